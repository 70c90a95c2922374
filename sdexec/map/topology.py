"""The node's hwloc topology: what it counts, and core-to-CPU mapping.

The topology arrives as hwloc XML. Counting (PUs, cores, GPUs) is done here by
reading the XML; mapping logical cores to CPU and NUMA-node OS indices is left
to ``hwloc-calc``, the tool that defines those rules, run through ``sh``. It
is asked once per kind, for every core at once (one location per line on its
standard input), the first time a core set is mapped: a core set's PUs and
NUMA nodes are the union of its cores' (``--intersect`` reports the objects
meeting the set's CPUs, and an object meets a union of cores if and only if
it meets one of them). Job starts after that spawn nothing, whatever their
core sets: a spawn blocks the service's reactor for 10-20 ms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import re
import signal
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import sh
from twisted.logger import Logger

from sdexec.idset import IDset

__all__ = [
    "GPU",
    "GPU_BACKENDS",
    "Topology",
    "TopologyXMLError",
    "live_topology_xml",
    "out_of_range",
]

_log = Logger()

# hwloc OS-device backends whose devices count as GPUs. Others (LevelZero,
# the Linux backend's bare DRM devices) do not.
GPU_BACKENDS = frozenset({"CUDA", "NVML", "OpenCL", "RSMI"})

# Seconds lstopo may take to probe the machine before the mapper gives up.
# hwloc-calc runs without one: it only reads our XML file, and sh's timeout
# watcher polls every 0.1 s, which added ~100 ms to every call (measured).
LSTOPO_TIMEOUT = 60


class TopologyXMLError(OSError):
    """An XML that is not an hwloc topology: ``EINVAL``, as upstream's mapper
    fails when hwloc cannot load it. Its own class because the XML is at
    fault, not the mapper: the configuration blames ``[sdexec] topology``
    for it, as it does a file that cannot be read."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.EINVAL, f"topology XML: {reason}")


@dataclass(frozen=True)
class GPU:
    """One logical GPU: the n-th GPU OS device in topology order."""

    index: int
    name: str  # hwloc's OS device name, e.g. "cuda0", "rsmi1"
    backend: str
    pci_busid: str | None  # "0000:01:00.0"; None when none could be found
    # Why no PCI device was found (None when one was): what the sibling
    # search saw, for the error that map_gpus raises for this GPU.
    unresolved: str | None = None
    #: The PCI devices of its ambiguous group, when it has no PCI device of
    #: its own but is one of N GPUs that hwloc shows beside the same N
    #: cards, with nothing to tell which is which: the group's GPUs are
    #: those cards, whatever the pairing, so a job holding the whole group
    #: is given every card's device nodes (and one holding part of it, none).
    one_of: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = self.pci_busid or "no PCI device"
        if self.one_of:
            where = f"one of {', '.join(self.one_of)}"
        return f"GPU {self.index} ({self.name}, {where})"


class Topology:
    """One node's hwloc topology, from its XML."""

    def __init__(self, xml: str) -> None:
        root = _parse(xml)
        # Counted as hwloc loads them (as hwloc-calc and Flux's R number
        # them): an XML written with --disallowed holds PUs a cgroup kept
        # from the node, which hwloc leaves out and numbers the rest without.
        allowed = _allowed_cpus(root)
        self.npus = _count(root, "PU", allowed)
        self.ncores = _count(root, "Core", allowed)
        self.gpus = _find_gpus(root)
        #: GPU makers' display-class PCI devices no GPU above is (nor one of
        #: an ambiguous group's): a card hwloc saw, but through no GPU
        #: backend of its own (named when a job asks for more GPUs than were
        #: counted).
        self.uncounted_gpu_devices = _uncounted_gpu_devices(root, self.gpus)
        if self.npus == 0:
            raise TopologyXMLError("it has no PU objects")
        self._hwloc_calc = _Tool("hwloc-calc")
        #: What hwloc-calc reads, from a file written for its runs only.
        self.xml = xml

    def load(self) -> None:
        """Have hwloc read the topology now, as the first core set mapped
        would: ``OSError`` if ``hwloc-calc`` cannot (an XML hwloc rejects,
        or one of a newer hwloc), so that a mapper is refused when it is
        built rather than failing every job."""
        if self.ncores:
            self._each_core  # noqa: B018 - computed (and cached) for its check

    def cpus_and_memory_nodes(self, cores: IDset) -> tuple[IDset, IDset]:
        """OS indices of the PUs of logical ``cores``, and of their NUMA nodes.

        ``OSError`` (ENODEV) names the cores the topology does not have;
        ``OSError`` also if ``hwloc-calc`` fails (it is asked again next
        time) or finds no PUs.
        """
        out_of_range(cores, self.ncores, "core")
        pus, memory_nodes = self._each_core
        cpus = IDset.union(*(pus[core] for core in cores))
        if not cpus:
            # An empty AllowedCPUs would mean "any CPU" to systemd.
            raise OSError(errno.EIO, f"hwloc-calc finds no PUs in cores {cores}")
        return cpus, IDset.union(*(memory_nodes[core] for core in cores))

    @functools.cached_property
    def _each_core(self) -> tuple[list[IDset], list[IDset]]:
        """Every core's PUs and NUMA nodes, by logical core index (not
        cached when hwloc-calc fails)."""
        locations = [f"core:{core}" for core in range(self.ncores)]
        with _topology_file(self.xml) as path:
            return (
                self._intersect("PU", locations, path),
                self._intersect("NUMAnode", locations, path),
            )

    def _intersect(self, kind: str, locations: list[str], path: str) -> list[IDset]:
        """The OS indices of the ``kind`` objects meeting each location, by
        hwloc-calc reading the topology at ``path``."""
        output = self._hwloc_calc(
            "--input",
            path,
            "--physical-output",
            "--intersect",
            kind,
            stdin="".join(f"{location}\n" for location in locations),
        )
        # One answer per location, last; before them, hwloc 2 says that it
        # is "Waiting for locations to process on stdin...".
        lines = output.splitlines()
        try:
            if len(lines) < len(locations):
                raise ValueError("fewer lines than locations")
            return [IDset(line) for line in lines[len(lines) - len(locations) :]]
        except ValueError:
            raise OSError(
                errno.EIO,
                f"hwloc-calc --intersect {kind} of {len(locations)} locations"
                f" on its standard input: unexpected output {output.strip()[:200]!r}",
            ) from None


def out_of_range(ids: IDset, count: int, what: str, hint: str = "") -> None:
    """``OSError`` (ENODEV) naming the ``ids`` not below ``count`` (and
    ``hint``, what may explain it): their first runs, and how many there
    are when there are more (a hostile R may hold hundreds of thousands,
    ``64,66,68,...``, whose list was megabytes of answer). Costs one pass
    over the runs: a set difference took seconds of the reactor for an R
    of 2.5 MiB of sparse ids."""
    missing = ids.at_least(count)
    if missing:
        many = len(missing) > 1
        raise OSError(
            errno.ENODEV,
            f"{what}{'s' if many else ''} {missing.abbreviated()}"
            f" {'are' if many else 'is'} beyond the topology's"
            f" {count} {what}{'' if count == 1 else 's'}{hint}",
        )


def uncounted_gpus_hint(devices: list[str]) -> str:
    """Why a topology may count fewer GPUs than the node has: the cards
    hwloc shows only as PCI devices. Its GPU backends start the GPU's
    driver in lstopo (NVIDIA's OpenCL starts CUDA's), which the service's
    own unit may keep from working."""
    if not devices:
        return ""
    return (
        f"; hwloc shows GPU-class PCI devices {', '.join(devices)} with no"
        " CUDA, NVML, OpenCL or RSMI device: is hwloc's GPU backend"
        " installed for lstopo, and may it start the GPU's driver in this"
        " service's unit (DeviceAllow=, SystemCallFilter=,"
        " MemoryDenyWriteExecute=; share/doc/sdexec/operating.md)?"
    )


def live_topology_xml() -> str:
    """This machine's topology as hwloc XML, from ``lstopo-no-graphics``.

    Its exit status and the XML decide, not its stderr: lstopo shows hwloc's
    non-critical messages itself (an Intel VMD PCI domain ignored, a
    firmware's topology complaints) on nodes whose XML is whole, so they
    are logged, not taken for a failure."""
    lstopo = _Tool("lstopo-no-graphics", timeout=LSTOPO_TIMEOUT, warns=True)
    return lstopo("--of", "xml", "-")


@contextlib.contextmanager
def _topology_file(xml: str) -> Iterator[str]:
    """The path of a temporary file holding ``xml``, for hwloc-calc's runs
    (they come once, when the mapper is built): removed after them, so that
    no stop leaves it behind (twistd ends a SIGTERM by killing itself with
    it, so no exit handler runs), and no descriptor outlives them.
    ``OSError`` naming the directory if it cannot be written (``ENOSPC``: a
    full ``$TMPDIR``, the system unit's ``/run/sdexec``)."""
    try:
        descriptor, path = tempfile.mkstemp(prefix="sdexec-topology-", suffix=".xml")
    except OSError as error:
        raise _unwritable(error) from None
    try:
        try:
            with open(descriptor, "w") as file:
                file.write(xml)
        except OSError as error:
            raise _unwritable(error) from None
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _unwritable(error: OSError) -> OSError:
    """``error`` of the topology's temporary copy, naming its directory
    (a write to a descriptor names no file)."""
    return OSError(
        error.errno,
        f"writing the topology for hwloc-calc in {tempfile.gettempdir()}:"
        f" {error.strerror}",
    )


def _parse(xml: str) -> ET.Element:
    """The XML's root; :class:`TopologyXMLError` if it is not an hwloc
    topology."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as error:
        # Expat's own words ("not well-formed (invalid token)", "no element
        # found"): a prefix of ours said "not well-formed" twice.
        raise TopologyXMLError(str(error)) from None
    if root.tag != "topology":
        raise TopologyXMLError(
            f"the root element is <{root.tag}>, not hwloc's <topology>"
        )
    return root


def _count(root: ET.Element, kind: str, allowed: int | None) -> int:
    """The ``kind`` objects that have a PU in ``allowed`` (``None``: all)."""
    return sum(
        1
        for obj in root.iter("object")
        if obj.get("type") == kind
        and (allowed is None or _bitmap(obj.get("cpuset", "")) & allowed)
    )


def _allowed_cpus(root: ET.Element) -> int | None:
    """The PUs hwloc loads from the XML: its root's ``allowed_cpuset``, as
    a bitmap (``None``: all, where the XML does not say)."""
    machine = root.find("object")
    allowed = machine.get("allowed_cpuset") if machine is not None else None
    return _bitmap(allowed) if allowed else None


def _bitmap(text: str) -> int:
    """An hwloc bitmap string (``0x0000ffff``; 32-bit words most significant
    first, ``0xffffffff,,0x0`` with empty words 0; led by ``0xf...f,``, every
    higher bit set too) as an int (negative when infinite)."""
    words = text.split(",")
    infinite = words[0] == "0xf...f"
    bits = 0
    try:
        for word in words[1:] if infinite else words:
            bits = bits << 32 | (int(word, 16) if word else 0)
    except ValueError:
        raise TopologyXMLError(f"{text!r} is not an hwloc cpuset") from None
    length = len(words) - infinite
    return bits | (-1 << 32 * length) if infinite else bits


def _find_gpus(root: ET.Element) -> list[GPU]:
    """GPU OS devices in topology order, one per card.

    A card seen through several backends (CUDA and OpenCL, say) counts once,
    under the first backend met; devices sharing a PCI function under the
    *same* backend (AMD partitions) each count. A device without a PCI
    ancestor is resolved to a PCI device beside it (:class:`_SiblingSearch`),
    or else may be one of an ambiguous group (:func:`_whole_groups`).
    """
    found = [
        (obj, pci_busid)
        for obj, pci_busid in _objects_with_pci_ancestor(root)
        if obj.get("type") == "OSDev" and _info(obj, "Backend") in GPU_BACKENDS
    ]
    siblings = _SiblingSearch(
        root, [(busid, _info(obj, "Backend") or "") for obj, busid in found if busid]
    )
    first_backend: dict[str, str] = {}
    gpus: list[GPU] = []
    for obj, pci_busid in found:
        backend = _info(obj, "Backend") or ""
        unresolved: str | None = None
        candidates: tuple[str, ...] = ()
        if pci_busid is None:
            if siblings.seen_through_another_backend(obj):
                continue
            pci_busid, unresolved, candidates = siblings.resolve(obj)
        if pci_busid and first_backend.setdefault(pci_busid, backend) != backend:
            continue
        name = obj.get("name", "?")
        gpus.append(GPU(len(gpus), name, backend, pci_busid, unresolved, candidates))
    return _whole_groups(gpus, siblings.claimed)


def _whole_groups(gpus: list[GPU], claimed: set[str]) -> list[GPU]:
    """``gpus``, each ambiguous one keeping its candidates (``one_of``) only
    when they make a whole group: as many GPUs saw exactly those candidates
    as there are of them, and none of them is claimed by another GPU (one
    resolved to it later) or is a candidate of another group. Only then are
    the group's device nodes its GPUs' and no other's; any other ambiguous
    GPU stays unresolved, and fails closed as before."""
    members = Counter(gpu.one_of for gpu in gpus if gpu.one_of)
    candidates = Counter(busid for group in members for busid in group)
    taken = claimed | {busid for busid, groups in candidates.items() if groups > 1}

    def whole(group: tuple[str, ...]) -> bool:
        return members[group] == len(group) and not taken.intersection(group)

    return [
        gpu
        if not gpu.one_of or whole(gpu.one_of)
        else dataclasses.replace(gpu, one_of=())
        for gpu in gpus
    ]


# PCI vendor ids of GPU makers, by a word of hwloc's GPUVendor string (which
# is the backend's: OpenCL says "NVIDIA Corporation", "Advanced Micro
# Devices, Inc.", "Intel(R) Corporation").
_VENDOR_IDS = {
    "nvidia": "10de",
    "amd": "1002",
    "advanced micro": "1002",
    "intel": "8086",
}
# Backends that only ever show one vendor's GPUs, for a device without GPUVendor.
_BACKEND_VENDOR_IDS = {"CUDA": "10de", "NVML": "10de", "RSMI": "1002"}


class _SiblingSearch:
    """Finds the PCI device of a GPU OS device that hwloc put beside it.

    hwloc sometimes cannot tie an OS device to its PCI function (OpenCL on a
    VM's GPU, seen on an H100 node) and leaves it under the host bridge, next
    to the PCI device. Candidates are PCI devices of class 03xx (display
    controllers) whose vendor id is the GPU's and that no other GPU OS device
    has claimed (is under, or was resolved to before, in topology order).
    The search starts with the OS device's parent and its subtree, and widens
    one ancestor at a time; the first level with any candidate decides, and
    only a single candidate there is an answer: two are ambiguous, and the
    GPU stays unresolved (fail closed) with a reason naming what was found,
    and the candidates it saw (its group's, see :func:`_whole_groups`).
    """

    def __init__(self, root: ET.Element, claims: list[tuple[str, str]]) -> None:
        self._parents = {child: obj for obj in root.iter() for child in obj}
        #: The backends of the GPU OS devices that claim each PCI device.
        self._claimed: dict[str, set[str]] = {}
        for busid, backend in claims:
            self._claimed.setdefault(busid, set()).add(backend)

    @property
    def claimed(self) -> set[str]:
        """The bus ids claimed so far."""
        return set(self._claimed)

    def resolve(
        self, osdev: ET.Element
    ) -> tuple[str | None, str | None, tuple[str, ...]]:
        """(the PCI bus id, None, ()), or (None, why none was chosen, the
        candidates when they were several)."""
        vendor = _gpu_vendor_id(osdev)
        if vendor is None:
            described = _info(osdev, "GPUVendor") or "none given"
            why = f"its vendor ({described}) is not one with a known PCI id"
            return None, why, ()
        for devices in self._levels(osdev, vendor):
            candidates = [busid for busid in devices if busid not in self._claimed]
            if len(candidates) == 1:
                self._claimed[candidates[0]] = {_info(osdev, "Backend") or ""}
                return candidates[0], None, ()
            if candidates:
                return (
                    None,
                    f"{len(candidates)} unclaimed GPU-class PCI devices of vendor"
                    f" {vendor} beside it ({', '.join(candidates)}): ambiguous",
                    tuple(candidates),
                )
        why = f"no unclaimed GPU-class PCI device of vendor {vendor} beside it"
        return None, why, ()

    def seen_through_another_backend(self, osdev: ET.Element) -> bool:
        """Whether ``osdev`` is a card already counted under another backend:
        the nearest GPU-class PCI devices of its vendor are all claimed, each
        by a device of a backend other than its own (an OpenCL device beside
        the card whose CUDA device is under it). Counted again, it would be
        a GPU of no device, and would shift the ids of the GPUs after it."""
        vendor = _gpu_vendor_id(osdev)
        backend = _info(osdev, "Backend") or ""
        for devices in self._levels(osdev, vendor) if vendor else ():
            claims = [self._claimed.get(busid) for busid in devices]
            return all(claim and backend not in claim for claim in claims)
        return False

    def _levels(self, osdev: ET.Element, vendor: str) -> Iterator[list[str]]:
        """From the device's parent outwards, one ancestor at a time, the
        GPU-class PCI devices of ``vendor`` in each scope that has any."""
        scope = self._parents.get(osdev)
        while scope is not None:
            devices = [
                busid
                for obj in scope.iter("object")
                if (busid := obj.get("pci_busid")) is not None
                and obj.get("type") == "PCIDev"
                and _pci_class_and_vendor(obj) == ("03", vendor)
            ]
            if devices:
                yield devices
            scope = self._parents.get(scope)


def _uncounted_gpu_devices(root: ET.Element, gpus: list[GPU]) -> list[str]:
    """``BUSID [VENDOR:DEVICE]`` of each display-class PCI device of a GPU
    maker that no GPU in ``gpus`` is, nor is one of a group's (a BMC's VGA
    is not one)."""
    counted = {gpu.pci_busid for gpu in gpus}
    counted.update(busid for gpu in gpus for busid in gpu.one_of)
    makers = set(_VENDOR_IDS.values())
    found = []
    for obj in root.iter("object"):
        busid = obj.get("pci_busid")
        kind = _pci_class_and_vendor(obj)
        if obj.get("type") != "PCIDev" or busid in counted or kind is None:
            continue
        if kind[0] == "03" and kind[1] in makers:
            ids = obj.get("pci_type", "").split(" ")[1]
            found.append(f"{busid} {ids}")
    return found


def _gpu_vendor_id(osdev: ET.Element) -> str | None:
    described = (_info(osdev, "GPUVendor") or "").lower()
    for word, vendor in _VENDOR_IDS.items():
        if re.search(rf"\b{word}\b", described):
            return vendor
    return _BACKEND_VENDOR_IDS.get(_info(osdev, "Backend") or "")


def _pci_class_and_vendor(pcidev: ET.Element) -> tuple[str, str] | None:
    """(class's first two hex digits, vendor id) from hwloc's pci_type,
    ``"0302 [10de:2330] [10de:16c1] a1"``; None if it is not that shape."""
    match = re.match(
        r"([0-9a-f]{2})[0-9a-f]{2} \[([0-9a-f]{4}):", pcidev.get("pci_type", "")
    )
    return (match[1], match[2]) if match else None


def _objects_with_pci_ancestor(
    obj: ET.Element, pci_busid: str | None = None
) -> Iterator[tuple[ET.Element, str | None]]:
    """Every object, depth first (hwloc's order), with its nearest PCI device
    ancestor's bus id (the object's own when it is one)."""
    if obj.get("type") == "PCIDev":
        pci_busid = obj.get("pci_busid")
    yield obj, pci_busid
    for child in obj.iterfind("object"):
        yield from _objects_with_pci_ancestor(child, pci_busid)


def _info(obj: ET.Element, name: str) -> str | None:
    for info in obj.iterfind("info"):
        if info.get("name") == name:
            return info.get("value")
    return None


class _Tool:
    """An hwloc command-line tool, run through ``sh``. ``warns``: what it
    writes to stderr is logged, not a failure."""

    def __init__(
        self, name: str, timeout: float | None = None, warns: bool = False
    ) -> None:
        self.name = name
        self._timeout = timeout
        self._warns = warns
        try:
            self._command = sh.Command(name)
        except sh.CommandNotFound:
            raise OSError(
                errno.ENOENT, f"{name} not found on PATH (it comes with hwloc)"
            ) from None

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        """The tool's output, given ``stdin``; ``OSError`` if it fails, times
        out, or (unless it ``warns``) writes anything to stderr: hwloc-calc
        exits 0 after warning that an object does not exist, and a partial
        answer must not become a job's CPU set.
        """
        where = " ".join((self.name, *args))
        try:
            result = self._command(
                *args,
                _in=stdin,
                _tty_out=False,
                _timeout=self._timeout,
                _return_cmd=True,
            )
        except sh.ErrorReturnCode as error:
            said = _lines(error.stderr) or _how_it_ended(error.exit_code)
            raise OSError(errno.EIO, f"{where}: {said}") from None
        except sh.TimeoutException:
            raise OSError(
                errno.ETIMEDOUT, f"{where}: no answer in {self._timeout}s"
            ) from None
        if result.stderr.strip() and not self._warns:
            raise OSError(errno.EIO, f"{where}: {_lines(result.stderr)}")
        if result.stderr.strip():
            _log.warn("{where}: {said}", where=where, said=_lines(result.stderr))
        return result.stdout.decode()


def _how_it_ended(exit_code: int) -> str:
    """A tool's end that it said nothing of (sh gives a signal as -N)."""
    if exit_code >= 0:
        return f"exited with status {exit_code}, saying nothing"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = f"signal {-exit_code}"
    # SIGSYS: a seccomp filter (a unit's SystemCallFilter=) refused a call.
    hint = " (a system call filter refused it a call)" if name == "SIGSYS" else ""
    return f"killed by {name}{hint}"


def _lines(raw: bytes) -> str:
    """A tool's stderr on one line, for an error message."""
    text = raw.decode(errors="replace")
    return " / ".join(line for line in text.splitlines() if line.strip())
