"""The hook's fixed tables (memory pools, stream captures, NVML connections) when they are full.

A full table must neither change what the program's call does nor fail silently: the hook says so once,
loudly, and falls back to something safe. Each test fills one table on the simulated driver (and, for NVML,
the simulated libnvidia-ml.so.1) and checks the call past the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.harness import Group
from tests.e2e_fixtures import MiB, Sim, finish, run, start
from tests.fake_pmgr import fake_pmgrs

PROGRAM = r'''
import ctypes, json, os, sys, time
c_void_p, c_size_t, c_int, c_uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
c_u64 = ctypes.c_uint64
CUdeviceptr, byref = ctypes.c_ulonglong, ctypes.byref
MiB = 1 << 20

def cuda():
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = c_int(), c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    return cu

class PoolProps(ctypes.Structure):      # CUmemPoolProps (88 bytes)
    _fields_ = [("allocType", c_int), ("handleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("maxSize", c_size_t), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 54)]

USED_MEM_CURRENT = 7

def pools(args):
    n = int(args[0])
    cu = cuda()
    props = PoolProps(allocType=1, locType=1, locId=0)
    made, rcs = [], []
    for i in range(n):
        p = c_void_p()
        assert cu.cuMemPoolCreate(byref(p), byref(props)) == 0
        made.append(p)
        ptr = CUdeviceptr()
        rcs.append(cu.cuMemAllocFromPoolAsync(byref(ptr), c_size_t(2 * MiB), p, None))
    assert cu.cuCtxSynchronize() == 0
    def used(p):
        v = c_u64()
        assert cu.cuMemPoolGetAttribute(p, USED_MEM_CURRENT, byref(v)) == 0
        return v.value
    default = c_void_p()
    assert cu.cuDeviceGetDefaultMemPool(byref(default), 0) == 0
    free, total = c_size_t(), c_size_t()
    assert cu.cuMemGetInfo_v2(byref(free), byref(total)) == 0
    print(json.dumps({"rcs": rcs, "used": [used(p) for p in made], "default_used": used(default),
                      "free": free.value, "total": total.value}))

def captures(args):
    n = int(args[0])
    cu = cuda()
    # everything the burst needs first: allocating while a GLOBAL capture is open would break it
    mod, fn, buf = c_void_p(), c_void_p(), CUdeviceptr()
    sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
    from pyclient import GEM_SPIN_PTX
    assert cu.cuModuleLoadData(byref(mod), GEM_SPIN_PTX.encode() + b"\0") == 0
    assert cu.cuModuleGetFunction(byref(fn), mod, b"gem_spin") == 0
    assert cu.cuMemAlloc_v2(byref(buf), c_size_t(24)) == 0
    work = c_void_p()
    assert cu.cuStreamCreate(byref(work), 1) == 0
    streams = []
    for _ in range(n):
        s = c_void_p()
        assert cu.cuStreamCreate(byref(s), 1) == 0
        streams.append(s)
    begins = [cu.cuStreamBeginCapture_v2(s, 0) for s in streams]
    graph = c_void_p()
    ends = [cu.cuStreamEndCapture(s, byref(graph)) for s in streams[:-1]]   # the last one stays open
    # one burst on a stream of its own (a token, a slot), then idle: the watcher gives the token back early,
    # draining first, unless a capture is open
    out, dur = CUdeviceptr(buf.value), c_u64(1000000)
    params = (c_void_p * 2)(ctypes.cast(byref(out), c_void_p), ctypes.cast(byref(dur), c_void_p))
    launch = cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, work, params, None)
    sync = cu.cuStreamSynchronize(work)
    time.sleep(0.3)
    status = c_int(-1)
    cu.cuStreamIsCapturing(streams[-1], byref(status))
    last_end = cu.cuStreamEndCapture(streams[-1], byref(graph))
    print(json.dumps({"pid": os.getpid(), "begins": begins, "ends": ends, "launch": launch, "sync": sync,
                      "last_status": status.value, "last_end": last_end}))

def nvml(args):
    n = int(args[0])
    nv = ctypes.CDLL("libnvidia-ml.so.1")
    assert nv.nvmlInit_v2() == 0
    count = c_uint()
    assert nv.nvmlDeviceGetCount_v2(byref(count)) == 0 and count.value == n
    class Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
    totals = []
    for i in range(n):
        h, m = c_void_p(), Mem()
        assert nv.nvmlDeviceGetHandleByIndex_v2(c_uint(i), byref(h)) == 0
        assert nv.nvmlDeviceGetMemoryInfo(h, byref(m)) == 0
        totals.append(m.total)
    print(json.dumps({"totals": totals}))

{"pools": pools, "captures": captures, "nvml": nvml}[sys.argv[1]](sys.argv[2:])
'''


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tables") / "tables.py"
    path.write_text(PROGRAM)
    return path


@pytest.fixture
def fake_pmgr():
    yield from fake_pmgrs()


def test_a_pool_past_the_table_is_still_the_callers_pool(sim, backends, program):
    """65 pools, 2 MiB from each: the 65th allocation comes from the 65th pool (not the device's default
    pool), the group is charged for all 65 blocks, and the hook says that it counts that pool block by
    block."""
    be = backends([Group("p", 0.0, 1.0, "512MiB")])
    r = run([sys.executable, str(program), "pools", "65"], sim.hooked(be, "p"))
    assert r.rc == 0, r
    out = r.json
    assert out["rcs"] == [0] * 65, out
    assert out["used"] == [2 * MiB] * 65, f"a block did not come from its caller's pool: {out['used']}"
    assert out["default_used"] == 0, out
    assert out["total"] == 512 * MiB and out["free"] == 512 * MiB - 65 * 2 * MiB, out
    assert "more than 64 memory pools" in r.err, r


def test_a_capture_past_the_table_still_stops_drains(sim, backends, program):
    """257 captures begin, 256 end: the one still open was begun past the table's end. The process then runs
    a burst and goes idle; the watcher gives its token back early but must not synchronise (a
    cuCtxSynchronize would invalidate the open capture), and the hook says so."""
    be = backends([Group("c", 0.0, 1.0)])
    r = run([sys.executable, str(program), "captures", "257"], sim.hooked(be, "c"))
    assert r.rc == 0, r
    out = r.json
    assert out["begins"] == [0] * 257 and out["ends"] == [0] * 256, out
    assert out["launch"] == 0 and out["sync"] == 0, out
    assert (out["last_status"], out["last_end"]) == (1, 0), \
        f"the open capture was invalidated: status {out['last_status']}, end {out['last_end']}"
    stats = sim.stats_of(out["pid"])
    assert stats["early_releases"] >= 1 and stats["drains"] == 0, stats
    assert "more than 256 stream captures" in r.err, r


def test_nvml_past_the_table_says_so(tmp_path, hook_lib, fake_pmgr, program):
    """A process that only uses NVML asks about 33 GPUs: each of the first 32 gets a connection of its own
    and shows the group's limit; the 33rd shows NVML's numbers, and the hook says why."""
    sim = Sim(tmp_path / "sim", hook_lib)
    limit = 64 * MiB
    pmgr = fake_pmgr(mem_limit=limit)
    env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_PORT=pmgr.port,
                  SIMNVML_DEVICES=33)
    r = finish(start([sys.executable, str(program), "nvml", "33"], env), timeout=60)
    assert r.rc == 0, r
    totals = r.json["totals"]
    assert totals[:32] == [limit] * 32, totals
    assert totals[32] == sim.mem_bytes, totals
    assert len({h.device_uuid for h in pmgr.hellos}) == 32, [h.device_uuid for h in pmgr.hellos]
    assert "more than 32 GPUs queried" in r.err, r
