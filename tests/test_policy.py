"""gem-schd's policy on simulated time: caps as token buckets, floors and fair shares by weighted virtual time,
continuations, latency claims. No sockets, no sleeping.

Two drivers: direct calls (exact decisions), and tests/policy_sim.Model, which adds the delays of the real
system (grants and requests travel, a holder drains its queue before it asks again, a context switch costs the
GPU 0.14 ms) and measures what each tenant really ran.
"""
from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemini.config import parse_config
from gemini.scheduler.policy import (DEFAULT_BUCKET_MS, MIN_WEIGHT, ClaimRightDecision, GrantDecision, Policy,
                                     RefuseDecision, SlotEndDecision, _FrameBucket, diff_configs, fair_targets)
from gemini.wire.sched import ERR_UNKNOWN_GROUP
from tests.policy_sim import Busy, Model, Requests, _Tenant, config, percentile


def grants(decisions):
    return [d for d in decisions if isinstance(d, GrantDecision)]


def ends(decisions):
    return [d for d in decisions if isinstance(d, SlotEndDecision)]


def busy_model(groups, until=30_000.0, **kw):
    return Model(groups, {g[0]: Busy() for g in groups}, **kw).run(until)


def worst(values, target):
    return max(abs(v - target) for v in values)


# --- floors -------------------------------------------------------------------------------------------------------

def test_min_util_floor_holds_against_a_busy_neighbour():
    """The issue's case: A with MinUtil 0.7, B with 0, both busy and uncapped. A gets its 0.7."""
    m = busy_model([("a", 0.7, 1.0), ("b", 0.0, 1.0)])
    assert m.share("a", 2000, m.now) >= 0.69
    assert m.share("b", 2000, m.now) >= 0.29      # and B the rest
    assert m.share("a", 2000, m.now) + m.share("b", 2000, m.now) >= 0.99


def test_without_continuations_the_groups_alternate_whatever_their_floors():
    """What the floor failure looked like: at a deadline the holder is still draining, so only the other group
    waits and wins; the groups alternate 1:1 (0.50 / 0.48 on the simulated driver, 0.505 / 0.477 on the H100)."""
    m = busy_model([("a", 0.7, 1.0), ("b", 0.0, 1.0)], continuation=False)
    assert m.share("a", 2000, m.now) < 0.55


@pytest.mark.parametrize("floors,expected", [
    ((0.3, 0.0), (0.5, 0.5)),          # the floor is met by an even split: no effect
    ((0.5, 0.2), (0.5, 0.5)),
    ((0.8, 0.2), (0.8, 0.2)),
    ((0.0, 0.0), (0.5, 0.5)),
])
def test_shares_under_contention_are_the_water_filled_floors(floors, expected):
    m = busy_model([("a", floors[0], 1.0), ("b", floors[1], 1.0)])
    for name, want in zip("ab", expected):
        assert abs(m.share(name, 2000, m.now) - want) <= 0.015, (name, m.share(name, 2000, m.now))


@pytest.mark.parametrize("groups", [
    [("a", 0.5, 1.0), ("b", 0.2, 1.0), ("c", 0.0, 1.0)],       # floors: 0.5 / 0.25 / 0.25
    [("a", 0.5, 1.0), ("b", 0.0, 0.8), ("c", 0.0, 1.0)],       # a cap the others' shares hold it under
])
def test_with_a_fair_cycle_floors_and_fair_shares_hold_over_every_second(groups):
    """gem-schd --fair-cycle 100: uncapped groups' slots are their fair share of 100 ms, taken in turns, so every
    100 ms holds each group's share, and so does every 1 s window over a minute (within 0.5 points). With the base
    quota's 100 ms slots each (the default) the slots interleave in proportion but a second holds a slot more or
    less of a group: 5-10 points. (By virtual time, slots of the cycle's share slipped every half minute or so,
    3-5 points: an independent review.)"""
    owed = fair_targets({g[0]: g[2] for g in groups}, {g[0]: g[1] for g in groups})

    def worst_1s(m):
        return max(worst(m.window_shares(n, 1000, 50, 2000), owed[n]) for n in owed)
    cycled = busy_model(groups, until=60_000.0, fair_cycle_ms=100.0)
    assert worst_1s(cycled) <= 0.005, worst_1s(cycled)
    for n, want in owed.items():
        assert abs(cycled.share(n, 2000, cycled.now) - want) <= 0.005
    assert cycled.handoffs(2000, cycled.now) <= 10.5 * len(groups) * 58     # one a group and cycle
    assert worst_1s(busy_model(groups)) >= 0.05


def test_a_fair_cycle_leaves_groups_held_to_their_caps_alone():
    """Caps that add up to less than 1 are the groups' fair shares: their frames decide their slots, cycle or not
    (200 ms frames, a 100 ms cycle: cut to the cycle's share, each frame's budget would take two slots)."""
    groups = [("a", 0.0, 0.3), ("b", 0.0, 0.6)]
    plain = busy_model(groups, until=10_000.0, cap_frame_ms=200.0)
    cycled = busy_model(groups, until=10_000.0, cap_frame_ms=200.0, fair_cycle_ms=100.0)
    assert [(d.group, d.quota_ms) for d in grants(plain.decisions)] == \
        [(d.group, d.quota_ms) for d in grants(cycled.decisions)]
    for bad in (-1.0, 150.0):       # past -q (100): a share of the cycle would not fit in a slot
        with pytest.raises(ValueError, match="fair_cycle_ms"):
            Policy(config(*groups), fair_cycle_ms=bad)


def test_with_a_fair_cycle_a_group_owed_nothing_gets_a_useful_slot_not_a_whole_quota():
    """Floors of 0.7 and 0.3 leave a third group nothing: when its turn by virtual time comes it runs -m (5 ms),
    not -q (100 ms), which took a tenth of a second from the floors (an independent review: a's 1 s window 0.629)."""
    groups = [("a", 0.7, 1.0), ("b", 0.3, 1.0), ("c", 0.0, 1.0)]
    m = Model(groups, {"a": Busy(), "b": Busy(), "c": Busy(start_ms=5000.0)}, fair_cycle_ms=100.0).run(30_000.0)
    assert all(d.quota_ms <= 5.0 + 1e-9 for d in grants(m.decisions) if d.group == "c")
    assert min(m.window_shares("a", 1000, 25, 6000)) >= 0.68


def test_a_fair_cycle_too_short_for_the_least_share_stretches_or_stands_aside():
    """A share whose part of the cycle would be under -m (5 ms) stretches the cycle (0.5 beside eleven groups owed
    0.045 each: 110 ms), so the proportions hold; where the largest share's slot would then pass -q the cycle stands
    aside (0.9 beside three owed 0.033: 135 ms), as without it. Rounding the small slots up to -m gave the 0.9
    floor 0.856 (an independent review)."""
    wide = [("a", 0.5, 1.0)] + [(f"z{i}", 0.0, 1.0) for i in range(11)]
    m = busy_model(wide, until=20_000.0, fair_cycle_ms=100.0)
    assert abs(m.share("a", 2000, m.now) - 0.5) <= 0.005
    assert worst(m.window_shares("a", 1000, 50, 2000), 0.5) <= 0.01
    big = [("a", 0.9, 1.0), ("b", 0.0, 1.0), ("c", 0.0, 1.0), ("d", 0.0, 1.0)]
    cycled, plain = busy_model(big, until=20_000.0, fair_cycle_ms=100.0), busy_model(big, until=20_000.0)
    assert cycled.share("a", 2000, cycled.now) >= 0.895
    assert [(d.group, d.quota_ms) for d in grants(cycled.decisions)] == \
        [(d.group, d.quota_ms) for d in grants(plain.decisions)]


def test_fair_targets_with_floors_and_caps():
    assert fair_targets({"a": 1.0, "b": 1.0}, {"a": 0.7}) == pytest.approx({"a": 0.7, "b": 0.3})
    assert fair_targets({"a": 0.3, "b": 0.6}) == {"a": 0.3, "b": 0.6}
    assert fair_targets({"a": 0.6, "b": 1.0}) == pytest.approx({"a": 0.5, "b": 0.5})
    t = fair_targets({"a": 0.2, "b": 0.9, "c": 0.9})
    assert t == pytest.approx({"a": 0.2, "b": 0.4, "c": 0.4})
    # floors adding up to more than 1 are scaled down
    assert fair_targets({"a": 1.0, "b": 1.0}, {"a": 0.9, "b": 0.6}) == pytest.approx({"a": 0.6, "b": 0.4})


# --- caps ---------------------------------------------------------------------------------------------------------

# Continuous buckets (`--frame 0`): 1 s windows within the bucket's depth over 1 s (MaxUtil x T + bucket is the
# guarantee) plus 2 points
W1 = DEFAULT_BUCKET_MS / 1000 + 0.002


@pytest.mark.parametrize("caps", [(0.3, 0.6), (0.4, 0.6), (0.2, 0.3, 0.5), (0.1, 0.2, 0.3, 0.4)])
def test_busy_capped_groups_reach_their_caps_over_every_window(caps):
    """Frames (the default, `--frame 100`): sliding 1 s and 10 s windows, stepped by 100 ms, from the 2nd second,
    within 1.1 points of the cap (issue 14: 1.5 and 1), and so is the mean. A busy group's slots repeat every 100 ms,
    so a window holds whole frames; what is left is the model's delays (with 0.3 / 0.6 the 0.3 group is credited the
    grant's travel at the start of its slots; with caps adding up to 1 the handoffs cost someone a little). A version
    whose slots ran on through the next frame's quota lost 2-3 points at 0.4 / 0.6 here."""
    groups = [(chr(97 + i), 0.0, c) for i, c in enumerate(caps)]
    m = busy_model(groups, until=25_000.0, cap_frame_ms=100.0)
    for name, _, cap in groups:
        assert worst(m.window_shares(name, 1000.0, 100.0, 2000.0), cap) <= 0.011, name
        assert worst(m.window_shares(name, 10_000.0, 100.0, 2000.0), cap) <= 0.011, name
        assert abs(m.share(name, 2000, m.now) - cap) <= 0.011, name


@pytest.mark.parametrize("caps,w10,mean", [
    ((0.3, 0.6), 0.010, 0.009),
    ((0.4, 0.6), 0.006, 0.005),
    ((0.2, 0.3, 0.5), 0.010, 0.008),
    ((0.1, 0.2, 0.3, 0.4), 0.010, 0.008),
])
def test_continuous_buckets_swing_a_one_second_window_by_up_to_their_depth(caps, w10, mean):
    """The mechanism switched off (`--frame 0`): continuous buckets of 25 ms hold the means and the 1 s windows
    within the bucket's depth, but the cycle of slots is as long as the refill and the handoffs make it, so a 1 s
    window holds a fraction of a cycle too, and swings by 1.6-2.6 points in this model (2.2-5.6 on an H100,
    docs/benchmarks.md): past issue 14's 1.5 for at least one group of every mix."""
    groups = [(chr(97 + i), 0.0, c) for i, c in enumerate(caps)]
    m = busy_model(groups, until=25_000.0, cap_frame_ms=0.0)
    worst_1s = 0.0
    for name, _, cap in groups:
        w1 = worst(m.window_shares(name, 1000.0, 100.0, 2000.0), cap)
        worst_1s = max(worst_1s, w1)
        assert w1 <= W1, name
        assert worst(m.window_shares(name, 10_000.0, 100.0, 2000.0), cap) <= w10, name
        assert abs(m.share(name, 2000, m.now) - cap) <= mean, name
        assert max(m.window_shares(name, 1000.0, 100.0, 2000.0)) <= cap + DEFAULT_BUCKET_MS / 1000 + 0.002
    assert worst_1s > 0.015


@pytest.mark.parametrize("cap", [0.3, 0.5])
def test_a_capped_group_next_to_uncapped_ones_reaches_its_cap(cap):
    """The uncapped groups' slots end by the time the capped group's bucket is full, so none of its refill is
    lost (with 100 ms slots beside it, MaxUtil 0.3 got 0.263 of the GPU, and 0.5 got 0.332 next to one uncapped
    group). The capped group's target is its cap, or an equal split if that is smaller."""
    for others in (("b",), ("b", "c")):
        m = busy_model([("a", 0.0, cap)] + [(o, 0.0, 1.0) for o in others], until=20_000.0)
        target = min(cap, 1 / (1 + len(others)))
        assert m.share("a", 2000, m.now) == pytest.approx(target, abs=0.01), others
        for o in others:
            assert m.share(o, 2000, m.now) == pytest.approx((1 - target) / len(others), abs=0.01), others


def test_a_lone_capped_group_stays_at_its_cap():
    m = busy_model([("a", 0.0, 0.3)], until=20_000.0)
    assert worst(m.window_shares("a", 1000.0, 100.0, 1000.0), 0.3) <= 0.01


@pytest.mark.parametrize("cap_bound_only", [True, False])
def test_uncapped_slots_are_not_cut_for_a_capped_group_that_its_fair_share_holds_below_its_cap(cap_bound_only,
                                                                                              monkeypatch):
    """MaxUtil 0.5 beside two busy uncapped groups: its fair share is a third, below its cap, so it cannot use its
    frame's budget whatever the others' slots, and their slots are not cut to its frame. Cut (the `False` case:
    every active capped group counted, as with continuous buckets), the uncapped groups' slots splintered into the
    shortest ones, about 100 handoffs a second in this model instead of 10."""
    if not cap_bound_only:
        real = Policy._current_targets

        def every_capped(self, now):
            out = real(self, now)
            self._cap_bound = {n: g for n, g in self._capped.items() if n in out}
            return out
        monkeypatch.setattr(Policy, "_current_targets", every_capped)
    m = busy_model([("a", 0.0, 0.5), ("b", 0.0, 1.0), ("c", 0.0, 1.0)], until=10_000.0, cap_frame_ms=100.0)
    for name in "abc":
        assert m.share(name, 2000, m.now) == pytest.approx(1 / 3, abs=0.01), name
    per_s = m.handoffs(2000, m.now) / 8.0
    assert (per_s <= 15) == cap_bound_only, per_s


@pytest.mark.parametrize("behind_too", [True, False])
def test_uncapped_slots_make_way_for_a_framed_group_behind_them_that_its_fair_share_holds_below_its_cap(behind_too,
                                                                                                      monkeypatch):
    """Three busy groups capped at 0.4 / 0.5 / 1 are owed a third each. The capped two are held below their caps
    by the others' shares, but their frames (40 and 50 ms of every 100) hold little more than a third: the uncapped
    group's 100 ms slots covered every other frame of theirs, and they got 0.209 / 0.289 / 0.499. An uncapped slot
    now ends before a boundary would take the rest of the frame of such a group while it is behind the holder in
    virtual time (the `False` case: only the groups whose share is their cap, as before)."""
    if not behind_too:
        monkeypatch.setattr(Policy, "_overflow_walk", lambda self, holder: list(self._cap_bound.items()))
    m = busy_model([("a", 0.0, 0.4), ("b", 0.0, 0.5), ("c", 0.0, 1.0)], until=12_000.0, cap_frame_ms=100.0)
    shares = {name: m.share(name, 2000, m.now) for name in "abc"}
    assert all(abs(v - 1 / 3) <= 0.01 for v in shares.values()) == behind_too, shares
    assert m.handoffs(2000, m.now) / 10.0 <= 30


@pytest.mark.parametrize("capped_yield", [True, False])
@pytest.mark.parametrize("groups", [
    [("a", 0.0, 0.4), ("b", 0.0, 0.6), ("c", 0.0, 0.8)],                       # a third each
    [("a", 0.0, 0.25), ("b", 0.0, 0.25), ("c", 0.0, 0.25), ("d", 0.0, 0.7)],   # a quarter each
])
def test_a_capped_holder_far_under_its_cap_makes_way_for_the_others_frames(groups, capped_yield, monkeypatch):
    """Busy groups that are all capped, the largest held by the others' shares at or under half its cap: its slots
    (its frame's budget, 70-80 ms) covered every other frame of the others, which got 0.239 / 0.339 against its
    0.419, and 0.202 each against its 0.389. Such a holder can spare its slot's end, as an uncapped one can (the
    `False` case: only uncapped holders' slots are cut, as before)."""
    if not capped_yield:
        monkeypatch.setattr(Policy, "_spare", lambda self, name, g, at: math.inf if g.bucket is None else 0.0)
    owed = fair_targets({g[0]: g[2] for g in groups})
    m = busy_model(groups, until=12_000.0, cap_frame_ms=100.0)
    shares = {name: m.share(name, 2000, m.now) for name in owed}
    assert all(abs(shares[n] - owed[n]) <= 0.01 for n in owed) == capped_yield, shares
    assert m.handoffs(2000, m.now) / 10.0 <= 10.5 * len(groups)


def test_a_full_frames_budget_does_not_splinter_the_others_slots():
    """Five busy groups capped at 0.6 / 0.5 / 0.45 / 0.2 / 0.6 (a fifth each; the 0.2 group's share is its cap).
    The 0.2 group starts every frame with a full budget, and a full one was taken as lost at once: every holder's
    slot was cut to a useful one (5 ms) while that group, ahead in virtual time, was not chosen -- 118 handoffs a
    second against 23 before the capped holders yielded too (an independent review). A frame's budget is lost at
    its boundary, not before."""
    groups = [(f"g{j}", 0.0, cap) for j, cap in enumerate([0.6, 0.5, 0.45, 0.2, 0.6])]
    m = busy_model(groups, until=12_000.0)
    for name, *_ in groups:
        assert abs(m.share(name, 2000, m.now) - 0.2) <= 0.01, name
    assert m.handoffs(2000, m.now) / 10.0 <= 35


def test_a_light_group_with_a_frame_to_spare_does_not_cut_the_busy_ones_slots():
    """A latency group capped at 0.3 that sends 3 ms every 20 ms beside busy groups capped at 0.5 / 0.5 / 0.7: its
    cap is under twice the quarter it is owed, so it counts as a framed group a skipped frame could keep from its
    share, and it is always behind in virtual time -- but it never uses its frame, which stays nearly full. Cut for
    it, every busy holder ended its slot 30 ms before each boundary: 52 handoffs a second against 30 (an independent
    review). Only a busy group (its last slot ran out) is made way for."""
    groups = [("t", 0.0, 0.3, "latency"), ("a", 0.0, 0.5), ("b", 0.0, 0.5), ("c", 0.0, 0.7)]
    m = Model(groups, {"t": Requests(3.0, 20.0), "a": Busy(), "b": Busy(), "c": Busy()}, seed=3).run(12_000.0)
    for name in "abc":
        assert abs(m.share(name, 2000, m.now) - 0.3) <= 0.01, name
    assert m.handoffs(2000, m.now) / 10.0 <= 36


def test_a_slot_makes_way_for_the_next_frames_budget_of_a_group_in_debt():
    """A group whose floor is its cap (0.35) beside busy groups capped at 0.39 and uncapped, and a light group asking
    1.5 ms every 20 ms. Its slots end a fraction of a millisecond in debt, so at the next boundary its bucket stays
    under its depth and counted as full only at the boundary after: nothing was cut for it, an uncapped 100 ms slot
    covered all of its next frame, and every third frame was skipped -- 0.285 instead of 0.35 (an independent
    review). A slot now also ends by the time the next frame's budget would no longer fit before that frame ends.
    (0.338 then; 0.330 since the light groups' demand counts in the targets: g1's target, 0.28, is then over half
    its cap and its slots are cut by at most what its frame holds over its share, _spare.)"""
    groups = [("l", 0.0, 0.21), ("g1", 0.0, 0.39), ("g2", 0.0, 0.42), ("g3", 0.0, 1.0), ("n", 0.35, 0.35)]
    m = Model(groups, {"l": Requests(1.5, 20.0, poisson=True), "g1": Busy(), "g2": Requests(2.0, 50.0), "g3": Busy(),
                       "n": Busy()}, seed=116).run(14_000.0)
    assert m.share("n", 2000, m.now) >= 0.325


def test_a_slot_granted_at_a_boundary_makes_way_for_a_busy_framed_group_whose_request_is_on_its_way():
    """b (MaxUtil 0.25, its share its cap) and a (0.8, held to 0.375 by the targets, so it yields) busy, and a light
    latency group. At a frame's boundary b's budget is full again while its next request is still on its way; a
    full bucket of a group not asking was skipped as idle, so a's slot granted there ran until b's whole frame no
    longer fitted, b's slot crossed the next boundary and paid for it from the next frame: 0.193 (a review's
    sweep). A busy framed group is made way for there too."""
    groups = [("a", 0.0, 0.8), ("b", 0.0, 0.25), ("c", 0.05, 0.5, "latency")]
    m = Model(groups, {"a": Busy(), "b": Busy(), "c": Requests(2.0, 50.0)}, seed=1).run(20_000.0)
    assert m.share("b", 2000, m.now) >= 0.24


def test_a_framed_group_that_stopped_asking_after_its_burst_does_not_splinter_the_others_slots():
    """b (MaxUtil 0.25) runs a 50 ms burst every 500 ms: its last slot of a burst runs out, then it asks nothing
    until the next one. Taken to have a request on its way for as long as it counted as active (500 ms), it had
    every holder cut to 5 ms slots before each boundary: a's 10 grants a second became 64 (a second review). Only
    just after its slot ran out does a group count as asking."""
    m = Model([("a", 0.0, 1.0), ("b", 0.0, 0.25)], {"a": Busy(), "b": Requests(50.0, 500.0)}, seed=1).run(12_000.0)
    grants_of_a = sum(1 for d in m.decisions if isinstance(d, GrantDecision) and d.group == "a" and d.start_ms >= 2000)
    assert grants_of_a / 10.0 <= 15, grants_of_a
    assert m.share("a", 2000, m.now) >= 0.88


def test_what_a_slot_runs_past_its_frames_boundary_is_paid_from_the_next_frame():
    """A framed group (MaxUtil 0.5: 50 ms a 100 ms frame) granted its frame's 50 ms 40 ms before the boundary: the
    slot is its frame's rest, not that and the next frame's quota too; the 10 ms it runs past the boundary come out
    of the next frame's 50, and what it could not use of its own frame before the boundary is gone. Released before
    the boundary, it keeps its frame's rest."""
    for release_at, left in ((80.0, 50.0 - 20.0), (110.0, 50.0 - 10.0)):
        p = Policy(config(("a", 0.0, 0.5)), 100, 5, 10_000, cap_frame_ms=100.0)
        [g] = grants(p.request("a", now=60.0))
        assert g.quota_ms == pytest.approx(50.0)
        p.release("a", g.token_seq, now=release_at)
        assert p.status(release_at)["a"].bucket_ms == pytest.approx(left)


def test_caps_adding_up_to_one_keep_the_gpu_busy():
    m = busy_model([("a", 0.0, 0.2), ("b", 0.0, 0.3), ("c", 0.0, 0.5)], until=20_000.0)
    useful = sum(m.share(n, 2000, m.now) for n in "abc")
    assert useful >= 0.985
    # fewer, longer slots: handoffs stay well under one per 10 ms
    assert m.handoffs(2000, m.now) / 18.0 < 100


@st.composite
def _mixes(draw):
    n = draw(st.integers(1, 3))
    groups = []
    for i in range(n):
        cap = draw(st.sampled_from([0.05, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0]))
        floor = draw(st.sampled_from([0.0, 0.0, min(cap, 0.2)]))
        groups.append((chr(97 + i), floor, cap))
    ops = draw(st.lists(st.tuples(st.sampled_from(range(n)), st.sampled_from(["req", "rel", "idle"]),
                                  st.floats(0.1, 60.0)), min_size=5, max_size=80))
    return groups, ops


@pytest.mark.parametrize("frame,turns", [(100.0, False), (0.0, False), (100.0, True)],
                         ids=["frames", "buckets", "frame-turns"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mixes())
def test_no_interval_gets_more_than_its_cap_plus_the_bucket(frame, turns, mix):
    """The cap's guarantee, for any mix of requests and early releases: over any interval of length T a group
    holds the GPU at most MaxUtil x T + its burst (`cap_burst_ms`): a continuous bucket's depth (25 ms), or with
    frames 2 x MaxUtil x (1 - MaxUtil) x the group's frame (at most 50 ms, at 0.5)."""
    groups, ops = mix
    p = Policy(config(*groups), 100.0, 5.0, 10_000.0, cap_frame_ms=frame, frame_turns=turns)
    now = 0.0
    held: dict[str, list[tuple[float, float]]] = {g[0]: [] for g in groups}
    seq_of: dict[str, int] = {}

    def apply(decisions):
        for d in decisions:
            if isinstance(d, GrantDecision):
                seq_of[d.group] = d.token_seq
            elif isinstance(d, SlotEndDecision):
                held[d.group].append((d.start_ms, d.end_ms))

    def advance(to):
        nonlocal now
        while True:
            w = p.next_wakeup(now)
            if w is None or w > to:
                break
            now = max(now, w)
            apply(p.tick(now))
        now = to

    for idx, op, dt in ops:
        name = groups[idx][0]
        advance(now + dt)
        if op == "req":
            apply(p.request(name, now=now))
        elif op == "rel" and name in seq_of:
            apply(p.release(name, seq_of[name], now=now))
    advance(now + 500.0)
    apply(p.stop(now))
    for name, _, cap in groups:
        if cap >= 1.0:
            continue
        spans = sorted(held[name])
        points = sorted({s for s, _ in spans} | {e for _, e in spans})
        for t0 in points:
            for length in (10.0, 50.0, 200.0, 1000.0):
                got = sum(max(0.0, min(e, t0 + length) - max(s, t0)) for s, e in spans)
                assert got <= cap * length + p.cap_burst_ms(name) + 1e-6, (name, t0, length, got)


# --- tenants that come late, come and go, or report oddly ---------------------------------------------------------

def test_a_late_starter_gets_its_share_within_a_second_and_the_other_never_overshoots():
    groups = [("a", 0.0, 0.3), ("b", 0.0, 0.6)]
    m = Model(groups, {"a": Busy(), "b": Busy(start_ms=3000.0)}).run(12_000.0)
    assert max(m.window_shares("a", 1000.0, 100.0, 0.0)) <= 0.3 + DEFAULT_BUCKET_MS / 1000 + 0.002
    assert worst(m.window_shares("b", 1000.0, 100.0, 4000.0), 0.6) <= W1


def test_a_group_that_comes_back_does_not_bank_its_idle_time():
    """Uncapped a and b with equal floors; b leaves for 3 s and comes back: it gets its half again, not a run
    that pays back the time it was away."""
    m = Model([("a", 0.0, 1.0), ("b", 0.0, 1.0)],
              {"a": Busy(), "b": Busy(stop_ms=4000.0)}).run(4000.0)
    m.tenants["b"].kind = Busy()
    m.push(7000.0, "want", "b")
    m.run(14_000.0)
    assert m.share("a", 4500.0, 7000.0) >= 0.97
    for t in range(8000, 14_000, 1000):
        assert m.share("b", t, t + 1000) <= 0.62, t


@pytest.mark.parametrize("used_factor", [0.1, 3.0])
def test_misreported_use_moves_a_share_by_at_most_the_credit(used_factor):
    """A client that reports using far less (or more) than its slot: the charge shrinks by at most the credit
    (2 ms a slot), and never grows."""
    p = Policy(config(("a", 0.0, 0.3)), 100.0, 5.0, 10_000.0)
    now, charged, held = 0.0, 0.0, 0.0
    ds = p.request("a", now=now)
    for _ in range(300):
        g = grants(ds)[0]
        now = g.start_ms + g.quota_ms
        held += g.quota_ms
        ds = p.request("a", now=now, used_ms=g.quota_ms * used_factor)
        while not grants(ds):
            w = p.next_wakeup(now)
            now = w
            ds = p.tick(now)
        charged = now
    share = held / charged
    # the first slot is a full bucket; after that a slot is charged at least (1 - 15%) of its length
    assert share <= 0.3 / 0.85 + DEFAULT_BUCKET_MS / charged
    if used_factor > 1:
        assert share <= 0.3 + DEFAULT_BUCKET_MS / charged


def test_measured_use_is_compared_without_the_overlaps_the_charges_split():
    """A busy holder's hooks measure from its slot's first kernel to the end of its drain, so the measurement holds
    the whole overrun, of which its charge holds only half; the next holder's start event runs while that drain
    runs (the GPU time-slices the two), so its measurement holds the overlap too. Half of each overlap comes off a
    measurement before it is compared with the charge. Compared whole, a busy spin tenant's measurement was
    above its charge and none of its idle gaps was forgiven (1.5-2 pp under its cap on the simulated driver)."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0, continuation=False)
    p.request("a", now=0.0)
    p.request("b", now=1.0)
    [gb] = grants(p.tick(20.0))
    # A drained 3 ms past its deadline, time-sliced with B's first kernels; its hooks measured 19 ms: 17.5 of its
    # own (charged) and the 3 ms drain, half of which was B's
    p.request("a", overuse_ms=3.0, now=23.5, used_ms=19.0)
    assert p.usage("a", 23.5) == pytest.approx(17.5)               # wall 21.5; the whole measurement: 19
    p.tick(40.0)
    # B's measurement (19 ms) began while A drained: 1.5 ms of it was A's
    p.request("b", now=41.0, used_ms=19.0)
    assert p.usage("b", 41.0) == pytest.approx(17.5)               # wall 18.5; the whole measurement: 18.5
    # a measurement below the credit is still charged the slot less the credit (3 ms of 20), overlaps or not
    p2 = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0, continuation=False)
    p2.request("a", now=0.0)
    p2.request("b", now=1.0)
    p2.tick(20.0)
    p2.request("a", overuse_ms=3.0, now=23.5, used_ms=1.0)
    assert p2.usage("a", 23.5) == pytest.approx(17.0)


def test_an_overlap_reported_after_the_next_slot_ended_still_comes_off_its_measurement():
    """B's slot ended and was charged by its measurement before A's overrun into it was reported: B's charge is
    settled again with half of the overlap off its measurement (and A's the same way)."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0, continuation=False)
    [ga] = grants(p.request("a", now=0.0))
    p.request("b", now=1.0)
    [gb] = grants(p.tick(20.0))
    p.release("b", gb.token_seq, now=40.0, used_ms=19.0)          # charged 19 (nothing known of A's overrun)
    assert p.usage("b", 40.0) == pytest.approx(19.0)
    p.release("a", ga.token_seq, overuse_ms=3.0, now=41.0, used_ms=19.0)
    assert p.usage("b", 41.0) == pytest.approx(17.5)               # 19 - 3 / 2 (was 18.5: only the wall's half)
    assert p.usage("a", 41.0) == pytest.approx(17.5)               # 19 - 3 / 2 (was 19)


def test_an_overrun_into_the_next_slot_is_split_between_the_two():
    """A's work ran 3 ms into B's slot, time-sliced with B's first kernels: each is charged half of those 3 ms,
    and the charges add up to the wall time (the hooks' measurements are not needed for it)."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0, continuation=False)
    [ga] = grants(p.request("a", now=0.0))
    p.request("b", now=1.0)
    [gb] = grants(p.tick(20.0))
    p.request("a", overuse_ms=3.0, now=23.5)                       # A drained 3 ms past its deadline
    ends(p.tick(40.0))
    assert p.usage("a", 40.0) == pytest.approx(21.5) and p.usage("b", 40.0) == pytest.approx(18.5)
    # reported after B's slot ended: B is credited then
    p2 = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0, continuation=False)
    p2.request("a", now=0.0)
    p2.request("b", now=1.0)
    p2.tick(20.0)
    p2.tick(40.0)
    p2.release("a", ga.token_seq, overuse_ms=3.0, now=41.0)
    assert p2.usage("a", 41.0) == pytest.approx(21.5) and p2.usage("b", 41.0) == pytest.approx(18.5)


# --- continuations ------------------------------------------------------------------------------------------------

def test_a_lone_holder_is_continued_without_a_handoff():
    p = Policy(config(("a", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    ds = p.tick(g.quota_ms - 1.0)        # the lead point
    [c] = grants(ds)
    [e] = ends(ds)
    assert c.continuation and c.prev_seq == g.token_seq and c.start_ms == 50.0
    assert e.reason == "continued" and e.end_ms == 50.0
    assert p.holder == "a" and p.holder_deadline == 100.0


def test_a_holder_is_not_continued_past_a_group_that_is_behind():
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    assert p.request("b", now=1.0) == []
    assert grants(p.tick(49.0)) == []                 # b waits and is behind: no continuation
    [gb] = grants(p.tick(50.0))
    assert gb.group == "b" and not gb.continuation


def test_a_release_before_the_continuation_starts_voids_it():
    p = Policy(config(("a", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    [c] = grants(p.tick(49.0))
    ds = p.release("a", g.token_seq, now=49.5)        # the hooks went idle before they saw it
    assert p.holder is None
    assert [(e.token_seq, e.end_ms) for e in ends(ds)] == [(c.token_seq, 50.0)]
    assert p.history()[-1][2] == 49.5                 # the continued slot really ended at the release
    assert c.token_seq not in [seq for *_, seq in p.history()]   # the continuation never ran


def test_a_request_before_the_continuation_starts_voids_it_and_is_answered():
    """The holder's pod manager asks for its next slot in the lead time, crossing the continuation on the wire: it
    ignores a continuation while its request is out, so gem-schd must void the continuation and answer the request
    with a grant of its own. Kept, the continuation was continued again at every deadline (the holder won against
    its own request), and the request waited out the pod manager's 300 s token timeout (a CI hang in
    test_faults.py::test_sigkill_of_a_pod_manager)."""
    p = Policy(config(("a", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    [c] = grants(p.tick(49.0))
    assert c.continuation
    ds = p.request("a", now=49.5)
    [fresh] = grants(ds)
    assert not fresh.continuation and fresh.start_ms == 49.5 and fresh.token_seq > c.token_seq
    assert [(e.token_seq, e.end_ms, e.reason) for e in ends(ds)] == [(c.token_seq, 50.0, "release")]
    assert p.history()[-2][1:3] == (0.0, 49.5)        # the continued slot really ended at the request
    assert c.token_seq not in [seq for *_, seq in p.history()]   # the continuation never ran
    assert p.holder == "a" and p.holder_seq == fresh.token_seq and not p.waiting()


def test_a_release_naming_the_continuation_before_it_starts_ends_the_slot_it_continues():
    """The pod manager took the continuation up (its token is the new seq) and its hooks went idle in the lead
    time: the release names the continuation. As for a release naming the old slot, that slot ends at the
    release and takes the measured use. Before: it stayed charged to its deadline while b was granted at once, and
    the measured use went to the zero-length continuation."""
    got = {}
    for which in ("old", "new"):
        p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)))
        [g] = grants(p.request("a", now=0.0))
        [c] = grants(p.tick(g.quota_ms - 2.0))
        p.request("b", now=98.1)
        ds = p.release("a", g.token_seq if which == "old" else c.token_seq, now=98.5, used_ms=90.0)
        assert [d.group for d in grants(ds)] == ["b"]
        slots = {seq: (start, end) for grp, start, end, seq in p.history() if grp == "a"}
        got[which] = (slots, p.usage("a", 200.0))
    assert got["new"] == got["old"]
    assert got["new"][0] == {1: (0.0, 98.5)}


def test_a_release_of_the_continued_slot_that_arrives_after_the_continuation_began_ends_it():
    """The pod manager gave slot 1 back just before its deadline, before the continuation reached it (it ignores
    it then); the release arrives just after the continuation began. Its group is idle: the continuation ends at
    the release, and b, waiting, is granted. Before: the continuation ran its whole 100 ms for nobody."""
    p = Policy(config(("a", 0.7, 1.0), ("b", 0.0, 1.0)))
    [g] = grants(p.request("a", now=0.0))
    [c] = grants(p.tick(98.0))
    p.request("b", now=99.0)
    p.tick(100.0)
    assert p.holder == "a" and p.holder_seq == c.token_seq
    ds = p.release("a", g.token_seq, now=100.1)
    assert [(e.token_seq, e.end_ms, e.reason) for e in ends(ds)] == [(c.token_seq, 100.1, "release")]
    assert [d.group for d in grants(ds)] == ["b"]


def test_a_release_naming_seq_0_does_not_end_a_fresh_slot():
    """Seqs start at 1, so a release naming 0 names no slot (a pod manager that never held one, or a bad one). A
    fresh slot's prev_seq is 0 too, and the branch for the slot a continuation continued took the release for it:
    the group's fresh slot ended, and b was granted over it."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)))
    [g] = grants(p.request("a", now=0.0))
    assert not g.continuation and g.prev_seq == 0
    p.request("b", now=1.0)
    ds = p.release("a", 0, now=2.0)
    assert not ends(ds) and not grants(ds)
    assert p.holder == "a" and p.holder_seq == g.token_seq


def test_status_shows_the_holder_while_its_continued_slot_runs_out():
    """In the lead time the running slot's continuation is decided (the policy's holder is the continuation, not
    begun): status still says the group holds the GPU (gem-ctl, gemini_token_holder)."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)))
    grants(p.request("a", now=0.0))
    [c] = grants(p.tick(98.0))
    assert c.continuation
    assert p.status(99.0)["a"].holding and p.status(101.0)["a"].holding


@pytest.mark.parametrize("cfg", [(("lat", 0.0, 1.0, "latency"), ("b", 0.0, 1.0)),
                                 (("lat", 0.1, 0.1, "latency"), ("b", 0.0, 1.0))], ids=["min-util-0", "cap-empty"])
def test_a_latency_group_that_cannot_claim_yet_sets_no_timer_before_it_can(cfg):
    """A latency group without the right to claim wakes gem-schd's timer when it could get the right back: both
    its claim budget half full and its cap's bucket above empty. Waking at the budget alone, the timer fired at
    once, for nothing, again and again: for good with MinUtil 0 (such a group never claims, and its budget is
    always full: an idle daemon spun a core), until the cap refilled with the cap's bucket empty."""
    p = Policy(config(*cfg))
    now = 40.0
    if cfg[0][1] > 0:
        p.request("b", now=0.0)
        p.claimed("lat", 10.0, 30.0, now=30.0, used_ms=20.0)
        p.claimed("lat", 30.0, 40.0, now=40.0, used_ms=10.0)     # its cap's bucket (25 ms at 0.1) is spent
        assert not p.claim_right("lat").allowed
    for _ in range(3 if cfg[0][1] == 0 else 8):    # (the cap's frames refill at their boundaries: more wakes)
        if cfg[0][1] > 0 and p.claim_right("lat").allowed:
            break
        w = p.next_wakeup(now)
        assert w is None or w > now, f"next_wakeup({now}) = {w}: the timer fires at once"
        if w is not None and math.isfinite(w):
            assert not any(isinstance(d, ClaimRightDecision) for d in p.tick(w - 0.01))
            now = w
        p.tick(now)
    if cfg[0][1] > 0:
        assert p.claim_right("lat").allowed         # woken when the right came back, and given it


def test_a_group_back_from_idle_is_charged_its_overuse_at_its_weight_as_an_active_group():
    """A group that asks after more than active_ms idle reports the overuse of its last slot: charged at the
    weight of an inactive group (1e-3), 4 ms of it added 4 s to its virtual time, 1.5 s more than its busy
    neighbour's, which then had the GPU for that long."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 20.0, 5.0, 10_000.0)
    [ga] = grants(p.request("a", now=0.0))
    p.release("a", ga.token_seq, now=10.0)
    [gb] = grants(p.request("b", now=30.0))          # (a's overrun ran into idle time: charged whole)
    t = 30.0 + gb.quota_ms
    for _ in range(100):                      # b alone and busy for 2 s: a is idle past active_ms (500 ms)
        p.tick(t - 1.0)
        p.tick(t)
        t += 20.0
    p.request("a", overuse_ms=4.0, now=t - 10.0)
    va, vb = p._groups["a"].vtime, p._groups["b"].vtime
    assert va - vb <= 4.0 / 0.5 + 1e-6, (va, vb)      # caught up with b, then its 4 ms at the weight of one of two


def test_a_holder_asking_again_late_in_a_long_slot_keeps_its_place():
    """A unified group's slot can last seconds (its quota_floor), longer than active_ms: when its pod manager asks
    again 900 ms into it, the holder has been active all along, and its virtual time must not catch up with its
    neighbour's as if it came back from idle (that cost u a 46 s lead when the catch-up ran before the slot was
    settled)."""
    p = Policy(config(("u", 1.0, 1.0), ("b", 0.0, 1.0)), 100.0)
    p.quota_floor = {"u": 2000.0}
    p.request("u", now=0.0)
    p.request("b", now=10.0)
    p.tick(1998.0)
    p.tick(2000.0)
    p.request("u", now=2000.0)
    p.release("b", p.holder_seq, now=2050.0)        # u holds a 2 s slot from 2050
    p.request("b", now=2060.0)
    assert p.holder == "u"
    before_u, before_b = p._groups["u"].vtime, p._groups["b"].vtime
    assert before_b - before_u > 10_000.0
    p.request("u", now=2950.0)                      # its clients went idle and came back, 900 ms in
    # settled (900 of its 2000 ms) and granted its next slot: 4000 - 1100 + 2000, far below b's (50910 if caught up)
    assert p._groups["u"].vtime == pytest.approx(before_u - 1100.0 + 2000.0), (before_u, p._groups["u"].vtime)


def test_a_voided_continuation_leaves_no_slot_behind_that_an_overrun_could_be_matched_with():
    """A continuation voided before it began never ran. Kept in the finished slots (zero length, at the old
    deadline, after the slots granted since), it was what a later overrun's search for "the next slot" met first:
    b's 2 ms overrun into a's slot was charged to b whole and a was credited nothing, instead of 1 ms each."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    p.request("a", now=0.0)
    p.request("b", now=10.0)
    p.tick(48.0)
    p.tick(50.0)
    p.release("b", p.holder_seq, now=55.0)
    p.request("a", now=55.0)
    p.tick(103.0)                                   # a is continued from 105
    p.request("b", now=103.5)
    [gb] = grants(p.request("a", now=104.0))        # a's request crossed it: void; b is behind and goes first
    assert gb.group == "b"
    p.release("b", gb.token_seq, now=104.5)         # a (waiting) is granted at 104.5
    sa = p.holder_seq
    p.release("a", sa, now=110.0)
    va = p._groups["a"].vtime
    p.request("b", overuse_ms=2.0, now=111.0)       # b's drain ran 2 ms into a's slot
    pa = next(x for x in p._past if x.token_seq == sa)
    assert pa.head_shared == pytest.approx(2.0)
    assert p._groups["a"].vtime - va == pytest.approx(-1.0 / 0.5)   # a credited half the overlap at weight 0.5


def test_a_holder_whose_pod_manager_went_away_is_not_continued():
    p = Policy(config(("a", 0.0, 1.0)), 50.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    p.cancel("a", now=10.0)                       # a new pod manager registered for a
    assert grants(p.tick(49.0)) == []
    assert [e.reason for e in ends(p.tick(50.0))] == ["deadline"]


def test_a_capped_holder_is_continued_only_while_its_bucket_allows():
    p = Policy(config(("a", 0.0, 0.5)), 100.0, 5.0, 10_000.0)
    [g] = grants(p.request("a", now=0.0))
    assert g.quota_ms == pytest.approx(DEFAULT_BUCKET_MS / 0.5)
    assert grants(p.tick(g.quota_ms - 1.0)) == []    # its bucket is empty at the deadline


# --- claims -------------------------------------------------------------------------------------------------------

def test_latency_groups_may_claim_and_claims_are_charged_and_credited():
    p = Policy(config(("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)), 100.0, 5.0, 10_000.0)
    assert p.initial_decisions() == [ClaimRightDecision("inf", True, p.max_claim_ms)]
    [g] = grants(p.request("train", now=0.0))
    p.claimed("inf", 10.0, 14.0, now=15.0)
    ds = p.release("train", g.token_seq, now=40.0)
    [e] = ends(ds)
    status = p.status(40.0)
    assert status["inf"].claims == 1 and status["inf"].claim_ms == pytest.approx(4.0)
    # train held 40 ms but 4 of them were inf's claim: its usage is 36 ms, inf's 4
    assert p.usage("train", 40.0) == pytest.approx(36.0)
    assert p.usage("inf", 40.0) == pytest.approx(4.0)
    assert e.end_ms == 40.0


def test_a_claim_is_charged_what_its_hooks_used_and_the_holder_is_credited_the_span():
    """A request's CPU-bound gaps are not GPU time: the claimer's budget pays for what its hooks measured (but
    at least a quarter of the span); the paused holder is credited the whole span."""
    p = Policy(config(("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)), 100.0, 5.0, 10_000.0)
    [g] = grants(p.request("train", now=0.0))
    p.claimed("inf", 10.0, 18.0, now=19.0, used_ms=3.0)
    p.claimed("inf", 20.0, 28.0, now=29.0, used_ms=0.5)        # under-reported: a quarter of 8 ms
    p.release("train", g.token_seq, now=40.0)
    assert p.status(40.0)["inf"].claim_ms == pytest.approx(3.0 + 2.0)
    assert p.usage("train", 40.0) == pytest.approx(40.0 - 16.0)


def test_an_early_claims_launches_ahead_are_charged_but_credit_no_one():
    """An early claim's hooks launched before the claim reached the board: what they measured then is charged to
    the claimer (its use may exceed the span by that much), but the holder, who was not paused then, is credited
    only the span. More than 5 ms ahead is not believed."""
    p = Policy(config(("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)), 100.0, 5.0, 10_000.0)
    [g] = grants(p.request("train", now=0.0))
    p.claimed("inf", 10.0, 12.0, now=13.0, used_ms=2.3, ahead_ms=0.4)
    p.claimed("inf", 20.0, 22.0, now=23.0, used_ms=50.0, ahead_ms=1000.0)   # used at most span + 5 ms
    p.release("train", g.token_seq, now=40.0)
    assert p.status(40.0)["inf"].claim_ms == pytest.approx(2.3 + 7.0)
    assert p.usage("train", 40.0) == pytest.approx(40.0 - 4.0)
    # a capped claimer's bucket pays the larger of its charge and the span: never less than it was charged
    q = Policy(config(("inf", 0.2, 0.5, "latency")), 100.0, 5.0, 10_000.0)
    before = q._groups["inf"].bucket.at(10.0)
    q.claimed("inf", 8.0, 10.0, now=10.0, used_ms=2.3, ahead_ms=0.4)
    assert before - q._groups["inf"].bucket.at(10.0) == pytest.approx(2.3)


def test_a_claim_after_the_slot_ended_still_credits_it():
    p = Policy(config(("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)), 100.0, 5.0, 10_000.0)
    [g] = grants(p.request("train", now=0.0))
    p.release("train", g.token_seq, now=20.0)
    p.claimed("inf", 15.0, 18.0, now=25.0)        # reported late
    assert p.usage("train", 25.0) == pytest.approx(17.0)


def test_the_claim_budget_is_the_min_util_and_comes_back_half_full():
    p = Policy(config(("inf", 0.1, 1.0, "latency")), 100.0, 5.0, 10_000.0, claim_burst_ms=20.0)
    now, rights = 0.0, []
    while now < 1000.0:
        rights += [d for d in p.claimed("inf", now, now + 10.0, now + 10.0) if isinstance(d, ClaimRightDecision)]
        now += 10.0
        if rights:
            break
    assert rights == [ClaimRightDecision("inf", False, p.max_claim_ms)]
    assert now <= 40.0           # a 20 ms budget plus 0.1 of the elapsed time
    wake = p.next_wakeup(now)
    assert wake == pytest.approx(now + (10.0 - p._groups["inf"].claim_bucket.at(now)) / 0.1)
    assert p.tick(wake - 1.0) == []
    assert p.tick(wake) == [ClaimRightDecision("inf", True, p.max_claim_ms)]


def test_claims_count_against_the_cap():
    p = Policy(config(("inf", 0.5, 0.2, "latency")), 100.0, 5.0, 10_000.0) if False else None
    # MinUtil above MaxUtil is refused by the config; use a cap above the floor
    p = Policy(config(("inf", 0.2, 0.3, "latency")), 100.0, 5.0, 10_000.0, claim_burst_ms=200.0)
    decisions = []
    now = 0.0
    for _ in range(10):
        decisions += p.claimed("inf", now, now + 5.0, now + 5.0)
        now += 5.0
    assert ClaimRightDecision("inf", False, p.max_claim_ms) in decisions   # the cap's bucket ran out first


def test_a_claimer_that_under_reports_its_use_stays_within_its_cap():
    """Claims are charged to the claim budget by the GPU time the hooks report (at least a quarter of the span),
    but to the cap by their whole span: a tenant that reports 1 us per 20 ms claim claimed 0.83 of the time at
    MaxUtil 0.3 when the cap, too, was charged what it reported."""
    p = Policy(config(("inf", 0.2, 0.3, "latency")), 100.0, 5.0, 10_000.0)
    now, allowed, claimed = 0.0, True, 0.0
    while now < 10_000.0:
        if allowed:
            ds = p.claimed("inf", now, now + 20.0, now + 20.0, used_ms=0.001)
            claimed += 20.0
            now += 20.0
        else:
            now = max(now + 1.0, p.next_wakeup(now))
            ds = p.tick(now)
        for d in ds:
            if isinstance(d, ClaimRightDecision):
                allowed = d.allowed
    assert claimed <= 0.3 * now + DEFAULT_BUCKET_MS + 2 * p.max_claim_ms, claimed / now


def test_claims_are_bounded_to_their_maximum_and_never_in_the_future():
    p = Policy(config(("inf", 0.5, 1.0, "latency")), 100.0, 5.0, 10_000.0)
    p.claimed("inf", -1e9, 1e9, now=100.0)
    assert p.status(100.0)["inf"].claim_ms <= p.max_claim_ms + 5.0


def test_a_batch_group_cannot_claim():
    p = Policy(config(("a", 0.5, 1.0)), 100.0, 5.0, 10_000.0)
    assert p.claim_right("a") is None and p.initial_decisions() == []


def test_inference_requests_stay_fast_next_to_a_trainer_with_claims():
    """On the model: a latency group serving 1.2 ms requests every 20 ms next to a busy trainer waits at most
    about the trainer's queued work, where without claims it waits for the trainer's slots to end."""
    groups = [("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)]
    m = Model(groups, {"inf": Requests(1.2, 20.0), "train": Busy()}).run(10_000.0)
    lat = m.tenants["inf"].latencies
    assert len(lat) > 400
    assert percentile(lat, 0.99) <= 1.2 + 0.1 + 1.0 + 0.3      # work + claim round trip + trainer's queue + switch
    assert m.share("train", 1000, m.now) >= 0.85
    batch = [("inf", 0.5, 1.0), ("train", 0.0, 1.0)]
    m2 = Model(batch, {"inf": Requests(1.2, 20.0), "train": Busy()}).run(10_000.0)
    assert percentile(m2.tenants["inf"].latencies, 0.99) > 10.0


# --- the API ------------------------------------------------------------------------------------------------------

def test_unknown_group_gets_an_explicit_error():
    p = Policy(config(("a", 0, 1)), 100, 5, 1000)
    [r] = p.request("zz", now=0.0)
    assert isinstance(r, RefuseDecision) and r.code == ERR_UNKNOWN_GROUP and "'zz'" in r.message


def test_removed_group_finishes_its_slot_and_its_waiting_request_is_refused():
    p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
    [g] = grants(p.request("a", now=0.0))
    p.request("b", now=1.0)
    ds = p.apply_config(config(("a", 0, 1)), now=2.0)
    assert [d.group for d in ds if isinstance(d, RefuseDecision)] == ["b"]
    assert p.holder == "a"
    ds = p.apply_config(config(("b", 0, 1)), now=3.0)       # a removed while it holds: it may still release
    assert p.holder == "a"
    assert ends(p.release("a", g.token_seq, now=4.0))[0].end_ms == 4.0


def test_a_slot_of_a_group_removed_and_added_again_is_not_continued():
    """A reload removed the holder's group and a later one added it back: whoever speaks for it now (gem-schd
    forgot the old pod manager at the removal) was never granted the running slot and ignores a continuation of it;
    so the slot runs to its deadline, as a removed group's does, and a request is answered with a fresh grant.
    Before, the slot was continued for nobody, another whole slot with the GPU idle."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
    [g] = grants(p.request("a", now=0.0))
    p.apply_config(config(("b", 0, 1)), now=10.0)
    p.apply_config(config(("a", 0, 1), ("b", 0, 1)), now=20.0)
    ds, now = [], 30.0
    for _ in range(3):
        wake = p.next_wakeup(now)
        if wake is None:
            break
        ds, now = ds + p.tick(wake), wake
    assert not [d for d in grants(ds) if d.continuation]
    assert [(e.token_seq, e.end_ms, e.reason) for e in ends(ds)] == [(g.token_seq, g.quota_ms, "deadline")]
    [f] = grants(p.request("a", now=g.quota_ms + 1))     # its pod manager's own request: a fresh grant
    assert not f.continuation


def test_a_group_removed_while_it_holds_and_added_back_is_the_same_group_again():
    """a is removed while it holds the GPU and added back before its slot ends; its new pod manager asks later, as
    does b whenever its slot runs out. The group added back is the one removed (its virtual time kept), so the two
    take turns. Before, a fresh group (virtual time 0) took the running slot's settling by name and skipped the
    catch-up to b's virtual time: a held the GPU for seven slots in a row while b waited (an independent review)."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
    now = 0.0
    p.request("b", now=now)
    while now < 1000:                               # b alone for a second: its virtual time runs ahead
        now = p.next_wakeup(now)
        p.tick(now)
    p.request("a", now=1000.0)                      # a catches up, and is granted next
    while p.holder != "a":
        now = p.next_wakeup(now)
        p.tick(now)
    p.request("b", now=1205.0)
    p.apply_config(config(("b", 0, 1)), now=1210.0)
    p.apply_config(config(("a", 0, 1), ("b", 0, 1)), now=1220.0)
    held: list[str] = []
    asked, now = False, 1220.0
    while now < 2600:
        wake = p.next_wakeup(now)
        if not asked and (wake is None or wake > 1398.0):
            ds, now, asked = p.request("a", now=1398.0), 1398.0, True     # a's new pod manager asks
        else:
            now = wake
            ds = p.tick(now)
            for e in ends(ds):                      # a busy group asks again as its slot runs out
                if e.reason == "deadline" and (e.group == "b" or asked):
                    ds += p.request(e.group, now=now)
        held += [g.group for g in grants(ds) if g.start_ms >= 1400.0]
    run = max(len(r) for r in "".join(held).replace("ab", "a b").replace("ba", "b a").split())
    assert run <= 2 and held.count("a") >= 4 and held.count("b") >= 4, held


@pytest.mark.parametrize("how", ["removed", "cancelled"])
def test_a_continuation_whose_group_goes_before_it_begins_is_voided(how):
    """a is continued at its lead point; before the continuation begins a reload removes a, or its pod manager goes
    (cancel: a sweep of a silent one, nobody to ask again). Nobody will run the continuation: it ends at its start,
    zero long, and b, waiting, goes when a's slot runs out -- not before, since a runs to it. Before, b waited a
    whole slot more while the GPU idled (an independent review's fuzzing of reloads)."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
    [g] = grants(p.request("a", now=0.0))
    [c] = grants(p.tick(98.0))
    assert c.continuation and c.start_ms == 100.0
    ds = p.apply_config(config(("b", 0, 1)), 99.0) if how == "removed" else p.cancel("a", 99.0)
    assert [(e.token_seq, e.start_ms, e.end_ms) for e in ends(ds)] == [(c.token_seq, 100.0, 100.0)]
    assert not grants(p.request("b", now=99.5))         # a's slot still runs
    assert p.next_wakeup(99.5) == pytest.approx(100.0)
    [b] = grants(p.tick(100.0))
    assert (b.group, b.start_ms, b.continuation) == ("b", 100.0, False)


def test_a_group_the_floors_crowded_out_gets_its_share_once_a_floor_leaves():
    """a (MinUtil 0.7) and c (0.3) take the whole GPU, so b's target is 0; b gets one slot on the first tie, charged
    at the least weight (1e-3): 100 s of virtual time. a stops at 3 s: b and c are owed half each, and b must get
    its half soon. Before, the debt kept b off the GPU until 51 s, c holding 525 slots in a row (an independent
    review's fuzzing)."""
    p = Policy(config(("a", 0.7, 1), ("b", 0, 1), ("c", 0.3, 1)), 100, 5, 1000)
    held = []

    def answer(ds, now, busy):
        held.extend((g.group, g.start_ms) for g in grants(ds))
        for e in ends(ds):          # a busy group asks again as its slot runs out
            if e.reason == "deadline" and e.group in busy:
                answer(p.request(e.group, now=now), now, busy)
    for name in "abc":
        answer(p.request(name, now=0.0), 0.0, "abc")
    now = 0.0
    while now < 10_000:
        now = p.next_wakeup(now)
        answer(p.tick(now), now, "abc" if now < 3000 else "bc")
    assert [t for g, t in held if g == "b" and t < 3000] == [100.0]      # the one slot on the first tie
    b_after = [t for g, t in held if g == "b" and t >= 3000]
    assert b_after and b_after[0] < 5000, b_after
    c_after = [t for g, t in held if g == "c" and t >= 5000]
    assert abs(len([t for t in b_after if t >= 5000]) - len(c_after)) <= 2, (b_after, c_after)


def _busy_until(p, start, until, busy):
    """Every group in busy(now) asks again as its slot runs out, from `start` to `until`: the grants' (group, ms)."""
    held: list[tuple[str, float]] = []

    def answer(ds, now):
        held.extend((g.group, g.quota_ms) for g in grants(ds))
        for e in ends(ds):
            if e.reason == "deadline" and e.group in busy(now):
                answer(p.request(e.group, now=now), now)
    for name in busy(start):
        answer(p.request(name, now=start), start)
    now = start
    while now < until:
        now = p.next_wakeup(now)
        answer(p.tick(now), now)
    return held


def test_a_crowded_out_holder_is_brought_back_only_after_its_slot_is_settled():
    """b (target 0: a's and c's floors add up to 1) holds a slot reserved at weight 1e-3 when a leaves; a decision
    in its slot must not bring its virtual time back yet: the slot's end undoes the reservation at the grant's
    weight, and b's release 38 ms early came back as 38 s of credit: b held the GPU 10 s while c waited (an
    independent review). After the slot, b and c share the GPU."""
    p = Policy(config(("a", 0.7, 1), ("b", 0, 1), ("c", 0.3, 1)), 100, 5, 1000)
    p.request("a", now=0.0)
    p.release("a", 1, now=50.0)                     # a last used the GPU at 50: inactive from 550
    p.request("c", now=98.0)
    for t in (196.0, 296.0, 396.0):
        p.tick(t)
    p.request("b", now=430.0)
    [g] = grants(p.tick(496.0) + p.tick(498.0))
    assert (g.group, g.start_ms) == ("b", 498.0)     # reserved while a still counted: weight 1e-3
    p.others_grantable(555.0)                       # (gem-schd asks after every event: the targets move on)
    p.request("c", now=556.0)
    p.release("b", g.token_seq, now=560.0)
    held = _busy_until(p, 560.0, 10_560.0, lambda now: "bc")
    b, c = (sum(ms for name, ms in held if name == n) for n in "bc")
    assert abs(b - c) <= 0.1 * (b + c), (b, c)


def test_a_crowded_out_group_idle_meanwhile_gets_its_share_when_it_comes_back():
    """As above, but b stops after its slot on the first tie and asks again at 4 s, after a left at 3 s: the debt
    run up at weight 1e-3 must not come back with it (a group back from idle was only ever caught up, never brought
    down: b got nothing until 30 s, an independent review)."""
    p = Policy(config(("a", 0.7, 1), ("b", 0, 1), ("c", 0.3, 1)), 100, 5, 1000)
    held = _busy_until(p, 0.0, 4000.0, lambda now: ("a" if now < 3000 else "") + "c" + ("b" if now == 0 else ""))
    assert [name for name, _ in held].count("b") == 1
    held += _busy_until(p, 4000.0, 9000.0, lambda now: "bc")
    late = held[-40:]
    assert abs(sum(1 for name, _ in late if name == "b") - sum(1 for name, _ in late if name == "c")) <= 4, late


def test_a_group_whose_target_was_0_a_while_keeps_what_it_owes():
    """a floor group that asks and goes puts a's and b's targets at 0 a while; a, charged nothing at that weight (its
    2 s slot, a unified group's floor, was reserved at weight 1), owes its slot as before: b runs about a second
    before a goes again. The catch-up of a crowded-out group (_uncrowd) brought a back to 0.2 s (a review)."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1), ("f", 1.0, 1)), 100, 5, 10_000)
    p.quota_floor["a"] = 2000.0
    [g] = grants(p.request("a", now=0.0))
    assert g.quota_ms == 2000.0
    p.request("b", now=1.0)
    p.request("f", now=100.0)
    p.cancel("f", 101.0)                            # f inactive from 600: a and b at 0.5 again
    p.tick(700.0)
    held = []

    def answer(ds, now):
        held.extend((d.group, d.start_ms, d.quota_ms) for d in grants(ds))
        for e in ends(ds):
            if e.reason == "deadline":
                answer(p.request(e.group, now=now), now)
    now = 1998.0
    answer(p.tick(now), now)
    while now < 4000:
        now = p.next_wakeup(now)
        answer(p.tick(now), now)
    first_a = next(i for i, (n, start, _) in enumerate(held) if n == "a" and start > 2000)
    assert sum(q for n, _, q in held[:first_a] if n == "b") >= 900, held


def test_a_late_starter_beside_a_light_group_does_not_take_the_busy_groups_share():
    """A light group (2 ms every 50 ms) stays active while using far less than its share, so its virtual time fell
    behind the busy group's without bound; c, starting at 60 s, caught up only to the least active virtual time,
    the light group's, and had 0.96 of the GPU over its first 10 s against a's 0.01 (0.80 / 0.17 starting at 10 s;
    an independent review's fuzzing). A group granted far behind the next waiting one keeps at most two slots of
    credit: c and a share the GPU from the start."""
    m = Model([("a", 0, 1), ("l", 0, 1), ("c", 0, 1)],
              {"a": Busy(), "l": Requests(2.0, 50.0), "c": Busy(start_ms=60_000.0)}).run(72_000.0)
    a, c = m.share("a", 61_000.0, 71_000.0), m.share("c", 61_000.0, 71_000.0)
    assert abs(a - c) < 0.1, (a, c)


def test_a_group_added_beside_a_light_one_does_not_keep_the_gpu_by_continuations():
    """A reload adds c (MinUtil 0.6) beside a busy b and a light latency group L: c starts at the least virtual time
    of the active groups, L's, far behind b's. c's first grant came while b's next request was on its way, so the
    bound on its lag (_bound_lag) saw nobody behind it, and its continuations, decided without that bound, kept the
    GPU for the whole 6 s while b waited (a fuzzer's seed 5042 in the thirty-third session). Now a continuation is
    bounded too: c's first run is a few slots."""
    first = [("b", 0.5, 1), ("L", 0.2, 1, "latency")]
    second = [("b", 0, 1), ("c", 0.6, 1), ("L", 0.2, 1, "latency")]
    m = Model(first, {"b": Busy(), "L": Requests(1.5, 20.0, poisson=True)}, seed=1).run(9000.0)
    m.apply(m.policy.apply_config(config(*second), 9000.0), 9000.0)
    m.tenants["c"] = _Tenant("c", Busy())
    m.push(9001.0, "want", "c")
    m.run(15_000.0)
    runs: list[list] = []
    for g, s, e in m.gpu:
        if s >= 9000.0 and g != "L":
            if runs and runs[-1][0] == g and s - runs[-1][2] < 5.0:
                runs[-1][2] = e
            else:
                runs.append([g, s, e])
    assert max(e - s for g, s, e in runs if g == "c") <= 1000.0, runs[:4]
    assert m.share("b", 11_000.0, 15_000.0) >= 0.18


def test_a_release_in_the_gap_after_a_voided_continuation_hands_over_at_once():
    """a's continuation is voided before it begins (its pod manager went); then a's slot is released (the seq of the
    slot or of the voided continuation): the slot ends there and b, waiting, goes at once, as at any release before
    a continuation begins. Before, b waited for a's deadline and a was charged for the time it gave back."""
    for named in (1, 2):
        p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
        [g] = grants(p.request("a", now=0.0))
        [c] = grants(p.tick(98.0))
        p.cancel("a", 98.5)
        assert not grants(p.request("b", now=98.6))
        [b] = grants(p.release("a", (g.token_seq, c.token_seq)[named - 1], now=98.7))
        assert (b.group, b.start_ms) == ("b", 98.7)
        assert p.usage("a", 98.7) == pytest.approx(98.7)


def test_a_group_removed_and_added_back_in_the_gap_after_its_voided_continuation_is_the_same_group():
    """The reload that removes a voids its continuation; a's slot still runs to the continuation's start, and a
    reload in that gap that adds a back gives back the same group (its usage, virtual time and bucket), as while
    any of its slots runs. Before, a fresh group (nothing used, a full bucket) took its place."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1)), 100, 5, 1000)
    grants(p.request("a", now=0.0))
    [c] = grants(p.tick(98.0))
    assert c.continuation
    used = p.usage("a", 98.5)
    p.apply_config(config(("b", 0, 1)), 98.5)       # voids the continuation: a's slot runs on to 100
    p.apply_config(config(("a", 0, 1), ("b", 0, 1)), 99.0)
    assert used > 90 and p.usage("a", 99.0) >= used


def test_reload_keeps_buckets_and_applies_new_caps_from_the_next_decision():
    p = Policy(config(("a", 0, 0.5)), 100, 5, 10_000, cap_frame_ms=0)
    [g] = grants(p.request("a", now=0.0))
    assert g.quota_ms == pytest.approx(DEFAULT_BUCKET_MS / 0.5)
    p.apply_config(config(("a", 0, 0.8)), now=1.0)
    ds = p.request("a", now=g.quota_ms)
    if not grants(ds):
        ds = p.tick(p.next_wakeup(g.quota_ms))
    [g2] = grants(ds)
    # the bucket went on from where it was (the slot reserved from a full bucket), refilling at 0.5
    # for 1 ms, then at 0.8; the slot empties it at the new rate
    level = DEFAULT_BUCKET_MS - g.quota_ms + 0.5 * 1.0 + 0.8 * (g.quota_ms - 1.0)
    assert g2.quota_ms == pytest.approx(level / (1 - 0.8))


def test_reload_keeps_a_frames_budget_and_applies_the_new_cap_from_the_next_frame():
    p = Policy(config(("a", 0, 0.5)), 100, 5, 10_000, cap_frame_ms=100.0)
    [g] = grants(p.request("a", now=0.0))
    assert g.quota_ms == pytest.approx(50.0)        # the frame's quota: 0.5 x 100 ms
    p.apply_config(config(("a", 0, 0.2)), now=1.0)
    assert p.status(1.0)["a"].bucket_ms <= 0.0      # what it had reserved stays spent
    ds = p.request("a", now=g.quota_ms)
    assert not grants(ds)                           # nothing left in this frame
    wake = p.next_wakeup(g.quota_ms)
    assert wake == pytest.approx(100.0)             # the next frame
    [g2] = grants(p.tick(wake))
    assert g2.quota_ms == pytest.approx(20.0)       # at the new cap: 0.2 x 100 ms


def test_bad_parameters_are_refused():
    for kw in ({"base_quota_ms": 0}, {"min_quota_ms": -1}, {"window_ms": math.nan}, {"bucket_ms": 0}):
        with pytest.raises(ValueError):
            Policy(config(("a", 0, 1)), **kw)


def test_time_never_runs_backwards_and_bad_time_is_refused():
    p = Policy(config(("a", 0, 1)), 100, 5, 1000)
    p.request("a", now=10.0)
    p.tick(5.0)
    assert p.status(1.0)["a"].holding
    with pytest.raises(ValueError):
        p.tick(math.inf)


def test_cancel_drops_the_waiting_request_and_a_resent_one_keeps_its_place():
    p = Policy(config(("a", 0, 1), ("b", 0, 1), ("c", 0, 1)), 100, 5, 1000)
    p.request("a", now=0.0)
    p.request("b", now=1.0)
    p.request("c", now=2.0)
    p.request("b", now=3.0)                  # re-sent
    p.cancel("c", now=4.0)
    assert p.waiting() == ["b"]
    assert p.status(4.0)["b"].wait_ms == pytest.approx(3.0)


def test_status_reports_shares_targets_and_claims():
    p = Policy(config(("a", 0.7, 1), ("b", 0, 1)), 100, 5, 1000)
    [g] = grants(p.request("a", now=0.0))
    p.request("b", now=0.0)
    s = p.status(50.0)
    assert s["a"].holding and s["b"].waiting and s["a"].grants == 1
    assert s["a"].share == pytest.approx(1.0) and s["a"].target == pytest.approx(0.7)
    assert s["b"].target == pytest.approx(0.3) and s["a"].bucket_ms == math.inf


def test_history_is_pruned_to_the_window():
    p = Policy(config(("a", 0, 1)), 10, 5, 1000)
    now = 0.0
    for _ in range(300):
        [g] = grants(p.request("a", now=now)) or [None]
        now += 5.0
        if g is not None:
            p.release("a", g.token_seq, now=now)
        now += 5.0
    assert all(start >= now - 1000 - 10 for _, start, _, _ in p.history())


def test_diff_configs_sees_class_and_memory_mode():
    old = parse_config("[a]\n[b]\nClass = latency\n")
    new = parse_config("[a]\nMemoryMode = unified\n[b]\n[c]\n")
    d = diff_configs(old, new)
    assert d.added == ("c",) and d.changed == ("a", "b") and d.removed == ()


def test_a_decision_at_64_groups_is_cheap():
    groups = [(f"g{i}", 0.0, 0.5 if i % 2 else 1.0) for i in range(64)]
    p = Policy(config(*groups), 20.0, 5.0, 10_000.0)
    now = 0.0
    asks: dict[str, float] = {name: 0.0 for name, _, _ in groups}      # every group is always busy
    t0 = time.perf_counter()
    n = 0
    while n < 500:
        w = p.next_wakeup(now)
        t_ask = min(asks.values(), default=math.inf)
        now = max(now, min(w if w is not None else math.inf, t_ask))
        if t_ask <= now:
            name = min(asks, key=asks.__getitem__)
            del asks[name]
            ds = p.request(name, now=now)
        else:
            ds = p.tick(now)
        for d in ds:
            if isinstance(d, GrantDecision):
                n += 1
                asks[d.group] = d.start_ms + d.quota_ms + 0.5     # asks again after its slot
    per = (time.perf_counter() - t0) / n
    assert per < 0.002, per     # generous for a loaded CI machine; bench/bench_scale.py measures it properly


def test_a_long_slot_released_early_is_settled_at_the_weight_of_its_grant():
    """A slot longer than active_ms (a unified group's slot floor is seconds long) ends early by release: its
    unused reservation is refunded at the weight it was reserved with. Settled at the weight of the release, the
    holder no longer counted as active (weight 1e-3): a's virtual time fell by millions of ms and it won every
    choice after."""
    p = Policy(config(("a", 0.0, 1.0), ("b", 0.0, 1.0), ("c", 0.0, 1.0)), base_quota_ms=100.0)
    p.quota_floor = {"a": 20_000.0, "b": 20_000.0, "c": 20_000.0}
    [g] = grants(p.request("a", now=0.0))
    p.request("b", now=0.0)
    p.request("c", now=0.0)
    [gb] = grants(p.release("a", g.token_seq, now=930.0))
    assert gb.group == "b"
    # a used 930 ms; the slot is settled at the weight of its grant (1: a was alone then)
    assert p._groups["a"].vtime == pytest.approx(930.0)
    assert p.request("a", now=1000.0) == []           # a asks again while b holds
    [gc] = grants(p.release("b", gb.token_seq, now=1860.0))
    assert gc.group == "c"                # c has waited longest and not run: it goes before a runs again
    st = p.status(1860.0)
    assert st["a"].grants == 1 and st["c"].grants == 1


def test_a_refund_after_the_groups_target_fell_to_0_goes_back_at_the_weight_of_its_slot():
    """A finished slot's charge is shrunk by what its hooks measured (here 4 ms: the credit) after the group's target
    fell to 0 (a floor of 1 came): refunded at the weight of now (1e-3), those 4 ms were 4 s of virtual time, a
    credit no slot of its had earned. Now they go back at the weight the slot was charged at."""
    p = Policy(config(("a", 0.0, 1.0), ("c", 1.0, 1.0)), 100.0, 5.0, 10_000.0)
    [ga] = grants(p.request("a", now=0.0))
    p.release("a", ga.token_seq, now=50.0)          # 50 ms at weight 1 (alone)
    before = p._groups["a"].vtime
    assert grants(p.request("c", now=51.0))         # c's floor of 1: a's target is 0
    assert p._weight("a", 52.0) == pytest.approx(MIN_WEIGHT)
    assert not grants(p.request("a", now=52.0, used_ms=40.0))     # measured 40 of its 50: 4 ms back (the credit)
    assert before - p._groups["a"].vtime == pytest.approx(4.0)


def test_a_refund_after_a_crowded_out_groups_debt_was_forgiven_is_no_thousandfold_credit():
    """a is charged a slot at the least weight (c's floor of 1 crowds it out); a reload lifts the floor, and its
    virtual time is brought back beside c's (_uncrowd). Then its hooks' measurement shrinks that slot's charge:
    refunded at the weight the slot was charged at (1e-3), the 15 ms were 15 s of credit on a debt already forgiven
    (an independent review of the refunds at a slot's weight; in the model a 1 ms claim's overlap let a busy group
    hold the GPU 300 ms). A refund goes back at the greater of the slot's weight and the weight of now."""
    p = Policy(config(("a", 0, 1), ("c", 1, 1)), 100.0, 5.0, 10_000.0)
    [gc] = grants(p.request("c", now=0.0))
    p.request("a", now=1.0)
    [ga] = grants(p.release("c", gc.token_seq, now=50.0))       # a's slot at the least weight
    assert ga.group == "a"
    p.request("c", now=60.0)
    p.release("a", ga.token_seq, now=150.0)
    p.apply_config(config(("a", 0, 1), ("c", 0, 1)), 151.0)     # the floor gone: a's debt forgiven
    p.request("a", now=152.0, used_ms=85.0)                     # 15 ms of the slot measured as not a's
    assert p._groups["c"].vtime - p._groups["a"].vtime <= 100.0


def test_a_refund_after_a_forgiven_debt_and_a_new_floor_is_no_thousandfold_credit():
    """As above, but the floor comes back before the refund: a's target is 0 again, and the slot was charged at
    the least weight too, so the greater of the two was still 1e-3 (a second review)."""
    p = Policy(config(("a", 0, 1), ("c", 1, 1)), 100.0, 5.0, 10_000.0)
    [gc] = grants(p.request("c", now=0.0))
    p.request("a", now=1.0)
    [ga] = grants(p.release("c", gc.token_seq, now=50.0))
    p.request("c", now=60.0)
    p.release("a", ga.token_seq, now=150.0)
    p.apply_config(config(("a", 0, 1), ("c", 0, 1)), 151.0)
    p.tick(151.5)                                               # a's debt forgiven
    p.apply_config(config(("a", 0, 1), ("c", 1, 1)), 152.0)
    p.tick(152.5)                                               # a's target 0 again
    p.request("a", now=153.0, used_ms=85.0)
    assert p._groups["c"].vtime - p._groups["a"].vtime <= 100.0


def test_others_grantable_says_whether_releasing_now_would_let_another_group_run():
    """What gem-schd publishes on the board (groups_waiting): a waiting group other than the holder whose cap
    and swap pacing allow a slot now. Not the holder itself, not a capped group whose bucket is empty, not one
    paced by residency (not_before), and nothing while nobody waits."""
    p = Policy(config(("a", 0, 1), ("b", 0, 1), ("c", 0, 0.1)), base_quota_ms=100)
    assert [d.group for d in grants(p.request("a", now=0.0))] == ["a"]
    assert not p.others_grantable(1.0)                      # only the holder
    p.request("c", now=2.0)                                 # capped at 0.1, its bucket full: it could run
    assert p.others_grantable(2.0)
    seq = p.holder_seq
    p.release("a", seq, now=3.0)                            # c runs its bucket empty, then a holds again
    p.request("a", now=3.5)
    assert p.holder == "c"
    p.release("c", p.holder_seq, now=40.0, used_ms=37.0)
    assert p.holder == "a"
    p.request("c", now=41.0)
    assert not p.others_grantable(41.0)                     # c waits, but its bucket does not allow a slot
    p.not_before = {"b": 1000.0}
    p.request("b", now=42.0)
    assert not p.others_grantable(42.0)                     # b is paced until 1000 ms
    p.not_before = {}
    assert p.others_grantable(43.0)


def test_an_early_claims_time_ahead_under_a_flare_is_credited_to_the_holder():
    """With the group's flare up, the holder was held from the early claim's first launch: that part of the time
    ahead (held_ahead_ms, never more than ahead_ms) is credited to it as the span is."""
    p = Policy(config(("inf", 0.5, 1.0, "latency"), ("train", 0.0, 1.0)), 100.0, 5.0, 10_000.0)
    [g] = grants(p.request("train", now=0.0))
    p.claimed("inf", 10.0, 12.0, now=13.0, used_ms=2.3, ahead_ms=0.4, held_ahead_ms=0.4)
    p.claimed("inf", 20.0, 22.0, now=23.0, used_ms=2.3, ahead_ms=0.4, held_ahead_ms=9.0)   # at most ahead_ms
    p.release("train", g.token_seq, now=40.0)
    assert p.usage("train", 40.0) == pytest.approx(40.0 - 2 * 2.4)


def test_caps_under_a_useful_quota_per_frame_and_aligned_groups_keep_the_bucket():
    """A frame's quota under 20 ms (MaxUtil < 0.2) would make slots that lose much of themselves to the handoff and
    the drain (a deep-queued group capped at 0.05 got 0.031-0.042 of an H100 with frames, 0.050 with the bucket), so
    such a cap keeps the 25 ms bucket, as does an aligned group; with `--frame 0` every cap has one."""
    cfg = parse_config("[small]\nMaxUtil = 0.1\n[framed]\nMaxUtil = 0.2\n[aligned]\nMaxUtil = 0.3\nSlots = aligned\n"
                       "[free]\nMaxUtil = 1.0\n")
    p = Policy(cfg)
    assert p.cap_burst_ms("small") == DEFAULT_BUCKET_MS == p.cap_burst_ms("aligned")
    assert p.cap_burst_ms("framed") == pytest.approx(2 * 20.0 * 0.8 + min(0.25 * 20.0, 8.0))
    assert p.cap_burst_ms("free") == math.inf
    off = Policy(cfg, cap_frame_ms=0)
    assert off.cap_burst_ms("framed") == DEFAULT_BUCKET_MS


def test_a_frames_boundary_on_the_hosts_clock_never_makes_the_timer_fire_for_nothing():
    """gem-schd's origin is the host's clock (about 1e9 ms): a division's rounding put a time up to a microsecond
    before a boundary in the next frame, where a parked group could be granted but was not unparked, and
    next_wakeup returned that time again and again (found by an independent review's fuzzing)."""
    p = Policy(config(("a", 0.0, 0.3)), 100, 5, 10_000, clock_origin_ms=987654321.987, cap_frame_ms=100.0)
    [g] = grants(p.request("a", now=0.0))
    p.release("a", g.token_seq, now=27.0)          # 3 ms left of its 30: not worth a slot, even as a rest
    assert not grants(p.request("a", now=27.0))
    b = p._groups["a"].bucket.next_boundary(27.0)
    for now in (b - 3e-8, b - 1e-9, b):
        w = p.next_wakeup(now)
        ds = p.tick(now)
        assert grants(ds) or (w is not None and w > now), (now, w, ds)


def test_a_continuation_across_a_frames_boundary_is_charged_after_the_boundarys_refill():
    """A continuation decided before the boundary, starting at it: charged before the refill, the refill's ceiling
    (the quota and the carry) did not hold, and a lone group capped at 0.5 held 90 ms of a 100 ms frame."""
    p = Policy(config(("a", 0.0, 0.5)), 30, 5, 10_000, cap_frame_ms=100.0)
    [g] = grants(p.request("a", now=70.0))              # 30 ms to the boundary: 20 left of the frame
    [c] = grants(p.tick(98.0))
    assert c.continuation and c.start_ms == pytest.approx(100.0) and c.quota_ms == pytest.approx(30.0)
    assert p.status(100.0)["a"].bucket_ms == pytest.approx(min(50.0 + 8.0, 20.0 + 50.0) - 30.0)
    m = Model([("a", 0.0, 0.5)], {"a": Busy()}, base_quota_ms=30.0, cap_frame_ms=100.0).run(10_000)
    assert m.share("a", 2000, m.now) <= 0.5 + 0.005


def test_a_voided_continuation_gives_back_the_rest_of_the_frame_its_slot_gave_up():
    """The slot was to run 1 ms past the boundary (its frame's rest beyond what it could use before it given up);
    its continuation decided, it released before the boundary after all: the rest comes back, as without
    continuations."""
    levels = []
    for cont in (True, False):
        p = Policy(config(("a", 0.0, 0.5)), 100, 5, 10_000, cap_frame_ms=100.0, continuation=cont)
        [g] = grants(p.request("a", now=51.0))
        p.tick(99.0)
        p.release("a", g.token_seq, now=99.5)
        levels.append(p.status(100.0)["a"].bucket_ms)
    assert levels[0] == pytest.approx(levels[1])


def test_a_framed_group_cut_short_gets_the_rest_of_its_frame_rather_than_the_gpu_idling():
    """b (MaxUtil 0.6: 60 ms a 100 ms frame) gives the GPU back 40 ms into its slot (its process stalled) and asks
    again at once while a (0.3) runs its 30 ms. b's 20 ms left are less than a good part of its quota (_theta:
    30 ms), so while a runs b waits; when a's slot ends nobody else can run, and b gets its 20 ms then, not the
    GPU idle to the boundary (on an H100: 22 ms idle, 1.3 points off b's worst 1 s window). The next frame
    begins as before."""
    p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p.request("b", now=0.0))
    assert gb.quota_ms == pytest.approx(60.0)
    assert grants(p.request("a", now=1.0)) == []
    [ga] = grants(p.release("b", gb.token_seq, now=40.0))
    assert ga.group == "a" and ga.quota_ms == pytest.approx(30.0)
    assert grants(p.request("b", now=41.0)) == []       # a runs: b waits for it
    # a is behind b in the order (10 of its 30 ms run, b 40 of 60): its hooks are not told to give the GPU back
    assert not p.others_grantable(50.0)
    [rest] = grants(p.tick(70.0))
    assert rest.group == "b" and rest.quota_ms == pytest.approx(20.0, abs=0.5)
    assert grants(p.release("b", rest.token_seq, now=90.0)) == []
    assert p.status(90.0)["b"].bucket_ms == pytest.approx(0.0, abs=0.5)


def test_a_framed_groups_rest_ends_at_the_boundary():
    """As above, but b asks again only at 92, with 20 ms of its frame left and 8 ms to the boundary: its rest runs
    those 8 ms, not 20 of which 12 are paid from the next frame. Paid from there, b's next turn fell short, the GPU
    ran out of budgets before that frame's end and gave another group a rest across the next boundary: with caps
    adding up to 1 and 200 ms frames (gem-schd --frame 200 -q 200) the slots kept that rotation for 3.5 s on the
    simulated driver, 7-10 points off the worst 1 s window."""
    p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p.request("b", now=0.0))
    p.request("a", now=1.0)
    [ga] = grants(p.release("b", gb.token_seq, now=40.0))
    assert ga.group == "a"
    assert grants(p.release("a", ga.token_seq, now=70.0)) == []
    [rest] = grants(p.request("b", now=92.0))
    assert rest.group == "b" and rest.quota_ms == pytest.approx(8.0), rest
    assert grants(p.release("b", rest.token_seq, now=100.0)) == []
    assert p.status(100.5)["b"].bucket_ms >= 60.0 - 1e-6    # the next frame's quota, whole (and its carry)
    # a rest shorter than a useful slot is not granted: the GPU idles to the boundary
    p2 = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p2.request("b", now=0.0))
    p2.release("b", gb.token_seq, now=40.0)
    assert grants(p2.request("b", now=97.0)) == []
    [nxt] = grants(p2.tick(100.0))
    assert nxt.group == "b" and nxt.quota_ms >= 60.0 - 1e-6


def test_framed_groups_that_are_all_there_is_take_turns_though_their_caps_leave_the_frame_idle():
    """0.3 / 0.6: b runs first in the frame, a second, and the GPU idles to the boundary. a's hooks measured 27 of
    its 30 ms, so its virtual time is now behind b's; by virtual time a would go first in the next frame and the
    two slots swap places (a slot more of a in a 1 s window). b asked first, so b keeps its place."""
    p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p.request("b", now=0.0))
    p.request("a", now=1.0)
    [ga] = grants(p.release("b", gb.token_seq, now=60.0, used_ms=60.0))
    assert ga.group == "a"
    assert grants(p.request("b", now=60.5)) == []
    assert grants(p.release("a", ga.token_seq, now=90.0, used_ms=27.0)) == []
    assert grants(p.request("a", now=90.5)) == []
    [nxt] = grants(p.tick(100.0))
    assert nxt.group == "b", nxt


@pytest.mark.parametrize("third, turns", [(None, True), (("z", 0.0, 0.0), True), (("c", 0.0, 1.0), False)],
                         ids=["alone", "beside-a-paused-group", "beside-an-uncapped-group"])
def test_which_framed_groups_take_turns_when_their_caps_leave_the_frame_idle(third, turns):
    """Framed groups at their caps take turns where they are all the active groups that take anything (a paused
    group, MaxUtil 0, asking does not count); an uncapped group among them keeps the order by virtual time; so does
    a latency group among them (its slots follow its requests)."""
    groups = [("a", 0.0, 0.3), ("b", 0.0, 0.6)] + ([third] if third else [])
    p = Policy(config(*groups), 100, 5, 10_000, cap_frame_ms=100.0)
    for i, g in enumerate(groups):
        p.request(g[0], now=float(i))
    p._current_targets(5.0)
    assert p._turns_apply == turns
    lat = Policy(config(("a", 0.3, 0.3, "latency"), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    lat.request("a", now=0.0)
    lat.request("b", now=1.0)
    lat._current_targets(5.0)
    assert not lat._turns_apply


def test_a_framed_groups_rest_does_not_go_ahead_of_a_group_that_can_run():
    """The same, with an uncapped c waiting too: c runs (the GPU has work), and b waits for its frame's boundary
    with a good part of its quota, as before: fewer, longer slots."""
    p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6), ("c", 0.0, 1.0)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p.request("b", now=0.0))
    p.request("a", now=1.0)
    [g1] = grants(p.release("b", gb.token_seq, now=40.0))
    p.request("b", now=41.0)
    p.request("c", now=42.0)
    assert g1.group == "a"
    [g2] = grants(p.tick(70.0))
    assert g2.group == "c", g2


def test_a_holder_is_told_to_give_the_gpu_back_for_a_rest_only_when_the_rest_comes_first_in_the_order():
    """a (MinUtil 0.7, uncapped) holds; b (MaxUtil 0.6) waits with 20 ms of its frame left, above its share. a's
    hooks give the GPU back at their burst's end when gem-schd says another group could go; told so for b's rest,
    a handed its slot to b and waited out the rest (an independent review: 0.4 / 0.6 instead of 0.5 / 0.5 against
    a's floor of 0.7). b's rest goes first only when b is behind a in virtual time."""
    p = Policy(config(("a", 0.7, 1.0), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
    [gb] = grants(p.request("b", now=0.0))
    p.request("a", now=1.0)
    [ga] = grants(p.release("b", gb.token_seq, now=40.0))
    assert ga.group == "a"
    p.request("b", now=41.0)
    assert not p.others_grantable(50.0)
    # the other way round: b holds, a (uncapped, below its floor) waits: told, as before
    p2 = Policy(config(("a", 0.0, 0.3), ("b", 0.7, 1.0)), 100, 5, 10_000, cap_frame_ms=100.0)
    [g1] = grants(p2.request("a", now=0.0))
    p2.request("b", now=1.0)
    [g2] = grants(p2.release("a", g1.token_seq, now=10.0))      # a stalled: 20 ms of its frame left
    assert g2.group == "b"
    p2.request("a", now=11.0)
    assert p2.others_grantable(12.0)       # a ran 10 ms at 0.3, b 2 ms: a's rest would go first


def test_a_rest_held_back_by_swap_pacing_is_granted_when_the_pacing_ends():
    """b waits with a rest of 20 ms; gem-schd paces b's grant (a unified group's swap) until 75, after a's slot
    ends at 70. Nothing else happens: the timer wakes at 75 and b gets its rest, whether or not gem-schd asked
    others_grantable in between (which dropped the rest, and the GPU idled to the boundary)."""
    for query in (False, True):
        p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
        [gb] = grants(p.request("b", now=0.0))
        p.request("a", now=1.0)
        p.release("b", gb.token_seq, now=40.0)
        p.request("b", now=41.0)
        p.tick(68.0)
        p.not_before = {"b": 75.0}
        if query:
            p.others_grantable(68.5)
        assert grants(p.tick(70.0)) == []
        assert p.next_wakeup(70.0) == pytest.approx(75.0)
        [g] = grants(p.tick(75.0))
        assert g.group == "b" and g.quota_ms == pytest.approx(20.0, abs=0.5), (query, g)


def test_a_rest_that_a_frames_refill_leaves_a_group_in_debt_is_woken_for():
    """b (0.6) used its 60 ms and asks again just before the boundary reporting 39 ms of overuse: the refill at 100
    leaves it 21 ms, less than half its quota. On the idle GPU it gets them at the boundary, not at the next one
    (the GPU idle 100 ms), whichever side of the boundary its request landed."""
    for ask_at in (99.0, 100.5):
        p = Policy(config(("b", 0.0, 0.6)), 100, 5, 10_000, cap_frame_ms=100.0)
        grants(p.request("b", now=0.0))
        p.tick(60.0)
        got = grants(p.request("b", overuse_ms=39.0, now=ask_at))
        if not got:
            w = p.next_wakeup(ask_at)
            assert w is not None and w <= 100.0 + 1e-6, w
            got = grants(p.tick(100.0))
        [g] = got
        assert g.group == "b" and g.quota_ms == pytest.approx(21.0, abs=0.5), (ask_at, g)


def _worst_1s_any_phase(m, name, cap, start=2000.0):
    """The worst sliding 1 s window (stepped by 100 ms) at four phases against the frames: a window aligned with
    them holds whole frames whatever the slots' order in each, which hid the reshuffling from the tests above."""
    return max(abs(x - cap) for off in (0.0, 25.0, 50.0, 75.0) for x in m.window_shares(name, 1000, 100, start + off))


@pytest.mark.parametrize("caps", [(0.2, 0.3, 0.5), (0.4, 0.6), (0.25, 0.25, 0.5)])
def test_with_frame_turns_caps_adding_up_to_one_hold_over_every_second_whatever_its_phase(caps):
    """Caps adding up to 1: the slots fill the frames, and by virtual time (which the charges' noise moves a
    little) the groups' order in the frames reshuffled, so that a 1 s window not aligned with the frames held a
    slot more or fewer of a group (here 2.1-5.0 points without --frame-turns; on H100s 4-6). Taking turns in the
    order they asked, the slots keep their places: 0.42 points at most, at no cost in useful time and 0-9% more
    handoffs. (The last group in the frame pays what the frame's slots run over it: 0.4 points under its cap here,
    where without turns each group was 0.1-0.2 under.)"""
    groups = [(f"g{i}", 0.0, c) for i, c in enumerate(caps)]
    runs = {turns: busy_model(groups, until=20_000.0, frame_turns=turns) for turns in (False, True)}
    m = runs[True]
    for name, _, cap in groups:
        assert _worst_1s_any_phase(m, name, cap) <= 0.01, (name, _worst_1s_any_phase(m, name, cap))
        assert m.share(name, 2000, m.now) == pytest.approx(cap, abs=0.006), name
    assert m.handoffs(2000, m.now) <= runs[False].handoffs(2000, m.now) * 1.1 + 5
    assert sum(m.share(n, 2000, m.now) for n, _, _ in groups) >= 0.99


@pytest.mark.parametrize("caps", [(0.2, 0.3, 0.5), (0.4, 0.6)])
def test_with_frame_turns_what_the_frame_lacks_is_spread_over_the_groups(caps):
    """The slots' wall time adds up to more than the frame (each can run its quota and the carry its measure gave
    back; here each handoff's switch), and uncut the last group in the frame paid it all: 0.4 points under its cap
    here while the others were exact (3-3.5 points on the simulated driver, tests/probe_frame_turns.py). Each
    turn-taker's slot is held to its part of what is left of the frame (_fit_turn), so each pays its own handoffs:
    the shortfalls are within 0.05 points of each other, and no group passes its cap."""
    groups = [(f"g{i}", 0.0, c) for i, c in enumerate(caps)]
    m = busy_model(groups, until=20_000.0, frame_turns=True)
    short = [cap - m.share(name, 2000, m.now) for name, _, cap in groups]
    assert max(short) - min(short) <= 0.0005, short
    assert min(short) >= -0.0005, short
    assert max(short) <= 0.003, short


def test_frame_turns_leave_caps_with_a_continuous_bucket_among_them_to_virtual_time():
    """The soak's caps, 0.1 / 0.2 / 0.3 / 0.4: the 0.1 group's frame quota (10 ms) is too small for a slot, so it
    keeps a continuous bucket and runs 20 ms every other frame. Taking turns, the framed groups were squeezed in the
    frames it ran in and could not carry what they lost to the others: one of them paid, 0.8 points on an H200 and
    1.9 on the simulated driver (twenty-first session); here, where the means hold, the 0.1 group's own slots were
    pushed around by the turns (one slot more or fewer in a 1 s window: 2.0 points, a fifth of its share). Turns
    apply only where the framed groups' own caps add up to 1; here the order is by virtual time."""
    groups = [(f"g{i}", 0.0, c) for i, c in enumerate((0.1, 0.2, 0.3, 0.4))]
    m = busy_model(groups, until=20_000.0, frame_turns=True)
    short = {name: cap - m.share(name, 2000, m.now) for name, _, cap in groups}
    assert max(short.values()) <= 0.0025, short
    assert _worst_1s_any_phase(m, "g0", 0.1) <= 0.005, _worst_1s_any_phase(m, "g0", 0.1)


def test_frame_turns_leave_the_order_by_virtual_time_to_groups_not_held_to_their_caps():
    """The floor's case (MinUtil 0.7 against 0, both uncapped) and a cap beside an uncapped group are as without
    turns: only framed groups whose fair share is their cap take turns."""
    for groups, expect in ((([("a", 0.7, 1.0), ("b", 0.0, 1.0)]), {"a": 0.7, "b": 0.3}),
                           (([("a", 0.0, 0.3), ("b", 0.0, 1.0)]), {"a": 0.3, "b": 0.7})):
        m = busy_model(groups, until=20_000.0, frame_turns=True)
        for name, share in expect.items():
            assert m.share(name, 2000, m.now) == pytest.approx(share, abs=0.015), (groups, name)


def test_with_frame_turns_the_framed_group_that_asked_first_goes_first():
    """At a frame's boundary b (asked at 31) and a (asked at 51, charged a little less: the lower virtual time)
    wait: by virtual time a goes first, taking turns b does."""
    firsts = {}
    for turns in (False, True):
        p = Policy(config(("a", 0.0, 0.2), ("b", 0.0, 0.3), ("c", 0.0, 0.5)), 100, 5, 10_000, cap_frame_ms=100.0,
                   frame_turns=turns)
        [gb] = grants(p.request("b", now=0.0))
        p.request("a", now=1.0)
        p.request("c", now=2.0)
        [ga] = grants(p.tick(30.0))
        assert ga.group == "a"
        p.request("b", now=31.0)
        [gc] = grants(p.release("a", ga.token_seq, 0.0, 50.0, 15.0))   # a measured 15 of its 20 ms
        assert gc.group == "c"
        p.request("a", now=51.0)
        p.tick(98.0)
        [first] = grants(p.tick(100.0))
        firsts[turns] = first.group
    assert firsts == {False: "a", True: "b"}, firsts


def test_with_frame_turns_a_reload_that_removes_a_waiting_group_does_not_break_the_next_decision():
    """Turns read the busy groups held to their caps; after a reload removed one that was waiting (and had asked
    first), a decision picked it and every tick failed on its name (an independent review: 70 of 200 reload times,
    the GPU idle, gem-schd retrying every 10 ms). Three busy groups at 0.3 / 0.3 / 0.4; b removed while it waits.
    (_frame_turn refreshes the targets and looks only at groups in the ready index: with both off, KeyError.)"""
    for k in range(40):
        p = Policy(config(("a", 0.0, 0.3), ("b", 0.0, 0.3), ("c", 0.0, 0.4)), 100, 5, 10_000, frame_turns=True)
        now, reloaded = 0.0, False
        for n in "abc":
            p.request(n, now=now)
        while now < 600.0:
            if not reloaded and now >= 200.0 + 4.3 * k and p.holder not in (None, "b") and "b" in p.waiting():
                p.apply_config(config(("a", 0.0, 0.3), ("c", 0.0, 0.4)), now=now)
                reloaded = True
            w = p.next_wakeup(now)
            assert w is not None
            now = max(now, w)
            out = p.tick(now)
            for d in list(out):
                if isinstance(d, SlotEndDecision) and d.reason != "continued" and (d.group != "b" or not reloaded):
                    out += p.request(d.group, now=now)
        assert reloaded, k


def test_with_frame_turns_a_light_group_keeps_its_place_by_virtual_time():
    """A group that serves requests now and then (5 ms every 20 ms, capped at 0.3) beside busy groups at 0.2 and
    0.5: taking turns by when they asked, the busy ones had always asked first, and its p99 went from 55 to 75 ms
    (an independent review). Turns are only among busy groups (their last slot ran to its deadline)."""
    groups = [("r", 0.0, 0.3), ("a", 0.0, 0.2), ("b", 0.0, 0.5)]
    p99 = {}
    for turns in (False, True):
        behaviour = {"r": Requests(5.0, 20.0), "a": Busy(), "b": Busy()}
        m = Model(groups, behaviour, frame_turns=turns).run(20_000)
        lat = m.tenants["r"].latencies
        p99[turns] = percentile(lat[len(lat) // 10:], 0.99)
    assert p99[True] <= p99[False] * 1.1 + 1.0, p99


def test_with_frame_turns_a_framed_group_with_a_floor_between_capped_ones_does_not_swing():
    """a (MinUtil 0.4, MaxUtil 0.5: its fair share is not its cap, so it is placed by virtual time) between b and
    c capped at 0.3: taking turns among b and c only, the frames fell into a pattern where c's slot crossed the
    boundary each frame, and 1 s windows swung by 8-9.5 points against 3 without turns (an independent review).
    Turns apply only where the caps of the groups held to them add up to 1."""
    groups = [("a", 0.4, 0.5), ("b", 0.0, 0.3), ("c", 0.0, 0.3)]
    worst = {}
    for turns in (False, True):
        m = busy_model(groups, until=20_000.0, frame_turns=turns)
        targets = {"a": 0.4, "b": 0.3, "c": 0.3}
        worst[turns] = max(_worst_1s_any_phase(m, n, targets[n]) for n in targets)
    assert worst[True] <= worst[False] + 0.005, worst


def test_min_frame_quota_decides_which_caps_keep_a_continuous_bucket():
    """gem-schd --min-frame-quota: a cap whose frame's quota is under it keeps a token bucket. At 10 ms the soak's
    0.1 group is framed too, and its caps' frames take turns (in the model every 1 s window of 0.1 / 0.2 / 0.3 / 0.4
    within 0.2 points, against 4.1 for the 0.4 group at the default of 20 ms)."""
    groups = [(f"g{i}", 0.0, c) for i, c in enumerate((0.1, 0.2, 0.3, 0.4))]
    worst = {}
    for mfq in (20.0, 10.0):
        p = Policy(config(*groups), 100, 5, 10_000, min_frame_quota_ms=mfq)
        framed = {n for n in ("g0", "g1") if isinstance(p._groups[n].bucket, _FrameBucket)}
        assert framed == ({"g1"} if mfq == 20.0 else {"g0", "g1"}), (mfq, framed)
        m = busy_model(groups, until=20_000.0, min_frame_quota_ms=mfq)
        worst[mfq] = max(_worst_1s_any_phase(m, n, c) for n, _, c in groups)
    assert worst[10.0] <= 0.002 < 0.02 <= worst[20.0], worst


@pytest.mark.parametrize("caps,kw", [((0.4, 0.6), {"base_quota_ms": 30.0}),
                                     ((0.2, 0.2, 0.6), {"cap_frame_ms": 200.0})])
def test_frame_turns_leave_frames_that_need_two_slots_of_a_group_to_virtual_time(caps, kw):
    """A frame's quota longer than the longest slot (-q) takes a group two slots: taking turns it got them a turn
    apart (a b a b: twice the handoffs, 2.8 points over 1 s windows at 0.4 / 0.6 with -q 30), and with --frame 200
    what the fit withheld came back as rests of the frame that broke the order (3.4 points at 0.2 / 0.2 / 0.6; an
    independent review). Turns apply only where every frame's quota is one slot: here as by virtual time."""
    groups = [(f"g{i}", 0.0, c) for i, c in enumerate(caps)]
    runs = {t: busy_model(groups, until=20_000.0, frame_turns=t, **kw) for t in (False, True)}
    assert runs[True].handoffs(2000, 20_000.0) <= runs[False].handoffs(2000, 20_000.0) * 1.05
    for name, _, cap in groups:
        assert _worst_1s_any_phase(runs[True], name, cap) <= _worst_1s_any_phase(runs[False], name, cap) + 0.002


class _PacedPolicy(Policy):
    """Group c may be granted only 120 ms after its last slot ended, as gem-schd paces a unified group whose grants
    evict another's memory (Policy.not_before, from residency.swap_gate)."""

    def _end_slot(self, now, reason, used_ms=0.0, at=None):
        h = self._holder
        out = super()._end_slot(now, reason, used_ms, at)
        if h is not None and h.group == "c":
            self.not_before["c"] = min(max(now if at is None else at, h.start), h.deadline) + 120.0
        return out


def test_frame_turns_leave_a_swap_paced_group_to_virtual_time():
    """A paced group cannot keep a place in every frame: counted as a turn to come, and cut to the frame's rest when
    it could run, c (cap 0.5) got 0.25 where by virtual time it gets 0.40 (continued across a boundary while its
    pacing allows: an independent review). While a framed group is paced, no turns."""
    groups = [("a", 0.0, 0.2), ("b", 0.0, 0.3), ("c", 0.0, 0.5)]
    shares = {}
    for turns in (False, True):
        p = _PacedPolicy(config(*groups), frame_turns=turns)
        m = Model(groups, {n: Busy() for n, _, _ in groups}, policy=p).run(20_000.0)
        shares[turns] = m.share("c", 2000, m.now)
    assert shares[True] >= shares[False] - 0.005, shares
