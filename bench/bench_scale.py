#!/usr/bin/env python3
"""Scale: grant latency and daemon CPU against the number of clients (8 to 256).

    python bench/bench_scale.py [--clients 8,16,32,64,128,256] [--seconds 20] [--quick] [--out DIR]

For each client count N, a fresh backend (launch-backend: gem-schd and one gem-pmgr per group) serves
min(N, --max-groups) groups with N / groups protocol-speaking clients each, under the soak's load model
(bench/bench_soak.py: think, ask for the token, hold it for a 1-8 ms burst, give it back). Per point: grant
latency p50/p99 (TOKEN_REQUEST -> TOKEN_GRANT at the client, queueing behind other groups included), grants/s,
lost grants, and the CPU of gem-schd, of all pod managers and of the load generator as a share of one core
(utime + stime over the run), and slots/s (distinct tokens gem-schd granted) with gem-schd's CPU per slot.
Written to DIR/scale.json and DIR/scale.md (a Markdown table for
docs/benchmarks.md), and the table is printed. --quick: 5 s per point.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_soak import LoadModel, run_backend, summarize  # noqa: E402
from gemini.logs import setup_logging  # noqa: E402

log = logging.getLogger("bench.scale")


def point(clients: int, max_groups: int, seconds: float, model: LoadModel, quota_ms: float, min_quota_ms: float,
          window_ms: float, seed: int) -> dict:
    groups = min(clients, max_groups)
    per_group = clients // groups
    with tempfile.TemporaryDirectory(prefix="gemini-scale-") as tmp:
        run = run_backend(groups, per_group, seconds, max(1.0, seconds / 4), model, quota_ms, min_quota_ms,
                          window_ms, seed, Path(tmp) / "backend")
    result = summarize(run, {"groups": groups, "clients_per_group": per_group, "seconds": seconds})
    return {
        "clients": run["clients"], "groups": groups, "clients_per_group": per_group,
        "duration_s": result["duration_s"], "grants": result["grants"], "lost_grants": result["lost_grants"],
        "grants_per_s": result["grants_per_s"], "slots_per_s": result["slots_per_s"],
        "gem_schd_cpu_ms_per_slot": result["gem_schd_cpu_ms_per_slot"], "latency": result["latency"],
        "cpu_share": result["cpu_share"],
        "gem_schd_rss_mib": result["rss"]["gem-schd"]["end_mib"],
        "accounting_back_to_zero": result["accounting_back_to_zero"], "problems": result["problems"],
    }


def markdown(points: list[dict], meta: dict) -> str:
    lines = [
        f"Scale: {meta['seconds']} s per point, {meta['cpus']} CPUs, quota {meta['quota_ms']} ms (min "
        f"{meta['min_quota_ms']} ms), think {meta['think_ms']} ms, bursts {meta['burst_ms'][0]}-"
        f"{meta['burst_ms'][1]} ms. CPU is a share of one core.",
        "",
        "| clients | groups | grants/s | slots/s | latency p50 (ms) | p99 (ms) | lost | gem-schd CPU "
        "| gem-schd ms/slot | gem-pmgr CPU (all) | load generator CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        cpu = p["cpu_share"]
        lines.append(f"| {p['clients']} | {p['groups']} | {p['grants_per_s']} | {p['slots_per_s']} | "
                     f"{p['latency']['p50_ms']} | {p['latency']['p99_ms']} | {p['lost_grants']} | "
                     f"{cpu['gem-schd']:.3f} | {p['gem_schd_cpu_ms_per_slot']} | {cpu['gem-pmgr_total']:.3f} | "
                     f"{cpu['load_generator']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="8,16,32,64,128,256", help="comma-separated client counts")
    ap.add_argument("--seconds", type=float, default=20.0, help="per point (default 20)")
    ap.add_argument("--quick", action="store_true", help="5 s per point")
    ap.add_argument("--max-groups", type=int, default=16, help="groups = min(clients, this)")
    ap.add_argument("--quota-ms", type=float, default=20.0)
    ap.add_argument("--min-quota-ms", type=float, default=5.0)
    ap.add_argument("--window-ms", type=float, default=10000.0)
    ap.add_argument("--think-ms", type=float, default=LoadModel.think_ms)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench-out", help="directory for scale.json and scale.md")
    args = ap.parse_args(argv)
    setup_logging("bench-scale", logging.INFO)
    seconds = 5.0 if args.quick else args.seconds
    model = LoadModel(think_ms=args.think_ms)
    points = []
    for n in (int(x) for x in args.clients.split(",")):
        log.info("%d clients ...", n)
        points.append(point(n, args.max_groups, seconds, model, args.quota_ms, args.min_quota_ms, args.window_ms,
                            args.seed))
    meta = {"seconds": seconds, "cpus": os.cpu_count(), "quota_ms": args.quota_ms, "min_quota_ms": args.min_quota_ms,
            "window_ms": args.window_ms, "think_ms": args.think_ms, "burst_ms": list(model.burst_ms),
            "max_groups": args.max_groups, "python": sys.version.split()[0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1) + "\n")
    table = markdown(points, meta)
    (out / "scale.md").write_text(table)
    print(table)
    lost = sum(p["lost_grants"] for p in points)
    if lost:
        log.error("%d lost grants: %s", lost, [p["problems"] for p in points if p["problems"]])
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
