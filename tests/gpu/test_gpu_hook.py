"""On a real GPU: every framework runs under the hook with correct results and gated launches.

Skipped where no NVIDIA driver is present (tests/conftest.py). `make gpu-check` runs these and
collects one JSON line per test in $GEMINI_GPU_REPORT for the report.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import Backend, Group, Trace, last_json, read_stats, shares_over
from tests.native import build_native, client_path

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"


def record(name: str, **fields) -> None:
    path = os.environ.get("GEMINI_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **fields}) + "\n")


def total(stats: dict, key: str) -> float:
    return sum(s.get(key, 0) for s in stats.values())


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    build_native()
    workdir = tmp_path_factory.mktemp("gpu-backend")
    groups = [Group("solo", 0.0, 1.0, "100GiB"), Group("capped", 0.0, 0.25, "100GiB")]
    with Backend(workdir, groups, quota_ms=50, min_quota_ms=10, window_ms=2000) as be:
        yield be


UNROUTED = "returned a variant gemini does not intercept"


def run_hooked(backend: Backend, group: str, argv: list, tmp_path: Path, timeout: float = 900,
               env_extra: dict | None = None):
    stats_file = tmp_path / "stats"
    env = dict(os.environ, GEMINI_STATS_FILE=str(stats_file), **(env_extra or {}))
    proc = backend.spawn(group, [str(a) for a in argv], env=env, stdin=subprocess.DEVNULL)
    out, err = proc.communicate(timeout=timeout)
    assert UNROUTED not in err, "\n".join(ln for ln in err.splitlines() if UNROUTED in ln)
    return proc.returncode, out, err, read_stats(stats_file)


def check_stats(stats: dict) -> dict:
    summary = {k: total(stats, k) for k in ("launches", "grants", "waits", "procaddr_routed", "procaddr_fallback",
                                            "procaddr_unrouted", "dlsym_routed", "capture_passthrough",
                                            "gate_errors", "mem_allocs", "early_releases")}
    assert summary["launches"] > 0, f"no launch went through the hook: {stats}"
    assert summary["grants"] >= 1, f"no token was granted: {stats}"
    assert summary["gate_errors"] == 0, stats
    assert summary["procaddr_unrouted"] == 0, f"cuGetProcAddress answers left unrouted: {stats}"
    return summary


FRAMEWORKS = ["torch_train.py", "torch_graphs.py", "torch_compile_graphs.py", "cupy_kernels.py", "jax_jit.py",
              "numba_kernel.py", "triton_kernel.py"]


@pytest.mark.parametrize("script", FRAMEWORKS)
def test_framework_runs_correctly_under_the_hook(backend, script, tmp_path):
    rc, out, err, stats = run_hooked(backend, "solo", [sys.executable, WORKLOADS / script], tmp_path)
    assert rc == 0, err[-4000:]
    verdict = last_json(out)
    summary = check_stats(stats)
    record(script, ok=verdict.get("ok"), **summary)
    assert verdict["ok"], verdict


@pytest.mark.parametrize("script,args", [("torch_train.py", ["300"]), ("torch_graphs.py", ["3000"])])
def test_framework_is_gated_in_a_capped_group(backend, script, args, tmp_path):
    """MaxUtil 0.25: the process must wait for tokens, which only happens if its launches are gated."""
    rc, out, err, stats = run_hooked(backend, "capped", [sys.executable, WORKLOADS / script, *args], tmp_path)
    assert rc == 0, err[-4000:]
    verdict = last_json(out)
    assert verdict["ok"], verdict
    summary = check_stats(stats)
    record(f"capped:{script}", **summary)
    assert summary["waits"] > 1, f"never waited for a token: {stats}"


@pytest.fixture(scope="module")
def cudart_binaries(tmp_path_factory):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if not nvcc:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("nvcc")
    built = {}
    for mode, flags in (("default", []), ("per-thread", ["--default-stream", "per-thread"])):
        exe = out / f"spin_{mode}"
        subprocess.run([nvcc, "-O2", *flags, "-o", str(exe), str(HERE / "spin_cudart.cu")], check=True)
        built[mode] = exe
    return built


@pytest.mark.parametrize("mode", ["default", "per-thread"])
def test_nvcc_static_cudart_binary(backend, cudart_binaries, mode, tmp_path):
    kernels = 300
    rc, out, err, stats = run_hooked(backend, "solo", [cudart_binaries[mode], kernels, 200], tmp_path)
    assert rc == 0, err[-4000:]
    verdict = last_json(out)
    summary = check_stats(stats)
    record(f"nvcc-{mode}", ok=verdict["ok"], **summary)
    assert verdict["ok"], verdict
    assert summary["launches"] >= kernels
    assert summary["procaddr_routed"] > 0, "static cudart must reach the hook through cuGetProcAddress"


@pytest.mark.parametrize("client", ["workload-linked", "workload-procaddr"])
def test_driver_api_programs(backend, client, tmp_path):
    kernels = 200
    rc, out, err, stats = run_hooked(backend, "solo", [client_path(client), "--kernels", kernels, "--kernel-us", 100,
                                                        "--sync-every", 10, "--json"], tmp_path)
    assert rc == 0, err[-4000:]
    result = last_json(out)
    summary = check_stats(stats)
    record(client, kernels_done=result["kernels_done"], **summary)
    assert result["kernels_done"] == kernels
    assert summary["launches"] == kernels, "every launch of the program must pass the hook"


def test_capped_spin_share(backend, tmp_path):
    """A full-width spin tenant alone in a group capped at 0.25 gets 0.25 of on-chip time."""
    trace = tmp_path / "spin.trace"
    rc, out, err, stats = run_hooked(backend, "capped", [client_path("workload-procaddr"), "--seconds", 8,
                                                         "--kernel-us", 1000, "--sync-every", 1, "--blocks", 132,
                                                         "--trace", trace, "--json"], tmp_path)
    assert rc == 0, err[-4000:]
    t = Trace.read(trace)
    start, end = t.host_ns[0] + 2e9, t.host_ns[-1]
    share = shares_over({"spin": t}, start, end)["spin"]
    summary = check_stats(stats)
    record("capped-spin", share=share, **summary)
    assert abs(share - 0.25) < 0.03, share


# --- cuGetProcAddress: what each runtime really asks for ------------------------------------------------

def procaddr_queries(log: Path) -> list[dict]:
    """GEMINI_PROCADDR_LOG lines ("pid symbol version flags result name") as dicts."""
    rows = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) != 6:
            raise AssertionError(f"malformed GEMINI_PROCADDR_LOG line {line!r}")
        pid, sym, ver, flags, result, name = parts
        rows.append({"pid": int(pid), "symbol": sym, "version": int(ver), "flags": int(flags, 16),
                     "result": result, "name": name})
    return rows


RUNTIMES = {
    "torch": lambda bins: [sys.executable, WORKLOADS / "torch_train.py", "40"],
    "cupy": lambda bins: [sys.executable, WORKLOADS / "cupy_kernels.py"],
    "nvcc-default": lambda bins: [bins["default"], 200, 100],
    "nvcc-per-thread": lambda bins: [bins["per-thread"], 200, 100],
}


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_every_procaddr_query_of_a_runtime_is_routed(backend, cudart_binaries, runtime, tmp_path):
    """Every (symbol, version, flags) the runtime really asks cuGetProcAddress for is logged with where the hook
    routed it: no query of a function the hook intercepts may be left unrouted (the stderr check in run_hooked
    and the log say the same), and the launch and context-sync queries must reach the hook's wrappers."""
    log = tmp_path / "procaddr.log"
    rc, out, err, stats = run_hooked(backend, "solo", RUNTIMES[runtime](cudart_binaries), tmp_path,
                                     env_extra={"GEMINI_PROCADDR_LOG": str(log)})
    assert rc == 0, err[-4000:]
    assert last_json(out)["ok"], out[-2000:]
    summary = check_stats(stats)
    queries = procaddr_queries(log)
    assert queries, "the runtime never called cuGetProcAddress"
    unrouted = [q for q in queries if q["result"] == "unrouted"]
    routed = {(q["symbol"], q["version"], q["flags"]): q["name"] for q in queries
              if q["result"] in ("hook", "fallback")}
    asked = sorted({q["version"] for q in queries})
    record(f"procaddr:{runtime}", queries=len(queries), routed=len(routed), unrouted=len(unrouted), versions=asked,
           ctx_sync=sorted({n for (s, _, _), n in routed.items() if s == "cuCtxSynchronize"}), **summary)
    assert not unrouted, unrouted
    # cudart resolves its whole driver table at start-up (on the H100 every runtime asked for
    # cuCtxSynchronize at 13000 whether or not it synchronised), so both are asked for and must be routed
    symbols = {s for s, _, _ in routed}
    assert "cuLaunchKernel" in symbols, sorted(routed.items())
    assert "cuCtxSynchronize" in symbols, sorted(routed.items())


@pytest.fixture(scope="module")
def long_slots(tmp_path_factory):
    """100 ms slots whatever the bursts: only a seen synchronisation can give a token back before its end."""
    build_native()
    with Backend(tmp_path_factory.mktemp("gpu-long-slots"), [Group("serve", 0.0, 1.0, "100GiB")], quota_ms=100,
                 min_quota_ms=100, window_ms=2000) as be:
        yield be


def test_torch_synchronize_between_bursts_gives_the_token_back_early(long_slots, tmp_path):
    """torch.cuda.synchronize() between bursts, then idle: on a CUDA 13 runtime that is cuCtxSynchronize_v2.
    The hook must see it end each burst and give the idle token back early (early_releases), instead of
    sitting on it to the slot's end (early_releases 0 was measured before cuCtxSynchronize_v2 was
    intercepted)."""
    log = tmp_path / "procaddr.log"
    bursts = 40
    rc, out, err, stats = run_hooked(long_slots, "serve", [sys.executable, WORKLOADS / "torch_sync_bursts.py", bursts,
                                                           30], tmp_path, env_extra={"GEMINI_PROCADDR_LOG": str(log)})
    assert rc == 0, err[-4000:]
    verdict = last_json(out)
    assert verdict["ok"], verdict
    summary = check_stats(stats)
    sync = sorted({(q["version"], q["result"], q["name"]) for q in procaddr_queries(log)
                   if q["symbol"] == "cuCtxSynchronize"})
    record("torch-sync-bursts", cuda_runtime=verdict.get("cuda_runtime"), ctx_sync=sync, **summary)
    assert sync and all(result in ("hook", "fallback") for _, result, _ in sync), sync
    assert summary["early_releases"] >= max(1, bursts // 4), summary


def test_a_trainer_running_through_a_scheduler_restart_pauses_for_claims_after_it(tmp_path):
    """gem-schd is SIGKILLed under a running ResNet-18 trainer and launch-backend restarts it; the new gem-schd
    makes a new board page. A latency tenant then serves for 6 s. The trainer must move to the new page (its pod
    manager marks its line on the old one; `board_moves`) and pause for the tenant's claims (`claim_pauses`),
    which its pod manager writes on the new page. Before, it read the old page for good and never paused."""
    import signal
    import time

    from tests.e2e_fixtures import all_registered

    build_native()
    groups = [Group("inf", 0.5, 1.0, "100GiB", sched_class="latency"), Group("train", 0.0, 1.0, "100GiB")]
    with Backend(tmp_path / "be", groups, quota_ms=None, min_quota_ms=None, window_ms=None) as be:
        train_stats, inf_stats = tmp_path / "train.stats", tmp_path / "inf.stats"
        train = be.spawn("train", [sys.executable, str(WORKLOADS / "train_loop.py"), "eager", "40"],
                         env=dict(os.environ, GEMINI_STATS_FILE=str(train_stats)), stdin=subprocess.DEVNULL)
        try:
            assert train.stdout is not None
            for line in train.stdout:           # warm-up done: it trains
                if '"steps"' in line:
                    break
            old = be.daemon_pids()["gem-schd"]
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while be.daemon_pids().get("gem-schd", old) == old or not all_registered(be):
                assert time.monotonic() < deadline, "gem-schd did not come back with both pod managers"
                time.sleep(0.1)
            time.sleep(0.5)
            inf = be.spawn("inf", [sys.executable, str(WORKLOADS / "infer_latency.py"), "6", "20"],
                           env=dict(os.environ, GEMINI_STATS_FILE=str(inf_stats)), stdin=subprocess.DEVNULL)
            out, err = inf.communicate(timeout=300)
            assert inf.returncode == 0, err[-4000:]
            served = last_json(out)
        finally:
            train.send_signal(signal.SIGTERM)
            _, train_err = train.communicate(timeout=120)
    assert train.returncode == 0, train_err[-4000:]
    # (one process each; should a framework start helpers, the busiest is the one that trained or served)
    trainer = max(read_stats(train_stats).values(), key=lambda st: st.get("launches", 0))
    server = max(read_stats(inf_stats).values(), key=lambda st: st.get("launches", 0))
    keys = ("grants", "claim_pauses", "claim_pause_ms", "board_moves", "continuations", "procaddr_unrouted")
    record("restart-board", served_p50_ms=served.get("p50_ms"), served_p99_ms=served.get("p99_ms"),
           requests=served.get("requests"), trainer={k: trainer.get(k) for k in keys},
           server={k: server.get(k) for k in keys})
    assert trainer.get("board_moves", 0) >= 1, trainer
    assert trainer.get("claim_pauses", 0) >= 50, trainer
