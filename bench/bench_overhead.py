"""Overhead of the hook for a single tenant, against native in the same run, interleaved.

    python bench/bench_overhead.py launch --rounds 5      # host cost per cuLaunchKernel (bench/launch_cost.c)
    python bench/bench_overhead.py train --rounds 3       # ResNet-18 training steps/s (tests/gpu/workloads)
    python bench/bench_overhead.py alloc --rounds 3       # cuMemAlloc/cuMemFree latency (bench/alloc_cost.c)
    python bench/bench_overhead.py launch --latency-neighbour  # the same with the in-flight bound on

The hooked runs use a backend with one group (MinUtil 0, MaxUtil 1). For the launch benchmark the quota
is long (the token is held throughout, so the launch path is the fast path being measured); for
training it is gem-schd's default 250 ms, so token turnover is part of what is measured.
Prints one JSON object with every round and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO_ROOT, Backend, Group, last_json, read_stats  # noqa: E402

LAUNCH_COST = REPO_ROOT / "build" / "bench" / "launch_cost"
ALLOC_COST = REPO_ROOT / "build" / "bench" / "alloc_cost"
RESNET = REPO_ROOT / "tests" / "gpu" / "workloads" / "resnet_train.py"


def run_json(argv: list, env: dict, timeout: float) -> dict:
    proc = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return last_json(proc.stdout)


def interleaved(kind: str, rounds: int, quota_ms: float, program: list, key: str, timeout: float,
                latency_neighbour: bool = False) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    env = dict(os.environ)
    stats_file = work / "stats"
    native, hooked, extra, runs = [], [], {}, {"native": [], "hooked": []}
    groups = [Group("solo", 0.0, 1.0, "200GiB")]
    if latency_neighbour:
        # an idle latency group in the config: the solo group's grants then carry the in-flight bound
        # (GEM_GRANT_BOUND | GEM_GRANT_TIGHT), so every launch also pays for the marker events
        groups.append(Group("lat", 0.1, 1.0, "1GiB", sched_class="latency"))
    with Backend(work / "backend", groups, quota_ms=quota_ms, min_quota_ms=10,
                 window_ms=max(10000, quota_ms * 2), env=env) as be:
        henv = dict(env, GEMINI_STATS_FILE=str(stats_file))
        for _ in range(rounds):
            result = run_json(program, env, timeout)
            native.append(result[key])
            hooked_result = run_json(be.command("solo", program), henv, timeout)
            hooked.append(hooked_result[key])
            runs["native"].append(result)
            runs["hooked"].append(hooked_result)
            extra = {k: v for k, v in result.items() if k.startswith("clock") or k.startswith("coarse")}
    return {"native": native, "hooked": hooked, "native_median": statistics.median(native),
            "hooked_median": statistics.median(hooked), "hook_stats": read_stats(stats_file), "runs": runs, **extra}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["launch", "train", "alloc"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=10, help="training seconds per round")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--quota", type=float, help="gem-schd base quota, ms")
    p.add_argument("--latency-neighbour", action="store_true",
                   help="configure an idle Class = latency group beside the measured one (in-flight bound on)")
    args = p.parse_args(argv)
    if args.what == "launch":
        if not LAUNCH_COST.exists():
            subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "bench-native"], check=True)
        r = interleaved("launch", args.rounds, args.quota or 8000, [LAUNCH_COST, 3000, 128], "ns_per_launch_median",
                        120, latency_neighbour=args.latency_neighbour)
        r["added_ns_per_launch"] = r["hooked_median"] - r["native_median"]
        r.pop("hook_stats")
    elif args.what == "alloc":
        if not ALLOC_COST.exists():
            subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "bench-native"], check=True)
        r = interleaved("alloc", args.rounds, args.quota or 250, [ALLOC_COST, 2000], "alloc_us_p50", 120)
        r.pop("hook_stats")
    else:
        r = interleaved("train", args.rounds, args.quota or 250, [sys.executable, RESNET, args.seconds, args.batch],
                        "steps_per_s", args.seconds + 300)
        r["overhead_pct"] = (1 - r["hooked_median"] / r["native_median"]) * 100
        r["hook_stats"] = {str(k): v for k, v in r["hook_stats"].items()}
    r["what"] = args.what
    r["latency_neighbour"] = args.latency_neighbour
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
