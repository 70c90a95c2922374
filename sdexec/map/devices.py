"""GPU device nodes, found through sysfs and procfs from a PCI bus id.

For a GPU at PCI function ``0000:01:00.0``:

- ``/sys/bus/pci/devices/0000:01:00.0/driver`` links to the driver, whose
  name picks the vendor rules below;
- ``/sys/bus/pci/devices/0000:01:00.0/drm/`` lists its DRM nodes
  (``renderD128``, ``card0``), which live under ``/dev/dri/``.

NVIDIA (driver ``nvidia``): ``/dev/nvidia<minor>``, the minor read from
``/proc/driver/nvidia/gpus/<pci>/information`` ("Device Minor:"), the DRM
render node, and the shared ``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
``/dev/nvidia-uvm-tools``. AMD (driver ``amdgpu``): the DRM render and card
nodes, and the shared ``/dev/kfd``. Any other driver: the DRM render and card
nodes.

Paths that do not exist are left out, but each GPU must keep the devices
that make it usable: NVIDIA's ``/dev/nvidia<minor>`` and ``/dev/nvidiactl``,
AMD's ``/dev/kfd`` and a DRM node, for other drivers a DRM node. Otherwise
the job would start with a GPU it cannot open, so that is an ``OSError``
(ENODEV) naming the GPU and the path. ``/dev/nvidia-uvm`` is CUDA's alone
(``nvidia-smi`` does without): missing, it is left out with a warning, once,
since a fenced job cannot create it on first use as ``nvidia-modprobe``
would, and its CUDA will fail.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from twisted.logger import Logger

from sdexec.map.topology import GPU

__all__ = ["DeviceFinder"]

#: NVIDIA's shared node every GPU job needs, and those CUDA's jobs need.
NVIDIA_CONTROL = "/dev/nvidiactl"
NVIDIA_UVM = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

_log = Logger()
RENDER = ("renderD",)
RENDER_AND_CARD = ("renderD", "card")


class DeviceFinder:
    """Looks GPUs' device nodes up under ``root`` (``/`` on a real node).

    ``root`` prefixes the ``/sys``, ``/proc`` and ``/dev`` lookups only: the
    paths returned are the absolute ``/dev/...`` paths a unit is given.
    """

    def __init__(self, root: str = "/") -> None:
        self._root = root
        self._said_no_uvm = False

    def device_paths(self, gpus: Iterable[GPU]) -> list[str]:
        """Device nodes for ``gpus``: each GPU's own, then the shared ones,
        each path once. A GPU of an ambiguous group (``one_of``) is given
        every card of its group: the mapper gives it only to a job that
        holds the whole group."""
        own: list[str] = []
        shared: list[str] = []
        for gpu in gpus:
            for pci_busid in _pci_devices(gpu):
                card_own, card_shared = self._devices(gpu, pci_busid)
                own += card_own
                shared += card_shared
        return list(dict.fromkeys(own + shared))

    def _devices(self, gpu: GPU, pci_busid: str) -> tuple[list[str], list[str]]:
        """(the own device nodes of ``gpu``'s card ``pci_busid``, the shared
        ones it needs)."""
        self._require_pci_device(gpu, pci_busid)
        driver = self._driver(pci_busid)
        if driver == "nvidia":
            own = self._nvidia(gpu, pci_busid)
            uvm = self._existing(NVIDIA_UVM)
            if NVIDIA_UVM[0] not in uvm:
                self._say_no_uvm()
            return own, [self._required(gpu, NVIDIA_CONTROL), *uvm]
        drm = self._drm_nodes(pci_busid, RENDER_AND_CARD)
        if not drm:
            raise OSError(
                errno.ENODEV,
                f"{gpu}: no DRM node (driver {driver or 'none'}): nothing under"
                f" {self._sys_pci(pci_busid, 'drm')} exists in /dev/dri",
            )
        if driver == "amdgpu":
            return drm, [self._required(gpu, "/dev/kfd")]
        return drm, []

    def _require_pci_device(self, gpu: GPU, pci_busid: str) -> None:
        """``OSError`` (ENODEV) if the node has no PCI device ``pci_busid``:
        a topology of another node, or a card gone since (an unbound
        driver's device is there, and is said as such)."""
        device = self._host(f"/sys/bus/pci/devices/{pci_busid}")
        if not os.path.isdir(device):
            raise OSError(
                errno.ENODEV,
                f"{gpu}: {device} does not exist (is the topology this node's,"
                " and the card still in it?)",
            )

    def _nvidia(self, gpu: GPU, pci_busid: str) -> list[str]:
        minor = self._nvidia_minor(gpu, pci_busid)
        main = self._required(gpu, f"/dev/nvidia{minor}")
        return [main, *self._drm_nodes(pci_busid, RENDER)]

    def _nvidia_minor(self, gpu: GPU, pci_busid: str) -> int:
        information = self._host(f"/proc/driver/nvidia/gpus/{pci_busid}/information")
        try:
            text = Path(information).read_text()
        except FileNotFoundError:
            raise OSError(
                errno.ENODEV, f"{gpu}: {information} does not exist"
            ) from None
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() != "Device Minor":
                continue
            if not value.strip().isdigit():
                raise OSError(
                    errno.ENODEV,
                    f"{gpu}: {information}: Device Minor {value.strip()!r}"
                    " is not a number",
                )
            return int(value)
        raise OSError(errno.ENODEV, f"{gpu}: {information} has no Device Minor line")

    def _driver(self, pci_busid: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self._sys_pci(pci_busid, "driver")))
        except OSError:
            return None  # no driver bound: only generic DRM nodes can help

    def _drm_nodes(self, pci_busid: str, prefixes: tuple[str, ...]) -> list[str]:
        """Existing ``/dev/dri`` nodes of the device, by prefix order, then name."""
        try:
            names = os.listdir(self._sys_pci(pci_busid, "drm"))
        except OSError:
            return []
        return self._existing(
            f"/dev/dri/{name}"
            for prefix in prefixes
            for name in sorted(names)
            if name.startswith(prefix)
        )

    def _required(self, gpu: GPU, path: str) -> str:
        if not os.path.exists(self._host(path)):
            raise OSError(errno.ENODEV, f"{gpu}: {self._host(path)} does not exist")
        return path

    def _say_no_uvm(self) -> None:
        if not self._said_no_uvm:
            self._said_no_uvm = True
            _log.warn(
                "{path} does not exist: GPU jobs are given no CUDA (a job fenced"
                " with DevicePolicy=closed cannot create it on first use); load"
                " nvidia-uvm at boot (nvidia-modprobe -u -c=0)",
                path=self._host(NVIDIA_UVM[0]),
            )

    def _existing(self, paths: Iterable[str]) -> list[str]:
        return [path for path in paths if os.path.exists(self._host(path))]

    def _sys_pci(self, pci_busid: str, entry: str) -> str:
        return self._host(f"/sys/bus/pci/devices/{pci_busid}/{entry}")

    def _host(self, path: str) -> str:
        """``path`` (absolute) as seen under this finder's root."""
        return os.path.join(self._root, path.lstrip("/"))


def _pci_devices(gpu: GPU) -> tuple[str, ...]:
    """The bus ids of the cards whose device nodes ``gpu`` needs: its own,
    or its ambiguous group's; ``OSError`` (ENODEV) when it has neither."""
    if gpu.pci_busid is not None:
        return (gpu.pci_busid,)
    if gpu.one_of:
        return gpu.one_of
    why = f", and {gpu.unresolved}" if gpu.unresolved else ""
    raise OSError(
        errno.ENODEV,
        f"{gpu}: hwloc shows no PCI device above it{why}, so its device"
        " nodes cannot be found",
    )
