"""A discrete-event model of gem-schd's policy with the delays of the real system, on simulated time.

The policy (gemini.scheduler.policy) is driven exactly as the daemon drives it, and the tenants behave as the
hooks and pod managers do, with the delays that matter:

* a grant reaches the tenant `delay_ms` after gem-schd sends it, and a request or release reaches gem-schd
  `delay_ms` after the tenant sends it;
* a tenant launches work until its own deadline (arrival + quota); then, unless a continuation reached it
  first, it stops, its queued work (`inflight_ms`) runs out on the GPU, it measures that overrun and only then
  asks again;
* the GPU runs one tenant at a time, first come first served; switching tenants costs `switch_ms` of GPU time
  (the context switch, about 0.14 ms on an H200); a holder's drain that overlaps the next tenant's first
  work is reported twice as long, as on a GPU that time-slices the two;
* a latency tenant's requests arrive on their own schedule; it claims the GPU (`claim_rtt_ms` after the
  request) when it has the right, and batch tenants stop launching during the claim.

What each tenant really ran on the GPU is recorded (`gpu`), independently of what the policy charged, so tests
measure shares as a benchmark on the GPU does.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Optional

from gemini.config import parse_config
from gemini.scheduler.policy import (ClaimRightDecision, Decision, GrantDecision, Policy, RefuseDecision,
                                     SlotEndDecision)


def config(*groups):
    """groups: (name, min, max) or (name, min, max, class) tuples."""
    text = ""
    for g in groups:
        text += f"[{g[0]}]\nMinUtil = {g[1]}\nMaxUtil = {g[2]}\n"
        if len(g) > 3:
            text += f"Class = {g[3]}\n"
    return parse_config(text, "<sim>")


@dataclass
class Busy:
    """Always has work."""
    start_ms: float = 0.0
    stop_ms: float = math.inf


@dataclass
class Requests:
    """Requests of `work_ms` GPU time each, arriving every `period_ms` (or Poisson at that mean)."""
    work_ms: float
    period_ms: float
    poisson: bool = False
    start_ms: float = 0.0


@dataclass
class _Tenant:
    name: str
    kind: object
    holding: bool = False
    seq: int = 0
    local_deadline: float = -math.inf
    granted_at: float = -math.inf        # when the grant reached it
    first_run: float = -math.inf         # when its slot's first work ran on the GPU
    measure_from: float = -math.inf      # when its hooks' measurement of the slot began (its start event ran)
    work_end: float = -math.inf          # when the work it launched in its slot (and continuations) ends
    asked: bool = False                  # a request is on its way or waiting at gem-schd
    # requests (latency or batch-with-requests)
    pending: list = field(default_factory=list)     # arrival times of requests not yet served
    latencies: list = field(default_factory=list)
    claim_allowed: bool = False
    claiming: bool = False


class Model:
    def __init__(self, groups, behaviour: dict, *, delay_ms=0.2, inflight_ms=1.0, switch_ms=0.14,
                 claim_rtt_ms=0.1, claim_idle_ms=0.5, seed=1, policy: Optional[Policy] = None, **policy_kw):
        self.policy = policy or Policy(config(*groups), **policy_kw)
        self.delay = delay_ms
        self.inflight = inflight_ms
        self.switch = switch_ms
        self.claim_rtt = claim_rtt_ms
        self.claim_idle = claim_idle_ms
        self.rng = random.Random(seed)
        self.tenants = {n: _Tenant(n, b) for n, b in behaviour.items()}
        self.events: list = []
        self.order = 0
        self.now = 0.0
        self.gpu: list[tuple[str, float, float]] = []    # (tenant, start, end) really run
        self.gpu_free = 0.0                              # when the GPU finishes what is queued
        self.last_on_gpu: Optional[str] = None
        self.claim_until = -math.inf                     # a latency claim is active until then
        self.decisions: list[Decision] = []
        self.claims: list[tuple[str, float, float]] = []
        self._seeded = False

    # --- events ------------------------------------------------------------------------------------------

    def push(self, t, kind, *args):
        heapq.heappush(self.events, (t, self.order, kind, args))
        self.order += 1

    def run(self, until_ms: float) -> "Model":
        """Run until `until_ms` (again: from where the last run stopped)."""
        if not self._seeded:
            self._seeded = True
            for n, t in self.tenants.items():
                b = t.kind
                if isinstance(b, Busy):
                    self.push(b.start_ms, "want", n)
                    if b.stop_ms < math.inf:
                        self.push(b.stop_ms, "quit", n)
                elif isinstance(b, Requests):
                    self.push(b.start_ms, "arrive", n)
            self.apply(self.policy.initial_decisions(), 0.0)
        while True:
            wake = self.policy.next_wakeup(self.now)
            te = self.events[0][0] if self.events else math.inf
            tw = wake if wake is not None else math.inf
            t = min(te, tw)
            if t > until_ms:
                break
            self.now = max(self.now, t)
            if te <= tw:
                _, _, kind, args = heapq.heappop(self.events)
                getattr(self, "_on_" + kind)(*args)
            else:
                self.apply(self.policy.tick(self.now), self.now)
        self.now = until_ms
        return self

    def apply(self, decisions, t):
        for d in decisions:
            self.decisions.append(d)
            if isinstance(d, GrantDecision):
                self.push(t + self.delay, "grant", d.group, d.token_seq, d.quota_ms, d.start_ms, d.continuation,
                          d.prev_seq)
            elif isinstance(d, ClaimRightDecision):
                self.push(t + self.delay, "claim_right", d.group, d.allowed)
            elif isinstance(d, RefuseDecision):
                raise AssertionError(f"refused: {d}")
            elif isinstance(d, SlotEndDecision):
                pass

    # --- GPU ---------------------------------------------------------------------------------------------

    def run_on_gpu(self, name: str, start: float, end: float) -> tuple[float, float]:
        """The tenant launches from `start` and stops so that its work ends at `end` (its deadline plus what it
        keeps queued); what others queued runs first. Returns when its work really ran. (Its queue is bounded,
        so a late start does not push its end back by more than that queue.)"""
        s = max(start, self.gpu_free)
        if self.last_on_gpu is not None and self.last_on_gpu != name:
            s += self.switch
        e = max(end, s + min(self.inflight, max(0.0, end - start)))
        if e > s:
            self.gpu.append((name, s, e))
            self.gpu_free = e
            self.last_on_gpu = name
        return s, e

    # --- batch tenants -----------------------------------------------------------------------------------

    def _on_want(self, n):
        t = self.tenants[n]
        if not t.holding and not t.asked:
            self._ask(n, 0.0, 0.0)

    def _on_quit(self, n):
        t = self.tenants[n]
        t.kind = None
        if t.holding:
            t.holding = False
            self.push(self.now + self.delay, "to_schd_release", n, t.seq, 0.0, 0.0)

    def _ask(self, n, overuse, used):
        t = self.tenants[n]
        t.asked = True
        self.push(self.now + self.delay, "to_schd_request", n, overuse, used)

    def _on_to_schd_request(self, n, overuse, used):
        self.apply(self.policy.request(n, overuse, 0.0, self.now, used), self.now)

    def _on_to_schd_release(self, n, seq, overuse, used):
        self.apply(self.policy.release(n, seq, overuse, self.now, used), self.now)

    def _on_to_schd_claimed(self, n, start, end):
        self.apply(self.policy.claimed(n, start, end, self.now), self.now)

    def _on_grant(self, n, seq, quota, start, continuation, prev_seq):
        t = self.tenants[n]
        if continuation:
            if t.holding and t.seq == prev_seq:
                # The board says the slot continues: keep launching until the new deadline (gem-schd's).
                t.seq = seq
                t.local_deadline = max(t.local_deadline, start + quota + self.delay)
                if isinstance(t.kind, Busy):
                    # Its queue never runs dry: the work runs on from where it was.
                    _, t.work_end = self.run_on_gpu(n, t.work_end, t.local_deadline + self.inflight)
                self.push(t.local_deadline, "deadline", n, seq)
                return
            # It released before (the continuation went nowhere: the policy was told), or it asked for its next
            # slot meanwhile: a pod manager ignores a continuation while its request is out, and gem-schd answers
            # that request with a fresh grant (gemini/podmgr/manager.py, `_on_grant`).
            return
        t.asked = False
        t.holding = True
        t.seq = seq
        t.granted_at = self.now
        t.local_deadline = self.now + quota
        if isinstance(t.kind, Busy):
            # It launches until its deadline; at the deadline `inflight` ms are still queued.
            t.first_run, t.work_end = self.run_on_gpu(n, self.now, t.local_deadline + self.inflight)
            # The hook's start event runs as soon as the GPU switches to it: while the previous holder still
            # drains, the GPU time-slices the two, so the event runs before this tenant's first work ends that
            # drain (the model runs the drain first, whole; see `_on_deadline`).
            t.measure_from = min(t.first_run, self.now + self.switch)
            self.push(t.local_deadline, "deadline", n, seq)
        elif isinstance(t.kind, Requests):
            self._serve_requests(n)
        else:
            t.holding = False
            self.push(self.now + self.delay, "to_schd_release", n, seq, 0.0, 0.0)

    def _on_deadline(self, n, seq):
        t = self.tenants[n]
        if not t.holding or t.seq != seq:
            return
        if self.now < t.local_deadline - 1e-9:
            return
        t.holding = False
        if t.kind is None:
            return
        # Drain: the queued work runs out past the deadline; that is its overuse. (The model runs queued work
        # first come first served; a GPU time-slices it with the next tenant's first kernels, so when someone
        # queued behind it the hook sees its drain take twice as long -- each had half of that time.)
        e = max(t.work_end, self.now)
        overuse = e - self.now
        if self.gpu_free > e + 1e-9:
            overuse *= 2
        # The hook's measure: from its start event to the end of its drain as it saw it (twice as long when the
        # next tenant's first work time-sliced with it), as gem-schd receives it.
        used = self.now + overuse - t.measure_from
        self.push(e, "drained", n, overuse, used)

    def _on_drained(self, n, overuse, used):
        t = self.tenants[n]
        if isinstance(t.kind, Busy):
            self._ask(n, overuse, used)
        elif isinstance(t.kind, Requests) and t.pending:
            self._ask(n, overuse, used)

    # --- request-driven tenants (latency class, or batch groups that serve requests) ----------------------

    def _next_arrival(self, b: Requests) -> float:
        return self.rng.expovariate(1.0 / b.period_ms) if b.poisson else b.period_ms

    def _on_arrive(self, n):
        t = self.tenants[n]
        b = t.kind
        assert isinstance(b, Requests)
        t.pending.append(self.now)
        self.push(self.now + self._next_arrival(b), "arrive", n)
        if t.claim_allowed:
            if not t.claiming:
                t.claiming = True
                self.push(self.now + self.claim_rtt, "claim_start", n)
        elif t.holding:
            self._serve_requests(n)
        elif not t.asked:
            self._ask(n, 0.0, 0.0)

    def _on_claim_right(self, n, allowed):
        self.tenants[n].claim_allowed = allowed

    def _on_claim_start(self, n):
        t = self.tenants[n]
        start = self.now
        # Batch holders stop launching at once; what they queued (inflight) still runs first.
        holder = next((x for x in self.tenants.values() if x.holding and x.name != n and isinstance(x.kind, Busy)),
                      None)
        if holder is not None:
            # Cut the holder's launched-ahead work: it only launched up to now + inflight.
            self._truncate_gpu(holder.name, self.now + self.inflight)
        end = start
        while t.pending:
            arrival = t.pending.pop(0)
            s, e = self.run_on_gpu(n, max(self.now, arrival), max(self.now, arrival) + t.kind.work_ms)
            t.latencies.append(e - arrival)
            end = e
        t.claiming = False
        release = end + self.claim_idle
        self.claims.append((n, start, release))
        self.push(release + self.delay, "to_schd_claimed", n, start, release)
        if holder is not None and holder.holding:
            # The holder resumes after the claim, until its deadline.
            if release < holder.local_deadline:
                self.run_on_gpu(holder.name, release, holder.local_deadline)

    def _truncate_gpu(self, name, until):
        """The holder's GPU work launched past `until` never ran (it stopped launching)."""
        kept = []
        for rec in self.gpu:
            g, s, e = rec
            if g == name and e > until:
                if s < until:
                    kept.append((g, s, until))
                continue
            kept.append(rec)
        self.gpu = kept
        self.gpu_free = max((e for _, _, e in self.gpu), default=0.0)
        self.last_on_gpu = self.gpu[-1][0] if self.gpu else None

    def _serve_requests(self, n):
        t = self.tenants[n]
        end = self.now
        while t.pending and self.now < t.local_deadline:
            arrival = t.pending.pop(0)
            s, e = self.run_on_gpu(n, max(self.now, arrival), max(self.now, arrival) + t.kind.work_ms)
            t.latencies.append(e - arrival)
            end = e
        if not t.pending:
            t.holding = False
            self.push(end + self.claim_idle + self.delay, "to_schd_release", n, t.seq, 0.0, end - t.granted_at)

    # --- measurements ------------------------------------------------------------------------------------

    def on_gpu(self, name: str, a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for g, s, e in self.gpu if g == name)

    def share(self, name: str, a: float, b: float) -> float:
        return self.on_gpu(name, a, b) / (b - a)

    def window_shares(self, name: str, window: float, step: float, first: float, last: Optional[float] = None):
        last = self.now if last is None else last
        out = []
        t = first + window
        while t <= last + 1e-9:
            out.append(self.share(name, t - window, t))
            t += step
        return out

    def handoffs(self, a: float, b: float) -> int:
        runs = [g for g, s, e in self.gpu if a <= s < b]
        return sum(1 for x, y in zip(runs, runs[1:]) if x != y)


def percentile(values, q):
    values = sorted(values)
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]
