#!/usr/bin/env python3
"""`make demo`: gemini's main job on the shipped resource-config.txt.

Starts the backend (gem-schd and one gem-pmgr per group), runs one always-busy client in each of the
first two groups, and prints each group's configured and achieved share of GPU time, measured from
the kernels' own on-chip time. On a machine without an NVIDIA driver it runs the same thing on the
simulated CUDA driver from tests/simcuda and says so.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import Backend, Trace, common_span, last_json, shares_over  # noqa: E402
from gemini.config import load_config  # noqa: E402
from gemini.scheduler.policy import fair_targets  # noqa: E402

log = logging.getLogger("demo")


def real_gpu() -> bool:
    """A real NVIDIA driver that initialises (the simulator identifies itself and does not count)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if hasattr(lib, "simcuda_is_simulated"):
        return False
    count = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "resource-config.txt"))
    p.add_argument("--seconds", type=float, help="how long the clients run (default 20 on a GPU, 12 simulated)")
    p.add_argument("--simulated", action="store_true", help="use the simulated driver even if a GPU is present")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    gpu = real_gpu() and not args.simulated
    subprocess.run(["make", "-s", "-C", str(REPO), "hook"], check=True)
    from tests.native import build_native, client_path, sim_env
    build_native()
    work = Path(tempfile.mkdtemp(prefix="gemini-demo-"))
    if gpu:
        env = None
        log.info("Running on the real GPU.")
    else:
        env = sim_env(work / "simcuda-shm", mem_bytes=16 << 30)
        log.info("No NVIDIA driver here: running on the SIMULATED CUDA driver (tests/simcuda). Kernels of all "
                 "processes take turns on one simulated device; shares are of simulated kernel time.")
    seconds = args.seconds or (20.0 if gpu else 12.0)

    config = load_config(args.config)
    groups = config.groups[:2]
    if len(groups) < 2:
        log.error("%s defines %d group(s); the demo needs two", args.config, len(groups))
        return 2
    trace_file = work / "grants.json"
    # A shorter window than gem-schd's default 10 s, so the shares settle within the demo's run.
    backend = Backend(work, config=Path(args.config), quota_ms=50, min_quota_ms=10, window_ms=5000, env=env,
                      extra_args=[f"--schd-arg=--trace={trace_file}"])
    log.info("Config %s (%s format); gem-schd window 5 s, quota 50 ms.", args.config, config.format)
    backend.start()
    try:
        blocks = "132" if gpu else "1"
        procs = {}
        for g in groups:
            argv = [client_path("workload-procaddr"), "--seconds", seconds, "--kernel-us", 1000, "--sync-every", 1,
                    "--blocks", blocks, "--trace", work / f"{g.name}.trace", "--json"]
            procs[g.name] = backend.spawn(g.name, argv, env=env)
        log.info("Running one always-busy client in each of %s for %.0f s ...", ", ".join(procs), seconds)
        time.sleep(max(0.0, seconds - 2.0))
        status = subprocess.run([sys.executable, "-m", "gemini.ctl", "--port", str(backend.port), "status"],
                                cwd=REPO, capture_output=True, text=True, timeout=20)
        outputs = {name: proc.communicate(timeout=seconds + 60) for name, proc in procs.items()}
    finally:
        backend.stop()
    failed = {n: err[-1500:] for n, (out, err) in outputs.items() if procs[n].returncode != 0}
    if failed:
        log.error("client(s) failed: %s", failed)
        return 1
    traces = {g.name: Trace.read(work / f"{g.name}.trace") for g in groups}
    start, end = common_span(traces, trim_s=3.0 if seconds >= 10 else 1.0)
    achieved = shares_over(traces, start, end)
    expected = fair_targets({g.name: g.max_util for g in groups})
    print()
    print(f"{'GROUP':<12}{'MinUtil':>9}{'MaxUtil':>9}{'expected':>10}{'achieved':>10}   "
          f"({'GPU' if gpu else 'simulated driver'}, on-chip time over {((end - start) / 1e9):.1f} s)")
    for g in groups:
        print(f"{g.name:<12}{g.min_util:>9.2f}{g.max_util:>9.2f}{expected[g.name]:>10.3f}{achieved[g.name]:>10.3f}")
    print(f"{'total':<12}{'':>9}{'':>9}{sum(expected.values()):>10.3f}{sum(achieved.values()):>10.3f}")
    for name, (out, _) in outputs.items():
        result = last_json(out)
        log.info("%s: %d kernels, %.2f s on-chip", name, result["kernels_done"], result["onchip_ns"] / 1e9)
    print()
    print("gem-ctl status, 2 s before the end of the run:")
    print(status.stdout.rstrip() or f"(gem-ctl status failed: {status.stderr.strip()[-300:]})")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.info("matplotlib is not installed: no plot (pip install matplotlib, then gem-ctl plot %s)", trace_file)
    else:
        png = REPO / "demo-share.png"
        plot = subprocess.run([sys.executable, "-m", "gemini.ctl", "plot", str(trace_file), "-o", str(png)],
                              cwd=REPO, capture_output=True, text=True)
        log.info("share plot: %s" if plot.returncode == 0 else "plot failed: %s",
                 png if plot.returncode == 0 else plot.stderr.strip()[-300:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
