"""How the processes of one group share the group's token: one strategy per ProcessSharing mode.

The group holds one token (`GroupToken`: a slot from gem-schd, with a deadline). A strategy decides which of
the group's hooks hold it and who waits, given the token's state; the pod manager asks gem-schd for the next
slot (`ctx.request_upstream()`) or gives the rest of one back (`ctx.release_upstream(now)`) when the
strategy says so. Pure: no sockets, time passed in.

* `Together` (Gemini's behaviour, the default): a request while the token is valid is granted at once with the
  time left, so every busy process of the group runs inside the slot; after the token ran out one upstream
  request serves every waiting hook.
* `Turns`: one process holds the token at a time; the others queue, first come first served. A turn lasts
  until the slot runs out or the holder gives the token back (idle, a burst that will not fit, or -- it sees
  the queue on the board -- its burst ended while others wait); the rest of the slot then goes to the next in
  line. Processes that run together inside one slot make the GPU switch contexts between them (about 12% of
  the group's share with two busy processes on an H200); taking turns costs at most one switch per turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

TOKEN_MIN_LEFT_S = 0.0005   # a token with less time left than this counts as expired
MIN_TURN_S = 0.002          # turns: less left than this is not worth a context switch; the slot goes back
TURN_REPORT_GRACE_S = 0.010  # turns: how long after its deadline a silent holder is waited for
CONTINUED_KEPT = 4          # earlier seqs of a continued slot whose releases still count


@dataclass
class GroupToken:
    """The group's slot as the pod manager knows it, and who holds or waits for it."""
    token_seq: int | None = None
    deadline: float = -1e18
    holders: set[int] = field(default_factory=set)
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (client_id, seq) of unanswered requests
    released_seq: int | None = None     # the slot given back to gem-schd early (its continuation is void)
    # The slots this one continues, newest last (a few): a hook that did not take a continuation up (a turn
    # others wait for, a latency group's hook) gives back the seq it was granted, and that release must count.
    continued: tuple[int, ...] = ()
    granted_seq: dict[int, int] = field(default_factory=dict)   # client id -> the seq its last grant named

    def left(self, now: float) -> float:
        """Seconds left on the token (<= 0 when there is none)."""
        return self.deadline - now if self.token_seq is not None else 0.0

    def valid(self, now: float) -> bool:
        """Pure: is there a token with time left?"""
        return self.token_seq is not None and self.deadline - now > TOKEN_MIN_LEFT_S

    def names(self, token_seq: int, client_id: int) -> bool:
        """Does a hook's release of `token_seq` give back its hold on the current slot: the slot's own seq, or one
        of the slots it continues if that is the seq the hook was last granted (a hook granted again since, under
        the new seq, released the old one before it asked: that late release must not end its new hold)?"""
        if self.token_seq is None:
            return False
        if token_seq == self.token_seq:
            return True
        return token_seq in self.continued and self.granted_seq.get(client_id) == token_seq

    def fresh(self, token_seq: int) -> None:
        """A fresh slot from gem-schd (not a continuation)."""
        self.token_seq, self.continued, self.released_seq = token_seq, (), None
        self.granted_seq.clear()

    def continue_as(self, token_seq: int) -> None:
        """gem-schd continued the slot under a new seq."""
        assert self.token_seq is not None
        self.continued = (*self.continued[-(CONTINUED_KEPT - 1):], self.token_seq)
        self.token_seq = token_seq


class SharingContext(Protocol):
    """What a strategy may ask of the pod manager."""
    token: GroupToken

    def grant(self, client_id: int, seq: int, now: float, quota_ns: int | None = None) -> list: ...

    def request_upstream(self) -> list: ...

    def release_upstream(self, now: float) -> list: ...


class SharingStrategy(Protocol):
    name: str

    def request(self, ctx: SharingContext, client_id: int, seq: int, now: float) -> list:
        """A hook asks for the token."""

    def release(self, ctx: SharingContext, client_id: int, token_seq: int, now: float) -> list:
        """A hook gives the token back (idle)."""

    def gone(self, ctx: SharingContext, client_id: int, now: float) -> list:
        """A hook's connection closed while it held the token."""

    def granted(self, ctx: SharingContext, quota_ns: int, now: float) -> list:
        """gem-schd granted the group a fresh slot: serve the waiting hooks."""

    def combine_used(self, total_ms: float, used_ms: float) -> float:
        """The slot's measured use, from the hooks' reports."""

    def tick(self, ctx: SharingContext, now: float) -> list:
        """Timers."""


def expire_if_over(token: GroupToken, now: float) -> bool:
    """The slot ran out: nobody holds it any more. Returns whether the token is still valid."""
    if token.valid(now):
        return True
    token.holders.clear()
    return False


def release_if_unused(ctx: SharingContext, now: float) -> list:
    """Early release: nobody holds the valid token and nobody waits -> give the slot back now."""
    token = ctx.token
    if token.holders or token.waiting or not expire_if_over(token, now) or token.token_seq is None:
        return []
    return ctx.release_upstream(now)


class Together:
    """Every hook that asks while the token is valid holds it (Gemini's behaviour)."""
    name = "together"

    def request(self, ctx: SharingContext, client_id: int, seq: int, now: float) -> list:
        if expire_if_over(ctx.token, now):
            return ctx.grant(client_id, seq, now)
        ctx.token.waiting.append((client_id, seq))
        return ctx.request_upstream()

    def release(self, ctx: SharingContext, client_id: int, token_seq: int, now: float) -> list:
        token = ctx.token
        if token.names(token_seq, client_id) and client_id in token.holders:
            token.holders.discard(client_id)
            return release_if_unused(ctx, now)
        return []   # a release of an older token only contributes its reports

    def gone(self, ctx: SharingContext, client_id: int, now: float) -> list:
        return release_if_unused(ctx, now)

    def granted(self, ctx: SharingContext, quota_ns: int, now: float) -> list:
        served, ctx.token.waiting = ctx.token.waiting, []
        actions: list = []
        for cid, seq in served:
            actions += ctx.grant(cid, seq, now, quota_ns)
        return actions

    def combine_used(self, total_ms: float, used_ms: float) -> float:
        # Together, the slot is charged for what the busiest process used (the others ran inside it).
        return max(total_ms, used_ms)

    def tick(self, ctx: SharingContext, now: float) -> list:
        return []


class Turns:
    """One hook holds the token at a time; the others queue, first come first served."""
    name = "turns"

    def request(self, ctx: SharingContext, client_id: int, seq: int, now: float) -> list:
        token = ctx.token
        token.holders.discard(client_id)     # asking again: its own turn is over
        # One request per connection at a time: a newer one replaces an older the hook gave up on (it timed
        # out), in place, so a turn never goes to a request nobody waits for.
        mine = next((i for i, (cid, _) in enumerate(token.waiting) if cid == client_id), None)
        if mine is not None:
            token.waiting[mine] = (client_id, seq)
            return []
        token.waiting.append((client_id, seq))
        return self.next_turn(ctx, now)

    def release(self, ctx: SharingContext, client_id: int, token_seq: int, now: float) -> list:
        if ctx.token.names(token_seq, client_id):
            ctx.token.holders.discard(client_id)
        return self.next_turn(ctx, now)     # also after the slot ran out: the next one goes upstream

    def gone(self, ctx: SharingContext, client_id: int, now: float) -> list:
        return self.next_turn(ctx, now)

    def granted(self, ctx: SharingContext, quota_ns: int, now: float) -> list:
        if not ctx.token.waiting:
            return []
        cid, seq = ctx.token.waiting.pop(0)
        return ctx.grant(cid, seq, now, quota_ns)

    def combine_used(self, total_ms: float, used_ms: float) -> float:
        # Taking turns, the processes used the slot one after another: their uses add up.
        return total_ms + used_ms

    def next_turn(self, ctx: SharingContext, now: float) -> list:
        """With nobody holding the token, hand what is left of the slot to the longest waiter; with too little
        left (or none), ask gem-schd for the next slot; with nobody waiting, give the slot back."""
        token = ctx.token
        if expire_if_over(token, now):
            if token.holders:
                return []
            if not token.waiting:
                return release_if_unused(ctx, now)
            if token.deadline - now >= MIN_TURN_S:
                cid, seq = token.waiting.pop(0)
                return ctx.grant(cid, seq, now)
            token.deadline = now     # not worth a context switch: end the slot (the request below says so)
        return ctx.request_upstream() if token.waiting else []

    def tick(self, ctx: SharingContext, now: float) -> list:
        token = ctx.token
        if token.waiting and token.token_seq is not None and now >= token.deadline + TURN_REPORT_GRACE_S:
            # The holder's turn ran out and it did not say so (stopped, or stuck in a long drain): the next
            # in line must not wait on it.
            return self.next_turn(ctx, now)
        return []


def strategy_for(turns: bool) -> SharingStrategy:
    return Turns() if turns else Together()
