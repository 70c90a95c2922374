"""Is device policy enforced? A canary unit says, as the node really is.

The mapper fences devices with ``DevicePolicy=closed`` and ``DeviceAllow``.
systemd accepts those from any manager, but only a manager that can load a
device filter applies them: the devices controller on cgroup v1, a BPF
program on v2, both out of reach of an unprivileged user manager. A fence
that is not enforced must not look enforced, so the service starts a
*canary* unit and watches what it can open.

Why ``DevicePolicy=strict`` and ``/dev/zero``: ``closed`` always lets in the
pseudo devices every node has (``/dev/null``, ``zero``, ``full``,
``random``, ``urandom``, ``tty``, ``ptmx``, ``/dev/pts/*``; systemd's
``bpf_devices_allow_list_static``), and the devices it keeps out (GPUs,
disks) differ from node to node. ``strict`` goes through the same filter
with none of those implicit entries, so ``/dev/zero`` — on every node,
mode 0666 — is outside it. ``/dev/null`` is allowed explicitly and must
open: a canary that cannot open even that proves nothing.

:class:`DeviceCanary` runs it for the server: once at start and at each
reload, again once systemd is back from an outage it could not run (or ran)
across, and never after the service began to stop; only the latest one's
verdict is judged.
"""

from __future__ import annotations

import dataclasses
import errno
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sdexec.command import Command
from sdexec.config import Config
from sdexec.containment import Containment
from sdexec.drain import AdminCause
from sdexec.ioencode import decode_io
from sdexec.plan import ExecPlan, RequestError, plan_exec
from sdexec.policy import STARTUP_TWINS
from sdexec.property import GATE_LISTS, RLIMITS
from sdexec.protocol import ExecFlag, command_object
from sdexec.rset import ResourceSet
from sdexec.signals import signal_name
from sdexec.systemd.unit import wait_status

__all__ = [
    "CANARY_PROPERTIES",
    "CANARY_SCRIPT",
    "CANARY_TIMEOUT_SECONDS",
    "CANARY_UNLIMITED",
    "PROBE",
    "CanaryContext",
    "CanaryResponder",
    "DeviceCanary",
    "canary_plan",
    "canary_verdict",
]

log = Logger()

#: How long the service waits for the canary's verdict before it counts the
#: fence as not verified (a unit start takes well under a second).
CANARY_TIMEOUT_SECONDS = 30.0

#: Opens ``{device}``: exit status 0 if it could, 1 if not. Said with an
#: ``if``, not left to the redirection's own status: that is 2 in dash
#: (Debian's and Ubuntu's /bin/sh), 1 in bash, and a fence that held read as
#: "could not be verified" (the node drained at every start). Lines, not
#: ``;``: a command without ``;`` or ``$`` is given to systemd as it is, not
#: through the trampoline (sdexec/execstart.py), so the canary needs no
#: Python in the unit the site's properties sandbox.
PROBE = "if true <{device}\nthen exit 0\nfi\nexit 1"

#: The allowed device, then the one outside the allow list. The exit status
#: is the verdict: 0 opened it (not enforced), 1 refused (enforced), 10 the
#: allowed device was refused, 11 there is no /dev/zero to probe.
CANARY_SCRIPT = "true </dev/null || exit 10\n[ -c /dev/zero ] || exit 11\n" + (
    PROBE.format(device="/dev/zero")
)
CANARY_PROPERTIES = {"DevicePolicy": "strict", "DeviceAllow": "/dev/null rw"}
OPENED, REFUSED, CONTROL_REFUSED, NO_PROBE = 0, 1, 10, 11

_STEADY_LIMITS = frozenset(
    {
        "MemoryMax", "MemoryHigh", "MemorySwapMax", "MemoryZSwapMax", "TasksMax",
        "CPUQuotaPerSecUSec", "RuntimeMaxUSec",
    }
)  # fmt: skip
#: The site's limits the canary's unit does not take: those that cap what a
#: job may use (memory, tasks, CPU and run time, rlimits soft or hard). They
#: are sized for a job, on a per-job share; the canary is three lines of
#: shell that must run to say anything, and a site's ``MemoryMax=1M`` (an
#: OOM kill where the memory controller holds) or ``LimitNOFILE=3`` (its
#: ``/bin/sh`` not even started) read as a fence not verified, which
#: drains the node. None of them has any bearing on device policy.
#: Upstream's sdexec, for its part, puts ``[exec.sdexec-properties]`` on
#: job shells only.
CANARY_UNLIMITED = (
    _STEADY_LIMITS
    | {twin for twin, steady in STARTUP_TWINS.items() if steady in _STEADY_LIMITS}
    | {f"Limit{resource}{soft}" for resource in RLIMITS for soft in ("", "Soft")}
)

#: What the canary's exit statuses mean when the fence does not hold.
_NOT_ENFORCED = {
    "user": "DevicePolicy not enforced: the user manager cannot load device"
    " filters; run sdexec under the system manager",
    "system": "DevicePolicy not enforced: /dev/zero opened in a DevicePolicy=strict"
    " unit of the system manager (is the devices controller or BPF available?)",
}
_INCONCLUSIVE = {
    CONTROL_REFUSED: "the allowed /dev/null could not be opened either",
    NO_PROBE: "this node has no /dev/zero to probe",
}


def canary_plan(config: Config) -> ExecPlan:
    """The canary's unit: the configured site properties and slice but for
    their gates and :data:`CANARY_UNLIMITED` limits, the canary's device
    policy, output read (stderr says why a probe failed)."""
    payload = {
        "flags": int(ExecFlag.STDOUT | ExecFlag.STDERR),
        "cmd": command_object(
            ["/bin/sh", "-c", CANARY_SCRIPT],
            {"PATH": "/usr/bin:/bin"},
            {
                "SDEXEC_NAME": f"sdexec-device-canary-{uuid.uuid4().hex}",
            },
            cwd="/",
        ),
    }
    plan = plan_exec(payload, config, _CanaryFence(config, None))
    # Not the site's gates: the canary checks the node's device policy, and
    # one false at start (a health file not written yet) would keep it from
    # running and drain the node until an admin's undrain. Nor a job's
    # limits (CANARY_UNLIMITED). The sandbox and the slice are kept: the
    # canary sees /dev as a job does (PrivateDevices= changes what it holds).
    dropped = GATE_LISTS | CANARY_UNLIMITED
    kept = tuple(p for p in plan.properties if p.name not in dropped)
    # Its plan says what its unit is: no site cap.
    return dataclasses.replace(plan, properties=kept, memory_capped=False)


class _CanaryFence(Containment):
    """The canary's device policy, planned as containment's properties: they
    are the service's own, and a request (whose policy the canary's options
    pass) may never name a device fence."""

    def properties(
        self, command: Command, resources: ResourceSet | None = None
    ) -> dict[str, str]:
        return dict(CANARY_PROPERTIES)


def canary_verdict(status: int | None, stderr: str, bus: str) -> str | None:
    """``None`` when the canary shows device policy enforced, else the
    problem: the fence is not enforced, or it could not be verified (which
    is no better: a fence that cannot be shown to hold is not trusted).

    ``status`` is the canary's wait status (``None``: it never ran).
    """
    if status == wait_status(1, REFUSED):
        return None
    if status == wait_status(1, OPENED):
        return _NOT_ENFORCED.get(bus, _NOT_ENFORCED["user"])
    if status is not None and status & 0x7F == 0:
        code = status >> 8
        why = _INCONCLUSIVE.get(code, f"the canary exited with status {code}")
    elif status is not None:
        # Named: SIGKILL (the OOM killer, under its slice's memory cap) says
        # something else than a SIGSEGV.
        why = f"the canary was killed by {signal_name(status & 0x7F)}"
    else:
        why = "the canary did not run"
    detail = f": {stderr.strip()}" if stderr.strip() else ""
    return f"DevicePolicy could not be verified: {why}{detail}"


class CanaryResponder:
    """Collects the canary's responses; :attr:`done` fires with the
    verdict (:func:`canary_verdict`) once its stream has ended."""

    def __init__(self, bus: str) -> None:
        self.done: defer.Deferred[str | None] = defer.Deferred()
        #: Whether the canary could not run because systemd was away (its
        #: start failed with EAGAIN: reconnecting, or the connection lost):
        #: then its verdict says nothing of the fence.
        self.systemd_away = False
        self._bus = bus
        self._status: int | None = None
        self._stderr = b""

    def respond(self, payload: dict[str, Any]) -> None:
        """One response of the canary: its status and stderr are kept for the
        verdict."""
        kind = payload.get("type")
        if kind == "finished":
            self._status = payload.get("status")
        elif kind == "output":
            stream, data, _eof = decode_io(payload["io"])
            if stream == "stderr":
                self._stderr += data

    def error(self, errnum: int, errstr: str) -> None:
        """The stream's end: ENODATA after ``finished``, or why it failed."""
        stderr = self._stderr.decode(errors="replace")
        if errnum != errno.ENODATA:
            stderr = f"{errstr} {stderr}".strip()
            self.systemd_away = self._status is None and errnum == errno.EAGAIN
        if not self.done.called:  # a timed-out canary ends after its verdict
            self.done.callback(canary_verdict(self._status, stderr, self._bus))

    def timed_out(self, _result: object, timeout: float) -> str:
        """``Deferred.addTimeout``'s ``onTimeoutCancel``: the verdict then."""
        return (
            "DevicePolicy could not be verified: the canary gave no verdict"
            f" in {timeout:g} s"
        )


@dataclass(frozen=True)
class CanaryContext:
    """What the device canary needs from the service around it (the
    server's); those read when needed may change meanwhile (a reload's
    configuration, a test's clock)."""

    #: The configuration in force: the canary's unit, and its manager's bus.
    config: Callable[[], Config]
    #: Whether containment is on: without it, no fence is there to verify.
    containment_enabled: Callable[[], bool]
    systemd_connected: Callable[[], bool]
    #: Why the manager refuses every unit now, the canary's too (a manager
    #: too old, a site's property it does not take), or ``None``: such a
    #: refusal says nothing of the device fence.
    units_refused: Callable[[], str | None]
    #: The clock of the verdict's timeout.
    clock: Callable[[], IReactorTime]
    #: ``start_process(plan, responder)``: the service's own process for the
    #: canary's unit, started; its key. Raises OSError when it cannot be
    #: (no fds left for its channels), and nothing is left tabled then.
    start_process: Callable[[ExecPlan, CanaryResponder], tuple[int, int]]
    #: Abandon the process under a key, if it is still tabled.
    abandon: Callable[[tuple[int, int]], None]
    #: ``fence_broken(problems, counter, cause)``: count, then apply
    #: ``containment-check`` (drain: the problem; warn: logged, ``None``).
    fence_broken: Callable[[Sequence[str], str, AdminCause], str | None]


class DeviceCanary:
    """Runs the canary and judges its verdict, like an unenforced CPU fence:
    the server's :meth:`verify`, :meth:`systemd_back` and :meth:`run_owed`,
    :meth:`cancel_all` at its shutdown; :attr:`verdict` for its stats."""

    def __init__(self, context: CanaryContext) -> None:
        self._context = context
        #: The last verdict (``None`` until one has run).
        self.verdict: dict[str, Any] | None = None
        #: Canaries awaiting their verdict (a reload may start one while
        #: another runs): a shutdown cancels them with their timers.
        self._canaries: set[defer.Deferred[str | None]] = set()
        #: Whether a canary is owed: systemd was away when one was to run.
        self._owed = False
        #: systemd's returns after a loss: a canary that ran across one
        #: gives no verdict.
        self._restorations = 0
        #: Canaries begun: only the latest one's verdict is judged (a
        #: reload's, or systemd's return's, supersedes one still running).
        self._begun = 0
        #: The service is stopping: no unit is started after the stop began.
        self._stopping = False

    def verify(self) -> defer.Deferred[str | None]:
        """With containment on, run the canary and treat a fence it finds not
        enforced (or cannot verify) like an unenforced CPU fence. Fires with
        the problem, or None; never fails."""
        if self._stopping:
            return defer.succeed(None)
        if not self._context.containment_enabled():
            # No verdict is in force: one from before a reload that turned
            # containment off would describe jobs no longer fenced.
            self.verdict = None
            return defer.succeed(None)
        if not self._context.systemd_connected():
            self._verify_later("systemd is away")
            return defer.succeed(None)
        refused = self._context.units_refused()
        if refused is not None:
            # Its refusal of the canary's unit would blame the device fence.
            self._verify_later(refused)
            return defer.succeed(None)
        self._begun += 1
        config = self._context.config()
        try:
            plan = canary_plan(config)
        except RequestError as error:  # no /bin/sh, say
            problem = f"DevicePolicy could not be verified: {error.errstr}"
            return defer.succeed(self._judged(problem))
        responder = CanaryResponder(config.systemd.bus)
        try:
            key = self._context.start_process(plan, responder)
        except OSError as error:  # no fds left for its channels (EMFILE)
            problem = (
                "DevicePolicy could not be verified: the canary could not be"
                f" started: {error.strerror or error}"  # not "[Errno 24] ..."
            )
            return defer.succeed(self._judged(problem))
        verdict = responder.done.addTimeout(
            CANARY_TIMEOUT_SECONDS,
            self._context.clock(),
            onTimeoutCancel=responder.timed_out,
        )
        self._canaries.add(verdict)
        verdict.addBoth(self._settled, verdict)
        return verdict.addCallbacks(
            self._judge_run,
            self._cancelled,
            callbackArgs=(key, responder, self._restorations, self._begun),
        )

    def systemd_back(self) -> None:
        """systemd is back after a loss: a canary that ran across it gives
        no verdict. Said before anything runs one (a canary owed, or one a
        lifted version drain lets run): that one is judged."""
        self._restorations += 1

    def run_owed(self) -> None:
        """Run the canary if one is owed: it could not run when it was to
        (systemd away, the manager too old), and now can."""
        if self._owed:
            self._owed = False
            self.verify()

    def cancel_all(self) -> None:
        """The service stops: canaries awaiting their verdict are cancelled
        with their timers (their processes are abandoned with the others),
        and none is started from now on."""
        self._stopping = True
        for verdict in list(self._canaries):
            verdict.cancel()

    def _verify_later(self, why: str) -> None:
        """A canary cannot run now (``why``: systemd is away, a reload
        during an outage, say; or its manager is too old), and that says
        nothing of the fence. It runs once one can (:meth:`run_owed`); the
        verdict in force stands."""
        self._owed = True
        log.info("device policy not verified: {why}; verified once it can be", why=why)

    def _settled(self, result: Any, verdict: defer.Deferred) -> Any:
        self._canaries.discard(verdict)
        return result

    @staticmethod
    def _cancelled(failure: Failure) -> None:
        """A shutdown came first: nothing is judged (the node is not
        drained for it, nor the fence recorded as holding)."""
        failure.trap(defer.CancelledError)
        log.info("device policy not verified: the service stopped first")

    def _judge_run(
        self,
        problem: str | None,
        key: tuple[int, int],
        responder: CanaryResponder,
        restorations: int,
        begun: int,
    ) -> str | None:
        # Stopped and reaped if it timed out; else a no-op.
        self._context.abandon(key)
        if begun != self._begun:
            return None  # a later canary gives the verdict
        # systemd away while it ran (its start refused, no answer in time,
        # its unit lost with a manager that restarted): no verdict.
        connected = self._context.systemd_connected()
        if restorations != self._restorations and connected:
            log.info("device policy not verified: systemd was away; verifying again")
            self.verify()
            return None
        if responder.systemd_away or not connected:
            self._verify_later("systemd was away while it ran")
            return None
        refused = self._context.units_refused()
        if refused is not None:  # its own refusal found it (a site's property)
            self._verify_later(refused)
            return None
        return self._judged(problem)

    def _judged(self, problem: str | None) -> str | None:
        if not self._context.containment_enabled():
            # A canary of before a reload that turned containment off: its
            # verdict is about jobs no longer fenced.
            return None
        self.verdict = {"enforced": problem is None, "problem": problem}
        if problem is None:
            log.info("device policy verified: a DevicePolicy=strict unit was refused")
            return None
        return self._context.fence_broken(
            [problem], "device-fence-failures", AdminCause.DEVICE_FENCE
        )
