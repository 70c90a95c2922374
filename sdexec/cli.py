"""The ``sdexec`` command: run processes through the sdexec service, list
them, signal them, show the service's statistics (docs/client.md).

Every failure is one line on stderr, ``sdexec: ...``, never a traceback.

It talks to the service with the synchronous :mod:`sdexec.syncclient`, not
Twisted: the command's time is mostly its own start-up, and Twisted (with
the OpenSSL it loads) would be most of that. Only ``stats --url`` loads
Twisted, for its HTTP client.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    import argparse
    import signal
    from typing import Any, NoReturn

    from twisted.internet.defer import Deferred

    from sdexec.earlyexec import EarlyExec
else:
    import _signal as signal  # the C core: signal's enums cost 2.5 ms

# Run as `python3 -m sdexec.cli`, a ^C during the imports below ends it
# quietly, as sdexec.console does for the console script; one the caller
# ignored (`&` in a script) stays ignored. (So the imports come after code:)
# ruff: noqa: E402
if (
    __name__ == "__main__"
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler
):
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import errno
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from sdexec import runrequest
from sdexec.cliio import (
    DISCARDED,
    EXEC_FAILURES,
    INTERRUPTING_SIGNALS,
    LOST,
    MALFORMED,
    READER_GONE,
    UNFINISHED,
    DeathBySignal,
    Output,
    close_outputs,
    connect,
    end_on_signals,
    exit_code,
    fail,
    flush_out,
    nonblocking_reader,
    open_closed_standard_fds,
    pid_of,
    print_out,
    request,
    say_end,
    say_held,
    say_killed,
    signalled_status,
    warn,
    write_output,
)
from sdexec.protocolbase import (
    UNIT_NAME_PREFIX,
    Topics,
    job_of_unit_name,
    terminate_not_found,
    terminate_runs_no_job,
)
from sdexec.receipt import Receipt
from sdexec.refusal import json_quoted, one_line
from sdexec.rpc import ConnectionFailed, RPCError, SdexecError, finished_receipt
from sdexec.runrequest import (
    COALESCED_SIGNALS,
    FORWARDED_SIGNALS,
    RUN_FLAGS,
    NotText,
    TerminalModes,
    hold_signal,
)
from sdexec.signals import signal_name
from sdexec.syncclient import ON_ITS_WAY_S, READABLE, Call, Connection, Exec, Loop

__all__ = [
    "build_command",
    "cancel_targets",
    "format_procs",
    "main",
    "run_and_exit",
]

#: ``undrain``'s exit status while a cause that lifts itself still drains
#: the service (2 is a usage error's).
STILL_DRAINED = 3
_READ_SIZE = 64 * 1024
#: How long a ``--no-passthrough`` process has to die of the SIGPIPE sent
#: when our reader went: output for that stream that comes later says it
#: ignores SIGPIPE (every Python program does), and `run` ends it, as
#: EPIPE would end it locally. What it wrote before the signal, still on
#: its way, takes milliseconds to come and be dropped.
_SIGPIPE_GRACE_S = ON_ITS_WAY_S


def main(argv: Sequence[str] | None = None, early: EarlyExec | None = None) -> int:
    """Run the ``sdexec`` command line ``argv`` (default ``sys.argv[1:]``);
    return the exit status. ``early``: the exec :mod:`sdexec.earlyexec`
    sent for this command line, which ``run`` takes over."""
    # Default dispositions until `run` catches them: a ^C while starting up
    # ends the client quietly (130) rather than with a KeyboardInterrupt.
    # Not one the caller ignores (nohup; `&` in a script): it stays ignored.
    # After an early exec its handlers keep them for `run` instead.
    if early is None:
        for signum in FORWARDED_SIGNALS:
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
    open_closed_standard_fds()
    try:
        status = _main(argv, early)
    finally:
        # Lines said while output waited, or at the end, not yet taken; a
        # signal that cut that wait short ends the command its way.
        ended_by = say_held()
    return status if ended_by is None else ended_by


def _main(argv: Sequence[str] | None, early: EarlyExec | None) -> int:
    """:func:`main`'s command: any failure one line, its exit status."""
    try:
        if early is None:
            from sdexec.cliargs import parse_args

            options = parse_args(argv)
            _check_target_text(options)
            status = _COMMANDS[options.command](options)
        else:  # a run's, its options read as the parser reads them
            status = _run(early.options, early)
        flush_out()
        return status
    except UnicodeEncodeError as error:
        # Text an option took from the command line, past what build_command
        # and _check_target_text name: the service takes UTF-8 only.
        shown = error.object[error.start : error.end].encode("utf-8", "surrogateescape")
        return fail(
            f"an argument is not UTF-8 text, which the service takes only: {shown!r}"
        )
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except SdexecError as failure:
        return fail(str(failure))
    except BrokenPipeError:
        # `sdexec stats | head -1`: the reader has all it wanted. Quiet, and
        # the status a shell gives a command SIGPIPE ended.
        return 128 + signal.SIGPIPE
    except Exception as failure:
        # A bug we did not foresee: still one line, never a traceback.
        return fail(f"unexpected error: {type(failure).__name__}: {failure}")


def run_and_exit(early: EarlyExec | None = None) -> NoReturn:
    """The ``sdexec`` command: :func:`main` (taking ``early`` over), then
    exit at once.

    The interpreter's finalization (tearing down every module) would cost
    the command about a sixth of its CPU time (docs/performance.md);
    nothing of ours needs it once our output is flushed and the socket is
    closed.
    """
    code = main(early=early)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass  # a reader that went away: nothing more can be said to it
    if isinstance(code, DeathBySignal):
        _die_of(code.signum)
    os._exit(code)


def _die_of(signum: int) -> None:
    """Die of ``signum`` (a ^C the user sent us, which ended the command),
    as a local command would: the shell that waits for us then stops its
    script too, where an exit with 128 + N tells it the ^C was handled.
    No core of our own for SIGQUIT: the one asked for was the process's."""
    if signum == signal.SIGQUIT:
        _dump_no_core()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)  # delivered before kill() returns


def _dump_no_core() -> None:
    """Leave no core when we die: not dumpable, the kernel dumps none.
    An RLIMIT_CORE of 0 would not do where the core_pattern is a pipe
    (systemd-coredump): the kernel dumps to it whatever the limit, and the
    shell says "Quit (core dumped)"."""
    import ctypes  # only here

    pr_set_dumpable = 4  # <linux/prctl.h>
    ctypes.CDLL(None).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _check_target_text(options: argparse.Namespace) -> None:
    """A ``kill``, ``wait``, ``attach`` or ``cancel`` target that is not
    UTF-8 text (which no request can carry) refused as ``run`` refuses
    such an argument, named, its bytes shown: it was "an argument is not
    UTF-8 text ...: b'\\xe9'", the one byte, naming no argument."""
    target = getattr(options, "target", None)
    text = target.get("label") if isinstance(target, dict) else target
    if text is not None and not runrequest.is_utf8(text):
        named = "PID|LABEL|JOBID" if options.command == "cancel" else "PID|LABEL"
        raise SdexecError(
            f"{options.command} {named} is not UTF-8 text, which the service"
            f" takes only: {os.fsencode(text)!r}"
        )


def build_command(
    options: argparse.Namespace, environ: Mapping[str, str], cwd: str
) -> dict[str, Any]:
    """The RFC 42 command object for ``sdexec run``
    (:func:`sdexec.runrequest.build_command`): a variable of ``environ``
    that is not UTF-8 is named on stderr and left out, any other field that
    is not is an :class:`SdexecError`."""
    try:
        return runrequest.build_command(options, environ, cwd, _not_passed)
    except NotText as error:
        raise SdexecError(str(error)) from None


def _not_passed(why: str) -> None:
    warn(f"not passing {why}")


# -- the commands --------------------------------------------------------------


def _run(options: argparse.Namespace, early: EarlyExec | None = None) -> int:
    """``sdexec run``; with ``early``, the exec :mod:`sdexec.earlyexec`
    sent for these options is taken over instead of sent."""
    command = _run_command(options) if early is None else early.command
    if options.bg:
        from sdexec.cli_background import run_background  # only when used

        return run_background(options, command)
    with Loop() as loop, early or _Stdio(options) as stdio:
        terminal = early.terminal if early else TerminalModes(stdio)
        job = _Job(
            loop,
            options.noinput,
            stdio,
            lambda: connect(loop, options, while_waiting=True),
            options.usage,
        )
        # Caught before connecting: a signal that arrives while we start up
        # is held until the process has started, or interrupts it; so is
        # one an early exec caught while we loaded. SIGCONT is not
        # forwarded: it tells a stdin held after a stop that we go on.
        loop.catch_signals(
            (*FORWARDED_SIGNALS, signal.SIGCONT),
            job.caught,
            early.caught if early else (),
        )
        try:
            with _connection(loop, options, early) as connection:
                job.start(connection, command, early.matchtag if early else None)
                loop.run_until(job.ended)
        except SdexecError:
            # A signal that cut the connect short (an unconnected socket
            # for the first write) is what to report, not the write.
            loop.serve_caught_signals()
            if job.interrupted is None:
                raise
        finally:
            close_outputs(job.outputs)
            job.close_stdin_reader()
        loop.serve_caught_signals()  # one the loop had no turn to serve
        end_on_signals()  # a ^C from now on ends a wait for our stderr
    terminal.restore_after(job.process_status())
    return job.exit_code()


def _run_command(options: argparse.Namespace) -> dict[str, Any]:
    try:
        base = runrequest.base_directory(options)
    except OSError as failure:
        why = failure.strerror
        raise SdexecError(f"cannot get the current directory: {why}") from None
    return build_command(options, os.environ, base)


def _connection(
    loop: Loop, options: argparse.Namespace, early: EarlyExec | None
) -> Connection:
    """The connection ``run`` uses: the early exec's, or a new one."""
    if early is None:
        return connect(loop, options)
    return Connection(loop, early.path, early.socket)


def _wait(options: argparse.Namespace) -> int:
    from sdexec.cli_background import wait

    return wait(options)


def _attach(options: argparse.Namespace) -> int:
    from sdexec.cli_background import attach

    return attach(options)


class _Stdio:
    """The descriptors `run` passes to the process (none with
    ``--no-passthrough``): our own, or /dev/null for stdin with ``-n``,
    opened on entry and closed on exit. (A class: contextlib's
    ``contextmanager`` would be the start-up's one use of contextlib.)"""

    def __init__(self, options: argparse.Namespace) -> None:
        self._options = options
        self._devnull: int | None = None

    def __enter__(self) -> dict[str, int]:
        if not self._options.passthrough:
            return {}
        if not self._options.noinput:
            # A terminal too, as systemd-run --pipe passes it: relayed, it
            # was read ahead of the process (type-ahead lost, a password
            # echoed, no prompt from python3; review session 43 R2-2).
            return {"stdin": 0, "stdout": 1, "stderr": 2}
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return {"stdin": self._devnull, "stdout": 1, "stderr": 2}

    def __exit__(self, *_exc_info: object) -> None:
        if self._devnull is not None:
            os.close(self._devnull)
            self._devnull = None


def _ps(options: argparse.Namespace) -> int:
    listing = request(options, Topics.LIST, {"detail": True})  # (checked)
    print_out(format_procs(listing["procs"]))
    return 0


def _kill(options: argparse.Namespace) -> int:
    # "who" always: a service older than the main-process default would
    # take its absence for every process.
    who = "all" if options.all else "main"
    request(
        options, Topics.KILL, {**options.target, "signum": options.signum, "who": who}
    )
    return 0


def cancel_targets(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two ``sdexec.terminate`` targets ``PID|LABEL|JOBID`` may name,
    in the order tried: all digits is a pid, else a (numeric) job id;
    anything else a job id, else a label. A number larger than any pid
    (:data:`~sdexec.cliio.MAX_PID`; a decimal Flux job id) is a job id, else
    a label."""
    pid = pid_of(text)
    if pid is not None:
        return {"pid": pid}, {"jobid": text}
    return {"jobid": text}, {"label": text}


def _cancel(options: argparse.Namespace) -> int:
    targets = cancel_targets(options.target)
    procs = request(options, Topics.LIST, {"detail": True})["procs"]
    target = _listed_job(procs, targets)
    if target is not None:
        reply = _terminate(options, target)
    else:  # not listed: an exited job's unit still stopping, or nothing
        _refuse_listed_non_job(procs, options.target, targets)
        reply = _terminate_either(options, *targets)
    print_out(f"job {reply.get('id')}: terminating (step {reply.get('step')})")
    return 0


def _listed_job(
    procs: list[dict[str, Any]], targets: Sequence[dict[str, Any]]
) -> dict[str, Any] | None:
    """The first of ``targets`` that names a job in ``procs`` (an
    ``sdexec.list`` with detail), else ``None``: looked up first so that a
    cancel sends one terminate (trying each target in turn counted a
    refused request and a terminate error at every ordinary ``sdexec
    cancel JOBID``)."""
    for target in targets:
        ((key, value),) = target.items()
        if any("jobid" in proc and proc.get(key) == value for proc in procs):
            return target
    return None


def _refuse_listed_non_job(
    procs: list[dict[str, Any]], text: str, targets: Sequence[dict[str, Any]]
) -> None:
    """:class:`SdexecError` saying why a process that ``targets`` name by
    pid or label, listed in ``procs`` running no job, cannot be
    cancelled: it has ended (``Z``, kept for a wait: its exit status is
    ``sdexec wait``'s to collect), or it was run without ``--jobid``.
    Said from the listing, not from the service's refusals: of an ended
    process those were "terminate label=L not found", which ``ps``
    belied."""
    for target in targets:
        ((key, value),) = target.items()
        for proc in procs:
            if key == "jobid" or proc.get(key) != value:
                continue
            pid = proc.get("pid")
            if proc.get("state") == "Z":
                raise SdexecError(
                    f"cancel {text}: pid {pid} has ended, nothing is left to"
                    f" terminate{_who_collects(proc, text)}"
                )
            if proc.get("state") == "O":
                # Not "run without --jobid": a leftover's job, if it ran
                # one, went with the run of the service that started it.
                raise SdexecError(
                    f"cancel {text}: pid {pid} is the main process of leftover"
                    f" unit {proc.get('unit')} (state O), which no request of"
                    " this run follows: it runs no job here; sdexec kill"
                    " signals it"
                )
            raise SdexecError(
                f"cancel {text}: pid {pid} runs no job (it was run without"
                f" --jobid): sdexec kill signals it"
            )


def _who_collects(proc: dict[str, Any], text: str) -> str:
    """Where the exit status of ``proc``, listed ended (``Z``) and named
    ``text``, goes. A streaming one's went to the run that started it; a
    wait collects another's only if it was started waitable, which the
    listing does not say (one finished, its unit still stopping, may not
    be: "sdexec wait" would say "process is not waitable")."""
    if proc.get("mode") == "streaming":
        return " (its exit status goes to the run that started it)"
    import shlex  # here: only this answer needs it

    return (
        f"; sdexec wait {shlex.quote(text)} collects its exit status if it was"
        " started waitable"
    )


def _terminate_either(
    options: argparse.Namespace, first: dict[str, Any], second: dict[str, Any]
) -> dict:
    """Terminate ``first``, else (if it names nothing) ``second``."""
    try:
        reply = _terminate(options, first)
    except RPCError as failure:
        if not _names_nothing(failure, first):
            raise  # found: "job J has already exited" says more than a retry
        try:
            reply = _terminate(options, second)
        except RPCError as again:
            if not _names_nothing(again, second):
                raise
            raise RPCError(errno.ESRCH, f"{failure}; {again}") from None
    return reply


def _names_nothing(failure: RPCError, target: dict[str, Any]) -> bool:
    """Whether ``failure`` says that ``target`` names no job: nothing by
    that name, or a process that runs none (pid N of a plain run, beside a
    job whose id is N)."""
    # Read from the text, not the errno alone: ESRCH is also a job or
    # process found ended ("job J has already exited", "...: the process has
    # ended and is kept for a wait"), which must be said, not retried as the
    # other target. It stays ESRCH, as kill's same answers (RFC 42) and as
    # cancel of other versions compares it, and an error response carries
    # only errnum and errstr (RFC 6); the listing decides every target it
    # shows, so this is reached only for one it did not (started since, or
    # none).
    # Not found with why after it (a label while leftovers of an earlier
    # run are listed: labels do not outlive a run) names nothing either.
    ((key, value),) = target.items()
    not_found = terminate_not_found(key, value)
    return (failure.errnum, failure.errstr) in (
        (errno.ESRCH, not_found),
        (errno.EINVAL, terminate_runs_no_job(key, value)),
    ) or (failure.errnum == errno.ESRCH and failure.errstr.startswith(f"{not_found};"))


def _terminate(options: argparse.Namespace, target: dict[str, Any]) -> dict:
    return request(options, Topics.TERMINATE, {**target, "reason": "cancel"})


def _stats(options: argparse.Namespace) -> int:
    if options.url:
        report = _http_stats(options.url)
    else:
        report = request(options, Topics.STATS, {})
    import json  # only here: run must not load it (docs/performance.md)

    print_out(json.dumps(report, indent=2))
    return 0


#: How long ``stats --url`` waits for the endpoint's answer.
_HTTP_TIMEOUT_S = 30

#: What ``stats --url`` wants, shown where a URL is not one.
_EXAMPLE_STATS_URL = "http://127.0.0.1:8490/stats"


def _http_stats(url: str) -> dict:
    """``GET url`` (the service's stats endpoint), with Twisted's Agent:
    the only part of the command that loads Twisted. Not with treq's
    requests: hyperlink, which they parse every URL with, refuses an IPv6
    literal's host (python-hyper/hyperlink#68), and the service writes its
    endpoint's address that way (``[::1]:8490``)."""
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    result: dict[str, Any] = {}

    async def get() -> None:
        try:
            result["report"] = await _within_timeout(
                ensureDeferred(_get_json(url, reactor)), reactor
            )
        except Exception as error:  # refused, timed out, not JSON: one line
            result["error"] = f"cannot read {url}: {_http_failure(error)}"

    def start() -> None:
        # Once running: a request that fails at once (a URL without a
        # scheme) would stop a reactor not yet running, and hang the next.
        ensureDeferred(get()).addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(start)
    # Not twisted's react(): its SIGTERM handler ended the command with a
    # lost connection's words; it dies of its signals, as any command does.
    reactor.run(installSignalHandlers=False)  # type: ignore[call-arg]
    if "error" in result:
        raise SdexecError(result["error"])
    return result["report"]


class _HTTPStatus(Exception):
    """An answer other than 200: its status, said as ``HTTP 404``."""


async def _get_json(url: str, reactor: Any) -> Any:
    """The JSON document at ``url`` (a new connection, closed after)."""
    from treq import content
    from twisted.web.client import Agent

    response = await Agent(reactor).request(b"GET", url.encode())
    if response.code != 200:
        raise _HTTPStatus(f"HTTP {response.code}")
    return _json_document(await content(response))


class _NotStats(Exception):
    """An answer that holds no JSON document, said in words."""


def _json_document(body: bytes) -> Any:
    """The JSON document ``body`` holds, else :class:`_NotStats` saying
    what the answer was not: treq's ``json_content`` let the codec's and
    the parser's own words through ("'utf-8' codec can't decode byte
    0xff in position 7"), naming neither the answer nor JSON."""
    import json

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _NotStats(
            f"the answer is not UTF-8 text, so not JSON: byte"
            f" {body[error.start]:#04x} at offset {error.start}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        what = "empty" if not text.strip() else str(error)
        raise _NotStats(f"the answer is not JSON: {what}") from None


def _within_timeout(waiting: Deferred[Any], clock: Any) -> Deferred[Any]:
    """``waiting``, cancelled after :data:`_HTTP_TIMEOUT_S` seconds (by
    ``clock``) and failed then with words saying so."""

    def timed_out(_result: object, timeout: float) -> NoReturn:
        raise TimeoutError(f"no answer within {timeout:g} s")

    return waiting.addTimeout(_HTTP_TIMEOUT_S, clock, onTimeoutCancel=timed_out)


def _http_failure(error: Exception) -> str:
    """What went wrong, in words: the Agent's ``ResponseNeverReceived`` and
    its kin hold a list of Twisted failures, which ``str()`` shows as
    reprs."""
    from twisted.internet.error import ConnectionClosed
    from twisted.web.error import SchemeNotSupported

    if isinstance(error, SchemeNotSupported):
        # The Agent's own words, "Unsupported scheme: b''", for the
        # scheme-less "127.0.0.1:8490/stats" an admin types first.
        return f"not an http:// URL, such as {_EXAMPLE_STATS_URL}"
    reasons = getattr(error, "reasons", None)
    if not reasons:
        return str(error) or type(error).__name__
    if reasons[0].check(ConnectionClosed):
        return "the server closed the connection without answering"
    tls = _tls_failure(reasons[0].value)
    if tls is not None:
        return tls
    return reasons[0].getErrorMessage() or reasons[0].type.__name__


def _tls_failure(error: BaseException) -> str | None:
    """An https:// URL's TLS failure in words, else ``None``: pyOpenSSL's
    error holds OpenSSL's (library, function, reason) triples, which
    ``str()`` showed as a list's repr (``[('SSL routines', '', 'wrong
    version number')]``, from a plain HTTP endpoint)."""
    try:
        from OpenSSL.SSL import Error  # loaded already, where TLS was tried
    except ImportError:  # no pyOpenSSL: no TLS failure of its
        return None
    if not isinstance(error, Error):
        return None
    entries = error.args[0] if error.args and isinstance(error.args[0], list) else []
    reasons = [
        str(entry[-1]) for entry in entries if isinstance(entry, tuple) and entry
    ]
    said = "; ".join(reason for reason in reasons if reason) or "no reason given"
    return f"TLS failed: {said} (is the endpoint served over TLS, as https:// asks?)"


def _undrain(options: argparse.Namespace) -> int:
    reply = request(options, Topics.UNDRAIN, {})
    cleared = _drain_causes(reply, "cleared", "reason")
    remaining = _drain_causes(reply, "remaining", "still")
    if len(cleared) == 1:
        print_out(f"undrained; the drain reason was: {cleared[0]}")
    elif cleared:
        print_out("undrained; the drain reasons were:", *cleared, sep="\n  ")
    for cause in remaining:
        # What lifts itself (once over, or once mended: each reason says
        # how): no undrain clears it.
        print_out(f"still drained, no undrain clears it: {cause}")
    if not cleared and not remaining:
        print_out("not drained")
    # A script's `sdexec undrain && …` must not go on as if it could run.
    return STILL_DRAINED if remaining else 0


def _reload(options: argparse.Namespace) -> int:
    """``sdexec.reload``: the service's configuration file read again (the
    units' ``ExecReload=``). A refusal is the service's reason on stderr,
    and exit status 1, which ``systemctl reload`` reports; the file's own
    warnings, and a setting read only at start that the file changed, are
    warnings on stderr."""
    try:
        reply = request(options, Topics.RELOAD, {})
    except RPCError as failure:
        if failure.errnum != errno.ENOSYS:
            raise
        raise RPCError(
            failure.errnum,
            f"{failure.errstr}: this service has no reload request (an sdexec"
            " older than this command, or not sdexec): send it SIGHUP",
        ) from None
    print_out(f"configuration reloaded from {one_line(str(reply.get('config')))}")
    for said in reply.get("warnings") or ():
        warn(f"warning: {one_line(str(said))}")  # as python3 -m sdexec.config
    for setting in reply.get("needs-restart") or ():
        warn(f"warning: {setting}")  # (its old value in force: taken all the same)
    return 0


def _drain_causes(reply: dict, each: str, joined: str) -> list[str]:
    """An undrain reply's causes under ``each`` (a list), else under
    ``joined`` (one string: a service from before the lists), printable."""
    causes = reply.get(each)
    if not isinstance(causes, list):
        causes = [reply[joined]] if reply.get(joined) else []
    return [one_line(str(cause)) for cause in causes]


#: Each command's function: the parsed options in, the exit status out.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run,
    "ps": _ps,
    "kill": _kill,
    "cancel": _cancel,
    "stats": _stats,
    "undrain": _undrain,
    "reload": _reload,
    "wait": _wait,
    "attach": _attach,
}


def format_procs(procs: Sequence[dict[str, Any]]) -> str:
    """``sdexec.list`` processes as a table: PID, STATE, MODE, UNIT, LABEL,
    JOBID, STEP (of its termination), CMDLINE."""
    import shlex  # here: only ps needs it

    rows: list[tuple[str, ...]] = [
        ("PID", "STATE", "MODE", "UNIT", "LABEL", "JOBID", "STEP", "CMDLINE")
    ]
    for proc in procs:
        cmdline = _cmdline_cell(proc.get("cmdline"), shlex.join)
        cells = (
            proc.get("pid", ""),
            proc.get("state", ""),
            proc.get("mode") or "-",
            proc.get("unit", ""),
            proc.get("label") or "-",
            _jobid_cell(proc),
            proc.get("step") or "-",
            cmdline,
        )
        rows.append(tuple(one_line(str(cell)) for cell in cells))
    widths = [max(len(row[column]) for row in rows) for column in range(7)]
    lines = (
        "  ".join(
            [
                *(cell.ljust(width) for cell, width in zip(row, widths, strict=False)),
                row[7],
            ]
        )
        for row in rows
    )
    return "\n".join(lines)


#: The JOBID of a job whose id is its unit's name (``SDEXEC_TIME_LIMIT``
#: alone): the UNIT column shows it, whole, once.
_JOBID_IS_UNIT = "(unit)"


def _jobid_cell(proc: dict[str, Any]) -> str:
    """A listed process's JOBID for ``ps``: its job's id; :data:`_JOBID_IS_UNIT`
    where that is its unit's name; for a leftover (no job of this run: its
    job went with the run that started it), the job id its unit's name
    carries, which ``sdexec cancel`` knows it by; else "-"."""
    jobid, unit = proc.get("jobid"), proc.get("unit")
    if jobid:
        return _JOBID_IS_UNIT if jobid == unit else str(jobid)
    if proc.get("state") == "O" and isinstance(unit, str):
        return job_of_unit_name(unit) or "-"
    return "-"


def _cmdline_cell(cmdline: Any, join: Callable[[Iterable[str]], str]) -> str:
    """A listed process's ``cmdline`` for ``ps``: its arguments joined as a
    shell quotes them; "?" for none yet (a leftover unit's until its unit
    is read: a glob, quoted as any argument would be, so no command shows
    as this); anything else a broken service sent, quoted (a number was
    "unexpected error: TypeError")."""
    if isinstance(cmdline, list):
        return join(str(arg) for arg in cmdline) or "?"
    return "?" if cmdline is None else json_quoted(cmdline, 200)


def _nothing() -> None:
    pass


# -- the pieces of `sdexec run` -------------------------------------------------


class _Job:
    """What `sdexec run` does with its process: output to our own stdout and
    stderr, our stdin to its (within the credit), our signals to it, its
    wait status kept for the exit code. ``reconnect()``: a new connection
    for a kill sent while an output write waits, read while it does
    (:meth:`_kill_aside`)."""

    def __init__(
        self,
        loop: Loop,
        noinput: bool,
        stdio: Mapping[str, int],
        reconnect: Callable[[], Connection],
        usage: bool = False,
    ) -> None:
        self._loop = loop
        self._reconnect = reconnect
        self._noinput = noinput
        self._passed = dict(stdio)
        self._usage = usage
        self.outputs = {"stdout": Output(1, loop), "stderr": Output(2, loop)}
        self._connection: Connection | None = None
        self._stream: Exec | None = None
        #: Signals for the process before it has started, each once.
        self._held_signals: list[int] = []
        self._stdin_open = not noinput and "stdin" not in stdio
        #: Our stdin is open for writing only (see :func:`_write_only`).
        self._stdin_write_only = self._stdin_open and _write_only(0)
        #: The descriptor our stdin is read from, chosen at the first read.
        self._stdin_reader: int | None = None
        #: Whether our stdin has been read from, and whether a read failed.
        self._stdin_read = False
        self._stdin_lost = False
        #: Whether our stdin is left unread until a SIGCONT comes
        #: (:meth:`_stopped_for_the_terminal`).
        self._stdin_held = False
        #: Whether a SIGCONT has come since this was last reset.
        self._continued = False
        #: How many signals we were sent and forwarded (one may repeat).
        self._forwarded = 0
        self._receipt: Receipt | None = None
        #: Whether output was lost: to a failed write (not a reader gone), or
        #: as malformed (:data:`~sdexec.cliio.MALFORMED`).
        self._output_lost = False
        #: When the SIGPIPE for a reader gone was sent (``time.monotonic``).
        self._sigpipe_sent_at: float | None = None
        #: The signal that ended the command before its process started.
        self.interrupted: int | None = None
        #: The signals sent to us (and forwarded).
        self._caught: set[int] = set()
        #: Each signal whose kill is in flight, with
        #: whether another came meanwhile (forwarded once it is answered).
        self._in_flight: dict[int, bool] = {}
        #: The exit status of a command that gave its process up: it wrote
        #: on to a stream whose reader went, ignoring the SIGPIPE.
        self._gave_up: int | None = None
        #: The unit name the command asked for (``SDEXEC_NAME``), if any.
        self._unit_name: str | None = None

    def start(
        self, connection: Connection, command: dict[str, Any], sent_as: int | None
    ) -> None:
        """Start ``command`` on ``connection``; given ``sent_as``, follow
        the exec sent with that matchtag instead (an early exec)."""
        self._connection = connection
        opts = command.get("opts")
        named = opts.get("SDEXEC_NAME") if isinstance(opts, dict) else None
        self._unit_name = named if isinstance(named, str) else None
        self._stream = connection.exec(
            command,
            RUN_FLAGS,
            self._respond,
            self._passed,
            self._stdin_refused,
            sent_as,
        )
        if self._noinput and "stdin" not in self._passed:
            connection.write_stdin(self._stream, b"")
        self._watch_stdin()

    def ended(self) -> bool:
        if self.interrupted is not None or self._gave_up is not None:
            return True
        stream = self._stream
        return stream is not None and (stream.ended or stream.killed_for is not None)

    def exit_code(self) -> int:
        if self.interrupted is not None:
            name = signal_name(self.interrupted)
            fail(f"interrupted by {name} before the process started")
            return signalled_status(self.interrupted)
        if self._gave_up is not None:
            return self._gave_up  # why was said when it happened
        assert self._stream is not None
        if self._stream.killed_for is not None:
            return say_killed(self._stream)
        failure = self._stream.error
        if failure is not None and self._receipt is None:
            fail(str(failure))
            if isinstance(failure, ConnectionFailed) and self._stream.pid is not None:
                _say_may_run_on(self._stream.pid, self._unit_name)
            errnum = failure.errnum if isinstance(failure, RPCError) else 0
            return EXEC_FAILURES.get(errnum, 1)
        if self._receipt is None:
            return fail(UNFINISHED)
        say_end(self._receipt, failure, self._usage)
        code = self._process_status(self._receipt.status)
        # Output lost (a failed write, malformed), stdin that could not be read or
        # that the service refused (the process may have done well without
        # them): nothing else fails the command, as a local one would.
        lost = (
            self._output_lost
            or self._stdin_lost
            or self._stream.stdin_error is not None
        )
        return (code or 1) if lost else code

    def process_status(self) -> int | None:
        """The process's wait status, if its end came."""
        return None if self._receipt is None else self._receipt.status

    def _process_status(self, status: int) -> int:
        """The exit status for the process's wait status: one for us to die
        of where it died of a signal we were sent and passed on (a ^C)."""
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in self._caught:
            return signalled_status(os.WTERMSIG(status))
        return exit_code(status)

    # -- signals -----------------------------------------------------------

    def caught(self, signum: int) -> None:
        """A signal sent to us: forwarded, and noted (a process that dies of
        it died of our user's ^C, as a local command would); but SIGCONT,
        which says we go on after a stop."""
        if signum == signal.SIGCONT:
            self._go_on()
            return
        if signum not in COALESCED_SIGNALS:
            # Not a resize: no process dies of that, and a held stdin waits
            # for the end of a process that a signal may have brought.
            self._caught.add(signum)
            self._forwarded += 1
        self._forward_coalesced(signum)

    def _go_on(self) -> None:
        """A SIGCONT (``fg``, ``bg``, the one ``kill %1`` sends after its
        signal): noted, and a held stdin read again."""
        self._continued = True
        if self._stdin_held:
            self._stdin_held = False
            self._watch_stdin()

    def _forward_coalesced(self, signum: int) -> None:
        """Forward ``signum`` with one kill in flight for it at most: one
        that comes meanwhile is sent once that is answered, and any more
        with it (a burst of resizes is two kills, the process told of the
        last). So a flood of a signal is no flood of kills: while an
        output write waits for our reader, each went on a connection of
        its own, left open until the write ended (its answer unread), and
        a flood of SIGUSR1 took every connection the service allows, and
        the SIGTERM after it was refused."""
        if signum in self._in_flight:
            self._in_flight[signum] = True
            return
        self._in_flight[signum] = False  # before: an answer may come at once
        if not self.forward_signal(signum, lambda: self._coalesced_answered(signum)):
            self._in_flight.pop(signum, None)

    def _coalesced_answered(self, signum: int) -> None:
        if self._in_flight.pop(signum, False):
            self._forward_coalesced(signum)

    def forward_signal(
        self, signum: int, answered: Callable[[], None] = _nothing
    ) -> bool:
        """Send ``signum`` to the process, once it has started; before, one
        of :data:`INTERRUPTING_SIGNALS` gives the command up, others wait.
        Whether a kill was sent: ``answered()`` is then called once its
        answer (or failure) is in."""
        stream, connection = self._stream, self._connection
        if stream is None or connection is None or stream.pid is None:
            self._before_start(signum)
        elif stream.ended:
            pass  # nothing left to signal
        elif any(output.waiting for output in self.outputs.values()):
            return self._kill_aside(signum, stream.pid, answered)
        else:
            sent = _KillSent(signum, self.ended, answered)
            connection.kill_unit(signum, stream.pid, sent)
            return True
        return False

    def _before_start(self, signum: int) -> None:
        """A signal before the start, which may take minutes (``[systemd]
        start-timeout``, a manager away): one of
        :data:`INTERRUPTING_SIGNALS` gives the command up (our connection's
        close makes the service stop the unit, should it start anyway);
        another waits for the start, once however often it came."""
        if signum not in INTERRUPTING_SIGNALS:
            hold_signal(self._held_signals, signum)
        elif self.interrupted is None:
            self.interrupted = signum
            if self._connection is not None:
                self._connection.close()

    def _kill_aside(self, signum: int, pid: int, answered: Callable[[], None]) -> bool:
        """The kill on a connection of its own, closed once answered: while
        an output write waits for our reader, the service has stopped
        reading our connection's requests (its answers to us wait unread),
        and a kill sent there would wait with them. Its answer is read while
        the write waits (``reconnect`` gives a connection served so): the
        next kill of that signal waits for it, and waited for the write too,
        so that a second ^C reached the process only once our reader read.
        Whether it was sent."""
        try:
            aside = self._reconnect()
        except SdexecError as failure:
            fail(f"kill {signal_name(signum)}: {failure}")
            return False

        def closed() -> None:
            aside.close()
            answered()

        aside.kill_unit(signum, pid, _KillSent(signum, self.ended, answered=closed))
        return True

    def _send_held_signals(self) -> None:
        held, self._held_signals = self._held_signals, []
        for signum in held:
            self._forward_coalesced(signum)

    # -- responses ---------------------------------------------------------

    def _respond(self, payload: dict) -> None:
        kind = payload.get("type")
        if kind == "output":
            self._output(payload.get("io"))
        elif kind == "started":
            self._started()
        elif kind == "add-credit":
            self._watch_stdin()
        elif kind == "finished" and self._receipt is None:
            self._receipt = finished_receipt(payload)
            self._stop_reading_stdin()

    def _started(self) -> None:
        """The process started: the signals held for it are sent. A start
        without a pid (a broken service: the stream's EPROTO) ends the
        command at once, said: no signal could be forwarded, and a ^C
        would be said as one before the start. Only our connection's close
        stops the process (the service stops a client's units when it
        leaves): nothing is killed by a pid we do not have."""
        assert self._stream is not None
        if self._stream.pid is not None:
            self._send_held_signals()
            return
        violation = self._stream.check.violation  # what see_start found
        fail(f"{violation}: ending, as no signal could be forwarded to it")
        self._give_up(1)

    def _output(self, io: Any) -> None:
        outcome = write_output(self.outputs, io)
        if outcome == READER_GONE:
            # Nobody reads ours: as if the process wrote to the pipe itself.
            if self._sigpipe_sent_at is None:
                self._sigpipe_sent_at = time.monotonic()
            self.forward_signal(signal.SIGPIPE)
        elif outcome in (LOST, MALFORMED):
            # Said on stderr; the rest of a stream whose write failed is
            # dropped. The process runs on, as a local one whose write failed
            # may (warnings lost to a full disk must not kill a long job):
            # the exit status says it.
            self._output_lost = True
        elif outcome == DISCARDED and self._ignores_sigpipe():
            self._give_up(exit_code(signal.SIGPIPE))

    def _ignores_sigpipe(self) -> bool:
        """Whether the process still writes to a stream whose reader went,
        past the grace the SIGPIPE sent for it had to end it."""
        sent = self._sigpipe_sent_at
        return sent is not None and time.monotonic() - sent > _SIGPIPE_GRACE_S

    def _give_up(self, status: int) -> None:
        """End the command with ``status``, and with it the process: our
        connection's close makes the service stop its unit (as when the
        client is killed)."""
        self._gave_up = status
        if self._connection is not None:
            self._connection.close()

    # -- stdin ---------------------------------------------------------------

    def _watch_stdin(self) -> None:
        """Read our stdin while there is credit for it, when the loop says
        it is readable, through a non-blocking descriptor of its own where
        it is a pipe or terminal (:func:`~sdexec.cliio.nonblocking_reader`:
        fd 0 itself is shared with the shell)."""
        if self._stdin_allowance() <= 0:
            # Nothing watched before a first read: a stdin passed through,
            # or /dev/null (-n), is never opened again.
            if self._stdin_reader is not None:
                self._loop.unwatch(self._stdin_reader)
        elif self._stdin_write_only:
            self._read_stdin(0)  # EBADF at once: an empty stdin, its EOF sent
        else:
            self._loop.watch(self._stdin_fd(), READABLE, self._read_stdin)

    def _stdin_fd(self) -> int:
        if self._stdin_reader is None:
            write_only = self._stdin_write_only
            self._stdin_reader = 0 if write_only else nonblocking_reader(0)
        return self._stdin_reader

    def _stop_reading_stdin(self) -> None:
        """Read no more of our stdin: the process has ended, though its
        stream goes on while the leftovers of its unit are stopped (the
        stop timer may take minutes). As ``flux exec`` stops reading at
        its subprocesses' exit, what is typed meanwhile stays its user's,
        not sent to a process that is gone."""
        self._stdin_open = False
        self._watch_stdin()
        self.close_stdin_reader()

    def close_stdin_reader(self) -> None:
        """Close the descriptor opened to read our stdin, if one was."""
        if self._stdin_reader not in (None, 0):
            self._loop.unwatch(self._stdin_reader)
            os.close(self._stdin_reader)
        self._stdin_reader = None

    def _stdin_allowance(self) -> int:
        """How much of our stdin may be read now: none once it is closed or
        the stream has ended, no more than the credit."""
        stream = self._stream
        if not self._stdin_open or self._stdin_held or stream is None or stream.ended:
            return 0
        if stream.credit is None:
            return _READ_SIZE
        return max(0, min(_READ_SIZE, stream.credit.available))

    def _stdin_refused(self, error: SdexecError) -> None:
        """The service refused a write (the rest of what we sent is dropped
        there): said once, and the rest of our stdin is left unread. The
        process runs on, with the stdin it got."""
        warn(f"stdin refused: {error}")
        self._stdin_open = False
        self._watch_stdin()

    def _unreadable_stdin(self, failure: OSError) -> None:
        """A read of our stdin failed: the process gets EOF. A stdin not
        open for reading (``EBADF`` at once: the write-only /dev/null
        ``nohup`` puts there) is an empty one, quietly, as a closed stdin
        is; any other failure is said, and the process, cut short of its
        input, fails the command (as a refused write does)."""
        if failure.errno == errno.EBADF and not self._stdin_read:
            return
        warn(f"cannot read stdin: {failure.strerror}")
        self._stdin_lost = True

    def _read_stdin(self, _events: int) -> None:
        assert self._stream is not None and self._connection is not None
        size = self._stdin_allowance()
        if size == 0 or self._stopped_for_the_terminal():
            return
        try:
            data = os.read(self._stdin_fd(), size)
        except BlockingIOError:
            return  # another reader took it: the loop watches on
        except OSError as failure:
            self._unreadable_stdin(failure)
            data = b""
        if not data:
            self._stdin_open = False
        self._stdin_read = True
        self._connection.write_stdin(self._stream, data)
        self._watch_stdin()

    def _stopped_for_the_terminal(self) -> bool:
        """Whether we stopped, and went on, instead of reading a stdin that
        is our terminal while another job has it: stopped as the read
        would stop us (SIGTTIN to our process group), but outside read().
        Stopped in it, a signal sent to the job (``kill %1``: SIGTERM, then
        SIGCONT) ran the handler that leaves it to the loop, the read was
        retried (PEP 475) and stopped us again, and the signal never
        reached the process (review session 43 L2-1). Here the signals
        sent meanwhile are served as soon as we go on; once one of them is
        forwarded, stdin waits for a later SIGCONT (``fg``, ``bg``):
        stopped again at once, we would not see the process end of it.
        No SIGCONT means we were not stopped (an orphaned process group;
        SIGTTIN ignored or blocked): the read then fails with ``EIO``."""
        if self._stdin_write_only or not _terminal_of_another_job(0):
            return False
        self._continued = False
        forwarded = self._forwarded
        os.killpg(0, signal.SIGTTIN)  # acted on before killpg returns
        self._loop.serve_caught_signals()  # those that came while stopped
        if not self._continued:
            return False
        if self._forwarded != forwarded:
            self._stdin_held = True
            self._watch_stdin()
        return True


def _say_may_run_on(pid: int, asked: str | None) -> None:
    """Say where process ``pid`` may still run, its connection lost before
    its end: a service killed (``SIGKILL``, a crash) stops no unit, and its
    next start stops them only under ``[sdexec] leftover-units = "stop"``.
    "connection lost" alone let the user believe the process gone. Its unit
    is read from ``/proc/PID/cgroup`` (the service is on this node): one
    named as the service names them, or ``asked`` (``SDEXEC_NAME``);
    nothing is said of a pid in no such unit (gone, or not the service's
    process)."""
    unit = _unit_of(pid, asked)
    if unit is not None:
        warn(
            f"pid {pid} may still run, as unit {unit}: a service that was"
            " killed leaves its units running (its next start stops them,"
            f' unless [sdexec] leftover-units = "keep"); systemctl --user stop'
            f" {unit} stops it now (no --user under the system manager)"
        )


def _unit_of(pid: int, asked: str | None) -> str | None:
    """The service's unit process ``pid`` runs in (the innermost ``.service``
    of its systemd cgroup, v1 or v2), if it is ``asked`` or, without it,
    named with the service's prefix; else ``None``."""
    from sdexec.procfs import process_cgroups  # only here

    units = [
        name
        for controllers, path in process_cgroups(pid) or ()
        if controllers in ("", "name=systemd")
        for name in path.split("/")
        if name.endswith(".service")
    ]
    if not units:
        return None
    unit = units[-1]
    if asked is not None:
        return unit if unit in (asked, f"{asked}.service") else None
    return unit if unit.startswith(UNIT_NAME_PREFIX) else None


def _terminal_of_another_job(fd: int) -> bool:
    """Whether ``fd`` is our controlling terminal and another process
    group is its foreground job (reading it would stop us)."""
    try:
        return os.tcgetpgrp(fd) != os.getpgrp()
    except OSError:
        return False  # no terminal of ours: reading it stops nobody


def _write_only(fd: int) -> bool:
    """Whether ``fd`` is open for writing only. The write end of a pipe
    (``0>&1`` onto one) is never readable to the loop: it was never read,
    its EBADF never seen, and the process waited for its stdin for ever
    (review session 40 R2-2). It is read at once instead, an empty stdin,
    as nohup's write-only /dev/null is."""
    import fcntl  # (here: only run --no-passthrough reads our stdin)

    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY


class _KillSent(Call):
    """A forwarded signal's ``sdexec.kill``: only a failure is worth a line,
    and not one that came after the stream ended (``stream_ended()``): its
    process needs no signal, and the connection closed before the answer
    (``run --no-passthrough cat FILE | head -1``: the SIGPIPE sent as the
    last output was written). ``answered()`` is called once the answer (or
    the failure) is in."""

    def __init__(
        self,
        signum: int,
        stream_ended: Callable[[], bool],
        answered: Callable[[], None] = _nothing,
    ) -> None:
        super().__init__()
        self._signum = signum
        self._stream_ended = stream_ended
        self._answered = answered

    def respond(self, payload: dict) -> None:
        super().respond(payload)
        self._answered()

    def end(self, error: SdexecError) -> None:
        super().end(error)
        gone = isinstance(error, RPCError) and error.errnum == errno.ESRCH
        if not (gone or self._stream_ended()):  # an exited process needs none
            fail(f"kill {signal_name(self._signum)}: {error}")
        self._answered()


if __name__ == "__main__":
    run_and_exit()
