"""Unit state: systemd's unit properties read as a process's life.

systemd reports a service unit through ``ActiveState``/``SubState`` and the
``ExecMain*`` properties; RFC 42 wants *started* (a pid), *finished* (a wait
status) or an error. :class:`UnitStatus` is that translation, a pure function
of one merged property snapshot (see :class:`sdexec.systemd.UnitWatch`).

Facts this relies on, observed with systemd 252 and ``Type=exec``,
``RemainAfterExit=yes``:

- a fast process may go from *activating* straight to *active/exited* or
  *failed*: no signal ever shows *running*, so "started" is also inferred
  from a valid exit status;
- ``ExecMainCode``/``ExecMainStatus`` read 0/0 until the process exits; a
  valid code is a ``CLD_*`` value (> 0);
- ``PropertiesChanged`` comes per interface, ``Service`` (the exit status)
  and ``Unit`` (``ActiveState``), in either order, so a merged snapshot may read
  *activating/start* or *active/running* with the exit status already set:
  the exit status decides, the states settle one signal later;
- when systemd itself fails to run the command it exits the forked child with
  one of its own codes, 200-243 (203 is EXEC: the binary could not be
  executed), so such a status is a failure to execute, not an exit of the
  command. Flux's sdexec reads the same range, 200-243, so (and fails the
  request with ENOENT), as this does (less 223 and 234, which systemd never
  gives) until the command is known to have run: seen *running*, or its
  output read (after that every status is the command's own:
  :attr:`UnitStatus.command_ran`, where Flux's never says so); 244-255 are
  ordinary exits, as there;
- a unit that fails before forking reports *failed* with no exit status.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdexec.exitstatus import SYSTEMD_EXIT_NAMES
from sdexec.property import UnitProperty, property_label

__all__ = ["UnitStatus", "queued_job", "wait_status"]

CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3
#: How :meth:`UnitStatus.said` says each ``ExecMainCode``, before its status.
_ENDED = {
    CLD_EXITED: "exited",
    CLD_KILLED: "killed by signal",
    CLD_DUMPED: "dumped core on signal",
}
#: systemd's own exit codes of 200-243, as Flux's sdexec reads that range:
#: less 223 and 234, which systemd reserves ("don't reuse") and never gives,
#: while a C program's ``return -EINVAL`` from ``main`` gives 234.
SYSTEMD_EXIT_CODES = frozenset(SYSTEMD_EXIT_NAMES)

#: The errno a client sees for a systemd exit code: the binary or the working
#: directory is missing (or unusable) for EXEC and CHDIR.
EXIT_CHDIR, EXIT_FDS, EXIT_EXEC, EXIT_NAMESPACE = 200, 202, 203, 226
_EXIT_ERRNO = {EXIT_CHDIR: errno.ENOENT, EXIT_EXEC: errno.ENOENT}
#: The errno of any other failure to run the command (a setup step of the
#: unit: 217/USER, 226/NAMESPACE...), or of a unit that failed before it
#: forked: ENOENT, as Flux's sdexec answers every systemd exit code ("unit
#: process could not be started"), an ordinary exec failure to its job-exec.
#: Never EIO: job-exec reads EIO from sdexec as a failed containment check
#: and drains the node (bulkexec.c error_cb).
NOT_STARTED_ERRNO = errno.ENOENT
#: The fewest open files systemd 252 needs in a unit's process to execute
#: its command: the 3 standard streams, the pipe by which it tells the
#: manager the exec happened, and the executable it opens to execute. A
#: unit's soft ``RLIMIT_NOFILE`` below it fails the start, whatever the
#: command: 203/EXEC at 3 (no descriptor to open the executable), 202/FDS at
#: 4 (none to move it to); measured.
EXEC_NEEDS_FILES = 5


def queued_job(state: Mapping[str, Any]) -> int | None:
    """The id of the job queued for a unit (0: none), from its ``Job``
    property, ``(id, path)``; ``None`` if that was not read."""
    job = state.get("Job")
    if isinstance(job, (list, tuple)) and len(job) == 2 and isinstance(job[0], int):
        return job[0]
    return None


def never_invoked(state: Mapping[str, Any]) -> bool:
    """Whether the unit is inactive with no job queued and was never
    invoked: nothing will start it (no ``InvocationID``)."""
    return (
        state.get("ActiveState") == "inactive"
        and queued_job(state) == 0
        and not state.get("InvocationID")
    )


def start_job_ended_unstarted(state: Mapping[str, Any]) -> bool:
    """Whether a unit whose start systemd accepted shows its start job over
    without a start: :func:`never_invoked`, and no main process. A false
    ``Condition*=``, a failed ``Assert*=`` or dependency (``Requires=``,
    ``Requisite=``) ends a start job so; the unit is then unloaded, and no
    signal will say it starts."""
    return never_invoked(state) and not state.get("ExecMainPID")


def _condition_false(state: Mapping[str, Any]) -> bool:
    return bool(
        state.get("ConditionTimestampMonotonic")
        and state.get("ConditionResult") is False
    )


def _assertion_failed(state: Mapping[str, Any]) -> bool:
    return bool(
        state.get("AssertTimestampMonotonic") and state.get("AssertResult") is False
    )


def checks_failed(state: Mapping[str, Any]) -> bool:
    """A condition of the unit was false or an assertion failed, where
    systemd checked them: what ended its start job, not the job itself."""
    return _condition_false(state) or _assertion_failed(state)


def why_unstarted(state: Mapping[str, Any]) -> str:
    """Why the start job of :func:`start_job_ended_unstarted` ended: its
    conditions or assertions, where systemd checked them, else the job."""
    if _condition_false(state):
        return "a condition of the unit was false (ConditionResult=no)"
    if _assertion_failed(state):
        return "an assertion of the unit failed (AssertResult=no)"
    return (
        "its start job ended without starting it (a dependency that failed,"
        " or a job canceled)"
    )


#: Where a unit's property came from (:attr:`UnitProperty.source`), in words.
_SOURCES = {
    "request": "the request",
    "config": "[exec.sdexec-properties]",
    "containment": "the mapper",
}


def _named(prop: UnitProperty) -> tuple[str, str]:
    """``prop``'s name as its source spells it, and that source in words."""
    label = property_label(prop.name, prop.source)
    return label, _SOURCES.get(prop.source, prop.source)


def _missing(missing: tuple[UnitProperty, str]) -> str:
    """What a path the unit's sandboxing names and the node lacks says."""
    prop, path = missing
    label, source = _named(prop)
    return (
        f"{label} from {source} names {path}, which does not exist on this node"
        " (a path named without '-' must exist; '-' lets systemd skip it)"
    )


def _too_few_files(files: UnitProperty | None) -> str | None:
    """Why ``files``, the property that set a unit's soft limit of open
    files, kept systemd from executing its command; ``None`` if it
    leaves enough (or is not set: the manager's default, not known here)."""
    if files is None or not isinstance(files.value, int):
        return None
    if files.value >= EXEC_NEEDS_FILES:
        return None
    label, source = _named(files)
    return (
        f"the unit's limit of open files, {label}={files.value} from {source},"
        f" is below the {EXEC_NEEDS_FILES} that systemd needs to execute a"
        " command: the 3 standard streams and 2 of its own"
    )


def wait_status(code: int, status: int) -> int:
    """A UNIX wait status from ``ExecMainCode``/``ExecMainStatus``:
    exited → ``status << 8``; killed → the signal; dumped → signal | 0x80."""
    if code == CLD_EXITED:
        return (status & 0xFF) << 8
    if code == CLD_KILLED:
        return status & 0x7F
    if code == CLD_DUMPED:
        return (status & 0x7F) | 0x80
    raise ValueError(f"ExecMainCode {code} is not CLD_EXITED, CLD_KILLED or CLD_DUMPED")


@dataclass(frozen=True)
class UnitStatus:
    """One snapshot of a unit, read as a process's state."""

    active_state: str = ""
    sub_state: str = ""
    pid: int = 0
    code: int = 0
    status: int = 0
    result: str = ""
    #: The command is known to have been executed (its ``Type=exec`` unit
    #: was seen *running*, here or before): every exit status is then its
    #: own, 200-243 too.
    command_ran: bool = False

    @classmethod
    def from_properties(
        cls, properties: Mapping[str, Any], command_ran: bool = False
    ) -> UnitStatus:
        """Build from a merged ``Unit`` + ``Service`` property dict."""
        return cls(
            active_state=properties.get("ActiveState", ""),
            sub_state=properties.get("SubState", ""),
            pid=properties.get("ExecMainPID", 0),
            code=properties.get("ExecMainCode", 0),
            status=properties.get("ExecMainStatus", 0),
            result=properties.get("Result", ""),
            command_ran=command_ran,
        )

    def said(self) -> str:
        """The snapshot as ``[systemd] sdexec-debug`` logs it: upstream's
        ``state.substate``, then the main pid and how it ended, if it has
        (``active.exited pid 42 exited 0, result success``; ``?`` for a
        state not signalled yet, no result where none was)."""
        said = f"{self.active_state or '?'}.{self.sub_state or '?'}"
        if self.pid:
            said += f" pid {self.pid}"
        ended = _ENDED.get(self.code)
        if ended is not None:
            said += f" {ended} {self.status}"
        return f"{said}, result {self.result}" if self.result else said

    @property
    def _exited(self) -> bool:
        return self.code in (CLD_EXITED, CLD_KILLED, CLD_DUMPED)

    @property
    def _systemd_exit(self) -> bool:
        # A snapshot may show the unit still running beside the exit (the
        # Unit and Service interfaces signal apart): running already says
        # the exec succeeded, as command_ran does.
        return (
            not (self.command_ran or self._running)
            and self.code == CLD_EXITED
            and self.status in SYSTEMD_EXIT_CODES
        )

    @property
    def _running(self) -> bool:
        return self.active_state == "active" and self.sub_state == "running"

    @property
    def has_started(self) -> bool:
        """The command is (or was) running: it has a pid and either runs or
        ended with a status of its own."""
        if self.pid <= 0:
            return False
        return self._running or self.has_finished

    @property
    def has_finished(self) -> bool:
        """The command ran and ended: :attr:`wait_status` is valid."""
        return self._exited and not self._systemd_exit

    @property
    def wait_status(self) -> int:
        """The UNIX wait status; only valid when :attr:`has_finished`."""
        return wait_status(self.code, self.status)

    @property
    def has_failed(self) -> bool:
        """systemd could not run the command (see :attr:`failure`): it exited
        the child with one of its own codes."""
        return self._systemd_exit

    @property
    def failed_without_status(self) -> bool:
        """*failed* with no exit status known. systemd signals the ``Unit``
        and ``Service`` interfaces separately, so this may be a snapshot
        whose ``ExecMain*`` half has not arrived yet: confirm it with a
        fresh ``GetAll`` before believing it."""
        return self.active_state == "failed" and not self._exited

    def failure(
        self,
        executable: str,
        cwd: str | None,
        files: UnitProperty | None = None,
        missing: tuple[UnitProperty, str] | None = None,
    ) -> tuple[int, str]:
        """``(errno, message)`` for a unit that :attr:`has_failed` (or is
        confirmed :attr:`failed_without_status`). ``files`` is the property
        that set its soft limit of open files (``LimitNOFILE`` or
        ``LimitNOFILESoft``): below :data:`EXEC_NEEDS_FILES`, the message of
        203/EXEC and 202/FDS names it (not a missing ``#!`` interpreter).
        For the two failures a client can act on, the message names what
        systemd was given: the ``executable`` it could not execute
        (203/EXEC: the plan found the file executable, so the exec itself
        failed), the working directory ``cwd`` it could not enter
        (200/CHDIR; ``None``: the manager's default); either may also be a
        command's own quick ``exit``. ``missing``, a path a sandboxing
        property named that does not exist, is named for 226/NAMESPACE."""
        if not self._systemd_exit:
            return (
                NOT_STARTED_ERRNO,
                "unit failed before running the command"
                f" (result: {self.result or 'unknown'})",
            )
        name = SYSTEMD_EXIT_NAMES[self.status]
        message = (
            f"systemd could not run the command: exit status {self.status}/{name}"
            f" (result: {self.result or 'unknown'})"
        )
        starved = _too_few_files(files)
        if starved and self.status in (EXIT_EXEC, EXIT_FDS):
            # Any command fails so: not a missing #! interpreter.
            said = (
                f"cannot execute {executable} ({starved})"
                if self.status == EXIT_EXEC
                else starved
            )
            return NOT_STARTED_ERRNO, f"{message}: {said}"
        if self.status == EXIT_EXEC:
            # As for 200/CHDIR below, a command's own quick exit 203 looks
            # the same.
            message += (
                f": cannot execute {executable} (the manager's log says why: a"
                " missing #! interpreter, a binary for another machine...; or"
                f" the command itself exited {EXIT_EXEC} at once)"
            )
        elif self.status == EXIT_NAMESPACE and missing is not None:
            message += f": {_missing(missing)}"
        elif self.status == EXIT_CHDIR:
            # A command that exits 200 itself before systemd has seen the
            # exec fails its unit exactly so (systemd 252 gives nothing to
            # tell them apart): the directory may well exist.
            message += (
                f": cannot enter {cwd or 'its default working directory'}"
                f" (or the command itself exited {EXIT_CHDIR} at once: systemd"
                " tells the two apart in no way)"
            )
        return _EXIT_ERRNO.get(self.status, NOT_STARTED_ERRNO), message

    @property
    def runs_unseen_end(self) -> bool:
        """A main process is known (``ExecMainPID``) and its exit is not:
        the unit has run, and its end is still to come, whatever
        ``ActiveState`` says (the Unit interface's signal may lag the
        Service's)."""
        return self.pid > 0 and not self._exited

    @property
    def is_inactive(self) -> bool:
        """The unit is stopped: inactive/dead (its fds are released)."""
        return self.active_state == "inactive"

    @property
    def needs_stop(self) -> bool:
        """Active with the main process gone: ``StopUnit`` releases it."""
        return self.active_state == "active" and self.sub_state == "exited"

    @property
    def needs_reset(self) -> bool:
        """Failed: ``ResetFailedUnit`` lets systemd unload it."""
        return self.active_state == "failed"

    @property
    def is_deactivating(self) -> bool:
        """Stopping with processes left in the cgroup: the stop timer's cue."""
        return self.active_state == "deactivating"
