"""bench/bench_policy_cost.py keeps measuring real decisions (a grant per timed call) as the policy changes."""
from bench.bench_policy_cost import config, measure


def test_every_timed_decision_hands_out_a_slot_and_all_groups_get_turns():
    r = measure(16, 300)
    assert r["decisions"] == 300
    assert 0 < r["p50_us"] <= r["p99_us"]
    assert r["ceiling_slots_per_s"] > 0


def test_the_mix_has_capped_floored_and_plain_groups():
    groups = config(8).groups
    assert sum(g.max_util < 1 for g in groups) == 2
    assert sum(g.min_util > 0 for g in groups) == 2
