"""A decision's cost grows with the groups that changed, not with all of them (issue 14, "Scale").

Counted, not timed, so that a loaded CI machine cannot make it flaky: the lines of the policy's own code
(gemini/scheduler/policy.py) that run per decision, traced with sys.settrace. Every pass over all the groups
-- a list of candidates, a scan for the active set, for a grantable waiter, for the capped groups -- runs a line
per group, so with 2000 groups such a pass shows up a hundred times larger than with 20. The driver is
bench/bench_policy_cost.py's: every group always busy (a quarter capped, a quarter with a floor; or every group
capped, their caps adding up to 0.9, so that most of them wait for their buckets at any moment), a `tick` at
each wakeup and the released holder asking again at once, each followed by `others_grantable`, and then
`next_wakeup` (gem-schd arms its timer after every event).
"""
from __future__ import annotations

import statistics
import sys
from types import FrameType
from typing import Any, Optional

from bench.bench_policy_cost import all_capped, config
from gemini.scheduler import policy as policy_module
from gemini.scheduler.policy import GrantDecision, Policy, SlotEndDecision

POLICY_FILE = policy_module.__file__


class _LineCounter:
    """Counts the lines run in policy.py while installed (sys.settrace; the previous tracer is put back)."""

    def __init__(self) -> None:
        self.lines = 0
        self._previous: Any = None

    def _local(self, frame: FrameType, event: str, arg: Any):
        if event == "line":
            self.lines += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any):
        return self._local if frame.f_code.co_filename == POLICY_FILE else None

    def __enter__(self) -> "_LineCounter":
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._previous)


def lines_per_decision(groups: int, warmup: int = 300, decisions: int = 200, capped: bool = False) -> float:
    """Median lines of policy code per decision (a tick, the released holder's request, others_grantable, the
    next wakeup), after `warmup` untraced decisions."""
    pol = Policy(all_capped(groups) if capped else config(groups))
    now = 0.0
    for g in pol.groups:
        pol.request(g, now=now)
    samples: list[int] = []
    made = 0
    while len(samples) < decisions:
        wake: Optional[float] = pol.next_wakeup(now)
        assert wake is not None, "the policy stalled"
        now = max(now, wake)
        counter = _LineCounter()
        traced = made >= warmup
        if traced:
            counter.__enter__()
        try:
            out = pol.tick(now)
            pol.others_grantable(now)
            for d in list(out):
                if isinstance(d, SlotEndDecision) and d.reason != "continued":
                    out += pol.request(d.group, now=now)
                    pol.others_grantable(now)
            pol.next_wakeup(now)
        finally:
            if traced:
                counter.__exit__()
        if any(isinstance(d, GrantDecision) for d in out):
            made += 1
            if traced:
                samples.append(counter.lines)
    return statistics.median(samples)


def test_a_decisions_work_does_not_grow_with_the_number_of_groups():
    few, many = lines_per_decision(20), lines_per_decision(1000)
    # HEAD before the incremental indexes: ~100x (several passes over every group per decision). Now the same
    # work up to the heap's log n, which runs in C (heapq): the margin is for the paths a decision takes, which
    # differ a little with the mix (a capped group's full bucket ends _before_overflow's walk at once, or not).
    assert many < 2.0 * few, (few, many)


def test_groups_held_back_by_their_caps_are_not_looked_at_each_decision():
    """Every group capped (caps adding up to 0.9): at any moment most wait for their buckets. Each decision used
    to try them all (and others_grantable and next_wakeup too): 96 us per decision at 64 groups on the development
    machine, 333 us at 256 (`bench/bench_policy_cost.py --mix capped`). Now a group found held back is
    parked until its bucket could allow a slot. (The warm-up lets every group spend its first full bucket: until
    then all of them are eligible.) Before: 779 lines per decision at 20 groups, 16416 at 400; now 184 and 203."""
    few = lines_per_decision(20, warmup=3 * 20 + 300, capped=True)
    many = lines_per_decision(400, warmup=3 * 400 + 300, capped=True)
    assert many < 2.0 * few, (few, many)
