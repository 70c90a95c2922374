"""How a file's keys and values are written: keys with dots, the forms Flux's
job-exec takes for the keys it reads too, YAML read as TOML would be, and
what the stats report (review session 43 G2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sdexec.config import ConfigError, load_config, parse_config
from sdexec.fluxforms import FLUX_SIGNAL_NAMES, flux_refusals

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


# --- G2-2: values Flux's job-exec would refuse -----------------------------

REFUSED = "Flux's job-exec would refuse the file"
IF_SHARED = "if Flux reads this file too"


@pytest.mark.parametrize(
    ("key", "value", "why", "written"),
    [
        ("kill-timeout", 5, "it reads this key as a string only", '"5s"'),
        ("max-kill-timeout", 1800, "it reads this key as a string only", '"30m"'),
        ("barrier-timeout", 0, "it reads this key as a string only", '"0s"'),
        ("shell-exit-timeout", 30, "it reads this key as a string only", '"30s"'),
        ("term-signal", 15, "it reads this key as a string only", '"SIGTERM"'),
        ("term-signal", "term", "it knows a signal only by a name", '"SIGTERM"'),
        ("kill-signal", "SIGIOT", "it knows a signal only by a name", '"SIGABRT"'),
        ("kill-signal", "SIGRTMIN+2", "it knows a signal only by a name", None),
        (
            "sdexec-stop-timer-signal",
            "SIGKILL",
            "it reads this key as an integer only",
            "9",
        ),
        (
            "sdexec-stop-timer-signal",
            "10",
            "it reads this key as an integer only",
            "10",
        ),
    ],
)
def test_a_value_flux_would_refuse_is_warned_about(key, value, why, written):
    config = parse_config({"exec": {key: value}}, "exec.toml")
    (warning,) = config.warnings
    assert warning.startswith(f"exec.toml: exec.{key}: ")
    assert f": {REFUSED}: {why}" in warning
    assert warning.endswith(f"{IF_SHARED}")
    if written is not None:
        assert f"; write {written} {IF_SHARED}" in warning
    assert "\n" not in warning


def test_a_realtime_signal_is_advised_by_its_number():
    (warning,) = parse_config({"exec": {"kill-signal": "SIGRTMIN+2"}}).warnings
    number = parse_config({"exec": {"kill-signal": "SIGRTMIN+2"}}).exec.kill_signal
    assert f'write "{number}" {IF_SHARED}' in warning


@pytest.mark.parametrize(
    "table",
    [
        {"kill-timeout": "5s", "max-kill-timeout": "30m", "barrier-timeout": "0"},
        {"shell-exit-timeout": "none", "term-signal": "SIGTERM"},
        {"term-signal": "TERM", "kill-signal": "9", "sdexec-stop-timer-signal": 9},
        {"kill-signal": " 9", "max-kill-count": 4, "max-start-delay-percent": 25},
    ],
)
def test_the_forms_flux_takes_are_not_warned_about(table):
    assert parse_config({"exec": table}, "exec.toml").warnings == ()


def test_a_yaml_file_is_not_warned_about(tmp_path):
    # Flux reads TOML only: a YAML file is sdexec's alone.
    path = write(tmp_path, "c.yaml", "exec:\n  kill-timeout: 5\n  term-signal: 15\n")
    assert load_config(path).warnings == ()


def test_flux_signal_names_are_this_systems_signals():
    import signal

    assert FLUX_SIGNAL_NAMES.issubset(signal.Signals.__members__)


def test_flux_refusals_reads_only_the_keys_flux_reads():
    assert flux_refusals({"max-kill-count": 4, "testexec": {}}, "c.toml") == ()
