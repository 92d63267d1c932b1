"""End to end: the hook's memory limits on the simulated driver, against a real backend.

The simulated device has 1 GiB; a group's MemoryLimit is enforced by the hook asking the group's pod manager
before every allocation, so refusals here come from gemini, not from the device running out.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from bench.harness import TRANSPORTS, Group, write_config
from gemini.wire import hook as hp
from tests.e2e_fixtures import (CUDA_ERROR_OUT_OF_MEMORY, GiB, MiB, Holder, Sim, client_argv, finish, read_line, run,
                                start, wait_for)
from tests.pmgr_helpers import BlockingHook

ALLOC_KINDS = ["device", "pitch", "managed", "async", "pool", "vmm", "array"]
LIMIT = 64 * MiB


def alloc_run(sim: Sim, be, group: str, kind: str, nbytes: int, *extra: object):
    """workload-linked allocating once with --alloc-kind (and freeing at exit), no kernels."""
    return run(client_argv("workload-linked", "--kernels", 0, "--alloc", nbytes, "--alloc-kind", kind, "--json",
                           *extra), sim.hooked(be, group))


def holder(sim: Sim, be, group: str, script) -> Holder:
    return Holder(client_argv("e2e", "serve", script=script), sim.hooked(be, group))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_allocation_path_is_limited(sim, backends, transport):
    """Each allocation kind is refused with CUDA_ERROR_OUT_OF_MEMORY just over the group's limit and works just
    under it; what is allocated is given back at exit (the next run starts from zero again). Either transport."""
    be = backends([Group("m", 0.0, 1.0, f"{LIMIT}")], transport=transport)
    for kind in ALLOC_KINDS:
        over = alloc_run(sim, be, "m", kind, LIMIT + 1 * MiB)
        assert over.rc == 0, over
        assert over.json["alloc"]["result"] == CUDA_ERROR_OUT_OF_MEMORY, (kind, over.json["alloc"])
        under = alloc_run(sim, be, "m", kind, LIMIT - 2 * MiB)
        assert under.rc == 0, under
        assert under.json["alloc"]["result"] == 0, (kind, under.json["alloc"])
        assert sim.stats_of(over.json["pid"])["mem_denied"] == 1, kind
        assert sim.stats_of(under.json["pid"])["mem_denied"] == 0, kind
    # far beyond the device itself: still gemini's refusal, not a crash or a device error
    huge = alloc_run(sim, be, "m", "device", 4 * GiB)
    assert huge.json["alloc"]["result"] == CUDA_ERROR_OUT_OF_MEMORY, huge


def test_meminfo_shows_the_group_limit_and_the_device(sim, backends, client_script):
    """cuMemGetInfo/cuDeviceTotalMem: total = min(limit, physical), free = min(limit - group's use, physical free)."""
    physical = sim.mem_bytes
    be = backends([Group("small", 0.0, 1.0, "64MiB"), Group("mid", 0.0, 1.0, "768MiB"),
                   Group("large", 0.0, 1.0, "4GiB")])
    small_holder = holder(sim, be, "small", client_script)
    large_holder = holder(sim, be, "large", client_script)
    try:
        assert small_holder.alloc(16 * MiB) == 0
        assert large_holder.alloc(512 * MiB) == 0
        own = 8 * MiB
        device_free = physical - 16 * MiB - 512 * MiB - own     # while the asking process holds `own`
        cases = {
            # group, expected total, expected free
            "small": (64 * MiB, 64 * MiB - 16 * MiB - own),     # the limit bounds both
            "mid": (768 * MiB, device_free),                    # the limit bounds the total, the device the free
            "large": (physical, device_free - 0),               # the device bounds both
        }
        for group, (total, free) in cases.items():
            res = alloc_run(sim, be, group, "device", own, "--meminfo")
            assert res.rc == 0 and res.json["alloc"]["result"] == 0, res
            out = res.json
            assert (out["mem_total"], out["device_total"], out["mem_free"]) == (total, total, free), (group, out)
        # the group's own view through the holder, which holds 512 MiB of 'large'
        assert large_holder.meminfo() == (physical - 16 * MiB - 512 * MiB, physical)
        assert small_holder.meminfo() == (64 * MiB - 16 * MiB, 64 * MiB)
    finally:
        small_holder.close()
        large_holder.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_allocations_never_exceed_the_limit(sim, backends, client_script, tmp_path, transport):
    """Six processes of one group allocate 3 MiB chunks as fast as they can, all at once, until refused: together
    they hold exactly floor(limit / chunk) chunks, and the pod manager counts exactly that. Either transport."""
    be = backends([Group("race", 0.0, 1.0, f"{LIMIT}")], transport=transport)
    chunk = 3 * MiB
    barrier = tmp_path / "go"
    procs = [start(client_argv("e2e", "chunks", chunk, barrier, script=client_script), sim.hooked(be, "race"),
                   stdin=subprocess.PIPE) for _ in range(6)]
    try:
        time.sleep(0.5)     # let them all initialise and connect, then start them at once
        barrier.write_text("go")
        held = []
        for p in procs:
            held.append(json.loads(read_line(p, 30)))
        assert all(h["refused_with"] == CUDA_ERROR_OUT_OF_MEMORY for h in held), held
        total = sum(h["held"] for h in held)
        assert total == LIMIT // chunk, held
        assert sum(1 for h in held if h["held"] > 0) >= 2, held    # it was a real race
        probe = BlockingHook(be.ports["race"])
        try:
            assert isinstance(probe.call(hp.Hello(pid=os.getpid(), pod_name="race")), hp.HelloAck)
            info = probe.call(hp.MemInfo())
            assert (info.used, info.limit) == (total * chunk, LIMIT), info
            for p in procs:
                assert finish(p).rc == 0     # stdin closed: they exit holding their chunks
            # every process gone: everything is back
            wait_for(lambda: probe.call(hp.MemInfo()).used == 0, timeout=5, what="the group's memory returned")
        finally:
            probe.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_limit_changed_in_the_config_applies_to_the_next_allocation(sim, backends, client_script):
    groups = [Group("live", 0.0, 1.0, "32MiB"), Group("other", 0.0, 1.0, "1GiB")]
    be = backends(groups)
    h = holder(sim, be, "live", client_script)

    def set_limit(limit: str) -> None:
        tmp = be.config_path.with_suffix(".new")
        write_config(tmp, [Group("live", 0.0, 1.0, limit), groups[1]])
        os.replace(tmp, be.config_path)     # an editor's save

    try:
        assert h.alloc(48 * MiB) == CUDA_ERROR_OUT_OF_MEMORY
        set_limit("128MiB")
        wait_for(lambda: h.meminfo()[1] == 128 * MiB, timeout=10, step=0.05, what="the raised limit")
        assert h.alloc(48 * MiB) == 0
        set_limit("16MiB")          # below what the process already holds
        wait_for(lambda: h.meminfo()[1] == 16 * MiB, timeout=10, step=0.05, what="the lowered limit")
        assert h.meminfo() == (0, 16 * MiB)
        assert h.alloc(1 * MiB) == CUDA_ERROR_OUT_OF_MEMORY
        assert h.ask("free") == [0]
        assert h.alloc(8 * MiB) == 0
    finally:
        h.close()


def test_memory_of_a_killed_process_is_reclaimed_at_once(sim, backends, client_script):
    be = backends([Group("r", 0.0, 1.0, f"{LIMIT}")])
    victim = holder(sim, be, "r", client_script)
    other = holder(sim, be, "r", client_script)
    try:
        assert victim.alloc(48 * MiB) == 0
        assert other.alloc(48 * MiB) == CUDA_ERROR_OUT_OF_MEMORY
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: other.alloc(48 * MiB) == 0, timeout=5, step=0.01, what="the killed process's memory")
        assert time.monotonic() - killed < 1.0
        assert other.alloc(16 * MiB) == 0 and other.alloc(1) == CUDA_ERROR_OUT_OF_MEMORY
    finally:
        victim.proc.wait(10)
        other.close()
