"""The mapper classes: :class:`ResourceMapper` and :class:`HwlocMapper`."""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from typing import Any

from sdexec.idset import IDset
from sdexec.map.devices import DeviceFinder
from sdexec.map.topology import GPU, Topology, out_of_range, uncounted_gpus_hint
from sdexec.property import cpu_set
from sdexec.rset import ResourceSet
from sdexec.sizes import UINT64_MAX, MemoryLimit

__all__ = ["HwlocMapper", "ResourceMapper", "UnfenceableRequest", "rank_problem"]

Properties = dict[str, Any]


def rank_problem(rset: ResourceSet, rank: int) -> str | None:
    """Why ``rset`` cannot be mapped for ``rank``: it holds nothing there
    (a job must not run unconstrained because of a wrong R); else ``None``."""
    if rank in rset:
        return None
    ranks = rset.ranks.abbreviated() or "none"
    return f"R has no resources for rank {rank} (its ranks are {ranks})"


# Memory caps from extra_properties that HwlocMapper scales by the job's share
# of the node's PUs. MemoryMin and MemoryLow are protections, not caps: a
# job's protection should not shrink because it has fewer CPUs.
_SCALED_MEMORY_PROPS = ("MemoryHigh", "MemoryMax", "MemorySwapMax")
#: Those systemd takes from 1 byte: a share of them that rounds down to 0 is
#: refused. MemorySwapMax may be 0 (no swap), within any budget.
_NONZERO_SCALED = frozenset({"MemoryHigh", "MemoryMax"})

# The resource types HwlocMapper fences (map_cores, map_gpus): a rank with
# neither would run on the whole node.
_FENCED_KINDS = ("core", "gpu")


class ResourceMapper:
    """Base class for mappers from a job's resources to systemd unit properties.

    ``map()`` takes this rank's children from R and, for each resource type,
    calls ``map_<type>s`` with the ids as an idset string: R's ``core``
    goes to ``map_cores("0-3")``, ``gpu`` to ``map_gpus``, a site's ``fpga``
    to ``map_fpgas``. Types without such a method are skipped. Subclasses add
    ``map_<type>s`` methods and may override :meth:`finalize_properties`.

    Args:
        rank: this broker's rank, whose resources are taken from R.
    """

    def __init__(self, rank: int = 0) -> None:
        self._rank = rank

    @property
    def rank(self) -> int:
        """The broker rank whose resources this mapper maps."""
        return self._rank

    def map(
        self,
        R: str | Mapping[str, Any] | ResourceSet,
        extra_properties: Mapping[str, Any] | None = None,
    ) -> Properties:
        """Unit properties for this rank's share of ``R``.

        Args:
            R: the job's resource set, as R JSON, a decoded dict or a
                :class:`~sdexec.rset.ResourceSet`.
            extra_properties: the configured ``exec.sdexec-properties``,
                passed to :meth:`finalize_properties`.

        Raises:
            ValueError: R is malformed, or holds nothing for this rank (a
                job must never run unconstrained because of a wrong R), or
                a scaled memory cap in ``extra_properties`` is malformed.
            OSError: a resource could not be mapped (see the map methods).
        """
        rset = R if isinstance(R, ResourceSet) else ResourceSet(R)
        problem = rank_problem(rset, self._rank)
        if problem is not None:
            raise ValueError(problem)
        properties: Properties = {}
        for kind, ids in rset.children(self._rank).items():
            method = getattr(self, f"map_{kind}s", None)
            if method is not None:
                _merge(properties, _call(method, ids.encode()), method.__name__)
        return self.finalize_properties(
            properties, rset, extra_properties=extra_properties
        )

    def finalize_properties(
        self,
        properties: Properties,
        R: ResourceSet,
        extra_properties: Mapping[str, Any] | None = None,
    ) -> Properties:
        """Hook for properties not tied to one resource type.

        Called by :meth:`map` after all ``map_<type>s`` methods with the
        properties they made (to be changed in place *and* returned), the
        :class:`~sdexec.rset.ResourceSet`, and the ``extra_properties``
        given to :meth:`map`. This one sets ``DevicePolicy=closed`` when
        there are properties, so only devices in ``DeviceAllow`` (and the
        standard pseudo devices) can be opened; an empty dict stays empty,
        which lets a custom mapper ask for an unconstrained unit. Overrides
        should call ``super().finalize_properties(...)``.
        """
        if properties:
            properties["DevicePolicy"] = "closed"
        return properties


class HwlocMapper(ResourceMapper):
    """The default mapper: cores and GPUs through the node's hwloc topology.

    Args:
        xml: the node's topology as hwloc XML.
        rank: this broker's rank.
        root: where ``/sys``, ``/proc`` and ``/dev`` are looked up for GPU
            device nodes (tests point it at a fake tree); the properties
            still name ``/dev/...``.

    Raises:
        OSError: the XML is not an hwloc topology (EINVAL, with the XML
            parser's message), or ``hwloc-calc`` is not installed.
    """

    def __init__(self, xml: str, rank: int = 0, *, root: str = "/") -> None:
        super().__init__(rank)
        self._topology = Topology(xml)
        self._devices = DeviceFinder(root)

    @property
    def topology(self) -> Topology:
        """The node's topology (counts of PUs, cores and GPUs)."""
        return self._topology

    def map_cores(self, cores: str) -> Properties:
        """``AllowedCPUs`` (OS indices of all PUs of the logical ``cores``) and
        ``AllowedMemoryNodes`` (their NUMA nodes), as idset strings.

        ``""`` gives ``{}``. ``OSError`` (ENODEV) names cores the topology
        does not have; ``OSError`` also if ``hwloc-calc`` fails.
        """
        ids = _idset(cores, "cores")
        if not ids:
            return {}
        cpus, memory_nodes = self._topology.cpus_and_memory_nodes(ids)
        return {
            "AllowedCPUs": cpus.encode(),
            "AllowedMemoryNodes": memory_nodes.encode(),
        }

    def map_gpus(self, gpus: str) -> Properties:
        """``DeviceAllow``: ``"<path> rw"`` for each device node the logical
        ``gpus`` need, comma-separated.

        Logical GPU n is the n-th GPU in topology order (see
        :mod:`sdexec.map.topology`). ``""`` gives ``{}``. ``OSError``
        (ENODEV) names GPUs the topology does not have, GPUs whose device
        nodes cannot be found (see :mod:`sdexec.map.devices`), and GPUs that
        share their PCI function, hence their device nodes, with GPUs the
        job does not hold (AMD partitions, say), or that are part of an
        ambiguous group (GPUs hwloc shows beside as many cards, with nothing
        to tell which is which) that the job does not hold whole: one job's
        ``DeviceAllow`` would open the other's GPU. A job holding a whole
        group is given every card of it.
        """
        ids = _idset(gpus, "gpus")
        if not ids:
            return {}
        topology = self._topology
        hint = uncounted_gpus_hint(topology.uncounted_gpu_devices)
        out_of_range(ids, len(topology.gpus), "GPU", hint)
        _refuse_part_of_a_group(ids, topology.gpus)
        paths = self._devices.device_paths(topology.gpus[i] for i in ids)
        _refuse_shared_functions(ids, topology.gpus)
        return {"DeviceAllow": ",".join(f"{path} rw" for path in paths)}

    def finalize_properties(
        self,
        properties: Properties,
        R: ResourceSet,
        extra_properties: Mapping[str, Any] | None = None,
    ) -> Properties:
        """The base class's ``DevicePolicy``, then memory caps scaled.

        When ``map_cores`` set ``AllowedCPUs``, each of ``MemoryHigh``,
        ``MemoryMax`` and ``MemorySwapMax`` in ``extra_properties`` is scaled
        by allocated PUs / the node's PUs (1 at most). Values are strings,
        as all property values are: a size (``4g``, ``1.5G``, ``4096``;
        suffixes ``K M G T P E`` in either case) becomes a byte count
        (``"2147483648"``), a percentage one to 0.01% (``"23.75%"``), each
        rounded down, so that the jobs sharing the node never hold more
        than the budget together; ``infinity`` passes through unchanged.
        A value that is not a memory limit is a ``ValueError`` naming the
        property, and so is a ``MemoryHigh`` or ``MemoryMax`` whose share
        rounds down to 0 (systemd takes neither from 0);
        ``MemorySwapMax`` may (no swap). ``MemoryMin`` and ``MemoryLow``
        are never scaled.

        Raises ``ValueError`` if R gives this rank no core and no GPU, even
        when an override has already added properties of its own.
        """
        _refuse_nothing_to_fence(R, self.rank)
        super().finalize_properties(properties, R, extra_properties=extra_properties)
        if extra_properties and "AllowedCPUs" in properties:
            # As systemd reads it: a subclass's map_cores may write "0 64".
            cpus = _idset(properties["AllowedCPUs"], "AllowedCPUs", cpu_set)
            npus = self._topology.npus
            properties.update(_scaled_memory_caps(extra_properties, len(cpus), npus))
        return properties


class UnfenceableRequest(ValueError):
    """The request's R, as it is, gives the mapper nothing it could fence:
    the request's fault, not the mapper's (a mapper of a site's may raise
    it too; the service names the R option, not the mapper)."""


def _refuse_nothing_to_fence(R: ResourceSet, rank: int) -> None:
    """:class:`UnfenceableRequest` if R gives ``rank`` no core and no GPU (a
    typo such as "cores", an empty set, no children): upstream's mapper
    returns an empty AllowedCPUs there, and the job runs on every CPU of
    the node.

    Judged from R, not from the properties made so far: a subclass may add
    its own (accounting, say) before calling ``finalize_properties``, and
    those fence nothing.
    """
    children = R.children(rank)
    if any(children.get(kind) for kind in _FENCED_KINDS):
        return
    held = ", ".join(f"{kind}={ids.abbreviated()!r}" for kind, ids in children.items())
    raise UnfenceableRequest(
        f"R gives rank {rank} no cores and no GPUs to fence (its"
        f" children: {held or 'none'}): a job is never run unconstrained"
    )


def _refuse_shared_functions(ids: IDset, gpus: list[GPU]) -> None:
    """``OSError`` (ENODEV) if a GPU of ``ids`` shares its PCI function
    with a GPU outside them: its device nodes are the function's."""
    functions = {gpus[i].pci_busid for i in ids if gpus[i].pci_busid}
    others = IDset(
        gpu.index for gpu in gpus if gpu.index not in ids and gpu.pci_busid in functions
    )
    if others:
        shared = {gpus[i].pci_busid for i in others}
        sharing = IDset(i for i in ids if gpus[i].pci_busid in shared)
        verb = "share" if len(sharing) > 1 else "shares"
        raise OSError(
            errno.ENODEV,
            f"{_gpus(sharing)} {verb} the device nodes of PCI"
            f" {', '.join(sorted(str(busid) for busid in shared))} with"
            f" {_gpus(others)} the job does not hold: a job holds every GPU of a"
            " PCI function, or none",
        )


def _refuse_part_of_a_group(ids: IDset, gpus: list[GPU]) -> None:
    """``OSError`` (ENODEV) if ``ids`` hold some GPUs of an ambiguous group
    but not all: which card is theirs is unknown, and the others' cards
    would be another job's."""
    groups = dict.fromkeys(gpus[i].one_of for i in ids if gpus[i].one_of)
    for cards in groups:
        group = IDset(gpu.index for gpu in gpus if gpu.one_of == cards)
        held = ids & group
        if held != group:
            names = ", ".join(gpus[i].name for i in group)
            raise OSError(
                errno.ENODEV,
                f"the job holds only {_gpus(held)} of GPUs {group} ({names}),"
                " whose device nodes cannot be told apart (hwloc shows them"
                f" beside PCI devices {', '.join(cards)}, with nothing to tell"
                " which is which): a job holds all of them or none; schedule"
                " whole-group jobs on this node, or turn containment off"
                " ([exec] sdexec-constrain-resources = false)",
            )


def _gpus(ids: IDset) -> str:
    return f"GPU{'s' if len(ids) > 1 else ''} {ids}"


def _scaled_memory_caps(
    extra_properties: Mapping[str, Any], pus: int, npus: int
) -> Properties:
    """The caps in ``extra_properties`` scaled to a job of ``pus`` of the
    node's ``npus`` PUs, as strings.

    ``ValueError`` names a cap that is not a memory limit (left out, the
    job would run without the cap the admin asked for), or one whose share
    rounds down to nothing where systemd takes no zero.
    """
    scaled: Properties = {}
    for name in _SCALED_MEMORY_PROPS:
        if name not in extra_properties:
            continue
        configured = str(extra_properties[name])
        try:
            limit = MemoryLimit.parse(configured)
        except ValueError as error:
            raise ValueError(f"extra_properties: {name}: {error}") from None
        scaled[name] = _scaled_limit(name, configured, limit, pus, npus)
    return scaled


def _scaled_limit(
    name: str, configured: str, limit: MemoryLimit, pus: int, npus: int
) -> str:
    """``limit`` times ``pus / npus``, rounded down in the unit it is kept
    in (ten-thousandths of memory, or bytes), so that jobs sharing the
    node never add up to more than it: with a whole percent, 128 one-PU
    jobs of a 50% budget each had 1%, 128% together."""
    if limit.infinite or limit.bytes == UINT64_MAX:
        return "infinity"  # systemd's infinity, spelt so or as its number
    # Never more than the whole budget: a site's map_cores may name CPUs
    # that the topology does not count.
    pus = min(pus, npus)
    percent = limit.permyriad is not None
    amount = limit.permyriad if limit.permyriad is not None else limit.bytes
    assert amount is not None
    share = amount * pus // npus
    if share == 0 and amount > 0 and name in _NONZERO_SCALED:
        raise ValueError(_rounds_to_nothing(name, configured, percent, pus, npus))
    return str(MemoryLimit(permyriad=share) if percent else MemoryLimit(bytes=share))


def _rounds_to_nothing(
    name: str, configured: str, percent: bool, pus: int, npus: int
) -> str:
    """Why a cap's share is refused: it rounds down to 0, which systemd
    refuses for ``name`` (and a percentage below 0.01% it would write into
    the unit's file as 0%, dropped at a daemon-reload), and the least
    budget that gives this job some."""
    least = -(-npus // pus)  # of the unit the limit is kept in, rounded up
    if percent:
        unit, at_least = "0%", f"{MemoryLimit(permyriad=least)}, or to a size"
        why = "systemd keeps a percentage to 0.01%, and takes"
    else:
        unit, at_least = "0 bytes", str(least)
        why = "systemd takes"
    pu = "PU" if pus == 1 else "PUs"
    return (
        f"extra_properties: {name}: {configured!r} scaled to a job of {pus} {pu}"
        f" of the node's {npus} rounds down to {unit} ({why} {name} from 1"
        f" byte): set it to at least {at_least}"
    )


def _idset(text: str, what: str, parse: Callable[[str], IDset] = IDset) -> IDset:
    """``text`` parsed (a Flux idset; :func:`~sdexec.property.cpu_set` for
    a list as systemd reads it), an error naming ``what``."""
    try:
        return parse(text)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


def _call(method: Callable[[str], Any], ids: str) -> Mapping[str, Any]:
    result = method(ids)
    if not isinstance(result, Mapping):
        raise TypeError(
            f"{method.__name__}({ids!r}) returned {type(result).__name__},"
            " not a dict of unit properties"
        )
    return result


def _merge(properties: Properties, mapped: Mapping[str, Any], source: str) -> None:
    """Add one map method's properties. Two methods may both allow devices
    (GPUs and a site's FPGAs, say); any other overlap is a mapper bug that
    must not be settled silently by whichever ran last."""
    for name, value in mapped.items():
        if name not in properties:
            properties[name] = value
        elif name == "DeviceAllow" and _both_str(properties[name], value):
            properties[name] = f"{properties[name]},{value}"
        else:
            raise ValueError(
                f"{source}() sets {name}, already set by another map method"
            )


def _both_str(a: object, b: object) -> bool:
    return isinstance(a, str) and isinstance(b, str)
