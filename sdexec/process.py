"""One process run as a transient unit: Flux's ``sdproc``.

:class:`Process` owns the three channels, the unit's property watch and the
stop timer, and turns unit state changes into RFC 42 responses, in order:
``add-credit`` (with write-credit), ``started``, ``output``…, ``finished``,
then — once the unit is inactive and stdout and stderr have reached EOF —
the ``ENODATA`` error that ends the stream. Data flows one way: the request
made it, systemd's events drive it, responses leave through its
:class:`Responder`.
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from sdexec.ioencode import encode_io
from sdexec.property import UnitProperty
from sdexec.protocol import ExecFlag
from sdexec.systemd import Manager, UnitStatus, Watch, errno_for, name_string_properties
from sdexec.systemd.channel import (
    DEFAULT_INPUT_BUFSIZE,
    DEFAULT_OUTPUT_BUFSIZE,
    InputChannel,
    OutputChannel,
    socketpair_for_systemd,
)

__all__ = [
    "FLAG_CHANNEL",
    "FLAG_STDERR",
    "FLAG_STDOUT",
    "FLAG_WRITE_CREDIT",
    "Process",
    "Responder",
    "StopTimerPolicy",
]

log = Logger()

FLAG_STDOUT, FLAG_STDERR = ExecFlag.STDOUT, ExecFlag.STDERR
FLAG_CHANNEL, FLAG_WRITE_CREDIT = ExecFlag.CHANNEL, ExecFlag.WRITE_CREDIT


class Responder(Protocol):
    """Where a process's responses go (a client's request, or nowhere once
    the client has gone)."""

    def respond(self, payload: dict[str, Any]) -> None: ...

    def error(self, errnum: int, errstr: str) -> None: ...


@dataclass(frozen=True)
class StopTimerPolicy:
    """The stop timer: ``seconds`` after the unit starts deactivating, send
    SIGTERM; as long again, ``signal``; as long again, give up (EDEADLK).
    Negative ``seconds`` disables it."""

    seconds: float
    signal: int

    @property
    def enabled(self) -> bool:
        return self.seconds >= 0


@dataclass(frozen=True)
class OutputOptions:
    line_buffered: bool = True
    bufsize: int = DEFAULT_OUTPUT_BUFSIZE


class Process:
    """A request's process: from ``StartTransientUnit`` to the end of the
    stream. Build it, then :meth:`start` it."""

    def __init__(
        self,
        systemd: Manager,
        unit_name: str,
        properties: list[UnitProperty],
        responder: Responder,
        *,
        reactor: Any,
        clock: IReactorTime,
        flags: int,
        rank: str,
        stop_timer: StopTimerPolicy,
        output: dict[str, OutputOptions],
        stdin_bufsize: int = DEFAULT_INPUT_BUFSIZE,
        cmdline: list[str] = (),
        label: str | None = None,
        on_reaped: Callable[[Process], None] = lambda process: None,
        verify: Callable[[dict[str, Any], int], str | None] | None = None,
        count: Callable[[str], None] = lambda event: None,
        debug: bool = False,
    ) -> None:
        self.unit_name = unit_name
        self.cmdline = list(cmdline)
        self.label = label
        self.pid: int | None = None
        self.status = UnitStatus()
        self._systemd = systemd
        self._properties = properties
        self._responder = responder
        self._reactor = reactor
        self._clock = clock
        self._flags = flags
        self._rank = rank
        self._stop_timer = stop_timer
        self._on_reaped = on_reaped
        self._verify = verify
        self._count = count  # for the service's statistics
        self._debug = debug  # log every unit state change
        self._watch: Watch | None = None
        self._timer = None
        self._timer_expiries = 0
        self._sent: set[str] = set()  # response kinds already sent
        self._requested: set[str] = set()  # systemd calls already made
        self._ended = False
        self._failure_confirmed = False  # by a GetAll after failed/no status
        self._output_gate_open = False  # opened by `started` (or a failure)
        self._client_paused = False
        self.stdin = InputChannel(self._add_credit, stdin_bufsize)
        self._outputs = {
            name: OutputChannel(
                name,
                on_data=lambda data, name=name: self._output(name, data),
                on_eof=lambda name=name: self._output_eof(name),
                line_buffered=options.line_buffered,
                bufsize=options.bufsize,
            )
            for name, options in output.items()
        }

    # -- state for list/stats ---------------------------------------------

    @property
    def state(self) -> str:
        """``R`` while running, ``Z`` once finished but not yet reaped."""
        return "Z" if self._outcome_known else "R"

    def describe(self) -> dict[str, Any]:
        return {
            "pid": self.pid if self.pid is not None else -1,
            "cmdline": self.cmdline,
            "label": self.label,
            "unit": self.unit_name,
            "state": self.state,
        }

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Make the channels, watch the unit, ask systemd to start it."""
        pairs = {
            name: socketpair_for_systemd() for name in ("stdin", "stdout", "stderr")
        }
        self._watch = self._systemd.watch_unit(self.unit_name, self._unit_changed)
        self.stdin.adopt(self._reactor, pairs["stdin"][0])
        for name in ("stdout", "stderr"):
            if name not in self._outputs:
                pairs[name][0].close()  # nobody would read it
        for name, channel in self._outputs.items():
            channel.adopt(self._reactor, pairs[name][0])
            # RFC 42 wants `started` before any output: leave the data in the
            # socket buffer until then (the process blocks if it fills).
            channel.pause()
        if self._flags & FLAG_WRITE_CREDIT:
            self._send(
                {"type": "add-credit", "channels": {"stdin": self.stdin.bufsize}}
            )
        theirs = [pairs[name][1] for name in ("stdin", "stdout", "stderr")]
        started = self._systemd.start_transient_unit(
            self.unit_name, self._properties, *(sock.fileno() for sock in theirs)
        )
        # systemd has its copies once it answers (or will never use them).
        started.addBoth(self._close_after_start, theirs)
        started.addCallbacks(self._start_accepted, self._start_refused)

    def write(self, data: bytes, eof: bool) -> None:
        """Client data for stdin (``eof`` closes it)."""
        if data:
            self.stdin.write(data)
        if eof:
            self.stdin.close()

    def kill(self, signum: int) -> Any:
        """Signal every process of the unit; a Deferred."""
        return self._systemd.kill_unit(self.unit_name, "all", signum)

    def abandon(self) -> None:
        """The client has gone: stop the unit and reap it, silently."""
        self._responder = _Nowhere()
        # Nobody reads any more: drain to EOF so the unit can be reaped.
        self._output_gate_open, self._client_paused = True, False
        self._resume_unless_client_paused()
        # A failed unit is being reset instead; anything else is stopped.
        if "start" in self._requested and "reset" not in self._requested:
            self._stop()

    def pause_output(self) -> None:
        """The client reads slowly: stop reading the process's output."""
        self._client_paused = True
        for channel in self._outputs.values():
            channel.pause()

    def resume_output(self) -> None:
        self._client_paused = False
        self._resume_unless_client_paused()

    def _resume_unless_client_paused(self) -> None:
        if self._output_gate_open and not self._client_paused:
            for channel in self._outputs.values():
                channel.resume()

    # -- systemd's answers and events ----------------------------------------

    @staticmethod
    def _close_after_start(result: Any, sockets: list) -> Any:
        for sock in sockets:
            sock.close()
        return result

    def _start_accepted(self, job: str) -> None:
        self._requested.add("start")
        if isinstance(self._responder, _Nowhere):
            self._stop()  # the client left while systemd was starting it
            return
        if self._verify is not None:
            # The fence check reads ControlGroup, which no signal carries.
            self._watch.refresh().addErrback(self._log_failure, "GetAll")
        elif self._watch.state:
            # Signals carry every state the lifecycle needs (the watch was
            # registered before the start); some may have come before this
            # answer, and the stream may only end now that it has.
            self._unit_changed(self._watch.state)

    def _start_refused(self, failure) -> None:
        error = failure.value
        message = name_string_properties(
            getattr(error, "message", str(error)), self._properties
        )
        log.warn(
            "{unit}: StartTransientUnit failed: {message}",
            unit=self.unit_name,
            message=message,
        )
        self._fail(errno_for(error), message)
        self._reap()

    def _unit_changed(self, properties: dict[str, Any]) -> None:
        status = self.status = UnitStatus.from_properties(properties)
        if self._debug:
            log.info("{unit}: {state}", unit=self.unit_name, state=status)
        if status.pid > 0 and self.pid is None:
            self.pid = status.pid
        if status.has_started and "started" not in self._sent:
            problem = self._verify(properties, status.pid) if self._verify else None
            if problem is None:
                self._once("started", {"type": "started", "pid": status.pid})
            else:
                self._sent.add("started")  # never: the job is refused instead
                self._refuse(problem)
            self._output_gate_open = True
            self._resume_unless_client_paused()
        if status.has_finished:
            self._once("finished", {"type": "finished", "status": status.wait_status})
        self._check_failure(status)
        if status.needs_stop:
            self._stop()
        # Reset only once the outcome is known: a reset clears ExecMain*.
        if status.needs_reset and self._outcome_known:
            self._request("reset", self._systemd.reset_failed_unit)
        if status.is_deactivating:
            self._arm_stop_timer()
        if status.is_inactive:
            self._cancel_stop_timer()
        self._maybe_end()

    @property
    def _outcome_known(self) -> bool:
        return self._ended or "finished" in self._sent

    def _check_failure(self, status: UnitStatus) -> None:
        if self._outcome_known:
            return  # e.g. a reset after `finished` shows failed/ExecMainCode=0
        if status.has_failed:
            self._fail(*status.failure)
        elif status.failed_without_status:
            if self._failure_confirmed:
                self._fail(*status.failure)
            elif "confirm-failure" not in self._requested:
                # Perhaps half a change: decide on the whole state, as the
                # refresh's own answer has it (not on signals in between).
                self._requested.add("confirm-failure")
                self._watch.refresh().addCallbacks(
                    self._failure_refreshed, self._log_failure, errbackArgs=("GetAll",)
                )

    def _failure_refreshed(self, properties: dict[str, Any]) -> None:
        self._failure_confirmed = True
        self._unit_changed(properties)

    def _forwarded(self, stream: str) -> bool:
        """Whether the client asked for this stream (else it is discarded)."""
        return bool(self._flags & (FLAG_STDOUT if stream == "stdout" else FLAG_STDERR))

    def _output(self, stream: str, data: bytes) -> None:
        if self._forwarded(stream):
            self._send(self._io(stream, data=data))

    def _output_eof(self, stream: str) -> None:
        if self._forwarded(stream):
            self._send(self._io(stream, eof=True))
        self._maybe_end()

    def _io(self, stream: str, data: bytes = b"", eof: bool = False) -> dict:
        return {
            "type": "output",
            "pid": self.pid if self.pid is not None else -1,
            "io": encode_io(stream, self._rank, data, eof),
        }

    def _add_credit(self, nbytes: int) -> None:
        if self._flags & FLAG_WRITE_CREDIT:
            self._send({"type": "add-credit", "channels": {"stdin": nbytes}})

    # -- the end -------------------------------------------------------------

    def _maybe_end(self) -> None:
        outputs_done = all(channel.eof for channel in self._outputs.values())
        if self.status.is_inactive and outputs_done and "start" in self._requested:
            if not self._ended:
                self._ended = True
                self._responder.error(errno.ENODATA, "")
            self._reap()

    def _refuse(self, problem: str) -> None:
        """The unit runs outside its fence: fail the request, kill it now."""
        log.error("{unit}: {problem}", unit=self.unit_name, problem=problem)
        self._fail(errno.EIO, problem)
        self.kill(signal.SIGKILL).addErrback(self._log_failure, "KillUnit(SIGKILL)")
        self._stop()

    def _fail(self, errnum: int, errstr: str) -> None:
        """End the stream with an error (no more responses follow); what
        output is left is read to EOF and discarded."""
        if not self._ended:
            self._ended = True
            self._responder.error(errnum, errstr)
        self._output_gate_open = True
        self._resume_unless_client_paused()

    def _reap(self) -> None:
        if "reaped" in self._requested:
            return
        self._requested.add("reaped")
        self._cancel_stop_timer()
        if self._watch is not None:
            self._watch.cancel()
        self.stdin.close()
        for channel in self._outputs.values():
            channel.close()  # if systemd still holds its end (EDEADLK)
        self._on_reaped(self)

    def _stop(self) -> None:
        # "replace": with "fail", systemd refuses to stop a unit whose start
        # job is still queued, and the unit would be left running.
        self._request("stop", lambda unit: self._systemd.stop_unit(unit, "replace"))

    def _request(self, what: str, call: Callable[[str], Any]) -> None:
        if what not in self._requested:
            self._requested.add(what)
            call(self.unit_name).addErrback(self._log_failure, what)

    def _once(self, kind: str, payload: dict[str, Any]) -> None:
        if kind not in self._sent:
            self._sent.add(kind)
            self._send(payload)

    def _send(self, payload: dict[str, Any]) -> None:
        if not self._ended:
            self._responder.respond(payload)

    def _log_failure(self, failure, what: str) -> None:
        log.warn(
            "{unit}: {what} failed: {error}",
            unit=self.unit_name,
            what=what,
            error=failure.getErrorMessage(),
        )

    # -- stop timer (kill escalation) ------------------------------------------

    def _arm_stop_timer(self) -> None:
        if self._timer is None and self._stop_timer.enabled:
            self._timer = self._clock.callLater(
                self._stop_timer.seconds, self._stop_timer_expired
            )

    def _cancel_stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _stop_timer_expired(self) -> None:
        self._timer = None
        self._timer_expiries += 1
        if self._timer_expiries == 1:
            self._count("stop-timer-sigterm")
            self._escalate(signal.SIGTERM)
        elif self._timer_expiries == 2:
            self._count("stop-timer-signal")
            self._escalate(self._stop_timer.signal)
        else:
            self._count("stop-timer-gave-up")
            log.error(
                "{unit}: still active after signal {signum}; giving up on it",
                unit=self.unit_name,
                signum=self._stop_timer.signal,
            )
            self._fail(errno.EDEADLK, "SIGKILL timeout, unit may still be active")
            self._reap()
            return
        self._arm_stop_timer()

    def _escalate(self, signum: int) -> None:
        log.info(
            "{unit}: stop timer expired, sending signal {signum}",
            unit=self.unit_name,
            signum=signum,
        )
        self.kill(signum).addErrback(self._log_failure, f"KillUnit({signum})")


class _Nowhere:
    """The responder of a process whose client has gone."""

    def respond(self, payload: dict[str, Any]) -> None:
        pass

    def error(self, errnum: int, errstr: str) -> None:
        pass
