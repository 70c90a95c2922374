"""How a file's keys and values are written: keys with dots, the forms Flux's
job-exec takes for the keys it reads too, YAML read as TOML would be, and
what the stats report (review session 43 G2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sdexec.config import ConfigError, load_config

EX_CONFIG = os.EX_CONFIG  # 78: the units do not restart the service


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refusal(tmp_path: Path, name: str, text: str) -> str:
    """Why the file ``name`` of ``text`` is refused, without the file's path."""
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    return str(error.value).removeprefix(f"{path}: ")


# --- G2-1: a key with dots at the top level ---------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "exec.kill-timeout: 30s\n",
            "exec.kill-timeout: a dotted key is not nested in YAML: write"
            ' "kill-timeout:" indented under "exec:"',
        ),
        (
            "sdexec.allow-users: [0]\n",
            "sdexec.allow-users: a dotted key is not nested in YAML: write"
            ' "allow-users:" indented under "sdexec:"',
        ),
        (
            "Systemd.enable: true\n",
            "Systemd.enable: a dotted key is not nested in YAML: write"
            ' "enable:" indented under "systemd:"',
        ),
        (
            "exec.testexec.allow-guests: true\n",
            "exec.testexec.allow-guests: a dotted key is not nested in YAML:"
            ' write "allow-guests:" indented under "testexec:", under "exec:"',
        ),
    ],
)
def test_a_dotted_yaml_key_is_refused_with_the_nested_form(tmp_path, text, expected):
    # It was one top-level key, ignored as an unknown table with a warning:
    # the defaults stayed in force and the file was called valid.
    assert refusal(tmp_path, "c.yaml", text) == expected


def test_a_quoted_dotted_toml_key_is_refused_with_the_nested_form(tmp_path):
    text = '"exec.max-kill-timeout" = "30m"\n'
    assert refusal(tmp_path, "c.toml", text) == (
        '"exec.max-kill-timeout": a quoted dotted key is one key, not nested:'
        " write max-kill-timeout in [exec], or the key unquoted"
    )


def test_a_dotted_key_of_a_table_not_ours_is_still_ignored(tmp_path):
    path = write(tmp_path, "c.yaml", "resource.noverify: true\n")
    assert load_config(path).warnings == (
        f"{path}: ignoring unknown table [resource.noverify]",
    )


def test_the_service_refuses_to_start_on_a_dotted_key(tmp_path, capsys):
    from twisted.plugins.sdexec_plugin import Options, SdexecServiceMaker

    config = write(tmp_path, "sdexec.yaml", "exec.kill-timeout: 30s\n")
    options = Options()
    options.parseOptions(["--config", str(config)])
    with pytest.raises(SystemExit) as exited:
        SdexecServiceMaker().makeService(options)
    assert exited.value.code == EX_CONFIG
    assert "exec.kill-timeout: a dotted key is not nested" in capsys.readouterr().err
