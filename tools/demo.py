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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import Backend, Trace, common_span, shares_over  # noqa: E402
from gemini.config import load_config  # noqa: E402
from gemini.ctl import SchedulerUnreachable, StatusClient, format_table  # noqa: E402
from gemini.wire.sched import StatusReply  # noqa: E402
from gemini.scheduler.policy import fair_targets  # noqa: E402

log = logging.getLogger("demo")

WINDOW_MS = 5000    # gem-schd's window here: shorter than its default 10 s, so the shares settle within the run


@dataclass
class StatusReading:
    """gem-schd's status as `gem-ctl status` asks for it, and when (CLOCK_MONOTONIC ns, as in the clients' traces)."""
    reply: Optional[StatusReply]
    at_ns: int
    endpoint: str
    error: str = ""


def read_status(port: int) -> StatusReading:
    client = StatusClient("127.0.0.1", port, timeout_s=10.0)
    try:
        before = time.monotonic_ns()
        reply = client.status()
        return StatusReading(reply, (before + time.monotonic_ns()) // 2, client.endpoint)
    except SchedulerUnreachable as exc:
        return StatusReading(None, 0, client.endpoint, str(exc))
    finally:
        client.close()


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
    backend = Backend(work, config=Path(args.config), quota_ms=50, min_quota_ms=10, window_ms=WINDOW_MS, env=env,
                      extra_args=[f"--schd-arg=--trace={trace_file}"])
    log.info("Config %s (%s format); gem-schd window %g s, quota 50 ms.", args.config, config.format,
             WINDOW_MS / 1000)
    backend.start()
    try:
        blocks = "132" if gpu else "1"
        procs = {}
        for g in groups:
            argv = [client_path("workload-procaddr"), "--seconds", seconds, "--kernel-us", 1000, "--sync-every", 1,
                    "--blocks", blocks, "--trace", work / f"{g.name}.trace", "--json"]
            procs[g.name] = backend.spawn(g.name, argv, env=env)
        clients_started_ns = time.monotonic_ns()
        log.info("Running one always-busy client in each of %s for %.0f s ...", ", ".join(procs), seconds)
        time.sleep(max(0.0, seconds - 2.0))
        status = read_status(backend.port)
        outputs = {name: proc.communicate(timeout=seconds + 60) for name, proc in procs.items()}
    finally:
        backend.stop()
    failed = {n: err[-1500:] for n, (out, err) in outputs.items() if procs[n].returncode != 0}
    if failed:
        log.error("client(s) failed: %s", failed)
        return 1
    traces = {g.name: Trace.read(work / f"{g.name}.trace") for g in groups}
    # One span for everything below: gem-schd's window as it stood when gem-ctl status asked (what its SHARE
    # covers), cut to the time every client ran.
    start, end = common_span(traces)
    if status.reply is not None:
        start, end = max(start, status.at_ns - WINDOW_MS * 1e6), min(end, status.at_ns)
    achieved = shares_over(traces, start, end)
    expected = fair_targets({g.name: g.max_util for g in groups})
    scheduled = {row["name"]: row["share"] for row in status.reply.groups} if status.reply is not None else {}
    where = "GPU" if gpu else "simulated driver"
    print()
    print(f"Each group's share over {(end - start) / 1e9:.1f} s ({where})"
          + (", the window of the gem-ctl status below:" if status.reply is not None else ":"))
    print(f"{'GROUP':<12}{'MinUtil':>9}{'MaxUtil':>9}{'expected':>10}{'gem-schd':>10}{'achieved':>10}{'kernels':>10}")
    for g in groups:
        t = traces[g.name]
        kernels = t.kernels_at(end) - t.kernels_at(start)
        share = f"{scheduled[g.name]:>10.3f}" if g.name in scheduled else f"{'-':>10}"
        print(f"{g.name:<12}{g.min_util:>9.2f}{g.max_util:>9.2f}{expected[g.name]:>10.3f}{share}"
              f"{achieved[g.name]:>10.3f}{kernels:>10.0f}")
    total = f"{sum(scheduled.values()):>10.3f}" if scheduled else f"{'-':>10}"
    print(f"{'total':<12}{'':>9}{'':>9}{sum(expected.values()):>10.3f}{total}{sum(achieved.values()):>10.3f}")
    print("gem-schd: the time the scheduler gave the group (SHARE in gem-ctl status); achieved: the on-chip time of "
          "its kernels; kernels: how many ran in that time.")
    print()
    if status.reply is not None:
        print(f"gem-ctl status, {seconds - (status.at_ns - clients_started_ns) / 1e9:.1f} s before the end of the run:")
        print(format_table(status.reply, status.endpoint))
    else:
        print(f"(gem-ctl status failed: {status.error})")
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
