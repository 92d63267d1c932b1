"""Floors and caps on real frameworks: busy PyTorch trainers in groups, their throughput against alone.

    python bench/bench_trainers.py --groups a:0.7:1,b:0:1 --seconds 30
    python bench/bench_trainers.py --groups a:0:0.3,b:0:0.6 --seconds 30

One trainer (tests/gpu/workloads/train_loop.py, eager ResNet-18 unless --trainer graph) runs alone, natively,
for its rate; then one per group NAME:MinUtil:MaxUtil runs hooked, all at once, under gem-schd's DEFAULT
flags. Each group's share is its rate over the common measured span divided by the rate alone (the trainers
are identical). Also reports the share of each over sliding 1 s and 10 s windows (stepped by 100 ms) from the
trainers' progress lines (one at each synchronisation, every 10 steps; each window's rate over exactly the window,
interpolated between them: bench_inference.rate_between): the least and largest, the 5th and 95th percentiles, and
how far the worst and the 95th percentile lie from the group's mean share, in points (`sliding_1s`, `sliding_10s`;
`window_10s` keeps the least and largest 10 s windows). A point every 10 steps is 0.14 s of the GPU alone, 0.45 s
at a share of 0.3, so a 1 s window is good to a few points; spin tenants (bench_share.py) count on-chip time.
Prints one JSON object.
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
from bench.harness import Backend, Group, ctl_status, percentile, read_stats  # noqa: E402


def sliding_shares(rate, base: float, t0: float, t1: float, window_s: float, step_s: float = 0.1) -> list[float]:
    """A trainer's share (its rate over `base`) over every window of `window_s` in [t0, t1], stepped by `step_s`;
    `rate(a, b)` is its steps per second between two times (nan where it made no progress to measure)."""
    out, k = [], 0
    while t0 + k * step_s + window_s <= t1 + 1e-9:
        a = t0 + k * step_s
        v = rate(a, a + window_s) / base
        if v == v:      # not nan
            out.append(v)
        k += 1
    return out


def window_stats(shares: list[float], mean: float) -> dict[str, float]:
    """The least and largest window, the 5th and 95th percentiles, and the worst and the 95th percentile of how far
    a window lies from the mean share (points)."""
    if not shares:
        return {}
    dev = [abs(x - mean) * 100 for x in shares]
    return {"min": min(shares), "max": max(shares), "p5": percentile(shares, 0.05), "p95": percentile(shares, 0.95),
            "windows": len(shares), "worst_from_mean_pp": max(dev), "p95_from_mean_pp": percentile(dev, 0.95)}


def unmeasured(out: dict) -> str | None:
    """What a run could not measure, said as an error (gpu_check then marks the step FAILED): a rate alone or a
    share that is nan (the progress points did not cover the span) must not pass for a result."""
    bad = [n for n, v in out.get("shares", {}).items() if v != v]
    base = out.get("alone_steps_per_s")
    if base is None or base != base:
        return "no rate alone: the trainer's progress points did not cover its span"
    if bad:
        return f"no share for {', '.join(bad)}: their progress points did not cover the common span"
    return None


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
            for t in trainers.values():     # each one's span must reach t1 before it is stopped
                t.wait_past(t1)
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
    for key, length in (("sliding_1s", 1.0), ("sliding_10s", 10.0)):
        out[key] = {n: window_stats(sliding_shares(t.rate, base, t0, t1, length), out["shares"][n])
                    for n, t in trainers.items()}
    out["window_10s"] = {n: {"min": w["min"], "max": w["max"]} for n, w in out["sliding_10s"].items() if w}
    # the hooks' counters (slots, drains, marker waits: where a trainer's time went)
    out["hook_stats"] = {str(k): v for k, v in read_stats(stats_file).items()}
    out["configured"] = {g.name: {"min_util": g.min_util, "max_util": g.max_util} for g in specs}
    error = unmeasured(out)
    if error:
        out["error"] = error
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
