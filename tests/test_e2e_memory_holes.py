"""End to end on the simulated driver: memory the driver still holds stays counted, and memory it freed does not.

* VMM: a physical allocation (cuMemCreate) is freed when no handle reference and no mapping is left, so a
  `create, map, release` allocation stays counted until it is unmapped (issue 17, item 1), and
  cuMemRetainAllocationHandle's reference keeps it too.
* Context teardown: cuCtxDestroy, cuDevicePrimaryCtxReset (cudaDeviceReset) and the last
  cuDevicePrimaryCtxRelease free the context's allocations in the driver; the group gets them back (item 2).
* A restarted pod manager counts what the processes of the group hold before it grants anything new (item 3).

Each check looks at both sides: the group's count at its pod manager, and the device memory the (simulated)
driver really holds, read by a process without the hook.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.harness import TRANSPORTS, Group
from tests.e2e_fixtures import CLIENTS_DIR, CUDA_ERROR_OUT_OF_MEMORY, MiB, Holder, Sim, wait_for
from tests.test_faults import daemon_pid, mem_used, pmgr_ready

LIMIT = 256 * MiB


def group_used(be, group: str) -> int:
    """The group's memory in use as its pod manager counts it (asked as a fresh client of the group)."""
    return mem_used(be.ports[group], group)


DEVICE_USED = ("import ctypes; cu = ctypes.CDLL('libcuda.so.1'); b = ctypes.byref; cu.cuInit(0); "
               "d, c, f, t = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(); "
               "cu.cuDeviceGet(b(d), 0); cu.cuCtxCreate_v2(b(c), 0, d); cu.cuMemGetInfo_v2(b(f), b(t)); "
               "print(t.value - f.value)")


def device_used(sim: Sim) -> int:
    """Device memory the simulated driver holds for every process, read without the hook."""
    out = subprocess.run([sys.executable, "-c", DEVICE_USED], env=sim.env(), capture_output=True, text=True,
                         timeout=30, check=True)
    return int(out.stdout.strip())


class MemHolder(Holder):
    """tests/clients/memholder.py: holds memory as it is told."""

    def __init__(self, sim: Sim, be, group: str):
        super().__init__([sys.executable, str(CLIENTS_DIR / "memholder.py")], sim.hooked(be, group))

    def do(self, command: str) -> list[int]:
        return self.ask(command)

    def ok(self, command: str) -> None:
        rcs = self.ask(command)
        assert rcs and all(rc == 0 for rc in rcs), (command, rcs)


@pytest.fixture
def group(sim, backends):
    """A group with a 256 MiB limit, and a function that says what it and the device hold."""
    be = backends([Group("g", 0.0, 1.0, f"{LIMIT}")])
    base = device_used(sim)     # the reading process's own context

    def held() -> tuple[int, int]:
        return group_used(be, "g"), device_used(sim) - base
    return be, held


def test_mapped_vmm_memory_stays_counted_until_unmapped(sim, group):
    """create, map, release: the driver keeps the memory (the mapping holds it), and so does the group's count,
    until the unmap. Before the fix the release gave the bytes back while the memory stayed mapped, and the
    group could allocate its limit again on top (a 1 GiB group held 1536 MiB)."""
    be, held = group
    h = MemHolder(sim, be, "g")
    try:
        h.ok(f"vmm {192 * MiB}")                        # mapping 0: its handle released at once
        assert held() == (192 * MiB, 192 * MiB)
        assert h.do(f"alloc {128 * MiB}") == [CUDA_ERROR_OUT_OF_MEMORY]    # 320 MiB would pass the limit
        h.ok(f"alloc {64 * MiB}")
        assert held() == (256 * MiB, 256 * MiB)
        h.ok("unmap 0")                                 # the last reference: the driver frees it
        assert held() == (64 * MiB, 64 * MiB)
        h.ok(f"alloc {128 * MiB}")
    finally:
        h.close()
    assert held() == (0, 0)


def test_a_retained_handle_keeps_unmapped_vmm_memory_counted(sim, group):
    """cuMemRetainAllocationHandle returns one more reference to the handle behind a mapping: the unmap then
    leaves the memory allocated, and only the release of that reference frees it. The other order too: a handle
    kept (not released) outlives its unmap, and is freed by its release."""
    be, held = group
    h = MemHolder(sim, be, "g")
    try:
        h.ok(f"vmm {64 * MiB}")                         # mapping 0, handle released
        h.ok("retain 0")
        h.ok("unmap 0")
        assert held() == (64 * MiB, 64 * MiB)
        h.ok("release 0")
        assert held() == (0, 0)
        h.ok(f"vmmkeep {32 * MiB}")                     # mapping 1, handle kept
        h.ok("unmap 1")
        assert held() == (32 * MiB, 32 * MiB)
        h.ok("release 1")
        assert held() == (0, 0)
        assert h.do("release 1") != [0]                 # no reference left: the driver refuses, nothing changes
        assert held() == (0, 0)
    finally:
        h.close()


def test_destroying_a_context_gives_its_memory_back(sim, group):
    """cuCtxDestroy frees the context's allocations and arrays in the driver; the group gets them back (before
    the fix they stayed counted, and the next allocation was refused: a false out-of-memory)."""
    be, held = group
    h = MemHolder(sim, be, "g")
    try:
        h.ok(f"alloc {16 * MiB}")                       # in the primary context: stays
        h.ok("ctx_create")
        h.ok(f"alloc {160 * MiB}")
        h.ok(f"array {32 * MiB}")
        assert held() == (208 * MiB, 208 * MiB)
        h.ok("ctx_destroy")
        assert held() == (16 * MiB, 16 * MiB)
        h.ok(f"alloc {224 * MiB}")
    finally:
        h.close()


@pytest.mark.parametrize("how", ["reset", "reset_procaddr", "release_primary"])
def test_resetting_the_primary_context_gives_its_memory_back(sim, group, how):
    """cudaDeviceReset (cuDevicePrimaryCtxReset_v2, exported or from cuGetProcAddress) and the release of the
    primary context's last reference free its allocations; VMM memory is the process's, not the context's: it
    stays allocated and counted."""
    be, held = group
    h = MemHolder(sim, be, "g")
    try:
        h.ok(f"vmm {32 * MiB}")
        h.ok(f"alloc {192 * MiB}")
        assert held() == (224 * MiB, 224 * MiB)
        h.ok(how)
        assert held() == (32 * MiB, 32 * MiB)
        if how == "release_primary":
            h.ok("retain_primary")
        h.ok(f"alloc {192 * MiB}")
        assert held() == (224 * MiB, 224 * MiB)
    finally:
        h.close()
    assert held() == (0, 0)


def test_a_primary_context_release_that_is_not_the_last_changes_nothing(sim, group):
    """A release that leaves a reference (the context stays active) frees nothing, and nothing is given back."""
    be, held = group
    h = MemHolder(sim, be, "g")
    try:
        h.ok("retain_primary")                          # two references now
        h.ok(f"alloc {128 * MiB}")
        h.ok("release_primary")
        assert held() == (128 * MiB, 128 * MiB)
        assert h.do(f"alloc {192 * MiB}") == [CUDA_ERROR_OUT_OF_MEMORY]
    finally:
        h.close()


def answers(be, group: str) -> bool:
    """The group's pod manager is up and knows its limit (False while it is not listening yet)."""
    try:
        return pmgr_ready(be.ports[group], group)
    except OSError:
        return False


# --- a restarted pod manager counts an idle holder again before it grants anything new (item 3) ---------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_pod_manager_counts_an_idle_holder_before_granting(sim, backends, transport):
    """A process holds 96 MiB of a 128 MiB group and makes no call. The group's pod manager is SIGKILLed and
    launch-backend restarts it. The new one learns from its predecessor's ledger that the process held memory,
    and holds the group's allocations until it re-announced (its hook reconnects at once, without a CUDA call):
    a newcomer's 64 MiB is refused, and the count is 96 MiB again. Before the fix the new pod manager started
    from zero and granted the 64 MiB (the group held 160 MiB of its 128)."""
    be = backends([Group("g", 0.0, 1.0, f"{128 * MiB}")], transport=transport)
    idle = MemHolder(sim, be, "g")
    try:
        idle.ok(f"alloc {96 * MiB}")
        assert group_used(be, "g") == 96 * MiB
        old = daemon_pid(be, "g")
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: daemon_pid(be, "g") != old, 10, what="gem-pmgr g restarted")
        wait_for(lambda: answers(be, "g"), 10, step=0.02, what="the new gem-pmgr g registered")
        newcomer = MemHolder(sim, be, "g")
        try:
            assert newcomer.do(f"alloc {64 * MiB}") == [CUDA_ERROR_OUT_OF_MEMORY]
            assert group_used(be, "g") == 96 * MiB
            newcomer.ok(f"alloc {32 * MiB}")
        finally:
            newcomer.close()
        # the idle process never made a call: its hook re-announced on its own
        assert idle.proc.poll() is None
    finally:
        done = idle.close()
    assert done.rc == 0, done
    assert sim.stats_of(idle.pid)["reconnects"] == 1
