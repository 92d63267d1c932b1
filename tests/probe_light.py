"""A probe, not a CI test (its name is not test_*): two busy groups beside two light ones on the simulated driver,
with gem-schd's default flags. f has MinUtil 0.35 (MaxUtil 0.6) and u nothing; l1 serves a request of 1.5 ms every
20 ms and l2 one of 2 ms every 50 ms. Floors first and the rest evenly gives f and u about 0.46 each. In the policy
model they got 0.549 / 0.338 before the thirty-fourth session's demand limits (gemini/scheduler/demand.py) and
0.447 / 0.446 after. Prints the on-chip shares over 10 s (the first 2 s left out) and the light groups' p99.

    make hook testhook sim clients && .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_light.py
"""
import json

from bench.harness import Group, Trace, common_span, shares_over
from tests.e2e_fixtures import Sim, client_argv, finish, start
from tests.test_e2e_hook import workload


def test_probe(tmp_path, hook_lib, backends):
    sim = Sim(tmp_path / "sim", hook_lib)
    be = backends([Group("f", 0.35, 0.6), Group("u", 0.0, 1.0), Group("l1", 0.0, 1.0), Group("l2", 0.0, 1.0)],
                  quota_ms=None, min_quota_ms=None, window_ms=None)
    traces = {g: tmp_path / f"{g}.trace" for g in ("f", "u", "l1", "l2")}
    procs = {g: start(workload("workload-procaddr", "--seconds", 12, "--sync-every", 4, "--trace", traces[g]),
                      sim.hooked(be, g)) for g in ("f", "u")}
    for g, kernel_us, period_us in (("l1", 750, 20_000), ("l2", 1000, 50_000)):
        procs[g] = start(client_argv("workload-linked", "--kernel-us", kernel_us, "--json", "--seconds", 12,
                                     "--period-us", period_us, "--sync-every", 2, "--trace", traces[g]),
                         sim.hooked(be, g))
    res = {g: finish(p) for g, p in procs.items()}
    assert all(r.rc == 0 for r in res.values()), res
    loaded = {g: Trace.read(p) for g, p in traces.items()}
    s, e = common_span(loaded, trim_s=2.0)
    sh = shares_over(loaded, s, e)
    p99 = {g: json.loads(res[g].out.strip().splitlines()[-1])["latency_us"]["p99"] / 1000 for g in ("l1", "l2")}
    print("\nPROBE f / u / l1 / l2: " + " / ".join(f"{sh[g]:.3f}" for g in ("f", "u", "l1", "l2")) +
          f"; light p99 {p99['l1']:.1f} / {p99['l2']:.1f} ms")
