"""Looking a request's command up off the reactor's thread.

Before it asks systemd, the service finds the command as execvp(3) would
(:meth:`~sdexec.command.Command.find_executable`): a stat of each file the
request's ``PATH`` names, from its working directory. On a node those are
often on network file systems (homes, project trees, a site's software), and
a stat on an NFS server that does not answer waits until it does: on the
reactor's thread that would hold every client of the service for as long —
every job's output, every kill, ``list``, ``stats``, ``/metrics``.

So the service looks each command up in a worker thread
(:class:`ThreadedLookups`), and a lookup that has not finished within
:data:`LOOKUP_TIMEOUT_S` refuses its request with ETIMEDOUT, naming where it
looked. Its thread is left to finish whenever the file system answers
(the next lookup takes another): a daemon thread, which no stop of the
service waits for. Once :data:`MAX_STUCK` threads are left so, a request
is refused at once (EAGAIN) rather than leave one more behind.

A command found stays found for :data:`FOUND_FRESH_S` from the start of
its lookup: an exec of the same absolute name, or of another from the same
``PATH`` and working directory, within that long runs what the last lookup
found without another (a job's shell, started for job
after job, is looked up about once a second, not once an exec: fewer stats
on a shared file system, and no hand-over to a worker thread, about 0.3 ms
of each exec's start). A file removed or made unexecutable meanwhile fails
in systemd's exec instead (203/EXEC: ``ENOENT`` still, "cannot execute
PATH"), as one removed just after any lookup would. What is not found is
looked up again each time.
"""

from __future__ import annotations

import errno
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from twisted.internet import defer
from twisted.python.failure import Failure

from sdexec.command import Command, Found
from sdexec.plan import RequestError
from sdexec.refusal import quoted

__all__ = [
    "FOUND_FRESH_S",
    "LOOKUP_TIMEOUT_S",
    "MAX_STUCK",
    "InlineLookups",
    "LookupTimedOut",
    "Lookups",
    "ThreadedLookups",
]

#: How long a lookup may take before its request is refused: a local stat
#: takes microseconds, and one on a busy parallel file system well under a
#: second; a file system silent for this long is not answering.
LOOKUP_TIMEOUT_S = 10.0
#: Timed-out lookups whose thread still waits on its file system, at most:
#: past them, an exec is refused at once rather than leave one more.
MAX_STUCK = 16
#: How long a command found stays found (the module's docstring).
FOUND_FRESH_S = 1.0
#: Commands kept found at most; the one found longest ago goes first.
MAX_FOUND = 256
#: Bytes (UTF-8) of the name, ``PATH`` and working directory, together,
#: past which a command found is not kept: a request's ``PATH`` may be
#: long, and what is kept must stay small (at most about 2 MiB in all).
_MAX_FOUND_KEY = 8 * 1024
#: Characters of a path a timed-out lookup's message shows: a long one
#: whole, and room for the reason after it in the log line, which quotes
#: the message (it names the request's command, which may be megabytes).
_SHOWN_PATH = 512


class LookupTimedOut(RequestError):
    """A lookup did not finish in time: the request's refusal, and the
    admin's to know (a file system of the node does not answer)."""


class Lookups(Protocol):
    """How the server looks commands up."""

    def find(self, command: Command, default_cwd: str) -> defer.Deferred[Found]:
        """``command`` found as :meth:`Command.find_executable` finds it from
        ``default_cwd`` (where the unit runs without a ``cwd``); fails with a
        :class:`~sdexec.plan.RequestError` when it cannot be looked up."""
        ...


class InlineLookups:
    """Lookups in the calling thread, answered at once: for callers whose
    file systems are all local (the offline tests, tools)."""

    def find(self, command: Command, default_cwd: str) -> defer.Deferred[Found]:
        return defer.maybeDeferred(command.find_executable, default_cwd)


class ThreadedLookups:
    """Lookups in worker threads, answered in the reactor's (the module's
    docstring says why); timed on ``clock``."""

    def __init__(
        self,
        reactor: Any,
        clock: Any = None,
        timeout: float = LOOKUP_TIMEOUT_S,
        limit: int = MAX_STUCK,
    ) -> None:
        self._reactor = reactor
        self._clock = clock or reactor
        self._timeout = timeout
        self._limit = limit
        #: Lookups that timed out and whose thread has not ended: their
        #: threads wait on a file system. Only the reactor's thread changes
        #: it. (Lookups in time are bounded by the connections: each holds
        #: its requests while one runs.)
        self.stuck = 0
        self._workers = _Workers()
        self._found = _RecentlyFound(self._clock)

    def find(self, command: Command, default_cwd: str) -> defer.Deferred[Found]:
        name = command.cmdline[0]
        key = _found_key(command, default_cwd)
        found = self._found.get(key)
        if found is not None:
            return defer.succeed(found)
        if self.stuck >= self._limit:
            return _not_looked_up(
                name, f"{self.stuck} lookups wait on a file system that does not answer"
            )
        answer: defer.Deferred[Found] = defer.Deferred()
        timer = self._clock.callLater(
            self._timeout, self._timed_out, answer, command, default_cwd
        )
        finished = partial(
            self._finished,
            answer=answer,
            timer=timer,
            key=key,
            started=self._clock.seconds(),
        )
        try:
            self._workers.run(
                partial(_outcome, command, default_cwd),
                partial(self._reactor.callFromThread, finished),
            )
        except RuntimeError as error:  # no thread to be had: the node's limits
            timer.cancel()
            return _not_looked_up(name, f"no thread to look it up in ({error})")
        return answer

    def _finished(
        self,
        outcome: Found | Failure,
        answer: defer.Deferred[Found],
        timer: Any,
        key: bytes | None,
        started: float,
    ) -> None:
        if answer.called:
            self.stuck -= 1  # timed out: its request was refused already
            return
        timer.cancel()
        if isinstance(outcome, Failure):
            answer.errback(outcome)
            return
        if outcome.executable is not None and key is not None:
            self._found.put(key, outcome, started)
        answer.callback(outcome)

    def _timed_out(
        self, answer: defer.Deferred[Found], command: Command, default_cwd: str
    ) -> None:
        self.stuck += 1
        reason = self._timeout_reason(command, default_cwd)
        answer.errback(LookupTimedOut(errno.ETIMEDOUT, reason))

    def _timeout_reason(self, command: Command, default_cwd: str) -> str:
        # Quoted: the message is logged, and a line break or an escape
        # code in the name would forge or garble the log's lines.
        path = command.cmdline[0]
        name = quoted(path, _SHOWN_PATH)
        waited = f"{self._timeout:g} s"
        if path.startswith("/"):
            return f"{name}: its file system did not answer within {waited}"
        cwd = quoted(command.cwd or default_cwd, _SHOWN_PATH)
        return (
            f"{name}: looking it up from {cwd} did not finish within {waited}"
            " (a file system of the working directory"
            " or of PATH that does not answer?)"
        )


def _found_key(command: Command, default_cwd: str) -> bytes | None:
    """What a lookup's outcome depends on, as one key: an absolute name
    alone (found the same from anywhere: a job's shell, started in each
    job's own directory), any other with ``PATH`` and the working
    directory; ``None`` when too long to keep."""
    name = command.cmdline[0]
    if name.startswith("/"):
        parts: tuple[str, ...] = (name,)
    else:
        path = command.env.get("PATH")
        where = command.cwd or default_cwd
        parts = (name, "" if path is None else f"={path}", where)
    key = "\0".join(parts).encode()  # (text checked: no NUL, no surrogate)
    return key if len(key) <= _MAX_FOUND_KEY else None


class _RecentlyFound:
    """Commands found by lookups started in the last :data:`FOUND_FRESH_S`
    on ``clock``, at most :data:`MAX_FOUND` of them; used in the reactor's
    thread only."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._found: OrderedDict[bytes, tuple[float, Found]] = OrderedDict()

    def get(self, key: bytes | None) -> Found | None:
        if key is None or key not in self._found:
            return None
        when, found = self._found[key]
        if self._clock.seconds() - when > FOUND_FRESH_S:
            del self._found[key]
            return None
        return found

    def put(self, key: bytes, found: Found, started: float) -> None:
        """Keep what a lookup ``started`` then found, unless a lookup
        started later has answered already, or this one took longer than
        :data:`FOUND_FRESH_S` (a file system that stalled: what it found
        may be older than what others have found since)."""
        kept = self._found.get(key)
        if kept is not None and kept[0] > started:
            return
        if self._clock.seconds() - started > FOUND_FRESH_S:
            return
        self._found.pop(key, None)
        self._found[key] = (started, found)
        if len(self._found) > MAX_FOUND:
            self._found.popitem(last=False)


#: A call for a worker thread, and where its outcome goes.
_Job = tuple[Callable[[], Any], Callable[[Any], None]]
#: How long a worker thread waits for another lookup before it ends.
IDLE_WORKER_S = 30.0


def _not_looked_up(name: str, why: str) -> defer.Deferred[Found]:
    return defer.fail(RequestError(errno.EAGAIN, f"{name}: not looked up: {why}"))


def _outcome(command: Command, default_cwd: str) -> Found | Failure:
    """The lookup, in a worker thread: what it found, or its fault."""
    try:
        return command.find_executable(default_cwd)
    except Exception:
        return Failure()


class _Workers:
    """Daemon threads that run calls, each one at a time: an idle one takes
    the next, else a new one starts (a thread stuck in a call is never
    waited for); one idle for ``idle_s`` ends. Kept rather than started
    per call: a thread's start is one more round trip between two threads,
    on every exec."""

    def __init__(self, idle_s: float = IDLE_WORKER_S) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Workers waiting for a call that no :meth:`run` has claimed.
        self._idle = 0
        self._idle_s = idle_s

    def run(self, call: Callable[[], Any], deliver: Callable[[Any], None]) -> None:
        """``deliver(call())`` in a worker thread."""
        job = (call, deliver)
        with self._lock:
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
                self._jobs.put(job)
        if not claimed:
            threading.Thread(
                target=self._work, args=(job,), name="sdexec lookup", daemon=True
            ).start()

    def _work(self, job: _Job | None) -> None:
        while job is not None:
            call, deliver = job
            outcome = call()
            with self._lock:
                # Idle before the outcome is delivered: a run() it lets
                # follow finds this worker.
                self._idle += 1
            deliver(outcome)
            job = self._next()

    def _next(self) -> _Job | None:
        """The next job, or ``None`` once idle for ``idle_s``."""
        while True:
            try:
                return self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    # A job put since the wait ended is for a waiting
                    # worker (it claimed one): this one, if no other takes it.
                    if self._jobs.empty():
                        self._idle -= 1
                        return None
