"""A probe, not a CI test (its name is not test_*): the model runs behind docs/benchmarks.md's "Thirty-fourth
session" table -- busy groups beside light ones (ms of work every ms), 12 s of tests/policy_sim.Model with gem-schd's
default flags. Prints, per mix, the busy groups' shares over 3-12 s, the first one's worst 1 s window, handoffs a
second and the first light group's p99 (ms), with light groups' demand in the targets and without it
(`demand_limits=False`, the targets as before the thirty-fourth session: for these mixes the same numbers as
`8f9e662` gave).

    .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_demand.py
"""
import pytest

from tests.policy_sim import Busy, Model, Requests, percentile

MIXES = {
    "F 0.35/0.6, U, light 1.5/20 and 2/50": ([("f", 0.35, 0.6), ("u", 0, 1), ("l1", 0, 1), ("l2", 0, 1)],
                                            {"f": Busy(), "u": Busy(), "l1": Requests(1.5, 20), "l2": Requests(2, 50)},
                                            ["f", "u"], "l1"),
    "A MinUtil 0.6, B, light 5/50": ([("a", 0.6, 1), ("b", 0, 1), ("l", 0, 1)],
                                     {"a": Busy(), "b": Busy(), "l": Requests(5, 50)}, ["a", "b"], "l"),
    "F 0.4/0.7, U, light 1.5/20 and 2/50": ([("f", 0.4, 0.7), ("u", 0, 1), ("l1", 0, 1), ("l2", 0, 1)],
                                           {"f": Busy(), "u": Busy(), "l1": Requests(1.5, 20), "l2": Requests(2, 50)},
                                           ["f", "u"], "l1"),
    "U, U, Poisson light 5/50": ([("a", 0, 1), ("b", 0, 1), ("l", 0, 1)],
                                 {"a": Busy(), "b": Busy(), "l": Requests(5, 50, poisson=True)}, ["a", "b"], "l"),
    "MaxUtil 0.45, U, light 3/30": ([("a", 0, 0.45), ("b", 0, 1), ("l", 0, 1)],
                                    {"a": Busy(), "b": Busy(), "l": Requests(3, 30)}, ["a", "b"], "l"),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_probe(mix):
    groups, kinds, busy, light = MIXES[mix]
    for on in (False, True):
        m = Model(groups, kinds, demand_limits=on).run(12_000.0)
        shares = " / ".join(f"{m.share(n, 3000, 12_000):.3f}" for n in busy)
        worst = min(m.window_shares(busy[0], 1000.0, 100.0, 3000.0))
        p99 = percentile(m.tenants[light].latencies, 0.99)
        print(f"\nPROBE {mix} ({'demand' if on else 'before'}): {shares}, worst 1 s {worst:.3f}, "
              f"{m.handoffs(3000, 12_000) / 9:.1f} handoffs/s, p99 {p99:.0f} ms")
