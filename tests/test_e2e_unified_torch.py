"""End to end on the simulated driver: the eviction delegate (gemini/unified_torch.py, hook/residency.h).

A unified group's process holds a live block and a "cached" one (what PyTorch's caching allocator keeps after a
free: allocated to the driver and the hook, unused by the program). Group b then needs room, so gem-schd evicts
group a. With the delegate installed, the hook holds the eviction until the delegate has freed the cached block,
so only the live block is moved to the host (the simulator's trace: every prefetch with the bytes it moved), and
the free comes before the move. gem-schd's trace times each eviction from its request to the answer: a delegate
that never answers holds it for GEM_DELEGATE_WAIT_NS (1 s) and no longer; without a delegate nothing waits.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.harness import Group
from gemini.launch.command import torch_delegate_env
from gemini.scheduler.trace import read_trace as read_sched_trace
from tests.e2e_fixtures import MiB, client_argv, finish, start, wait_for
from tests.test_e2e_unified import prefetches, status

import native

LIVE = 64 * MiB
CACHED = 96 * MiB
B_SIZE = 128 * MiB
CAPACITY = 200 * MiB        # a (160 MiB) and b (128 MiB) do not fit together; a's live block and b do
DELEGATE_WAIT_S = 1.0       # hook/residency.h: GEM_DELEGATE_WAIT_NS

CACHED_JOB = r'''
"""A unified group's process with a live block and a cached one; `mode`: "free" installs the delegate with a
release_cache that frees the cached block, "never" one that never returns, "none" installs nothing, "torch"
imports the fake torch package (the delegate comes from gemini's sitecustomize, unasked by this program). Runs
kernels until stdin closes, then prints what happened."""
import json, os, sys, threading, time
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import SpinJob
live, cached, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
job = SpinJob()
cu, ctx, work = job.cu.lib, job.ctx, job.work
blocks = {"live": job.alloc(live), "cached": job.alloc(cached)}
seen = {"calls": 0, "called_ns": None, "freed_ns": None, "free_rc": None}
def release_cache():
    seen["calls"] += 1
    seen["called_ns"] = seen["called_ns"] or time.monotonic_ns()
    if mode == "never":
        threading.Event().wait()
    if blocks["cached"].value:
        cu.cuCtxSetCurrent(ctx)            # the delegate's thread has no context of its own (as torch's guard)
        seen["free_rc"] = cu.cuMemFree_v2(blocks["cached"])
        blocks["cached"].value = 0
        seen["freed_ns"] = time.monotonic_ns()
installed = None
if mode in ("free", "never"):
    from gemini import unified_torch
    installed = unified_torch.install(release_cache)
elif mode == "torch":
    os.environ["FAKE_TORCH_CTX"] = str(ctx.value)
    os.environ["FAKE_TORCH_CACHED"] = str(blocks["cached"].value)
    import torch
    torch.cuda._init()
    installed = "_gemini_unified_torch" in sys.modules
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
work()
print("ready", flush=True)
while not stop.is_set():
    work()
if mode == "torch":
    seen.update(sys.modules["torch"].cuda.seen)
print(json.dumps({"pid": os.getpid(), "installed": installed, **seen}), flush=True)
'''

# A stand-in for torch: what the default release_cache (unified_torch.empty_torch_cache) calls; its cache is the
# job's cached block, freed by empty_cache.
FAKE_TORCH = r'''
import contextlib, ctypes, os, time
class _Cuda:
    def __init__(self):
        self.ready, self.seen = False, {"calls": 0, "called_ns": None, "freed_ns": None, "free_rc": None}
    def _init(self):
        self.ready = True
    def is_initialized(self):
        return self.ready
    def device_count(self):
        return 1
    def memory_reserved(self, i):
        return 2 if int(os.environ["FAKE_TORCH_CACHED"]) else 1
    def memory_allocated(self, i):
        return 1
    @contextlib.contextmanager
    def device(self, i):
        yield
    def empty_cache(self):
        self.seen["calls"] += 1
        self.seen["called_ns"] = self.seen["called_ns"] or time.monotonic_ns()
        block = int(os.environ["FAKE_TORCH_CACHED"])
        if block:
            cu = ctypes.CDLL("libcuda.so.1")
            cu.cuCtxSetCurrent(ctypes.c_void_p(int(os.environ["FAKE_TORCH_CTX"])))
            self.seen["free_rc"] = cu.cuMemFree_v2(ctypes.c_ulonglong(block))
            os.environ["FAKE_TORCH_CACHED"] = "0"
            self.seen["freed_ns"] = time.monotonic_ns()
cuda = _Cuda()
'''


def run_a_evicted_by_b(sim, backends, tmp_path, mode, env_of=lambda env: env):
    """a (live + cached, delegate `mode`) runs and is resident; b needs room, so a is evicted. Returns a's report,
    the simulator's prefetches of a's blocks (not its 24-byte ring) and each eviction's delay in gem-schd's trace
    (from the request to the start of the move: what the hook held it for)."""
    sim.trace = tmp_path / "trace.txt"
    schd_trace = tmp_path / "schd-trace.json"
    be = backends([Group(n, 0.0, 1.0, "1GiB", memory_mode="unified") for n in ("a", "b")], quota_ms=20,
                  extra_args=["--device-memory", str(CAPACITY), f"--schd-arg=--trace={schd_trace}"])
    script = tmp_path / "cached_job.py"
    script.write_text(CACHED_JOB)
    a = subprocess.Popen([sys.executable, str(script), str(LIVE), str(CACHED), mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(sim.hooked(be, "a")))
    try:
        assert a.stdout.readline().strip() == "ready", a.stderr.read() if a.poll() is not None else "a not ready"
        wait_for(lambda: status(be)["a"].get("resident_bytes", 0) >= LIVE + CACHED, timeout=20, what="a resident")
        run_b = finish(start(client_argv("workload-linked", "--alloc", B_SIZE, "--alloc-kind", "device",
                                         "--kernels", 5, "--kernel-us", 1000, "--json"), sim.hooked(be, "b")),
                       timeout=30)
        assert run_b.rc == 0 and run_b.json["alloc"]["result"] == 0, run_b
        assert status(be)["a"]["evictions"] >= 1
    finally:
        out, err = a.communicate(timeout=30)
    assert a.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    moves = [m for m in prefetches(native.read_trace(sim.trace)) if m[0] == report["pid"] and m[5] >= MiB]
    events = read_sched_trace(schd_trace)
    swaps = [e for e in events if e.get("cat") == "swap" and e["name"].startswith("a ")]
    # gem-schd asks again (a new seq) while an eviction is unanswered; the hook holds from the first request:
    # each move's delay counts from the first request after the move before it
    asks = sorted(e["ts"] for e in swaps if e["ph"] == "i")
    delays, after = [], -1.0
    for out in sorted((e for e in swaps if e["ph"] == "X" and e["args"]["direction"] == "host"),
                      key=lambda e: e["ts"]):
        first = min((t for t in asks if after < t <= out["ts"]), default=None)
        if first is not None:
            delays.append((out["ts"] - first) / 1e6)
        after = out["ts"] + out["dur"]
    assert delays, swaps
    first_out = min((e["ts"] for e in swaps if e["ph"] == "X" and e["args"]["direction"] == "host"), default=None)
    report["asks_before_first_move"] = sum(1 for t in asks if first_out is None or t <= first_out)
    return report, moves, delays


def host_moves(moves):
    return [m for m in moves if m[4] == "host"]


def test_the_delegate_frees_the_cache_before_the_eviction_moves_only_live_memory(sim, backends, tmp_path):
    report, moves, delays = run_a_evicted_by_b(sim, backends, tmp_path, "free")
    assert report["installed"] is True and report["calls"] >= 1 and report["free_rc"] == 0, report
    outs = host_moves(moves)
    # only the live block went to the host: the cached one was freed first
    assert outs and {m[5] for m in outs} == {LIVE}, moves
    assert report["freed_ns"] < outs[0][1], (report, outs)
    # the hold lasted as long as the free, not the delegate's time limit
    assert max(delays) < DELEGATE_WAIT_S / 2, delays


def test_without_install_evictions_move_the_cache_and_are_not_held(sim, backends, tmp_path):
    report, moves, delays = run_a_evicted_by_b(sim, backends, tmp_path, "none")
    assert report["installed"] is None and report["calls"] == 0, report
    assert CACHED in {m[5] for m in host_moves(moves)}, moves     # today's behaviour: everything moves
    assert max(delays) < DELEGATE_WAIT_S / 2, delays


def test_a_delegate_that_never_answers_holds_the_eviction_for_the_time_limit_only(sim, backends, tmp_path):
    report, moves, delays = run_a_evicted_by_b(sim, backends, tmp_path, "never")
    assert report["installed"] is True and report["calls"] == 1 and report["freed_ns"] is None, report
    outs = host_moves(moves)
    assert CACHED in {m[5] for m in outs}, moves        # not freed: moved with the rest, after the time limit
    assert outs[0][1] - report["called_ns"] >= 0.8 * DELEGATE_WAIT_S * 1e9, (report, outs)
    assert all(DELEGATE_WAIT_S * 0.9 <= d <= DELEGATE_WAIT_S + 0.5 for d in delays), delays
    # b's slot outlasts the hold (SLOT_FLOOR_MIN_MS): a is asked once. With slots as short as the small groups'
    # swaps (268 ms), b's slot ended first, a was granted and evicted b, and they alternated: 5 asks of a.
    assert report["asks_before_first_move"] == 1, report


def test_launch_command_sitecustomize_installs_the_delegate_when_torch_is_imported(sim, backends, tmp_path):
    """An unmodified program that imports torch (a stand-in here) gets the delegate from launch-command's
    sitecustomize, with the default release_cache (torch.cuda.empty_cache); the program's own sitecustomize,
    further on the path, still runs."""
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (tmp_path / "theirs").mkdir()
    marker = tmp_path / "their-sitecustomize-ran"
    (tmp_path / "theirs" / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    def env_of(env):
        env["PYTHONPATH"] = ":".join([str(tmp_path / "fake"), str(tmp_path / "theirs"), env["PYTHONPATH"]])
        torch_delegate_env(env)
        return env

    report, moves, _delays = run_a_evicted_by_b(sim, backends, tmp_path, "torch", env_of)
    assert report["installed"] is True and report["calls"] >= 1 and report["free_rc"] == 0, report
    outs = host_moves(moves)
    assert outs and {m[5] for m in outs} == {LIVE}, moves
    assert report["freed_ns"] < outs[0][1], (report, outs)
    assert marker.exists()


@pytest.mark.parametrize("imports_torch", [False, True])
def test_the_sitecustomize_costs_nothing_without_torch(tmp_path, imports_torch):
    """Without an import of torch, nothing is loaded (no thread, no symbol lookup); and without the hook, an import
    of torch installs nothing and says nothing."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    torch_delegate_env(env)
    program = ("import sys, threading\n" + ("import torch\n" if imports_torch else "import json\n") +
               "print('_gemini_unified_torch' in sys.modules, threading.active_count())\n")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out
    assert out.stdout.split() == (["True", "1"] if imports_torch else ["False", "1"]), out.stdout

