"""Always-busy spin tenants sharing one GPU: native time-slicing against gemini's configured shares.

Each tenant runs tests/clients/workload.c (full-width `gem_spin` kernels that count on-chip time with
%globaltimer, skipping jumps that mean the context was switched out) and writes a trace; shares come
from on-chip time, never from nvidia-smi.

    python bench/bench_share.py --mode gemini --caps 0.3,0.6 --seconds 12 --out out/share
    python bench/bench_share.py --mode native --tenants 2 --seconds 12

Prints one JSON object: per-tenant shares over the common span, the worst share error over 1 s and
10 s windows (gemini), total useful GPU time, and handoff gaps between tenants on the GPU clock.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Backend, Group, Trace, common_span, last_json, read_stats, shares_over, window_errors  # noqa: E402

log = logging.getLogger("bench.share")


def workload_argv(client: Path, args, name: str, out: Path) -> list:
    return [str(client), "--seconds", args.seconds, "--kernel-us", args.kernel_us, "--sync-every", args.sync_every,
            "--blocks", args.blocks, "--trace", out / f"{name}.trace", "--kernel-log", out / f"{name}.kernels",
            "--json"]


def handoff_gaps_us(out: Path, names: list[str], start_ns: float | None = None) -> list[float]:
    """GPU idle time between one tenant's last kernel and the next tenant's first (negative: overlap)."""
    kernels = []
    for name in names:
        path = out / f"{name}.kernels"
        if path.exists():
            for line in path.read_text().splitlines():
                s, e, _ = (int(x) for x in line.split())
                kernels.append((s, e, name))
    kernels.sort()
    gaps = []
    for (s0, e0, n0), (s1, e1, n1) in zip(kernels, kernels[1:]):
        if n0 != n1:
            gaps.append((s1 - e0) / 1e3)
    return gaps


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(args) -> dict:
    from tests.native import build_native, client_path
    build_native()
    client = client_path("workload-procaddr")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-share-"))
    out.mkdir(parents=True, exist_ok=True)
    caps = [float(c) for c in args.caps.split(",")] if args.caps else []
    mins = [float(m) for m in args.mins.split(",")] if args.mins else [0.0] * len(caps)
    names = [f"t{i}" for i in range(len(caps) if args.mode == "gemini" else args.tenants)]
    env = dict(os.environ)
    stats_file = out / "stats"
    stats_file.unlink(missing_ok=True)
    env["GEMINI_STATS_FILE"] = str(stats_file)
    started = time.time()
    if args.mode == "gemini":
        groups = [Group(n, mn, cap) for n, mn, cap in zip(names, mins, caps)]
        backend = Backend(out / "backend", groups, quota_ms=args.quota, min_quota_ms=args.min_quota,
                          window_ms=args.window, env=env)
        backend.start()
        try:
            procs = {n: backend.spawn(n, workload_argv(client, args, n, out), env=env) for n in names}
            results = {n: p.communicate(timeout=args.seconds + 120) for n, p in procs.items()}
        finally:
            backend.stop()
    else:
        import subprocess
        procs = {n: subprocess.Popen([str(a) for a in workload_argv(client, args, n, out)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in names}
        results = {n: p.communicate(timeout=args.seconds + 120) for n, p in procs.items()}
    failures = {n: err[-2000:] for n, (o, err) in results.items() if procs[n].returncode != 0}
    if failures:
        raise RuntimeError(f"tenants failed: {failures}")
    traces = {n: Trace.read(out / f"{n}.trace") for n in names}
    start, end = common_span(traces, trim_s=args.trim)
    shares = shares_over(traces, start, end)
    gaps = handoff_gaps_us(out, names)
    report = {
        "mode": args.mode, "tenants": len(names), "seconds": args.seconds, "kernel_us": args.kernel_us,
        "blocks": args.blocks, "span_s": (end - start) / 1e9, "shares": shares, "useful": sum(shares.values()),
        "handoffs": len(gaps), "handoff_gap_us_p50": pct(gaps, 0.5), "handoff_gap_us_p99": pct(gaps, 0.99),
        "wall_s": time.time() - started,
        "results": {n: last_json(o) for n, (o, _) in results.items()},
    }
    if args.mode == "gemini":
        targets = dict(zip(names, caps))
        report.update({
            "caps": targets, "quota_ms": args.quota, "window_ms": args.window,
            "share_error_pp": {n: abs(shares[n] - targets[n]) * 100 for n in names},
            "useful_of_configured": sum(shares.values()) / min(1.0, sum(caps)),
            "window_error_1s_pp": window_errors(traces, targets, 1.0, start, end),
        })
        if end - start >= 10e9:
            report["window_error_10s_pp"] = window_errors(traces, targets, 10.0, start, end)
        report["hook_stats"] = {str(pid): s for pid, s in read_stats(stats_file).items()}
    (out / "share.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["native", "gemini"], default="gemini")
    p.add_argument("--caps", default="0.3,0.6", help="MaxUtil per tenant (gemini mode)")
    p.add_argument("--mins", default="", help="MinUtil per tenant (gemini mode; default 0)")
    p.add_argument("--tenants", type=int, default=2, help="number of tenants (native mode)")
    p.add_argument("--seconds", type=float, default=12)
    p.add_argument("--trim", type=float, default=1.0, help="seconds dropped at both ends of the common span")
    p.add_argument("--kernel-us", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--blocks", type=int, default=132)
    p.add_argument("--quota", type=float, default=20, help="gem-schd base quota, ms")
    p.add_argument("--min-quota", type=float, default=5)
    p.add_argument("--window", type=float, default=10000)
    p.add_argument("--out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
