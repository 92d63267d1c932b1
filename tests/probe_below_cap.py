"""A probe, not a CI test (its name is not test_*): framed caps that the others' shares hold below them, by less
than half (0.4 / 0.5 / 1 and 0.4 / 0.6 / 0.8: a third each), on the simulated driver with gem-schd's default flags:
three always-busy spin groups for 8 s, their on-chip shares (the first second left out) and the worst sliding 1 s
window's distance from a third. In the policy model these were 0.209 / 0.289 / 0.499 and 0.239 / 0.339 / 0.419
before the thirty-third session's _overflow_walk and _yields (docs/architecture.md, "Slots").

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_below_cap.py
"""
import pytest

from bench.harness import Group, Trace, common_span, shares_over
from tests.e2e_fixtures import Sim, finish, start
from tests.test_e2e_hook import workload


@pytest.mark.parametrize("caps", [(0.4, 0.5, 1.0), (0.4, 0.6, 0.8)])
def test_probe(tmp_path, hook_lib, backends, caps):
    sim = Sim(tmp_path / "sim", hook_lib)
    names = ("a", "b", "c")
    be = backends([Group(n, 0.0, c) for n, c in zip(names, caps)], quota_ms=None, min_quota_ms=None, window_ms=None)
    traces = {g: tmp_path / f"{g}.trace" for g in names}
    procs = {g: start(workload("workload-procaddr", "--seconds", 8, "--sync-every", 4, "--trace", traces[g]),
                      sim.hooked(be, g)) for g in names}
    res = {g: finish(p) for g, p in procs.items()}
    assert all(r.rc == 0 for r in res.values()), res
    loaded = {g: Trace.read(p) for g, p in traces.items()}
    s, e = common_span(loaded, trim_s=1.0)
    sh = shares_over(loaded, s, e)
    worst = max(abs(shares_over(loaded, t, t + 1e9)[g] - 1 / 3) for g in names
                for t in range(int(s), int(e - 1e9) + 1, int(0.1e9)))
    print(f"\nPROBE caps={caps}: " + " / ".join(f"{sh[g]:.3f}" for g in names) +
          f", sum {sum(sh.values()):.3f}; worst 1 s window {worst * 100:.1f} points from a third")
