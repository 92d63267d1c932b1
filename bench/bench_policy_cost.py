#!/usr/bin/env python3
"""CPU cost of one scheduling decision in gem-schd's policy, against the number of groups.

    python bench/bench_policy_cost.py [--groups 2,16,64,256] [--slots 4000] [--cpu 0] [--mix capped]

Issue 14 asks for the CPU time from a slot's deadline to the next grant at 64 groups (goal: <= 100 us at p50)
and the ceiling in slots/s at 2, 16, 64 and 256 groups on one core. This drives the pure policy
(gemini/scheduler/policy.py) on simulated time with every group always busy: a quarter of the groups capped
(MaxUtil 0.05), a quarter with a floor, the rest plain; with `--mix capped`, every group capped at 0.9 / n, so that
most of them wait for their buckets at any moment. At each deadline the daemon calls `tick`; the holder's
pod manager then asks again (its clients still have work) -- both are timed together as one decision, as gem-schd
makes them on one event-loop turn, each followed by `others_grantable` (what gem-schd then writes on the board).
The process is pinned to one CPU (`--cpu`) when the OS allows it. The policy's work per decision should not
grow with the number of groups here (docs/architecture.md, "A decision's cost"; tests/test_policy_scale.py
counts it): what does is the interpreter's, not the policy's.

The ceiling (slots/s) is 1 / mean decision time: what one core could sustain with nothing else to do, so it
leaves out the messaging (pyzmq, JSON) that the scale benchmark (bench/bench_scale.py) includes.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemini.config import Config, GroupConfig  # noqa: E402
from gemini.scheduler.policy import GrantDecision, Policy, SlotEndDecision  # noqa: E402


def config(n: int) -> Config:
    groups = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            groups.append(GroupConfig(f"g{i}", 0.0, 0.05))
        elif kind == 1:
            groups.append(GroupConfig(f"g{i}", min(0.5, 0.5 / max(1, n // 4)), 1.0))
        else:
            groups.append(GroupConfig(f"g{i}"))
    return Config(tuple(groups))


def all_capped(n: int) -> Config:
    return Config(tuple(GroupConfig(f"g{i}", 0.0, round(0.9 / n, 9)) for i in range(n)))


def measure(n: int, slots: int, mix: str = "mixed") -> dict:
    pol = Policy(all_capped(n) if mix == "capped" else config(n))
    now = 0.0
    for g in pol.groups:                      # everyone asks at t=0
        pol.request(g, now=now)
    samples: list[int] = []
    while len(samples) < slots:
        wake = pol.next_wakeup(now)
        if wake is None:
            raise RuntimeError("nothing is due: the policy stalled")
        now = max(now, wake)
        t0 = time.perf_counter_ns()
        decisions = pol.tick(now)
        pol.others_grantable(now)                  # gem-schd publishes groups_waiting after each dispatch
        for d in list(decisions):
            if isinstance(d, SlotEndDecision) and d.reason != "continued":  # busy: it asks again at once
                decisions += pol.request(d.group, now=now)
                pol.others_grantable(now)
        t1 = time.perf_counter_ns()
        if any(isinstance(d, GrantDecision) for d in decisions):
            samples.append(t1 - t0)
    samples.sort()
    mean = statistics.fmean(samples)
    return {"groups": n, "mix": mix, "decisions": len(samples), "p50_us": samples[len(samples) // 2] / 1000,
            "p99_us": samples[int(len(samples) * 0.99)] / 1000, "mean_us": mean / 1000,
            "ceiling_slots_per_s": round(1e9 / mean)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", default="2,16,64,256")
    ap.add_argument("--slots", type=int, default=4000)
    ap.add_argument("--cpu", type=int, default=0, help="pin to this CPU (-1: do not pin)")
    ap.add_argument("--mix", choices=["mixed", "capped"], default="mixed")
    args = ap.parse_args(argv)
    pinned = None
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {args.cpu})
            pinned = args.cpu
        except OSError:
            pass
    points = [measure(int(n), args.slots, args.mix) for n in args.groups.split(",")]
    print(json.dumps({"pinned_cpu": pinned, "python": sys.version.split()[0], "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
