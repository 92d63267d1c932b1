"""Floors and caps on real frameworks: busy PyTorch trainers in groups, their throughput against alone.

    python bench/bench_trainers.py --groups a:0.7:1,b:0:1 --seconds 30
    python bench/bench_trainers.py --groups a:0:0.3,b:0:0.6 --seconds 30

One trainer (tests/gpu/workloads/train_loop.py, eager ResNet-18 unless --trainer graph) runs alone, natively,
for its rate; then one per group NAME:MinUtil:MaxUtil runs hooked, all at once, under gem-schd's DEFAULT
flags. Each group's share is its rate over the common measured span divided by the rate alone (the trainers
are identical). Also reports the share of each over sliding 10 s windows (stepped by 1 s) from the trainers'
progress lines. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_inference import WORKLOADS, Trainer  # noqa: E402
from bench.harness import Backend, Group, ctl_status, read_stats  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="a:0.7:1,b:0:1")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--alone-seconds", type=float, default=10)
    p.add_argument("--trainer", default="eager", choices=["eager", "graph"])
    p.add_argument("--schd-args", default="", help="extra gem-schd flags (none: its defaults), e.g. '--bucket 25'")
    args = p.parse_args(argv)
    specs = []
    for item in args.groups.split(","):
        name, mn, mx = item.split(":")
        specs.append(Group(name, float(mn), float(mx), "30GiB"))
    env = dict(os.environ)
    argv_train = [sys.executable, str(WORKLOADS / "train_loop.py"), args.trainer, "100000"]
    out: dict = {"groups": args.groups, "seconds": args.seconds, "trainer": args.trainer,
                 "schd_args": args.schd_args}
    alone = Trainer(argv_train, env)
    try:
        alone.wait_ready()
        out["alone_steps_per_s"] = alone.measure_alone(args.alone_seconds)
    finally:
        alone.stop()
    work = Path(tempfile.mkdtemp(prefix="bench-trainers-"))
    with Backend(work / "backend", specs, env=env, quota_ms=None, min_quota_ms=None, window_ms=None,
                 extra_args=[f"--schd-arg={a}" for a in args.schd_args.split()]) as be:
        stats_file = work / "stats"
        henv = dict(env, GEMINI_STATS_FILE=str(stats_file))
        trainers = {g.name: Trainer(be.command(g.name, argv_train), henv) for g in specs}
        try:
            for t in trainers.values():
                t.wait_ready()
            t0 = time.monotonic()
            time.sleep(args.seconds)
            t1 = time.monotonic()
            try:    # what gem-schd charged them over its last window (its SHARE): the cap it held, in GPU time
                status = ctl_status(be)
                out["charged"] = {g["name"]: g["share"] for g in status.get("groups", [])}
            except Exception as exc:  # noqa: BLE001 -- the throughputs stand without it
                out["charged"] = {"error": str(exc)[-300:]}
        finally:
            for t in trainers.values():
                t.stop()
    base = out["alone_steps_per_s"]
    out["shares"] = {n: t.rate(t0, t1) / base for n, t in trainers.items()}
    windows: dict[str, list[float]] = {}
    for n, t in trainers.items():
        w, s = [], t0
        while s + 10.0 <= t1:
            w.append(t.rate(s, s + 10.0) / base)
            s += 1.0
        windows[n] = w
    out["window_10s"] = {n: {"min": min(w), "max": max(w)} for n, w in windows.items() if w}
    # the hooks' counters (slots, drains, marker waits: where a trainer's time went)
    out["hook_stats"] = {str(k): v for k, v in read_stats(stats_file).items()}
    out["configured"] = {g.name: {"min_util": g.min_util, "max_util": g.max_util} for g in specs}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
