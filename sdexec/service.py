"""The long-running service: config, systemd, the RPC and stats endpoints.

:class:`SdexecService` is what the twistd plugin runs. Start-up order:
connect to systemd (a service that cannot reach systemd exits with that
reason), then listen. ``SIGHUP`` reloads the configuration: a bad file is
logged and the running configuration stays; an ``sdexec.reload`` request
(``sdexec reload``, the units' ``ExecReload=``) runs the same reload and is
answered with its outcome. Losing systemd is not fatal:
the client reconnects, the service drains only if that takes longer than
``[systemd] reconnect-timeout`` (sdexec/outage.py). Units of an earlier run
are found at start (sdexec/leftovers.py). Stopping the service stops and
reaps every unit it started, and the leftovers it is stopping.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import sys
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer, threads
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import CannotListenError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Site

from sdexec.activation import (
    inherited_address,
    inherited_socket_keeps_out,
    is_systemd_endpoint,
    kernel_somaxconn,
    server_endpoint,
    with_backlog,
)
from sdexec.clocks import timers_clock
from sdexec.closing import EXIT_FLUSH_SECONDS
from sdexec.config import (
    DEFAULT_SOCKET_MODE,
    Config,
    ConfigError,
    allowed_users_cannot_connect,
    load_config_quietly,
    log_warnings,
    users_a_mode_may_keep_out,
)
from sdexec.connection import SdexecServerFactory
from sdexec.containment import Containment
from sdexec.leftovers import owner_marks
from sdexec.lookup import ThreadedLookups
from sdexec.metrics import Metrics
from sdexec.notify import Readiness, describe_server
from sdexec.outage import SystemdOutage
from sdexec.ownerlock import AlreadyServed, OwnerLock
from sdexec.protocol import default_socket_path
from sdexec.refusal import RequestRefused
from sdexec.server import SdexecServer
from sdexec.signals import signal_name
from sdexec.sockets import (
    clear_stale_socket,
    directory_mode,
    kept_out,
    listening_path,
    private_endpoint,
    private_umask,
    unix_endpoint,
    unix_path,
)
from sdexec.stats import recent, stats_site
from sdexec.systemd import Manager, SystemdClient, SystemdError
from sdexec.systemd.errors import NO_BUS_ADDRESS

__all__ = ["EX_CONFIG", "ReloadRefused", "SdexecService", "default_listen_endpoint"]

log = Logger()

DEFAULT_STATS_ENDPOINT = "tcp:8490:interface=127.0.0.1"
#: How long stopping the service waits for its units to be reaped.
SHUTDOWN_GRACE_SECONDS = 10.0
#: ``[sdexec]`` settings read once, at start (sockets, the log observer): a
#: reload keeps the values in force, so the configuration shown is true.
START_ONLY_SETTINGS = (
    "listen",
    "listen_backlog",
    "stats",
    "stats_socket",
    "socket_mode",
    "log_format",
)


def default_listen_endpoint(socket_mode: int = DEFAULT_SOCKET_MODE) -> str:
    """``unix:$XDG_RUNTIME_DIR/sdexec/sdexec.sock`` (its mode ``[sdexec]
    socket-mode``, applied when it listens), its directory made private:
    mode 0700, plus search permission for those ``socket_mode`` lets
    connect (``allow-users``)."""
    path = default_socket_path()
    if path is None:
        raise ConfigError(
            "<environment>",
            "XDG_RUNTIME_DIR",
            "not set: give --listen or [sdexec] listen",
        )
    directory = os.path.dirname(path)
    mode = directory_mode(socket_mode)
    try:
        os.makedirs(directory, mode=mode, exist_ok=True)
        os.chmod(directory, mode)
    except OSError as error:  # a file there, another user's directory…
        raise ConfigError(
            "<environment>",
            "XDG_RUNTIME_DIR",
            f"{directory}: {error.strerror}: give --listen or [sdexec] listen",
        ) from None
    escaped = path.replace(":", r"\:")  # endpoint strings split on ':'
    # The mode written out, as before socket-mode applied here: with the
    # default it is the same string, so units an old version marked with
    # the whole string's hash are still found as its leftovers.
    return f"unix:{escaped}:mode={socket_mode:o}:lockfile=1"


#: The exit status of a start refused for its configuration (sysexits'
#: EX_CONFIG, as systemd's own tools use it): the units do not restart it,
#: since the same file would fail again every 5 s.
EX_CONFIG = 78


def _with_command_line(config: Config, given: Mapping[str, str]) -> Config:
    """``config`` with the settings the command line ``given`` (``listen``,
    ``stats``, ``bus``) in place of the file's: what the service reports is
    what it does."""
    listen = given.get("listen", config.sdexec.listen)
    stats = given.get("stats", config.sdexec.stats)
    config = replace(config, sdexec=replace(config.sdexec, listen=listen, stats=stats))
    if "bus" in given:
        config = replace(config, systemd=replace(config.systemd, bus=given["bus"]))
    return config


def _exit_failed(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class SdexecService(Service):
    """Runs the sdexec RPC server and its stats endpoint."""

    def __init__(
        self,
        config: Config,
        reactor: Any,
        listen: str | None = None,
        stats: str | None = None,
        exit_on_failure: bool = False,
        connect: Callable[[], defer.Deferred[Any]] | None = None,
        bus: str | None = None,
    ) -> None:
        """``exit_on_failure``: a start that fails ends the process with
        status 1 (what twistd wants; tests keep it off and read
        :attr:`ready`). ``connect`` reaches the systemd manager (offline
        tests pass one that answers with :class:`sdexec.testing.FakeManager`;
        by default the manager ``[systemd] bus`` names). ``listen``,
        ``stats`` and ``bus`` (twistd's ``--bus``) override the file's
        settings, also across reloads."""
        self._connect = connect or self._connect_systemd
        self.exit_on_failure = exit_on_failure
        #: Settings the command line gave (--listen, --stats, --bus): the file's
        #: value is not the one in force, now or after a reload.
        self._command_line = {
            name: value
            for name, value in (("listen", listen), ("stats", stats), ("bus", bus))
            if value
        }
        self.config = _with_command_line(config, self._command_line)
        self.reactor = reactor
        in_force = self.config.sdexec  # the command line's endpoints, if given
        self.listen = in_force.listen or default_listen_endpoint(in_force.socket_mode)
        self.stats = in_force.stats or DEFAULT_STATS_ENDPOINT
        self.server: SdexecServer | None = None
        self.owner_lock: OwnerLock | None = None
        self.outage: SystemdOutage | None = None
        self.ports: dict[str, Any] = {}
        self.ready: defer.Deferred = defer.Deferred()
        self.reload_when_started = False  # a SIGHUP came during the start
        #: One reload at a time: each builds the mapper in a thread.
        self._reloads = defer.DeferredLock()
        #: A SIGHUP's reload waits for its turn: another SIGHUP meanwhile is
        #: the same reload (it reads the file when its turn comes).
        self._signal_reload_waiting = False
        #: Started (listening, READY=1 sent) and not stopping: what a
        #: reload needs.
        self.serving = False
        #: The stop has begun: nothing more is reloaded or told to systemd.
        self.stopped = False
        # sd_notify (a no-op without $NOTIFY_SOCKET): see sdexec/notify.py
        self.readiness = Readiness(reactor, self._status_line)
        # GET /metrics: as GET /stats, made at most once a second.
        self.metrics = Metrics(reactor, recent(self._server_stats, reactor))

    def startService(self) -> None:
        """Start the service: :attr:`ready` fires once it listens (or fails
        with why it could not start)."""
        super().startService()
        # First: SIGHUP's default action ends the process, and a reload may
        # be asked for (kill -HUP) while the start waits.
        self._install_sighup()
        self._start().addCallbacks(self.ready.callback, self._start_failed)

    @defer.inlineCallbacks
    def _start(self) -> Generator[defer.Deferred[Any], Any, SdexecService]:
        containment = Containment.from_config(self.config)
        marks = owner_marks(self.listen, self._check_inherited_socket())
        self._take_ownership(marks)
        systemd = yield self._connect()
        # Before the leftover scan, whose calls on a restart among thousands
        # of units are the slowest the manager gets (the default connection
        # counted its own already: _connect_systemd).
        systemd.on_call = self.metrics.dbus_call
        if not self.running:
            systemd.disconnect()  # the stop found no server to close it
        self._check_still_starting()
        server = self.server = self._new_server(systemd, containment, marks)
        self._watch_systemd(systemd, server)
        leftovers = server.leftovers
        assert leftovers is not None, "the server is built with the owner marks"
        # Before listening: leftovers of an earlier run drain the node first.
        yield leftovers.scan()
        self._check_still_starting()
        server.observer = self.metrics
        # Before listening: no job runs before the device fence is judged.
        yield server.verify_devices()
        self._check_still_starting()
        yield self._listen_all(server)
        leftovers.release_stops()  # the start can fail no more
        self._now_serving()
        return self

    def _check_inherited_socket(self) -> str | None:
        """A ``systemd:`` endpoint's socket, checked before the owner lock
        is taken and any unit touched. A start by hand with the
        configuration of a socket-activated unit has none, and would fail
        to listen only after its leftover scan had taken the running
        service's units for its own: its lock, in its own runtime
        directory (the unit's is ``$RUNTIME_DIRECTORY``), does not keep it
        out. What the socket is bound to, which marks the units (two
        instances of a socket-activated unit share their endpoint, not
        their socket); ``None`` for any other endpoint."""
        if not is_systemd_endpoint(self.listen):
            return None
        named = self._named("listen")
        return inherited_address(_endpoint(self.reactor, self.listen, named))

    def _take_ownership(self, marks: tuple[str, ...]) -> None:
        """First of all: the owner lock of the endpoint, beside its socket.
        A second service on this endpoint would take the first one's
        running units for leftovers (sdexec/ownerlock.py)."""
        mode = self.config.sdexec.socket_mode
        named = self._named("listen")
        with _making_socket(self.listen, named):  # beside its socket
            self.owner_lock = OwnerLock(
                self.listen, marks[0], mode, marks[1:], setting=named
            )
            self.owner_lock.take()

    def _named(self, setting: str) -> str:
        """Where the value in force of ``setting`` came from, as its errors
        name it: twistd's option (``--listen``) if the command line gave
        it, else the file's key (``[sdexec] listen``, also when unset: the
        key that would change the default). An admin who set ``--listen``
        in ``ExecStart=`` would look in the file and find nothing."""
        if setting in self._command_line:
            return f"--{setting}"
        return f"[sdexec] {setting}"

    def _new_server(
        self, systemd: Manager, containment: Containment, marks: tuple[str, ...]
    ) -> SdexecServer:
        """The server on ``systemd``, its units marked with ``marks``; its
        leftovers, once scanned, are held unstopped until it listens (a
        start that then fails must not have stopped units it leaves
        unfollowed)."""
        systemd.debug = self.config.systemd.sdbus_debug
        systemd.max_inflight = self.config.systemd.max_inflight
        clock = timers_clock(self.reactor)
        server = SdexecServer(
            systemd,
            self.config,
            self.reactor,
            containment,
            clock=clock,
            # A command's lookup may wait on a network file system.
            lookups=ThreadedLookups(self.reactor, clock),
            marks=marks,
            hold_leftover_stops=True,
        )
        server.reloader = self._reload_asked
        return server

    def _watch_systemd(self, systemd: Manager, server: SdexecServer) -> None:
        """Judge the manager's version, and follow systemd's losses and
        returns (sdexec/outage.py)."""
        server.check_manager_version()
        self.outage = SystemdOutage(server)
        systemd.on_lost = self.outage.lost
        systemd.on_restored = self.outage.restored

    @defer.inlineCallbacks
    def _listen_all(
        self, server: SdexecServer
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Listen for requests, then for stats (and on the private stats
        socket, if one is configured)."""
        backlog = self._listen_backlog()
        self.ports["listen"] = yield self._listen(
            with_backlog(self.listen, backlog),
            SdexecServerFactory(server),
            "listen",
            shown=self.listen,
            backlog=backlog,
        )
        site = self._stats_site()
        self.ports["stats"] = yield self._listen(self.stats, site, "stats")
        if self.config.sdexec.stats_socket is not None:
            # A site (and a connection cap) of its own: strangers on TCP
            # must not close a trusted scraper's private connections.
            private_site = self._stats_site()
            self.ports["stats-socket"] = yield self._listen(
                unix_endpoint(self.config.sdexec.stats_socket),
                private_site,
                "stats-socket",
            )

    def _now_serving(self) -> None:
        """Listening: READY=1, and a reload asked for meanwhile runs now."""
        self.serving = True
        self.readiness.ready()
        log.info(
            "sdexec listening on {listen}, stats on {stats}",
            listen=self.listen,
            stats=_with_bound_port(self.stats, self.ports.get("stats")),
        )
        self._warn_if_allowed_users_kept_out()
        if self.reload_when_started:
            self._reload_on_signal()

    def _warn_if_allowed_users_kept_out(self) -> None:
        """A warning if ``allow-users`` names users whom the socket served
        keeps out, where the file's own check cannot see it: the modes of a
        socket systemd passed, which are the ``.socket`` unit's and not
        ``socket-mode``; the group of one the service made, which they are
        not in; for any socket, a directory above it that they may not
        search (``/run/user/UID``, the system unit's ``/run/sdexec`` of
        ``RuntimeDirectoryMode=0700``). They would get EACCES, and nothing
        would say why. (At start; a reload judges it in the pool.)"""
        judge = self._kept_out_judge()
        if judge is not None:
            _say_kept_out(judge())

    async def _warn_in_pool_if_allowed_users_kept_out(self) -> None:
        """:meth:`_warn_if_allowed_users_kept_out`, judged off the reactor's
        thread: each user's groups come from the user database (LDAP,
        sssd), which may take seconds, and every stream and timer would
        wait for it at each reload (as for the file's own check, in
        :meth:`_load`)."""
        judge = self._kept_out_judge()
        if judge is None:
            return
        pool = self.reactor.getThreadPool()
        try:
            _say_kept_out(await threads.deferToThreadPool(self.reactor, pool, judge))
        except Exception:
            # The configuration is in force already: a warning not given
            # must not make the reload read as refused.
            log.failure("judging whom the socket keeps out failed")

    def _kept_out_judge(self) -> Callable[[], str | None] | None:
        """What says how the socket served keeps ``allow-users`` out (the
        user database and the file system read: it may block), or ``None``
        when there is nothing to judge."""
        port = self.ports.get("listen")
        uids = users_a_mode_may_keep_out(self.config)
        if not uids or port is None:
            return None
        path = listening_path(port)  # here: the port is the reactor's
        if is_systemd_endpoint(self.listen):
            return partial(inherited_socket_keeps_out, path, uids)
        return partial(
            _made_socket_keeps_out,
            path,
            uids,
            self._named("listen"),
            self.config.sdexec.socket_mode,
        )

    def _listen_backlog(self) -> int:
        """``[sdexec] listen-backlog``, else the kernel's cap (Twisted's own
        default, 50, refused a burst of connects with EAGAIN)."""
        return self.config.sdexec.listen_backlog or kernel_somaxconn()

    def _connect_systemd(self) -> defer.Deferred[SystemdClient]:
        """The user manager (the session bus) or, with ``[systemd] bus =
        "system"``, the system manager."""
        return SystemdClient.connect(
            system=self.config.systemd.bus == "system",
            clock=timers_clock(self.reactor),  # reconnecting too: sdexec/clocks.py
            # Its Subscribe and Version read counted too; a reconnection's
            # are, by the same client.
            on_call=self.metrics.dbus_call,
        )

    def _listen(
        self,
        description: str,
        factory: Any,
        setting: str,
        shown: str = "",
        backlog: int | None = None,
    ) -> defer.Deferred[Any]:
        """Listen on an endpoint; a UNIX socket is made private
        (sdexec/sockets.py): ``[sdexec] socket-mode``, in a directory of
        ours, bound under a umask that keeps others out from the start. One
        that cannot be had is a one-line error naming where ``setting`` came
        from (:meth:`_named`) and the endpoint as configured (``shown``,
        else ``description``). An inherited (``systemd:``) socket listens
        with ``backlog``."""
        named = self._named(setting)
        with _making_socket(shown or description, named):
            private = private_endpoint(
                description, self.config.sdexec.socket_mode, os.getuid()
            )
            clear_stale_socket(private)
        endpoint = _endpoint(self.reactor, private, named, backlog)
        with private_umask():  # a UNIX socket is bound within listen()
            listening = endpoint.listen(factory)
        return listening.addErrback(_cannot_listen, shown or description, named)

    def _stats_site(self) -> Site:
        """``/stats`` and ``/metrics``; an answer with command lines is not
        given again once a reload has set ``stats-detail`` false."""
        return stats_site(
            self._http_stats,
            self.metrics.resource(),
            self.reactor,
            depends_on=lambda: self.config.sdexec.stats_detail,
        )

    def _http_stats(self) -> dict:
        """``GET /stats``: anyone who can reach it reads it, so command
        lines and labels only with ``[sdexec] stats-detail``."""
        assert self.server is not None, "the stats endpoint listens after start"
        return self.server.stats(detail=self.config.sdexec.stats_detail)

    def _server_stats(self) -> dict:
        assert self.server is not None, "the stats endpoint listens after start"
        return self.server.stats()

    def _status_line(self) -> str:
        if self.server is None:
            return "starting"
        server = self.server
        return describe_server(
            server.drain_reason, server.listed_count, server.systemd.silence()
        )

    def _check_still_starting(self) -> None:
        """After each wait of the start: a stop that came meanwhile ends it
        (it would listen after the stop, its READY=1 after STOPPING=1)."""
        if not self.running:
            raise StoppedWhileStarting("the service was stopped while starting")

    def _start_failed(self, failure: Failure) -> None:
        if self.owner_lock is not None:
            self.owner_lock.release()
        if failure.check(StoppedWhileStarting):
            log.info("sdexec stopped while starting")
            self.ready.errback(failure)
            return  # stopping as asked: no failure to exit with
        if failure.check(*_TOLD_IN_ONE_LINE):
            log.error(
                "sdexec could not start: {error}", error=failure.getErrorMessage()
            )
        else:
            log.failure("sdexec could not start", failure)
        self.ready.errback(failure)
        if self.exit_on_failure:
            status = EX_CONFIG if _fails_again(failure) else 1
            self.reactor.callWhenRunning(self._exit_after_shutdown, status)

    def _exit_after_shutdown(self, status: int) -> None:
        # twistd has no exit status of its own: leave with it once the
        # reactor has shut down (and the log is flushed).
        self.reactor.addSystemEventTrigger("after", "shutdown", _exit_failed, status)
        self.reactor.stop()

    def _install_sighup(self) -> None:
        # Called from the reactor thread; the handler only schedules work.
        signal.signal(
            signal.SIGHUP, lambda *_: self.reactor.callFromThread(self._sighup)
        )

    def _stop_signals_said(self) -> None:
        """From the stop on, a SIGTERM or SIGINT is logged, not handed to
        the reactor: Twisted's handlers would stop it again, which it
        answers with a ``ReactorNotRunning`` traceback (an admin's second
        Ctrl-C while the units are stopped, which takes 20 s and more)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            handler = signal.getsignal(signum)
            if getattr(handler, "__self__", None) is self.reactor:
                signal.signal(signum, self._stop_asked_again)

    def _stop_asked_again(self, signum: int, _frame: object) -> None:
        self.reactor.callFromThread(
            log.info,
            "{signal} received: the service is already stopping (its units"
            " are stopped and reaped first)",
            signal=signal_name(signum),
        )

    def _sighup(self) -> None:
        """Reload now, or once listening: the start has already built its
        parts from the configuration it began with. Not while stopping, nor
        after a start that failed (a reload would start a device canary and
        tell systemd READY=1)."""
        if self.serving:
            self._reload_on_signal()
        elif not self.running or self.ready.called:
            log.info("reload ignored: the service is not serving")
        else:
            log.info("reload asked for while starting: it runs once listening")
            self.reload_when_started = True

    def _reload_asked(self) -> defer.Deferred[dict]:
        """An ``sdexec.reload`` request's reload (``systemctl reload``'s):
        the same as a SIGHUP's, whose outcome it is answered with
        (:meth:`Reloaded.answer`). A
        client can connect from when the service listens, a moment before
        it serves, and a connection may last into the stop: a request
        then is refused (EAGAIN, ECANCELED), not deferred as a SIGHUP is."""
        if self.stopped:
            return defer.fail(ReloadRefused(errno.ECANCELED, _STOPPING))
        if not self.serving:
            return defer.fail(
                ReloadRefused(
                    errno.EAGAIN,
                    "the service is still starting: the configuration it"
                    " starts with is read already; reload once it is ready",
                )
            )
        return self._reload_in_turn(None).addCallback(Reloaded.answer)

    def _reload_on_signal(self) -> None:
        """A SIGHUP's reload, whose outcome nobody waits for: a fault of
        ours in it is logged now, not when its Deferred is collected. One
        asked for while another SIGHUP's waits for its turn is that one: a
        storm of SIGHUPs ran a whole reload (the mapper rebuilt, the canary
        judged) for each."""
        if self._signal_reload_waiting:
            return
        self._signal_reload_waiting = True
        reloading = self._reloads.run(self._signal_reload_s_turn)
        reloading.addErrback(_refused).addErrback(
            lambda failure: log.failure("reload failed", failure)
        )

    def _signal_reload_s_turn(self) -> defer.Deferred[Reloaded]:
        """Its turn: a SIGHUP from now on reloads again, after this one
        (the file may change once this one has read it)."""
        self._signal_reload_waiting = False
        return defer.Deferred.fromCoroutine(self._reload_once(None))

    def reload(self, path: str | None = None) -> defer.Deferred[bool]:
        """Load the configuration again and rebuild the mapper; a bad file or
        a mapper that cannot be built keeps the old configuration in force.
        Fires with whether the new one is in force (:meth:`reload_or_refuse`
        says why not)."""
        return self.reload_or_refuse(path).addCallbacks(lambda _path: True, _refused)

    def reload_or_refuse(self, path: str | None = None) -> defer.Deferred[str]:
        """The one reload, a SIGHUP's and an ``sdexec.reload`` request's
        alike: fires with the file now in force, or fails with
        :class:`ReloadRefused` saying why the old configuration stays (as
        logged). Reloads run one at a time, in the order asked. Running
        processes are not touched (but leftovers, under a
        ``leftover-units`` changed to ``stop``); the next request sees the
        new configuration, and the drain is judged afresh (the manager's
        version, the device canary, the leftovers)."""
        return self._reload_in_turn(path).addCallback(lambda done: done.path)

    def _reload_in_turn(self, path: str | None) -> defer.Deferred[Reloaded]:
        """:meth:`reload_or_refuse`, firing with the whole outcome."""
        return self._reloads.run(
            lambda: defer.Deferred.fromCoroutine(self._reload_once(path))
        )

    async def _reload_once(self, path: str | None) -> Reloaded:
        if self.stopped:  # one that waited for another, the stop between
            log.info("reload dropped: the service is stopping")
            raise ReloadRefused(errno.ECANCELED, _STOPPING)
        self.readiness.reloading()
        try:
            reloaded = await self._reload(path or self.config.source)
            self.metrics.reloaded(True)
            return reloaded
        except ReloadRefused:
            self.metrics.reloaded(False)
            raise
        finally:
            if not self.stopped:  # nothing after STOPPING=1
                self.readiness.reloaded()

    async def _reload(self, path: str) -> Reloaded:
        """Load ``path`` and put it in force; :class:`ReloadRefused` says
        why not (the configuration in force stays as it was)."""
        config, containment = await self._load(path)
        if self.stopped:
            log.info("reload dropped: the service stopped meanwhile")
            raise ReloadRefused(errno.ECANCELED, _STOPPING)
        config = _with_command_line(config, self._command_line)
        if config.systemd.bus != self.config.systemd.bus:
            # The connection is made once: the configuration in force must
            # keep naming the manager the service really talks to.
            raise _refusing(
                f"{path}: systemd.bus: the {self.config.systemd.bus} manager is"
                " in use; a new bus needs a restart"
            )
        config, kept = self._keep_start_only_settings(config, path)
        self._put_in_force(config, containment)
        await self._warn_in_pool_if_allowed_users_kept_out()
        log.info("configuration reloaded from {path}", path=path)
        return Reloaded(path, kept, config.warnings)

    async def _load(self, path: str) -> tuple[Config, Containment]:
        """The configuration of ``path`` and its containment (the mapper
        built), read off the reactor's thread; :class:`ReloadRefused` with
        why they could not be."""
        try:
            # In a thread, the file's parse and check and the mapper's
            # build: a large YAML file, a user looked up through LDAP,
            # lstopo (and a site's mapper) on a GPU node can take seconds,
            # and every stream and timer would wait for them.
            config = await threads.deferToThreadPool(
                self.reactor, self.reactor.getThreadPool(), load_config_quietly, path
            )
            log_warnings(config)  # here: the log is the reactor thread's
            containment = await threads.deferToThreadPool(
                self.reactor,
                self.reactor.getThreadPool(),
                Containment.from_config,
                config,
            )
        except (ConfigError, ValueError, OSError) as error:
            raise _refusing(str(error)) from None
        except (Exception, SystemExit) as error:
            # A fault of ours or of a site's mapper (SystemExit too: one
            # that exits as it loads went by unlogged, answered "3"): its
            # traceback logged, and refused as a bad file is (an
            # sdexec.reload's client told why, the refusal counted), the
            # old configuration in force.
            log.failure("reload of {path} failed", path=path)
            raise _refusing(f"{path}: {type(error).__name__}: {error}") from None
        return config, containment

    def _put_in_force(self, config: Config, containment: Containment) -> None:
        """``config`` and ``containment`` are the service's from now on."""
        self.config = config
        if self.server is not None:
            self.server.reconfigure(config, containment)
            # judged afresh: containment may be new
            self.server.check_manager_version()
            self.server.verify_devices()

    def _keep_start_only_settings(
        self, config: Config, path: str
    ) -> tuple[Config, tuple[str, ...]]:
        """``config`` with the values in force of the settings read only at
        start, and a warning naming each changed one (logged, and for the
        reload's answer: what needs a restart)."""
        kept = {}
        said = []
        in_force = {"listen": self.listen, "stats": self.stats}
        for name in START_ONLY_SETTINGS:
            old, new = getattr(self.config.sdexec, name), getattr(config.sdexec, name)
            if old != new:
                said.append(
                    f"{path}: sdexec.{name.replace('_', '-')}: read only at start:"
                    f" {_setting(name, new)} takes effect at the next restart,"
                    f" {_setting(name, in_force.get(name, old))} stays in force"
                )
                log.warn("{warning}", warning=said[-1])
                kept[name] = old
        if not kept:
            return config, ()
        config = replace(config, sdexec=replace(config.sdexec, **kept))
        if "socket_mode" in kept:
            # The file's mode was judged: the users it lets in, the one in
            # force may not (EACCES, which nothing else would explain).
            for warning in allowed_users_cannot_connect(config):
                log.warn("{warning}", warning=warning)
                said.append(warning)
        return config, tuple(said)

    @defer.inlineCallbacks
    def stopService(self) -> Generator[defer.Deferred[Any], Any, None]:
        """Stop listening, end what runs (docs/operating.md), flush the
        answers owed, and release the owner lock."""
        super().stopService()
        self._stop_signals_said()
        self.stopped = True
        self.serving = False
        self.readiness.stopping()
        for port in self.ports.values():
            yield port.stopListening()
        if self.outage is not None:
            self.outage.stop()
        try:
            if self.server is not None:
                yield self.server.shutdown(SHUTDOWN_GRACE_SECONDS)
                self.server.systemd.disconnect()
                # Its answers written out before the reactor's shutdown
                # closes what is left, dropping what Twisted holds for it.
                yield self.server.open_connections.close_all(
                    self.server.clock, EXIT_FLUSH_SECONDS
                )
                self.server.stop_log_rates()  # what they held back is said now
        finally:
            self.metrics.stop()  # its log says now what it held back
            if self.owner_lock is not None:
                self.owner_lock.release()  # its units are stopped: the next may


@dataclass(frozen=True)
class Reloaded:
    """A reload taken: the file now in force, the warnings naming the
    settings it changed that only a restart applies (their old values stay
    in force), and the file's own warnings (as ``python3 -m sdexec.config``
    prints them)."""

    path: str
    needs_restart: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def answer(self) -> dict[str, Any]:
        """The ``sdexec.reload`` answer (docs/protocol.md): ``warnings`` and
        ``needs-restart`` only when there are any, so that whoever reloads is
        told, not only the log: a kill-signal = "SIGSTOP" taken, or a conf.d
        file not read, was said in the log alone."""
        answer: dict[str, Any] = {"config": self.path}
        if self.warnings:
            answer["warnings"] = list(self.warnings)
        if self.needs_restart:
            answer["needs-restart"] = list(self.needs_restart)
        return answer


class ReloadRefused(RequestRefused):
    """A reload that left the configuration in force as it was: ``errnum``
    and ``errstr`` (why) are what an ``sdexec.reload`` request is answered
    with."""


#: Why a reload that the stop overtook did nothing.
_STOPPING = "the service is stopping: the configuration was not reloaded"


def _refusing(reason: str) -> ReloadRefused:
    """A configuration refused (``reason`` names the file and the key, or
    the mapper's failure): logged here, for a SIGHUP's reload has nobody
    else to tell."""
    log.error("reload refused, old configuration kept: {reason}", reason=reason)
    return ReloadRefused(
        errno.EINVAL, f"reload refused, old configuration kept: {reason}"
    )


def _refused(failure: Failure) -> bool:
    """:meth:`SdexecService.reload`'s ``False`` for a refusal (said in the
    log already); any other failure, a fault of ours, goes on."""
    failure.trap(ReloadRefused)
    return False


def _setting(name: str, value: object) -> str:
    """A setting's value as the configuration file writes it."""
    if value is None:
        return "unset"
    if name == "socket_mode" and isinstance(value, int):
        return f'"{value:04o}"'
    # A TOML basic string (or integer) is written as JSON writes it, not as
    # Python's repr: 'unix:…' read as a quoting no configuration file has.
    return json.dumps(value, ensure_ascii=False)


def _fails_again(failure: Failure) -> bool:
    """Whether the same start would fail again as it is: a configuration
    refused, a socket that cannot be made where it is configured, no bus
    address (or one that is not an address) to reach systemd at. The
    units do not restart it (``EX_CONFIG``)."""
    error = failure.value
    if isinstance(error, ConfigError):
        return not error.transient
    if isinstance(error, SystemdError):
        return error.name == NO_BUS_ADDRESS
    return isinstance(error, ListenError) and error.lasting


def _say_kept_out(why: str | None) -> None:
    """Log what keeps the users of ``allow-users`` out, if anything does."""
    if why is not None:
        log.warn(
            "sdexec.allow-users: the users listed cannot connect: {kept_out}",
            kept_out=why,
        )


def _made_socket_keeps_out(
    path: str | None, uids: Iterable[int], named: str, socket_mode: int
) -> str | None:
    """For a UNIX socket the service made: what keeps one of ``uids`` out
    (:func:`sdexec.sockets.kept_out`), and what to change: the socket's
    mode (``socket_mode``, the one in force, or the ``mode=`` of ``named``,
    the option or key that gave the socket), or a directory above it (or
    a socket elsewhere); ``None`` if nothing does, or if it is
    ``socket_mode`` and lets no one but its owner connect (the file's check
    said so, ``allowed_users_cannot_connect``)."""
    if path is None:
        return None
    kept = kept_out(path, uids)
    if kept is None:
        return None
    if kept.path == path:
        mode = stat.S_IMODE(kept.info.st_mode)
        if mode == socket_mode and not mode & 0o022:
            return None
        setting = "socket-mode" if mode == socket_mode else f"the mode= of {named}"
        return f"{kept}: {kept.reason}: set {setting} to {_LETTING_IN[kept.judged_as]}"
    return (
        f"{path} is below {kept}, which uid {kept.uid} may not search: give it"
        " search permission (0711; the system unit's RuntimeDirectoryMode=),"
        f" or {named} a socket outside it"
    )


#: The socket modes that let in a user judged by each class of bits
#: (:attr:`sdexec.sockets.KeptOut.judged_as`).
_LETTING_IN = {
    "owner": 'one that gives its owner write ("0600", "0660" or "0666")',
    "group": '"0660" or "0666" (its group needs write)',
    "others": '"0666", or to "0660" with the service run under a group they share',
}


def _with_bound_port(description: str, port: Any) -> str:
    """``description`` and, for a TCP listener, the address it is bound to
    (``tcp:0`` lets the kernel pick the port, which the admin, a scraper's
    config or a test then reads here)."""
    address = port.getHost() if port is not None else None
    if isinstance(address, IPv6Address):
        return f"{description} ([{address.host}]:{address.port})"
    if isinstance(address, IPv4Address):
        return f"{description} ({address.host}:{address.port})"
    return description


def _endpoint(
    reactor: Any, description: str, named: str, backlog: int | None = None
) -> Any:
    """The server endpoint of ``description``; a :class:`ListenError`
    naming ``named`` (the option or key that gave it) for a ``systemd:``
    socket not passed, or not one the unit can serve: the same start fails
    again until the ``.socket`` unit is mended."""
    try:
        return server_endpoint(reactor, description, backlog)
    except ValueError as error:
        raise ListenError(f"{named}: {error}", lasting=True) from None


def _cannot_listen(failure: Failure, description: str, named: str) -> None:
    """A port already taken, told in one line (not Twisted's traceback);
    also an error of the pid link's check (``EPERM``: the link of a socket
    something serves names another user's process)."""
    failure.trap(CannotListenError, OSError)
    error = failure.value
    why = error.socketError if isinstance(error, CannotListenError) else error
    if isinstance(why, str) and "lock" in why:
        why = f"{why} (another sdexec is serving on it)"
    elif isinstance(why, OSError) and why.errno == errno.EADDRINUSE:
        why = f"{why.strerror} (another program, or sdexec, is serving on it)"
    elif isinstance(error, CannotListenError) and isinstance(why, OSError):
        # bind(2) itself: its file system, the path (not a port someone
        # else holds, nor a pid link naming a process that may end).
        raise _unusable_socket(description, named, why)
    raise ListenError(f"{named}: cannot listen on {description}: {why}")


@contextmanager
def _making_socket(description: str, named: str) -> Iterator[None]:
    """Where a UNIX socket is made ready (its directory made and checked,
    the owner lock beside it taken, an earlier run's socket removed): a
    failure is one line naming ``named`` (the option or key) and the
    endpoint, lasting where the path is at fault (a restart would meet it
    again)."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise _unusable_socket(description, named, error) from None


#: What a socket's path meets that stays until an admin acts: a directory
#: of another user's or read-only, a file in the way. Not a full file
#: system, nor a process out of descriptors, which may pass.
_LASTING_ERRNOS = frozenset(
    {
        errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ENOENT,
        errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG,
    }
)  # fmt: skip


def _unusable_socket(
    description: str, named: str, error: OSError | ValueError
) -> ListenError:
    """The :class:`ListenError` of a socket ``error`` keeps from being made,
    naming the path it met and, on a read-only one, what to give."""
    why, lasting = str(error), True
    if isinstance(error, OSError):
        lasting = error.errno in _LASTING_ERRNOS
        path = error.filename or unix_path(description) or ""
        why = f"{error.strerror}: {path}" if path else str(error.strerror)
        if error.errno == errno.EROFS:
            # The system unit's file system is read-only but for /run/sdexec.
            why += f" ({_read_only_advice(unix_path(description) or path)})"
    return ListenError(f"{named}: cannot listen on {description}: {why}", lasting)


def _read_only_advice(socket_path: str) -> str:
    """What to give the unit for a socket at ``socket_path`` on a read-only
    file system: a ``ReadWritePaths=`` of the socket's own directory, never
    of the parent a missing one was to be made in (that advice opened
    ``/var/lib`` whole to the service); a missing one must be made first,
    or systemd refuses to start the unit (226/NAMESPACE)."""
    directory = os.path.dirname(socket_path)
    advice = (
        "under ProtectSystem=strict, give its directory a ReadWritePaths="
        f" drop-in: {directory}"
    )
    if not os.path.isdir(directory):
        advice += ", once made: it does not exist"
    return advice


class StoppedWhileStarting(Exception):
    """A stop came before the start was done: ``ready`` fails with it."""


class ListenError(Exception):
    """An endpoint the service cannot listen on (one line: the setting, the
    endpoint and why). ``lasting``: the socket cannot be made where it is
    configured (a read-only or missing directory, another user's), so the
    same start would fail again; not a port another program holds."""

    def __init__(self, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


#: Start failures whose message says it all: logged as one line, not with
#: a traceback (which is kept for faults of the service's own).
_TOLD_IN_ONE_LINE = (
    SystemdError,
    ConfigError,
    ValueError,
    OSError,
    ListenError,
    AlreadyServed,
)
