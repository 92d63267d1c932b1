"""How much of the GPU a group asks for: the demand that gem-schd's targets leave a light group's unused share by.

A pure estimator (no clock of its own, no I/O): the policy tells it a group's events -- it asked after being idle,
a slot of it ended, it went idle -- with their times, and asks it for the group's demand limit.

Why: the targets (policy.fair_targets) count every active group as wanting its whole fair share. What a light
group leaves unused (an inference service asking 1.5 ms every 20 ms) then went to the busy groups in proportion to
their targets, not evenly: a group with a floor of 0.35 beside an uncapped one and two light groups got 0.549
against 0.338, where the floor first and the rest evenly gives about 0.46 each (docs/architecture.md, "Floors and
fair shares"). With a light group's target limited to its demand in the water-filling, the busy groups' targets
share what it leaves.

The estimate is the fraction of the time a group held the GPU (the GPU time its hooks measured in its slots,
where they report it), decayed over TAU_MS: its use, not what a
prompter service would let it use (a light group made to wait behind a busy one's slot is not told apart from one
that asks for less). That is enough because a limit changes only the others' targets: the limited group's own
weight, and with it its place in the order, stay what its fair share gives (policy.demand_targets). Its limit is
that fraction times MARGIN, rounded up to a LEVEL (powers of 2 ** 0.5 from MIN_LIMIT: so that the targets, which
are recomputed when a limit changes, are not recomputed at every event); a limit rises at once and falls only by
more than one level (following every 0.05 step, a group holding 1.6 ms every 20 ms changed its limit at every
event; with levels 2 ** 0.25 apart a Poisson light group's bursts moved its limit 3.5 times a second: two
independent reviews). A group whose last
BUSY_RUNS slots ran out (it had work to their end), with no pause between them but brief ones, is not limited at
all, whatever its history: a light group that turns busy gives the others their usual targets back within two
slots (a pause shorter than BRIEF_IDLE_MS is a busy group's next request on its way). Pauses alone do not tell: a
light group made to wait behind 100 ms slots finds requests waiting when it is done, and asks again at once; and a
time of running out would not do either: among many busy groups a group's slots are far apart. A pause is
counted from the end of the drain its request reports (overuse: 4-16 ms on an H200), not from its deadline. Nor is
a group limited until it has been seen for TAU_MS / 2 -- from its first event, or from its return after it counted
as inactive if it was not limited then (the policy starts a new estimate for a busy group back from a pause:
counting the pause as low demand, a busy floor group of 0.7 that came back after a second's pause got 0.50 over its
first second back, its limit raising the others' targets until two of its slots had run out; a light group's pause
is what it is, and started afresh, a light group asking every 250-400 ms on average counted as wanting its whole
share half the time: two independent reviews).
"""

from __future__ import annotations

import math
from typing import Optional

TAU_MS = 2000.0         # the estimate's memory: a light group's Poisson bursts average out (two reviews)
MARGIN = 1.25           # a group limited to its demand gets a quarter more than it used: room for it to grow
LEVEL = 2 ** 0.5        # limits are powers of it ...
MIN_LIMIT = 2.0 ** -6   # ... from this one (0.016: a light group among dozens still counts for little)
BUSY_RUNS = 2           # slots run out in a row: busy (one can be a light group's backlog after a long wait)
BRIEF_IDLE_MS = 10.0    # a pause this short is a busy group's next request on its way (policy.REQUEST_ON_ITS_WAY_MS)


class Demand:
    """One group's demand estimate (module docstring). Times in ms, on the policy's clock."""

    __slots__ = ("held", "at", "first", "idle_from", "runs", "use", "limit")

    def __init__(self) -> None:
        self.held = 0.0             # ms held, decayed to `at`
        self.at = -math.inf
        self.first = math.inf       # its first event
        self.idle_from: Optional[float] = None  # asking for nothing since (None: waiting or holding)
        self.runs = 0               # its last slots that ran out, in a row (brief pauses between)
        self.use: Optional[float] = None        # the fraction of the time it held slots (None: busy, or not known)
        self.limit: Optional[float] = None      # the share it is limited to (None: not limited)

    def _decayed(self, now: float) -> float:
        return self.held * math.exp(-(now - self.at) / TAU_MS) if now > self.at else self.held

    def asked(self, now: float, drain_ms: float = 0.0) -> None:
        """The group asks for the GPU with no request waiting and no slot held; `drain_ms`: how long its last slot's
        queued work ran past its end (the overuse its request reports), which is no pause."""
        self.first = min(self.first, now)
        if self.idle_from is not None:
            if now - self.idle_from - max(0.0, drain_ms) >= BRIEF_IDLE_MS:
                self.runs = 0           # a pause ends the run (a brief one: its next request, on its way)
            self.idle_from = None

    def slot_ended(self, start: float, end: float, idle: bool, ran_out: bool, used: float = 0.0) -> None:
        """A slot of the group ran from `start` to `end`; `idle`: it asks for nothing after it (no request
        waiting, no continuation); `ran_out`: it ran to its deadline (the group had work to its end); `used`: the
        GPU time its hooks measured in it (0: not reported), which counts instead of the slot's length when less.
        (A light group's slot lasts its burst and the idle release after it, 2-5 ms: on the simulated driver a group
        serving 1.5 ms every 20 ms held slots a third of the time and was never limited.)"""
        self.first = min(self.first, start)
        self.runs = self.runs + 1 if ran_out else 0
        span = max(0.0, end - start)
        self.held = self._decayed(end) + (min(span, used) if used > 0 else span)
        self.at = max(self.at, end)
        if idle:
            self.idle_from = end

    def went_idle(self, now: float) -> None:
        """Its request was withdrawn (its pod manager went) and it holds nothing."""
        if self.idle_from is None:
            self.idle_from = now

    def update(self, now: float) -> bool:
        """Re-decide the limit at one of the group's events. True if it changed."""
        limit = self._limit(now)
        old = self.limit
        if limit is None or old is None or limit > old or limit < old / LEVEL ** 1.5:
            self.limit = limit
        return self.limit != old

    def _limit(self, now: float) -> Optional[float]:
        self.use = None
        if self.runs >= BUSY_RUNS:
            return None
        seen = now - self.first
        if not seen >= TAU_MS / 2:
            return None
        # the decayed time held over the decayed time elapsed since its first event
        self.use = self._decayed(now) / (TAU_MS * -math.expm1(-seen / TAU_MS))
        raw = MARGIN * self.use
        if raw >= 1.0:
            return None
        level = max(MIN_LIMIT, LEVEL ** math.ceil(math.log(max(raw, 1e-12), LEVEL) - 1e-9))
        return None if level >= 1.0 - 1e-9 else level
