"""End to end on the simulated driver: unified groups (MemoryMode = unified) swapped by gem-schd.

Three groups of 128 MiB of managed memory each share a GPU whose configured capacity (--device-memory) holds
two. The simulator's trace records every kernel and every prefetch (which ABI, which direction, how many bytes),
so the tests check from the outside what the hooks and gem-schd did: allocations made as managed memory, each
process's memory moved to the GPU before its first kernel of a slot, the least recently run group evicted before
another's prefetch starts, the resident sum never over the capacity, and the ABI the driver chose.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.harness import Group
from gemini.scheduler.trace import SchedulerTrace
from gemini.scheduler.trace import read_trace as read_sched_trace
from tests.e2e_fixtures import MiB, client_argv, finish, start, wait_for

import native

SIZE = 128 * MiB
CAPACITY = 300 * MiB       # two groups' memory fits, three do not


def unified_backend(backends, names=("a", "b", "c"), capacity=CAPACITY, min_slot_ms=None):
    extra = ["--device-memory", str(capacity)]
    if min_slot_ms is not None:
        extra.append(f"--schd-arg=--unified-min-slot={min_slot_ms}")
    return backends([Group(n, 0.0, 1.0, "1GiB", memory_mode="unified") for n in names], quota_ms=20,
                    extra_args=extra)


# Jobs of about 0.4 s of kernels each. With the default floor (2 s slots while the groups do not all fit) the
# first job could run to its end in one slot when all three had reported their memory before the first grant:
# then two fit, and no eviction was ever needed (a failure seen once in a full run). 100 ms slots make the three
# take turns while all are alive, so the third always needs room.
SHORT_FLOOR_MS = 100


def job(sim, be, group, kernels=400, kernel_us=1000, **env):
    argv = client_argv("workload-linked", "--alloc", SIZE, "--alloc-kind", "device", "--kernels", kernels,
                       "--kernel-us", kernel_us, "--sync-every", 5, "--json")
    return start(argv, sim.hooked(be, group, **env))


def prefetches(trace):
    """(pid, start, end, abi, direction, bytes) of every prefetch in the trace."""
    out = []
    for pid, _dev, t0, t1, name in trace:
        if name.startswith("prefetch"):
            abi, where, nbytes = name.split(":")
            out.append((pid, t0, t1, abi, where, int(nbytes)))
    return out


def kernels_of(trace, pid):
    return [(t0, t1) for p, _d, t0, t1, name in trace if p == pid and not name.startswith("prefetch")]


@pytest.fixture
def traced_sim(sim, tmp_path):
    sim.trace = tmp_path / "trace.txt"
    return sim


def run_three(sim, be, **env):
    procs = [job(sim, be, g, **env) for g in ("a", "b", "c")]
    runs = [finish(p, timeout=60) for p in procs]
    for r in runs:
        assert r.rc == 0 and r.json["alloc"]["result"] == 0, r
    return [r.json["pid"] for r in runs], native.read_trace(sim.trace)


def test_three_unified_groups_swap_within_the_capacity(traced_sim, backends):
    sim = traced_sim
    be = unified_backend(backends, min_slot_ms=SHORT_FLOOR_MS)
    pids, trace = run_three(sim, be)
    moves = prefetches(trace)
    # managed allocations: only managed memory can be prefetched, and every process's was, whole
    for pid in pids:
        ins = [m for m in moves if m[0] == pid and m[4] == "device"]
        assert ins and ins[0][5] == SIZE, (pid, moves)
        # prefetched before its first kernel, and before the first kernel after each time it came back
        first_kernel = kernels_of(trace, pid)[0][0]
        assert ins[0][2] <= first_kernel, (pid, ins[0], first_kernel)
    # evictions happened (3 x 128 MiB > 300 MiB), and the resident sum never passed the capacity: an eviction
    # ends before the prefetch that needs its room starts
    outs = [m for m in moves if m[4] == "host" and m[5] > 0]
    assert outs, moves
    events = sorted([(m[1], m[0], m[5]) for m in moves if m[4] == "device" and m[5] > 0] +
                    [(m[2], m[0], -m[5]) for m in outs] +
                    [(max(r[3] for r in trace if r[0] == pid), pid, None) for pid in pids],   # exit frees it all
                    # at one instant: moves out, then in, then exits (an exit's None never compared with a size)
                    key=lambda e: (e[0], e[2] is None, e[2] or 0))
    held = {pid: 0 for pid in pids}
    for _t, pid, delta in events:
        held[pid] = 0 if delta is None else held[pid] + delta
        assert sum(held.values()) <= CAPACITY, (held, moves)
    # on CUDA 13 (the simulator's default driver version) only the _v2 ABI is called
    assert {m[3] for m in moves} == {"prefetch_v2"}, moves


def test_the_least_recently_run_group_is_evicted(traced_sim, backends):
    sim = traced_sim
    # short slots, as above: with the 2 s floor the first job once ran to its end in one slot, then two fit and
    # nothing was evicted (1 of 8 runs on the development machine, the twentieth session)
    be = unified_backend(backends, min_slot_ms=SHORT_FLOOR_MS)
    pids, trace = run_three(sim, be)
    moves = prefetches(trace)
    evictions = [m for m in moves if m[4] == "host" and m[5] > 0]
    assert len(evictions) >= 2, moves     # each job needs several slots: groups come back after being evicted
    for pid, t0, _t1, _abi, _where, _nbytes in evictions:
        # among the processes that were resident then, the evicted one ran its last kernel earliest
        last_run = {}
        for p in pids:
            before = [k[1] for k in kernels_of(trace, p) if k[1] <= t0]
            ins = [m for m in moves if m[0] == p and m[4] == "device" and m[5] > 0 and m[2] <= t0]
            outs = [m for m in moves if m[0] == p and m[4] == "host" and m[5] > 0 and m[2] <= t0]
            alive = max(r[3] for r in trace if r[0] == p) > t0     # a finished job's memory is freed, not resident
            if before and len(ins) > len(outs) and alive:
                last_run[p] = before[-1]
        last_run[pid] = max([k[1] for k in kernels_of(trace, pid) if k[1] <= t0] or [0])
        assert pid == min(last_run, key=last_run.get), (pid, last_run)


@pytest.mark.parametrize("version,abi", [(12000, "prefetch"), (13000, "prefetch_v2")])
def test_prefetch_uses_the_abi_the_driver_answers(traced_sim, backends, version, abi):
    sim = traced_sim
    be = unified_backend(backends, names=("a",))
    run = finish(job(sim, be, "a", kernels=5, SIMCUDA_DRIVER_VERSION=version), timeout=60)
    assert run.rc == 0 and run.json["alloc"]["result"] == 0, run
    moves = prefetches(native.read_trace(sim.trace))
    assert moves and {m[3] for m in moves} == {abi}, moves


def status(be) -> dict:
    out = subprocess.run([sys.executable, "-m", "gemini.ctl", *be.where_args(), "status", "--json"],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(native.REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    return {g["name"]: g for g in json.loads(out.stdout)["groups"]}


def test_a_killed_processs_resident_memory_comes_back(traced_sim, backends):
    sim = traced_sim
    be = unified_backend(backends, names=("a", "b"))
    p = job(sim, be, "a", kernels=100000, kernel_us=1000)
    try:
        # (the workload's small result ring is managed memory too)
        wait_for(lambda: status(be)["a"].get("resident_bytes", 0) >= SIZE, timeout=20, what="a resident")
        assert status(be)["a"]["memory_mode"] == "unified" and status(be)["a"]["swapped_in_bytes"] >= SIZE
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    # gem-schd forgets its memory (its pod manager saw the process go), so a newcomer needs no eviction
    wait_for(lambda: status(be)["a"].get("managed_bytes", 0) == 0, timeout=20, what="a's memory released")
    assert status(be)["a"]["resident_bytes"] == 0
    # and the simulated GPU got the memory back with the process (nothing of it stays charged)
    free = finish(start(client_argv("workload-linked", "--kernels", 0, "--meminfo", "--json"), sim.env()))
    assert free.json["mem_free"] == sim.mem_bytes, free
    run = finish(job(sim, be, "b", kernels=5), timeout=60)
    assert run.rc == 0
    assert status(be)["a"]["evictions"] == 0


def test_host_work_between_steps_does_not_swap_at_every_step(traced_sim, backends):
    """Shaped like bench/bench_um.py: three unified groups that do not fit together, each step a little GPU
    work then host work longer than the hooks' idle release (GEMINI_IDLE_RELEASE_MS, 5 ms), so every step gives
    the token back while another group waits for room. Swaps must stay a small part of the time: a switch that
    needs an eviction at most once per unified slot floor (10x the swap time), not one per step. (Without
    gem-schd's pacing: ~70 evictions for 90 steps, swapping 78% of the time.)"""
    sim = traced_sim
    be = unified_backend(backends)
    steps, gbps = 30, 4
    procs = [start(client_argv("workload-linked", "--alloc", SIZE, "--alloc-kind", "device", "--kernels", 5 * steps,
                               "--kernel-us", 1000, "--sync-every", 5, "--think-us", 20_000, "--json"),
                   sim.hooked(be, g, SIMCUDA_MIGRATE_GBPS=gbps)) for g in ("a", "b", "c")]
    runs = [finish(p, timeout=120) for p in procs]
    for r in runs:
        assert r.rc == 0 and r.json["alloc"]["result"] == 0, r
    trace = native.read_trace(sim.trace)
    moves = [m for m in prefetches(trace) if m[5] >= SIZE]      # the jobs' memory (not the small result ring)
    evictions = [m for m in moves if m[4] == "host"]
    span_s = (max(r[3] for r in trace) - min(r[2] for r in trace)) / 1e9
    # each process's first prefetch is no swap: what a switch costs is the moves after it
    firsts = {pid: min(m[1] for m in moves if m[0] == pid and m[4] == "device") for pid in {m[0] for m in moves}}
    swap_s = sum(m[2] - m[1] for m in moves if m[1] > firsts[m[0]]) / 1e9
    floor_s = 10 * 2 * SIZE / (gbps * 1e9)      # gem-schd measures the simulator's speed: 10x a swap
    assert evictions, moves                     # 3 x 128 MiB do not fit in 300 MiB
    assert len(evictions) <= 2 + span_s / floor_s, (len(evictions), span_s, moves)
    assert swap_s <= 0.2 * span_s, (swap_s, span_s, moves)


BENCH_SHAPED_JOB = r'''
"""bench_um's job, scaled to the simulator: a start-up (importing torch), the model allocated in several steps
with warm-up kernels between them (so a group can be evicted while it is still allocating), then steps of host
work and GPU work."""
import json, os, sys, time
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import SpinJob
delay, chunks, chunk, steps, host_ms = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5])
time.sleep(delay)
job = SpinJob()
work = job.work
held = []
for i in range(chunks):
    held.append(job.alloc(chunk))
    if i % 3 == 2:
        work()
    time.sleep(0.15)
for s in range(steps):
    end = time.perf_counter() + host_ms / 1000
    while time.perf_counter() < end:
        pass
    work()
print(json.dumps({"pid": os.getpid(), "steps": steps}), flush=True)
'''


def test_bench_shaped_jobs_evicted_while_starting_all_finish(sim, backends, tmp_path):
    """Issue 19, bench_um's gemini phase on the simulator: three unified groups (TCP transport, the bench's
    defaults for the quotas) whose memory does not fit together, jobs started a little apart that allocate their
    memory in steps with warm-up kernels between them (so a group is evicted while still allocating), swaps slow
    enough (0.5 GB/s) to outlast a slot, then steps of host work. Every job must finish and gem-schd answer
    gem-ctl status all along. (Before the fix: a grant held for an eviction that outlasted its slot was lost, and
    that group's processes waited for the token forever.)"""
    job = tmp_path / "job.py"
    job.write_text(BENCH_SHAPED_JOB)
    be = backends([Group(f"j{i}", 0.0, 1.0, "200MiB", memory_mode="unified") for i in range(3)], quota_ms=None,
                  min_quota_ms=None, window_ms=None, extra_args=["--device-memory", str(240 * MiB)])
    procs = [start([sys.executable, str(job), str(delay), "10", str(10 * MiB), "30", "40"],
                   sim.hooked(be, f"j{i}", SIMCUDA_MIGRATE_GBPS=0.5))
             for i, delay in enumerate((0.2, 0.5, 0.3))]
    polls = []
    deadline = time.monotonic() + 60
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        polls.append(status(be))        # asserts that gem-schd answered
        time.sleep(0.5)
    runs = [finish(p, timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    for r in runs:
        assert r.rc == 0 and r.json["steps"] == 30, r
    assert sum(g.get("evictions", 0) for g in status(be).values()) >= 1     # they did not fit: swapped
    assert polls


def test_gem_schd_traces_evictions_and_swaps(traced_sim, backends, tmp_path):
    """gem-schd --trace shows the swaps on each unified group's track: an instant when it asks a group to evict
    (the bytes it counted resident), and a complete event per move the hooks reported, as long as the move took
    and ending when the report came (cat "swap"). gem-ctl plot's reader takes them in."""
    sim = traced_sim
    schd_trace = tmp_path / "schd-trace.json"
    be = backends([Group(n, 0.0, 1.0, "1GiB", memory_mode="unified") for n in ("a", "b", "c")], quota_ms=20,
                  extra_args=["--device-memory", str(CAPACITY), f"--schd-arg=--trace={schd_trace}",
                              f"--schd-arg=--unified-min-slot={SHORT_FLOOR_MS}"])
    pids, trace = run_three(sim, be, SIMCUDA_MIGRATE_GBPS=4)
    outs_sim = [m for m in prefetches(trace) if m[4] == "host" and m[5] > 0]
    assert outs_sim      # the simulator saw evictions: the trace must show them
    events = read_sched_trace(schd_trace)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    swaps = [e for e in events if e.get("cat") == "swap"]
    asks = [e for e in swaps if e["ph"] == "i"]
    outs = [e for e in swaps if e["ph"] == "X" and e["args"]["direction"] == "host"]
    ins = [e for e in swaps if e["ph"] == "X" and e["args"]["direction"] == "device"]
    assert asks and outs and ins, swaps
    for e in swaps:
        group = e["name"].split(" ")[0]
        assert tracks[e["tid"]] == f"group {group}", (e, tracks)     # on the group's own track
    assert all(e["args"]["bytes"] >= SIZE for e in asks), asks
    assert any(e["args"]["bytes"] >= SIZE for e in outs) and all(e["args"]["bytes"] >= SIZE for e in ins), swaps
    for e in outs + ins:
        assert e["dur"] == pytest.approx(e["args"]["took_ms"] * 1000, abs=0.01), e
        assert e["dur"] > 0 or e["args"]["bytes"] == 0, e
    # 128 MiB at the simulator's 4 GB/s: ~34 ms per move, as the hooks timed it
    assert all(20 <= e["args"]["took_ms"] <= 1000 for e in ins if e["args"]["bytes"] >= SIZE), ins
    # every answer follows its request, on the same track
    for e in outs:
        ask = [a for a in asks if a["tid"] == e["tid"] and a["args"]["seq"] == e["args"]["seq"]]
        assert ask and ask[0]["ts"] <= e["ts"] + e["dur"], (e, asks)
    loaded = SchedulerTrace.load(schd_trace)
    assert {s.direction for s in loaded.swaps} == {"host", "device"} and set(loaded.groups) == {"a", "b", "c"}
    assert sum(s.bytes for s in loaded.swaps if s.direction == "host") == sum(e["args"]["bytes"] for e in outs)


def test_an_eviction_whose_prefetches_fail_is_reported_as_what_it_moved(traced_sim, backends, tmp_path):
    """Every prefetch to the host fails (the simulator's SIMCUDA_HOST_PREFETCH_FAILS): an evicted group's memory
    stays on the GPU. Its hooks report what moved (nothing) and what stayed resident, so gem-schd records
    evictions of 0 bytes, marked incomplete where memory stayed, and warns (the driver's page faults make the
    room). Before, a hook reported its whole resident set as moved and nothing left, and the eviction counted as
    complete at the bandwidth of a move that never happened. The jobs still finish."""
    sim = traced_sim
    schd_trace = tmp_path / "schd-trace.json"
    be = backends([Group(n, 0.0, 1.0, "1GiB", memory_mode="unified") for n in ("a", "b", "c")], quota_ms=20,
                  extra_args=["--device-memory", str(CAPACITY), f"--schd-arg=--trace={schd_trace}",
                              f"--schd-arg=--unified-min-slot={SHORT_FLOOR_MS}"])
    run_three(sim, be, SIMCUDA_HOST_PREFETCH_FAILS=1)
    assert not [m for m in prefetches(native.read_trace(sim.trace)) if m[4] == "host"]   # none ran
    outs = [e for e in read_sched_trace(schd_trace) if e.get("cat") == "swap" and e["ph"] == "X"
            and e["args"]["direction"] == "host"]
    assert outs, "no eviction was answered"
    moves = [(e["args"]["bytes"], e["args"]["complete"], e["name"]) for e in outs]
    assert all(nbytes == 0 for nbytes, _, _ in moves), moves
    # incomplete when a process had memory on the GPU (one that had none yet, or no more, answered a complete 0)
    assert any(complete is False for _, complete, _ in moves), moves
    assert "incomplete" in be.logs(), be.logs()


STARTING_JOB = r'''
"""A process of a unified group that is still starting: a context, and (with an allocation size > 0) managed
memory, but no kernel yet, so it never held the token. It says "ready" and waits for stdin to close."""
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
byref, vp = ctypes.byref, ctypes.c_void_p
def check(rc, what):
    if rc != 0:
        sys.exit(f"starting job: {what} failed: {rc}")
nbytes = int(sys.argv[1])
dev, ctx = ctypes.c_int(), vp()
check(cu.cuInit(0), "cuInit")
check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cu.cuMemGetInfo_v2(byref(free), byref(total)), "cuMemGetInfo_v2")      # connects to the pod manager
if nbytes:
    p = ctypes.c_ulonglong()
    check(cu.cuMemAlloc_v2(byref(p), ctypes.c_size_t(nbytes)), "cuMemAlloc_v2")
print("ready", os.getpid(), flush=True)
sys.stdin.read()
'''


@pytest.mark.parametrize("starting_bytes", [0, 64 * MiB], ids=["connected", "allocated"])
def test_a_starting_process_does_not_hold_up_an_eviction(traced_sim, backends, tmp_path, starting_bytes):
    """gem-schd asks group a to evict while one of a's processes is still starting (connected, with or without
    managed memory, never granted the token) and another runs: the eviction is answered at once, so b's grant
    goes out well within the pod manager's 10 s wait for a process that does not answer (and gem-schd's 15 s),
    and the starting process's memory goes to the host with the rest of a's. (Before the fix, a process with
    managed memory answered only once it had been granted the token: b's grant waited, and every new request
    replaced the unanswered one, so b never ran.)"""
    sim = traced_sim
    script = tmp_path / "starting.py"
    script.write_text(STARTING_JOB)
    be = unified_backend(backends, names=("a", "b"), capacity=200 * MiB)
    starting = subprocess.Popen([sys.executable, str(script), str(starting_bytes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=sim.hooked(be, "a"))
    running = None
    try:
        ready, starting_pid = starting.stdout.readline().split()
        assert ready == "ready"
        # a's other process runs and stays (its memory resident); then b needs room: a must be evicted
        running = job(sim, be, "a", kernels=100000)
        wait_for(lambda: status(be)["a"].get("resident_bytes", 0) >= SIZE + starting_bytes, timeout=20,
                 what="a resident")
        t0 = time.monotonic()
        run_b = finish(job(sim, be, "b", kernels=5), timeout=30)
        took = time.monotonic() - t0
        assert run_b.rc == 0, run_b
        assert status(be)["a"]["evictions"] >= 1
        assert took < 5.0, (took, status(be))
        if starting_bytes:
            # its hook moved its memory to the host, in the context it allocated in (the simulator counts the
            # bytes that were on the GPU: none, as it never touched them, but the call was made)
            outs = [m for m in prefetches(native.read_trace(sim.trace)) if m[0] == int(starting_pid)]
            assert outs and {m[4] for m in outs} == {"host"}, outs
    finally:
        if running is not None:
            running.send_signal(signal.SIGKILL)
            running.wait(timeout=10)
        starting.stdin.close()
        starting.wait(timeout=20)


GROWING_JOB = r'''
"""A unified group's process that allocates more after its first grant (as PyTorch builds its model in its first
steps): 16 MiB, kernels (granted: its memory prefetched), 128 MiB more, kernels; then "ready", and it waits."""
import os, sys
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import SpinJob
job = SpinJob()
held = [job.alloc(16 << 20)]
job.work()
held.append(job.alloc(128 << 20))
job.work()
print("ready", os.getpid(), flush=True)
sys.stdin.read()
'''


LATE_ALLOCATING_JOB = r'''
"""A unified group's process whose first grant comes before its first managed allocation (a kernel launched
before anything is allocated: its grant has nothing to move), then 144 MiB allocated and used in that slot;
then "ready", and it waits."""
import os, sys
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import CUdeviceptr, SpinJob
alloc = SpinJob.alloc
SpinJob.alloc = lambda self, nbytes: CUdeviceptr(0)     # no result ring: the first kernels allocate nothing
job = SpinJob()
SpinJob.alloc = alloc
job.work()
held = [job.alloc(144 << 20)]
job.work()
print("ready", os.getpid(), flush=True)
sys.stdin.read()
'''


@pytest.mark.parametrize("script_text", [GROWING_JOB, LATE_ALLOCATING_JOB], ids=["grown", "granted-empty"])
def test_memory_allocated_in_a_slot_counts_as_moved_when_evicted(traced_sim, backends, tmp_path, script_text):
    """Issue 19, H100: a job granted with 2.4 GB allocated 12 GB more in its slot; its eviction moved 14.6 GB in
    4.7 s but reported 2.4 GB (only what the grant's prefetch had moved), so gem-schd took the host link for
    0.5 GB/s and made slots of 107 s. Memory allocated while the group's memory is on the GPU is first touched
    there: the hook counts it resident, and the eviction reports it -- after a grant that moved memory
    (`grown`) and after one that had nothing to move yet (`granted-empty`: its first kernel came before its
    first managed allocation)."""
    sim = traced_sim
    script = tmp_path / "job.py"
    script.write_text(script_text)
    be = unified_backend(backends, names=("a", "b"), capacity=200 * MiB)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=sim.hooked(be, "a"))
    try:
        assert proc.stdout.readline().split()[0] == "ready"
        wait_for(lambda: status(be)["a"].get("managed_bytes", 0) >= 144 * MiB, timeout=20, what="a's report")
        run_b = finish(job(sim, be, "b", kernels=5), timeout=30)        # 128 MiB: a must make room
        assert run_b.rc == 0, run_b
        a = status(be)["a"]
        assert a["evictions"] >= 1, a
        assert a["swapped_out_bytes"] >= 144 * MiB, a
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)


PITCH_PROBE = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
out = {}
for name, width, height in (("fits", 1000, 4096), ("wraps", 2**55 + 512, 512)):
    p, pitch = ctypes.c_ulonglong(), ctypes.c_size_t()
    rc = cu.cuMemAllocPitch_v2(ctypes.byref(p), ctypes.byref(pitch), ctypes.c_size_t(width), ctypes.c_size_t(height), 4)
    out[name] = [rc, pitch.value]
print(json.dumps(out))
"""


def test_a_pitch_allocation_whose_size_does_not_fit_64_bits_is_refused(sim, backends):
    """In a unified group the hook makes a pitched allocation itself (managed memory, 512-byte rows). A width of
    2**55 + 512 by 512 rows is 2**64 + 256 KiB: wrapped, it was a 256 KiB allocation that succeeded with a pitch
    of 2**55 + 512, row 1 far past its end (the driver refuses such a call)."""
    be = unified_backend(backends, names=("a",))
    r = finish(start([sys.executable, "-c", PITCH_PROBE], sim.hooked(be, "a")), timeout=60)
    assert r.rc == 0, r
    out = r.json
    assert out["fits"] == [0, 1024], out
    assert out["wraps"][0] == 1, out        # CUDA_ERROR_INVALID_VALUE
