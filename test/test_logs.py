"""Logs for the journal (``<N>`` priority prefixes when stdout is the
journal stream) and for log shippers (``log-format = "json"``)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from test_twistd import (
    CONFIG,
    TWISTD,
    _environment,
    _wait_for,
    _wait_for_text,
    reaped,
    terminate,
)
from twisted.logger import Logger, LogPublisher, eventsFromJSONLogFile
from twisted.python.failure import Failure

from sdexec.logs import journal_observer, log_observer, stream_is_journal


def _journal_stream_of(path: Path) -> str:
    status = os.stat(path)
    return f"{status.st_dev}:{status.st_ino}"


def test_stream_is_journal_compares_device_and_inode(tmp_path):
    journal, other = tmp_path / "journal", tmp_path / "other"
    with journal.open("w") as stream, other.open("w") as elsewhere:
        environ = {"JOURNAL_STREAM": _journal_stream_of(journal)}
        assert stream_is_journal(stream, environ)
        assert not stream_is_journal(elsewhere, environ)
        assert not stream_is_journal(stream, {})
        assert not stream_is_journal(stream, {"JOURNAL_STREAM": "garbage"})
        assert not stream_is_journal(io.StringIO(), environ)  # no fd at all


def test_each_line_carries_the_events_priority():
    output = io.StringIO()
    publisher = LogPublisher(journal_observer(output))
    log = Logger(namespace="sdexec.server", observer=publisher)
    log.error("draining: {reason}", reason="fence failed on sdexec-x.service")
    log.warn("stop timer: sdexec-y.service")
    log.info("undrained")
    log.debug("detail")
    try:
        raise ValueError("boom")
    except ValueError:
        log.failure("unit sdexec-z.service failed", Failure())
    lines = output.getvalue().splitlines()
    assert lines[:4] == [
        "<3>[sdexec.server] draining: fence failed on sdexec-x.service",
        "<4>[sdexec.server] stop timer: sdexec-y.service",
        "<6>[sdexec.server] undrained",
        "<7>[sdexec.server] detail",
    ]
    # a failure and its traceback: every line is an error for the journal
    assert lines[4] == "<2>[sdexec.server] unit sdexec-z.service failed"
    assert len(lines) > 6 and all(line.startswith("<2>") for line in lines[4:])
    assert lines[-1] == "<2>[sdexec.server] builtins.ValueError: boom"


def test_text_outside_the_journal_is_twistds_own(tmp_path):
    with (tmp_path / "log").open("w") as stream:
        assert log_observer("text", stream, {}) is None


def _run_twistd(
    tmp_path: Path, extra_config: str, environ: Callable, logfile: Path | None = None
) -> str:
    """Start twistd with stdout on a file (and ``--logfile``, if given), run
    a refused reload (an error) and stop it; its output."""
    config = tmp_path / "sdexec.toml"
    socket = tmp_path / "sdexec.sock"
    text = CONFIG.format(socket=socket, kill_timeout="5s")
    config.write_text(text + extra_config)
    output = tmp_path / "stdout"
    with output.open("wb") as stdout:
        environment = {**_environment(tmp_path), **environ(output)}
        service = subprocess.Popen(
            [*TWISTD, "--nodaemon", "--pidfile=",
             *([f"--logfile={logfile}"] if logfile else []),
             "sdexec", "--config", str(config)],
            cwd=tmp_path, env=environment, stdout=stdout, stderr=subprocess.STDOUT,
        )  # fmt: skip
    with reaped(service):
        _wait_for(socket.exists, "the service's socket", log=output)
        config.write_text('[exec]\nkill-timeout = "5x"\n')
        service.send_signal(signal.SIGHUP)
        _wait_for_text(logfile or output, b"reload refused")
        assert terminate(service) == -signal.SIGTERM
    return output.read_text()


@pytest.mark.systemd
def test_twistd_on_the_journal_prefixes_priorities(user_manager, tmp_path):
    lines = _run_twistd(
        tmp_path, "", lambda stdout: {"JOURNAL_STREAM": _journal_stream_of(stdout)}
    ).splitlines()
    assert all(line.startswith(("<3>", "<4>", "<6>")) for line in lines), lines
    assert any(line.startswith("<6>[sdexec.service] sdexec listening on")
               for line in lines)  # fmt: skip
    refused = [line for line in lines if "reload refused" in line]
    assert refused and refused[0].startswith("<3>[sdexec.service] reload refused")
    # Twisted's "Starting factory <...Factory object at 0x7f...>" names a
    # Python object, nothing an admin can use.
    assert not [line for line in lines if " object at 0x" in line]


@pytest.mark.systemd
def test_twistd_json_log_format(user_manager, tmp_path):
    # CONFIG ends in its [sdexec] table: the key goes there
    text = _run_twistd(tmp_path, 'log-format = "json"\n', lambda _: {})
    events = list(eventsFromJSONLogFile(io.StringIO(text)))
    namespaces = {event.get("log_namespace") for event in events}
    assert "sdexec.service" in namespaces
    refused = [e for e in events if "reload refused" in e.get("log_format", "")]
    assert refused and refused[0]["log_level"].name == "error"


@pytest.mark.systemd
def test_a_log_file_twistd_is_given_gets_the_log_as_text(user_manager, tmp_path):
    """log-format is for standard output: it must not take the place of
    --logfile (a daemon's standard output goes nowhere)."""
    logfile = tmp_path / "twistd.log"
    stdout = _run_twistd(tmp_path, 'log-format = "json"\n', lambda _: {}, logfile)
    text = logfile.read_text()
    assert "[sdexec.service#info] sdexec listening on" in text
    assert "sdexec.log-format = 'json' applies to standard output" in text
    assert "\x1e" not in text + stdout  # no JSON record anywhere


@pytest.mark.parametrize(
    ("twistd", "to_stdout"),
    [
        ({"nodaemon": True, "logfile": None}, True),
        ({"nodaemon": True, "logfile": "-"}, True),
        ({"nodaemon": True, "logfile": "/var/log/sdexec.log"}, False),
        ({"nodaemon": True, "logfile": None, "syslog": True}, False),
        ({"nodaemon": False, "logfile": None}, False),  # twistd.log
    ],
)
def test_log_format_applies_only_where_twistd_logs_to_stdout(twistd, to_stdout):
    from twisted.plugins.sdexec_plugin import Options, _twistd_logs_to_stdout

    options = Options()
    options.parent = twistd
    assert _twistd_logs_to_stdout(options) is to_stdout
