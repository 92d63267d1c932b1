"""A probe, not a CI test (its name is not test_*): where a capped group's charged GPU time goes that its kernels do
not use. Two always-busy spin tenants at MaxUtil 0.3 / 0.6 (PROBE_CAPS) for 14 s on the simulated driver with
gem-schd's default flags; the simulator's kernel trace and gem-schd's trace are read side by side (both on
CLOCK_MONOTONIC once gem-schd's wall-clock origin is moved by this process's realtime - monotonic offset). Prints,
per group: its on-chip share, its charged share (gem-schd's last whole reporting window), how much of its slots' time
its own kernels and other groups' kernels ran, its kernels outside its slots, and how long after a slot's start its
first kernel ran. The numbers in docs/benchmarks.md ("Twenty-sixth session") came from it.

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_charge.py
"""
from __future__ import annotations

import bisect
import os
import time

from bench.harness import Group
from gemini.scheduler.trace import SchedulerTrace
from tests.e2e_fixtures import Sim, finish, start
from tests.test_e2e_hook import workload

import native

CAPS = dict(zip("abcdefgh", (float(c) for c in os.environ.get("PROBE_CAPS", "0.3,0.6").split(","))))
SECONDS = float(os.environ.get("PROBE_SECONDS", "14"))


def _busy_within(spans: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> int:
    """ns of the (sorted, non-overlapping per tenant) kernel spans inside [lo, hi]."""
    total = 0
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(spans) and spans[i][0] < hi:
        s, e = spans[i]
        total += max(0, min(e, hi) - max(s, lo))
        i += 1
    return total


def test_probe(tmp_path, hook_lib, backends):
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    strace = tmp_path / "schd.trace"
    be = backends([Group(g, 0.0, c) for g, c in CAPS.items()], quota_ms=None, min_quota_ms=None, window_ms=None,
                  extra_args=[f"--schd-arg=--trace={strace}"] +
                  [f"--schd-arg={a}" for a in os.environ.get("PROBE_SCHD_ARGS", "").split()])
    offset_ns = time.time_ns() - time.monotonic_ns()
    procs = {g: start(workload("workload-procaddr", "--seconds", SECONDS, "--sync-every", 4, "--json"),
                      sim.hooked(be, g)) for g in CAPS}
    pids = {}
    for g, p in procs.items():
        r = finish(p)
        assert r.rc == 0, r
        pids[r.json["pid"]] = g
    be.stop()
    rows = [r for r in native.read_trace(sim.trace) if r[0] in pids and r[4] == "gem_spin"]
    spans = {g: sorted((s, e) for pid, _d, s, e, _n in rows if pids[pid] == g) for g in CAPS}
    starts = {g: [s for s, _e in v] for g, v in spans.items()}
    trace = SchedulerTrace.load(strace)
    t0 = int(trace.unix_t0 * 1e9) - offset_ns     # gem-schd's ts 0 on CLOCK_MONOTONIC
    lo = max(v[0][0] for v in spans.values()) + 2_000_000_000
    hi = min(v[-1][1] for v in spans.values()) - 1_000_000_000
    print(f"\ncaps {CAPS}, span {(hi - lo) / 1e9:.1f} s")
    for g in CAPS:
        onchip = _busy_within(spans[g], starts[g], lo, hi) / (hi - lo)
        slots = [(t0 + int(s.start_s * 1e9), t0 + int((s.start_s + s.dur_s) * 1e9)) for s in trace.slots
                 if s.group == g]
        slots = [(max(s, lo), min(e, hi)) for s, e in slots if e > lo and s < hi]
        in_slots = sum(e - s for s, e in slots)
        own = sum(_busy_within(spans[g], starts[g], s, e) for s, e in slots)
        others = {h: sum(_busy_within(spans[h], starts[h], s, e) for s, e in slots) for h in CAPS if h != g}
        outside = _busy_within(spans[g], starts[g], lo, hi) - own
        sample = [x for x in trace.samples if lo <= t0 + int((x.t_s - trace.window_s) * 1e9)
                  and t0 + int(x.t_s * 1e9) <= hi]
        charged = sample[-1].shares.get(g) if sample else None
        # from the slot's start (gem-schd sent the grant) to the group's first kernel starting after it: the grant's
        # way through gem-pmgr and the hook, and the previous holder's queue the simulated device runs first
        firsts = []
        for s, e in slots:
            i = bisect.bisect_left(starts[g], s)
            if i < len(starts[g]) and starts[g][i] < e:
                firsts.append((starts[g][i] - s) / 1e6)
        firsts.sort()
        if firsts:
            print(f"{g}: its first kernel after a slot's start, ms: p10 {firsts[len(firsts) // 10]:.2f} "
                  f"p50 {firsts[len(firsts) // 2]:.2f} p90 {firsts[len(firsts) * 9 // 10]:.2f}")
        reasons: dict[str, int] = {}
        for s in trace.slots:
            if s.group == g:
                reasons[s.ended] = reasons.get(s.ended, 0) + 1
        print(f"{g}: on-chip {onchip:.4f}, charged {charged}, slots {in_slots / (hi - lo):.4f} of the span "
              f"({len(slots)}): own kernels {own / max(in_slots, 1):.4f} of them, others' "
              f"{ {h: round(v / max(in_slots, 1), 4) for h, v in others.items()} }, "
              f"own kernels outside its slots {outside / (hi - lo):.4f} of the span; ends {reasons}")
