"""End to end: the real hook (LD_PRELOAD) on the simulated driver, against a real backend.

Each test runs unmodified driver-API programs (tests/clients) under libgemhook.so.1 and judges the hook by
what the programs, the simulated device (SIMCUDA_TRACE) and the hook's own counters (GEMINI_STATS_FILE)
report. Interception, time sharing, early release, capture, failure handling and fork.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import TRANSPORTS, Group, Trace, common_span, shares_over
from tests import native
from tests.e2e_fixtures import (CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_SYSTEM_NOT_READY, Sim, client_argv, finish,
                                run, spawn, start)

KERNEL_US = 1000


def workload(name: str, *args: object) -> list[str]:
    return client_argv(name, "--kernel-us", KERNEL_US, "--json", *args)


# --- interception ----------------------------------------------------------------------------------

def test_every_client_style_is_intercepted_and_every_launch_counted(sim, backends):
    """cudart-style (cuGetProcAddress, also per-thread-stream variants), linked (-lcuda) and Python (ctypes
    dlsym) clients: correct results, every launch seen by the hook, each through its own route."""
    be = backends([Group("solo", 0.0, 1.0)])
    kernels = 60
    styles = {
        "procaddr": workload("workload-procaddr", "--kernels", kernels, "--sync-every", 10),
        "procaddr-ptsz": workload("workload-procaddr", "--kernels", kernels, "--sync-every", 10, "--ptsz"),
        "linked": workload("workload-linked", "--kernels", kernels, "--sync-every", 10),
        "pyclient": client_argv("pyclient.py", "--kernels", kernels, "--kernel-us", KERNEL_US, "--sync-every", 10,
                                "--json"),
    }
    # launch-command itself starts the programs, as a user would
    procs = {name: spawn(be, "solo", argv, sim.env()) for name, argv in styles.items()}
    results = {name: finish(p) for name, p in procs.items()}
    for name, res in results.items():
        assert res.rc == 0, res
        out = res.json
        assert out["kernels_done"] == kernels and out["launches"] == kernels, res
        assert out["onchip_ns"] >= kernels * KERNEL_US * 1000, res     # every gem_spin really ran its time
        st = sim.stats_of(out["pid"])
        assert st["launches"] == kernels, (name, st)
        assert st["grants"] >= 1 and st["gate_errors"] == 0, (name, st)
    for name in ("procaddr", "procaddr-ptsz"):
        assert sim.stats_of(results[name].json["pid"])["procaddr_routed"] > 0, name
    assert sim.stats_of(results["pyclient"].json["pid"])["dlsym_routed"] > 0


LAUNCH_KINDS = ["kernel", "ex", "cooperative", "graph"]


def test_every_launch_kind_is_gated(sim, backends, tmp_path, hook_lib):
    """Each launch kind, in a group capped at 10 %, gets about 10 % of the device and waits for tokens; alone in
    an uncapped group (on a second simulated device, meanwhile) it gets nearly all of it."""
    be = backends([Group(f"capped-{k}", 0.0, 0.1) for k in LAUNCH_KINDS])
    kernels = 150
    procs = {k: start(workload("workload-procaddr", "--launch", k, "--kernels", kernels, "--sync-every", 5),
                      sim.hooked(be, f"capped-{k}")) for k in LAUNCH_KINDS}
    # 100 ms slots: a handful of token round trips in a run, so a loaded machine's slow daemons cost little
    alone_sim = Sim(tmp_path / "alone", hook_lib)
    alone_be = backends([Group("full", 0.0, 1.0)], quota_ms=100, min_quota_ms=50)
    alone = {k: run(workload("workload-procaddr", "--launch", k, "--kernels", 250, "--sync-every", 25),
                    alone_sim.hooked(alone_be, "full")) for k in LAUNCH_KINDS}
    capped = {k: finish(p) for k, p in procs.items()}
    for kind in LAUNCH_KINDS:
        res = capped[kind]
        assert res.rc == 0, res
        out = res.json
        assert out["kernels_done"] == kernels, res
        share = out["onchip_ns"] / out["wall_ns"]
        # ungated, four busy processes would get a quarter each; gated, a little over 0.1 (queued kernels run
        # past a slot's end, and a loaded machine stretches the simulated kernels)
        assert share < 0.18, f"{kind}: share {share:.3f} in a group capped at 0.1"
        st = sim.stats_of(out["pid"])
        assert st["waits"] > 0 and st["wait_ms"] > 0.5 * out["wall_ns"] / 1e6, (kind, st)
        res = alone[kind]
        assert res.rc == 0, res
        out = res.json
        share = out["onchip_ns"] / out["wall_ns"]
        assert share > 0.8, f"{kind}: share {share:.3f} alone in an uncapped group"
        assert alone_sim.stats_of(out["pid"])["grants"] >= 1


# --- dlsym keeps the caller's semantics ------------------------------------------------------------

DLSYM_FIRST = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
int probe_value(void) { return 1; }
int cudaLaunchKernel(void) { return 11; }   /* a cuda* (not cu[A-Z]*) name: never the hook's business */
/* Not a tail call (built -O0, and the barrier): glibc must see this library as the caller. */
void *first_next_probe(void) {
    void *p = dlsym(RTLD_NEXT, "probe_value");
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}
"""
DLSYM_SECOND = r"""
int probe_value(void) { return 2; }
"""
DLSYM_MAIN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
void *first_next_probe(void);
typedef int (*int_fn)(void);

static const char *lib_of(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_fname) return "null";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}
static int call(void *p) { return p ? ((int_fn)p)() : -1; }

int main(void) {
    void *first = dlopen("libe2efirst.so", RTLD_NOW | RTLD_NOLOAD);
    void *second = dlopen("libe2esecond.so", RTLD_NOW | RTLD_NOLOAD);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    printf("next_from_library=%d\n", call(first_next_probe()));
    printf("next_from_main=%d\n", call(dlsym(RTLD_NEXT, "probe_value")));
    printf("default=%d\n", call(dlsym(RTLD_DEFAULT, "probe_value")));
    printf("handle_first=%d\n", call(dlsym(first, "probe_value")));
    printf("handle_second=%d\n", call(dlsym(second, "probe_value")));
    printf("cuda_name_in_first=%d\n", call(dlsym(first, "cudaLaunchKernel")));
    printf("cu_launch_from_cuda=%s\n", lib_of(dlsym(cuda, "cuLaunchKernel")));
    printf("cu_alloc_from_cuda=%s\n", lib_of(dlsym(cuda, "cuMemAlloc_v2")));
    printf("cu_plain_from_cuda=%s\n", lib_of(dlsym(cuda, "cuDeviceGetName")));
    printf("cu_launch_from_first=%s\n", lib_of(dlsym(first, "cuLaunchKernel")));
    printf("cu_missing=%s\n", lib_of(dlsym(cuda, "cuNoSuchFunction")));
    printf("cu_missing_error=%d\n", dlerror() != NULL);
    printf("strlen=%s\n", lib_of(dlsym(RTLD_DEFAULT, "strlen")));
    return 0;
}
"""


def test_dlsym_keeps_the_callers_semantics(sim, tmp_path):
    """RTLD_NEXT from a library finds the next definition after that library, explicit handles find their
    own symbols, intercepted cu* names from the driver's handle come from the hook, everything else is the
    C library's answer unchanged."""
    d = tmp_path / "dlsym"
    d.mkdir()
    (d / "first.c").write_text(DLSYM_FIRST)
    (d / "second.c").write_text(DLSYM_SECOND)
    (d / "main.c").write_text(DLSYM_MAIN)
    cc = os.environ.get("CC", "cc")
    for lib in ("first", "second"):
        subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(d / f"libe2e{lib}.so"), str(d / f"{lib}.c"), "-ldl"],
                       check=True)
    # the program links first, then second: RTLD_NEXT from first must land in second
    subprocess.run([cc, "-O2", "-o", str(d / "main"), str(d / "main.c"), f"-L{d}", "-Wl,--no-as-needed",
                    "-le2efirst", "-le2esecond",
                    "-ldl", f"-Wl,-rpath,{d}"], check=True)
    res = run([str(d / "main")], sim.env(LD_PRELOAD=str(sim.hook)))
    assert res.rc == 0, res
    got = dict(line.split("=", 1) for line in res.out.split())
    assert got.pop("strlen").startswith("libc.so"), res
    hook_name = sim.hook.name
    assert got == {
        "next_from_library": "2",
        "next_from_main": "1",
        "default": "1",
        "handle_first": "1",
        "handle_second": "2",
        "cuda_name_in_first": "11",
        "cu_launch_from_cuda": hook_name,
        "cu_alloc_from_cuda": hook_name,
        "cu_plain_from_cuda": "libcuda.so.1",
        "cu_launch_from_first": "null",     # the handle has no such symbol: the hook must not invent one
        "cu_missing": "null",
        "cu_missing_error": "1",
    }, res


# --- inert in programs that never use CUDA ------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["sh", "-c", "true"],
    [sys.executable, "-c", "pass"],
    # the preload really is in the process (else this test proves nothing)
    [sys.executable, "-c", "import sys; sys.exit(0 if 'libgemhook' in open('/proc/self/maps').read() else 3)"],
    ["grep", "-q", "libgemhook", "/proc/self/maps"],
], ids=["sh", "python", "python-maps", "grep-maps"])
def test_programs_without_cuda_are_untouched(sim, argv):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_PORT=port,
                      GEMINI_LOG_LEVEL="debug")
        res = run(argv, env, timeout=30)
        assert res.rc == 0, res
        assert res.out == "" and res.err == "", res
        readable, _, _ = select.select([listener], [], [], 0.2)
        assert not readable, "the hook connected to the pod manager port"
    assert not sim.stats_file.exists(), sim.stats_file.read_text()


# --- time sharing ----------------------------------------------------------------------------------

def group_runs(rows: list[tuple[int, int, int, int, str]], group_of: dict[int, str]) -> list[tuple[str, set[int], int]]:
    """Maximal sequences of consecutive kernels of one group: (group, pids seen, kernels)."""
    runs: list[tuple[str, set[int], int]] = []
    for pid, _dev, _start, _end, _name in rows:
        g = group_of[pid]
        if runs and runs[-1][0] == g:
            runs[-1][1].add(pid)
            runs[-1] = (g, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, {pid}, 1))
    return runs


def test_processes_of_one_group_share_its_token(tmp_path, hook_lib, backends):
    """Two processes of group A run inside A's slots together (their kernels interleave), while B waits for
    its own slots: the device alternates between groups in slot-long runs, not kernel by kernel."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("A", 0.0, 1.0), Group("B", 0.0, 1.0)], quota_ms=20, min_quota_ms=20)
    argv = workload("workload-linked", "--seconds", 1.5, "--sync-every", 2)
    procs = [start(argv, sim.hooked(be, g)) for g in ("A", "A", "B")]
    results = [finish(p) for p in procs]
    for r in results:
        assert r.rc == 0, r
    group_of = {r.json["pid"]: g for r, g in zip(results, ("A", "A", "B"))}
    rows = [row for row in native.read_trace(sim.trace) if row[4] == "gem_spin" and row[0] in group_of]
    # only the time all three were running
    first = max(min(r[2] for r in rows if r[0] == pid) for pid in group_of)
    last = min(max(r[3] for r in rows if r[0] == pid) for pid in group_of)
    rows = [r for r in rows if first <= r[2] and r[3] <= last]
    assert len(rows) > 300, len(rows)
    runs = group_runs(rows, group_of)
    mean_run = len(rows) / len(runs)
    assert mean_run >= 6, f"groups alternate every {mean_run:.1f} kernels: not slot by slot"
    a_runs = [r for r in runs if r[0] == "A" and r[2] >= 6]
    both = sum(1 for r in a_runs if len(r[1]) == 2)
    assert a_runs and both >= 0.8 * len(a_runs), f"both A processes ran in {both} of {len(a_runs)} A slots"
    b_stats = sim.stats_of(results[2].json["pid"])
    assert b_stats["waits"] > 5 and b_stats["wait_ms"] > 200, b_stats


def test_processes_of_a_turns_group_take_turns(tmp_path, hook_lib, backends):
    """ProcessSharing = turns: the two processes of A run one at a time (a run of A's kernels comes from one
    process), and each gets about half of A's time."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("A", 0.0, 1.0, turns=True), Group("B", 0.0, 1.0)], quota_ms=20, min_quota_ms=20)
    argv = workload("workload-linked", "--seconds", 1.5, "--sync-every", 2)
    procs = [start(argv, sim.hooked(be, g)) for g in ("A", "A", "B")]
    results = [finish(p) for p in procs]
    for r in results:
        assert r.rc == 0, r
    pids = [r.json["pid"] for r in results]
    # split A into its two processes: runs of one pid show who held the device
    group_of = {pids[0]: "A0", pids[1]: "A1", pids[2]: "B"}
    rows = [row for row in native.read_trace(sim.trace) if row[4] == "gem_spin" and row[0] in group_of]
    first = max(min(r[2] for r in rows if r[0] == pid) for pid in group_of)
    last = min(max(r[3] for r in rows if r[0] == pid) for pid in group_of)
    rows = [r for r in rows if first <= r[2] and r[3] <= last]
    assert len(rows) > 300, len(rows)
    runs = group_runs(rows, group_of)
    a_runs = [r for r in runs if r[0] != "B"]
    mean_a_run = sum(r[2] for r in a_runs) / len(a_runs)
    assert mean_a_run >= 6, f"A's processes alternate every {mean_a_run:.1f} kernels: not turn by turn"
    a_kernels = {g: sum(r[2] for r in a_runs if r[0] == g) for g in ("A0", "A1")}
    assert min(a_kernels.values()) >= 0.35 * sum(a_kernels.values()), a_kernels


def sim_uuid(ordinal: int) -> str:
    """The UUID the simulator gives a device, as the hook writes it."""
    b = bytes([0x51, 0x6d, 0x43, 0x75, 0x64, 0x61, 0x4a, 0x40 | (ordinal >> 8 & 0x0f),
               0x80, 0x00, 0x73, 0x69, 0x6d, 0x67, 0x70, ordinal & 0xff]).hex()
    return f"GPU-{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_gpus_each_with_its_own_scheduler(tmp_path, hook_lib, backends, transport):
    """One process drives two devices at once, one thread each. Each device has its own gem-schd and pod
    manager with its own cap and memory limit, and each is held to its own. On TCP the process is told where
    each GPU's pod manager is (GEMINI_POD_MANAGERS by UUID); on sockets both backends share one directory, a
    subdirectory per GPU UUID, and the hook finds each GPU's socket by itself."""
    sim = Sim(tmp_path / "sim", hook_lib, devices=2)
    ipc = tmp_path / "ipc"
    kw = dict(quota_ms=20, min_quota_ms=5, window_ms=1000, transport=transport)
    if transport == "ipc":
        kw["ipc_dir"] = ipc
    be0 = backends([Group("g", 0.0, 0.3, "64MiB")], device_uuid=sim_uuid(0) if transport == "ipc" else None, **kw)
    be1 = backends([Group("g", 0.0, 1.0, "128MiB")], device_uuid=sim_uuid(1) if transport == "ipc" else None, **kw)
    extra = {}
    if transport == "tcp":
        extra["GEMINI_POD_MANAGERS"] = ",".join(f"{sim_uuid(i)}=127.0.0.1:{be.ports['g']}"
                                                for i, be in enumerate((be0, be1)))
    argv = client_argv("pyclient.py", "--devices", "0,1", "--seconds", 3, "--kernel-us", KERNEL_US,
                       "--sync-every", 4, "--meminfo", "--alloc", "100MiB", "--json")
    r = finish(start(argv, sim.hooked(be0, "g", **extra)))
    assert r.rc == 0, r
    d0, d1 = r.json["devices"]["0"], r.json["devices"]["1"]
    assert (d0["mem_total"], d1["mem_total"]) == (64 << 20, 128 << 20), (d0, d1)
    assert d0["alloc"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY" and d1["alloc"]["result"] == 0, (d0, d1)
    share0, share1 = d0["onchip_ns"] / d0["wall_ns"], d1["onchip_ns"] / d1["wall_ns"]
    assert 0.2 <= share0 <= 0.36 and share1 >= 0.8, (share0, share1)
    assert sim.stats_of(r.json["pid"])["gate_errors"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_capped_groups_get_their_shares(sim, backends, transport):
    """Two always-busy groups capped at 0.3 and 0.6 get close to their caps, and never far above them, on either
    transport."""
    be = backends([Group("low", 0.0, 0.3), Group("high", 0.0, 0.6)], quota_ms=20, min_quota_ms=5, window_ms=1000,
                  transport=transport)
    traces = {g: sim.dir / f"{g}.trace" for g in ("low", "high")}
    procs = {g: start(workload("workload-procaddr", "--seconds", 6, "--sync-every", 4, "--trace", traces[g]),
                      sim.hooked(be, g)) for g in traces}
    results = {g: finish(p) for g, p in procs.items()}
    for r in results.values():
        assert r.rc == 0, r
    loaded = {g: Trace.read(path) for g, path in traces.items()}
    start_ns, end_ns = common_span(loaded, trim_s=1.0)     # skip the first window, when usage has no history
    shares = shares_over(loaded, start_ns, end_ns)
    caps = {"low": 0.3, "high": 0.6}
    for g, cap in caps.items():
        assert abs(shares[g] - cap) <= 0.06, f"{g}: share {shares[g]:.3f}, cap {cap} (all: {shares})"
    # and window by window (1 s, the scheduler's window), never far above the cap
    for g, cap in caps.items():
        worst_above = max(shares_over(loaded, t, t + 1e9)[g] - cap
                          for t in range(int(start_ns), int(end_ns - 1e9) + 1, int(0.5e9)))
        assert worst_above <= 0.10, f"{g}: {worst_above * 100:.1f} pp above its cap in some 1 s window"


def test_an_idle_process_gives_its_token_back_early(tmp_path, hook_lib, backends, client_script):
    """A process that sleeps between short bursts releases its token once idle, so a busy group gets the
    time; with early release disabled the idle one sits on its slots and the busy group loses it. The two
    cases run at once, each on its own simulated device and backend."""
    seconds = 2.0
    cases = {}
    for case, idle_ms in (("early", None), ("held", 0)):
        sim = Sim(tmp_path / case, hook_lib)
        # 100 ms slots whatever the bursts: a slot the idle process sits on is a long loss for the busy one
        be = backends([Group("idle", 0.0, 1.0), Group("busy", 0.0, 1.0)], quota_ms=100, min_quota_ms=100,
                      window_ms=2000)
        idle = start(client_argv("e2e", "idle", seconds, 3, KERNEL_US, 40, script=client_script),
                     sim.hooked(be, "idle", GEMINI_IDLE_RELEASE_MS=idle_ms))
        busy = start(workload("workload-procaddr", "--seconds", seconds, "--sync-every", 4), sim.hooked(be, "busy"))
        cases[case] = (sim, idle, busy)
    share = {}
    for case, (sim, idle, busy) in cases.items():
        ri, rb = finish(idle), finish(busy)
        assert ri.rc == 0 and rb.rc == 0, f"{ri}\n{rb}"
        share[case] = rb.json["onchip_ns"] / rb.json["wall_ns"]
        idle_stats = sim.stats_of(idle.pid)
        assert idle_stats["launches"] == ri.json["launches"], idle_stats
        if case == "early":
            assert idle_stats["early_releases"] >= ri.json["bursts"] // 2, (idle_stats, ri.json)
        else:
            assert idle_stats["early_releases"] == 0, idle_stats
    # ~0.9 vs ~0.5 on an idle machine; the difference is what matters when the machine is loaded
    assert share["early"] > share["held"] + 0.15 and share["early"] > 0.6, share


# --- stream capture --------------------------------------------------------------------------------

def test_capture_survives_gating_in_another_thread(sim, backends, client_script):
    """One thread keeps a GLOBAL-mode capture open for a while; another thread of the same process launches
    all along and is gated (its tokens expire and are drained meanwhile). The capture is not invalidated,
    launches into it pass without a token, and the graph launch is gated and runs the captured kernels."""
    be = backends([Group("cap", 0.0, 0.3), Group("rival", 0.0, 1.0)], quota_ms=20, min_quota_ms=10)
    rival = start(workload("workload-procaddr", "--seconds", 3, "--sync-every", 4), sim.hooked(be, "rival"))
    res = run(client_argv("e2e", "capture", 1.2, script=client_script), sim.hooked(be, "cap"))
    assert res.rc == 0, res
    out = res.json
    assert out["begin"] == 0 and out["capture_launch_rcs"] == [0] * 8, out
    assert out["status_before_end"] == 1, out          # still ACTIVE, not INVALIDATED
    assert out["end"] == 0, out
    assert not out["ran_before_graph_launch"], out     # captured, not run
    assert out["instantiate"] == 0 and out["graph_launch"] == 0 and out["sync"] == 0, out
    assert all(onchip >= 1_000_000 for onchip in out["graph_results"]), out
    assert out["gated_errors"] == [] and out["gated_launches"] > 10, out
    # the group held no token for most of the capture, yet captured launches never waited for one
    assert out["capture_launch_max_ms"] < 40, out
    stats = sim.stats_of(out["pid"])
    assert stats["launches"] == out["gated_launches"] + 8 + 1, stats     # captured launches and the graph's
    assert stats["capture_passthrough"] >= 4, stats     # at least the four made before any token was held
    assert stats["waits"] > 3 and stats["expiries"] + stats["early_releases"] > 3, stats
    assert stats["gate_errors"] == 0, stats
    assert finish(rival).rc == 0


# --- no pod manager ---------------------------------------------------------------------------------

def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_a_pod_manager_calls_fail_quickly_or_run_ungated_when_told(sim):
    """Nothing listens on the pod manager's port: the first CUDA call that needs it returns 802 within
    GEMINI_CONNECT_TIMEOUT_MS (the program is neither killed nor hung); with GEMINI_FAIL_OPEN=1 the program
    runs ungated and says so."""
    port = _unused_port()
    timeout_ms = 1200

    def env(**extra) -> dict:
        return sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_PORT=port,
                       GEMINI_CONNECT_TIMEOUT_MS=timeout_ms, **extra)

    procs = {
        "workload": start(workload("workload-procaddr", "--kernels", 20), env()),
        "keep-going": start(workload("workload-linked", "--kernels", 20, "--keep-going"), env()),
        "pyclient": start(client_argv("pyclient.py", "--kernels", 20, "--json"), env()),
        "fail-open": start(workload("workload-procaddr", "--kernels", 20, "--sync-every", 5),
                           env(GEMINI_FAIL_OPEN=1, GEMINI_LOG_LEVEL="warn")),
    }
    res = {name: finish(p, timeout=30) for name, p in procs.items()}
    slack_s = 2.0
    for name in ("workload", "keep-going", "pyclient"):
        r = res[name]
        # the program's own exit (an error, or 0 where it counts errors and goes on), not a signal
        assert r.rc == (0 if name == "keep-going" else 1), r
        assert r.wall_s < timeout_ms / 1000 + slack_s, r
        first = r.json["first_error"]
        assert first["code"] == CUDA_ERROR_SYSTEM_NOT_READY, r
        assert f"127.0.0.1:{port}" in r.err and "unreachable" in r.err, r
    assert res["keep-going"].json["errors"] > 20, res["keep-going"]      # every launch failed too, quickly
    r = res["fail-open"]
    assert r.rc == 0, r
    assert r.json["kernels_done"] == 20 and r.json["errors"] == 0, r
    assert "UNGATED" in r.err, r
    assert r.wall_s < timeout_ms / 1000 + slack_s, r
    stats = sim.stats_of(r.json["pid"])
    assert stats["grants"] == 0 and stats["launches"] == 20, stats


# --- fork ------------------------------------------------------------------------------------------------

def test_the_queue_bound_never_breaks_a_capture_another_thread_begins(sim, backends, client_script):
    """A capped group's hooks keep the queue short (a marker event every few launches, waiting on an older one).
    One thread launches all along; another begins, fills and ends 300 short GLOBAL captures. A marker's own event
    calls in the launching thread (query, synchronise, record) must not invalidate a capture that began after the
    marker checked for one: before, 10 of 300 captures ended with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901),
    none without the hook."""
    be = backends([Group("cap", 0.0, 0.9)])
    res = run(client_argv("e2e", "capture_race", 300, script=client_script), sim.hooked(be, "cap"), timeout=120)
    assert res.rc == 0, res
    out = res.json
    stats = sim.stats_of(out["pid"])
    assert stats["markers"] > 100, stats           # the queue was bounded all along
    assert out["launch_errors"] == [] and out["bad"] == [], out


def test_the_queue_stays_bounded_after_the_primary_context_is_reset(sim, backends, client_script):
    """A capped group's process resets its primary context (cudaDeviceReset) and goes on launching. A reset primary
    context keeps its handle, and the queue-bound rings are keyed by it: their events had died with the context, so
    every marker failed to record and the queue was bounded no longer (the simulated driver's events die with
    their context, as a real driver's do)."""
    be = backends([Group("cap", 0.0, 0.9)])
    res = run(client_argv("e2e", "reset", 200, script=client_script), sim.hooked(be, "cap"), timeout=120)
    assert res.rc == 0, res
    out = res.json
    assert out["launch_errors"] == [], out
    assert out["before"] >= 20 and out["after"] >= 20, out


def test_fork_child_exits_cleanly_and_the_parent_keeps_launching(sim, backends, client_script):
    be = backends([Group("f", 0.0, 1.0), Group("rival", 0.0, 1.0)])
    rival = start(workload("workload-linked", "--seconds", 1.5, "--sync-every", 4), sim.hooked(be, "rival"))
    res = run(client_argv("e2e", "fork", 5, script=client_script), sim.hooked(be, "f"), timeout=60)
    assert res.rc == 0, res
    out = res.json
    assert len(out["children"]) == 5, out
    for child in out["children"]:
        assert os.WIFEXITED(child["status"]) and os.WEXITSTATUS(child["status"]) == 0, child
        assert child["seconds"] < 5, child
        # the simulator, like the real driver, refuses CUDA in a fork child; the hook must pass that on
        assert child["sync"] == CUDA_ERROR_NOT_INITIALIZED, child
        assert child["launch"] != 0, child
    assert out["parent_errors"] == [] and out["parent_launches"] > 20, out
    assert out["parent_result_written"] == 1, out
    parent = sim.stats_of(out["pid"])
    assert parent["launches"] == out["parent_launches"], parent      # the children's launch is not counted here
    assert parent["grants"] >= 1 and parent["gate_errors"] == 0, parent
    for child in out["children"]:
        # the child's hook reported at exit, and its counters started at zero
        assert sim.stats_of(child["pid"])["launches"] == 1, child
    assert finish(rival).rc == 0


CAPTURE_RACE = r"""
import ctypes, json, os, sys, threading, time
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import GEM_SPIN_PTX
c_void_p, c_size_t, c_int, c_u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
CUdeviceptr, byref = ctypes.c_ulonglong, ctypes.byref
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = c_int(), c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
mod, fn, buf = c_void_p(), c_void_p(), CUdeviceptr()
assert cu.cuModuleLoadData(byref(mod), GEM_SPIN_PTX.encode() + b"\0") == 0
assert cu.cuModuleGetFunction(byref(fn), mod, b"gem_spin") == 0
assert cu.cuMemAlloc_v2(byref(buf), c_size_t(48)) == 0
seconds = float(sys.argv[1])
stop = threading.Event()

def launch(stream, slot):
    out, dur = CUdeviceptr(buf.value + 24 * slot), c_u64(1000000)
    params = (c_void_p * 2)(ctypes.cast(byref(out), c_void_p), ctypes.cast(byref(dur), c_void_p))
    return cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, params, None)

def bursts(res):
    # short bursts with idle gaps: each gap ends with an early release, which drains first
    cu.cuCtxSetCurrent(ctx)
    s = c_void_p()
    assert cu.cuStreamCreate(byref(s), 1) == 0
    while not stop.is_set():
        res["errors"] += launch(s, 0) != 0
        res["errors"] += cu.cuStreamSynchronize(s) != 0
        res["bursts"] += 1
        time.sleep(0.02)

res = {"bursts": 0, "errors": 0, "captures": 0, "invalidated": 0, "other": []}
t = threading.Thread(target=bursts, args=(res,))
t.start()
s, g = c_void_p(), c_void_p()
assert cu.cuStreamCreate(byref(s), 1) == 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    rc = cu.cuStreamBeginCapture_v2(s, 2)          # RELAXED: only a context-wide synchronise can break it
    if rc == 0:
        launch(s, 1)
        time.sleep(0.005)                           # open for a while, then closed for a while
        rc = cu.cuStreamEndCapture(s, byref(g))
        res["captures"] += 1
        if rc == 901:
            res["invalidated"] += 1
        elif rc != 0:
            res["other"].append(rc)
    else:
        res["other"].append(rc)
    time.sleep(0.005)
stop.set()
t.join()
res["pid"] = os.getpid()
print(json.dumps(res))
"""


def test_a_capture_begun_during_a_drain_is_not_broken(sim, backends, tmp_path):
    """One thread runs short bursts while another begins and ends a capture every few milliseconds; the
    process's tokens expire and are drained (cuCtxSynchronize) many times meanwhile. The simulated
    cuCtxSynchronize waits 30 ms before it looks at the captures, so a capture begun after the drain checked
    for open ones, but before it synchronised, would be invalidated. The check and the drain must exclude
    capture begins: no capture is ever invalidated, while drains still happen."""
    be = backends([Group("r", 0.0, 1.0)])
    script = tmp_path / "capture_race.py"
    script.write_text(CAPTURE_RACE)
    res = run([sys.executable, str(script), "1.5"], sim.hooked(be, "r", SIMCUDA_CTX_SYNC_DELAY_US=30000), timeout=60)
    assert res.rc == 0, res
    out = res.json
    assert out["errors"] == 0 and out["other"] == [], out
    assert out["captures"] > 20 and out["bursts"] > 20, out
    stats = sim.stats_of(out["pid"])
    assert stats["drains"] >= 10, stats
    assert out["invalidated"] == 0, f"{out['invalidated']} of {out['captures']} captures were invalidated by a drain"


# --- cuGetProcAddress on CUDA 13 ------------------------------------------------------------------------

PROCADDR_IDLE = r"""
import ctypes, json, os, sys, time
sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import GEM_SPIN_PTX
c_void_p, c_size_t, c_int, c_u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
CUdeviceptr, byref = ctypes.c_ulonglong, ctypes.byref
version, bursts, kernels, sleep_ms = (int(a) for a in sys.argv[1:5])
cu = ctypes.CDLL("libcuda.so.1")
gpa = cu.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, ctypes.c_uint64, ctypes.POINTER(c_int)]

def entry(name, proto):
    # as cudart does: the driver picks the variant for (name, version, flags)
    p, st = c_void_p(), c_int(-1)
    assert gpa(name.encode(), byref(p), version, 0, byref(st)) == 0 and st.value == 0 and p.value, name
    return proto(p.value)

R = c_int
launch = entry("cuLaunchKernel", ctypes.CFUNCTYPE(R, c_void_p, *[ctypes.c_uint] * 7, c_void_p, c_void_p, c_void_p))
ctx_sync = entry("cuCtxSynchronize", ctypes.CFUNCTYPE(R, c_void_p) if version >= 13000 else ctypes.CFUNCTYPE(R))
dev, ctx = c_int(), c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
mod, fn, buf = c_void_p(), c_void_p(), CUdeviceptr()
assert cu.cuModuleLoadData(byref(mod), GEM_SPIN_PTX.encode() + b"\0") == 0
assert cu.cuModuleGetFunction(byref(fn), mod, b"gem_spin") == 0
assert cu.cuMemAlloc_v2(byref(buf), c_size_t(24)) == 0
out, dur = CUdeviceptr(buf.value), c_u64(1000000)
params = (c_void_p * 2)(ctypes.cast(byref(out), c_void_p), ctypes.cast(byref(dur), c_void_p))
errors = 0
for _ in range(bursts):
    for _ in range(kernels):
        errors += launch(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None) != 0
    errors += (ctx_sync(None) if version >= 13000 else ctx_sync()) != 0
    time.sleep(sleep_ms / 1000)
print(json.dumps({"pid": os.getpid(), "errors": errors, "launches": bursts * kernels, "bursts": bursts}))
"""


@pytest.fixture
def procaddr_idle(tmp_path) -> Path:
    path = tmp_path / "procaddr_idle.py"
    path.write_text(PROCADDR_IDLE)
    return path


def read_procaddr_log(path: Path) -> list[tuple[str, int, int, str, str]]:
    """GEMINI_PROCADDR_LOG lines as (symbol, version, flags, result, name)."""
    rows = []
    for line in path.read_text().splitlines():
        _pid, sym, ver, flags, result, name = line.split()
        rows.append((sym, int(ver), int(flags, 16), result, name))
    return rows


def test_a_cuda13_context_sync_ends_bursts_and_releases_the_token_early(sim, backends, procaddr_idle, tmp_path):
    """A program built for CUDA 13 asks cuGetProcAddress for cuCtxSynchronize at version 13000 and gets
    cuCtxSynchronize_v2(ctx) (as driver 580 answers). The hook must hand out its wrapper for that variant:
    each sync ends the burst, so the idle process gives its token back early between bursts."""
    # 100 ms slots: a token outlives each burst, so only a seen sync can give it back before its end
    be = backends([Group("s", 0.0, 1.0)], quota_ms=100, min_quota_ms=100)
    log = tmp_path / "procaddr.log"
    res = run([sys.executable, str(procaddr_idle), "13000", "12", "3", "30"],
              sim.hooked(be, "s", GEMINI_PROCADDR_LOG=log))
    assert res.rc == 0, res
    out = res.json
    assert out["errors"] == 0, out
    assert "does not intercept" not in res.err, res
    stats = sim.stats_of(out["pid"])
    assert stats["launches"] == out["launches"] and stats["procaddr_unrouted"] == 0, stats
    assert stats["early_releases"] >= out["bursts"] // 2, stats
    queries = read_procaddr_log(log)
    assert ("cuCtxSynchronize", 13000, 0, "hook", "cuCtxSynchronize_v2") in queries, queries
    assert ("cuLaunchKernel", 13000, 0, "hook", "cuLaunchKernel") in queries, queries


def test_a_procaddr_answer_that_is_no_exported_symbol_is_routed_by_name(sim, backends, procaddr_idle, tmp_path):
    """SIMCUDA_PROCADDR_ALIAS: the driver answers cuLaunchKernel and cuCtxSynchronize with functions that are
    no exported symbol. The hook cannot match them by pointer; it must route them by name, version and
    flags (cuLaunchKernel, cuCtxSynchronize_v2), say so and count it, so launches are still gated and syncs
    still end bursts."""
    be = backends([Group("a", 0.0, 1.0)], quota_ms=100, min_quota_ms=100)
    log = tmp_path / "procaddr.log"
    res = run([sys.executable, str(procaddr_idle), "13000", "12", "3", "30"],
              sim.hooked(be, "a", GEMINI_PROCADDR_LOG=log, SIMCUDA_PROCADDR_ALIAS=1, GEMINI_LOG_LEVEL="info"))
    assert res.rc == 0, res
    out = res.json
    assert out["errors"] == 0, out
    stats = sim.stats_of(out["pid"])
    assert stats["procaddr_fallback"] == 2 and stats["procaddr_unrouted"] == 0, stats
    assert stats["launches"] == out["launches"] and stats["grants"] >= 1, stats
    assert stats["early_releases"] >= out["bursts"] // 2, stats
    assert "routed by name to cuCtxSynchronize_v2" in res.err, res
    queries = read_procaddr_log(log)
    assert ("cuCtxSynchronize", 13000, 0, "fallback", "cuCtxSynchronize_v2") in queries, queries
    assert ("cuLaunchKernel", 13000, 0, "fallback", "cuLaunchKernel") in queries, queries


def test_a_holder_gives_the_gpu_back_when_its_burst_ends_while_another_group_waits(sim, backends):
    """Two groups whose steps are a 10 ms burst and 30 ms of host work (bench_um's jobs, scaled down), with a
    25 ms idle release: a holder that kept the token through its idle release would leave the GPU idle for
    the other group 25 ms of every step. gem-schd says on the board that another group could be granted now
    (groups_waiting), so the holder's hooks give the token back once the burst is over (the 2 ms merge gap;
    a holder already idle sees it within a millisecond), counted as group_passes. On the simulator, against
    the same job alone: 1.27x its time with the pass, 1.80x without."""
    be = backends([Group("a", 0.0, 1.0), Group("b", 0.0, 1.0)], quota_ms=100, min_quota_ms=5, window_ms=2000)
    steps = 40
    argv = workload("workload-linked", "--kernels", 10 * steps, "--kernel-us", KERNEL_US, "--sync-every", 10,
                    "--think-us", 30_000)
    alone = finish(start(argv, sim.hooked(be, "a", GEMINI_IDLE_RELEASE_MS=25)), timeout=60)
    assert alone.rc == 0, alone
    procs = {g: start(argv, sim.hooked(be, g, GEMINI_IDLE_RELEASE_MS=25)) for g in ("a", "b")}
    runs = {g: finish(p, timeout=60) for g, p in procs.items()}
    for g, r in runs.items():
        assert r.rc == 0, r
        stats = sim.stats_of(procs[g].pid)
        slowdown = r.json["wall_ns"] / alone.json["wall_ns"]
        assert slowdown < 1.55, (g, slowdown, stats)
        assert stats["group_passes"] >= steps // 2, (g, stats)
