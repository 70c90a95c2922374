"""The RPC server: requests in, processes made, responses out.

:class:`SdexecServer` holds what outlives a connection (the systemd client,
the configuration, the process table, counters, the drain state);
:class:`ClientProtocol` is one client's connection: it checks who the peer
is, frames and checks requests, and routes responses back by matchtag. See
``docs/protocol.md`` for the wire format.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from zope.interface import implementer

from sdexec.config import Config
from sdexec.containment import Containment, check_cpu_fence, enforced_cpus
from sdexec.idset import IDset
from sdexec.ioencode import decode_io
from sdexec.passthrough import NO_STDIO, PassedStdio, StdioReceivingProtocol
from sdexec.plan import RequestError, plan_exec
from sdexec.process import Process, ProcessContext
from sdexec.protocol import Topic
from sdexec.systemd import Manager

__all__ = ["ClientProtocol", "RequestError", "SdexecServer", "SdexecServerFactory"]

log = Logger()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a UNIX socket."""
    creds = sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class SdexecServer:
    """The service's state and its request handlers (one per topic)."""

    def __init__(
        self,
        systemd: Manager,
        config: Config,
        reactor: Any,
        containment: Containment | None = None,
        clock: Any = None,
    ) -> None:
        self.systemd = systemd
        self.config = config
        self.reactor = reactor
        self.clock = clock or reactor
        self.containment = containment or Containment(config, None)
        self._all_reaped: list[defer.Deferred[None]] = []
        self.processes: dict[tuple[int, int], Process] = {}
        self.counters: Counter[str] = Counter()
        self.drain_reason: str | None = None
        #: The only uid whose requests are served: the service's own.
        self.owner_uid = os.getuid()
        #: Metrics hook (sdexec/metrics.py): ``watch_exec(responder)`` wraps
        #: each exec stream's responder, ``error_sent(topic, errnum)`` sees errors.
        self.observer: Any = None
        self._next_connection_id = 0

    def new_connection_id(self) -> int:
        self._next_connection_id += 1
        return self._next_connection_id

    @property
    def rank(self) -> str:
        return str(self.config.sdexec.rank)

    def reconfigure(self, config: Config, containment: Containment) -> None:
        """Use a new configuration from the next request on (running
        processes keep the plan they were started with)."""
        self.config = config
        self.containment = containment
        self.systemd.debug = config.systemd.sdbus_debug

    # -- exec --------------------------------------------------------------

    def exec(
        self,
        connection_id: int,
        matchtag: int,
        payload: dict,
        responder: Any,
        stdio: PassedStdio = NO_STDIO,
    ) -> None:
        """Start a process for an ``sdexec.exec`` request, with the
        descriptors it brought (``stdio``; the caller closes them if this
        raises)."""
        if self.drain_reason is not None:
            raise RequestError(
                errno.EBUSY,
                f"node is drained: {self.drain_reason} (sdexec undrain clears it)",
            )
        plan = plan_exec(payload, self.config, self.containment)
        stdio.assign(plan.stdio)
        key = (connection_id, matchtag)
        if key in self.processes:
            raise RequestError(errno.EEXIST, f"matchtag {matchtag} is already in use")
        if self.observer is not None:
            responder = self.observer.watch_exec(responder)
        if plan.mapped:
            self.count("mapper")
        process = Process(
            self.systemd,
            plan,
            responder,
            ProcessContext(
                reactor=self.reactor,
                clock=self.clock,
                rank=self.rank,
                count=self.count,
                debug=self.config.systemd.sdexec_debug,
            ),
            on_reaped=lambda process: self._reaped(key),
            verify=self._fence_verifier(plan.fence),
            stdio=stdio,
        )
        self.processes[key] = process
        process.start()

    def _fence_verifier(
        self, expected: IDset | None
    ) -> Callable[[dict[str, Any], int], str | None] | None:
        """The check run when the unit starts, if the mapper fenced CPUs."""
        if expected is None:
            return None
        return lambda state, pid: self._verify_fence(expected, state, pid)

    def _verify_fence(self, expected: IDset, state: dict, pid: int) -> str | None:
        actual = enforced_cpus(state.get("ControlGroup"), pid)
        if actual is None:
            log.warn("pid {pid} exited before its CPU fence could be checked", pid=pid)
            return None
        problem = check_cpu_fence(expected, actual)
        if problem is None:
            return None
        self.counters["fence-failures"] += 1
        if self.containment.check == "warn":
            log.warn(
                "{problem} (containment-check = warn: job left running)",
                problem=problem,
            )
            return None
        self.drain(problem)
        return problem

    def count(self, event: str) -> None:
        """One more ``event`` in the statistics' counters."""
        self.counters[event] += 1

    def _reaped(self, key: tuple[int, int]) -> None:
        self.processes.pop(key, None)
        self.counters["reaped"] += 1
        if not self.processes:
            waiting, self._all_reaped = self._all_reaped, []
            for waiter in waiting:
                waiter.callback(None)

    def shutdown(self, grace: float) -> defer.Deferred:
        """Abandon every process (their units are stopped) and wait up to
        ``grace`` seconds for all of them to be reaped."""
        for process in list(self.processes.values()):
            process.abandon()
        if not self.processes:
            return defer.succeed(None)
        waiter: defer.Deferred = defer.Deferred()
        self._all_reaped.append(waiter)
        waiter.addTimeout(grace, self.clock, onTimeoutCancel=self._shutdown_timeout)
        return waiter

    def _shutdown_timeout(self, result, timeout) -> None:
        names = ", ".join(process.unit_name for process in self.processes.values())
        log.error(
            "units still not reaped after {timeout}s: {names}",
            timeout=timeout,
            names=names,
        )

    # -- write, kill, list, stats ------------------------------------------------

    def write(self, connection_id: int, payload: dict) -> None:
        """Client data for a process's stdin; unknown targets are dropped."""
        matchtag = payload.get("matchtag")
        if not isinstance(matchtag, int) or isinstance(matchtag, bool):
            raise RequestError(errno.EINVAL, "matchtag: expected an integer")
        try:
            stream, data, eof = decode_io(payload.get("io"))
        except ValueError as error:
            raise RequestError(errno.EINVAL, str(error)) from None
        if stream != "stdin":
            raise RequestError(errno.EINVAL, f"io.stream: {stream!r} is not stdin")
        process = self.processes.get((connection_id, matchtag))
        if process is not None:
            process.write(data, eof)

    def connection_processes(self, connection_id: int) -> Iterator[Process]:
        """The processes one connection started."""
        return (
            process
            for (owner, _), process in list(self.processes.items())
            if owner == connection_id
        )

    def find(self, pid: int | None = None, label: str | None = None) -> Process | None:
        for process in self.processes.values():
            if (pid is not None and process.pid == pid) or (
                label is not None and process.label == label
            ):
                return process
        return None

    def kill(self, payload: dict) -> defer.Deferred[dict]:
        """Signal a process by ``pid`` or ``label``; a Deferred."""
        signum = payload.get("signum")
        if not isinstance(signum, int) or isinstance(signum, bool) or signum <= 0:
            raise RequestError(errno.EINVAL, "signum: expected a positive integer")
        pid, label = payload.get("pid"), payload.get("label")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
            raise RequestError(errno.EINVAL, "pid: expected an integer")
        if label is not None and not isinstance(label, str):
            raise RequestError(errno.EINVAL, "label: expected a string")
        if pid is None and label is None:
            raise RequestError(errno.EINVAL, "kill needs a pid or a label")
        process = self.find(pid=pid, label=label)
        if process is None:
            target = f"pid={pid}" if pid is not None else f"label={label}"
            raise RequestError(errno.ESRCH, f"kill {target} not found")
        return process.kill(signum).addCallback(lambda _: {})

    def list(self) -> dict:
        return {
            "rank": self.config.sdexec.rank,
            "procs": [process.describe() for process in self.processes.values()],
        }

    def stats(self) -> dict:
        """What ``sdexec.stats-get`` and ``GET /stats`` report."""
        return {
            "requests": dict(self.counters),
            "procs": self.list()["procs"],
            "job-exec": self.config.introspect(),
            "config": {
                "source": self.config.source,
                **self.config.effective(),
            },
            "mapper": self.containment.stats(self.counters["mapper"]),
            "drain": {
                "drained": self.drain_reason is not None,
                "reason": self.drain_reason,
            },
        }

    def drain(self, reason: str) -> None:
        log.error("draining: {reason}", reason=reason)
        self.drain_reason = reason

    def undrain(self) -> dict:
        previous, self.drain_reason = self.drain_reason, None
        if previous is not None:
            log.info("undrained (was: {reason})", reason=previous)
        return {"reason": previous}


@implementer(IPushProducer)
class ClientProtocol(StdioReceivingProtocol):
    """One client connection."""

    #: A UNIX socket transport once connected. Twisted types it as
    #: ``ITransport | None``, which lacks the producer and half-close methods
    #: the socket transport has; Any keeps those calls unchecked, not wrong.
    transport: Any

    def __init__(self, server: SdexecServer) -> None:
        super().__init__()
        self.server = server
        self.max_frame = server.config.sdexec.max_frame_size
        self.connection_id = server.new_connection_id()
        self.authorized = False
        self._handlers: dict[str, Callable[[int, dict], Any]] = {
            Topic.EXEC: self._exec,
            Topic.WRITE: self._write,
            Topic.KILL: lambda matchtag, payload: self.server.kill(payload),
            Topic.LIST: lambda matchtag, payload: self.server.list(),
            Topic.STATS: lambda matchtag, payload: self.server.stats(),
            Topic.UNDRAIN: lambda matchtag, payload: self.server.undrain(),
        }

    def connectionMade(self) -> None:
        try:
            uid = peer_uid(self.transport.getHandle())
        except OSError as error:
            log.warn("cannot read peer credentials: {error}", error=error)
            uid = -1
        self.authorized = uid == self.server.owner_uid
        if not self.authorized:
            log.warn("refusing requests from uid {uid}", uid=uid)
        self.transport.registerProducer(self, True)

    def connectionLost(self, reason: object = None) -> None:
        super().connectionLost(reason)
        for process in self.server.connection_processes(self.connection_id):
            process.abandon()

    def framingError(self, reason: str) -> None:
        self.server.count("errors")
        self._send_error("", 0, errno.EPROTO, reason)
        self.transport.loseConnection()

    def messageReceived(self, message: dict) -> None:
        topic = message.get("topic")
        matchtag = message.get("matchtag")
        valid_matchtag = isinstance(matchtag, int) and not isinstance(matchtag, bool)
        reply_topic = topic if isinstance(topic, str) else ""
        reply_matchtag = matchtag if isinstance(matchtag, int) and valid_matchtag else 0
        try:
            result = self._dispatch(message, topic, matchtag, valid_matchtag)
        except RequestError as error:
            self.server.count("errors")
            self._send_error(reply_topic, reply_matchtag, error.errnum, error.errstr)
            return
        if result is None:
            return
        if isinstance(result, defer.Deferred):
            result.addCallbacks(
                lambda payload: self._send(reply_topic, reply_matchtag, payload),
                lambda failure: self._send_error(
                    reply_topic, reply_matchtag, errno.EIO, failure.getErrorMessage()
                ),
            )
        else:
            self._send(reply_topic, reply_matchtag, result)

    def _dispatch(self, message: dict, topic, matchtag, valid_matchtag: bool):
        if message.get("type") != "request":
            raise RequestError(errno.EPROTO, 'type: expected "request"')
        if not isinstance(topic, str):
            raise RequestError(errno.EINVAL, "topic: expected a string")
        if not valid_matchtag or matchtag < 0:
            raise RequestError(errno.EINVAL, "matchtag: expected an integer >= 0")
        payload = message.get("payload", {})
        if not isinstance(payload, dict):
            raise RequestError(errno.EINVAL, "payload: expected an object")
        if not self.authorized:
            raise RequestError(errno.EPERM, "only the service's owner may use it")
        handler = self._handlers.get(topic)
        if handler is None:
            raise RequestError(errno.ENOSYS, f"unknown topic {topic!r}")
        self.server.count(topic)
        if self.server.config.systemd.sdexec_debug:
            log.info(
                "request {topic} matchtag={matchtag} from connection {id}",
                topic=topic,
                matchtag=matchtag,
                id=self.connection_id,
            )
        return handler(matchtag, payload)

    def _exec(self, matchtag: int, payload: dict) -> None:
        stdio = PassedStdio(self.take_request_fds())
        try:
            responder = _Stream(self, matchtag)
            self.server.exec(
                self.connection_id, matchtag, payload, responder, stdio=stdio
            )
        except BaseException:
            stdio.close()
            raise

    def descriptorsRefused(self, message: dict, reason: str) -> None:
        topic, matchtag = message.get("topic"), message.get("matchtag")
        self.server.count("errors")
        self._send_error(
            topic if isinstance(topic, str) else "",
            matchtag if type(matchtag) is int else 0,
            errno.EPROTO,
            reason,
        )

    def _write(self, matchtag: int, payload: dict) -> None:
        self.server.write(self.connection_id, payload)

    def _send(self, topic: str, matchtag: int, payload: dict) -> None:
        self.sendMessage(
            {
                "type": "response",
                "topic": topic,
                "matchtag": matchtag,
                "payload": payload,
            }
        )

    def _send_error(self, topic: str, matchtag: int, errnum: int, errstr: str) -> None:
        if self.server.observer is not None:
            self.server.observer.error_sent(topic, errnum)
        self.sendMessage(
            {
                "type": "response",
                "topic": topic,
                "matchtag": matchtag,
                "errnum": errnum,
                "errstr": errstr,
            }
        )

    # IPushProducer: when the client reads slowly, stop reading process output.
    def pauseProducing(self) -> None:
        for process in self.server.connection_processes(self.connection_id):
            process.pause_output()

    def resumeProducing(self) -> None:
        for process in self.server.connection_processes(self.connection_id):
            process.resume_output()

    def stopProducing(self) -> None:
        pass


class _Stream:
    """The responder for one exec request on one connection."""

    def __init__(self, protocol: ClientProtocol, matchtag: int) -> None:
        self._protocol = protocol
        self._matchtag = matchtag

    def respond(self, payload: dict) -> None:
        self._protocol._send(Topic.EXEC, self._matchtag, payload)

    def error(self, errnum: int, errstr: str) -> None:
        self._protocol._send_error(Topic.EXEC, self._matchtag, errnum, errstr)


class SdexecServerFactory(Factory):
    """The listening side: makes a :class:`ClientProtocol` per connection."""

    def __init__(self, server: SdexecServer) -> None:
        self.server = server

    def buildProtocol(self, addr) -> ClientProtocol:
        protocol = ClientProtocol(self.server)
        protocol.factory = self
        return protocol
