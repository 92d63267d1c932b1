"""Overhead of the hook for a single tenant, against native in the same run, interleaved.

    python bench/bench_overhead.py launch --rounds 11     # host cost per cuLaunchKernel (bench/launch_cost.c)
    python bench/bench_overhead.py launch --sync stream   # the same, each batch ended by cuStreamSynchronize
    python bench/bench_overhead.py train --rounds 3       # ResNet-18 training steps/s (tests/gpu/workloads)
    python bench/bench_overhead.py alloc --rounds 3       # cuMemAlloc/cuMemFree latency (bench/alloc_cost.c)

The hooked runs use a backend with one group (MinUtil 0, MaxUtil 1). For the launch benchmark the quota
is long (the token is held throughout, so the launch path is the fast path being measured); for
training it is gem-schd's default 250 ms, so token turnover is part of what is measured.
Prints one JSON object with every round and the medians.

The launch benchmark measures three cases in every round, in a rotating order, each process pinned to the same
core: native, hooked, and hooked with an idle `Class = latency` group configured beside it (its grants then carry
the in-flight bound, so launches also pay for the marker events; the class is switched by a live config edit).
Separate processes differ by up to 1 us per launch from one run to the next (pinned to one core or not), ten
times the goal of +0.1 us, so each process also times its launches in alternate batches through the pointer
it was given and through the driver's own cuLaunchKernel (launch_cost.c): the median of those pairs'
differences is the hook's added cost on one driver state (`in_process_added_ns`, the median over rounds; the
native runs' same figure, where both are the driver's function, is the measurement's own noise).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO_ROOT, Backend, Group, last_json, read_stats, write_config  # noqa: E402

LAUNCH_COST = REPO_ROOT / "build" / "bench" / "launch_cost"
ALLOC_COST = REPO_ROOT / "build" / "bench" / "alloc_cost"
RESNET = REPO_ROOT / "tests" / "gpu" / "workloads" / "resnet_train.py"


def run_json(argv: list, env: dict, timeout: float, cpu: int | None = None) -> dict:
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    proc = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return last_json(proc.stdout)


def launch_rounds(rounds: int, quota_ms: float, program: list, key: str, timeout: float) -> dict:
    """native / hooked / hooked beside an idle latency group, each round in a rotating order, on one core."""
    work = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    env = dict(os.environ)
    cpu = max(os.sched_getaffinity(0))
    config = work / "resource-config.txt"

    def configure(lat_class: str) -> None:
        # group `lat` stays idle: as `Class = latency` it makes the solo group's grants carry the in-flight bound
        # (GEM_GRANT_BOUND | GEM_GRANT_TIGHT); as batch it changes nothing
        tmp = config.with_suffix(".tmp")
        write_config(tmp, [Group("solo", 0.0, 1.0, "200GiB"), Group("lat", 0.1, 1.0, "1GiB", sched_class=lat_class)])
        os.replace(tmp, config)
        time.sleep(0.3)    # gem-schd reloads within ~10 ms

    configure("batch")
    cases = ("native", "hooked", "bound")
    runs: dict = {c: [] for c in cases}
    extra: dict = {}
    with Backend(work / "backend", [Group("solo"), Group("lat")], config=config, quota_ms=quota_ms, min_quota_ms=10,
                 window_ms=max(10000, quota_ms * 2), env=env) as be:
        for r in range(rounds):
            for case in cases[r % 3:] + cases[:r % 3]:
                if case == "native":
                    res = run_json(program, env, timeout, cpu)
                    extra = {k: v for k, v in res.items() if k.startswith("clock") or k.startswith("coarse")}
                else:
                    configure("latency" if case == "bound" else "batch")
                    henv = dict(env, GEMINI_STATS_FILE=str(work / f"stats-{case}"))
                    res = run_json(be.command("solo", program), henv, timeout, cpu)
                runs[case].append(res)
    vals = {c: [x[key] for x in runs[c]] for c in cases}
    added = [h - n for h, n in zip(vals["hooked"], vals["native"])]
    added_bound = [b - n for b, n in zip(vals["bound"], vals["native"])]
    paired = {c: [x["paired_added_median"] for x in runs[c] if x.get("paired_found")] for c in cases}
    # what the hooks did (every process of a case together): markers per launch tell the bound's amortisation
    hook = {}
    for c in ("hooked", "bound"):
        procs = read_stats(work / f"stats-{c}").values()
        hook[c] = {k: sum(p.get(k, 0) for p in procs) for k in ("launches", "markers", "marker_waits", "marker_grows",
                                                                  "marker_shrinks", "grants", "marker_wait_ms",
                                                                  "marker_host_ms", "gpu_gate_waits",
                                                                  "kernels_measured", "kernel_costs_learnt",
                                                                  "kernel_cost_learnt_ms", "kernel_cost_checks")}
    return {"cpu": cpu,
            "in_process_added_ns": statistics.median(paired["hooked"]) if paired["hooked"] else None,
            "in_process_added_ns_bound": statistics.median(paired["bound"]) if paired["bound"] else None,
            "in_process_native_control_ns": statistics.median(paired["native"]) if paired["native"] else None,
            "in_process_each_round": paired, "hook_stats": hook,
            "native": vals["native"], "hooked": vals["hooked"], "bound": vals["bound"],
            "native_median": statistics.median(vals["native"]), "hooked_median": statistics.median(vals["hooked"]),
            "bound_median": statistics.median(vals["bound"]),
            "added_ns_per_launch": statistics.median(added),
            "added_ns_per_launch_bound": statistics.median(added_bound),
            "added_each_round": added, "added_bound_each_round": added_bound, "runs": runs, **extra}


def interleaved(kind: str, rounds: int, quota_ms: float | None, program: list, key: str, timeout: float,
                idle_neighbour: bool = False) -> dict:
    """Native and hooked runs of `program`, alternated. `quota_ms` None runs gem-schd with its default flags (what a
    user gets, and what the goals are judged with); a number passes `-q` and the short `-m` and long `-w` that suit
    it. With `idle_neighbour` each round also runs it hooked in a second backend whose config has another group,
    configured but idle (MinUtil 0.5): what a configured neighbour costs a group that has the GPU to itself (its
    grants carry GEM_GRANT_BOUND, so its hook places timed markers; docs/benchmarks.md, "Twenty-seventh session")."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    env = dict(os.environ)
    stats_file = work / "stats"
    native, hooked, beside, extra = [], [], [], {}
    runs: dict[str, list] = {"native": [], "hooked": []}
    flags = dict(quota_ms=None, min_quota_ms=None, window_ms=None) if quota_ms is None else \
        dict(quota_ms=quota_ms, min_quota_ms=10, window_ms=max(10000, quota_ms * 2))
    solo = Group("solo", 0.0, 1.0, "200GiB")
    with contextlib.ExitStack() as stack:
        be = stack.enter_context(Backend(work / "backend", [solo], env=env, **flags))
        be_n = stack.enter_context(Backend(work / "backend-neighbour", [solo, Group("idle", 0.5, 1.0, "1GiB")],
                                           env=env, **flags)) if idle_neighbour else None
        henv = dict(env, GEMINI_STATS_FILE=str(stats_file))
        nenv = dict(env, GEMINI_STATS_FILE=str(work / "stats-neighbour"))
        cases = ["native", "hooked"] + (["hooked_idle_neighbour"] if be_n is not None else [])
        for r in range(rounds):
            # each round starts with the next case, so that a drift over the run (clocks, heat) falls on each alike
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                if case == "native":
                    result = run_json(program, env, timeout)
                    native.append(result[key])
                    extra = {k: v for k, v in result.items() if k.startswith("clock") or k.startswith("coarse")}
                elif case == "hooked":
                    result = run_json(be.command("solo", program), henv, timeout)
                    hooked.append(result[key])
                else:
                    assert be_n is not None
                    result = run_json(be_n.command("solo", program), nenv, timeout)
                    beside.append(result[key])
                runs.setdefault(case, []).append(result)
    out = {"native": native, "hooked": hooked, "native_median": statistics.median(native),
           "hooked_median": statistics.median(hooked), "hook_stats": read_stats(stats_file), "runs": runs, **extra}
    if beside:
        out.update(hooked_idle_neighbour=beside, hooked_idle_neighbour_median=statistics.median(beside),
                   hook_stats_idle_neighbour=read_stats(work / "stats-neighbour"))
    shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["launch", "train", "alloc"])
    p.add_argument("--rounds", type=int, default=None, help="default: 11 for launch, 3 otherwise")
    p.add_argument("--seconds", type=float, default=10, help="training seconds per round")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--quota", type=float, help="gem-schd base quota, ms (train: without it, gem-schd's default flags; "
                                               "launch: 8000, alloc: 250)")
    p.add_argument("--idle-neighbour", action="store_true",
                   help="train: also run it hooked beside another group that is configured but idle")
    p.add_argument("--sync", choices=["ctx", "stream"], default="ctx",
                   help="launch: how launch_cost synchronises between its batches (cuCtxSynchronize, or "
                        "cuStreamSynchronize of the legacy stream)")
    args = p.parse_args(argv)
    rounds = args.rounds or (11 if args.what == "launch" else 3)
    if args.what == "launch":
        if not LAUNCH_COST.exists():
            subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "bench-native"], check=True)
        r = launch_rounds(rounds, args.quota or 8000, [LAUNCH_COST, 3000, 128, args.sync], "ns_per_launch_median", 120)
        r["sync"] = args.sync
    elif args.what == "alloc":
        if not ALLOC_COST.exists():
            subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "bench-native"], check=True)
        r = interleaved("alloc", rounds, args.quota or 250, [ALLOC_COST, 2000], "alloc_us_p50", 120)
        r.pop("hook_stats")
    else:
        # gem-schd's default flags unless --quota is given (until the twenty-seventh session this ran with
        # -q 250 -m 10 -w 10000, the previous scheduler's defaults)
        r = interleaved("train", rounds, args.quota, [sys.executable, RESNET, args.seconds, args.batch],
                        "steps_per_s", args.seconds + 300, idle_neighbour=args.idle_neighbour)
        r["schd_flags"] = "defaults" if args.quota is None else f"-q {args.quota} -m 10 -w {max(10000, args.quota * 2)}"
        r["overhead_pct"] = (1 - r["hooked_median"] / r["native_median"]) * 100
        r["hook_stats"] = {str(k): v for k, v in r["hook_stats"].items()}
        if args.idle_neighbour:
            r["overhead_idle_neighbour_pct"] = (1 - r["hooked_idle_neighbour_median"] / r["native_median"]) * 100
            r["hook_stats_idle_neighbour"] = {str(k): v for k, v in r["hook_stats_idle_neighbour"].items()}
    r["what"] = args.what
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
