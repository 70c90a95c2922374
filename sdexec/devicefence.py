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
"""

from __future__ import annotations

import dataclasses
import errno
import uuid
from typing import Any

from twisted.internet import defer

from sdexec.command import Command
from sdexec.config import Config
from sdexec.containment import Containment
from sdexec.ioencode import decode_io
from sdexec.plan import ExecPlan, plan_exec
from sdexec.property import GATE_LISTS
from sdexec.protocol import ExecFlag, command_object
from sdexec.systemd.unit import wait_status

__all__ = [
    "CANARY_PROPERTIES",
    "CANARY_SCRIPT",
    "CANARY_TIMEOUT_SECONDS",
    "PROBE",
    "CanaryResponder",
    "canary_plan",
    "canary_verdict",
]

#: How long the service waits for the canary's verdict before it counts the
#: fence as not verified (a unit start takes well under a second).
CANARY_TIMEOUT_SECONDS = 30.0

#: Opens ``{device}``: exit status 0 if it could, 1 if not. Said with an
#: ``if``, not left to the redirection's own status: that is 2 in dash
#: (Debian's and Ubuntu's /bin/sh), 1 in bash, and a fence that held read as
#: "could not be verified" (the node drained at every start).
PROBE = "if true <{device}; then exit 0; fi; exit 1"

#: The allowed device, then the one outside the allow list. The exit status
#: is the verdict: 0 opened it (not enforced), 1 refused (enforced), 10 the
#: allowed device was refused, 11 there is no /dev/zero to probe.
CANARY_SCRIPT = "true </dev/null || exit 10; [ -c /dev/zero ] || exit 11; " + (
    PROBE.format(device="/dev/zero")
)
CANARY_PROPERTIES = {"DevicePolicy": "strict", "DeviceAllow": "/dev/null rw"}
OPENED, REFUSED, CONTROL_REFUSED, NO_PROBE = 0, 1, 10, 11

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
    """The canary's unit: the configured site properties and slice, the
    canary's device policy, output read (stderr says why a probe failed)."""
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
    # running and drain the node until an admin's undrain.
    kept = tuple(p for p in plan.properties if p.name not in GATE_LISTS)
    return dataclasses.replace(plan, properties=kept)


class _CanaryFence(Containment):
    """The canary's device policy, planned as containment's properties: they
    are the service's own, and a request (whose policy the canary's options
    pass) may never name a device fence."""

    def properties(self, command: Command) -> dict[str, str]:
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
        why = f"the canary was killed by signal {status & 0x7F}"
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
