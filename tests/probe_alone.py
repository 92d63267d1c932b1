"""A probe, not a CI test (its name is not test_*): what a lone busy group pays for a neighbour that is configured but
idle. One spin tenant (1 ms kernels, a synchronisation every 4) in group `train` (MinUtil 0, MaxUtil 1) for 6 s on
the simulated driver, with or without an idle group `infer` (MinUtil 0.5) in the config, under gem-schd's default
flags and under `-q 250 -m 10 -w 10000` (what bench_overhead.py passed until the twenty-seventh session). Prints the
kernels done and the hook's counters. With the neighbour configured the group's grants carry GEM_GRANT_BOUND (gem-pmgr
`_grant_flags`: "configured, not active"), so its hook places markers every N launches, and since `0d73272` every
such marker is a timed event (2.3 us of GPU time each on an H200, docs/benchmarks.md "Twenty-seventh session").

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_alone.py
"""
from __future__ import annotations

import pytest

from bench.harness import Group, read_stats
from tests.e2e_fixtures import Sim, finish, start
from tests.test_e2e_hook import workload

KEYS = ("launches", "grants", "waits", "wait_ms", "expiries", "drains", "continuations", "idle_ms", "syncs",
        "markers", "markers_timed", "marker_waits", "marker_wait_ms", "marker_host_ms")


@pytest.mark.parametrize("rep", [0, 1])
@pytest.mark.parametrize("idle_neighbour", [True, False])
@pytest.mark.parametrize("flags", ["defaults", "q250"])
def test_probe(tmp_path, hook_lib, backends, flags, idle_neighbour, rep):
    sim = Sim(tmp_path / "sim", hook_lib)
    groups = [Group("train", 0.0, 1.0)] + ([Group("infer", 0.5, 1.0)] if idle_neighbour else [])
    kw = dict(quota_ms=None, min_quota_ms=None, window_ms=None) if flags == "defaults" else \
        dict(quota_ms=250, min_quota_ms=10, window_ms=10000)
    be = backends(groups, **kw)
    stats = tmp_path / "stats"
    env = dict(sim.hooked(be, "train"), GEMINI_STATS_FILE=str(stats))
    r = finish(start(workload("workload-procaddr", "--seconds", 6, "--sync-every", 4, "--json"), env))
    assert r.rc == 0, r
    be.stop()
    st = next(iter(read_stats(stats).values()), {})
    print(f"\n{flags}, idle neighbour {idle_neighbour}: kernels {r.json.get('kernels_done')}",
          {k: st.get(k) for k in KEYS})
