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
is refused at once (EAGAIN) rather than leave one more behind: the
owner's requests once its own have left so many, each user's of
``[sdexec] allow-users`` once its own have, apart (a user's home on a
file system that hangs must not refuse the resource manager's jobs, as
the process caps are apart: sdexec/shares.py).

The paths a failed unit's sandboxing named (:meth:`Lookups.first_missing`,
to say why its namespace failed) are looked at so too; one that does not
answer in time is not known, and not named.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from twisted.internet import defer
from twisted.python.failure import Failure

from sdexec.command import Command, Found
from sdexec.plan import NamedPath, RequestError
from sdexec.refusal import quoted
from sdexec.shares import count_off

__all__ = [
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
#: Characters of a path a timed-out lookup's message shows: a long one
#: whole, and room for the reason after it in the log line, which quotes
#: the message (it names the request's command, which may be megabytes).
_SHOWN_PATH = 512


class LookupTimedOut(RequestError):
    """A lookup did not finish in time: the request's refusal, and the
    admin's to know (a file system of the node does not answer)."""


class Lookups(Protocol):
    """How the server looks commands up."""

    def find(
        self, command: Command, default_cwd: str, uid: int | None = None
    ) -> defer.Deferred[Found]:
        """``command`` found as :meth:`Command.find_executable` finds it from
        ``default_cwd`` (where the unit runs without a ``cwd``), for a
        request of ``uid``, a user of ``allow-users`` (``None``: the
        owner's); fails with a :class:`~sdexec.plan.RequestError` when it
        cannot be looked up."""
        ...

    def first_missing(self, paths: list[NamedPath]) -> defer.Deferred[NamedPath | None]:
        """The first of ``paths`` that does not exist (:func:`first_missing`);
        never fails: ``None`` where that is not known."""
        ...


class InlineLookups:
    """Lookups in the calling thread, answered at once: for callers whose
    file systems are all local (the offline tests, tools)."""

    def find(
        self, command: Command, default_cwd: str, uid: int | None = None
    ) -> defer.Deferred[Found]:
        return defer.maybeDeferred(command.find_executable, default_cwd)

    def first_missing(self, paths: list[NamedPath]) -> defer.Deferred[NamedPath | None]:
        return defer.succeed(first_missing(paths))


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
        #: Lookups that timed out and whose thread has not ended, by whose
        #: they were (``None``: the owner's, a uid: a user's of
        #: ``allow-users``): their threads wait on a file system. Only the
        #: reactor's thread changes it. (Lookups in time are bounded by the
        #: connections: each holds its requests while one runs.)
        self._stuck: Counter[int | None] = Counter()
        self._workers = _Workers()

    @property
    def stuck(self) -> int:
        """The threads left waiting on a file system, everyone's."""
        return self._stuck.total()

    def find(
        self, command: Command, default_cwd: str, uid: int | None = None
    ) -> defer.Deferred[Found]:
        name = command.cmdline[0]
        stuck = self._stuck[uid]
        if stuck >= self._limit:
            whose = "" if uid is None else f" of uid {uid}"
            return _not_looked_up(
                name,
                f"{stuck} lookups{whose} wait on a file system that does not answer",
            )
        call = partial(_outcome, command, default_cwd)
        timed_out = partial(self._timed_out, command=command, default_cwd=default_cwd)
        try:
            return self._in_worker(call, timed_out, uid)
        except RuntimeError as error:  # no thread to be had: the node's limits
            return _not_looked_up(name, f"no thread to look it up in ({error})")

    def first_missing(self, paths: list[NamedPath]) -> defer.Deferred[NamedPath | None]:
        if self._stuck[None] >= self._limit:
            return defer.succeed(None)  # not one more thread left waiting
        try:
            return self._in_worker(
                partial(first_missing, paths), lambda answer: answer.callback(None)
            )
        except RuntimeError:  # no thread to be had: not known
            return defer.succeed(None)

    def _in_worker(
        self,
        call: Callable[[], Any],
        timed_out: Callable[[defer.Deferred[Any]], None],
        uid: int | None = None,
    ) -> defer.Deferred[Any]:
        """``call()`` in a worker thread, answered in the reactor's; past
        the timeout, ``timed_out(answer)`` answers it instead, and the
        thread counts as ``uid``'s stuck one until it ends.
        ``RuntimeError`` if no thread can be had."""
        answer: defer.Deferred[Any] = defer.Deferred()
        timer = self._clock.callLater(
            self._timeout, self._left_stuck, answer, timed_out, uid
        )
        finished = partial(self._finished, answer=answer, timer=timer, uid=uid)
        try:
            self._workers.run(call, partial(self._reactor.callFromThread, finished))
        except RuntimeError:
            timer.cancel()
            raise
        return answer

    def _left_stuck(
        self,
        answer: defer.Deferred[Any],
        timed_out: Callable[[defer.Deferred[Any]], None],
        uid: int | None,
    ) -> None:
        self._stuck[uid] += 1
        timed_out(answer)

    def _finished(
        self, outcome: Any, answer: defer.Deferred[Any], timer: Any, uid: int | None
    ) -> None:
        if answer.called:  # timed out: its request was refused already
            count_off(self._stuck, uid)
            return
        timer.cancel()
        if isinstance(outcome, Failure):
            answer.errback(outcome)
        else:
            answer.callback(outcome)

    def _timed_out(
        self, answer: defer.Deferred[Found], command: Command, default_cwd: str
    ) -> None:
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


#: A call for a worker thread, and where its outcome goes.
_Job = tuple[Callable[[], Any], Callable[[Any], None]]
#: How long a worker thread waits for another lookup before it ends.
IDLE_WORKER_S = 30.0


def first_missing(paths: list[NamedPath]) -> NamedPath | None:
    """The first of ``paths`` that does not exist, as systemd would find it
    (symbolic links followed); ``None`` if each does, or cannot be looked
    at (a permission): only a path known missing is named. It may wait on
    its file system: call it off the reactor's thread."""
    for named in paths:
        try:
            os.stat(named[1])
        except (FileNotFoundError, NotADirectoryError):
            return named
        except (OSError, ValueError):  # ValueError: a NUL, which no path has
            continue
    return None


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
