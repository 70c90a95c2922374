"""Looking a request's command up off the reactor's thread.

Before it asks systemd, the service finds the command as execvp(3) would
(:meth:`~sdexec.command.Command.find_executable`): a stat of each file the
request's ``PATH`` names, from its working directory. On a node those are
often on network file systems (homes, project trees, a site's software), and
a stat on an NFS server that does not answer waits until it does: on the
reactor's thread that would hold every client of the service for as long —
every job's output, every kill, ``list``, ``stats``, ``/metrics``.

So the service looks each command up in a thread of its own
(:class:`ThreadedLookups`), and a lookup that has not finished within
:data:`LOOKUP_TIMEOUT_S` refuses its request with ETIMEDOUT, naming where it
looked. Its thread is left to finish whenever the file system answers: a
daemon thread, which no stop of the service waits for, and at most
:data:`MAX_UNFINISHED` of them at once: past that, a request is refused at
once (EAGAIN) rather than leave one more thread behind.
"""

from __future__ import annotations

import errno
import threading
from typing import Any, Protocol

from twisted.internet import defer
from twisted.python.failure import Failure

from sdexec.command import Command, Found
from sdexec.plan import RequestError

__all__ = [
    "LOOKUP_TIMEOUT_S",
    "MAX_UNFINISHED",
    "InlineLookups",
    "LookupTimedOut",
    "Lookups",
    "ThreadedLookups",
]

#: How long a lookup may take before its request is refused: a local stat
#: takes microseconds, and one on a busy parallel file system well under a
#: second; a file system silent for this long is not answering.
LOOKUP_TIMEOUT_S = 10.0
#: Lookups whose thread may run at once, finished with or not (a timed-out
#: one's thread waits on for its file system).
MAX_UNFINISHED = 16


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
    """Lookups in threads of their own, answered in the reactor's (the
    module's docstring says why); timed on ``clock``."""

    def __init__(
        self,
        reactor: Any,
        clock: Any = None,
        timeout: float = LOOKUP_TIMEOUT_S,
        limit: int = MAX_UNFINISHED,
    ) -> None:
        self._reactor = reactor
        self._clock = clock or reactor
        self._timeout = timeout
        self._limit = limit
        #: Lookups whose thread has not ended, timed out or not (only the
        #: reactor's thread changes it).
        self.unfinished = 0

    def find(self, command: Command, default_cwd: str) -> defer.Deferred[Found]:
        if self.unfinished >= self._limit:
            return defer.fail(
                RequestError(
                    errno.EAGAIN,
                    f"{command.cmdline[0]}: not looked up: {self.unfinished}"
                    " lookups wait on a file system that does not answer",
                )
            )
        answer: defer.Deferred[Found] = defer.Deferred()
        timer = self._clock.callLater(
            self._timeout, self._timed_out, answer, command, default_cwd
        )
        self.unfinished += 1
        threading.Thread(
            target=self._look_up,
            args=(command, default_cwd, answer, timer),
            name=f"sdexec lookup of {command.cmdline[0]}"[:100],
            daemon=True,
        ).start()
        return answer

    def _look_up(
        self,
        command: Command,
        default_cwd: str,
        answer: defer.Deferred[Found],
        timer: Any,
    ) -> None:
        """The lookup, in its own thread; its outcome goes to the reactor's."""
        try:
            outcome: Found | Failure = command.find_executable(default_cwd)
        except Exception:
            outcome = Failure()
        self._reactor.callFromThread(self._finished, outcome, answer, timer)

    def _finished(
        self, outcome: Found | Failure, answer: defer.Deferred[Found], timer: Any
    ) -> None:
        self.unfinished -= 1
        if answer.called:
            return  # timed out: its request was refused already
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
        name = command.cmdline[0]
        waited = f"{self._timeout:g} s"
        if name.startswith("/"):
            return f"{name}: its file system did not answer within {waited}"
        return (
            f"{name}: looking it up from {command.cwd or default_cwd} did not"
            f" finish within {waited} (a file system of the working directory"
            " or of PATH that does not answer?)"
        )
