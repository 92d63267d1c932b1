"""A unified group's managed memory, as its pod manager sees it: pure state, time passed in.

In a unified group (MemoryMode = unified) the hooks make the group's allocations as managed memory and move
them themselves: to the GPU when the group is granted it (each hook reports a RESIDENCY message), and to the
host when gem-schd asks (`Evict`): the pod manager raises the group's `evict_seq` on the board, each hook's
watcher sees it, moves its memory to the host and reports. When every client that holds managed memory has
answered (or gone: a dead process's memory is gone with it), the pod manager tells gem-schd (`Swapped`,
direction "host"), which only then lets the next holder prefetch. A client that does not answer within
`timeout_s` (plus a second per GB it holds) is not waited for: the report says `complete=False` and gem-schd
goes on (the driver's page faults then make room, slowly) -- a broken hook must never stop the GPU. So does an
answer that left memory on the GPU (a prefetch to the host failed: its resident bytes say how much).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gemini.wire import hook as hp

EVICT_TIMEOUT_S = 10.0
EVICT_BYTES_PER_S = 1e9     # ... plus a second per GB to move (an H100 moved 12.5 GB to the host in up to 7 s)


@dataclass
class SwapTotals:
    """What the group's hooks moved, for gem-ctl status, metrics and the scheduler."""
    to_device_bytes: int = 0
    to_host_bytes: int = 0
    swap_s: float = 0.0         # time spent moving (the longest process of each move)
    swaps: int = 0


@dataclass
class _Eviction:
    seq: int
    started: float
    waiting: set[int]           # client ids still to answer
    limit_s: float = EVICT_TIMEOUT_S    # given up this long after `started`
    moved: int = 0
    took_s: float = 0.0
    left: int = 0               # bytes the answers said stayed on the GPU (a prefetch to the host failed)


@dataclass
class Report:
    """A finished swap to report upstream: direction "host" (an eviction, `seq` answered) or "device"."""
    direction: str
    seq: int
    moved_bytes: int
    took_s: float
    complete: bool = True


@dataclass
class GroupResidency:
    timeout_s: float = EVICT_TIMEOUT_S
    managed: dict[int, int] = field(default_factory=dict)     # client id -> managed bytes it holds
    resident: dict[int, int] = field(default_factory=dict)    # client id -> of which on the GPU (last report)
    provisional: set[int] = field(default_factory=set)         # clients whose count is a rejoin's guess (held)
    totals: SwapTotals = field(default_factory=SwapTotals)
    evicting: _Eviction | None = None
    last_seq: int = 0

    @property
    def managed_bytes(self) -> int:
        return sum(self.managed.values())

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def held(self, client_id: int, nbytes: int) -> None:
        """The process says it holds `nbytes` (a HELLO's mem_in_use: it rejoined a restarted pod manager, which saw
        none of its allocations). In a unified group they are managed memory as far as anyone can tell: counted as
        fixed, gem-schd never evicted them, and an eviction was answered at once without waiting for the process.
        The count is provisional: the process's next residency report replaces it (it may hold VMM memory too)."""
        if nbytes > 0:
            self.managed[client_id] = max(self.managed.get(client_id, 0), nbytes)
            self.provisional.add(client_id)

    def bound(self, client_id: int, nbytes: int) -> None:
        """The client holds `nbytes` in all now: it cannot manage more (a free of any kind may lower a provisional
        count)."""
        if self.managed.get(client_id, 0) > nbytes:
            self.managed[client_id] = max(0, nbytes)
            self.resident[client_id] = min(self.resident.get(client_id, 0), self.managed[client_id])

    def allocated(self, client_id: int, nbytes: int) -> None:
        self.managed[client_id] = self.managed.get(client_id, 0) + nbytes

    def freed(self, client_id: int, nbytes: int) -> None:
        left = max(0, self.managed.get(client_id, 0) - nbytes)
        self.managed[client_id] = left
        self.resident[client_id] = min(self.resident.get(client_id, 0), left)

    def evict(self, seq: int, now: float) -> Report | None:
        """gem-schd asks for eviction `seq`: wait for the clients holding managed memory (a Report at once if
        there are none). A newer request replaces an older one still running, but keeps its start, so that
        a hook that never answers times out however often gem-schd asks again (restarting the clock at each
        request would let repeated requests keep it from ever firing). The limit grows with the bytes to move."""
        self.last_seq = max(self.last_seq, seq)
        waiting = {cid for cid, n in self.managed.items() if n > 0}
        started = self.evicting.started if self.evicting is not None else now
        limit = self.timeout_s + sum(self.managed[c] for c in waiting) / EVICT_BYTES_PER_S
        self.evicting = _Eviction(seq, started, waiting, limit)
        return self._finish_if_done()

    def on_report(self, client_id: int, msg: hp.Residency, held: int | None = None) -> list[Report]:
        """A hook moved its memory. `held`: the bytes the group's ledger counts for the client, which bound what
        it may say it manages (None: unbounded)."""
        managed = max(0, msg.managed_bytes)
        if held is not None:
            managed = min(managed, max(0, held))
        if client_id in self.provisional:       # the count a rejoin guessed: the report knows better
            self.provisional.discard(client_id)
        else:
            managed = max(self.managed.get(client_id, 0), managed)
        self.managed[client_id] = managed
        self.resident[client_id] = min(max(0, msg.resident_bytes), managed)
        took = max(0, msg.moved_ns) / 1e9
        if msg.moved_bytes:
            self.totals.swaps += 1
        if msg.direction == hp.RESIDENCY_TO_DEVICE:
            self.totals.to_device_bytes += msg.moved_bytes
            self.totals.swap_s += took
            return [Report("device", 0, msg.moved_bytes, took)] if msg.moved_bytes else []
        self.totals.to_host_bytes += msg.moved_bytes
        self.totals.swap_s += took
        ev = self.evicting
        if ev is None or msg.evict_seq < ev.seq:
            return []
        ev.waiting.discard(client_id)
        ev.moved += msg.moved_bytes
        ev.left += self.resident[client_id]
        ev.took_s = max(ev.took_s, took)
        done = self._finish_if_done()
        return [done] if done else []

    def gone(self, client_id: int) -> Report | None:
        """A client disconnected: its memory is gone (a killed process's too), and it is not waited for."""
        self.provisional.discard(client_id)
        self.managed.pop(client_id, None)
        self.resident.pop(client_id, None)
        if self.evicting is not None:
            self.evicting.waiting.discard(client_id)
            return self._finish_if_done()
        return None

    def expire(self, now: float) -> Report | None:
        ev = self.evicting
        if ev is None or now - ev.started < ev.limit_s:
            return None
        self.evicting = None
        return Report("host", ev.seq, ev.moved, ev.took_s, complete=False)

    def _finish_if_done(self) -> Report | None:
        ev = self.evicting
        if ev is None or ev.waiting:
            return None
        self.evicting = None
        return Report("host", ev.seq, ev.moved, ev.took_s, complete=ev.left == 0)
