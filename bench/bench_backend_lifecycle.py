#!/usr/bin/env python3
"""How long a backend (launch-backend, gem-schd and a pod manager per group) takes to start and to stop.

    python bench/bench_backend_lifecycle.py [--groups 2] [--rounds 5] [--transport ipc|tcp]

Every end-to-end test starts and stops one or more backends, so these are most of the fixed cost of CI's serial
phase. Start: from spawning launch-backend to its "ready" line (bench/harness.py, Backend.start). Stop: from its
SIGINT to its exit having been reaped (Backend.stop: launch-backend signals its daemons and waits for them).
docs/benchmarks.md ("Twenty-sixth session") has the numbers before and after the daemons ended without the
interpreter's teardown (gemini/shutdown.py). No GPU needed. Prints one JSON object (seconds: median, min, max).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import TRANSPORTS, Backend, Group  # noqa: E402


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transport", choices=TRANSPORTS, default="ipc")
    args = ap.parse_args(argv)
    if args.groups < 1 or args.rounds < 1:
        ap.error("--groups and --rounds must be at least 1")
    starts, stops = [], []
    with tempfile.TemporaryDirectory(prefix="gemini-lifecycle-") as tmp:
        for r in range(args.rounds):
            be = Backend(Path(tmp) / f"be{r}", groups=[Group(f"g{i}", 0.0, 1.0 / args.groups)
                                                       for i in range(args.groups)], transport=args.transport)
            t0 = time.monotonic()
            be.start()
            t1 = time.monotonic()
            be.stop()
            stops.append(time.monotonic() - t1)
            starts.append(t1 - t0)
    print(json.dumps({"groups": args.groups, "rounds": args.rounds, "transport": args.transport,
                      "start_s": _summary(starts), "stop_s": _summary(stops)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
