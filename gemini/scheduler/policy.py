"""The token scheduling policy of gem-schd: pure logic, no I/O, time passed in.

All times are milliseconds (floats) on one monotonic clock chosen by the caller; the policy never reads a clock,
so it can be driven on simulated time in tests and by the daemon on real time.

It is a port of Gemini's scheduler (NTHU-LSALAB/Gemini, src/scheduler.cpp and src/schd-priority.cpp):

* one token; a grant appends the entry [now, now + quota] to the group's history;
* usage of a group = the time its entries cover inside the sliding window [now - window_eff, now], where
  window_eff = min(window, now - first request); time where entries of different groups overlap (a holder that
  overran its slot while the next group already ran) is split evenly between those groups;
* a waiting group is eligible while it is below its MaxUtil; among eligible groups, those below their MinUtil
  come first (largest missing / (missing + usage) first, missing = MinUtil x window_eff - usage), then the least
  usage; ties go to the one that has waited longest;
* the quota adapts to the burst size the group's clients report;
* the slot ends at its deadline (the next group is granted then) or earlier when the holder releases the token
  (its clients are idle: work-conserving) or comes back with a new request (as in Gemini).

Defects of the original that are fixed here:

* MaxUtil accuracy. Gemini grants a full quota whenever usage < MaxUtil x window, so an always-busy capped group
  overshoots its cap by about quota x (1 - share) / window (2.5 pp with the defaults). Here a grant is decided on
  the group's *projected* usage instead: the headroom h is the longest slot q such that the group's usage over the
  window ending at now + q (its past entries still inside that window, plus q) stays within MaxUtil x
  window_eff(now + q). The quota is trimmed to h, and a group only becomes eligible once h reaches a minimum
  useful slot (theta = min(min quota, its quota)), so no tiny slots are handed out. An always-busy capped group
  therefore sits exactly at its cap at the end of each of its slots and never above it, which keeps the long-run
  share within a fraction of a point of the cap. (Trimming alone with the old eligibility test would also work,
  but waiting for theta of headroom avoids a stream of sliver-sized slots and their handoff costs.)
  The exception, as in Gemini: a group with no usage in the window is always eligible (for MaxUtil > 0), so that
  right after the scheduler starts (window_eff ~ 0) groups get going; the effective window corrects the share
  within a few slots.
* MinUtil under overload. Gemini gives a group priority only once it is already below its MinUtil, so an
  always-busy guaranteed group hovers just under its guarantee (1-2 pp with the defaults). Here "below MinUtil" is
  judged on the usage the group will have at the next decision point (now + the longest slot that may be granted
  instead of it), which keeps it at or above its guarantee.
* Interleaving. After the MinUtil groups, Gemini picks the least *absolute* usage, so a group with a larger cap
  waits behind a smaller one until the smaller one is capped: slots come in window-long waves (0.3/0.6 groups
  alternate 1:1, then the 0.6 group runs alone), and since history leaves the window in the order it came, the
  wave repeats every window. Shares are right over the window but off by tens of points over 1 s. Here usage is
  compared as a fraction of each active group's fair target -- min(cap, level), water-filled so that the targets
  add up to 1 -- so slots interleave in proportion to where the shares converge, from the start. Caps stay caps:
  groups whose caps do not bind still split evenly, and with equal caps this is exactly Gemini's rule.
* The time at which a waiting, capped group next becomes eligible is computed exactly (`next_wakeup`), instead of
  Gemini's "when the oldest history entry leaves the window", which can wake too early (busy loop) or too late.
* Quota: no hard-coded constants; base/min quota and window are parameters. Without a burst estimate the base
  quota is used (bounded by MaxUtil x window); with one, clamp(0.5 x burst + 0.5 x previous quota, min quota,
  MaxUtil x window), where the cap wins if MaxUtil x window is below the min quota.
* Measured use. A slot is charged from its grant, but its holder only starts after the grant has travelled
  to its processes and the GPU has switched contexts (about 0.14 ms on an H200), so every group fell short of
  its cap by that much per slot (2-3 pp with 20 ms slots). The hooks measure the GPU time they really had in
  a slot with CUDA events; the charge shrinks to it, by at most max_used_credit_ms (2 ms) per slot.
* Usage is computed incrementally (only the recent time that changed is swept again), so a decision costs about
  the same with thousands of short work-conserving slots in the window as with a few long ones.
* Configuration reloads keep history, refuse requests of removed groups explicitly and never silently ignore an
  unknown group.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from gemini.config import Config, GroupConfig
from gemini.wire.sched import ERR_UNKNOWN_GROUP

EPS = 1e-6  # ms; tolerance of eligibility tests against float rounding


# --- decisions --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GrantDecision:
    """Give the token to `group` for `quota_ms`, starting now."""
    group: str
    quota_ms: float
    token_seq: int


@dataclass(frozen=True)
class RefuseDecision:
    """Answer the group's request (or message) with an error."""
    group: str
    code: str
    message: str


Decision = Union[GrantDecision, RefuseDecision]


@dataclass(frozen=True)
class ConfigDiff:
    """What a reload changed: groups added, groups whose settings changed, groups removed."""
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.removed)


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    old_groups = {g.name: g for g in old.groups}
    new_groups = {g.name: g for g in new.groups}
    added = tuple(n for n in new_groups if n not in old_groups)
    removed = tuple(n for n in old_groups if n not in new_groups)
    def settings(g: GroupConfig) -> tuple:
        return g.min_util, g.max_util, g.mem_limit, g.turns

    changed = tuple(n for n, g in new_groups.items() if n in old_groups and settings(g) != settings(old_groups[n]))
    return ConfigDiff(added, changed, removed)


# --- internal state ---------------------------------------------------------------------------------------------

@dataclass
class _Entry:
    group: str
    start: float
    end: float
    token_seq: int


@dataclass
class _Waiting:
    arrival: float
    burst: float


@dataclass
class _Holder:
    group: str
    token_seq: int
    start: float
    deadline: float


@dataclass
class _Group:
    cfg: GroupConfig
    prev_quota: float
    waiting: Optional[_Waiting] = None
    grants: int = 0
    last_quota: float = 0.0


class _Usage:
    """Disjoint usage segments of one group, sorted, with prefix sums: segment i is [starts[i], ends[i]) used at
    `rates[i]` (1 alone, 1/k when k groups overlap); cum[i] = usage of segments lo..i-1 (plus a constant).
    Segments before index `lo` have left the window."""

    __slots__ = ("starts", "ends", "rates", "cum", "lo")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.rates: list[float] = []
        self.cum: list[float] = [0.0]
        self.lo = 0

    def add(self, start: float, end: float, rate: float) -> None:
        if len(self.ends) > self.lo and self.ends[-1] == start and self.rates[-1] == rate:
            self.ends[-1] = end
            self.cum[-1] += (end - start) * rate
            return
        self.starts.append(start)
        self.ends.append(end)
        self.rates.append(rate)
        self.cum.append(self.cum[-1] + (end - start) * rate)

    def truncate_from(self, t: float) -> None:
        """Forget all usage after time t."""
        k = bisect.bisect_left(self.starts, t, self.lo)      # segments k.. start at or after t
        if k < len(self.starts):
            del self.starts[k:], self.ends[k:], self.rates[k:], self.cum[k + 1:]
        if k > self.lo and self.ends[k - 1] > t:
            self.cum[k] -= (self.ends[k - 1] - t) * self.rates[k - 1]
            self.ends[k - 1] = t

    def prune_before(self, cutoff: float) -> None:
        """Drop segments that ended before `cutoff`."""
        self.lo = bisect.bisect_left(self.ends, cutoff, self.lo)
        if self.lo > 256 and 2 * self.lo > len(self.starts):
            lo, base = self.lo, self.cum[self.lo]
            self.starts, self.ends, self.rates = self.starts[lo:], self.ends[lo:], self.rates[lo:]
            self.cum = [c - base for c in self.cum[lo:]]
            self.lo = 0

    @property
    def empty(self) -> bool:
        return len(self.starts) <= self.lo

    def between(self, a: float, b: float) -> float:
        """Usage inside [a, b]."""
        if b <= a:
            return 0.0
        i = bisect.bisect_right(self.ends, a, self.lo)        # first segment ending after a
        j = bisect.bisect_left(self.starts, b, self.lo)       # segments i..j-1 start before b
        if i >= j:
            return 0.0
        total = self.cum[j] - self.cum[i]
        if self.starts[i] < a:
            total -= (a - self.starts[i]) * self.rates[i]
        if self.ends[j - 1] > b:
            total -= (self.ends[j - 1] - max(b, self.starts[j - 1])) * self.rates[j - 1]
        return max(total, 0.0)

    def pieces(self, a: float, b: float):
        """(start, end, rate) of the segments inside [a, b], clipped."""
        i = bisect.bisect_right(self.ends, a, self.lo)
        while i < len(self.starts) and self.starts[i] < b:
            yield max(self.starts[i], a), min(self.ends[i], b), self.rates[i]
            i += 1

    def tail_point(self, budget: float) -> float:
        """The smallest time x such that the usage in [x, +inf) is at most `budget` (-inf if all of it is)."""
        n = len(self.starts)
        if n <= self.lo or self.cum[n] - self.cum[self.lo] <= budget:
            return -math.inf
        target = self.cum[n] - budget
        i = bisect.bisect_left(self.cum, target, self.lo, n + 1) - 1
        return self.ends[i] - (budget - (self.cum[n] - self.cum[i + 1])) / self.rates[i]


class Policy:
    """Gemini's token policy. See the module docstring.

    Parameters: the Config (groups), base quota (used when a request carries no burst estimate), min quota,
    window (all ms) and the scheduler's start time on the caller's clock.
    """

    def __init__(self, config: Config, base_quota_ms: float = 250.0, min_quota_ms: float = 100.0,
                 window_ms: float = 10000.0, start_ms: float = 0.0, max_used_credit_ms: float = 2.0):
        for name, value in (("base_quota_ms", base_quota_ms), ("min_quota_ms", min_quota_ms),
                            ("window_ms", window_ms)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.base_quota_ms = float(base_quota_ms)
        self.min_quota_ms = float(min_quota_ms)
        self.window_ms = float(window_ms)
        self.start_ms = float(start_ms)
        # At most this much of a slot is forgiven when its holder reports it used less GPU time (see
        # _apply_used): enough for the handoff at the slot's start, too little for a lying client to matter.
        self.max_used_credit_ms = max(0.0, float(max_used_credit_ms))
        self.config = config
        self._groups: dict[str, _Group] = {g.name: _Group(g, self.base_quota_ms) for g in config.groups}
        self._entries: list[_Entry] = []             # sorted by start (grants happen in time order)
        self._by_seq: dict[int, _Entry] = {}
        self._last_entry: dict[str, _Entry] = {}
        self._holder: Optional[_Holder] = None
        self._seq = 0
        self._starts: list[float] = []               # entry starts, for bisect
        self._usages: dict[str, _Usage] = {}
        self._dirty = math.inf                        # usage after this time must be recomputed
        self._len_heap: list[tuple[float, int]] = []  # (-length, token_seq): longest entry, lazily cleaned
        self._last_now = self.start_ms

    # --- public API ---------------------------------------------------------------------------------------------

    @property
    def holder(self) -> Optional[str]:
        return self._holder.group if self._holder else None

    @property
    def holder_deadline(self) -> Optional[float]:
        return self._holder.deadline if self._holder else None

    @property
    def groups(self) -> list[str]:
        return list(self._groups)

    def waiting(self) -> list[str]:
        return [n for n, g in self._groups.items() if g.waiting is not None]

    def request(self, group: str, overuse_ms: float = 0.0, burst_ms: float = 0.0,
                now: float = 0.0, used_ms: float = 0.0) -> list[Decision]:
        """A group asks for the token. Returns the decisions to carry out now (possibly a grant)."""
        now = self._now(now)
        g = self._groups.get(group)
        if g is None:
            return [self._unknown(group)]
        if not self._entries and all(gr.waiting is None for gr in self._groups.values()) and self._seq == 0:
            # The window starts with the first request, not when the daemon started: idle time before any
            # client came would otherwise count as unused window, letting groups overshoot their caps until
            # it slides out (and then stall them while the overshoot is paid back).
            self.start_ms = now
        self._apply_overuse(self._last_entry.get(group), overuse_ms, now)
        if self._holder is not None and self._holder.group == group:
            # As in Gemini: the holder coming back means its clients stopped using the token.
            self._end_slot(now)
        self._apply_used(self._last_entry.get(group), used_ms)
        burst = burst_ms if (math.isfinite(burst_ms) and burst_ms > 0) else 0.0
        if g.waiting is None:
            g.waiting = _Waiting(now, burst)
        else:  # a re-sent request (e.g. after a pod manager re-registered): keep its place in the queue
            g.waiting.burst = burst
        return self._schedule(now)

    def release(self, group: str, token_seq: int, overuse_ms: float = 0.0, now: float = 0.0,
                used_ms: float = 0.0) -> list[Decision]:
        """The group's clients are idle. Ends the slot at once if it is the current one; for an older token only
        its overuse (and measured use) is applied."""
        now = self._now(now)
        h = self._holder
        if h is not None and h.group == group and h.token_seq == token_seq:
            self._end_slot(now)
            self._apply_used(self._by_seq.get(token_seq), used_ms)
            return self._schedule(now)
        if group not in self._groups and group not in self._last_entry:
            return [self._unknown(group)]
        entry = self._by_seq.get(token_seq)
        if entry is not None and entry.group == group:
            # (An entry already out of the window, or a token of another scheduler run, is ignored.)
            self._apply_overuse(entry, overuse_ms, now)
            self._apply_used(entry, used_ms)
        return self._schedule(now)

    def cancel(self, group: str, now: float) -> None:
        """Drop the group's waiting request (its pod manager went away)."""
        self._now(now)
        g = self._groups.get(group)
        if g is not None:
            g.waiting = None

    def tick(self, now: float) -> list[Decision]:
        """Time passed: end an expired slot and grant if someone is eligible."""
        return self._schedule(self._now(now))

    def next_wakeup(self, now: float) -> Optional[float]:
        """When `tick` should be called next: the holder's deadline, else the earliest time a waiting group becomes
        eligible (None: nothing will happen until a new message)."""
        now = self._now(now)
        if self._holder is not None:
            return max(now, self._holder.deadline)
        best: Optional[float] = None
        for name, g in self._groups.items():
            if g.waiting is None:
                continue
            t = self._eligible_at(name, g, now)
            if t is not None:
                t = self._confirm(name, g, t)
            if t is not None and (best is None or t < best):
                best = t
        return best

    def apply_config(self, config: Config, now: float) -> list[Decision]:
        """Switch to a new config. History is kept; new MinUtil/MaxUtil apply from the next grant; a removed
        group's holder finishes its slot and its waiting request is refused. The entries of a removed group stay
        until they leave the window (they still count in overlaps, and again for the group if it is re-added
        within a window: it did use that GPU time)."""
        now = self._now(now)
        out: list[Decision] = []
        new_names = set(config.names)
        for name in list(self._groups):
            if name not in new_names:
                g = self._groups.pop(name)
                if g.waiting is not None:
                    out.append(RefuseDecision(name, ERR_UNKNOWN_GROUP,
                                              f"group {name!r} was removed from {config.path}"))
        for gc in config.groups:
            old = self._groups.get(gc.name)
            if old is None:
                self._groups[gc.name] = _Group(gc, self.base_quota_ms)
            else:
                old.cfg = gc
        self.config = config
        out.extend(self._schedule(now))
        return out

    def window_eff(self, now: float) -> float:
        return max(0.0, min(self.window_ms, now - self.start_ms))

    def usage(self, group: str, now: float) -> float:
        """ms of GPU time the group used inside [now - window_eff, now]."""
        u = self._usage().get(group)
        return u.between(now - self.window_eff(now), now) if u else 0.0

    def share(self, group: str, now: float) -> float:
        w = self.window_eff(now)
        return self.usage(group, now) / w if w > 0 else 0.0

    def status(self, now: float) -> dict[str, dict]:
        """Per group: name, min_util, max_util, share, holding, waiting, wait_ms, quota_ms, grants."""
        out = {}
        for name, g in self._groups.items():
            out[name] = {
                "name": name, "min_util": g.cfg.min_util, "max_util": g.cfg.max_util,
                "share": self.share(name, now),
                "holding": self._holder is not None and self._holder.group == name and self._holder.deadline > now,
                "waiting": g.waiting is not None,
                "wait_ms": (now - g.waiting.arrival) if g.waiting else 0.0,
                "quota_ms": g.last_quota, "grants": g.grants,
            }
        return out

    def history(self) -> list[tuple[str, float, float, int]]:
        """(group, start, end, token_seq) of the entries still kept (for tests and debugging)."""
        return [(e.group, e.start, e.end, e.token_seq) for e in self._entries]

    def desired_quota(self, group: str) -> float:
        """The quota the group would get if granted now (before trimming to its headroom)."""
        g = self._groups[group]
        return self._desired(g)

    # --- internals ----------------------------------------------------------------------------------------------

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

    def _clamp(self, quota: float, cfg: GroupConfig) -> float:
        hi = cfg.max_util * self.window_ms
        q = max(quota, self.min_quota_ms)
        return min(q, hi) if hi > 0 else q

    def _desired(self, g: _Group) -> float:
        burst = g.waiting.burst if g.waiting else 0.0
        if burst > 0:
            return self._clamp(0.5 * burst + 0.5 * g.prev_quota, g.cfg)
        # The base quota is used as given (even below the min quota), bounded only by MaxUtil x window.
        hi = g.cfg.max_util * self.window_ms
        return min(self.base_quota_ms, hi) if hi > 0 else self.base_quota_ms

    def _apply_overuse(self, entry: Optional[_Entry], overuse_ms: float, now: float) -> None:
        if entry is None or not (math.isfinite(overuse_ms) and overuse_ms > 0):
            return
        new_end = min(now, entry.end + overuse_ms)
        if new_end > entry.end:
            self._set_end(entry, new_end)

    def _apply_used(self, entry: Optional[_Entry], used_ms: float) -> None:
        """The holder measured (with CUDA events) the GPU time it really had in the slot: from its first kernel
        to the end of its work. The part of the slot before that -- the grant travelling to the hooks, the GPU
        switching contexts -- was nobody's, and charging it made every group fall short of its cap by the
        handoff time of each of its slots. The charge shrinks to the measured use, by at most
        max_used_credit_ms, so a client that reports too little cannot gain more than that per slot."""
        if entry is None or not (math.isfinite(used_ms) and used_ms > 0) or self.max_used_credit_ms <= 0:
            return
        new_end = max(entry.start + used_ms, entry.end - self.max_used_credit_ms)
        if new_end < entry.end:
            self._set_end(entry, new_end)

    def _end_slot(self, now: float) -> None:
        h = self._holder
        assert h is not None
        entry = self._by_seq.get(h.token_seq)
        if entry is not None and entry.end > now:
            self._set_end(entry, max(now, entry.start))
        self._holder = None

    def _set_end(self, entry: _Entry, end: float) -> None:
        self._dirty = min(self._dirty, entry.end, end)
        entry.end = end
        heapq.heappush(self._len_heap, (-(entry.end - entry.start), entry.token_seq))

    def _max_len(self) -> float:
        heap = self._len_heap
        while heap:
            neg, seq = heap[0]
            e = self._by_seq.get(seq)
            if e is None or e.end - e.start != -neg:
                heapq.heappop(heap)
                continue
            return -neg
        return 0.0

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_ms
        i = 0
        hold = self._holder.token_seq if self._holder else -1
        while i < len(self._entries) and self._entries[i].end < cutoff and self._entries[i].token_seq != hold:
            i += 1
        if i:
            for e in self._entries[:i]:
                self._by_seq.pop(e.token_seq, None)
                if self._last_entry.get(e.group) is e:
                    del self._last_entry[e.group]
            del self._entries[:i]
            del self._starts[:i]
            for u in self._usages.values():
                u.prune_before(cutoff)
            if len(self._len_heap) > 4 * len(self._entries) + 64:
                self._len_heap = [(-(e.end - e.start), e.token_seq) for e in self._entries]
                heapq.heapify(self._len_heap)

    def _usage(self) -> dict[str, _Usage]:
        """Usage segments per group. A sweep over the history splits overlapping time evenly between the groups
        active in it. History only changes near the present (grants start now, overuse extends an entry up to now,
        a release cuts the current entry), so only the time after the earliest change is swept again."""
        t = self._dirty
        if t == math.inf:
            return self._usages
        self._dirty = math.inf
        for u in self._usages.values():
            u.truncate_from(t)
        first = bisect.bisect_left(self._starts, t - self._max_len())
        events: list[tuple[float, int, str]] = []
        for e in self._entries[first:]:
            if e.end > t and e.end > e.start:
                events.append((max(e.start, t), 1, e.group))
                events.append((e.end, -1, e.group))
        events.sort(key=lambda ev: (ev[0], ev[1]))
        active: Counter[str] = Counter()
        prev = t
        for when, kind, grp in events:
            if active and when > prev:
                rate = 1.0 / len(active)
                for name in active:
                    seg = self._usages.get(name)
                    if seg is None:
                        seg = self._usages[name] = _Usage()
                    seg.add(prev, when, rate)
            if kind > 0:
                active[grp] += 1
            else:
                active[grp] -= 1
                if active[grp] <= 0:
                    del active[grp]
            prev = when
        return self._usages

    def _theta(self, g: _Group) -> float:
        """Smallest slot worth granting to a capped group: the min quota, or less if the group's quota or its
        reported burst is smaller (a group that needs 30 ms should not wait for 100 ms of headroom)."""
        theta = min(self.min_quota_ms, self._desired(g))
        if g.waiting is not None and g.waiting.burst > 0:
            theta = min(theta, g.waiting.burst)
        return theta

    def _headroom(self, name: str, g: _Group, now: float, limit: float) -> float:
        """Longest slot q <= limit starting now such that the group's usage over the window ending at now + q
        stays within MaxUtil x window_eff(now + q) (all entries end by now when this is called)."""
        cap = g.cfg.max_util
        if cap >= 1.0:
            return limit
        if cap <= 0.0:
            return 0.0
        u = self._usage().get(name)
        W = self.window_ms
        C = cap * W
        # Late phase: window_eff(now + q) = W. phi(q) = usage in [now + q - W, now] + q is non-decreasing in q
        # (the window start slides over the group's old segments at rate 1, shedding at most rate 1 of usage).
        # Walk the group's segments from the window start, solving phi(q) = C piece by piece.
        a = now - W
        phi = u.between(a, now) if u else 0.0
        q_late: float
        if phi > C + EPS:
            q_late = -1.0
        else:
            q = 0.0
            q_late = math.inf
            pieces = u.pieces(a, now) if u else iter(())
            # phi may touch C and stay flat there while the window slides over the group's own full-rate
            # segments, so only a strict rise above C ends the walk.
            for p_start, p_end, rate in pieces:
                if p_start > a + q:  # a gap of no usage: phi grows at rate 1
                    gap = p_start - (a + q)
                    if phi + gap > C + EPS:
                        q_late = q + max(C - phi, 0.0)
                        break
                    phi += gap
                    q += gap
                length = p_end - max(p_start, a + q)
                grow = (1.0 - rate) * length
                if rate < 1.0 and phi + grow > C + EPS:
                    q_late = q + max(C - phi, 0.0) / (1.0 - rate)
                    break
                phi += grow
                q += length
                if q >= limit:
                    break
            if q_late == math.inf:
                q_late = q + max(C - phi, 0.0) if q < limit else limit
        boundary = self.start_ms + W - now  # q at which window_eff reaches W
        if boundary <= 0 or (q_late >= boundary):
            return min(max(q_late, 0.0), limit)
        # Early phase: window_eff(now + q) = now + q - start, the window covers the whole history.
        total = u.between(self.start_ms, now) if u else 0.0
        q_early = (cap * (now - self.start_ms) - total) / (1.0 - cap)
        return min(max(q_early, 0.0), limit)

    def _eligibility(self, name: str, g: _Group, now: float) -> Optional[float]:
        """The quota the group may be granted now, or None if it is not eligible."""
        if g.cfg.max_util <= 0.0:
            return None
        desired = self._desired(g)
        if self.usage(name, now) <= 0.0:
            return desired
        h = self._headroom(name, g, now, desired)
        if h >= self._theta(g) - EPS:
            return min(desired, max(h, self._theta(g)))
        return None

    def _eligible_at(self, name: str, g: _Group, now: float) -> Optional[float]:
        """Earliest time >= now at which the waiting group becomes eligible, if nobody uses the GPU meanwhile on
        its behalf (its history is fixed while it waits)."""
        cap = g.cfg.max_util
        if cap <= 0.0:
            return None
        if self._eligibility(name, g, now) is not None:
            return now
        u = self._usage().get(name)
        if u is None:
            return now
        theta = self._theta(g)
        W = self.window_ms
        # Early phase: eligible once total + theta <= cap x (t + theta - start), while t + theta <= start + W.
        # (Only while still in the early phase: later the history has been pruned.)
        if now + theta < self.start_ms + W:
            total = u.between(self.start_ms, math.inf)
            t_early = self.start_ms + (total + theta) / cap - theta
            if t_early + theta <= self.start_ms + W:
                return max(now, t_early)
        # Late phase: eligible once usage in [t + theta - W, inf) <= cap x W - theta. Find the smallest window start
        # `a` with at most that much usage to its right (a bisection on the prefix sums).
        a = u.tail_point(cap * W - theta)
        t = max(now, self.start_ms + W - theta, a + W - theta)
        return t

    def _confirm(self, name: str, g: _Group, t: float) -> float:
        """Guard against float rounding making the computed time a hair early (the daemon would wake, find no
        one eligible and spin): check the eligibility test itself at t, nudging t forward a little if needed."""
        for step in (0.0, 1e-3, 1e-2, 0.1):
            if self._eligibility(name, g, t + step) is not None:
                return t + step
        return t + 1.0

    def _schedule(self, now: float) -> list[Decision]:
        h = self._holder
        if h is not None:
            if h.deadline > now:
                return []
            self._holder = None
        self._prune(now)
        eligible: list[tuple[str, _Group, float]] = []
        for name, g in self._groups.items():
            if g.waiting is None:
                continue
            quota = self._eligibility(name, g, now)
            if quota is not None:
                eligible.append((name, g, quota))
        if not eligible:
            return []
        # MinUtil is judged at the next decision point, now + the longest slot that may be granted instead: a group
        # that only got priority once already below its minimum would sit below it on average (by about a slot's
        # worth of decay; 1-2 pp with the defaults). Looking ahead keeps an always-busy group at or above it.
        horizon = now + max(q for _, _, q in eligible)
        weff_h = self.window_eff(horizon)
        usages = self._usage()
        targets = fair_targets({n: gr.cfg.max_util for n, gr in self._groups.items()
                                if gr.waiting is not None or (n in usages and self.usage(n, now) > EPS)})
        best_key = None
        best = eligible[0]
        for name, g, quota in eligible:
            assert g.waiting is not None
            u = usages.get(name)
            usage_h = u.between(horizon - weff_h, now) if u else 0.0
            missing = g.cfg.min_util * weff_h - usage_h
            if missing > EPS:
                key = (0, -missing / (missing + usage_h), g.waiting.arrival, name)
            else:
                # least usage relative to the group's fair target (see the module docstring)
                key = (1, self.usage(name, now) / max(targets.get(name, g.cfg.max_util), EPS), g.waiting.arrival,
                       name)
            if best_key is None or key < best_key:
                best_key, best = key, (name, g, quota)
        name, g, quota = best
        g.prev_quota = self._desired(g)
        g.waiting = None
        g.grants += 1
        g.last_quota = quota
        self._seq += 1
        entry = _Entry(name, now, now + quota, self._seq)
        self._entries.append(entry)
        self._starts.append(now)
        self._by_seq[self._seq] = entry
        self._last_entry[name] = entry
        self._dirty = min(self._dirty, now)
        heapq.heappush(self._len_heap, (-quota, self._seq))
        self._holder = _Holder(name, self._seq, now, now + quota)
        return [GrantDecision(name, quota, self._seq)]


def fair_targets(caps: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares under caps (water-filling): each group gets min(cap, level), the level chosen so
    that the shares add up to 1 (or every group gets its cap when the caps add up to less)."""
    if sum(caps.values()) <= 1.0:
        return dict(caps)
    left, level, pending = 1.0, 0.0, sorted(caps.items(), key=lambda kv: kv[1])
    while pending:
        level = left / len(pending)
        if pending[0][1] >= level:
            break
        name, cap = pending.pop(0)
        left -= cap
    return {name: min(cap, level) for name, cap in caps.items()}


def group_names(decisions: Iterable[Decision]) -> list[str]:
    return [d.group for d in decisions]
