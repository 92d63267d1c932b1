"""The token scheduling policy of gem-schd: pure logic, no I/O, time passed in.

All times are milliseconds (floats) on one monotonic clock chosen by the caller; the policy never reads a clock,
so it can be driven on simulated time in tests and by the daemon on real time.

One group holds the GPU at a time (a *slot*), except that a latency-class group may *claim* it at any moment
within its budget (see below). Three mechanisms decide who gets the next slot and for how long:

* **Caps (MaxUtil) are budgets per frame** (`cap_frame_ms`, 100 ms; `_FrameBucket`). At every frame boundary of the
  host's monotonic clock a capped group's budget is topped up to MaxUtil x the frame (an idle frame is not banked;
  overuse carries over as debt, and a little of a frame's rest passes the boundary: what the hooks' measured use gives
  back after a slot). A slot is granted only when the budget allows a useful one (half the frame's quota) and is the
  frame's rest at most; what it runs past the boundary is paid from the next frame's quota. With nobody else grantable
  (the GPU would idle), a rest of at least min_quota_ms is granted too (`_choose_rest`). So a busy capped group's
  slots repeat every frame, which divides 1 s and 10 s: a window of either holds whole frames, and the group's share
  over it is its cap (with a continuous bucket the cycle of slots is as long as the refill and the handoffs make it,
  and a 1 s window swung by up to the bucket's depth). Over ANY interval of length T a group gets at most MaxUtil x T
  + `cap_burst_ms` (2 x MaxUtil x (1 - MaxUtil) x the frame + the carry). A cap whose frame's quota would be under
  `min_frame_quota_ms` (MIN_FRAME_QUOTA_MS by default), an aligned group, and every cap with `cap_frame_ms=0` have a
  continuous token bucket instead: it fills at MaxUtil ms per ms of wall time up to a depth of `bucket_ms`, a slot is
  trimmed so that it is empty, not negative, when the slot ends, a busy group (its last slot ran out) that is the
  only capped one beside active uncapped groups is granted its next slot only when the bucket is full again (its slots
  repeat with the refill period, bucket_ms / MaxUtil), and over any interval a group gets at most MaxUtil x T +
  bucket_ms. Either is charged what the group really used: the
  slot up to its release, minus the part the hooks measured as not theirs (the handoff at its start, at most
  `max_used_credit_ms`), minus time a latency group claimed the GPU, plus overuse the hooks report. An overrun into
  the next slot is split evenly between the two holders, and half of it comes off each one's measurement too
  (`_measured_charge`).
* **Floors (MinUtil) and fair shares are weighted virtual time.** Each active group (one that is waiting,
  holding, or used the GPU in the last `active_ms`) gets a target share by water-filling: every group gets at
  least its MinUtil and at most its MaxUtil, and what is left is split evenly (this is where Gemini's
  "MinUtil first, then least usage" converges), a light group counting for about 1.25 times what it uses
  (gemini/scheduler/demand.py, demand_targets). Its virtual time advances by its charges divided by that
  target; the waiting group with the least virtual time goes next. So two busy groups with MinUtil 0.7 and 0
  get 0.7 and 0.3, and equal groups alternate. A group that comes back after being idle starts at the least
  virtual time of the others: idle time is not banked.
* **Continuation.** `continue_lead_ms` before a slot's deadline the holder competes with the waiting groups
  for the next slot as if it had asked again. If it wins (nobody else waits, or it is furthest below its
  target), it is granted a continuation that starts at the deadline: its hooks keep launching without draining
  their queue and without a round trip. Without this, a holder whose hooks are still draining at its deadline
  could never be chosen then, and two busy groups alternated 1:1 whatever their floors.

**Latency groups** (Class = latency) are not queued while they have the right to claim: their pod manager
claims
the GPU on the per-GPU board page (batch holders stop launching during a claim) and reports each claim's span
afterwards. The claim budget is a bucket that fills at the group's MinUtil (depth `claim_burst_ms`); when it is
empty the right is taken away (`ClaimRightDecision(allowed=False)`) and the group queues like any other until
the bucket is half full again. Claimed time is charged to the claimer (and to its cap) and credited back to
whichever slot it overlapped.

The sliding window (`window_ms`, opened at the first request) is what gem-schd *reports* (`share`, `status`);
it no longer decides anything.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Union

from gemini.config import Config, GroupConfig
from gemini.scheduler.demand import MARGIN, Demand
from gemini.wire.sched import ERR_UNKNOWN_GROUP, MAX_CLAIM_AHEAD_MS

EPS = 1e-6  # ms; tolerance of eligibility tests against float rounding

DEFAULT_BASE_QUOTA_MS = 100.0
DEFAULT_MIN_QUOTA_MS = 5.0
DEFAULT_WINDOW_MS = 10_000.0
MIN_WEIGHT = 1e-3     # an inactive group's weight, and an active one's whose target is 0 (_weight)
DEFAULT_BUCKET_MS = 25.0
DEFAULT_CAP_FRAME_MS = 100.0  # divides 1 s and 10 s: a window holds whole frames (0: continuous buckets)
MIN_FRAME_QUOTA_MS = 20.0     # a cap whose frame's quota is smaller keeps the continuous bucket (_retune_bucket)
DEFAULT_CLAIM_BURST_MS = 100.0
DEFAULT_MAX_CLAIM_MS = 20.0
DEFAULT_CONTINUE_LEAD_MS = 2.0
MAX_CREDIT_FRACTION = 0.15
CLAIM_MIN_CHARGE = 0.25     # a claim is charged at least this part of its span
# A busy group asks again within its drain and a round trip of its slot's end: how long after it ran out a group not
# asking yet is taken to have its request on its way (_before_overflow)
REQUEST_ON_ITS_WAY_MS = 10.0


# --- decisions --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GrantDecision:
    """Give the token to `group` for `quota_ms` from `start_ms` (now, or a continuation's old deadline)."""
    group: str
    quota_ms: float
    token_seq: int
    start_ms: float = 0.0
    continuation: bool = False      # the holder keeps the GPU: its slot `prev_seq` runs on without a handoff
    prev_seq: int = 0
    wait_ms: float = 0.0            # how long the request waited


@dataclass(frozen=True)
class SlotEndDecision:
    """A slot is over at `end_ms`: released early, at its deadline, continued, or the daemon stops."""
    group: str
    token_seq: int
    quota_ms: float
    start_ms: float
    end_ms: float
    wait_ms: float
    reason: str                     # "release" | "deadline" | "continued" | "stop"


@dataclass(frozen=True)
class RefuseDecision:
    """Answer the group's request (or message) with an error."""
    group: str
    code: str
    message: str


@dataclass(frozen=True)
class ClaimRightDecision:
    """A latency group may (or may no longer) claim the GPU; each claim lasts at most `max_claim_ms`."""
    group: str
    allowed: bool
    max_claim_ms: float


Decision = Union[GrantDecision, SlotEndDecision, RefuseDecision, ClaimRightDecision]


@dataclass(frozen=True)
class ConfigDiff:
    """What a reload changed: groups added, groups whose settings changed, groups removed."""
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.removed)


def _settings(g: GroupConfig) -> tuple:
    return (g.min_util, g.max_util, g.mem_limit, g.turns, g.sched_class, g.memory_mode, g.slots)


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    old_groups = {g.name: g for g in old.groups}
    new_groups = {g.name: g for g in new.groups}
    added = tuple(n for n in new_groups if n not in old_groups)
    removed = tuple(n for n in old_groups if n not in new_groups)
    changed = tuple(n for n, g in new_groups.items()
                    if n in old_groups and _settings(g) != _settings(old_groups[n]))
    return ConfigDiff(added, changed, removed)


@dataclass(frozen=True)
class GroupStatus:
    """What the policy reports about one group (gem-schd status, metrics)."""
    name: str
    min_util: float
    max_util: float
    sched_class: str
    share: float                # of the reporting window
    holding: bool
    waiting: bool
    wait_ms: float
    quota_ms: float             # the last slot granted
    grants: int
    continuations: int
    bucket_ms: float            # cap bucket level (inf when uncapped)
    target: float               # water-filled target share among the active groups (0 if inactive)
    claim_allowed: bool
    claims: int
    claim_ms: float             # claimed GPU time in total


# --- internal state ---------------------------------------------------------------------------------------------

class _Bucket:
    """A token bucket in ms of GPU time: fills at `rate` per ms of wall time up to `depth`."""

    __slots__ = ("rate", "depth", "level", "t")

    def __init__(self, rate: float, depth: float, now: float):
        self.rate, self.depth, self.level, self.t = rate, depth, depth, now

    def at(self, now: float) -> float:
        if now <= self.t:
            return self.level
        return min(self.depth, self.level + self.rate * (now - self.t))

    def advance(self, now: float) -> None:
        if now > self.t:
            self.level = self.at(now)
            self.t = now

    def ceiling(self) -> float:
        """The most the level may be."""
        return self.depth

    def add(self, ms: float, now: float) -> None:
        """Debit (ms > 0 used) or refund (ms < 0) GPU time."""
        self.advance(now)
        self.level = min(self.ceiling(), self.level - ms)

    def time_to_reach(self, level: float, now: float) -> float:
        """When the bucket reaches `level` (now if it has; inf if it never will)."""
        cur = self.at(now)
        if cur >= level - EPS:
            return now
        if self.rate <= 0 or level > self.depth + EPS:
            return math.inf
        return self._when(level, cur, now)

    def _when(self, level: float, cur: float, now: float) -> float:
        """When the level, `cur` at `now`, reaches `level`, which it will."""
        return now + (level - cur) / self.rate


class _FrameBucket(_Bucket):
    """A cap's budget per frame: `depth` = `rate` x `frame` ms of GPU time added at every `frame` ms boundary of the
    host's monotonic clock (`origin` is the clock's value at policy time 0), up to the quota and `carry` (`ceiling`),
    so idle frames are not banked, and debt (overuse) carries over. Refilled on a grid, not continuously: a busy
    capped group's slots then repeat with the frame's period, which divides 1 s, so a 1 s or 10 s window holds whole
    frames (tests/test_policy.py; with a continuous bucket the cycle's length was set by the refill and the handoffs,
    and a 1 s window held a fraction of a cycle too: 1.6-2.6 points of error on the simulated delays, 2.5-3.0 at
    0.3 / 0.6 on an H100, against 0.9-1.3 with frames)."""

    __slots__ = ("frame", "origin", "carry")

    def __init__(self, rate: float, frame: float, origin: float, now: float, carry: float = 0.0):
        super().__init__(rate, rate * frame, now)
        self.frame, self.origin = frame, origin
        # A little may pass a boundary on top of the next frame's quota: what the hooks' measured use gives back
        # after a slot (a millisecond or two), too little for a slot of its own. Lost at the boundary, a group sat
        # that far under its cap; used by a slot that started before the boundary to reach it, it let the group go
        # ahead of the others there, and their order in the frame flipped (on an H100: a worst 1 s window of 3.9
        # points at 0.3 / 0.6).
        self.carry = carry
        self.level = self.depth

    def _start(self, i: int) -> float:
        return i * self.frame - self.origin

    def _index(self, t: float) -> int:
        """The frame `t` is in: the one whose start (`_start`) is the last at or before `t`. Computed from the
        starts themselves, so that the two agree to the last bit: with the host's clock as the origin (about 1e9 ms)
        a division's rounding put `t` in the next frame up to a microsecond before the boundary `next_boundary`
        gave, a parked group could be granted there but was not unparked, and gem-schd's timer fired at once, for
        nothing, until the clock passed it (forever on a fixed simulated time)."""
        i = math.floor((t + self.origin) / self.frame)
        if self._start(i + 1) <= t:
            i += 1
        elif self._start(i) > t:
            i -= 1
        return i

    def next_boundary(self, now: float) -> float:
        """The first frame boundary after `now` (always later than `now`)."""
        return self._start(self._index(now) + 1)

    def at(self, now: float) -> float:
        if now <= self.t:
            return self.level
        k = self._index(now) - self._index(self.t)
        return min(self.ceiling(), self.level + k * self.depth) if k > 0 else self.level

    def ceiling(self) -> float:
        return self.depth + self.carry

    def _when(self, level: float, cur: float, now: float) -> float:
        """At a frame boundary."""
        k = max(1, math.ceil((level - cur) / self.depth - 1e-9))
        return self.next_boundary(now) + (k - 1) * self.frame

    def room(self, at: float) -> float:
        """The longest slot that may start at `at`: what is left of the frame. A slot may run past the boundary; what
        it runs there is paid from the next frame's quota (`forfeit`). Running on through the next frame's quota as
        well, one slot across the boundary (up to the rest of the frame and a whole quota), made slots of twice the
        quota at irregular places, after which every group had spent its budget and the GPU idled to the boundary:
        with caps adding up to 1, 3-6 points under the caps in tests/policy_sim.py, and 7.7-9.4 points of error over
        1 s windows on an H100."""
        return max(0.0, self.at(at))

    def forfeit(self, at: float, quota: float) -> float:
        """What a slot of `quota` from `at` that runs past the boundary cannot use of its frame before it: lost at
        the boundary, so that what the slot runs past the boundary is paid from the next frame's quota (idle time is
        not banked, and a slot that holds on is not given two frames' worth)."""
        b = self.next_boundary(at)
        if at + quota <= b + EPS:
            return 0.0
        return max(0.0, self.at(at) - (b - at))


@dataclass
class _Waiting:
    arrival: float
    burst: float


@dataclass
class _Slot:
    group: str
    token_seq: int
    start: float
    quota: float
    wait_ms: float
    reserved: float             # GPU time reserved from the bucket and virtual time at the grant
    reserved_weight: float = 1.0  # the group's weight then: the reservation is undone at the same weight
    prev_seq: int = 0           # the slot this one continues (0: a fresh grant)
    claim_credit: float = 0.0   # claimed by latency groups while this slot ran
    head_shared: float = 0.0    # how long the previous holder's overrun shared the start of this slot
    decided: bool = False       # the continuation decision was taken (lead point passed)
    forfeit: float = 0.0        # a framed cap's rest of the frame that this slot, across the boundary, gave up
    forfeit_until: float = 0.0  # that boundary

    @property
    def deadline(self) -> float:
        return self.start + self.quota


class _Gap(NamedTuple):
    """After a continuation voided before it began (Policy._void_unbegun): the slot it continued still runs."""
    group: str
    voided_seq: int     # the continuation's
    running_seq: int    # the slot it continued
    until: float        # that slot's deadline (the continuation's start): nothing is granted before it


@dataclass
class _Past:
    """A finished slot, kept for a window: late overuse, measured use and claim credits still apply to it."""
    group: str
    token_seq: int
    start: float
    end: float
    charge: float
    used: float = 0.0           # the GPU time its hooks measured (0: not reported)
    head_shared: float = 0.0    # how long the previous holder's overrun shared its start
    tail_shared: float = 0.0    # how long its own overrun shared the next holder's start
    forfeit: float = 0.0        # a framed cap's rest of the frame it gave up (_Slot.forfeit), if still to be given
    forfeit_until: float = 0.0  # back when the slot turns out to have ended before that boundary
    weight: float = 1.0         # the weight it was charged at (_Slot.reserved_weight): refunds go back at it at
    #                             least (_refund), and at the new weight once _uncrowd forgave its debt


class _Usage:
    """Charged GPU time of one group as (start, end, rate) segments, for the reporting window only."""

    __slots__ = ("segments",)

    def __init__(self) -> None:
        self.segments: deque[tuple[float, float, float]] = deque()

    def add(self, start: float, end: float, amount: float) -> None:
        if amount == 0.0:
            return
        if end <= start:
            end = start + abs(amount)
        self.segments.append((start, end, amount / (end - start)))

    def prune(self, before: float) -> None:
        # Segments are appended roughly in time order; late corrections may end up behind newer ones, so pruning
        # only drops from the left while the head is old (a stale one further in is harmless, and rare).
        while self.segments and self.segments[0][1] < before:
            self.segments.popleft()

    def between(self, a: float, b: float) -> float:
        total = 0.0
        for s, e, rate in self.segments:
            lo, hi = max(s, a), min(e, b)
            if hi > lo:
                total += (hi - lo) * rate
        return max(total, 0.0)


@dataclass
class _Group:
    cfg: GroupConfig
    bucket: Optional[Union[_Bucket, _FrameBucket]]  # None when uncapped; frames unless aligned or --frame 0
    vtime: float = 0.0
    waiting: Optional[_Waiting] = None
    last_active: float = -math.inf
    grants: int = 0
    continuations: int = 0
    last_quota: float = 0.0
    usage: _Usage = field(default_factory=_Usage)
    # latency class
    claim_bucket: Optional[_Bucket] = None
    claim_allowed: bool = False
    claims: int = 0
    claim_ms: float = 0.0
    # bookkeeping of the policy's incremental indexes (see Policy._index_groups)
    order: int = 0                      # its place in the config: the order of Policy._groups
    wstamp: int = 0                     # its live entry in Policy._wheap or Policy._held (older entries are stale)
    ran_out: bool = False               # its last slot ran to its deadline (busy): --frame-turns is among such
    crowded: bool = False               # charged at the least weight (1e-3) since its virtual time was last
    #                                     brought back (_uncrowd): a debt that no share it has now would run up
    demand: Demand = field(default_factory=Demand)  # how much it asks for: light groups' targets (demand.py)


def fair_targets(caps: dict[str, float], floors: Optional[dict[str, float]] = None) -> dict[str, float]:
    """Max-min fair shares with floors and caps (water-filling): each group gets clamp(level, floor, cap), the
    level chosen so that the shares add up to 1 (every group gets its cap when the caps add up to less; the
    floors scaled down to add up to 1 when they add up to more)."""
    floors = floors or {}
    lo = {n: min(max(floors.get(n, 0.0), 0.0), c) for n, c in caps.items()}
    if sum(caps.values()) <= 1.0:
        return dict(caps)
    total_lo = sum(lo.values())
    if total_lo >= 1.0:
        return {n: v / total_lo for n, v in lo.items()} if total_lo > 0 else {n: 0.0 for n in caps}
    # sum(clamp(L, lo, cap)) is continuous and non-decreasing in L: bisect on the breakpoints, then solve.
    points = sorted({0.0, 1.0, *lo.values(), *caps.values()})

    def total(level: float) -> float:
        return sum(min(max(level, lo[n]), c) for n, c in caps.items())

    a = 0.0
    for p in points:
        if total(p) >= 1.0:
            b = p
            break
        a = p
    else:
        b = 1.0
    ta, tb = total(a), total(b)
    level = b if tb == ta else a + (1.0 - ta) * (b - a) / (tb - ta)
    return {n: min(max(level, lo[n]), c) for n, c in caps.items()}


def demand_targets(caps: dict[str, float], floors: dict[str, float], limits: dict[str, float]) \
        -> tuple[dict[str, float], dict[str, float], frozenset[str]]:
    """The targets with light groups' demand (gemini/scheduler/demand.py): (weights, shares, the limited groups).
    Shares: fair_targets with each limited group's cap and floor lowered to its limit where that is under its fair
    share (those are the limited groups), so that every other group gets its fair share of what they leave; they
    add up to 1 (or to the caps). Weights, what virtual time runs at: the shares, but a limited group's is its fair
    share as if it wanted all of it (fair_targets), so that it stays as far ahead in the order as before and,
    should it turn busy, owes nothing for the slots it ran while limited."""
    full = fair_targets(caps, floors)
    limits = {n: v for n, v in limits.items() if n in caps and v < full[n] - EPS}
    if not limits:
        return full, full, frozenset()
    lowered = {n: min(c, limits[n]) if n in limits else c for n, c in caps.items()}
    shares = fair_targets(lowered, {n: min(floors.get(n, 0.0), lowered[n]) for n in caps})
    return {n: full[n] if n in limits else shares[n] for n in caps}, shares, frozenset(limits)


class Policy:
    """gem-schd's scheduling policy. See the module docstring.

    Parameters (ms): `base_quota_ms` the longest slot, `min_quota_ms` the shortest slot worth granting a capped
    group, `window_ms` the reporting window, `bucket_ms` the depth of a cap's bucket, `claim_burst_ms` the depth
    of a latency group's claim budget, `max_claim_ms` the longest single claim, `continue_lead_ms` how long
    before a deadline the holder's continuation is decided, `max_used_credit_ms` how much of a slot the hooks'
    measurement may forgive, `active_ms` how long after its last use a group still counts for the targets.
    """

    def __init__(self, config: Config, base_quota_ms: float = DEFAULT_BASE_QUOTA_MS,
                 min_quota_ms: float = DEFAULT_MIN_QUOTA_MS, window_ms: float = DEFAULT_WINDOW_MS,
                 start_ms: float = 0.0, max_used_credit_ms: float = 4.0, *, bucket_ms: float = DEFAULT_BUCKET_MS,
                 claim_burst_ms: float = DEFAULT_CLAIM_BURST_MS, max_claim_ms: float = DEFAULT_MAX_CLAIM_MS,
                 continue_lead_ms: float = DEFAULT_CONTINUE_LEAD_MS, active_ms: Optional[float] = None,
                 cap_slot_fraction: float = 0.5, continuation: bool = True, clock_origin_ms: float = 0.0,
                 cap_frame_ms: float = DEFAULT_CAP_FRAME_MS, frame_turns: bool = True,
                 min_frame_quota_ms: float = MIN_FRAME_QUOTA_MS, fair_cycle_ms: float = 0.0,
                 demand_limits: bool = True):
        for name, value in (("base_quota_ms", base_quota_ms), ("min_quota_ms", min_quota_ms),
                            ("window_ms", window_ms), ("bucket_ms", bucket_ms), ("claim_burst_ms", claim_burst_ms),
                            ("max_claim_ms", max_claim_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(continue_lead_ms) and continue_lead_ms >= 0):
            raise ValueError(f"continue_lead_ms must be >= 0, got {continue_lead_ms!r}")
        if not (math.isfinite(cap_frame_ms) and cap_frame_ms >= 0):
            raise ValueError(f"cap_frame_ms must be >= 0 (0: continuous buckets), got {cap_frame_ms!r}")
        if not (math.isfinite(fair_cycle_ms) and 0 <= fair_cycle_ms <= base_quota_ms):
            raise ValueError(f"fair_cycle_ms must be between 0 (off) and base_quota_ms ({base_quota_ms!r}: the longest "
                             f"slot, which a share of the cycle must fit), got {fair_cycle_ms!r}")
        self.base_quota_ms = float(base_quota_ms)
        # Per group, the shortest slot (ms) it is given when its slot is not capped: set by gem-schd for unified
        # groups whose slots end in swaps (gemini/scheduler/residency.py), so swapping stays a small part of them.
        self.quota_floor: dict[str, float] = {}
        # Per group, the earliest time (ms) it may be granted: set by gem-schd for unified groups whose grant would
        # evict another group's memory, so that such swaps are paced (residency.py's swap_gate).
        self.not_before: dict[str, float] = {}
        self.min_quota_ms = float(min_quota_ms)
        self.window_ms = float(window_ms)
        self.bucket_ms = float(bucket_ms)
        # Caps are budgets per frame of the host's clock (_FrameBucket); 0: continuous buckets of `bucket_ms`.
        self.cap_frame_ms = float(cap_frame_ms)
        # Framed groups held to their caps take turns in the order they asked (_frame_turn), not by virtual time
        # (gem-schd --no-frame-turns: by virtual time).
        self.frame_turns = bool(frame_turns)
        # A cap whose frame's quota is under this keeps a continuous bucket (_retune_bucket).
        self.min_frame_quota_ms = max(0.0, float(min_frame_quota_ms))
        # Uncapped groups' slots as their fair share of this cycle (0: the base quota each; _quota): slots of the
        # base quota interleave in proportion, but their order slips with the measured charges (0.7 / 0: a a b a a b
        # a a a b, now and then a a b a a b a a b), and a share's 1 s windows swing by a slot (11 points on the
        # simulated driver); with a cycle that divides 1 s, every group runs its share in each cycle.
        self.fair_cycle_ms = float(fair_cycle_ms)
        self.claim_burst_ms = float(claim_burst_ms)
        self.max_claim_ms = float(max_claim_ms)
        self.continue_lead_ms = float(continue_lead_ms)
        self.cap_slot_fraction = min(1.0, max(0.0, float(cap_slot_fraction)))
        self.continuation = bool(continuation)   # off only to show what it is for (tests)
        self.demand_limits = bool(demand_limits)  # likewise: light groups' demand in the targets (demand.py)
        # The host's monotonic clock (ms) at this policy's time 0: `Slots = aligned` groups' grid is laid on the
        # host's clock, so that every gem-schd of the host (one per GPU) lays the same grid.
        self.clock_origin_ms = float(clock_origin_ms)
        self.start_ms = float(start_ms)
        # At most this much of a slot is forgiven when its holder reports it used less GPU time: enough for the
        # handoff at the slot's start and a program's own host gaps after its synchronisations (3% of a slot
        # for one that synchronises after every 1 ms kernel), too little for a lying client to matter.
        self.max_used_credit_ms = max(0.0, float(max_used_credit_ms))
        self.active_ms = float(active_ms) if active_ms is not None else max(4 * self.base_quota_ms, 500.0)
        self.config = config
        self._groups: dict[str, _Group] = {}
        self._holder: Optional[_Slot] = None
        # The group a reload removed while it held the GPU, kept until that slot ends: a reload that adds the group
        # back meanwhile gets it back (apply_config), so that everything the policy keys by a group's name -- the
        # holder's, its slot's settling, the catch-up of a group back from idle -- still means one group.
        self._orphan: Optional[_Group] = None
        self._gap: Optional[_Gap] = None
        self._past: deque[_Past] = deque()
        self._claims: deque[tuple[str, float, float]] = deque()   # (group, start, end) reported, for a window
        self._seq = 0
        self._started = False
        self._last_now = self.start_ms
        self._targets_key: Optional[frozenset] = None
        self._targets: dict[str, float] = {}     # the active groups' weights (demand_targets)
        self._shares: dict[str, float] = {}      # and their shares: what status reports, --fair-cycle's slots
        self._limited: frozenset[str] = frozenset()  # the groups held to their demand there
        # Active groups whose target went from 0 (the others' floors took the whole GPU) to a share: their virtual
        # time is brought back within a slot of the others' before the next choice (_schedule, _uncrowd)
        self._uncrowded: set[str] = set()
        # Incremental indexes, so that a decision's cost grows with the groups its events touch, not with all
        # the groups (issue 14; bench/bench_policy_cost.py). Each mirrors a scan the policy used to make:
        # - the waiting groups, in the order they began waiting, and a heap of them keyed as _choose orders them,
        #   (vtime, False, arrival, name, stamp): an entry is live while its stamp is its group's `wstamp`
        #   (a charge re-keys a waiting group by pushing a new entry; stale ones are dropped when met);
        self._waiting: dict[str, _Group] = {}
        self._wheap: list[tuple[float, bool, float, str, int]] = []
        self._stamp = 0
        # - the waiting groups a decision found held back by their cap ("parked"), out of _wheap, in a heap keyed by
        #   (until, stamp, name): `until` is a lower bound of when the bucket allows a slot, so nothing before it
        #   needs to look at them (with many capped groups most of them wait for their buckets: every decision
        #   walked them all, 96 us at 64 groups, bench_policy_cost.py --mix capped). Any event that may move that
        #   time earlier re-keys the group (_rekey), which takes it back into _wheap; `_ready` is the waiting
        #   groups not parked;
        self._held: list[tuple[float, int, str]] = []
        self._ready: dict[str, _Group] = {}
        # - of the parked groups, the framed ones whose frame still had a rest of at least min_quota_ms when they
        #   were parked (name -> stamp; live while the group is parked with that stamp): a group whose slot was cut
        #   short (its burst ended, it stalled) and which asked again. They are granted that rest when nobody else
        #   can be (_choose_rest); there are few, so that looks at no other group;
        self._rests: dict[str, int] = {}
        # - the active set (_active_names): `_recent` holds the groups with last_active >= `_since` (= the last time
        #   asked about - active_ms) in increasing last_active (raising it moves a group to the end: it is then
        #   the newest); `_expired` the groups that fell off its front, oldest first (with the last_active they
        #   fell off with: stale entries are skipped), so that a question about an earlier time (a continuation
        #   is decided at its deadline, which a late tick has passed) takes them back from the end. `_active` is
        #   the set itself; `_key_diff` counts the groups whose membership differs from `_targets_key`, so the
        #   targets are recomputed only when the set really changed;
        self._incremental_active = math.isfinite(self.active_ms)
        self._recent: OrderedDict[str, _Group] = OrderedDict()
        self._expired: list[tuple[float, str, _Group]] = []
        self._since = -math.inf
        self._active: set[str] = set()
        self._key_diff = 0
        # - the groups of a class, in config order (rebuilt at a reload): latency groups (claim rights), capped
        #   groups with free slots and with aligned slots (_before_overflow, _choose's aligned pass).
        self._next_order = 0
        self._latency: dict[str, _Group] = {}
        self._capped: dict[str, _Group] = {}
        self._cap_bound: dict[str, _Group] = {}     # of those, the active ones whose target is their cap
        self._frame_bound: dict[str, _Group] = {}   # of those, the framed ones (not aligned): --frame-turns
        self._frame_tight: dict[str, _Group] = {}   # framed, held under their caps, by less than half (_overflow_walk)
        self._turns_apply = False                   # _frame_bound fills the frames or is all there is (_frame_turn)
        self._full_wait: Optional[str] = None       # the one capped group, continuous, among the active (_theta)
        self._aligned: dict[str, _Group] = {}
        for gc in config.groups:
            self._groups[gc.name] = self._new_group(gc, self.start_ms)
        self._index_groups()

    # --- public API ---------------------------------------------------------------------------------------------

    @property
    def holder(self) -> Optional[str]:
        return self._holder.group if self._holder else None

    @property
    def holder_deadline(self) -> Optional[float]:
        return self._holder.deadline if self._holder else None

    @property
    def holder_seq(self) -> Optional[int]:
        return self._holder.token_seq if self._holder else None

    @property
    def groups(self) -> list[str]:
        return list(self._groups)

    def waiting(self) -> list[str]:
        return sorted(self._waiting, key=lambda n: self._groups[n].order)

    def others_grantable(self, now: float) -> bool:
        """Could a group other than the holder be granted at `now` (it waits, and its cap and any swap pacing
        allow a slot)? gem-schd tells the holder's hooks on the board, so that they give the GPU back when
        their burst ends rather than keep it idle through the idle release. Stops at the first such group.
        (A parked group cannot be: its bucket allows no slot before its `until`.)"""
        now = self._now(now)
        self._unpark_due(now)
        holder = self._holder.group if self._holder is not None else None
        # A rest counts only where it would come before the holder in _choose's order: the holder gives the GPU back
        # at its burst's end, and a rest granted then, with no check of the order, put a group above its share ahead
        # of one below it (an independent review: 0.4 / 0.6 instead of 0.5 / 0.5 against a floor of 0.7).
        hg = self._groups.get(holder) if holder is not None else None
        bar = self._vtime_now(holder, hg, now) if holder is not None and hg is not None else math.inf

        def rest_first(name: str, g: _Group) -> bool:
            return g.vtime < bar and self._rest_room(g, now) is not None and \
                now >= self.not_before.get(name, -math.inf) - EPS

        for name, g in self._ready.items():
            if name != holder and (self._quota(g, now) is not None or rest_first(name, g)):
                return True
        return any(name != holder and rest_first(name, self._groups[name]) for name, _ in self._live_rests(now))

    def initial_decisions(self) -> list[Decision]:
        """Claim rights of the latency groups at the start (the daemon sends them at each Welcome too)."""
        return [ClaimRightDecision(n, g.claim_allowed, self.max_claim_ms)
                for n, g in self._groups.items() if g.cfg.latency]

    def claim_right(self, group: str) -> Optional[ClaimRightDecision]:
        g = self._groups.get(group)
        if g is None or not g.cfg.latency:
            return None
        return ClaimRightDecision(group, g.claim_allowed, self.max_claim_ms)

    def request(self, group: str, overuse_ms: float = 0.0, burst_ms: float = 0.0,
                now: float = 0.0, used_ms: float = 0.0) -> list[Decision]:
        """A group asks for the token. Returns the decisions to carry out now (possibly a grant)."""
        now = self._now(now)
        g = self._groups.get(group)
        if g is None:
            return [self._unknown(group)]
        if not self._started:
            # The reporting window starts with the first request, not when the daemon started: idle time before
            # any client came would otherwise count as unused window.
            self._started = True
            self.start_ms = now
        out: list[Decision] = []
        # Active first: what the request reports is charged at the weight of an active group. A group back from
        # idle has the weight of an inactive one (1e-3): its last slot's 4 ms of overuse added 4 s to its virtual
        # time, and it fell 1.5 s behind its busy neighbour (tests/test_policy.py).
        self._activate(g, now)
        self._apply_overuse(group, overuse_ms, now)
        h = self._holder
        if h is not None and h.group == group and h.start <= now:
            # As in Gemini: the holder asking again means its clients stopped using this slot.
            out += self._end_slot(now, "release", used_ms)
        elif h is not None and h.group == group and self._continues(h, h.prev_seq):
            # It asks for its next slot before the continuation granted for it starts: the request crossed the
            # continuation, which its pod manager ignores while a request is out. The continuation is void and the
            # slot it continued ends now, as at a release; the request is answered below. (Kept, the holder won
            # every next continuation against its own request, which waited out the pod manager's token timeout.)
            prev = h.prev_seq
            out += self._end_slot(now, "release")
            out += self._shorten_past(prev, now)
            self._apply_used(group, used_ms, now, prev)
        else:
            self._apply_used(group, used_ms, now)
        burst = burst_ms if (math.isfinite(burst_ms) and burst_ms > 0) else 0.0
        if g.waiting is None:
            g.demand.asked(now, overuse_ms if math.isfinite(overuse_ms) else 0.0)
            self._update_demand(g, now)
            self._set_waiting(group, g, _Waiting(now, burst))
        else:  # a re-sent request (e.g. after a pod manager re-registered): keep its place in the queue
            g.waiting.burst = burst
            self._rekey(g)      # its burst may lower the slot worth granting it: no longer parked
        return out + self._schedule(now)

    def release(self, group: str, token_seq: int, overuse_ms: float = 0.0, now: float = 0.0,
                used_ms: float = 0.0) -> list[Decision]:
        """The group's clients are idle. Ends the slot at once if it is the current one (or the one the current
        continuation continues); for an older token only its overuse and measured use are applied."""
        now = self._now(now)
        h = self._holder
        out: list[Decision] = []
        if h is not None and h.group == group and h.prev_seq and self._continues(h, h.prev_seq) and \
                token_seq in (h.token_seq, h.prev_seq):
            # Released before the deadline at which its continuation was to start: the continuation never runs,
            # and the slot it continued ends now instead of at its deadline -- whichever of the two the release
            # names (a pod manager that took the continuation up names the new one; what its hooks measured is
            # the old one's).
            prev = h.prev_seq
            out += self._end_slot(now, "release")
            out += self._shorten_past(prev, now)
            self._apply_overuse(group, overuse_ms, now)
            self._apply_used(group, used_ms, now, prev)
            return out + self._schedule(now)
        if h is not None and h.group == group and h.token_seq == token_seq:
            self._apply_overuse(group, overuse_ms, now)
            out += self._end_slot(now, "release", used_ms)
            return out + self._schedule(now)
        if h is not None and h.group == group and h.prev_seq and h.prev_seq == token_seq:   # (0: a fresh slot's)
            # The slot it continued, released just before its deadline, the release arriving after the
            # continuation began: the pod manager gave the slot back before the continuation reached it, and
            # ignores it now (protocol.md). Its group is idle: the continuation ends here, not a whole slot later
            # while others wait.
            self._apply_overuse(group, overuse_ms, now)
            self._apply_used(group, used_ms, now, token_seq)
            out += self._end_slot(now, "release")
            return out + self._schedule(now)
        gap = self._gap
        if h is None and gap is not None and gap.group == group and token_seq in (gap.voided_seq, gap.running_seq):
            # Released in the gap after a voided continuation (_void_unbegun): the slot it continued ends now, as
            # at a release before a continuation begins, and the next group goes now, not at that slot's deadline
            # (an independent review).
            self._end_idle_gap()
            out += self._shorten_past(gap.running_seq, now)
            self._apply_overuse(group, overuse_ms, now)
            self._apply_used(group, used_ms, now, gap.running_seq)
            return out + self._schedule(now)
        if group not in self._groups and not any(p.group == group for p in self._past):
            return [self._unknown(group)]
        self._apply_overuse(group, overuse_ms, now)
        self._apply_used(group, used_ms, now, token_seq)
        return out + self._schedule(now)

    def cancel(self, group: str, now: float) -> list[Decision]:
        """The group's pod manager went away (or another replaced it): drop its waiting request, and if it holds
        the GPU its slot runs to its deadline and is not continued -- whoever speaks for the group now must ask
        (a continuation would keep its hooks launching without ever meeting the new pod manager)."""
        now = self._now(now)
        g = self._groups.get(group)
        if g is not None and g.waiting is not None:
            self._clear_waiting(group, g)
        h = self._holder
        out: list[Decision] = []
        if g is not None and (h is None or h.group != group):
            g.demand.went_idle(now)
        if h is not None and h.group == group:
            h.decided = True
            out += self._void_unbegun(now)
        return out + self._schedule(now)

    def _void_unbegun(self, now: float) -> list[Decision]:
        """The holder is a continuation not yet begun whose group was removed or whose pod manager went: nobody
        will run it (kept, the GPU idled through a whole slot while others waited: an independent review's fuzzing
        of reloads). It ends at its start, zero long (gem-schd withdraws it from the board, where the old hooks
        would take it up), and the next group goes when the slot it continued runs out."""
        h = self._holder
        if h is None or not h.prev_seq or h.start <= now + EPS:
            return []
        start = h.start
        out = self._end_slot(now, "release")        # (ends at its start: max(now, start))
        self._gap = _Gap(h.group, h.token_seq, h.prev_seq, start)
        return out

    def _end_idle_gap(self) -> None:
        self._gap = None
        if self._holder is None:
            self._orphan = None     # (a removed group's slot has run out: a group added back now is a new one)

    def claim_span(self, start_ms: float, end_ms: float, now: float) -> Optional[tuple[float, float]]:
        """The part of a reported claim the policy takes: not in the future, nor longer than its bound plus a
        margin for the report's travel (None: nothing of it). Observers are told of this span, not the report's."""
        if not (math.isfinite(start_ms) and math.isfinite(end_ms)):
            return None
        end_ms = min(end_ms, now)
        start_ms = max(start_ms, end_ms - self.max_claim_ms - 5.0)
        return (start_ms, end_ms) if end_ms > start_ms else None

    def claimed(self, group: str, start_ms: float, end_ms: float, now: float, used_ms: float = 0.0,
                ahead_ms: float = 0.0, held_ahead_ms: float = 0.0) -> list[Decision]:
        """A latency group's pod manager reports a claim it made: [start_ms, end_ms] on the policy's clock, and
        the GPU time its hooks measured in it (0: not measured). The batch holder it paused is credited the whole
        span; the claimer is charged what it used -- a request's CPU-bound gaps are not GPU time -- but at least a
        quarter of the span, so that a client that under-reports gains little; its cap's bucket pays the whole span.
        An early claim's hooks launched `ahead_ms` before the span, when the claim was not yet on the board: what
        they measured then is charged too (their use may reach span + ahead), but credits no one -- the others
        were not paused then -- except `held_ahead_ms` of it, when the group's flare held the others already."""
        now = self._now(now)
        g = self._groups.get(group)
        if g is None:
            return [self._unknown(group)]
        bounded = self.claim_span(start_ms, end_ms, now)
        if bounded is None:
            return []
        start_ms, end_ms = bounded
        span = end_ms - start_ms
        ahead = min(max(0.0, ahead_ms), MAX_CLAIM_AHEAD_MS) if math.isfinite(ahead_ms) else 0.0
        held = min(max(0.0, held_ahead_ms), ahead) if math.isfinite(held_ahead_ms) else 0.0
        credit_start = start_ms - held      # from when the others could not run
        dur = span
        if math.isfinite(used_ms) and used_ms > 0:
            dur = min(span + ahead, max(used_ms, CLAIM_MIN_CHARGE * span))
        if not self._started:
            self._started = True
            self.start_ms = start_ms
        self._activate(g, now)
        g.claims += 1
        g.claim_ms += dur
        if g.claim_bucket is not None:
            g.claim_bucket.add(dur, now)
        self._charge(g, dur, now)
        if g.bucket is not None:
            # The cap pays for the whole span: the others could not launch during it, whatever the claimer's
            # hooks report (charged only what they reported, a tenant reporting 1 us per claim had 0.83 of the
            # GPU at MaxUtil 0.3).
            g.bucket.add(max(0.0, span - dur), now)
        g.usage.add(start_ms - ahead, end_ms, dur)
        self._claims.append((group, start_ms, end_ms))
        # (the paused holder is credited the span: it could not launch)
        # Credit the overlapped slots of other groups: their holders stopped launching during the claim.
        h = self._holder
        if h is not None and h.group != group:
            overlap = max(0.0, min(end_ms, h.deadline) - max(credit_start, h.start))
            h.claim_credit += overlap
        for p in self._past:
            if p.group == group:
                continue
            overlap = max(0.0, min(end_ms, p.end) - max(credit_start, p.start))
            if overlap > 0:
                overlap = min(overlap, p.charge)
                p.charge -= overlap
                pg = self._groups.get(p.group)
                if pg is not None:
                    self._refund(pg, p, overlap, now)
                    pg.usage.add(max(credit_start, p.start), min(end_ms, p.end), -overlap)
        out = self._update_claim_right(g, now)
        return out + self._schedule(now)

    def tick(self, now: float) -> list[Decision]:
        """Time passed: decide a continuation, end an expired slot, grant if someone is eligible, and give
        claim rights back."""
        now = self._now(now)
        out: list[Decision] = []
        for g in self._latency.values():
            out += self._update_claim_right(g, now)
        return out + self._schedule(now)

    def next_wakeup(self, now: float) -> Optional[float]:
        """When `tick` should be called next (None: nothing happens until a new message)."""
        now = self._now(now)
        best = math.inf
        h = self._holder
        if h is not None:
            if not h.decided:
                best = max(now, h.deadline - self.continue_lead_ms)
            else:
                best = max(now, h.deadline)
        elif self._gap is not None and now < self._gap.until - EPS and self._waiting:
            best = self._gap.until      # (_void_unbegun: the slot it continued still runs)
        else:
            # (only while the GPU is idle: every waiting group is held back by its cap or swap pacing) The parked
            # ones in the order of their lower bounds, only while one could still come first.
            for g in self._ready.values():
                best = min(best, self._eligible_at(g, now), self._rest_at(g, now))
            popped = []
            while self._held and self._held[0][0] < best:
                entry = heapq.heappop(self._held)
                if self._held_live(entry):
                    popped.append(entry)
                    g = self._groups[entry[2]]
                    best = min(best, self._eligible_at(g, now), self._rest_at(g, now))
            for entry in popped:
                heapq.heappush(self._held, entry)
            for name, stamp in list(self._rests.items()):    # a rest held back by its swap pacing
                rg = self._groups.get(name)
                if rg is not None and rg.waiting is not None and rg.wstamp == stamp:
                    best = min(best, self._rest_at(rg, now))
        for g in self._latency.values():
            if not g.claim_allowed:
                best = min(best, self._claim_right_back_at(g, now))
        return None if best == math.inf else best

    def apply_config(self, config: Config, now: float) -> list[Decision]:
        """Switch to a new config. Buckets, virtual times and history are kept; new MinUtil/MaxUtil apply from
        the next decision; a removed group's holder finishes its slot and its waiting request is refused."""
        now = self._now(now)
        out: list[Decision] = []
        new_names = set(config.names)
        for name in list(self._groups):
            if name not in new_names:
                if self._holder is not None and self._holder.group == name:
                    out += self._void_unbegun(now)      # (settled on the group before it goes)
                g = self._groups.pop(name)
                if self._holder is None and self._gap is not None and self._gap.group == name:
                    self._orphan = g        # (its slot still runs, to the voided continuation's start)
                self._forget(name)
                if self._holder is not None and self._holder.group == name:
                    # its slot runs to its deadline and is not continued, also if the group is added back
                    # meanwhile: whoever speaks for it then never had the slot (gem-schd forgets a removed group's
                    # pod manager), and must ask
                    self._holder.decided = True
                    self._orphan = g
                if g.waiting is not None:
                    g.waiting = None
                    out.append(RefuseDecision(name, ERR_UNKNOWN_GROUP,
                                              f"group {name!r} was removed from {config.path}"))
        for gc in config.groups:
            old = self._groups.get(gc.name)
            h = self._holder
            running = h.group if h is not None else self._gap.group if self._gap is not None else None
            if old is None and self._orphan is not None and running == gc.name:
                # Added back while the slot it held when removed still runs: the same group again (its virtual
                # time, bucket and history), changed as any reload changes a group. A fresh one (virtual time 0)
                # was taken for the holder by name: the old slot was settled on it, its catch-up to the others'
                # virtual time skipped, and it held the GPU for seven slots in a row (an independent review).
                old, self._orphan = self._orphan, None
                self._groups[gc.name] = old
            if old is None:
                self._groups[gc.name] = self._new_group(gc, now)
                if gc.latency:
                    out.append(ClaimRightDecision(gc.name, self._groups[gc.name].claim_allowed, self.max_claim_ms))
                continue
            was_latency = old.cfg.latency
            old.cfg = gc
            old.bucket = self._retune_bucket(old.bucket, gc, now)
            if gc.latency:
                if old.claim_bucket is None:
                    old.claim_bucket = _Bucket(gc.min_util, self.claim_burst_ms, now)
                else:
                    old.claim_bucket.advance(now)
                    old.claim_bucket.rate = gc.min_util
                allowed = self._claim_ok(old, now)
                if allowed != old.claim_allowed or not was_latency:
                    old.claim_allowed = allowed
                    out.append(ClaimRightDecision(gc.name, allowed, self.max_claim_ms))
            elif was_latency:
                old.claim_bucket, old.claim_allowed = None, False
                out.append(ClaimRightDecision(gc.name, False, self.max_claim_ms))
        self.config = config
        self._index_groups()
        out.extend(self._schedule(now))
        return out

    def stop(self, now: float) -> list[Decision]:
        """The daemon stops: the current slot ends now."""
        now = self._now(now)
        if self._holder is None:
            return []
        return self._end_slot(now, "stop")

    # --- reports ------------------------------------------------------------------------------------------------

    def window_eff(self, now: float) -> float:
        return max(0.0, min(self.window_ms, now - self.start_ms)) if self._started else 0.0

    def usage(self, group: str, now: float) -> float:
        """ms of GPU time charged to the group inside [now - window_eff, now] (the running slot up to now)."""
        g = self._groups.get(group)
        if g is None:
            return 0.0
        a = now - self.window_eff(now)
        g.usage.prune(now - self.window_ms)
        total = g.usage.between(a, now)
        h = self._holder
        if h is not None and h.group == group and h.start < now:
            total += max(0.0, min(now, h.deadline) - max(a, h.start))
        return total

    def share(self, group: str, now: float) -> float:
        w = self.window_eff(now)
        return min(1.0, self.usage(group, now) / w) if w > 0 else 0.0

    def status(self, now: float) -> dict[str, GroupStatus]:
        now = self._now(now)
        self._current_targets(now)
        targets = self._shares
        out = {}
        for name, g in self._groups.items():
            h = self._holder
            out[name] = GroupStatus(
                name=name, min_util=g.cfg.min_util, max_util=g.cfg.max_util, sched_class=g.cfg.sched_class,
                share=self.share(name, now),
                # (a continuation decided but not begun: the slot it continues still runs)
                holding=h is not None and h.group == name and (h.start <= now < h.deadline or
                                                              (h.prev_seq != 0 and now < h.start)),
                waiting=g.waiting is not None, wait_ms=(now - g.waiting.arrival) if g.waiting else 0.0,
                quota_ms=g.last_quota, grants=g.grants, continuations=g.continuations,
                bucket_ms=self._level(g, now) if g.bucket is not None else math.inf,
                target=targets.get(name, 0.0), claim_allowed=g.claim_allowed, claims=g.claims,
                claim_ms=g.claim_ms)
        return out

    def history(self) -> list[tuple[str, float, float, int]]:
        """(group, start, end, token_seq) of the finished slots still kept, then the running one."""
        out = [(p.group, p.start, p.end, p.token_seq) for p in self._past]
        if self._holder is not None:
            h = self._holder
            out.append((h.group, h.start, h.deadline, h.token_seq))
        return out

    # --- internals: groups, buckets, virtual time ------------------------------------------------------------------

    def _now(self, now: float) -> float:
        # Never let time run backwards, whatever the caller passes.
        if not math.isfinite(now):
            raise ValueError(f"bad time {now!r}")
        if now < self._last_now:
            now = self._last_now
        self._last_now = now
        return now

    def _unknown(self, group: str) -> RefuseDecision:
        return RefuseDecision(group, ERR_UNKNOWN_GROUP, f"group {group!r} is not in {self.config.path}")

    def _new_group(self, gc: GroupConfig, now: float) -> _Group:
        g = _Group(gc, self._retune_bucket(None, gc, now), order=self._next_order)
        self._next_order += 1
        if gc.latency:
            g.claim_bucket = _Bucket(gc.min_util, self.claim_burst_ms, now)
            g.claim_allowed = self._claim_ok(g, now)
        return g

    def _cap_carry(self, quota: float) -> float:
        """How much of a frame's rest passes its boundary: what the hooks' measured use gives back after a slot
        (at most `max_used_credit_ms` a slot), never more than a quarter of the quota."""
        return min(0.25 * quota, 2 * self.max_used_credit_ms)

    def _retune_bucket(self, bucket: Optional[Union[_Bucket, _FrameBucket]], gc: GroupConfig,
                       now: float) -> Optional[Union[_Bucket, _FrameBucket]]:
        cap = gc.max_util
        if cap >= 1.0:
            return None
        # Only a cap whose frame's quota makes a slot worth its handoff and drain (min_frame_quota_ms): on an H100 a
        # deep-queued group capped at 0.05 ran 0.031 of the GPU's time given 10 ms every 200 ms, 0.042 given 25 ms
        # every 500 ms (and up to 0.083 over a 1 s window), and 0.050 with the bucket (0.072), in the same call.
        # An aligned group keeps the bucket too: its own grid (_grid) places its slots.
        framed = self.cap_frame_ms > 0 and not gc.aligned and cap * self.cap_frame_ms >= self.min_frame_quota_ms - EPS
        fresh: Union[_Bucket, _FrameBucket]
        if framed:
            frame = self.cap_frame_ms
            if isinstance(bucket, _FrameBucket):
                bucket.advance(now)
                bucket.rate, bucket.frame, bucket.depth = cap, frame, cap * frame
                bucket.carry = self._cap_carry(bucket.depth)
                bucket.level = min(bucket.level, bucket.depth + bucket.carry)
                return bucket
            fresh = _FrameBucket(cap, frame, self.clock_origin_ms, now, self._cap_carry(cap * frame))
        else:
            if type(bucket) is _Bucket:     # (not a _FrameBucket, its subclass)
                bucket.advance(now)
                bucket.rate = cap
                return bucket
            fresh = _Bucket(cap, self.bucket_ms, now)
        if bucket is not None:      # the kind changed (Slots edited): keep what is left, never more than a full one
            fresh.level = min(fresh.depth, bucket.at(now))
        return fresh

    def cap_burst_ms(self, group: str) -> float:
        """How far above MaxUtil x T a group's slots may reach over any interval T: a continuous bucket's depth; with
        frames 2 x MaxUtil x (1 - MaxUtil) x its frame (a frame's quota at the end of one frame and the next one's at
        the start of the next) plus the frame's carry. inf if uncapped."""
        g = self._groups.get(group)
        if g is None or g.bucket is None:
            return math.inf
        if isinstance(g.bucket, _FrameBucket):
            return 2 * g.bucket.depth * (1.0 - g.cfg.max_util) + g.bucket.carry
        return g.bucket.depth

    def _room(self, g: _Group, at: float) -> float:
        """The longest slot the cap allows from `at`: the bucket empty, not negative, when it ends."""
        assert g.bucket is not None
        if isinstance(g.bucket, _FrameBucket):
            return g.bucket.room(at)
        return g.bucket.at(at) / (1.0 - g.cfg.max_util)

    def _level(self, g: _Group, now: float) -> float:
        return g.bucket.at(now) if g.bucket is not None else math.inf

    def _activate(self, g: _Group, now: float) -> None:
        """A group becomes active (asks, or claims): its virtual time catches up with the active groups', so
        that idle time is not banked and a group that comes back cannot take a long run while others wait. The
        holder is active however long ago its slot began (a unified group's slot may last seconds, longer than
        active_ms): asking again it keeps its place."""
        h = self._holder
        if now - g.last_active > self.active_ms and not (h is not None and h.group == g.cfg.name):
            floor = self._min_active_vtime(now, exclude=g)
            if floor is not None and g.vtime < floor:
                g.vtime = floor
                self._rekey(g)
            self._invalidate_targets()
            self._demand_afresh(g)
            if g.crowded:
                # nor a debt run up while the others' floors crowded it out (_uncrowd), which a group idle
                # meanwhile would otherwise bring back with it (only that: a unified group's long slot, say, is
                # still paid for)
                self._uncrowded.add(g.cfg.name)
        self._touch(g, now)

    def _vtime_now(self, name: str, g: _Group, now: float) -> float:
        """The group's virtual time as of now: the holder's includes only the part of its slot that has run."""
        h = self._holder
        if h is not None and h.group == name:
            ahead = max(0.0, h.deadline - max(now, h.start))
            return g.vtime - ahead / self._weight(name, now)
        return g.vtime

    def _min_active_vtime(self, now: float, exclude: Optional[_Group] = None) -> Optional[float]:
        # (only when a group comes back after active_ms idle: it costs one pass over the active groups, in config
        # order, as min keeps the first of equal values)
        groups = self._groups
        values = [self._vtime_now(n, groups[n], now) for n in self._in_order(self._active_names(now))
                  if groups[n] is not exclude]
        return min(values) if values else None

    def _in_order(self, names: Iterable[str]) -> list[str]:
        """Names of groups in config order (the order of self._groups)."""
        return sorted(names, key=lambda n: self._groups[n].order)

    def _active_names(self, now: float) -> Union[set[str], frozenset[str]]:
        """The groups active at `now`: waiting, holding (by name), or used the GPU in the last active_ms
        (last_active >= now - active_ms). The set itself: do not change it. Kept up to date by the events that
        change it (_refresh) and moved to `now` here: the cost grows with the groups that crossed the active_ms
        line since the last question, not with all the groups."""
        if not self._incremental_active:        # active_ms inf or nan: no line to keep groups in order by
            h = self._holder
            holder = h.group if h is not None else None
            since = now - self.active_ms
            return frozenset(n for n, g in self._groups.items()
                             if g.waiting is not None or n == holder or g.last_active >= since)
        since = now - self.active_ms
        if since > self._since:
            recent = self._recent
            while recent:
                name = next(iter(recent))
                g = recent[name]
                if g.last_active >= since:
                    break
                del recent[name]
                self._push_expired(g.last_active, name, g)
                self._refresh(name, g)
        elif since < self._since:
            expired = self._expired
            while expired and expired[-1][0] >= since:
                last_active, name, g = expired.pop()
                if self._groups.get(name) is g and g.last_active == last_active and name not in self._recent:
                    self._recent[name] = g
                    self._recent.move_to_end(name, last=False)
                    self._refresh(name, g)
        self._since = since
        return self._active

    def _touch(self, g: _Group, now: float) -> None:
        """The group used the GPU (or asked) at `now`: raise its last_active, keeping _recent in its order."""
        if now <= g.last_active:
            return
        g.last_active = now
        name = g.cfg.name
        # now is the latest time the policy has seen: the group is the newest of all
        if now >= self._since:
            self._recent[name] = g
            self._recent.move_to_end(name)
        else:                                   # (the last question was about a later time: a deadline)
            self._recent.pop(name, None)
            self._push_expired(now, name, g)
        self._refresh(name, g)

    def _push_expired(self, last_active: float, name: str, g: _Group) -> None:
        """Put a group on top of _expired (its last_active is at least any there). The stale entries (groups
        back in _recent or used since) are dropped once they could outnumber the groups, so the list stays short
        in a daemon that runs for months."""
        self._expired.append((last_active, name, g))
        if len(self._expired) > 2 * len(self._groups) + 64:
            self._expired = [e for e in self._expired if self._groups.get(e[1]) is e[2]
                             and e[2].last_active == e[0] and e[1] not in self._recent]

    def _refresh(self, name: str, g: _Group) -> None:
        """Re-decide one group's membership of the active set after an event changed what _active_names reads."""
        h = self._holder
        active = g.waiting is not None or (h is not None and h.group == name) or name in self._recent
        if active == (name in self._active):
            return
        if active:
            self._active.add(name)
        else:
            self._active.discard(name)
        if self._targets_key is not None:
            self._key_diff += 1 if active != (name in self._targets_key) else -1

    def _set_waiting(self, name: str, g: _Group, w: _Waiting) -> None:
        g.waiting = w
        self._waiting[name] = g
        self._rekey(g)
        self._refresh(name, g)

    def _clear_waiting(self, name: str, g: _Group) -> None:
        g.waiting = None
        del self._waiting[name]
        self._ready.pop(name, None)
        self._refresh(name, g)

    def _rekey(self, g: _Group) -> None:
        """A waiting group's place in _choose's order (its virtual time, or its request) changed, or what its cap
        allows may have: it goes (back) into _wheap, unparked."""
        if g.waiting is None:
            return
        self._stamp += 1
        g.wstamp = self._stamp
        self._ready[g.cfg.name] = g
        heapq.heappush(self._wheap, (g.vtime, False, g.waiting.arrival, g.cfg.name, self._stamp))
        if len(self._wheap) > 2 * len(self._waiting) + 64:
            self._wheap = [e for e in self._wheap if self._live(e)]
            heapq.heapify(self._wheap)

    def _live(self, entry: tuple[float, bool, float, str, int]) -> bool:
        g = self._groups.get(entry[3])
        return g is not None and g.waiting is not None and g.wstamp == entry[4]

    def _park(self, g: _Group, at: float) -> bool:
        """A waiting free-slot capped group whose bucket allows no slot at `at`: out of _wheap until a lower bound
        of when it will (the bucket only fills between the events that re-key it). False if it cannot be."""
        if g.bucket is None or g.cfg.aligned or g.waiting is None:
            return False
        cap = g.cfg.max_util
        until = math.inf        # MaxUtil 0: never, until a reload re-keys it
        if cap > 0.0:
            # _quota allows a slot once level / (1 - cap) >= theta - EPS; a little below that level, so that `until`
            # is never later than the first moment it does (time_to_reach has its own EPS)
            if isinstance(g.bucket, _FrameBucket):
                until = self._frame_ready_at(g, at)
                # a boundary before that may leave it a rest (a group in debt): unparked there, it is parked again
                # with the rest recorded, which a GPU that would idle grants
                rest_at = self._rest_at(g, at)
                if rest_at > at:
                    until = min(until, rest_at)
            else:
                until = g.bucket.time_to_reach((self._theta(g) - EPS) * (1.0 - cap) - 2 * EPS, at)
        if until <= at:
            return False
        # a new stamp: its _wheap entries go stale, and its _held entry is live until a re-key
        self._stamp += 1
        g.wstamp = self._stamp
        self._ready.pop(g.cfg.name, None)
        heapq.heappush(self._held, (until, self._stamp, g.cfg.name))
        if self._rest_room(g, at) is not None:
            self._rests[g.cfg.name] = self._stamp
        if len(self._held) > 2 * len(self._waiting) + 64:
            self._held = [e for e in self._held if self._held_live(e)]
            heapq.heapify(self._held)
        return True

    def _held_live(self, entry: tuple[float, int, str]) -> bool:
        g = self._groups.get(entry[2])
        return g is not None and g.waiting is not None and g.wstamp == entry[1]

    def _unpark_due(self, at: float) -> None:
        """The parked groups whose lower bound `at` has reached go back into _wheap."""
        while self._held and self._held[0][0] <= at:
            entry = heapq.heappop(self._held)
            if self._held_live(entry):
                self._rekey(self._groups[entry[2]])

    @staticmethod
    def _frame_of(g: _Group) -> Optional[_FrameBucket]:
        """The frame budget of a group whose frame's rest may be granted (framed, not aligned, not paused)."""
        b = g.bucket
        return b if isinstance(b, _FrameBucket) and not g.cfg.aligned and g.cfg.max_util > 0.0 else None

    @staticmethod
    def _rest_of(b: _FrameBucket, now: float) -> float:
        """A rest's longest slot from `now`: the frame's rest, up to the boundary. Run past the boundary, a rest
        was paid from the group's next frame, whose turn then fell short; the GPU ran out of budgets before that
        frame's end and gave another group a rest across the next boundary, paid from the frame after: with caps
        adding up to 1 and 200 ms frames (--frame 200 -q 200) the slots kept that rotation for 3.5 s on the
        simulated driver, 7-10 points off the worst 1 s window."""
        return min(b.room(now), b.next_boundary(now) - now)

    def _rest_room(self, g: _Group, now: float) -> Optional[float]:
        """A framed group's rest at `now` (_rest_of) if it is worth a slot (min_quota_ms), else None (its swap
        pacing, `not_before`, is the caller's)."""
        b = self._frame_of(g)
        if b is None:
            return None
        room = self._rest_of(b, now)
        return room if room >= self.min_quota_ms - EPS else None

    def _rest_at(self, g: _Group, now: float) -> float:
        """When a framed group next has a rest worth a slot that a grant may use: `now`, or the first frame boundary
        whose refill lifts it past min_quota_ms (a group in debt can come out of it with less than a useful slot),
        and never before its swap pacing; inf if not within 64 frames."""
        b = self._frame_of(g)
        if b is None:
            return math.inf
        t = max(now, self.not_before.get(g.cfg.name, -math.inf))
        for _ in range(64):
            if self._rest_of(b, t) >= self.min_quota_ms - EPS:
                return t
            t = b.next_boundary(t)
        return math.inf

    def _live_rests(self, now: float) -> list[tuple[str, float]]:
        """The parked framed groups with a rest of their frame worth a slot at `now` (min_quota_ms) that their swap
        pacing allows now, and the rest. Drops the entries that are no longer so: re-keyed, gone, or their rest spent
        (it only shrinks until the boundary, which unparks the group). An entry held back by its pacing stays:
        next_wakeup wakes for it."""
        out = []
        for name in list(self._rests):
            g = self._groups.get(name)
            if g is None or g.waiting is None or g.wstamp != self._rests[name]:
                del self._rests[name]
                continue
            room = self._rest_room(g, now)
            if room is None:
                del self._rests[name]
            elif now >= self.not_before.get(name, -math.inf) - EPS:
                out.append((name, room))
        return out

    def _choose_rest(self, now: float) -> Optional[tuple[str, float]]:
        """With nobody eligible (the GPU would idle), the rest of its frame (up to the boundary: _rest_of) to a
        parked framed group whose rest is still worth a slot, the least virtual time first. A group waits for a good
        part of its frame's quota (_theta: fewer, longer slots) as long as the GPU has other work; with none, the
        rest it waited with was lost at the boundary while the GPU idled. On an H100 (twentieth session, 0.3 / 0.6):
        the 0.6 group's process stalled 6 ms into its slot, gave the GPU back, asked again with 18 ms of its frame
        left and waited 22 ms for the boundary, the GPU idle: 1.3 points off its worst 1 s window (2.47 against 0.6
        for the other)."""
        best: Optional[tuple[tuple, str, float]] = None
        for name, room in self._live_rests(now):
            g = self._groups[name]
            assert g.waiting is not None
            key = (g.vtime, g.waiting.arrival, name)
            if best is None or key < best[0]:
                best = (key, name, room)
        if best is None:
            return None
        longest = max(self.base_quota_ms, self.quota_floor.get(best[1], 0.0))
        return best[1], min(best[2], longest)

    def _forget(self, name: str) -> None:
        """A reload removed the group: out of the indexes (its heap and _expired entries go stale)."""
        self._waiting.pop(name, None)
        self._ready.pop(name, None)
        self._rests.pop(name, None)
        self._recent.pop(name, None)
        self._active.discard(name)

    def _index_groups(self) -> None:
        """After the groups or their settings changed (start, reload): the groups of each class, each group's
        membership of the active set (a new group may have the holder's name), and the targets."""
        self._latency = {n: g for n, g in self._groups.items() if g.cfg.latency}
        self._capped = {n: g for n, g in self._groups.items() if g.bucket is not None and not g.cfg.aligned}
        self._aligned = {n: g for n, g in self._groups.items() if g.bucket is not None and g.cfg.aligned}
        for name, g in self._groups.items():
            self._refresh(name, g)
            if g.waiting is not None and name not in self._ready:
                self._rekey(g)      # parked: its cap or class may have changed, so it is looked at again
        self._invalidate_targets()

    def _demand_afresh(self, g: _Group) -> None:
        """A group back from being inactive, not limited then (busy), has its demand estimated afresh: counting the
        time it was inactive as low demand, its limit raised the others' targets until two of its slots had run out
        (a busy floor group of 0.7 back after a second's pause got 0.50 over its first second: an independent
        review). A limited (light) one keeps its estimate: started afresh, it counted as wanting its whole share
        for half a second at every return, and a light group asking every 250-400 ms on average did so half the
        time (a floor of 0.35 beside it got 0.53 against an uncapped group's 0.46: a second review)."""
        if g.demand.limit is None:
            g.demand = Demand()

    def _update_demand(self, g: _Group, now: float) -> None:
        """Re-decide a group's demand limit at one of its events (demand.py); the targets follow a change. A
        latency group's targets are never limited (its claims, not its slots, are its demand); its limit tells
        only _makes_no_way that it is light."""
        old = g.demand.limit
        if not (self.demand_limits and g.demand.update(now)) or g.cfg.latency:
            return
        # Only a limit under the group's target now changes the targets (demand_targets): a busy group among many,
        # with a small share, has a limit far above it, and recomputing the targets at its every slot made each
        # decision's cost grow with the groups (tests/test_policy_scale.py).
        target = self._targets.get(g.cfg.name)
        if target is not None and any(v is not None and v < target - EPS for v in (old, g.demand.limit)):
            self._invalidate_targets()

    def _invalidate_targets(self) -> None:
        self._targets_key = None
        self._key_diff = 0

    def _current_targets(self, now: float) -> dict[str, float]:
        names = self._active_names(now)
        if self._targets_key is not None and self._key_diff == 0 and self._incremental_active:
            return self._targets            # the same set as when they were computed
        active = frozenset(names)
        if active != self._targets_key:
            self._targets_key = active
            # Walked in config order: fair_targets adds the shares in its order, and the turns' walks (_frame_turn,
            # _fit_turn) and their ties follow _frame_bound's. A frozenset's order follows the names' hashes, which
            # differ from one process to the next (PYTHONHASHSEED): the same events gave other decisions.
            ordered = self._in_order(active)
            before = self._targets
            groups = self._groups
            limits: dict[str, float] = {}
            for name in ordered:
                limit = groups[name].demand.limit
                if limit is not None and not groups[name].cfg.latency:     # (None with demand_limits off)
                    limits[name] = limit
            self._targets, self._shares, self._limited = demand_targets(
                {n: groups[n].cfg.max_util for n in ordered}, {n: groups[n].cfg.min_util for n in ordered}, limits)
            self._uncrowded |= {n for n, t in self._targets.items() if t > EPS and before.get(n, 1.0) <= EPS}
            # the active capped groups whose fair share is their cap: only their buckets can overflow while they
            # wait (one held back by the others' shares gets less than its cap whatever the slots around it)
            self._cap_bound = {n: self._capped[n] for n in ordered if n in self._capped and
                               self._targets.get(n, 0.0) >= self._capped[n].cfg.max_util - EPS}
            self._frame_bound = {n: cg for n, cg in self._cap_bound.items()
                                 if isinstance(cg.bucket, _FrameBucket) and not cg.cfg.aligned}
            # the framed ones the others' shares hold under their caps by less than half: skipping every other
            # frame, such a group gets less than its share (_overflow_walk)
            self._frame_tight = {n: cg for n, cg in self._capped.items()
                                 if n not in self._cap_bound and n in active and isinstance(cg.bucket, _FrameBucket)
                                 and cg.cfg.max_util < 2.0 * self._targets.get(n, 0.0) - EPS}
            # The only capped group among the active ones, beside uncapped ones, if its bucket is continuous and its
            # share is its cap: the others' slots end by the time its bucket is full (_before_overflow), so it may
            # wait for a full bucket (_theta) and lose none of its refill. (Beside other capped groups it may not:
            # waiting for a full bucket, the 0.1 group of 0.1 / 0.2 / 0.3 / 0.4 lost 2 points in tests/policy_sim.py.)
            taking = [n for n in ordered if self._groups[n].cfg.max_util > 0]
            bucketed = [n for n in taking if self._groups[n].bucket is not None]
            full_wait = bucketed[0] if len(bucketed) == 1 and len(taking) > 1 and bucketed[0] in self._cap_bound and \
                not isinstance(self._cap_bound[bucketed[0]].bucket, _FrameBucket) else None
            if full_wait != self._full_wait:
                for n in (self._full_wait, full_wait):
                    if n is not None and n in self._groups:
                        self._rekey(self._groups[n])    # what it waits for changed: not parked on the old one
                self._full_wait = full_wait
            # Turns only where the framed ones alone fill the frames: a capped group with a continuous bucket among
            # them (a cap whose frame's quota is too small for a slot) runs a slot every few frames, the frames it
            # runs in are short of room for the others and the rest have room to spare, and the turns' fit cannot
            # carry the difference across: at 0.1 / 0.2 / 0.3 / 0.4 (the soak's caps) one framed group paid 0.8-1.9
            # points (an H200 and the simulated driver, twenty-first session).
            # And only where each frame's quota is one slot (at most -q): a group that needs two slots a frame took
            # them a turn apart (a b a b: twice the handoffs and 2.8 points over 1 s windows at 0.4 / 0.6 with -q 30),
            # and what the fit withheld came back as rests of the frame that broke the order (3.4 points at
            # 0.2 / 0.2 / 0.6 with --frame 200: an independent review).
            # Or where they are all the active groups, whatever their caps add up to: at 0.3 / 0.6 (0.9) the
            # frames do not fill, and by virtual time, which the hooks' measured use moves a little, the two groups'
            # order in a frame flipped every second or so, a slot more of one in a 1 s window: 3.4-4.8 points in 9
            # of 33 runs on the simulated driver (twenty-fifth session), 3.79 once on an H200 (twenty-first).
            # (Not with a latency group among them, whose slots follow its requests; a paused group, MaxUtil 0,
            # takes nothing and does not count.)
            fill = sum(cg.cfg.max_util for cg in self._frame_bound.values()) >= 1.0 - 1e-6 or \
                (len(self._frame_bound) > 1 and set(self._frame_bound) == set(taking) and
                 not any(cg.cfg.latency for cg in self._frame_bound.values()))
            self._turns_apply = fill and \
                all(cg.bucket.depth <= self.base_quota_ms + EPS for cg in self._frame_bound.values()
                    if cg.bucket is not None)
        self._key_diff = 0
        return self._targets

    def _weight(self, name: str, now: float) -> float:
        return max(self._current_targets(now).get(name, 0.0), MIN_WEIGHT)

    def _charge(self, g: _Group, ms: float, now: float) -> None:
        """Charge (ms > 0) or refund (ms < 0) GPU time to a group's cap bucket and virtual time."""
        if g.bucket is not None:
            g.bucket.add(ms, now)
        weight = self._weight(g.cfg.name, now)
        g.vtime += ms / weight
        if ms > 0 and weight <= MIN_WEIGHT + EPS:
            g.crowded = True
        self._rekey(g)

    def _refund(self, g: _Group, p: _Past, ms: float, now: float) -> None:
        """Give back `ms` of a finished slot's charge, to the cap bucket and to virtual time at the greater of the
        weight the slot was charged at and the weight of now: never more credit than either gives. At the weight of
        now, a refund made after the group's target had fallen to 0 (another group's floor came, a reload) was a
        thousandfold credit: 4 ms of measured use moved its virtual time by 4 s. At the slot's alone, so was one of
        a slot charged at the least weight whose debt _uncrowd had since forgiven (a 1 ms claim's overlap let a busy
        group hold the GPU 300 ms: an independent review)."""
        if g.bucket is not None:
            g.bucket.add(-ms, now)
        g.vtime -= ms / max(p.weight, self._weight(g.cfg.name, now))
        self._rekey(g)

    # --- internals: slots ----------------------------------------------------------------------------------------

    def _continues(self, h: _Slot, token_seq: int) -> bool:
        """Is the running slot `h` a continuation, not yet started, of slot `token_seq`?"""
        return h.prev_seq == token_seq and h.start > self._last_now

    def _shorten_past(self, token_seq: int, end: float) -> list[Decision]:
        """A finished slot really ended at `end`, before the end it was given: refund the difference."""
        for p in reversed(self._past):
            if p.token_seq == token_seq:
                if end < p.end:
                    cut = min(p.end - end, p.charge)
                    p.end = max(p.start, end)
                    p.charge -= cut
                    g = self._groups.get(p.group)
                    if g is not None:
                        self._refund(g, p, cut, end)
                        g.usage.add(p.end, p.end + cut, -cut)
                        if p.forfeit > 0 and p.end < p.forfeit_until - EPS and isinstance(g.bucket, _FrameBucket):
                            g.bucket.add(-p.forfeit, end)   # it ended before the boundary after all (a voided
                            p.forfeit = 0.0                  # continuation): its frame's rest was not lost
                break
        return []

    def _end_slot(self, now: float, reason: str, used_ms: float = 0.0, at: Optional[float] = None) -> list[Decision]:
        """End the running slot at `at` (default: now, or its deadline if that came first) and settle its charge
        (on the buckets at `now`)."""
        h = self._holder
        assert h is not None
        self._holder, self._orphan = None, None
        if h.group in self._groups:
            self._refresh(h.group, self._groups[h.group])
        end = min(max(now if at is None else at, h.start), h.deadline)
        span = end - h.start
        # The previous holder's overrun shared the start of this slot; half of it is charged to that holder.
        head = min(h.head_shared, span)
        charge = span - head / 2.0
        used = used_ms if (used_ms and math.isfinite(used_ms) and used_ms > 0) else 0.0
        if used > 0 and self.max_used_credit_ms > 0:
            charge = min(charge, self._measured_charge(span, used, head, 0.0))
        charge = max(0.0, charge - min(h.claim_credit, charge))
        g = self._groups.get(h.group)
        if g is not None:
            g.ran_out = reason in ("deadline", "continued") or end >= h.deadline - self.continue_lead_ms - EPS
            # Settle the reservation made at the grant at the weight it was made with. At the weight of now, the
            # refund of a long unused reservation (a unified group's slot floor is seconds) moved virtual time by
            # as much when the targets had changed meanwhile -- and after a slot longer than active_ms the holder
            # counts as inactive here (weight 1e-3): its virtual time fell by millions of ms, it won every choice.
            if g.bucket is not None:
                g.bucket.add(charge - h.reserved, now)
                if h.forfeit > 0 and end < h.forfeit_until - EPS:
                    g.bucket.add(-h.forfeit, now)   # ended before the boundary: the frame's rest was not lost
            g.vtime += (charge - h.reserved) / h.reserved_weight
            self._rekey(g)
            g.usage.add(h.start, end, charge)
            self._touch(g, now)
            g.demand.slot_ended(h.start, end, idle=reason != "continued" and g.waiting is None, ran_out=g.ran_out,
                                used=used)
            self._update_demand(g, end)
        if span > 0 or not h.prev_seq:
            late = h.forfeit > 0 and end >= h.forfeit_until - EPS     # (ended before the boundary: given back above)
            self._past.append(_Past(h.group, h.token_seq, h.start, end, charge, used=used, head_shared=head,
                                    forfeit=h.forfeit if late else 0.0, forfeit_until=h.forfeit_until,
                                    weight=h.reserved_weight))
        # (a continuation voided before it began never ran: no report can name it, and kept, it sat in _past
        # out of time order, where a later overrun's search for the slot it ran into met it first)
        self._prune(now)
        return [SlotEndDecision(h.group, h.token_seq, h.quota, h.start, end, h.wait_ms, reason)]

    def _apply_overuse(self, group: str, overuse_ms: float, now: float) -> None:
        """The group's hooks measured that its work ran `overuse_ms` past its last slot's deadline."""
        if not (math.isfinite(overuse_ms) and overuse_ms > 0):
            return
        last = next((p for p in reversed(self._past) if p.group == group), None)
        if last is None:
            return
        overuse = min(overuse_ms, max(0.0, now - last.end))    # it cannot have run into the future
        if overuse <= 0:
            return
        # Past its deadline the holder's last work runs into the next group's slot, time-sliced with that
        # group's first kernels on a GPU (interleaved on the simulator): each had about half of that time.
        # Half is charged here, and the next slot is credited half (when it ends, or now if it has), unless
        # its own hooks' measurement already took more off. The charges add up to the wall time.
        end = last.end + overuse
        shared = 0.0
        h = self._holder
        if h is not None and h.group != group and h.start < end and h.start >= last.end - EPS:
            shared = min(h.deadline, end) - max(h.start, last.end)
            h.head_shared = max(h.head_shared, shared)
        else:
            nxt = next((p for p in self._past if p.group != group and p.start >= last.end - EPS and p.start < end),
                       None)
            if nxt is not None:
                shared = max(0.0, min(nxt.end, end) - max(nxt.start, last.end))
                nxt.head_shared = max(nxt.head_shared, shared)
                span = nxt.end - nxt.start
                new = min(nxt.charge, span - shared / 2.0)
                if nxt.used > 0 and self.max_used_credit_ms > 0:
                    new = min(new, self._measured_charge(span, nxt.used, nxt.head_shared, nxt.tail_shared))
                refund = max(0.0, nxt.charge - max(0.0, new))
                nxt.charge -= refund
                ng = self._groups.get(nxt.group)
                if ng is not None and refund > 0:
                    self._refund(ng, nxt, refund, now)
                    ng.usage.add(nxt.start, nxt.start + shared, -refund)
        overuse -= max(0.0, shared) / 2.0
        last.tail_shared = max(last.tail_shared, max(0.0, shared))
        g = self._groups.get(group)
        last.charge += overuse
        if g is not None:
            self._charge(g, overuse, now)
            g.usage.add(last.end, last.end + overuse, overuse)

    def _apply_used(self, group: str, used_ms: float, now: float, token_seq: Optional[int] = None) -> None:
        """Measured use reported after the slot ended (with the next request, or a late release): shrink its
        charge, by at most the credit."""
        if not (math.isfinite(used_ms) and used_ms > 0) or self.max_used_credit_ms <= 0:
            return
        for p in reversed(self._past):
            if p.group == group and (token_seq is None or p.token_seq == token_seq):
                span = p.end - p.start
                p.used = used_ms
                new = min(p.charge, self._measured_charge(span, used_ms, p.head_shared, p.tail_shared))
                refund = p.charge - new
                if refund > 0:
                    p.charge = new
                    g = self._groups.get(group)
                    if g is not None:
                        self._refund(g, p, refund, now)
                        g.usage.add(p.start, p.end, -refund)
                return

    def _measured_charge(self, span: float, used: float, head_shared: float, tail_shared: float) -> float:
        """What a slot is charged by its hooks' measurement `used` (from its first kernel to the end of its drain,
        less its idle gaps), at least the span less the credit. The measurement spans both overlaps with the
        neighbouring holders -- the previous one's overrun at its start, its own overrun at its end -- of which
        the charges give this slot only half (the other half is the neighbour's); so half of each comes off it
        here too. Compared whole, a busy holder's measurement (its full overrun in it) was above its wall-time
        charge (half of that overrun) and nothing was ever forgiven: spin tenants sat 1.5-2 pp under their caps
        on the simulator, charged their own gaps and the handoffs."""
        measured = used - (max(0.0, head_shared) + max(0.0, tail_shared)) / 2.0
        return max(measured, span - self._credit(span))

    def _credit(self, span: float) -> float:
        """How much of a slot the hooks' measurement may forgive: the handoff at its start (the grant's travel,
        the GPU switching contexts, the previous holder's last queued work) and the holder's own idle gaps after
        its synchronisations, at most max_used_credit_ms and at most 15% of the slot, so that a client that
        under-reports gains little."""
        return min(self.max_used_credit_ms, MAX_CREDIT_FRACTION * span)

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_ms
        while self._past and self._past[0].end < cutoff:
            self._past.popleft()
        while self._claims and self._claims[0][2] < cutoff:
            self._claims.popleft()

    def _theta(self, g: _Group) -> float:
        """The shortest slot worth granting a capped group: the min quota, or its burst if that is smaller."""
        theta = min(self.min_quota_ms, self.base_quota_ms)
        if g.waiting is not None and g.waiting.burst > 0:
            theta = min(theta, g.waiting.burst)
        if g.bucket is not None and g.cfg.max_util < 1.0:
            # the slot a full bucket allows (a frame's quota)
            full = g.bucket.depth if isinstance(g.bucket, _FrameBucket) else self.bucket_ms / (1.0 - g.cfg.max_util)
            # Fewer, longer slots: every handoff costs the GPU a context switch (~0.14 ms), so a capped group
            # waits until its bucket allows a good part of a full slot; waiting costs it nothing (the bucket
            # fills meanwhile), as long as it is served before the bucket overflows (_before_overflow).
            fraction = self.cap_slot_fraction
            if g.ran_out and g.cfg.name == self._full_wait:
                # A busy group with a continuous bucket beside uncapped ones waits for a full bucket: its slots then
                # repeat with the refill period (bucket_ms / MaxUtil: 500 ms at 0.05, which divides 1 s), so a 1 s
                # window holds two of them. Granted half full whenever a neighbour's slot ended and its virtual
                # time was the least, a deep-queued group capped at 0.05 beside an uncapped one ran 16 ms every
                # 316 ms on the simulated driver (four slots in some seconds: 0.068-0.077 of a 1 s window).
                fraction = 1.0
            theta = max(theta, fraction * full)
            theta = min(theta, full, self.base_quota_ms)     # never more than a full bucket allows
        return theta

    def _quota(self, g: _Group, at: float) -> Optional[float]:
        """The slot the group may be granted at time `at`, or None if its cap does not allow a useful one."""
        cap = g.cfg.max_util
        if cap <= 0.0 or at < self.not_before.get(g.cfg.name, -math.inf) - EPS:
            return None
        # A unified group whose slots end in swaps gets longer ones (gemini/scheduler/residency.py sets this).
        longest = max(self.base_quota_ms, self.quota_floor.get(g.cfg.name, 0.0))
        if g.bucket is None:
            if self.fair_cycle_ms > 0 and not g.cfg.latency and g.cfg.name not in self.not_before:
                length = self._cycle_length(at)
                if length is not None:
                    return self._cycle_quota(g, at, longest, length)
            return longest
        room = self._room(g, at)            # run this long and the bucket is empty at the end
        if g.cfg.aligned:
            # only inside its window of the grid, and never past the window's end (on every GPU the same)
            period, length = self._grid(g)
            phase = (at + self.clock_origin_ms) % period
            quota = min(length - phase, room)
            return quota if quota >= self.min_quota_ms - EPS else None
        theta = self._theta(g)
        if room < theta - EPS:
            return None
        quota = min(longest, max(room, theta))
        length = self._cycle_of(g, at) if self.fair_cycle_ms > 0 else None
        if length is not None:
            # held below its cap by the others' shares, it takes its fair share of the cycle as an uncapped group
            quota = min(quota, self._cycle_quota(g, at, longest, length))
        return quota

    def _in_cycle(self, g: _Group, at: float) -> bool:
        """`--fair-cycle`: does the group take part in the cycle (_cycle_of)?"""
        return self._cycle_of(g, at) is not None

    def _cycle_of(self, g: _Group, at: float) -> Optional[float]:
        """`--fair-cycle`: the cycle's length (_cycle_length) if the group takes part in it, a batch group whose fair
        share is not its cap (an uncapped one, or one the others' shares hold under its cap), with a share to take;
        else None (a group at its cap keeps its frame's budget; a light one, held to its demand, takes slots by
        virtual time as it asks: given its share of the cycle, the light groups' unused slots shrank the cycle and a
        floor group's turns no longer fitted its frames, 0.36 of a floor of 0.35's 0.375 beside two light groups: an
        independent review)."""
        if g.cfg.latency or g.cfg.name in self.not_before:
            return None
        self._current_targets(at)
        if g.cfg.name in self._limited:
            return None
        share = self._shares.get(g.cfg.name, 0.0)
        if share > 0 and (g.bucket is None or share < g.cfg.max_util - EPS):
            return self._cycle_length(at)
        return None

    def _cycle_length(self, at: float) -> Optional[float]:
        """`--fair-cycle`: the cycle for the active groups now, stretched so that the least share's slot is a useful
        one (-m), or None where the largest share's slot would then pass -q: the cycle is off for that set (by
        virtual time, slots of -q). Rounding a small share's slot up to -m instead lengthened the cycle behind the
        others' backs: a floor of 0.9 beside three groups owed 0.033 got 0.856 (90 ms of every 105: an independent
        review)."""
        self._current_targets(at)
        shares = [t for n, t in self._shares.items() if t > 0 and n in self._groups and not self._groups[n].cfg.latency
                  and n not in self._limited]
        if not shares:
            return None
        length = max(self.fair_cycle_ms, self.min_quota_ms / min(shares))
        return length if max(shares) * length <= self.base_quota_ms + EPS else None

    def _cycle_quota(self, g: _Group, at: float, longest: float, length: float) -> float:
        """`--fair-cycle`: the group's fair share of the cycle `length` (_cycle_length; a group whose share is
        nothing, a useful slot: -m), never more than -q, never below -m or a unified group's floor. The groups take
        turns (_cycle_turn), so a group's share comes from its slots' length, not from its virtual time.
        (Correcting the length by how far a group's virtual time lagged the others' was tried: the holder's reserved
        slot always counts ahead of the group that follows it, and the slots grew to 93 / 40 ms at 0.7 / 0.3, a
        cycle that does not divide 1 s.)"""
        self._current_targets(at)
        share = self._shares.get(g.cfg.name, 0.0)
        return max(self.min_quota_ms, self.quota_floor.get(g.cfg.name, 0.0), min(longest, share * length))

    def _eligible_at(self, g: _Group, now: float) -> float:
        cap = g.cfg.max_util
        if cap <= 0.0:
            return math.inf
        now = max(now, self.not_before.get(g.cfg.name, -math.inf))
        if g.bucket is None:
            return now
        if g.cfg.aligned:
            period, length = self._grid(g)
            t = g.bucket.time_to_reach(self.min_quota_ms * (1.0 - cap), now)
            for _ in range(64):      # the next window (from t) whose start finds the bucket full enough
                phase = (t + self.clock_origin_ms) % period
                if phase > length - self.min_quota_ms:
                    t += period - phase
                if self._quota(g, t) is not None:
                    return t
                t = max(t + 1e-3, g.bucket.time_to_reach(self.min_quota_ms * (1.0 - cap), t))
            return t
        if isinstance(g.bucket, _FrameBucket):
            return self._frame_ready_at(g, now)
        need = self._theta(g) * (1.0 - cap)
        t = g.bucket.time_to_reach(need, now)
        if t > now and self._quota(g, t) is None:   # float rounding: nudge so the daemon does not spin
            t += 1e-3
        return t

    def _frame_ready_at(self, g: _Group, now: float) -> float:
        """When a framed group's cap first allows a useful slot, from `now`: its level moves only at frame boundaries
        (and at charges, which re-key it). A rest too small for a useful slot is not used to start one before the
        boundary (it passes the boundary instead, up to the bucket's carry)."""
        b = g.bucket
        assert isinstance(b, _FrameBucket)
        theta = self._theta(g)
        t = now
        for _ in range(64):
            if b.room(t) >= theta - EPS:
                return t
            t = b.next_boundary(t)
        return t

    def _grid(self, g: _Group) -> tuple[float, float]:
        """A `Slots = aligned` capped group's grid: a window of `length` ms at the start of every `period` ms of
        the host's monotonic clock, length / period = MaxUtil (the bucket refills one window per period)."""
        length = min(self.bucket_ms, self.base_quota_ms)
        return length / g.cfg.max_util, length

    def _choose(self, at: float, now: float, holder: Optional[str] = None) -> Optional[tuple[str, float]]:
        """Who gets the slot that starts at `at`, and its quota: among the eligible waiting groups (and the
        holder, when deciding a continuation), the least virtual time; a tie goes to a waiting group (the
        holder's virtual time already counts the slot it holds), then to the one that has waited longest."""
        # Cheap keys first, the quota (bucket arithmetic) only as far down the order as needed: the waiting
        # groups are kept in a heap in this order (_rekey), so a decision pops the ineligible ones at its top
        # (they go back after) and looks at no other group (bench/bench_policy_cost.py).
        self._unpark_due(at)
        hg = self._groups.get(holder) if holder is not None else None
        hkey = (hg.vtime, True, math.inf, holder) if hg is not None else None
        heap = self._wheap
        popped: list[tuple[float, bool, float, str, int]] = []
        best: Optional[tuple[tuple, str, float]] = None
        pending = hkey          # the holder's place in the order, until it is passed
        try:
            while True:
                while heap and not self._live(heap[0]):
                    heapq.heappop(heap)             # stale: re-keyed since, granted or gone
                if pending is not None and (not heap or pending < heap[0][:4]):
                    key: tuple = pending
                    pending = None
                    g = hg
                elif heap:
                    entry = heapq.heappop(heap)
                    popped.append(entry)
                    if entry[3] == holder:
                        continue                    # it waits for its next slot: it competes as the holder
                    key = entry[:4]
                    g = self._groups[entry[3]]
                else:
                    break
                assert g is not None
                quota = self._quota(g, at)
                if quota is not None:
                    best = (key, key[3], quota)
                    break
                if g is not hg and self._park(g, at):
                    popped.pop()                    # parked: its entry is stale now
        finally:
            for entry in popped:
                heapq.heappush(heap, entry)
        if best is None:
            return None
        if self.frame_turns:
            best = self._frame_turn(best, at, holder)
        if self.fair_cycle_ms > 0:
            best = self._cycle_turn(best, at, holder)
        if not self._aligned:
            return best[1], best[2]
        least = best[0][0]
        # An aligned group inside its window goes first (its peers on the other GPUs run now), unless it is
        # more than two windows ahead in virtual time: then the others' floors come first.
        cands: list[tuple[tuple, _Group]] = [((g.vtime, False, g.waiting.arrival, name), g)
                                             for name, g in self._aligned.items()
                                             if g.waiting is not None and name != holder]
        if hg is not None and hkey is not None and hg.cfg.aligned and hg.bucket is not None:
            cands.append((hkey, hg))
        for key, g in sorted(cands):
            name = key[3]
            if g.cfg.max_util <= 0:
                continue                # paused (MaxUtil 0): never granted, and it has no grid
            if g.vtime > least + 2 * self._grid(g)[1] / self._weight(name, at) + EPS:
                continue
            quota = self._quota(g, at)
            if quota is not None:
                return name, quota      # the first such in the order: the least virtual time among them
        return best[1], best[2]

    def _uncrowd(self, now: float) -> None:
        """A group that had a target of 0 while active (the others' floors added up to the whole GPU) was charged
        at the least weight, 1e-3: a 100 ms slot it got on a tie or from what the others left added 100 s to its
        virtual time. Once it has a share again (a floor's group left) that debt would keep it from the GPU for as
        long as the others take to run 100 s of virtual time: 48 s at a fair share of 0.5 (an independent review's
        fuzzing). Its virtual time is brought back to within one base slot, at its new weight, of the least of the
        other active groups'."""
        targets = self._current_targets(now)
        h = self._holder
        names, self._uncrowded = self._uncrowded, set()
        for name in self._in_order(n for n in names if n in self._groups and targets.get(n, 0.0) > EPS):
            if not self._groups[name].crowded:
                continue        # (its target was 0 a while, but nothing was charged at that weight: what it owes
                #                  it owes; a unified group's 2 s slot came back as 0.2 s: an independent review)
            if h is not None and h.group == name:
                # Not while it holds: its virtual time carries the slot's reservation, undone at its end at the
                # weight of the grant (1e-3): clamped now, what the slot leaves unused came back 1000-fold as
                # credit, and it held the GPU for 10 s while the other waited (an independent review). After.
                self._uncrowded.add(name)
                continue
            g = self._groups[name]
            g.crowded = False
            least = self._min_active_vtime(now, exclude=g)
            if least is not None and g.vtime > least + self.base_quota_ms / targets[name]:
                g.vtime = least + self.base_quota_ms / targets[name]
                self._rekey(g)
            # Its finished slots' debt is forgiven: a refund of them goes back at its weight now at least, also if
            # its target falls to 0 again before the refund (at the least weight, 4 ms measured were 4 s of credit
            # on a debt no longer owed: an independent review)
            for p in self._past:
                if p.group == name and p.weight < targets[name]:
                    p.weight = targets[name]

    def _schedule(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        if self._uncrowded or self._targets_key is None or self._key_diff:
            self._current_targets(now)          # (a change of the active set is seen before the choice)
            if self._uncrowded:
                self._uncrowd(now)
        h = self._holder
        if h is None and self._gap is not None:
            if now < self._gap.until - EPS:
                return out          # the slot a voided continuation continued still runs
            self._end_idle_gap()
        if h is not None:
            if now < h.deadline - self.continue_lead_ms - EPS or (h.decided and now < h.deadline):
                return out
            if not h.decided:
                h.decided = True
                out += self._decide_continuation(h, now)
                if self._holder is not h:
                    return out            # continued
                if now < h.deadline:
                    return out            # someone else goes next, at the deadline
            out += self._end_slot(now, "deadline")
        # No holder: grant the best eligible waiting group, or else the rest of a frame.
        choice = self._choose(now, now) or self._choose_rest(now)
        if choice is None:
            return out
        name, quota = choice
        quota = self._before_overflow(name, now, quota)
        g = self._groups[name]
        assert g.waiting is not None
        wait = now - g.waiting.arrival
        self._clear_waiting(name, g)
        self._bound_lag(name, g, now)
        out.append(self._grant(name, g, quota, now, wait))
        return out

    def _bound_lag(self, name: str, g: _Group, now: float) -> None:
        """A group granted far behind the next waiting group in virtual time keeps at most two of the longer of
        their slots' worth of credit, at the lesser of their weights (which is more than two busy groups' turns
        ever put between them: after a 100 ms slot of a MinUtil-0 group beside a 0.7 one, 333 of 667). A light group
        that stays active while using less than its share fell behind without bound, and a group that started late
        or came back, caught up only to it, inherited that lag: 0.96 of the GPU for 10 s beside a busy group that
        got 0.01 (tests/policy_sim.py; an independent review's fuzzing). One peek at the waiting heap."""
        heap = self._wheap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)                     # stale: re-keyed since, granted or gone
        if not heap or g.cfg.aligned:
            return
        nxt = self._groups[heap[0][3]]
        # (the targets as last computed: recomputing them here, when the active set moved, made each decision's
        # cost grow with the groups; a stale target only moves the slack, and a smaller one only widens it)
        targets = self._targets
        weight = max(min(targets.get(name, 0.0), targets.get(heap[0][3], 0.0)), MIN_WEIGHT)
        slack = 2.0 * max(self.base_quota_ms, g.last_quota, nxt.last_quota) / weight
        if g.vtime < nxt.vtime - slack:
            g.vtime = nxt.vtime - slack

    def _frame_turn(self, best: tuple, at: float, holder: Optional[str]) -> tuple:
        """`--frame-turns`: when the caps of the groups held to them add up to 1 (their slots fill the frames), or
        they are all the active batch groups (_turns_apply), and _choose's pick is a busy framed one of them, the
        busy framed one that asked earliest goes instead (a holder deciding its continuation has not asked: it goes
        last). Each of them gets its frame's budget whatever their order (less its part of what the frame lacks:
        _fit_turn); by virtual time, which their charges' noise moves a little, their order reshuffled from frame to
        frame, and a 1 s window not aligned with the frames held a slot more or fewer of a group: 2-5 points in
        tests/policy_sim.py, 4-6 on H100s (docs/benchmarks.md, "Twentieth session"). Taking turns, the slots keep
        their places in the frames. Busy (the last slot ran to its deadline): a light group that asks now and then
        keeps its place by virtual time (taking turns behind the busy ones that always asked first, a request's p99
        doubled: an independent review); and not with another group among them (with a floor's group between them
        placed by virtual time, turns swung 1 s windows by 9.5 points, 3 without)."""
        self._current_targets(at)       # _frame_bound as of now (a reload's removed group must not be picked)
        name0 = best[1]
        g = self._groups.get(name0)
        if not self._turns_apply or g is None or name0 not in self._frame_bound or \
                not (g.ran_out or name0 == holder):
            return best
        if any(name in self._frame_bound for name in self.not_before):
            # a unified group paced by its swaps (gem-schd's residency) cannot keep a place in every frame: counted
            # as a turn to come and cut to the frame's rest when it could run, a 0.5 group got 0.25 (by virtual
            # time 0.40, continued across a boundary while allowed: an independent review's model of the pacing)
            return best
        pick = self._earliest_turn(best, g, at, holder,
                                   ((n, cg) for n, cg in self._frame_bound.items() if n in self._ready))
        return pick[0], pick[1], self._fit_turn(pick[1], pick[2], at)

    def _earliest_turn(self, best: tuple, g: _Group, at: float, holder: Optional[str],
                       candidates: Iterable[tuple[str, _Group]]) -> tuple:
        """Taking turns (_frame_turn, _cycle_turn): of `best` (_choose's pick, group `g`) and the busy `candidates`
        waiting now with a quota, the one that asked earliest; the holder deciding its continuation has not asked,
        so it goes last."""
        pick = best
        pick_arrival = g.waiting.arrival if (g.waiting is not None and best[1] != holder) else math.inf
        for name, cg in candidates:
            if name == holder or cg.waiting is None or not cg.ran_out or cg.waiting.arrival >= pick_arrival - EPS:
                continue
            quota = self._quota(cg, at)
            if quota is not None:
                pick, pick_arrival = ((cg.vtime, False, cg.waiting.arrival, name), name, quota), cg.waiting.arrival
        return pick

    def _cycle_turn(self, best: tuple, at: float, holder: Optional[str]) -> tuple:
        """`--fair-cycle`: when _choose's pick is a busy group of the cycle (_in_cycle), the busy group of the cycle
        that asked earliest goes instead (a holder deciding its continuation has not asked: it goes last), so that
        they take turns in a fixed order and every cycle holds each one's slot. By virtual time their slots, each
        worth the same virtual time, tie at every turn, and the charges' noise decided who went first: a a b b now
        and then, a second with a slot more of one group (3-5 points in tests/policy_sim.py)."""
        name0 = best[1]
        g = self._groups.get(name0)
        if g is None or not self._in_cycle(g, at) or not (g.ran_out or name0 == holder):
            return best
        return self._earliest_turn(best, g, at, holder,
                                   ((n, cg) for n, cg in self._ready.items() if self._in_cycle(cg, at)))

    def _fit_turn(self, name: str, quota: float, at: float) -> float:
        """`--frame-turns`: a turn-taker's slot from `at`, cut so that the turns still to come in this frame share
        what is left of it in proportion to their caps. Each slot could run its frame's quota and the carry its hooks'
        measure gave back, and with the handoffs the slots' wall time added up to more than the frame: uncut, the last
        group in the frame paid all of it, 3-3.5 points under its cap on the simulated driver
        (tests/probe_frame_turns.py), and cut in proportion to their rests (the carries are not in proportion to the
        caps) it still paid every handoff. Never longer than the cap allows (so never past a cap), and never below a
        useful slot (a turn that finds the frame nearly spent crosses the boundary, paid from the next frame)."""
        g = self._groups[name]
        b = g.bucket
        if not isinstance(b, _FrameBucket):
            return quota
        left = b.next_boundary(at) - at
        weights = b.depth
        # (a walk over the framed groups held to their caps, twice a slot: with turns their caps add up to 1 and
        # each frame's quota is at least --min-frame-quota, so there are at most frame / min-frame-quota of them,
        # 5 at the defaults; a light group, a claim or a rest may still take time in the frame: a turn then pays)
        for other, cg in self._frame_bound.items():
            if other == name or not cg.ran_out:
                continue
            assert isinstance(cg.bucket, _FrameBucket)
            if cg.bucket.room(at) >= self._theta(cg) - EPS:
                weights += cg.bucket.depth      # its turn in this frame is still to come
        return min(quota, max(b.depth * left / weights, self._theta(g)))

    def _decide_continuation(self, h: _Slot, now: float) -> list[Decision]:
        """At the lead point: does the holder keep the GPU past its deadline? It competes with the waiting
        groups with its virtual time as it will be at the deadline (the reservation already counts it)."""
        g = self._groups.get(h.group)
        if g is None or not self.continuation:
            return []
        choice = self._choose(h.deadline, now, holder=h.group)
        if choice is None or choice[0] != h.group:
            return []
        # As at a fresh grant (_schedule): continued, a group that came in far behind the others kept all of its lag
        # (a group added by a reload beside a light one, with a floor of 0.6, held the GPU 5.6 s while a busy group
        # owed 0.2 waited: its first grant came before that group had asked again)
        self._bound_lag(h.group, g, now)
        quota = self._before_overflow(h.group, h.deadline, choice[1])
        # Continue: the old slot ends at its deadline, the new one starts there.
        deadline = h.deadline
        out: list[Decision] = list(self._end_slot(now, "continued", at=deadline))
        g.continuations += 1
        grant = self._grant(h.group, g, quota, now, 0.0, start=deadline, prev_seq=h.token_seq)
        out.append(grant)
        return out

    def _before_overflow(self, name: str, start: float, quota: float) -> float:
        """End the slot by the time an active capped group's bucket is full: past that its refill would be lost,
        and a group capped at 0.3 next to an uncapped one waiting out 100 ms slots got 0.26 (0.5: 0.33) instead of
        the target its cap allows. Active, not only waiting: a busy group's next request is usually still on its
        way when the slot after its own is granted. Never shorter than a useful slot (min_quota_ms). Only the slot
        of a holder that can spare it is cut (_spare): an uncapped one, or one that the others' shares hold at or
        under half its cap, or a framed one nearer its cap by what its frame holds over its share; a capped one at
        its cap has a slot of its bucket's worth, and between capped groups
        whose caps add up to 1 or more the buckets cannot all be kept from filling (cutting there only splintered
        the slots: six times the handoffs at 0.4 / 0.6 in tests/policy_sim.py)."""
        holder = self._groups.get(name)
        if holder is None:
            return quota
        spare = self._spare(name, holder, start)
        if spare <= 0:
            return quota
        limit = quota
        window = math.inf
        active = self._active_names(start)
        for other, g in self._aligned.items():
            if other == name or g.cfg.max_util <= 0 or other not in active:
                continue
            # the next window of an aligned group that is waiting or ran within the last period (a busy one
            # asks again just after its slot): the holder makes way exactly at its start (the group's peers on
            # the other GPUs start then), even if that leaves it less than a useful slot
            period, _ = self._grid(g)
            if g.waiting is not None or start - g.last_active <= period:
                window = min(window, period - (start + self.clock_origin_ms) % period)
        useful = min(quota, self.min_quota_ms)
        self._current_targets(start)        # (and _cap_bound with them)
        # The active capped groups whose fair share is their cap, and the framed ones behind the holder that a
        # skipped frame would keep from their share (_overflow_walk). Once the limit is down to a useful slot the
        # others cannot change the answer, so the walk stops there (a waiting group whose bucket is full already,
        # the usual case when many groups are busy, ends it at once).
        for other, cg in self._overflow_walk(holder):
            if cg is None or other == name or cg.cfg.max_util <= 0 or other not in active:
                continue
            assert cg.bucket is not None
            full = cg.bucket.time_to_reach(cg.bucket.depth, start)
            if self._makes_no_way(other, cg, start, full):
                continue
            if isinstance(cg.bucket, _FrameBucket):
                # what is left of its frame is lost at the boundary unless a slot of its starts before it (room);
                # full or not, nothing is lost before then (taken as lost at once, a full frame's budget cut every
                # holder to a useful slot while that group, ahead in virtual time, was not chosen: 5 ms slots and 118
                # handoffs a second at 0.6 / 0.5 / 0.45 / 0.2 / 0.6 in tests/policy_sim.py, an independent review)
                level = cg.bucket.at(start)
                theta = self._theta(cg)
                boundary = cg.bucket.next_boundary(start)
                if level > cg.bucket.carry and level >= theta - EPS:
                    full = max(start, boundary - level)
                else:
                    # and the next frame's budget at the boundary after (a debt of a fraction of a millisecond kept
                    # the bucket from its depth at the next boundary, so it was full only two boundaries on, and an
                    # uncapped 100 ms slot covered all of the next frame: a group whose floor is its cap, 0.35, got
                    # 0.285 beside a light group in tests/policy_sim.py, an independent review)
                    after = cg.bucket.at(boundary)
                    if after >= theta - EPS:
                        full = min(full, max(boundary, cg.bucket.next_boundary(boundary) - after))
            limit = min(limit, full - start)
            if limit <= useful:
                break
        cut = min(max(useful, limit), max(window, EPS))
        return cut if quota - cut <= spare + EPS else quota

    def _makes_no_way(self, name: str, g: _Group, start: float, full: float) -> bool:
        """Whether a holder's slot granted at `start` is not cut for capped group `name`'s budget, which is full by
        `full` (_before_overflow): the group is not asking, and
        - its bucket is full already: it has nothing to lose by waiting (idle now). Not a busy framed group whose
          slot just ran out, whose bucket is full at a boundary while its next request is on its way: skipped there,
          a holder granted at the boundary ran over the time that group's frame needed, its slot crossed the next
          boundary, and a group capped at 0.25 got 0.193 beside one at 0.8 (a review). Only just after
          (REQUEST_ON_ITS_WAY_MS): a group whose last slot ran out and that then stopped asking (a burst's end) cut
          every holder to 5 ms slots until it was inactive, 64 grants a second instead of 10 (a second review);
        - or it is framed, and walked only as busy (_frame_tight's, not at its cap), and its burst ended: its next
          frame's budget cut every holder to 5 ms slots up to the boundary, 9 a second where light groups' demand had
          raised a busy group's target over half its cap (a sweep of tests/policy_sim.py);
        - or it is framed and light, its use (demand.py) with the margin under half its cap: what is left of its
          frame it leaves anyway, and cut for it, holders ran 5 ms slots up to its boundaries, 16 a second beside a
          group asking 2 ms every 20 ms and capped at 0.21, 20 a second beside such a latency group. The price: a
          latency group whose claims are spent, asking 5 ms every 20 ms and capped at 0.29, queued behind the others'
          whole slots, got 0.11 instead of 0.16 (for 44 handoffs a second instead of 62)."""
        if g.waiting is not None:
            return False
        framed = isinstance(g.bucket, _FrameBucket)
        if framed and g.ran_out and start - g.last_active <= REQUEST_ON_ITS_WAY_MS:
            return False                            # its next request is on its way
        if full <= start + EPS:
            return True
        if not framed:
            return False
        light = g.demand.use is not None and MARGIN * g.demand.use <= 0.5 * g.cfg.max_util + EPS
        return name not in self._cap_bound or light

    def _spare(self, name: str, g: _Group, at: float) -> float:
        """How much of the holder's slot may be cut to make way for the others' budgets (_before_overflow): all of an
        uncapped group's, or of a capped one's that the others' shares hold at or under half its cap (not aligned:
        its windows are its peers' on the other GPUs). Such a group reaches its share even if it skips every other
        frame, so a shorter slot costs it nothing; a capped group's 0.7 and 0.8 slots (its frame's budget) covered
        every other frame of the others at 0.4 / 0.6 / 0.8 (0.239 / 0.339 / 0.419 instead of a third each, and 0.25 /
        0.25 / 0.25 / 0.7: 0.202 each and 0.389, in tests/policy_sim.py). A framed one nearer its cap can spare what
        its frame holds over its share: with light groups' demand in the targets, a group capped at 0.84 and owed
        0.61 did not yield, its 84 ms slots covered a frame of a group capped at 0.22 now and then, and that one got
        0.16 (a sweep of tests/policy_sim.py). 0: it keeps its slot."""
        if g.bucket is None:
            return math.inf
        if g.cfg.aligned:
            return 0.0
        target = self._current_targets(at).get(name, 0.0)
        if target <= 0.5 * g.cfg.max_util + EPS:
            return math.inf
        if isinstance(g.bucket, _FrameBucket):
            return max(0.0, (g.cfg.max_util - target) * g.bucket.frame)
        return 0.0

    def _overflow_walk(self, holder: _Group) -> list[tuple[str, _Group]]:
        """The groups whose budgets _before_overflow keeps a yielding holder's slot from wasting: the capped groups
        whose fair share is their cap (_cap_bound), and a framed group that the others' shares hold below its cap
        while it is behind the holder in virtual time. What is left of a frame is lost at its boundary, and such a
        group's frames (MaxUtil x the frame) hold little more than its share of them: three busy groups capped at
        0.4 / 0.5 / 1 (a third each) got 0.209 / 0.289 / 0.499 in tests/policy_sim.py, the uncapped one's 100 ms slots
        covering every other frame of the other two. Only where its cap is under twice its share (_frame_tight: with
        more, every other frame is enough) and while it is behind: at 0.5 / 1 / 1 the 0.5 group is such a group
        (0.5 < 2 / 3), but cut for it whenever it was in that set, the uncapped slots splintered (45 handoffs a second
        instead of 10, where it reaches its third uncut:
        test_uncapped_slots_are_not_cut_for_a_capped_group_that_its_fair_share_holds_below_its_cap). With
        --fair-cycle such a group takes its share of each cycle instead (_cycle_of). The set is kept with the
        targets, so a decision does not look at every capped group (tests/test_policy_scale.py)."""
        walk = list(self._cap_bound.items())
        if self.fair_cycle_ms > 0:
            return walk
        for other, cg in self._frame_tight.items():     # (active ones, as of the targets; never aligned)
            # (busy: its last slot ran out; a light group's frame stays nearly full whatever the others do, and cut
            # for it, a latency group at 0.3 beside 0.5 / 0.5 / 0.7 cost 52 handoffs a second instead of 30)
            if cg.ran_out and cg.vtime < holder.vtime:
                walk.append((other, cg))
        return walk

    def _grant(self, name: str, g: _Group, quota: float, now: float, wait: float, start: Optional[float] = None,
               prev_seq: int = 0) -> GrantDecision:
        """Grant a slot from `start` (default now; a continuation's starts at the old deadline)."""
        start = now if start is None else start
        self._seq += 1
        g.grants += 1
        g.last_quota = quota
        self._touch(g, now)
        weight = self._weight(name, now)
        if isinstance(g.bucket, _FrameBucket) and start > now:
            # a continuation decided before the boundary that its slot starts after: charged before the boundary's
            # refill, the refill's ceiling would not hold (a frame gave 90 ms against 58)
            g.bucket.advance(start)
        lost = g.bucket.forfeit(start, quota) if isinstance(g.bucket, _FrameBucket) else 0.0
        self._charge(g, quota, now)                       # reserved; settled when the slot ends
        self._holder = _Slot(name, self._seq, start, quota, wait, reserved=quota, reserved_weight=weight,
                             prev_seq=prev_seq)
        if isinstance(g.bucket, _FrameBucket):
            if lost > 0:        # given back if the slot ends before the boundary after all
                g.bucket.add(lost, now)
                self._holder.forfeit, self._holder.forfeit_until = lost, g.bucket.next_boundary(start)
        self._refresh(name, g)
        return GrantDecision(name, quota, self._seq, start, bool(prev_seq), prev_seq, wait)

    # --- internals: claims ----------------------------------------------------------------------------------------

    def _claim_regrant_level(self) -> float:
        return self.claim_burst_ms / 2.0

    def _claim_ok(self, g: _Group, now: float) -> bool:
        if not g.cfg.latency or g.claim_bucket is None or g.cfg.min_util <= 0 or g.cfg.max_util <= 0:
            return False
        if g.bucket is not None and g.bucket.at(now) <= 0:
            return False
        return g.claim_bucket.at(now) > 0

    def _claim_right_back_at(self, g: _Group, now: float) -> float:
        """The earliest time `_update_claim_right` could give a latency group its right back: both its claim budget
        half full and its cap's bucket above empty (inf: never, e.g. MinUtil 0). Waking at the budget alone, the
        daemon's timer fired at once and for nothing, again and again, while the cap held the right back -- and
        for good with MinUtil 0 (a budget that never drains is always full)."""
        if g.claim_bucket is None or g.cfg.min_util <= 0 or g.cfg.max_util <= 0:
            return math.inf
        at = g.claim_bucket.time_to_reach(self._claim_regrant_level(), now)
        if g.bucket is not None and g.bucket.at(at) <= 0:
            at = max(at, g.bucket.time_to_reach(2 * EPS, at))   # (reached: above EPS, so above 0)
        return at

    def _update_claim_right(self, g: _Group, now: float) -> list[Decision]:
        """Take the right to claim away when the budget is spent; give it back when it is half full again."""
        if not g.cfg.latency or g.claim_bucket is None:
            return []
        if g.claim_allowed:
            if not self._claim_ok(g, now):
                g.claim_allowed = False
                return [ClaimRightDecision(g.cfg.name, False, self.max_claim_ms)]
            return []
        if g.claim_bucket.at(now) >= self._claim_regrant_level() - EPS and self._claim_ok(g, now):
            g.claim_allowed = True
            return [ClaimRightDecision(g.cfg.name, True, self.max_claim_ms)]
        return []


def group_names(decisions: Iterable[Decision]) -> list[str]:
    return [d.group for d in decisions]
