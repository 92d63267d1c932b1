"""The GPU memory unified groups may hold resident when gem-schd is not given `--device-memory`: the card's total
memory less a reserve (issue 19).

The reserve is max(1 GiB, 5% of the card). What the groups' resident sets must leave free on a GPU is memory
gemini does not count: each process's CUDA context (more with lazy module loading off), the driver's own
allocations, and whatever processes outside gemini hold (a display, a monitoring agent, a job started by hand).
A fixed floor covers the contexts of a handful of processes on a small card; 5% grows with the card, whose jobs
(and so their contexts and library workspaces) grow with it: 4 GiB on an 80 GiB card. A GPU shared with work
gemini does not see needs `--device-memory` set by hand.

Where the total comes from is a plug-in point, `DeviceMemoryProbe`; gem-schd uses `NvmlProbe` (NVML through
ctypes: libnvidia-ml.so.1 comes with the driver, so no Python package is needed), tests inject their own.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Protocol

GiB = 1 << 30
RESERVE_MIN_BYTES = 1 * GiB
RESERVE_FRACTION = 0.05

NVML_LIBRARY = "libnvidia-ml.so.1"


def reserve_for(total: int) -> int:
    """The bytes left out of a card of `total` bytes: max(1 GiB, 5%)."""
    return max(RESERVE_MIN_BYTES, int(total * RESERVE_FRACTION))


def capacity_for(total: int) -> int:
    """The capacity gem-schd takes on a card of `total` bytes (0: the card is smaller than the reserve)."""
    return max(0, total - reserve_for(total))


class ProbeError(RuntimeError):
    """The GPU's memory could not be read (the text says why)."""


class DeviceMemoryProbe(Protocol):
    """How gem-schd learns the size of the GPU it serves."""

    def describe(self) -> str:
        """Which GPU and how (for logs and gem-ctl status), e.g. "NVML, GPU-1234..."."""

    def total_bytes(self) -> int:
        """The GPU's total memory in bytes. Raises ProbeError when it cannot be read. May block (gem-schd calls
        it off its event loop)."""


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def device_from_env(env: Optional[dict[str, str]] = None) -> tuple[Optional[str], int]:
    """(uuid, index) of the GPU a process with this environment would use first: CUDA_VISIBLE_DEVICES's first
    entry, a UUID ("GPU-...") or an index (NVML counts in PCI bus order, CUDA by default fastest first: the same
    on a machine of identical GPUs); none set: index 0."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "")
    first = value.split(",")[0].strip()
    if not first:
        return None, 0
    if first.isdigit():
        return None, int(first)
    return first, 0


class NvmlProbe:
    """The total memory of one GPU through NVML: by UUID (gem-schd's --device-uuid, or CUDA_VISIBLE_DEVICES's
    first entry when it is a UUID), else by index (CUDA_VISIBLE_DEVICES's first entry, else 0)."""

    def __init__(self, uuid: Optional[str] = None, index: Optional[int] = None, library: str = NVML_LIBRARY):
        if uuid is None and index is None:
            uuid, index = device_from_env()
        self.uuid = uuid
        self.index = index or 0
        self.library = library

    def describe(self) -> str:
        return f"NVML, {self.uuid}" if self.uuid else f"NVML, GPU index {self.index}"

    def total_bytes(self) -> int:
        try:
            nvml = ctypes.CDLL(self.library)
        except OSError as exc:
            raise ProbeError(f"cannot load {self.library} (no NVIDIA driver here?): {exc}") from None

        def check(rc: int, what: str) -> None:
            if rc != 0:
                try:
                    fn = nvml.nvmlErrorString
                    fn.restype = ctypes.c_char_p
                    text = (fn(rc) or b"").decode(errors="replace")
                except (AttributeError, OSError):
                    text = ""
                raise ProbeError(f"{what} failed: NVML error {rc}{f' ({text})' if text else ''}")

        try:
            check(nvml.nvmlInit_v2(), "nvmlInit_v2")
        except AttributeError:
            raise ProbeError(f"{self.library} has no nvmlInit_v2") from None
        try:
            handle = ctypes.c_void_p()
            if self.uuid:
                if self.uuid.startswith("MIG-"):
                    raise ProbeError(f"{self.uuid} is a MIG instance: give gem-schd --device-memory")
                check(nvml.nvmlDeviceGetHandleByUUID(self.uuid.encode(), ctypes.byref(handle)),
                      f"nvmlDeviceGetHandleByUUID({self.uuid})")
            else:
                check(nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(self.index), ctypes.byref(handle)),
                      f"nvmlDeviceGetHandleByIndex_v2({self.index})")
            memory = _NvmlMemory()
            check(nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)), "nvmlDeviceGetMemoryInfo")
            if memory.total <= 0:
                raise ProbeError("NVML reports 0 bytes of memory")
            return int(memory.total)
        except AttributeError as exc:
            raise ProbeError(f"{self.library} lacks a function gem-schd needs: {exc}") from None
        finally:
            nvml.nvmlShutdown()
