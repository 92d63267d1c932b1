"""Config reaction time on the GPU: from saving resource-config.txt to the new shares on the GPU.

    python bench/bench_reaction.py --seconds 12 --repeats 3

Two always-busy spin tenants run with MaxUtil 0.3 (t0) and 0.6 (t1). Halfway through, the config is
saved (write to a temporary file, rename over) with the caps swapped. The tenant that was capped at 0.3
must take over: the reaction time is from the save to the earliest moment from which it holds at least
75% of the GPU over the next 20 ms, measured from its kernels' on-chip time. With several repeats the caps
are swapped back and forth.
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

from bench.harness import Backend, Group, Trace, last_json, write_config  # noqa: E402


def reaction_ms(trace: Trace, save_ns: int, window_ns: float = 20e6, threshold: float = 0.75) -> float | None:
    """The earliest time after the save from which the tenant holds >= threshold of the next window."""
    t = save_ns
    while t + window_ns <= trace.host_ns[-1]:
        if (trace.onchip_at(t + window_ns) - trace.onchip_at(t)) / window_ns >= threshold:
            return (t - save_ns) / 1e6
        t += 0.5e6
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="between saves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quota", type=float, default=20)
    p.add_argument("--window", type=float, default=2000)
    p.add_argument("--blocks", type=int, default=132)
    args = p.parse_args(argv)
    from tests.native import build_native, client_path
    build_native()
    work = Path(tempfile.mkdtemp(prefix="bench-reaction-"))
    caps = [("t0", 0.3), ("t1", 0.6)]
    total = args.seconds * (args.repeats + 1)
    with Backend(work / "backend", [Group(n, 0.0, c) for n, c in caps], quota_ms=args.quota, min_quota_ms=5,
                 window_ms=args.window) as be:
        procs = {n: be.spawn(n, [client_path("workload-procaddr"), "--seconds", total, "--kernel-us", 1000,
                                 "--sync-every", 1, "--blocks", args.blocks, "--trace", work / f"{n}.trace", "--json"])
                 for n, _ in caps}
        saves = []
        for _ in range(args.repeats):
            time.sleep(args.seconds)
            caps = [(n, c) for n, c in zip((n for n, _ in caps), reversed([c for _, c in caps]))]
            tmp = be.config_path.with_suffix(".tmp")
            write_config(tmp, [Group(n, 0.0, c) for n, c in caps])
            saves.append((time.monotonic_ns(), max(caps, key=lambda nc: nc[1])[0]))
            os.replace(tmp, be.config_path)
        outputs = {n: p.communicate(timeout=total + 120) for n, p in procs.items()}
    for n, (_out, err) in outputs.items():
        if procs[n].returncode != 0:
            raise RuntimeError(f"{n} failed: {err[-1500:]}")
    traces = {n: Trace.read(work / f"{n}.trace") for n in ("t0", "t1")}
    reactions = [reaction_ms(traces[winner], save_ns) for save_ns, winner in saves]
    ok = [r for r in reactions if r is not None]
    print(json.dumps({"reactions_ms": reactions, "max_ms": max(ok) if ok else None,
                      "median_ms": sorted(ok)[len(ok) // 2] if ok else None, "quota_ms": args.quota,
                      "window_ms": args.window, "results": {n: last_json(o) for n, (o, _) in outputs.items()}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
