"""Always-busy spin tenants sharing one GPU: native time-slicing against gemini's configured shares.

Each tenant runs tests/clients/workload.c (full-width `gem_spin` kernels that count on-chip time with
%globaltimer, skipping jumps that mean the context was switched out) and writes a trace; shares come
from on-chip time, never from nvidia-smi.

    python bench/bench_share.py --mode gemini --caps 0.3,0.6 --seconds 12 --out out/share
    python bench/bench_share.py --mode native --tenants 2 --seconds 12
    python bench/bench_share.py --mode mps --caps 0.3,0.6 --seconds 12   # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    python bench/bench_share.py --mode native --tenants 1                 # the reference for useful time
    python bench/bench_share.py --mode gemini --caps 0.1,0.2,0.3,0.4 --per-group 2 --turns --seconds 120
    python bench/bench_share.py --mode gemini --caps 0.3,0.6 --transport ipc   # hooks on Unix sockets

Prints one JSON object: per-tenant shares over the common span, the worst share error over 1 s and
10 s windows (gemini), total useful GPU time, and handoff gaps between tenants on the GPU clock.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (Backend, Group, GroupTrace, Trace, common_span, last_json, read_stats,  # noqa: E402
                           shares_over, window_errors)

log = logging.getLogger("bench.share")


def workload_argv(client: Path, args, name: str, out: Path, seconds: float | None = None) -> list:
    argv = [str(client), "--seconds", seconds or args.seconds, "--sync-every", args.sync_every,
            "--blocks", args.blocks, "--trace", out / f"{name}.trace", "--kernel-log", out / f"{name}.kernels",
            "--json"]
    if args.work_iters:
        return argv + ["--work-iters", args.work_iters, "--threads", args.threads]
    return argv + ["--kernel-us", args.kernel_us]


def calibrate_alone(client: Path, args, out: Path, env: dict) -> float:
    """ns per gem_work kernel with the GPU to itself (the yardstick of throughput shares)."""
    proc = subprocess.run([str(a) for a in workload_argv(client, args, "calibrate", out, seconds=3)], env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"calibration failed: {proc.stderr[-1500:]}")
    tr = Trace.read(out / "calibrate.trace")
    i0 = next(i for i, k in enumerate(tr.kernels) if k >= 5)  # past JIT and the first kernels
    return (tr.host_ns[-1] - tr.host_ns[i0]) / max(1, tr.kernels[-1] - tr.kernels[i0])


def kernels_in_order(out: Path, group_of: dict[str, str]) -> list[tuple[int, int, str]]:
    """Every process's kernels from its kernel log, as (start, end, group), in the order they started."""
    kernels = []
    for name, group in group_of.items():
        path = out / f"{name}.kernels"
        if path.exists():
            for line in path.read_text().splitlines():
                s, e, _ = (int(x) for x in line.split())
                kernels.append((s, e, group))
    kernels.sort()
    return kernels


def handoff_gaps_us(out: Path, group_of: dict[str, str]) -> list[float]:
    """GPU idle time between one group's last kernel and the next group's first (negative: overlap)."""
    kernels = kernels_in_order(out, group_of)
    gaps = []
    for (_s0, e0, n0), (s1, _e1, n1) in zip(kernels, kernels[1:]):
        if n0 != n1:
            gaps.append((s1 - e0) / 1e3)
    return gaps


def own_gaps_us(out: Path, group_of: dict[str, str]) -> dict[str, float | None]:
    """Each group's median GPU idle time between two consecutive kernels of its own (no other group's kernel
    between them): the tenant's host work between kernels, hook included. With caps adding up to 1 nobody can
    fill these gaps, so they bound the useful time (a 1 ms kernel with a 30 us gap: 0.97)."""
    kernels = kernels_in_order(out, group_of)
    gaps: dict[str, list[float]] = {g: [] for g in set(group_of.values())}
    for (_s0, e0, n0), (s1, _e1, n1) in zip(kernels, kernels[1:]):
        if n0 == n1 and s1 >= e0:
            gaps[n0].append((s1 - e0) / 1e3)
    return {g: pct(v, 0.5) for g, v in gaps.items()}


def own_gaps_mean_us(out: Path, group_of: dict[str, str]) -> dict[str, float | None]:
    """The same gaps' mean, below a millisecond (longer ones are the group's waits for its token): what they cost
    the GPU per kernel, tails included, which a median hides."""
    kernels = kernels_in_order(out, group_of)
    gaps: dict[str, list[float]] = {g: [] for g in set(group_of.values())}
    for (_s0, e0, n0), (s1, _e1, n1) in zip(kernels, kernels[1:]):
        if n0 == n1 and 0 <= s1 - e0 < 1_000_000:
            gaps[n0].append((s1 - e0) / 1e3)
    return {g: (sum(v) / len(v) if v else None) for g, v in gaps.items()}


def time_shares(out: Path, group_of: dict[str, str], start_ns: float, end_ns: float) -> dict[str, float]:
    """Each group's share of GPU *time*: the union of its processes' kernel spans (device clock) in
    [start, end] (host clock), over the span. With several processes in a group this counts the time
    they spend switching between each other, which on-chip time does not; it is what the token gives."""
    spans: dict[str, list[tuple[float, float]]] = {g: [] for g in set(group_of.values())}
    for name, group in group_of.items():
        kpath, tpath = out / f"{name}.kernels", out / f"{name}.trace"
        if not kpath.exists() or not tpath.exists():
            continue
        rows = [tuple(int(x) for x in line.split()) for line in kpath.read_text().splitlines() if line.strip()]
        if not rows:
            continue
        # device clock -> host clock: each kernel ended just before its sync returned (one sync per kernel);
        # the closest such pair bounds the offset best (the first sync alone is late by start-up work)
        host = Trace.read(tpath).host_ns
        shift = min(h - r[1] for h, r in zip(host, rows))
        spans[group] += [(s + shift, e + shift) for s, e, _ in rows]
    return {group: covered_time(iv, start_ns, end_ns) / (end_ns - start_ns) for group, iv in spans.items()}


def covered_time(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of [lo, hi] the union of `spans` covers (overlapping spans count once)."""
    total, cur_s, cur_e = 0.0, 0.0, None
    for s, e in sorted(spans):
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def device_clock_shares(kernels: dict[str, list[tuple[int, int, int]]], trim_s: float
                        ) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """The span every group ran by the kernel logs alone (device clock, `trim_s` dropped at both ends), and each
    group's on-chip share and time share (the union of its kernels' spans) over it."""
    lo = max(k[0][0] for k in kernels.values() if k) + trim_s * 1e9
    hi = min(k[-1][1] for k in kernels.values() if k) - trim_s * 1e9
    if hi <= lo or any(not k for k in kernels.values()):
        raise ValueError("the tenants did not run at the same time (kernel logs)")
    onchip, timeshare = {}, {}
    for group, ks in kernels.items():
        # a kernel cut by the span counts the part of its on-chip time that falls inside it
        total = sum(oc * (min(e, hi) - max(s, lo)) / max(1, e - s) for s, e, oc in ks if min(e, hi) > max(s, lo))
        onchip[group] = total / (hi - lo)
        timeshare[group] = covered_time([(s, e) for s, e, _ in ks], lo, hi) / (hi - lo)
    return lo, hi, onchip, timeshare


def load_kernels(out: Path, group_of: dict[str, str]) -> dict[str, list[tuple[int, int, int]]]:
    """Each group's kernels from its processes' kernel logs: (start, end, on-chip ns), device clock, sorted."""
    kernels: dict[str, list[tuple[int, int, int]]] = {g: [] for g in set(group_of.values())}
    for name, group in group_of.items():
        path = out / f"{name}.kernels"
        if path.exists():
            for line in path.read_text().splitlines():
                s, e, onchip = (int(x) for x in line.split())
                kernels[group].append((s, e, onchip))
    for k in kernels.values():
        k.sort()
    return kernels


def charged_against_kernels(trace_path: Path, kernels: dict[str, list[tuple[int, int, int]]]) -> dict:
    """gem-schd's own account beside the kernels': each group's charged share over the last whole reporting window
    inside the run (its trace's `share` samples), the on-chip share of its kernels over the same window, and how
    much the charge exceeds those kernels per kernel (what a slot's events count that an in-kernel clock does not:
    launch and teardown, handoff overlaps). Kernel logs are on the device clock, which reads wall time."""
    from gemini.scheduler.trace import SchedulerTrace
    trace = SchedulerTrace.load(trace_path)
    firsts = [k[0][0] for k in kernels.values() if k]
    lasts = [k[-1][1] for k in kernels.values() if k]
    if trace.unix_t0 is None or not firsts:
        return {}
    lo, hi = max(firsts) / 1e9 - trace.unix_t0, min(lasts) / 1e9 - trace.unix_t0     # on the trace's clock
    inside = [s for s in trace.samples if s.t_s - trace.window_s >= lo and s.t_s <= hi]
    if not inside:
        return {}
    sample = inside[-1]
    w_end = (trace.unix_t0 + sample.t_s) * 1e9
    w_start = w_end - trace.window_s * 1e9
    out = {"window_end_s": sample.t_s, "charged": {}, "onchip": {}, "excess_us_per_kernel": {}}
    for g, ks in kernels.items():
        if g not in sample.shares:
            continue
        within = [(s, e, c) for s, e, c in ks if w_start <= s and e <= w_end]
        onchip_ms = sum(c for _s, _e, c in within) / 1e6
        charged_ms = sample.shares[g] * trace.window_s * 1000
        out["charged"][g] = sample.shares[g]
        out["onchip"][g] = onchip_ms / (trace.window_s * 1000)
        out["excess_us_per_kernel"][g] = (charged_ms - onchip_ms) * 1000 / len(within) if within else None
    return out


def sliding_windows(kernels: dict[str, list[tuple[int, int, int]]], targets: dict[str, float], window_s: float,
                    step_s: float = 0.1, trim_s: float = 1.0) -> dict[str, dict[str, float]]:
    """Each group's on-chip share over every window of `window_s`, stepped by `step_s`, in the span where every
    group ran (device clock; `trim_s` dropped at both ends): the worst and the 95th percentile of
    |share - target| in percentage points, and the largest share seen."""
    import bisect
    lo = max(k[0][0] for k in kernels.values() if k) + trim_s * 1e9
    hi = min(k[-1][1] for k in kernels.values() if k) - trim_s * 1e9
    w = window_s * 1e9
    out: dict[str, dict[str, float]] = {}
    for group, target in targets.items():
        ks = kernels.get(group) or []
        starts = [k[0] for k in ks]
        cum = [0]
        for _s, _e, onchip in ks:
            cum.append(cum[-1] + onchip)

        def onchip_in(a: float, b: float, ks=ks, starts=starts, cum=cum) -> float:
            i = bisect.bisect_left(starts, a)
            j = bisect.bisect_left(starts, b)
            total = float(cum[j] - cum[i])
            if i > 0:   # a kernel that started before a and ran into the window
                s, e, oc = ks[i - 1]
                if e > a:
                    total += oc * (min(e, b) - a) / max(1, e - s)
            if j > i:   # the last kernel may run past b
                s, e, oc = ks[j - 1]
                if e > b:
                    total -= oc * (e - b) / max(1, e - s)
            return total

        errors, shares = [], []
        t = lo
        while t + w <= hi:
            share = onchip_in(t, t + w) / w
            shares.append(share)
            errors.append(abs(share - target) * 100)
            t += step_s * 1e9
        if errors:
            out[group] = {"worst_pp": max(errors), "p95_pp": pct(errors, 0.95) or 0.0, "max_share": max(shares),
                          "windows": len(errors)}
    return out


def entitled_shares(mins: list[float], caps: list[float]) -> list[float]:
    """What each always-busy group is owed: gem-schd's own fair targets (policy.fair_targets: the caps when they
    add up to 1 or less, otherwise each group between its MinUtil and its MaxUtil at the level where they add up
    to 1, floors that add up to more scaled down). A group capped at 1.0 beside one at 0.1 is owed 0.9, not 1.0:
    scored against its cap it read 11 points off while it got 0.887."""
    from gemini.scheduler.policy import fair_targets
    names = [str(i) for i in range(len(caps))]
    owed = fair_targets(dict(zip(names, caps)), dict(zip(names, mins)))
    return [owed[n] for n in names]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@contextmanager
def mps_daemon(workdir: Path):
    """An MPS control daemon of our own (private pipe and log directories), stopped afterwards.
    It changes no setting of the GPU; clients reach it through CUDA_MPS_PIPE_DIRECTORY."""
    control = shutil.which("nvidia-cuda-mps-control")
    if not control:
        raise RuntimeError("nvidia-cuda-mps-control not found")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(workdir / "mps-pipe"),
               CUDA_MPS_LOG_DIRECTORY=str(workdir / "mps-log"))
    for d in ("mps-pipe", "mps-log"):
        (workdir / d).mkdir(parents=True, exist_ok=True)
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        yield env
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
        time.sleep(1.0)


def run(args) -> dict:
    from tests.native import build_native, client_path
    build_native()
    client = client_path("workload-procaddr")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-share-"))
    out.mkdir(parents=True, exist_ok=True)
    caps = [float(c) for c in args.caps.split(",")] if args.caps else []
    mins = [float(m) for m in args.mins.split(",")] if args.mins else [0.0] * len(caps)
    groups_n = args.tenants if args.mode == "native" else len(caps)
    group_names = [f"t{i}" for i in range(groups_n)]
    # one tenant per group is named like its group; several are t<i>-<j>
    names = [g if args.per_group == 1 else f"{g}-{j}" for g in group_names for j in range(args.per_group)]
    group_of = {n: n.split("-")[0] for n in names}
    env = dict(os.environ)
    stats_file = out / "stats"
    stats_file.unlink(missing_ok=True)
    env["GEMINI_STATS_FILE"] = str(stats_file)
    started = time.time()
    if args.mode == "gemini":
        groups = [Group(n, mn, cap, turns=args.turns) for n, mn, cap in zip(group_names, mins, caps)]
        extra = [f"--schd-arg=--trace={out / 'grants.json'}"] + (["-vv"] if args.debug_logs else [])
        extra += [f"--schd-arg={a}" for a in args.schd_arg]
        if args.debug_logs:
            env["GEMINI_LOG_LEVEL"] = "debug"     # each grant and continuation, timed to the ms, in <tenant>.stderr
        backend = Backend(out / "backend", groups, quota_ms=args.quota, min_quota_ms=args.min_quota,
                          window_ms=args.window, env=env, extra_args=extra, transport=args.transport)
        backend.start()
        try:
            procs = {n: backend.spawn(group_of[n], workload_argv(client, args, n, out), env=env) for n in names}
            results = {n: p.communicate(timeout=args.seconds + 120) for n, p in procs.items()}
        finally:
            backend.stop()
    elif args.mode == "mps":
        with mps_daemon(out) as mps_env:
            procs = {n: subprocess.Popen([str(a) for a in workload_argv(client, args, n, out)],
                                         env=dict(env, **mps_env,
                                                  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(round(cap * 100))),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for n, cap in zip(names, caps)}
            results = {n: p.communicate(timeout=args.seconds + 120) for n, p in procs.items()}
    else:
        procs = {n: subprocess.Popen([str(a) for a in workload_argv(client, args, n, out)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in names}
        results = {n: p.communicate(timeout=args.seconds + 120) for n, p in procs.items()}
    if args.debug_logs:
        for n, (_o, err) in results.items():
            (out / f"{n}.stderr").write_text(err)
    failures = {n: err[-2000:] for n, (o, err) in results.items() if procs[n].returncode != 0}
    if failures:
        raise RuntimeError(f"tenants failed: {failures}")
    tenant_traces = {n: Trace.read(out / f"{n}.trace") for n in names}
    ns_per_kernel = None
    if args.work_iters:
        ns_per_kernel = calibrate_alone(client, args, out, {k: v for k, v in env.items() if k != "GEMINI_STATS_FILE"})
        tenant_traces = {n: t.as_throughput(ns_per_kernel) for n, t in tenant_traces.items()}
    traces = {g: GroupTrace([tenant_traces[n] for n in names if group_of[n] == g]) for g in group_names}
    try:
        start, end = common_span(tenant_traces, trim_s=args.trim)
        shares = shares_over(traces, start, end)
        span_clock = "host"
    except ValueError:
        # A tenant that synchronises rarely (--sync-every 800 at a small cap) leaves one or two trace lines:
        # its host trace has no span in common with the others, but every kernel it ran is in its kernel log.
        if args.work_iters:
            raise
        start, end, shares, dev_time_shares = device_clock_shares(load_kernels(out, group_of), args.trim)
        span_clock = "device"
    gaps = handoff_gaps_us(out, group_of)
    report = {
        "mode": args.mode, "turns": args.turns, "tenants": len(names), "seconds": args.seconds,
        "transport": args.transport if args.mode == "gemini" else None,
        "kernel_us": args.kernel_us,
        "blocks": args.blocks, "per_group": args.per_group, "work_iters": args.work_iters,
        "ns_per_kernel_alone": ns_per_kernel, "span_s": (end - start) / 1e9, "span_clock": span_clock,
        "shares": shares,
        "useful": sum(shares.values()),
        "handoffs": len(gaps), "handoff_gap_us_p50": pct(gaps, 0.5), "handoff_gap_us_p99": pct(gaps, 0.99),
        "own_gap_us_p50": own_gaps_us(out, group_of),
        "own_gap_us_mean": own_gaps_mean_us(out, group_of),
        "wall_s": time.time() - started,
        "results": {n: last_json(o) for n, (o, _) in results.items()},
        "errors": sum(last_json(o).get("errors", 0) for o, _ in results.values()),
    }
    # Every run: each group's share of GPU time as the union of its kernels' spans (device clock), beside the
    # on-chip shares; they differ by the time a group's processes spend switching between each other.
    report["time_shares"] = (time_shares(out, group_of, start, end) if span_clock == "host" else dev_time_shares)
    if args.mode in ("gemini", "mps"):
        targets = dict(zip(group_names, entitled_shares(mins, caps)))
        report.update({
            "caps": dict(zip(group_names, caps)), "entitled": targets,
            "quota_ms": args.quota, "window_ms": args.window,
            "share_error_pp": {n: abs(shares[n] - targets[n]) * 100 for n in group_names},
            "useful_of_configured": sum(shares.values()) / min(1.0, sum(caps)),
        })
        if not args.work_iters:
            # sliding windows stepped by 100 ms, from every kernel's on-chip time (device clock)
            kernels = load_kernels(out, group_of)
            if args.mode == "gemini" and (out / "grants.json").exists():
                report["charged_vs_kernels"] = charged_against_kernels(out / "grants.json", kernels)
            report["sliding_1s"] = sliding_windows(kernels, targets, 1.0, trim_s=args.trim)
            report["sliding_10s"] = sliding_windows(kernels, targets, 10.0, trim_s=args.trim)
            report["window_error_1s_pp"] = {g: v["worst_pp"] for g, v in report["sliding_1s"].items()}
            if report["sliding_10s"]:
                report["window_error_10s_pp"] = {g: v["worst_pp"] for g, v in report["sliding_10s"].items()}
        else:
            report["window_error_1s_pp"] = window_errors(traces, targets, 1.0, start, end)
        if "time_shares" in report:
            report["time_share_error_pp"] = {n: abs(report["time_shares"][n] - targets[n]) * 100 for n in group_names}
        if args.mode == "gemini":
            report["hook_stats"] = {str(pid): s for pid, s in read_stats(stats_file).items()}
    (out / "share.json").write_text(json.dumps(report, indent=1))
    if args.plot:
        try:
            from bench.plots import plot_run
            report["plot"] = str(plot_run(out, Path(args.plot), title=args.title))
        except ImportError as exc:
            report["plot"] = f"no plot: {exc}"
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["native", "gemini", "mps"], default="gemini")
    p.add_argument("--caps", default="0.3,0.6",
                   help="per tenant: MaxUtil (gemini) or CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / 100 (mps)")
    p.add_argument("--mins", default="", help="MinUtil per tenant (gemini mode; default 0)")
    p.add_argument("--tenants", type=int, default=2, help="number of tenants (native mode)")
    p.add_argument("--per-group", type=int, default=1, help="processes per group (gemini mode)")
    p.add_argument("--transport", choices=["tcp", "ipc"], default="tcp",
                   help="gemini mode: hooks and daemons on TCP ports or on Unix sockets (launch-backend --ipc-dir)")
    p.add_argument("--turns", action="store_true",
                   help="gemini mode: ProcessSharing = turns (a group's processes hold its token one at a time)")
    p.add_argument("--seconds", type=float, default=12)
    p.add_argument("--trim", type=float, default=1.0, help="seconds dropped at both ends of the common span")
    p.add_argument("--kernel-us", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--debug-logs", action="store_true",
                   help="gemini mode: daemons and hooks log at debug level (tenants' stderr kept as <tenant>.stderr)")
    p.add_argument("--work-iters", type=int, default=0,
                   help="compute-bound gem_work kernels of this many steps (shares by throughput against the "
                        "kernel's time alone) instead of gem_spin; needed to compare with MPS")
    p.add_argument("--threads", type=int, default=256, help="threads per block for --work-iters")
    p.add_argument("--blocks", type=int, default=132)
    p.add_argument("--quota", type=float, default=None, help="gem-schd base quota, ms (default: gem-schd's)")
    p.add_argument("--min-quota", type=float, default=None, help="(default: gem-schd's)")
    p.add_argument("--window", type=float, default=None, help="gem-schd's reporting window, ms (default: its own)")
    p.add_argument("--schd-arg", action="append", default=[], metavar="FLAG",
                   help="one more gem-schd flag (repeatable), e.g. --schd-arg=--frame=0 (continuous buckets)")
    p.add_argument("--out")
    p.add_argument("--plot", help="write a PNG of share over time and the token timeline here (needs matplotlib)")
    p.add_argument("--title", help="plot title")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
