"""Claims of a latency-class group: its pod manager gives the GPU to the group's hooks at once.

While gem-schd lets the group claim (ClaimRight), a hook's TOKEN_REQUEST is answered at once, without a
round trip to gem-schd: the pod manager writes the claim's end on the GPU's board page (batch holders stop
launching while a claim lasts) and grants the hook the claim as its token. Every hook of the group that asks
during a claim shares it. The claim ends when its last holder gives it back (idle) or goes away, or at its
end (at most `max_claim_ms` after it started; a hook still busy then asks again and gets a new claim), and
its span is reported to gem-schd (ClaimReport), which charges it to the group's budget and credits the
slot it interrupted. A pod manager that dies leaves a claim that expires by itself.

Pure: no sockets; the board is injected; time passed in (seconds on CLOCK_MONOTONIC, the board's clock).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Protocol

from gemini.wire.sched import MAX_CLAIM_AHEAD_MS

log = logging.getLogger("gemini.podmgr")

CLAIM_SEQ_BASE = 1 << 62    # claim tokens are numbered apart from gem-schd's slots


class ClaimBoard(Protocol):
    def claim(self, slot: int, until_ns: int) -> None: ...

    def unclaim(self, slot: int) -> None: ...


class FlareBoard(Protocol):
    def set_flare(self, slot: int, up: bool) -> None: ...

    def flare(self, slot: int) -> bool: ...


class FlarePage(Protocol):
    def until_ns(self) -> int: ...

    def changed(self) -> None: ...


@dataclass
class Claim:
    seq: int
    start: float                # when it was written on the board
    until: float
    holders: set[int] = field(default_factory=set)
    used_ms: float = 0.0        # GPU time its holders measured (events), summed over them
    ahead: float = 0.0          # its first holder launched this long before `start` (an early claim)
    flared: bool = False        # ... and the group's flare held the others from then (FlareKeeper)
    unmeasured: bool = False    # a holder left without giving it back (its connection closed)


# (start, end, measured use in ms, ahead in ms, held ahead in ms): what a ClaimReport says
ClaimSpan = tuple[float, float, float, float, float]

# The flare audit: a flare up this long with no claim of the group begun or running counts a strike ...
FLARE_GRACE_S = 0.010
# ... and this many strikes in a row (one a tick) take the flare's right away for good: its hooks raise flares
# without asking for claims (a well-behaved hook's request reaches its pod manager a millisecond after its flare).
FLARE_STRIKES = 3


class FlareKeeper:
    """Whether a latency group's flares count: its board line's `flare` word follows the group's right to claim
    (hook/flare.h). A flare is raised by the group's hooks, not by this pod manager, so it is audited: one that
    stays up while no claim of the group begins or runs loses the right for the pod manager's life.

    Pure: the board and the page are injected; time passed in (seconds, CLOCK_MONOTONIC)."""

    def __init__(self, board: FlareBoard, slot: int, page: FlarePage) -> None:
        self.board, self.slot, self.page = board, slot, page
        self.up = False
        self.revoked = False
        self.strikes = 0
        self._claim_running = False
        self._last_claim = float("-inf")   # when the group's last claim began or ended

    def follow(self, allowed: bool) -> None:
        """The group may claim (`allowed`) or not: its flares count only then."""
        want = allowed and not self.revoked
        # (also when the board lost it: gem-schd clears the word of a pod manager it thought gone)
        if want != self.up or (want and not self.board.flare(self.slot)):
            self.up = want
            self.board.set_flare(self.slot, want)
            self.page.changed()

    def claims_changed(self, now: float, running: bool) -> None:
        """A claim of the group began or ended on the board: a mirror sleeping on the page looks again."""
        self._claim_running = running
        self._last_claim = now
        self.page.changed()

    def audit(self, now: float) -> bool:
        """Once a tick. True if the flare's right was taken away now."""
        if not self.up:
            return False
        until = self.page.until_ns()
        unbacked = (until > int(now * 1e9) and not self._claim_running
                    and now - self._last_claim > FLARE_GRACE_S)
        self.strikes = self.strikes + 1 if unbacked else 0
        if self.strikes < FLARE_STRIKES:
            return False
        log.warning("the group's flare was up for %d ticks in a row with no claim asked for: its processes raise "
                    "flares without requests; batch work no longer makes way for its flares (claims still count)",
                    self.strikes)
        self.revoked = True
        self.follow(False)
        return True

    def detach(self) -> None:
        """The page is going (a new board, or the pod manager stops): its flares no longer count."""
        self.follow(False)


class ClaimBroker:
    """The claims of one latency group."""

    def __init__(self) -> None:
        self.allowed = False
        self.max_claim_s = 0.020
        self.board: Optional[ClaimBoard] = None
        self.slot = -1
        self.current: Optional[Claim] = None
        self._next_seq = CLAIM_SEQ_BASE
        self.claims = 0
        self._last_end = float("-inf")     # claims never overlap, even reported from ahead
        self.flares: Optional[FlareKeeper] = None   # the group's flare page, if it has one

    @property
    def usable(self) -> bool:
        """May a request be answered with a claim now?"""
        return self.allowed and self.board is not None and self.slot >= 0

    def set_right(self, allowed: bool, max_claim_ms: float) -> None:
        if allowed != self.allowed:
            log.info("this group %s claim the GPU", "may" if allowed else "may no longer")
        self.allowed = allowed
        if self.flares is not None:
            self.flares.follow(allowed)     # its flares count exactly while it may claim
        if max_claim_ms > 0:
            self.max_claim_s = max_claim_ms / 1000.0

    def attach(self, board: Optional[ClaimBoard], slot: int) -> None:
        self.board, self.slot = board, slot

    def owns(self, token_seq: int) -> bool:
        return token_seq >= CLAIM_SEQ_BASE

    def request(self, client_id: int, now: float,
                ahead: float = 0.0) -> tuple[int, int, list[ClaimSpan]]:
        """A hook asks: (token_seq, quota_ns) of the claim it joins, and the claims that ended
        (ClaimSpan). `ahead` (s): the hook launched this long before its request came (an early claim): a claim it
        opens is charged from then (at most MAX_CLAIM_AHEAD_MS back, never into the claim before), but only its time
        on the board pauses -- and credits -- the others, and its flare's time ahead if the group's flare counted."""
        ended = self.expire(now)
        c = self.current
        if c is None:
            assert self.board is not None
            ahead = min(max(0.0, ahead), MAX_CLAIM_AHEAD_MS / 1000.0, max(0.0, now - self._last_end))
            flared = ahead > 0 and self.flares is not None and self.flares.up
            c = self.current = Claim(self._next_seq, now, now + self.max_claim_s, ahead=ahead, flared=flared)
            self._next_seq += 1
            self.claims += 1
            self.board.claim(self.slot, int(c.until * 1e9))
            if self.flares is not None:
                self.flares.claims_changed(now, True)
        c.holders.add(client_id)
        return c.seq, max(0, int((c.until - now) * 1e9)), ended

    def release(self, client_id: int, token_seq: int, now: float,
                used_ms: float = 0.0) -> list[ClaimSpan]:
        """A holder gives the claim back (idle), with the GPU time it measured in it."""
        c = self.current
        if c is None or c.seq != token_seq:
            return []
        c.used_ms += max(0.0, min(used_ms, (now - c.start + c.ahead) * 1000.0))
        c.holders.discard(client_id)
        return self._end(now) if not c.holders else []

    def gone(self, client_id: int, now: float) -> list[ClaimSpan]:
        c = self.current
        if c is None or client_id not in c.holders:
            return []
        c.holders.discard(client_id)
        c.unmeasured = True
        return self._end(now) if not c.holders else []

    def expire(self, now: float) -> list[ClaimSpan]:
        """A claim past its end is over (its holders ask again for a new one)."""
        c = self.current
        if c is not None and now >= c.until:
            return self._end(c.until)
        return []

    def _end(self, end: float) -> list[ClaimSpan]:
        c = self.current
        assert c is not None
        self.current = None
        self._last_end = max(c.start, end)
        if self.board is not None:
            self.board.unclaim(self.slot)
        if self.flares is not None:
            self.flares.claims_changed(end, False)
        # Measured only if every holder gave the claim back with its measure: one still busy at the claim's end (or
        # gone) reports its use later, with its next request, where no claim takes it. Reported as measured, the
        # claim was charged what the others used (at least a quarter of the span: 5 ms for 19.5 of GPU time) and
        # an honest group's budget went four times as far. 0 says "not measured": the whole span is charged.
        used = 0.0 if (c.holders or c.unmeasured) else c.used_ms
        return [(c.start, max(c.start, end), used, c.ahead * 1000.0, c.ahead * 1000.0 if c.flared else 0.0)]

    def end_all(self, now: float) -> list[ClaimSpan]:
        """The pod manager lost its board or its right: end a running claim now."""
        return self._end(now) if self.current is not None else []
