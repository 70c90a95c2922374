"""The generated man pages and shell completions: current with their
sources, rendering cleanly, and completing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from sdexec.config import ConfigError, build_config, load_config_quietly
from sdexec.sizes import (
    memory_size,
    parse_flux_percent,
    parse_flux_size,
    parse_permyriad,
)

REPO = Path(__file__).resolve().parent.parent


def _gen_docs():
    spec = importlib.util.spec_from_file_location(
        "gen_docs", REPO / "scripts" / "gen_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_current():
    assert _gen_docs().stale() == [], "run scripts/gen_docs.py"


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("man1/sdexec.1", ["sdexec [-h] [--version] [--socket PATH] COMMAND",
                           "EXIT STATUS", "sdexec.toml(5)"]),
        ("man5/sdexec.toml.5", ["kill-timeout", "containment-check", "log-format",
                                "Effective max-kill-timeout", "sdexec(1)"]),
    ],
)  # fmt: skip
def test_man_pages_render_without_warnings(page, expected):
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", str(REPO / "share" / "man" / page)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "GROFF_NO_SGR": "1"},
    )  # fmt: skip
    assert (rendered.returncode, rendered.stderr) == (0, "")
    text = subprocess.run(["col", "-b"], input=rendered.stdout, capture_output=True,
                          text=True, timeout=60).stdout  # fmt: skip
    for phrase in expected:
        assert phrase in text


def _bash_complete(*words: str) -> list[str]:
    script = (
        f"source {REPO}/share/bash-completion/completions/sdexec\n"
        'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; '
        "COMP_POINT=${#COMP_LINE}\n"
        '_shtab_sdexec sdexec "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", script, "bash", *words],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_bash_completes_commands_and_options():
    assert {"run", "ps", "kill", "cancel", "stats", "undrain"} <= set(
        _bash_complete("sdexec", "")
    )
    assert _bash_complete("sdexec", "un") == ["undrain"]
    assert "--noinput" in _bash_complete("sdexec", "run", "--")


def test_bash_offers_no_run_option_after_the_command_word():
    # They would go to the command: `sdexec run ls --dir` lists a "--dir".
    assert _bash_complete("sdexec", "run", "ls", "-") == []
    assert _bash_complete("sdexec", "run", "-n", "ls", "--d") == []
    assert "--label" in _bash_complete("sdexec", "run", "--dir", "/tmp", "--")


def test_zsh_completion_covers_every_command():
    text = (REPO / "share" / "zsh" / "site-functions" / "_sdexec").read_text()
    assert text.startswith("#compdef sdexec\n")
    commands = ("run", "ps", "kill", "cancel", "stats", "undrain", "wait", "attach")
    for command in commands:
        assert f"    {command}:'" in text  # the command list
        assert f"        {command}) _arguments" in text  # its options


def _config_examples() -> list[tuple[str, str, str]]:
    """Every TOML and YAML block of the documents: (where, suffix, text)."""
    examples = []
    for document in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        text = document.read_text(encoding="utf-8")
        for found in re.finditer(r"```(toml|yaml)\n(.*?)```", text, re.S):
            line = text.count("\n", 0, found.start()) + 1
            where = f"{document.name}:{line}"
            examples.append((where, found.group(1), found.group(2)))
    return examples


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        pytest.param(suffix, text, id=where)
        for where, suffix, text in _config_examples()
    ],
)
def test_the_documents_configuration_examples_are_taken(tmp_path, suffix, text):
    # containment.md's "Switching it on" set exec.service without the
    # [systemd] enable it requires: the service refused it, exit 78
    # (review session 41 A2).
    example = tmp_path / f"example.{suffix}"
    example.write_text(text, encoding="utf-8")
    load_config_quietly(example)


def _inline_settings() -> list[tuple[str, str]]:
    """Every setting the documents write inline as TOML
    (`` `kill-timeout = "5s"` ``): (where, the setting)."""
    settings = []
    for document in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        text = document.read_text(encoding="utf-8")
        for found in re.finditer(r"`([a-z][a-z-]+ = [^`\n]+)`", text):
            line = text.count("\n", 0, found.start()) + 1
            settings.append((f"{document.name}:{line}", found.group(1)))
    return settings


@pytest.mark.parametrize(
    "setting",
    [pytest.param(setting, id=where) for where, setting in _inline_settings()],
)
def test_the_documents_recommend_no_exec_value_flux_would_refuse(setting):
    # termination.md and design.md recommended sdexec-stop-timer-signal =
    # "SIGKILL", which sdexec warns Flux's job-exec refuses (review session
    # 43 R-1). Settings of other tables are not [exec]'s: refused, skipped.
    try:
        config = build_config(tomllib.loads(f"[exec]\n{setting}"), "docs")
    except ConfigError:
        return
    assert [w for w in config.warnings if "Flux's job-exec" in w] == []


def _section_titles(text: str) -> list[str]:
    """The headings of a document and the bold lead-ins of its paragraphs
    (``**A GPU beside its PCI device.**``), without their backticks."""
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    leads = re.findall(r"^\*\*(.+?)\.?\*\*", text, re.M)
    return [title.replace("`", "") for title in headings + leads]


def _section_references() -> list[tuple[str, Path, str]]:
    """Every reference of the documents to a section of one of them
    (``docs/protocol.md, "Framing"``): (where, the document, the section)."""
    documents = {path.name: path for path in [*(REPO / "docs").glob("*.md"),
                                              REPO / "README.md"]}  # fmt: skip
    references = []
    for name, path in sorted(documents.items()):
        text = path.read_text(encoding="utf-8")
        for found in re.finditer(r'\b([a-z]+\.md),?\s+"([^"]+)"', text):
            if found.group(1) in documents:
                line = text.count("\n", 0, found.start()) + 1
                target = documents[found.group(1)]
                references.append((f"{name}:{line}", target, found.group(2)))
    return references


@pytest.mark.parametrize(
    ("document", "section"),
    [
        pytest.param(document, section, id=where)
        for where, document, section in _section_references()
    ],
)
def test_a_section_the_documents_name_is_there(document, section):
    # client.md sent the reader to protocol.md's "Flow control", which is a
    # paragraph of its sdexec.write section (review session 45).
    titles = _section_titles(document.read_text(encoding="utf-8"))
    wanted = re.sub(r"\s+", " ", section).replace("`", "")
    assert any(title.startswith(wanted) for title in titles), (document.name, section)


#: A memory limit written as a setting: ``MemoryHigh = "400G"`` (TOML, commented
#: or not) or ``MemoryMax: "95%"`` (YAML).
_MEMORY_SETTING = re.compile(
    r"\b(Memory(?:Max|High|Low|Min|SwapMax))\s*[=:]\s*\"([^\"]*)\""
)


def _memory_settings() -> list[tuple[str, str, str]]:
    """Every memory limit the documents and the example configurations
    write as a setting: (where, the key, the value)."""
    settings = []
    examples = [REPO / "etc" / "sdexec.toml", REPO / "etc" / "sdexec.yaml"]
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", *examples]:
        text = path.read_text(encoding="utf-8")
        for found in _MEMORY_SETTING.finditer(text):
            line = text.count("\n", 0, found.start()) + 1
            settings.append((f"{path.name}:{line}", found.group(1), found.group(2)))
    return settings


@pytest.mark.parametrize(
    ("key", "value"),
    [pytest.param(key, value, id=where) for where, key, value in _memory_settings()],
)
def test_the_documents_memory_limits_are_spelled_as_flux_reads_them(key, value):
    # containment.md's example had MemoryHigh = "400g", "either case": a
    # spelling sdexec keeps but Flux's sdexec (parse_size: only "k" in lower
    # case) refuses, in a file a Flux broker may read too.
    flux = _read(value, parse_flux_percent, parse_flux_size)
    assert flux == _read(value, parse_permyriad, memory_size), key


def _read(value: str, percent: Callable[[str], int], size: Callable[[str], int]):
    """A memory limit as ``percent`` and ``size`` read its two forms."""
    if value == "infinity":
        return value
    return ("%", percent(value)) if value.endswith("%") else size(value)


def _pinned_numbers() -> list[tuple[str, str]]:
    """The numbers the admin-facing documents state, each as the phrase that
    states it, made from the constant the code uses: (document, phrase)."""
    from sdexec.closing import EXIT_FLUSH_SECONDS
    from sdexec.devicefence import CANARY_TIMEOUT_SECONDS
    from sdexec.fdlimit import FDS_PER_PROCESS, RESERVE
    from sdexec.lograte import BURST, MAX_QUOTED
    from sdexec.lookup import LOOKUP_TIMEOUT_S
    from sdexec.metrics import KEPT_ANSWERS
    from sdexec.notify import STATUS_REASON_MAX
    from sdexec.service import SHUTDOWN_GRACE_SECONDS
    from sdexec.stats import MAX_STATS_CONNECTIONS, STATS_SHARE, STATS_TIMEOUT
    from sdexec.systemd.unanswered import SILENT_AFTER_S

    grace = f"{SHUTDOWN_GRACE_SECONDS:g} s"
    return [
        ("operating.md", f"once {grace} pass without progress"),
        ("termination.md", f"after {grace} without progress"),
        ("operating.md", f"up to {EXIT_FLUSH_SECONDS:g} s more"),
        ("operating.md", f"cut at {STATUS_REASON_MAX} bytes"),
        ("operating.md", "(checked every second)"),
        ("operating.md", f"waited {SILENT_AFTER_S:g} s or more"),
        ("operating.md", f"at most {MAX_STATS_CONNECTIONS} connections at once"),
        ("operating.md", f"idle for {STATS_TIMEOUT} s"),
        ("operating.md", f"given again for {1 / STATS_SHARE:g} T (at most a second)"),
        ("operating.md", f"(the {KEPT_ANSWERS} newest kept)"),
        ("operating.md", f"fewer than {2 * FDS_PER_PROCESS + RESERVE} descriptors"),
        ("operating.md", f"at most {BURST} of a kind a minute"),
        ("operating.md", f"cut at {MAX_QUOTED} characters"),
        ("operating.md", f"did not finish in {LOOKUP_TIMEOUT_S:g} s"),
        ("containment.md", f"no verdict within {CANARY_TIMEOUT_SECONDS:g} s"),
        *_protocol_and_design_numbers(),
    ]


def _protocol_and_design_numbers() -> list[tuple[str, str]]:
    """The numbers protocol.md and design.md state of the stop, errors and
    lookups, as :func:`_pinned_numbers` gives them."""
    from sdexec.closing import EXIT_FLUSH_SECONDS
    from sdexec.lookup import _SHOWN_PATH, LOOKUP_TIMEOUT_S
    from sdexec.process import STOP_RECEIPT_WAIT
    from sdexec.refusal import MAX_ERRSTR
    from sdexec.service import SHUTDOWN_GRACE_SECONDS
    from sdexec.systemd.unit import EXEC_NEEDS_FILES

    lookup = f"{LOOKUP_TIMEOUT_S:g} s"
    receipt = f"{STOP_RECEIPT_WAIT:g} s"
    return [
        ("protocol.md", f"if systemd answers its read within {receipt}"),
        ("protocol.md", f"the service is stopping (waited {receipt})"),
        ("design.md", f"`STOP_RECEIPT_WAIT` ({receipt}, under the stop's"),
        ("protocol.md", f"The stop waits at most {EXIT_FLUSH_SECONDS:g} s for that"),
        ("design.md", f"written out, within {EXIT_FLUSH_SECONDS:g} s"),
        ("design.md", f"progresses at least every {SHUTDOWN_GRACE_SECONDS:g} s"),
        ("protocol.md", f"no `errstr` is over {MAX_ERRSTR} characters"),
        ("protocol.md", f"is below {EXEC_NEEDS_FILES} cannot be started"),
        ("protocol.md", f"its file system did not answer within {lookup}"),
        ("protocol.md", f"cut past {_SHOWN_PATH} characters"),
    ]


@pytest.mark.parametrize(("document", "phrase"), _pinned_numbers())
def test_the_documents_numbers_are_the_code_s(document, phrase):
    # operating.md's status line had no word of the cut at STATUS_REASON_MAX
    # bytes; a constant changed must change the sentence that states it.
    text = re.sub(r"\s+", " ", (REPO / "docs" / document).read_text(encoding="utf-8"))
    assert phrase in text


def test_the_documents_worded_numbers_are_the_code_s():
    # "a minute", "at most a second", "checked every second" (operating.md).
    from sdexec.lograte import WINDOW_S
    from sdexec.notify import STATUS_INTERVAL_SECONDS
    from sdexec.stats import MAX_REUSE_S

    assert (WINDOW_S, MAX_REUSE_S, STATUS_INTERVAL_SECONDS) == (60, 1, 1)


def _table_rows() -> list[tuple[str, str]]:
    """Every line of the documents that opens a Markdown table row: (where,
    the line)."""
    rows = []
    for document in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        lines = document.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if line.startswith("|"):
                rows.append((f"{document.name}:{number}", line))
    return rows


@pytest.mark.parametrize(
    "row", [pytest.param(row, id=where) for where, row in _table_rows()]
)
def test_the_documents_table_rows_end_with_their_cell(row):
    # protocol.md's errno table had sdexec.reload's EPERM, EAGAIN, EINVAL
    # and ECANCELED written after their rows' closing "|": outside the
    # table, where a renderer drops or misplaces them (review session 46).
    assert row.rstrip().endswith("|")


def test_client_md_names_every_attribute_of_a_receipt():
    # client.md listed Receipt's attributes without receipt_lost, which
    # says why a receipt holds no usage (review session 46).
    from sdexec.receipt import Receipt

    text = (REPO / "docs" / "client.md").read_text(encoding="utf-8")
    start = text.index("`sdexec.client.Receipt` with")
    listing = text[start : text.index("Malformed extension keys", start)]
    named = set(re.findall(r"`\.(\w+)(?:\(\))?`", listing))
    receipt = Receipt(status=0)
    public = {name for name in dir(receipt) if not name.startswith("_")}
    assert named == public - {"from_finished"}


def _quoted_messages() -> list[tuple[str, str]]:
    """Messages the documents quote whole, each made from the code that
    sends it: (document, the message)."""
    from sdexec import connection, server, service
    from sdexec.policy import _UPSTREAM_MULTIUSER
    from sdexec.protocolbase import MAX_MATCHTAG

    past = connection._PAST_MAX_MATCHTAG.format("N")
    neither = _UPSTREAM_MULTIUSER[: _UPSTREAM_MULTIUSER.index(" (only")]
    return [
        *[(doc, server._STOPPING) for doc in ("protocol.md", "design.md")],
        *[(doc, server._STOPPING_AWAY) for doc in ("protocol.md", "design.md")],
        ("protocol.md", service._STOPPING),
        ("protocol.md", past),
        ("protocol.md", f"integer from 1 to {MAX_MATCHTAG}"),
        ("client.md", f"from 1 again after {MAX_MATCHTAG}"),
        ("design.md", neither),
    ]


@pytest.mark.parametrize(("document", "message"), _quoted_messages())
def test_the_documents_quote_the_code_s_messages(document, message):
    # design.md gave the stop's ECANCELED only as sent with systemd there,
    # and protocol.md's reload errors were outside their table's rows
    # (review session 46): a message changed must change its quotation.
    text = re.sub(r"\s+", " ", (REPO / "docs" / document).read_text(encoding="utf-8"))
    assert message in text


def test_protocol_md_names_every_receipt_key_a_wait_answer_carries():
    # A wait's answer is finished's keys (background.py), but protocol.md
    # named only result, oom_kills, memory_max and usage: not terminated,
    # runtime_max_usec or receipt_lost, added since (review session 46).
    from sdexec.receipt import Receipt

    text = re.sub(r"\s+", " ", (REPO / "docs" / "protocol.md").read_text("utf-8"))
    start = text.index("where it carried them (", text.index("Beside the status"))
    named = set(re.findall(r"`(\w+)`", text[start : text.index(": [", start)]))
    assert named == set(Receipt.__slots__) - {"status"}


def test_protocol_md_names_every_drain_cause():
    # A resource manager automating undrains tells an unkillable job from
    # a fence from a device canary by `cause`: each it may meet is named.
    from sdexec.drain import CAUSES

    text = re.sub(r"\s+", " ", (REPO / "docs" / "protocol.md").read_text("utf-8"))
    start = text.index("no reason's text need be parsed:")
    named = set(
        re.findall(r"`([a-z-]+)`", text[start : text.index('`"device-fence"`', start)])
    )
    assert named == set(CAUSES)


def test_protocol_md_names_every_key_of_the_stats(server):
    # An admin scripting against GET /stats reads it by key: protocol.md
    # described requests, procs and mapper without their keys, and the
    # whole configuration in force ("config") not at all (review session 50).
    text = re.sub(r"\s+", " ", _section("protocol.md", "### `sdexec.stats-get`"))
    named = set(re.findall(r'`"([a-z-]+)"', text))
    assert set(server.stats()) <= named
    assert set(server.stats()["config"]) - set(server.config.introspect()) <= {
        "source",
        "exec",
        "sdexec",
        "systemd",
    }


def _section(document: str, heading: str) -> str:
    """A section of a document: from its heading to the next of its level."""
    text = (REPO / "docs" / document).read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    end = text.find(f"\n{level} ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_client_md_s_offline_test_runs_as_written(tmp_path):
    # Its recipe was a sentence: a reviewer who followed it read the unit's
    # name from manager.units at once (empty: the request was still on its
    # socket) and lost the connection, and a teardown without the units
    # ended hung on the Clock (review session 47). The example, run as a
    # user would run it, from a fresh file.
    section = _section("client.md", "## Testing a program offline")
    [example] = re.findall(r"```python\n(.*?)```", section, re.S)
    (tmp_path / "test_offline.py").write_text(example, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "twisted.trial", "test_offline"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED (successes=2)" in done.stdout


def test_client_md_names_every_public_name_of_sdexec_testing():
    # What a test drives is listed where the offline recipe is; the Manager
    # protocol's own members are the service's, not the test's.
    from sdexec import testing
    from sdexec.systemd.manager import Manager

    section = _section("client.md", "## Testing a program offline")
    prose = re.sub(r"```.*?```", "", section, flags=re.S)
    named = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]+)`", prose))))
    protocol = set(Manager.__annotations__) | set(vars(Manager))
    fake = {name for name in dir(testing.FakeManager()) if not name.startswith("_")}
    assert (set(testing.__all__) | (fake - protocol)) - named == set()
