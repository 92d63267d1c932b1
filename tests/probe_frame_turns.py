"""A probe, not a CI test (its name is not test_*: CI does not collect it; 30 s): three always-busy spin tenants at
MaxUtil 0.2 / 0.3 / 0.5 for 12 s on the simulated driver, with the real gem-schd, pod managers and hook, with and
without `gem-schd --frame-turns`. Prints each group's share and its worst sliding 1 s window (stepped by 25 ms, so
at every phase against the frames), against what each is owed (gem-schd's fair targets: the caps unless they add
up to more than 1). The numbers in docs/benchmarks.md ("Twentieth session") came from it; with
`PROBE_CAPS=1,1 PROBE_MINS=0.7,0`, issue 13's floor ("Twenty-third session"):

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_frame_turns.py
"""
from __future__ import annotations

import os

import pytest

from bench.harness import Group, Trace, common_span, shares_over
from gemini.scheduler.policy import fair_targets
from tests.e2e_fixtures import finish, start
from tests.test_e2e_hook import workload

# PROBE_CAPS=0.1,0.2,0.3,0.4 probes another mix (the soak's); PROBE_SCHD_ARGS more gem-schd flags
CAPS = dict(zip("abcdefgh", (float(c) for c in os.environ.get("PROBE_CAPS", "0.2,0.3,0.5").split(","))))
# PROBE_MINS=0.7,0 gives the groups floors (with PROBE_CAPS=1,1: issue 13's floor); each is then scored against
# what it is owed (gem-schd's fair targets), not its cap
MINS = dict(zip("abcdefgh", (float(m) for m in os.environ.get("PROBE_MINS", "").split(",") if m)))
OWED = fair_targets(CAPS, MINS)


@pytest.mark.parametrize("turns", [False, True], ids=["vtime", "frame-turns"])
def test_probe(sim, backends, turns):
    be = backends([Group(g, MINS.get(g, 0.0), c) for g, c in CAPS.items()], quota_ms=100, min_quota_ms=5,
                  window_ms=10_000,
                  extra_args=([] if turns else ["--schd-arg=--no-frame-turns"]) +
                  [f"--schd-arg={a}" for a in os.environ.get("PROBE_SCHD_ARGS", "").split()])
    traces = {g: sim.dir / f"{g}.trace" for g in CAPS}
    procs = {g: start(workload("workload-procaddr", "--seconds", 12, "--sync-every", 4, "--trace", traces[g]),
                      sim.hooked(be, g)) for g in CAPS}
    for p in procs.values():
        assert finish(p).rc == 0
    loaded = {g: Trace.read(path) for g, path in traces.items()}
    s, e = common_span(loaded, trim_s=2.0)
    shares = shares_over(loaded, s, e)
    worst = dict.fromkeys(CAPS, 0.0)
    t = s
    while t + 1e9 <= e:
        w = shares_over(loaded, t, t + 1e9)
        for g, owed in OWED.items():
            worst[g] = max(worst[g], abs(w[g] - owed))
        t += 0.025e9
    print(f"\nframe turns {turns}: shares", {g: round(v, 3) for g, v in shares.items()},
          "worst 1 s window (points)", {g: round(v * 100, 2) for g, v in worst.items()})
