"""The units gem-node's device plugin advertises, which of them a container should get, and what it is given.

Pure: no gRPC, no files. Each GPU is offered to the kube-scheduler as two extended resources:

    gemini.io/gpu-percent   100 units per GPU; a container's request is its MinUtil in percent
    gemini.io/gpu-memory    one unit per 256 MiB of the GPU's memory (less a reserve); its MemoryLimit

so the scheduler never places more floors or more memory on a node than its GPUs have. Unit IDs name their
GPU ("GPU-<uuid>-pct-007", "GPU-<uuid>-mem-00042"): Allocate can tell which GPU the kubelet picked and refuse
a set that spans two.

A container's group is named after its memory units (`group_name`): the kubelet's Allocate call does not say
which pod it is for, so the name must come from what it does say, and the same units always give the same
name (gem-node recomputes it from the PodResources API after a restart). The pod that holds the units is
learned later from the kubelet; the group's pod manager admits only that pod's processes (cgroup.py).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterable

RESOURCE_PERCENT = "gemini.io/gpu-percent"
RESOURCE_MEMORY = "gemini.io/gpu-memory"
RESOURCES = (RESOURCE_PERCENT, RESOURCE_MEMORY)
PERCENT_UNITS_PER_GPU = 100
MEMORY_UNIT_BYTES = 256 << 20
_KIND = {RESOURCE_PERCENT: "pct", RESOURCE_MEMORY: "mem"}
_UNIT_RE = re.compile(r"^(?P<uuid>.+)-(?P<kind>pct|mem)-(?P<n>\d{3,6})$")
GROUP_PREFIX = "k8s-"

# Where things are inside a container (Allocate mounts them there). The host side is HostLayout's.
CONTAINER_HOOK = "/opt/gemini/lib/libgemhook.so.1"
CONTAINER_PRELOAD = "/etc/ld.so.preload"
CONTAINER_IPC_ROOT = "/run/gemini/ipc"
CONTAINER_BOARD_ROOT = "/run/gemini/board"
# The hook's settings file: a constant compiled into the hook (hook/settings.c), so a container cannot point the
# hook at another file; while it exists the hook ignores the GEMINI_* settings of the environment.
CONTAINER_SETTINGS = "/etc/gemini/hook.conf"


class AllocationError(ValueError):
    """A set of units gem-node will not give a container; the text reaches the pod's events."""


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str                 # "GPU-..." as nvidia-smi -L and cuDeviceGetUuid show it
    memory_bytes: int
    numa_node: int | None = None


@dataclass(frozen=True)
class Unit:
    gpu_uuid: str
    resource: str
    number: int


def unit_id(gpu_uuid: str, resource: str, number: int) -> str:
    width = 3 if resource == RESOURCE_PERCENT else 5
    return f"{gpu_uuid}-{_KIND[resource]}-{number:0{width}d}"


def parse_unit(device_id: str) -> Unit:
    m = _UNIT_RE.match(device_id)
    if m is None:
        raise AllocationError(f"{device_id!r} is not a gemini unit (expected GPU-<uuid>-pct-NNN or -mem-NNNNN)")
    resource = RESOURCE_PERCENT if m.group("kind") == "pct" else RESOURCE_MEMORY
    return Unit(m.group("uuid"), resource, int(m.group("n")))


@dataclass(frozen=True)
class Inventory:
    """The node's GPUs and how many units of each resource each one offers."""
    gpus: tuple[Gpu, ...]
    reserved_memory_bytes: int = 0          # per GPU: contexts, the driver, anything outside the hook's count

    def __post_init__(self) -> None:
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"a GPU is listed twice: {uuids}")
        for g in self.gpus:
            if _UNIT_RE.match(g.uuid + "-pct-000") is None or any(c.isspace() or c == "/" for c in g.uuid):
                raise ValueError(f"GPU UUID {g.uuid!r} cannot name units")

    def gpu(self, uuid: str) -> Gpu:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise AllocationError(f"GPU {uuid} is not on this node (gem-node knows {', '.join(self.uuids) or 'none'})")

    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self.gpus]

    def memory_units(self, gpu: Gpu) -> int:
        return max(0, (gpu.memory_bytes - self.reserved_memory_bytes) // MEMORY_UNIT_BYTES)

    def device_ids(self, resource: str) -> list[str]:
        """Every unit of `resource` on this node, GPU by GPU."""
        out: list[str] = []
        for g in self.gpus:
            count = PERCENT_UNITS_PER_GPU if resource == RESOURCE_PERCENT else self.memory_units(g)
            out.extend(unit_id(g.uuid, resource, n) for n in range(count))
        return out

    def gpu_of(self, device_ids: Iterable[str], resource: str) -> Gpu:
        """The one GPU all these units are on. AllocationError if they span GPUs, belong to another resource
        or to no GPU of this node, or are none at all."""
        ids = list(device_ids)
        if not ids:
            raise AllocationError(f"no {resource} units in the request")
        units = [parse_unit(d) for d in ids]
        wrong = [d for d, u in zip(ids, units) if u.resource != resource]
        if wrong:
            raise AllocationError(f"{wrong[0]} is not a {resource} unit")
        gpus = sorted({u.gpu_uuid for u in units})
        if len(gpus) > 1:
            counts = ", ".join(f"{sum(1 for u in units if u.gpu_uuid == g)} on {g}" for g in gpus)
            raise AllocationError(f"{len(ids)} {resource} units span {len(gpus)} GPUs ({counts}); gemini gives a "
                                  f"container one GPU: ask for no more than one GPU holds, or see docs/kubernetes.md")
        gpu = self.gpu(gpus[0])
        limit = PERCENT_UNITS_PER_GPU if resource == RESOURCE_PERCENT else self.memory_units(gpu)
        bad = [u.number for u in units if u.number >= limit]
        if bad:
            raise AllocationError(f"{resource} unit {bad[0]} does not exist on {gpu.uuid} ({limit} units)")
        return gpu


def group_name(memory_device_ids: Iterable[str]) -> str:
    """The group of the container that holds these memory units: the same units always give the same name.
    Printable ASCII, 16 characters, within the config's 63-character rule."""
    digest = hashlib.sha256("\n".join(sorted(memory_device_ids)).encode()).hexdigest()
    return GROUP_PREFIX + digest[:12]


def preferred_allocation(inventory: Inventory, resource: str, available: list[str], must_include: list[str],
                         size: int, hint_gpu: str | None = None) -> list[str]:
    """Which `size` units of `available` the container should get: all on one GPU.

    The GPU is the one of `must_include` if given; else `hint_gpu` (where the container's other gemini resource
    just went) if it has room; else the GPU with the least room that still fits (so large requests find a
    GPU later). Within the GPU, the lowest-numbered units. An empty list if no GPU has `size` free units: the
    kubelet then picks by itself, and Allocate refuses a choice that spans GPUs.
    """
    free: dict[str, list[str]] = {}
    for d in available:
        try:
            u = parse_unit(d)
        except AllocationError:
            continue
        if u.resource == resource:
            free.setdefault(u.gpu_uuid, []).append(d)
    for ids in free.values():
        ids.sort(key=lambda d: parse_unit(d).number)
    if must_include:
        gpus = {parse_unit(d).gpu_uuid for d in must_include}
        if len(gpus) != 1:
            return list(must_include)
        gpu = gpus.pop()
        rest = [d for d in free.get(gpu, []) if d not in must_include]
        return list(must_include) + rest[: max(0, size - len(must_include))]
    fitting = {g: ids for g, ids in free.items() if len(ids) >= size}
    if not fitting:
        return []
    if hint_gpu in fitting:
        gpu = hint_gpu
    else:
        order = {g: i for i, g in enumerate(inventory.uuids)}
        gpu = min(fitting, key=lambda g: (len(fitting[g]), order.get(g, len(order)), g))
    return fitting[gpu][:size]


# --- what a container is given -----------------------------------------------------------------------------------

def default_scheduler_root(ipc_root: str | Path) -> Path:
    """Where gem-schd's sockets go unless told: `schd` beside the group sockets' root (never mounted into a
    container: see HostLayout.schd_root)."""
    return Path(str(ipc_root).rstrip("/")).parent / "schd"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class HostLayout:
    """Where gem-node keeps, on the host, what containers get mounted."""
    hook: str = "/var/lib/gemini/lib/libgemhook.so.1"       # copied out of the node image at start
    preload: str = "/var/lib/gemini/lib/ld.so.preload"     # one line: CONTAINER_HOOK
    ipc_root: str = "/var/lib/gemini/ipc"                   # one directory per GPU, named by its UUID
    # gem-schd's board page per GPU (claims, continuations): a directory per GPU, on a tmpfs (the host's /run),
    # since the daemons write the page and a file system would write it back to disk
    board_root: str = "/run/gemini/board"
    settings_root: str = "/var/lib/gemini/conf"            # one hook settings file per group
    # gem-schd's socket per GPU, never mounted into a container: in the GPU's socket directory, which every
    # container of that GPU gets, a container's root could connect to it (a read-only mount does not stop connect())
    # and say hello as another pod's group, unregistering that group's pod manager. "": `schd` beside ipc_root.
    schd_root: str = ""

    @property
    def scheduler_root(self) -> str:
        return self.schd_root or str(default_scheduler_root(self.ipc_root))

    def ipc_dir(self, gpu_uuid: str) -> str:
        return f"{self.ipc_root.rstrip('/')}/{gpu_uuid}"

    def board_dir(self, gpu_uuid: str) -> str:
        return f"{self.board_root.rstrip('/')}/{gpu_uuid}"

    def settings_file(self, group: str) -> str:
        return f"{self.settings_root.rstrip('/')}/{group}.conf"


@dataclass(frozen=True)
class ContainerGrant:
    """The Allocate answer for one container."""
    gpu: Gpu
    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()


def hook_settings(group: str, gpu_uuid: str) -> str:
    """The hook's settings file of a group's containers (mounted read-only at CONTAINER_SETTINGS), in container
    paths. A function of the group and its GPU only, so it can be written again at any time."""
    return (f"# gemini hook settings of group {group}, written by gem-node; while this file exists the hook\n"
            f"# ignores the GEMINI_* settings of the environment\n"
            f"GEMINI_GROUP_NAME={group}\n"
            f"GEMINI_IPC_DIR={CONTAINER_IPC_ROOT}\n"
            f"GEMINI_BOARD_DIR={CONTAINER_BOARD_ROOT}/{gpu_uuid}\n")


def container_grant(inventory: Inventory, layout: HostLayout, resource: str, device_ids: list[str]) -> ContainerGrant:
    """What a container needs to be gated on the GPU of `device_ids`, and nothing more.

    Both resources give the same GPU-wide settings (the kubelet merges the answers of a container's resources,
    keeping the first of two different values, so they must agree); only the memory units name the group, and
    only their answer mounts the group's hook settings file. The hook is loaded through /etc/ld.so.preload as
    well as LD_PRELOAD, so a program that clears its environment is still gated, and takes its settings from
    the mounted file, so a program that sets GEMINI_DISABLE or GEMINI_IPC_DIR is still gated by its group. Every
    mount is read-only: the container can reach the sockets in its GPU's directory but cannot replace them,
    and can read the GPU's board page but not write it.
    """
    gpu = inventory.gpu_of(device_ids, resource)
    envs = {
        "LD_PRELOAD": CONTAINER_HOOK,
        "GEMINI_IPC_DIR": CONTAINER_IPC_ROOT,
        "NVIDIA_VISIBLE_DEVICES": gpu.uuid,
    }
    if resource == RESOURCE_MEMORY:
        envs["GEMINI_GROUP_NAME"] = group_name(device_ids)
    mounts: tuple[Mount, ...] = (
        Mount(CONTAINER_HOOK, layout.hook),
        Mount(CONTAINER_PRELOAD, layout.preload),
        Mount(f"{CONTAINER_IPC_ROOT}/{gpu.uuid}", layout.ipc_dir(gpu.uuid)),
        Mount(f"{CONTAINER_BOARD_ROOT}/{gpu.uuid}", layout.board_dir(gpu.uuid)),
    )
    if resource == RESOURCE_MEMORY:
        mounts += (Mount(CONTAINER_SETTINGS, layout.settings_file(envs["GEMINI_GROUP_NAME"])),)
    return ContainerGrant(gpu, envs, mounts)
