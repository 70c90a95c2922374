"""Resource containment: Flux's sdexec-mapper, joined to the service.

:class:`Containment` is built once per configuration: it loads the
configured mapper class (``[sdexec] mapper``, ``mapper-searchpath``) with
the node's topology, then turns each request's ``SDEXEC_R_LOCAL`` into unit
properties. After the unit starts, :func:`check_cpu_fence` and
:func:`check_memory_node_fence` verify that the CPU and NUMA node sets are
really enforced: a node whose cpuset controller is not delegated to the user
manager (any cgroup v1 node, for one) stores ``AllowedCPUs`` and
``AllowedMemoryNodes`` but applies neither, and must not keep running jobs
unfenced.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sdexec.command import Command
from sdexec.config import Config, ConfigError, read_text_file, site_reserved_reason
from sdexec.idset import IDset
from sdexec.map import ResourceMapper, create_mapper
from sdexec.map.mapper import UnfenceableRequest, rank_problem
from sdexec.map.topology import TopologyXMLError
from sdexec.procfs import (
    cgroup_value,
    process_cgroups,
    process_exists,
    process_status,
)
from sdexec.property import (
    CONTAINMENT_PROPERTIES,
    PropertyError,
    properties_together_problem,
    split_rlimit_pairs,
    typed_property,
    unknown_property_reason,
)
from sdexec.receipt import unit_cgroup_exists
from sdexec.rset import ResourceSet
from sdexec.sizes import UINT64_MAX, MemoryLimit

__all__ = [
    "MEMORY_NOT_ENFORCED",
    "Containment",
    "FenceVerdict",
    "Fences",
    "MapperError",
    "check_cpu_fence",
    "check_memory_node_fence",
    "enforced_cpus",
    "enforced_mems",
    "judge_fences",
    "map_resources",
    "memory_cap_in_force",
    "request_resources",
]

R_OPTION = "SDEXEC_R_LOCAL"

#: Failures of the machine, not of the file, while a mapper is built (lstopo
#: timing out at boot, no memory or descriptors, a full ``/run`` or quota
#: under the topology's temporary copy): a later start may succeed.
_PASSING = frozenset(
    {
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EINTR,
        errno.ENOMEM,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOSPC,
        errno.EDQUOT,
    }
)


class MapperError(Exception):
    """The mapper failed for one request: the message names its class (or
    R's option, when R gives it nothing it could fence). ``reason`` says
    the same without that name, for ``python3 -m sdexec.map``, whose
    command line named the mapper and gave R."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def request_resources(command: Command) -> ResourceSet | None:
    """The request's R (``SDEXEC_R_LOCAL``), ``None`` if it has none.

    ``ValueError`` naming the option and R's field when R is malformed: the
    request's fault, told the same whoever reads R (its job's time limit,
    the mapper), and before a mapper is given it.
    """
    R = command.option(R_OPTION)
    if R is None:
        return None
    try:
        return ResourceSet(R)
    except ValueError as error:
        raise ValueError(f"{R_OPTION}: {error}") from None


class Containment:
    """The configured mapper and its statistics."""

    def __init__(self, config: Config, mapper: ResourceMapper | None) -> None:
        self.enabled = config.exec.sdexec_constrain_resources
        self.mapper_class = config.sdexec.mapper
        self.mapper_searchpath = config.sdexec.mapper_searchpath
        self.extra_properties = dict(config.exec.sdexec_properties)
        self.check = config.sdexec.containment_check
        self.mapper = mapper
        #: Whether the site caps memory (``[exec.sdexec-properties]
        #: MemoryMax``, scaled by the mapper): the cap the fence check looks
        #: for. A request's own cap is its business: one the node cannot
        #: hold must not let any client drain the node.
        self.caps_memory = _caps_memory(self.extra_properties.get("MemoryMax"))

    def resources(self, command: Command) -> ResourceSet | None:
        """The request's R where containment maps it (else ``None``), read
        once for the mapper and the job's time limit. ``ValueError`` naming
        the option when it is the request's fault: R malformed, or nothing
        in it for this rank, as the mapper would refuse it (told as the
        mapper's failure, that sent the admin to the mapper)."""
        if self.mapper is None or not self.applies_to(command):
            return None
        rset = request_resources(command)
        problem = None if rset is None else rank_problem(rset, self.mapper.rank)
        if problem is not None:
            raise ValueError(f"{R_OPTION}: {problem}")
        return rset

    def checks_memory_cap(self, memory_max: str | None) -> bool:
        """Whether the fence check looks for the cap of a unit given
        ``memory_max`` (its final ``MemoryMax``): the site caps memory, and
        the unit's is a cap. A mapper may lift the site's for some jobs
        (``infinity``: the spec lets its values win), and the kernel then
        holds the unit to no limit, as asked."""
        return self.caps_memory and _caps_memory(memory_max)

    @classmethod
    def from_config(cls, config: Config) -> Containment:
        """Build the mapper when containment is on (reading the topology
        once: ``[sdexec] topology`` or the live one from lstopo).

        A :class:`~sdexec.config.ConfigError` naming the file, the key
        (``sdexec.topology``, ``sdexec.mapper``) and why, if it cannot be
        built; the caller refuses the configuration then.
        """
        if not config.exec.sdexec_constrain_resources:
            return cls(config, None)
        topology = config.sdexec.topology
        xml = None
        if topology is not None:
            try:
                xml = read_text_file(topology)
            except (OSError, UnicodeDecodeError) as error:
                raise ConfigError(
                    config.source, "sdexec.topology", f"{topology}: {_reason(error)}"
                ) from None
        try:
            mapper = create_mapper(
                config.sdexec.mapper,
                config.sdexec.mapper_searchpath,
                config.sdexec.rank,
                topology_xml=xml,
            )
        except TopologyXMLError as error:
            if topology is None:
                raise ConfigError(
                    config.source, "sdexec.mapper", f"lstopo's XML: {_reason(error)}"
                ) from None
            # The file's fault, named as one that cannot be read is.
            raise ConfigError(
                config.source, "sdexec.topology", f"{topology}: {_reason(error)}"
            ) from None
        except (ValueError, OSError) as error:
            transient = isinstance(error, OSError) and error.errno in _PASSING
            raise ConfigError(
                config.source, "sdexec.mapper", _reason(error), transient=transient
            ) from None
        return cls(config, mapper)

    def applies_to(self, command: Command) -> bool:
        """Whether this request is mapped: containment is on and it has R."""
        return (
            self.enabled
            and self.mapper is not None
            and command.option(R_OPTION) is not None
        )

    def properties(
        self, command: Command, resources: ResourceSet | None = None
    ) -> dict[str, str]:
        """The mapper's unit properties for this request (``{}`` unless it
        :meth:`applies_to` it), by :func:`map_resources`; ``resources``: its
        R already parsed (a mapper's ``map()`` takes a ``ResourceSet`` as it
        takes R's JSON)."""
        R = command.option(R_OPTION)
        if self.mapper is None or R is None or not self.applies_to(command):
            return {}
        given = resources if resources is not None else R
        return map_resources(
            self.mapper, given, self.extra_properties, self.mapper_class
        )

    def stats(self, requests: int) -> dict[str, Any]:
        """The module statistics Flux's sdexec-mapper reports."""
        return {
            "config": {
                "mapper_class": self.mapper_class,
                "mapper_searchpath": self.mapper_searchpath,
            },
            "requests": requests,
        }


def map_resources(
    mapper: ResourceMapper,
    R: ResourceSet | str,
    extra_properties: Mapping[str, str],
    mapper_class: str,
) -> dict[str, str]:
    """The unit properties ``mapper`` gives R (a ``ResourceSet``, as the
    service reads it from a request, or its JSON), with the site's
    ``extra_properties`` (``[exec.sdexec-properties]``, whose memory caps
    :class:`~sdexec.map.HwlocMapper` scales), every value a string: what
    the service gives a job, and ``python3 -m sdexec.map`` shows.

    The mapper is given the site's properties as the unit gets them, a
    ``Limit<X>=SOFT:HARD`` pair as ``Limit<X>Soft=SOFT`` and
    ``Limit<X>=HARD``, and its own pairs are split so too: a mapper
    comparing ``LimitNOFILE`` with the site's must read the hard limit the
    job gets, never ``"1024:4096"``.

    :class:`MapperError` naming ``mapper_class`` if the mapper raises,
    returns something other than a mapping, a ``Limit`` pair that is none,
    or a limit that clashes with the site's (a hard limit below its soft
    one, which every job would fail on); naming R's option if it raises
    :class:`~sdexec.map.mapper.UnfenceableRequest` (R's fault, not its).
    """
    # As the unit gets them (checked when the configuration was loaded).
    site = split_rlimit_pairs(extra_properties, "config")
    try:
        # A copy: a mapper may change what it is given.
        mapped = mapper.map(R, extra_properties=dict(site))
    except UnfenceableRequest as error:
        raise MapperError(f"{R_OPTION}: {error}", str(error)) from error
    except OSError as error:
        # The machine's (ENODEV: a core or GPU it does not have): the
        # errno goes with the answer, so "[Errno N]" would say it twice.
        raise _mapper_failed(mapper_class, _os_reason(error)) from error
    except Exception as error:  # a custom mapper may raise anything
        reason = f"{type(error).__name__}: {error}"
        raise _mapper_failed(mapper_class, reason) from error
    if not isinstance(mapped, Mapping):
        reason = f"returned {type(mapped).__name__}, not a dict of properties"
        raise MapperError(f"mapper {mapper_class} {reason}", reason)
    for name, value in mapped.items():
        refused = _name_refused(str(name))
        if refused is None and not isinstance(value, _SCALARS):
            refused = _not_a_string(name, value)
        if refused is not None:
            raise MapperError(f"mapper {mapper_class} {refused}", refused)
    # Values reach systemd as strings; a custom mapper may give ints or
    # booleans (str(True) is "True", which the property parser accepts).
    strings = {str(name): str(value) for name, value in mapped.items()}
    return _as_sent(strings, site, mapper_class)


def _as_sent(
    mapped: dict[str, str], site: Mapping[str, str], mapper_class: str
) -> dict[str, str]:
    """``mapped`` with each ``Limit<X>=SOFT:HARD`` as its two properties,
    as the site's and a request's are (a pair reaching the unit as it is
    failed every job, told as no mapper's); :class:`MapperError` naming
    the mapper for a value systemd cannot take (a pair that is none
    among them), or for a limit of its that, laid
    over the site's, systemd refuses (``LimitNOFILE=512`` under the site's
    ``LimitNOFILESoft=1024``: every job failed, told as the site's and a
    request's fault, neither of which had set it)."""
    try:
        split = split_rlimit_pairs(mapped, "containment")
        for name, value in split.items():
            # As the unit's properties are typed: a value systemd cannot
            # take failed every job as "MemoryMax: error setting property",
            # naming no mapper (the site's was fine), and the CLI showed it.
            typed_property(name, value, "containment")
    except PropertyError as error:
        raise _mapper_refused(mapper_class, f"{error.label}: {error.reason}") from None
    problem = properties_together_problem({**site, **split})
    if problem is not None:
        names, why = problem
        theirs = ", ".join(name for name in names if name in split)
        site_said = [name for name in names if name not in split]
        said = f" ({', '.join(site_said)} from [exec.sdexec-properties])"
        raise _mapper_refused(
            mapper_class, f"{theirs}: {why}{said if site_said else ''}"
        )
    return split


#: The value types a mapper may return, made strings as systemd reads them.
_SCALARS = (str, int, float)


def _name_refused(name: str) -> str | None:
    """Why a mapper may not return property ``name``, or ``None``: the
    site's own rule for ``[exec.sdexec-properties]`` (a mapper sets
    properties in the site's place), but for the fences and the slice,
    which are a mapper's to set. ``Restart=`` would run a failed job again
    behind sdexec's back, and an unknown name fails every job in systemd,
    told there without the mapper's name."""
    if name in CONTAINMENT_PROPERTIES or name == "Slice":
        return None
    reserved = site_reserved_reason(name)
    if reserved is not None:
        return f"returned {name}: reserved: {reserved}"
    unknown = unknown_property_reason(name)
    return f"returned {name}: {unknown}" if unknown is not None else None


def _not_a_string(name: str, value: object) -> str:
    """Why a mapper's value for ``name`` is refused: ``str()`` of the
    spec's own ``map_gpus`` example, a list of ``"PATH rw"``, was
    ``"['/dev/nvidia0 rw']"``, which the CLI showed as mapped and the
    service refused quoting ``"['/dev/nvidia0 rw'"``. Upstream's sdexec
    refuses any value that is no string."""
    hint = ""
    if isinstance(value, list | tuple):
        hint = ' (a list of devices is one string: "PATH rw,PATH rw")'
    return f"returned {name} as {type(value).__name__}, not a string{hint}"


def _mapper_failed(mapper_class: str, reason: str) -> MapperError:
    return MapperError(f"mapper {mapper_class} failed: {reason}", reason)


def _mapper_refused(mapper_class: str, problem: str) -> MapperError:
    """What the mapper returned, refused: ``problem`` names the property."""
    reason = f"returned {problem}"
    return MapperError(f"mapper {mapper_class} {reason}", reason)


def _reason(error: Exception) -> str:
    """An error's words for an admin: an ``OSError``'s without Python's
    ``[Errno N]`` (its errno, where it matters, travels apart)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)


def _os_reason(error: OSError) -> str:
    """An ``OSError``'s words without ``[Errno N]``, but with the files it
    names: a site mapper's missing file must be found from them alone (a
    refused request leaves no traceback)."""
    operands = [repr(name) for name in (error.filename, error.filename2) if name]
    return ": ".join([_reason(error), *operands])


def enforced_cpus(control_group: str | None, pid: int, root: str = "/") -> IDset | None:
    """The CPUs a unit's processes may really use, or ``None`` if they
    cannot be read (the process is gone, or its status hidden).

    Read in order: cgroup v2's ``cpuset.cpus.effective`` of the unit's
    cgroup, or of its nearest ancestor that has one (the cpuset controller
    need not reach the unit's: its processes are held to the ancestor's);
    cgroup v1's ``cpuset.cpus`` of the cpuset cgroup the main process is in
    (systemd makes none for a unit there). Where none is seen (a kernel
    without cpusets, a container the controller is not delegated to),
    nothing holds them: every online CPU. Never the main process's
    ``Cpus_allowed_list``: an affinity it may narrow itself (a Flux job
    shell binds itself to its cores), which proves no fence.
    """
    return _enforced_cpuset("cpus", None, control_group, pid, root, _every_cpu)


def enforced_mems(control_group: str | None, pid: int, root: str = "/") -> IDset | None:
    """The NUMA nodes a unit's processes may really allocate memory on, or
    ``None`` if they cannot be read (the process is gone, or its status
    hidden).

    Read as :func:`enforced_cpus` reads the CPUs: cgroup v2's
    ``cpuset.mems.effective`` (the unit's, or its nearest ancestor's),
    cgroup v1's ``cpuset.mems``; where none is seen, the main process's
    ``Mems_allowed_list``, which the kernel's cpuset sets and the process
    cannot change; a kernel without cpusets has none, and its processes
    may use every node.
    """
    return _enforced_cpuset(
        "mems", "Mems_allowed_list", control_group, pid, root, _every_node
    )


def _enforced_cpuset(
    kind: str,
    status_key: str | None,
    control_group: str | None,
    pid: int,
    root: str,
    unlisted: Callable[[str], IDset | None],
) -> IDset | None:
    """The cpuset ``kind`` (``cpus`` or ``mems``) in force for a unit, from
    its cgroup if it has one that says, else from ``/proc/PID/status``'s
    ``status_key`` (if any), else ``unlisted(root)``; ``None`` if the
    process is gone."""
    ids = _cgroup_cpuset(kind, control_group, pid, root)
    if ids is not None:
        return ids
    status = process_status(pid, root)
    if status is None:
        return None
    listed = status.get(status_key.encode()) if status_key else None
    if listed is None:
        return unlisted(root)
    try:
        return IDset(listed.decode("ascii"))
    except ValueError:
        return None


def _cgroup_cpuset(
    kind: str, control_group: str | None, pid: int, root: str
) -> IDset | None:
    """The cpuset ``kind`` a unit's processes are held to: v2's effective
    set of the unit's cgroup or its nearest ancestor's, else v1's of the
    main process's cpuset cgroup; ``None`` if neither says.

    The unit's cgroup is ``control_group`` (the caller's best knowledge of
    it) where that is there, else the main process's own v2 cgroup: without
    one, an enforcing v2 node read as one whose cpuset holds nothing. Only
    from a cgroup that is there are its ancestors read: one systemd pruned
    (its processes gone), or a path that is not the unit's, says nothing."""
    cgroups = process_cgroups(pid, root) or []
    unit_cgroup = _unit_v2_cgroup(control_group, cgroups, root)
    if unit_cgroup is not None:
        for cgroup in _self_and_ancestors(unit_cgroup):
            name = f"cpuset.{kind}.effective"
            ids = _ids(cgroup_value(root, "sys/fs/cgroup", cgroup, name))
            if ids is not None:
                return ids
    v1_cgroup = _v1_cgroup(cgroups, "cpuset")
    if v1_cgroup is None:
        return None
    return _ids(cgroup_value(root, "sys/fs/cgroup/cpuset", v1_cgroup, f"cpuset.{kind}"))


def _unit_v2_cgroup(
    control_group: str | None, cgroups: list[tuple[str, str]], root: str
) -> str | None:
    """The unit's v2 cgroup: ``control_group`` where that is there, else
    the main process's own (``cgroups``, its ``(controllers, path)``)."""
    candidates = (control_group, _v2_cgroup(cgroups))
    # One systemd pruned (its processes gone), or a path of another layout
    # (a hybrid node's), is not there, and its ancestors say nothing of it.
    return next((c for c in candidates if c and unit_cgroup_exists(c, root)), None)


def _self_and_ancestors(cgroup: str) -> list[str]:
    """``/a/b.slice/c.service``, ``/a/b.slice``, ``/a``, ``/``."""
    parts = [part for part in cgroup.split("/") if part]
    return ["/" + "/".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _v2_cgroup(cgroups: list[tuple[str, str]]) -> str | None:
    """The v2 (unified) cgroup among a process's ``(controllers, path)``."""
    return next((path for controllers, path in cgroups if not controllers), None)


def _v1_cgroup(cgroups: list[tuple[str, str]], controller: str) -> str | None:
    """The cgroup v1 ``controller`` cgroup (``cpuset``, ``memory``) among a
    process's ``(controllers, path)``."""
    return next(
        (path for controllers, path in cgroups if controller in controllers.split(",")),
        None,
    )


def _ids(text: str | None) -> IDset | None:
    """A cpuset file's IDs; ``None`` if unreadable, unparsable or empty (an
    empty v1 cpuset file is "not configured", not "none")."""
    try:
        ids = IDset(text) if text is not None else None
    except ValueError:
        return None
    return ids or None


def _every_cpu(root: str) -> IDset | None:
    """The CPUs the kernel has online."""
    return _online(root, "cpu")


def _every_node(root: str) -> IDset | None:
    """The NUMA nodes the kernel has: ``node/online``; a kernel without
    NUMA support has only node 0."""
    return _online(root, "node", missing=IDset("0"))


def _present_cpus(root: str) -> IDset | None:
    """The CPUs this node has, online or not: ``cpu/present`` (then
    ``cpu/possible``, then what it has online, where that cannot be read).
    Not ``possible`` first: firmware lists there CPUs the node may never
    have (an empty socket, a VM's hotplug slots), which no ``chcpu`` brings
    online."""
    return _first_listed(root, "cpu", ("present", "possible"), _every_cpu)


def _possible_nodes(root: str) -> IDset | None:
    """The NUMA nodes the kernel could ever have online (``node/possible``;
    what it has online where that cannot be read, or node 0)."""
    return _first_listed(root, "node", ("possible",), _every_node)


def _first_listed(
    root: str,
    what: str,
    lists: tuple[str, ...],
    online: Callable[[str], IDset | None],
) -> IDset | None:
    """The first of ``/sys/devices/system/WHAT/LIST`` that can be read,
    for each of ``lists`` in turn; what ``online`` gives if none can."""
    for which in lists:
        listed = _listed(root, what, which)
        if listed is not None:
            return listed
    return online(root)


def _online(root: str, what: str, missing: IDset | None = None) -> IDset | None:
    """``/sys/devices/system/WHAT/online``; ``missing`` if there is none."""
    return _listed(root, what, "online", missing)


def _listed(
    root: str, what: str, which: str, missing: IDset | None = None
) -> IDset | None:
    """``/sys/devices/system/WHAT/WHICH``; ``missing`` if there is none,
    ``None`` if it cannot be read."""
    try:
        path = os.path.join(root, f"sys/devices/system/{what}/{which}")
        with open(path, encoding="ascii") as file:
            return IDset(file.read().strip())
    except FileNotFoundError:
        return missing
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Fences:
    """What a unit was fenced to, to be checked once it runs: the mapper's
    CPUs and memory nodes (either may be absent), and whether the site
    caps its memory."""

    cpus: IDset | None = None
    mems: IDset | None = None
    memory_capped: bool = False

    def __bool__(self) -> bool:
        return self.cpus is not None or self.mems is not None


@dataclass
class FenceVerdict:
    """What :func:`judge_fences` found: the fences that do not hold (their
    reasons, in the order checked), and the first it could not check
    because the process had exited (then none after it was)."""

    problems: list[str] = field(default_factory=list)
    unchecked: str | None = None


def judge_fences(
    fences: Fences,
    control_group: str | None,
    pid: int,
    first_only: bool = True,
    root: str = "/",
    bus: str = "user",
) -> FenceVerdict:
    """Check ``fences`` against what the kernel holds the unit to: CPUs,
    then memory nodes, then the memory cap; with ``first_only``, stop at
    the first that does not hold. A fence that cannot be read while the
    process lives does not hold (it cannot be verified, as the device
    canary's); once the process has exited, nothing more is checked, and
    what was read as it went is not trusted. ``bus`` names the manager that
    runs the unit (``[systemd] bus``), for the reasons' hints."""
    verdict = FenceVerdict()
    cpusets = [
        ("cpus", "its CPU fence", fences.cpus, enforced_cpus, check_cpu_fence),
        (
            "mems",
            "its memory node fence",
            fences.mems,
            enforced_mems,
            check_memory_node_fence,
        ),
    ]
    for kind, what, expected, enforced, check in cpusets:
        if expected is None:
            continue
        actual = enforced(control_group, pid, root)
        # Asked after the read, whatever it gave: a process that ended may
        # have taken its unit's cgroup with it (systemd prunes an emptied
        # unit's as it leaves running), and an ancestor's set was read.
        if not process_exists(pid, root):
            verdict.unchecked = what
            return verdict
        if actual is None:
            problem: str | None = _unverified(_FENCE_NAMES[kind], pid, root)
        else:
            problem = check(expected, actual, bus)
            if problem is not None:
                # The controller's delegation is the usual cause, but not
                # when the job asked for what the node lacks, or the slice's
                # own set left the unit nothing of its own.
                other_cause = _cause_not_delegation(
                    kind, expected, control_group, pid, root
                )
                if other_cause is not None:
                    problem = _not_enforced(
                        _FENCE_NAMES[kind], expected, actual, other_cause
                    )
        if problem is not None:
            verdict.problems.append(problem)
            if first_only:
                return verdict
    if fences.memory_capped:
        in_force = memory_cap_in_force(control_group, pid, root)
        if in_force is None:
            verdict.unchecked = "its memory cap"
        elif not in_force:
            verdict.problems.append(MEMORY_NOT_ENFORCED[bus])
    return verdict


#: The property each cpuset fence (its ``cpus`` or ``mems``) comes from.
_FENCE_NAMES = {"cpus": "AllowedCPUs", "mems": "AllowedMemoryNodes"}


#: What the kernel has online, by cpuset ``kind``.
_ONLINE = {"cpus": _every_cpu, "mems": _every_node}

#: What the node has, online or not, by cpuset ``kind``.
_ON_NODE = {"cpus": _present_cpus, "mems": _possible_nodes}

#: What a cpuset ``kind`` lists, in a reason.
_MEMBERS = {"cpus": "CPUs", "mems": "NUMA nodes"}


def _cause_not_delegation(
    kind: str, expected: IDset, control_group: str | None, pid: int, root: str
) -> str | None:
    """Why cpuset fence ``kind`` to ``expected`` does not hold, where its
    controller's delegation is not the cause: the node lacks some of
    ``expected``, or has some of it offline, or the unit's slice has none
    of it, or the node's cpuset controller is on cgroup v1; ``None`` if
    none of these."""
    return (
        _absent_cause(kind, expected, root)
        or _v1_cause(kind, pid, root)
        or _slice_cause(kind, expected, control_group, pid, root)
    )


def _v1_cause(kind: str, pid: int, root: str) -> str | None:
    """Why cpuset fence ``kind`` does not hold on a node whose cpuset
    controller is on cgroup v1 (a v1 or hybrid layout: a ``cpuset`` line
    in the main process's ``/proc/PID/cgroup``): systemd applies cpuset
    properties only on the unified hierarchy, whatever the delegation (a
    hint to delegate would send the admin the wrong way). ``None`` else."""
    if _v1_cgroup(process_cgroups(pid, root) or [], "cpuset") is None:
        return None
    return (
        f"systemd applies {_FENCE_NAMES[kind]} only on the unified cgroup v2"
        " hierarchy, and this node's cpuset controller is on cgroup v1"
    )


def _absent_cause(kind: str, expected: IDset, root: str) -> str | None:
    """``expected`` cannot be held on this node, whatever the slice or
    the delegation (an R, or a ``[sdexec] topology``, of another node
    type), in the same words on cgroup v1 and v2:

    - it names a member the node does not have at all (not in its
      ``present`` CPUs, or ``possible`` NUMA nodes): the kernel refuses the
      whole set (v2 checks a write against the possible ones, v1 against
      the online ones), and the unit keeps its slice's; so one absent SMT
      sibling of a fence that otherwise fits is enough;
    - the node has all of it, some of it offline: v1 refuses the whole set,
      and v2 gives the unit the online part, or its parent's set if none
      is online. (Asked only once the fence failed, so on v2 that part did
      not hold either.)

    ``None`` if neither, or what the node has cannot be read.
    """
    on_node = _ON_NODE[kind](root)
    if on_node is None:
        return None
    members = _MEMBERS[kind]
    missing = expected - on_node
    if missing:
        return (
            f"{missing} is not on this node, which has {members} {on_node}:"
            " the kernel refuses the whole set"
        )
    online = _ONLINE[kind](root)
    offline = expected - online if online is not None else None
    if not offline:
        return None
    return f"{offline} is offline: online {members} {online}"


def _slice_cause(
    kind: str, expected: IDset, control_group: str | None, pid: int, root: str
) -> str | None:
    """Why cpuset fence ``kind`` does not hold when the unit's slice broke
    it: the controller reaches the unit's own cgroup, but the parent's
    effective set has none of ``expected``. (The kernel gives a cgroup
    whose set has nothing in common with its parent's the parent's whole
    set: a slice that keeps housekeeping CPUs from jobs, against an R that
    still lists them.) ``None`` if the slice is not the cause."""
    unit = _unit_v2_cgroup(control_group, process_cgroups(pid, root) or [], root)
    if unit is None or unit == "/":
        return None
    name = f"cpuset.{kind}.effective"
    if _ids(cgroup_value(root, "sys/fs/cgroup", unit, name)) is None:
        return None  # no controller there: its delegation is the cause
    parent = _self_and_ancestors(unit)[1]
    held = _ids(cgroup_value(root, "sys/fs/cgroup", parent, name))
    # Only a set with nothing in common: the kernel gives a unit what it
    # asked that its parent has, so one that overlaps was never written.
    if held is None or expected & held:
        return None
    return (
        f"the slice's own cpuset is the cause: {parent} has {name}"
        f" {held}, none of the job's {expected}"
    )


#: Where each fence is read when the unit's cgroup has no cpuset.
_UNLISTED_SOURCES = {
    "AllowedCPUs": "/sys/devices/system/cpu/online",
    "AllowedMemoryNodes": "Mems_allowed_list in /proc/{pid}/status, or"
    " /sys/devices/system/node/online",
}


def _unverified(name: str, pid: int, root: str) -> str:
    """Why fence ``name`` of a living process could not be read: its
    status hidden, or what stands in for a cpuset unreadable."""
    if process_status(pid, root) is None:
        why = f"/proc/{pid}/status cannot be read (is /proc mounted hidepid?)"
    else:
        why = f"{_UNLISTED_SOURCES[name].format(pid=pid)} cannot be read"
    return (
        f"{name} could not be verified: no cpuset of the unit's cgroup says"
        f" which it may use, and {why}"
    )


def _caps_memory(configured: object) -> bool:
    if configured is None:
        return False
    # Read as the configuration and the mapper read it (" infinity" is
    # infinity; so is systemd's numeric 2**64-1).
    limit = MemoryLimit.parse(str(configured))
    return limit.percent is not None or (
        limit.bytes is not None and limit.bytes < UINT64_MAX
    )


#: cgroup v1's memory.limit_in_bytes when no limit is set (PAGE_COUNTER_MAX
#: pages); anything from 2**62 up is "none".
_V1_UNLIMITED = 2**62


def memory_cap_in_force(
    control_group: str | None, pid: int, root: str = "/"
) -> bool | None:
    """Whether the kernel holds a unit to a memory limit; ``None`` if it
    cannot be told (the process, or its cgroup, went while it was read).

    cgroup v1 (a ``memory`` line in the main process's ``/proc/PID/cgroup``):
    that memory cgroup must be the unit's own, with a limit in
    ``memory.limit_in_bytes``; a user manager's units have none of their
    own there (they sit in the session's, or a container's). cgroup v2: the
    unit's ``memory.max`` is a number; it is absent when the memory
    controller is not delegated to the manager, and ``max`` when no limit
    took. A node with no memory controller at all holds no limit.
    """
    cgroups = _process_cgroups(pid, root)
    if cgroups is None:
        if not process_exists(pid, root):
            return None
        cgroups = (None, None)  # /proc/PID/cgroup hidden (hidepid): the unit's
    v1_path, v2_path = cgroups
    if v1_path is not None:
        if control_group and v1_path.rstrip("/") != control_group.rstrip("/"):
            # Not the unit's own: a limit there (a container's, say) is not
            # the one the unit asked for.
            return False
        limit = cgroup_value(
            root, "sys/fs/cgroup/memory", v1_path, "memory.limit_in_bytes"
        )
        in_force = limit is not None and limit.isdigit() and int(limit) < _V1_UNLIMITED
    else:
        unit = (control_group or v2_path or "").lstrip("/")
        limit = (
            cgroup_value(root, "sys/fs/cgroup", unit, "memory.max") if unit else None
        )
        in_force = limit is not None and limit.isdigit()
    if not in_force and not process_exists(pid, root):
        return None  # it ended while we read: nothing to judge by
    return in_force


def _process_cgroups(pid: int, root: str) -> tuple[str | None, str | None] | None:
    """(the cgroup v1 memory controller's path, the v2 path) of ``pid``;
    ``None`` if its ``/proc/PID/cgroup`` cannot be read (it is gone)."""
    entries = process_cgroups(pid, root)
    if entries is None:
        return None
    return _v1_cgroup(entries, "memory"), _v2_cgroup(entries)


def _controller_hint(controller: str, bus: str) -> str:
    """Where to look when ``controller`` does not hold a unit of the
    manager on ``bus``, as the device canary words its reason by bus: a
    user manager has only what is delegated to it."""
    if bus == "system":
        return (
            f"does the system manager have the {controller} controller? a"
            " container must be delegated it"
        )
    return f"is the {controller} controller delegated to the user instance?"


#: The reason a unit's memory cap does not hold, by ``[systemd] bus``.
MEMORY_NOT_ENFORCED = {
    bus: "MemoryMax not enforced: the unit's cgroup has no memory limit"
    f" ({_controller_hint('memory', bus)})"
    for bus in ("user", "system")
}


def check_cpu_fence(expected: IDset, actual: IDset, bus: str = "user") -> str | None:
    """``None`` if the fence holds (the usable CPUs are within the allowed
    ones), else the reason, for the client and the drain record; its hint
    is worded for the manager on ``bus``."""
    return _check_cpuset("AllowedCPUs", expected, actual, bus)


def check_memory_node_fence(
    expected: IDset, actual: IDset, bus: str = "user"
) -> str | None:
    """``None`` if the fence holds (the usable NUMA nodes are within the
    allowed ones), else the reason, for the client and the drain record;
    its hint is worded for the manager on ``bus``."""
    return _check_cpuset("AllowedMemoryNodes", expected, actual, bus)


def _check_cpuset(name: str, expected: IDset, actual: IDset, bus: str) -> str | None:
    if actual.issubset(expected):
        return None
    # Both fences are cpuset's: a manager without the controller holds neither.
    return _not_enforced(name, expected, actual, _controller_hint("cpuset", bus))


def _not_enforced(name: str, expected: IDset, actual: IDset, why: str) -> str:
    return f"{name} not enforced: expected {expected} got {actual} ({why})"
