"""A probe, not a CI test (its name is not test_*): the floor, MinUtil 0.7 against 0, on the simulated driver with
gem-schd's default flags, deciding ahead (the default) and not (`--decide-ahead 0`): two always-busy spin groups for
8 s, their on-chip shares (the first second left out), a's sliding 1 s windows, and the hooks' counters.

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_floor_ahead.py
"""
import pytest

from bench.harness import Group, read_stats
from bench.harness import Trace, common_span, shares_over
from tests.e2e_fixtures import Sim, finish, start
from tests.test_e2e_hook import workload


@pytest.mark.parametrize("rep", [0, 1])
@pytest.mark.parametrize("ahead", ["default", "off"])
def test_probe(tmp_path, hook_lib, backends, ahead, rep):
    sim = Sim(tmp_path / "sim", hook_lib)
    extra = [] if ahead == "default" else ["--schd-arg=--decide-ahead=0"]
    be = backends([Group("a", 0.7, 1.0), Group("b", 0.0, 1.0)], quota_ms=None, min_quota_ms=None, window_ms=None,
                  extra_args=extra)
    traces = {g: tmp_path / f"{g}.trace" for g in ("a", "b")}
    procs = {g: start(workload("workload-procaddr", "--seconds", 8, "--sync-every", 4, "--trace", traces[g]),
                      dict(sim.hooked(be, g), GEMINI_STATS_FILE=str(tmp_path / f"{g}.stats"))) for g in traces}
    res = {g: finish(p) for g, p in procs.items()}
    assert all(r.rc == 0 for r in res.values()), res
    loaded = {g: Trace.read(p) for g, p in traces.items()}
    s, e = common_span(loaded, trim_s=1.0)
    sh = shares_over(loaded, s, e)
    w1 = [shares_over(loaded, t, t + 1e9)["a"] for t in range(int(s), int(e - 1e9) + 1, int(0.1e9))]
    st = {g: next(iter(read_stats(tmp_path / f"{g}.stats").values()), {}) for g in traces}
    keys = ("grants", "continuations", "drains", "expiries", "wait_ms", "waits")
    print({g: {k: v.get(k) for k in keys} for g, v in st.items()})
    print(f"\nPROBE ahead={ahead} rep={rep}: a {sh['a']:.3f} b {sh['b']:.3f} sum {sh['a'] + sh['b']:.3f}; "
          f"a's 1 s windows {min(w1):.3f}-{max(w1):.3f}")
