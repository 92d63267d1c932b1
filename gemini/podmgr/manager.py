"""The logic of gem-pmgr, one group's proxy between its hooks and gem-schd.

Pure: no sockets, no tasks, time comes from an injected clock (seconds, monotonic). Every entry point
returns a list of actions (`ToHook`, `CloseHook`, `ToScheduler`) that server.py carries out, so the whole
behaviour can be tested on simulated time.

The pod manager is made of four parts:

* the **scheduler link** (`_Link`): registration with gem-schd (Hello / Welcome, heartbeats, retries), the one
  outstanding upstream TokenRequest, and the reports (worst overuse, largest burst, measured use) the group's
  hooks made since the last one;
* the **memory ledger** (`_Ledger`): the group's memory for all its processes. A hook asks before it allocates
  and the ledger answers from the group's limit, which comes from gem-schd (Welcome, then ConfigUpdate). A
  restarted pod manager starts from what its predecessor recorded (`begin_recovery`, from the ledger file
  server.py keeps): those processes' bytes stay counted, and the group's allocations wait, until each of them
  has re-announced what it holds (its hook reconnects at once: hook/rejoin.c) or `rejoin_grace_s` passed;
* the group's **token** (`sharing.GroupToken`) and how its processes share it, a strategy per
  ProcessSharing mode (`sharing.Together`, Gemini's behaviour; `sharing.Turns`, one process at a time);
* for a latency-class group, the **claims** (`claims.ClaimBroker`): while gem-schd lets the group claim, a
  hook's request is answered at once with a claim of the GPU written on the board page.

Continuations: when gem-schd decides that the group keeps the GPU past its slot's deadline, its Grant says so
(`continuation`, `prev_seq`); the token's deadline moves on and its holders keep it. (The hooks read the same
decision on the board, so they do not drain or ask.)
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from gemini.peercred import PeerCredentials
from gemini.wire import hook as hp
from gemini.wire import sched as sm

from .claims import ClaimBroker, ClaimSpan, FlareKeeper
from .residency import GroupResidency, Report
from .sharing import TOKEN_MIN_LEFT_S, GroupToken, SharingStrategy, release_if_unused, strategy_for

log = logging.getLogger("gemini.podmgr")

__all__ = ["PodManager", "ToHook", "CloseHook", "ToScheduler", "Action", "Client", "TOKEN_MIN_LEFT_S",
           "Holder", "WELCOME_WAIT_S", "REJOIN_GRACE_S", "HEARTBEAT_S", "HELLO_RETRY_S", "LINK_SILENT_S", "MAX_BYTES"]

WELCOME_WAIT_S = 2.0        # how long HELLO and memory requests wait for the first Welcome
REJOIN_GRACE_S = 5.0        # after a restart: how long allocations wait for the known holders to re-announce
                            # (below the hook's 10 s wait for a memory reply)
HEARTBEAT_S = 1.0
HELLO_RETRY_S = 1.0
LINK_SILENT_S = 3.0         # no word from gem-schd for this long: log that it is unreachable (once)
NS_PER_MS = 1_000_000
MAX_BYTES = 2**63 - 1         # a group's count must stay encodable (uint64 on the wire) with room to spare
MAX_MEMBERS_REPORTED = 64     # (pid, uid) pairs sent to gem-schd for gem-ctl status; the count is always exact


# --- actions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToHook:
    client_id: int
    seq: int
    msg: hp.Message


@dataclass(frozen=True)
class CloseHook:
    client_id: int


@dataclass(frozen=True)
class ToScheduler:
    msg: sm.Message


Action = Union[ToHook, CloseHook, ToScheduler]


@dataclass
class Client:
    id: int
    peer: str
    greeted: bool = False       # HELLO received (its ACK may still be waiting for the first Welcome)
    pid: int = 0                # the kernel's (socket transport), else the one HELLO claims
    mem: int = 0                # bytes this connection holds
    creds: PeerCredentials | None = None    # from SO_PEERCRED; None on TCP
    pid_visible: bool = False   # `pid` names a process of the pod manager's own pid namespace (it can tell if it lives)
    latency: bool = False       # its HELLO_ACK said latency class: its hook takes claims (it keeps the class for life)
    hello_mem: int = 0          # what its HELLO said it already held (a process rejoining after a restart)
    hello_mem_counted: bool = False  # ... counted as managed memory (a unified group), once
    board_told: int = -1        # the pod manager's board_generation when this hook was last told of the board

    @property
    def uid(self) -> int:
        return self.creds.uid if self.creds is not None else -1


@dataclass
class _Deferred:
    """A HELLO or memory request waiting for the first Welcome (the limit is not known before)."""
    until: float
    client_id: int
    seq: int
    msg: hp.Message


@dataclass
class _Upstream:
    """The TokenRequest sent to the scheduler and not yet granted."""
    msg: sm.TokenRequest
    sent: bool = False


def _error(client_id: int, seq: int, code: hp.ErrorCode, text: str) -> ToHook:
    return ToHook(client_id, seq, hp.Error(code=int(code), message=text))


def _ms(ns: int) -> float:
    return max(0, ns) / NS_PER_MS


@dataclass(frozen=True)
class Holder:
    """A process that holds memory of the group, as recorded for a successor (ledger.py)."""
    bytes: int
    visible: bool = False       # its pid is one the pod manager can look up: a successor drops it once it is gone


class _Ledger:
    """The group's memory: its limit (None until the first Welcome) and what its clients hold.

    After a restart, `carried` holds what the previous pod manager counted for processes (by pid) that have not
    re-announced yet; it is part of `used` until they do (their HELLO's mem_in_use replaces it) or the recovery
    ends. While `recovering_until` is set, allocations wait in `held`.
    """

    def __init__(self) -> None:
        self.limit: int | None = None
        self.used = 0
        self.carried: dict[int, Holder] = {}
        self.recovering_until: float | None = None
        self.held: list[_Deferred] = []

    def fits(self, extra: int) -> bool:
        assert self.limit is not None
        return self.used + extra <= self.limit

    def take(self, client: Client, nbytes: int) -> None:
        client.mem += nbytes
        self.used += nbytes

    def give_back(self, client: Client, nbytes: int) -> int:
        """Return up to `nbytes` of what the client holds (never below zero, never another's); returns how many."""
        freed = min(nbytes, client.mem)
        client.mem -= freed
        self.used -= freed
        return freed


class _Link:
    """Registration with gem-schd and the one outstanding upstream request, with the reports it carries."""

    def __init__(self, scheduler_addr: str, now: float) -> None:
        self.addr = scheduler_addr
        self.registered = False          # Welcome received from the current scheduler
        self.scheduler_id: str | None = None
        self.unknown_reason: str | None = None   # set while the scheduler does not know the group
        self.last_hello = -1e18
        self.last_heartbeat = -1e18
        self.last_heard: float | None = None
        self.started = now
        self.silence_logged = False
        self.upstream: _Upstream | None = None
        self.overuse_ms = 0.0            # worst overuse reported since the last upstream request
        self.used_ms = 0.0               # GPU time used in the last slot, as the sharing mode adds it up
        self.burst_ms = 0.0              # largest burst reported since the last upstream request


class PodManager:
    """One group's token, its hooks and its memory. Feed it events; carry out what it returns."""

    def __init__(self, group: str, clock: Callable[[], float], *, device_uuid: str | None = None,
                 pid: int | None = None, scheduler_addr: str = "gem-schd", turns: bool = False,
                 board_open: Optional[Callable[[str], Any]] = None,
                 flare_create: Optional[Callable[[Any, int], Any]] = None, pid_ns: int = 0,
                 process_exists: Optional[Callable[[int], bool]] = None):
        self.group = group
        self.clock = clock
        self.device_uuid = device_uuid or None
        self.pid = os.getpid() if pid is None else pid
        self.scheduler_addr = scheduler_addr
        # This pod manager's pid namespace (0: unknown) and a look-up of a pid in it: a recorded holder that is
        # gone need not be waited for after a restart.
        self.pid_ns = pid_ns
        self._process_exists = process_exists
        self.clients: dict[int, Client] = {}
        self._next_client_id = 1
        self.min_util = 0.0
        self.max_util = 0.0
        self.neighbours = 0             # other groups on the GPU (gem-schd's Welcome and ConfigUpdate)
        self.sched_class = "batch"
        self.memory_mode = "device"
        self.link = _Link(scheduler_addr, clock())
        self.ledger = _Ledger()
        self._deferred: list[_Deferred] = []
        self.token = GroupToken()
        self.sharing: SharingStrategy = strategy_for(turns)
        self.claims = ClaimBroker()
        self.residency = GroupResidency()   # unified groups: managed memory and evictions (residency.py)
        # The GPU's board page (from the Welcome): claims, and the turn queue's length for the hooks.
        self._board_open = board_open
        self._flare_create = flare_create   # a latency group's flare page beside the board (claims.FlareKeeper)
        self._flare_page: Any = None
        self.board: Any = None
        self.board_path = ""
        self.board_slot = -1
        self._board_scheduler = ""     # the gem-schd whose Welcome named the board
        self.board_generation = 0       # counts the board (page, line) changes: hooks told of an older one ask again
        self._waiters_shown = -1

    # --- views kept for callers and tests ----------------------------------------------------

    @property
    def turns(self) -> bool:
        return self.sharing.name == "turns"

    @property
    def holders(self) -> set[int]:
        return self.token.holders

    @property
    def waiting(self) -> list[tuple[int, int]]:
        return self.token.waiting

    @property
    def token_seq(self) -> int | None:
        return self.token.token_seq

    @property
    def deadline(self) -> float:
        return self.token.deadline

    @property
    def registered(self) -> bool:
        return self.link.registered

    @property
    def scheduler_id(self) -> str | None:
        return self.link.scheduler_id

    @property
    def unknown_reason(self) -> str | None:
        return self.link.unknown_reason

    @property
    def mem_used(self) -> int:
        return self.ledger.used

    @property
    def mem_limit(self) -> int | None:
        return self.ledger.limit

    def token_left(self, now: float) -> float:
        """Seconds left on the group's token (<= 0 when it has none)."""
        return self.token.left(now)

    # --- helpers -----------------------------------------------------------------------------

    def _note_report(self, overuse_ns: int, burst_ns: int, used_ns: int = 0) -> None:
        link = self.link
        link.overuse_ms = max(link.overuse_ms, _ms(overuse_ns))
        link.burst_ms = max(link.burst_ms, _ms(burst_ns))
        link.used_ms = self.sharing.combine_used(link.used_ms, _ms(used_ns))

    def _greeted(self) -> list[Client]:
        return [c for c in self.clients.values() if c.greeted]

    def _send_hello(self, now: float) -> list[Action]:
        self.link.last_hello = now
        return [ToScheduler(sm.Hello(group=self.group, pid=self.pid, mem_used=self.ledger.used,
                                     clients=len(self._greeted()), members=self.members(),
                                     managed=self.residency.managed_bytes))]

    def members(self) -> list[list[int]]:
        """[pid, uid] of the greeted clients (uid -1 on TCP, where the pid is only what the HELLO claimed)."""
        return [[c.pid, c.uid] for c in self._greeted()[:MAX_MEMBERS_REPORTED]]

    def _mem_reply(self, client_id: int, seq: int, verdict: hp.MemVerdict) -> ToHook:
        return ToHook(client_id, seq, hp.MemReply(verdict=int(verdict), used=self.ledger.used,
                                                  limit=self.ledger.limit or 0))

    def _hello_ack(self, client: Client, seq: int) -> ToHook:
        flags = hp.ACK_LATENCY if self.sched_class == "latency" else 0
        client.latency = bool(flags)
        if self.memory_mode == "unified":
            flags |= hp.ACK_UNIFIED
        slot, path = self._board_for_hooks()
        client.board_told = self.board_generation
        return ToHook(client.id, seq, hp.HelloAck(client_id=client.id, mem_limit=self.ledger.limit or 0,
                                                  mem_used=self.ledger.used, group=self.group, flags=flags,
                                                  board_slot=slot, board_path=path))

    def _board_for_hooks(self) -> tuple[int, str]:
        """The board line and page the hooks are told of (HELLO_ACK, BOARD_INFO): none unless it is mapped."""
        slot = self.board_slot if self.board is not None else -1
        return slot, (self.board_path if slot >= 0 else "")

    def _unknown_text(self) -> str:
        return self.link.unknown_reason or f"group {self.group!r} is not known to gem-schd"

    def _grant_flags(self) -> int:
        """GRANT_BOUND when a cap, a claim or another group needs the hooks' queue kept within the slot; GRANT_TIGHT
        as well when a latency group may claim the GPU at any moment (then the queue stays about a millisecond long:
        a claim must not wait for a whole slot's queued work, while a cap or a neighbour's slot only needs the queue
        to end with the slot). Another group on the GPU (gem-schd counts them for us: `neighbours`, with or without
        a board): an uncapped group's queue ran on into the next holder's slot, which the GPU then shared with it;
        a deep-queued group capped at 0.1 beside an uncapped one got 0.066 of the GPU, charged 0.099 (an H200,
        twenty-first session). Configured, not active: an idle neighbour costs the group its markers."""
        latency_present = False
        if self.board is not None:
            try:
                latency_present = int(self.board.latency_groups) > 0
            except (AttributeError, TypeError, ValueError):
                latency_present = False
        if latency_present:
            return hp.GRANT_BOUND | hp.GRANT_TIGHT
        return hp.GRANT_BOUND if (self.max_util < 1.0 or self.neighbours > 0) else 0

    # --- the SharingContext the strategies use ------------------------------------------------

    def grant(self, client_id: int, seq: int, now: float, quota_ns: int | None = None) -> list[Action]:
        """Make the client a holder of the group's token; its quota is what is left of the slot."""
        token = self.token
        assert token.token_seq is not None
        token.holders.add(client_id)
        token.granted_seq[client_id] = token.token_seq
        if quota_ns is None:
            quota_ns = int((token.deadline - now) * 1e9)
        return [ToHook(client_id, seq, hp.TokenGrant(quota_ns=quota_ns, token_seq=token.token_seq,
                                                     flags=self._grant_flags() | self._board_flag(client_id)))]

    def _board_flag(self, client_id: int) -> int:
        """GRANT_BOARD for a hook told of another board or line than the one in use now: it asks again."""
        client = self.clients.get(client_id)
        return hp.GRANT_BOARD if client is not None and client.board_told != self.board_generation else 0

    def request_upstream(self) -> list[Action]:
        link = self.link
        if link.upstream is not None:
            return []       # one outstanding upstream request serves every waiting hook
        link.upstream = _Upstream(sm.TokenRequest(group=self.group, overuse_ms=link.overuse_ms,
                                                  burst_ms=link.burst_ms, used_ms=link.used_ms,
                                                  managed=self.residency.managed_bytes))
        link.overuse_ms = link.burst_ms = link.used_ms = 0.0
        return self._send_upstream()

    def release_upstream(self, now: float) -> list[Action]:
        """Give the rest of the slot back to gem-schd (nobody holds or waits for it)."""
        token, link = self.token, self.link
        assert token.token_seq is not None
        release = sm.TokenRelease(group=self.group, token_seq=token.token_seq, overuse_ms=link.overuse_ms,
                                  used_ms=link.used_ms)
        link.overuse_ms = link.used_ms = 0.0
        token.deadline = now     # the slot is over for us too: the next request goes upstream
        token.released_seq = token.token_seq
        log.debug("token %d released early", release.token_seq)
        return [ToScheduler(release)] if link.registered else []

    def _send_upstream(self) -> list[Action]:
        up = self.link.upstream
        if up is None or not self.link.registered:
            return []       # sent when the scheduler welcomes us
        up.sent = True
        return [ToScheduler(up.msg)]

    # --- the board -----------------------------------------------------------------------------

    def _attach_board(self, path: str, slot: int, scheduler_id: str = "") -> None:
        """Use the board page and line a Welcome named. A new gem-schd makes a new page even under the same name
        (its path may be fixed with --board), so a Welcome from another gem-schd always maps it afresh."""
        if (path == self.board_path and slot == self.board_slot and scheduler_id == self._board_scheduler
                and (self.board is not None or not path)):
            return
        self.claims_end_all(self.clock())
        self.drop_flare()
        # The hooks read the board they were told of until told otherwise: their next grant says so (GRANT_BOARD),
        # and they ask (BOARD_QUERY). Without it, processes that were running when gem-schd restarted never
        # paused for a claim, never saw an eviction request and were never continued again.
        self.board_generation += 1
        if self.board is not None:
            # A new gem-schd: the old page is dead. The mark on the group's line there reaches the hooks that get
            # no grant too (an idle unified process must still answer evictions). Not for the same gem-schd's
            # page (a line moved by a reload): that page is live, and the line may be another group's now.
            if (scheduler_id != self._board_scheduler and self.board_slot >= 0
                    and hasattr(self.board, "mark_moved")):
                self.board.mark_moved(self.board_slot)
            if hasattr(self.board, "close"):
                self.board.close()
        self.board, self.board_path, self.board_slot = None, path, slot
        self._board_scheduler = scheduler_id
        self._waiters_shown = -1
        if path and slot >= 0 and self._board_open is not None:
            try:
                self.board = self._board_open(path)
            except Exception as exc:   # a missing or foreign page: no claims, no turn queue on the board
                log.warning("cannot use the board page %s: %s", path, exc)
                self.board = None
        self.claims.attach(self.board, slot if self.board is not None else -1)
        self._keep_flare()

    def _keep_flare(self) -> None:
        """A latency group on a board has a flare page (hook/flare.h), which counts while the group may claim; a
        batch group has none."""
        create = self._flare_create
        if create is None or self.sched_class != "latency" or self.board is None or self.board_slot < 0:
            self.drop_flare()
            return
        if self.claims.flares is None:
            try:
                self._flare_page = create(self.board, self.board_slot)
            except Exception as exc:   # the name taken, no room: claims still work, a little later
                log.warning("no flare page for this latency group: %s", exc)
                return
            self.claims.flares = FlareKeeper(self.board, self.board_slot, self._flare_page)
        self.claims.flares.follow(self.claims.allowed)

    def _flare_state(self) -> str:
        """The flare page's state for status: none (batch, no board, or it could not be made), up (its flares count),
        down (the group may not claim now), revoked (flares raised without requests: they count no more)."""
        keeper = self.claims.flares
        if keeper is None:
            return "none"
        return "revoked" if keeper.revoked else "up" if keeper.up else "down"

    def drop_flare(self) -> None:
        """The flare page goes (a new board, a batch class, or the pod manager stops)."""
        if self.claims.flares is not None:
            self.claims.flares.detach()
            self.claims.flares = None
        page, self._flare_page = self._flare_page, None
        if page is not None:
            page.unlink()
            page.close()

    def claims_end_all(self, now: float) -> list[Action]:
        return self._claim_reports(self.claims.end_all(now))

    def _claim_reports(self, spans: list[ClaimSpan]) -> list[Action]:
        if not self.link.registered:
            return []
        return [ToScheduler(sm.ClaimReport(group=self.group, start_s=s, end_s=e, used_ms=u, ahead_ms=a,
                                           held_ahead_ms=h))
                for s, e, u, a, h in spans]

    def _show_waiters(self) -> None:
        """Turns: the queue's length on the board, so a holder whose burst ended passes its turn on."""
        if self.board is None or self.board_slot < 0:
            return
        n = len(self.token.waiting) if self.turns else 0
        if n != self._waiters_shown:
            self._waiters_shown = n
            self.board.set_waiters(self.board_slot, n)

    def _after(self, actions: list[Action]) -> list[Action]:
        self._show_waiters()
        return actions

    # --- hook connections ----------------------------------------------------------------------

    def connect(self, peer: str, creds: PeerCredentials | None = None) -> int:
        """A hook connected (`creds`: what the kernel says about it, on the socket transport). Returns its id."""
        cid = self._next_client_id
        self._next_client_id += 1
        self.clients[cid] = Client(cid, peer, creds=creds, pid=creds.pid if creds is not None else 0)
        return cid

    def disconnect(self, client_id: int) -> list[Action]:
        """A hook connection closed (exit, crash, or closed by us): release all it had."""
        client = self.clients.pop(client_id, None)
        if client is None:
            return []
        now = self.clock()
        if client.mem:
            self.ledger.used -= client.mem
            log.info("client %d (pid %d) gone: %d bytes released, group uses %d", client.id, client.pid,
                     client.mem, self.ledger.used)
        self._deferred = [d for d in self._deferred if d.client_id != client_id]
        self.ledger.held = [d for d in self.ledger.held if d.client_id != client_id]
        self.token.waiting = [w for w in self.token.waiting if w[0] != client_id]
        actions = self._claim_reports(self.claims.gone(client_id, now))
        had_managed = self.residency.managed.get(client_id, 0)
        actions += self._swapped(self.residency.gone(client_id))
        if had_managed and self.link.registered:
            # gem-schd counts the group's managed memory on the GPU: tell it at once that this much is gone
            actions.append(ToScheduler(sm.Heartbeat(group=self.group, mem_used=self.ledger.used,
                                                    clients=len(self._greeted()), members=self.members(),
                                                    managed=self.residency.managed_bytes)))
        self.token.granted_seq.pop(client_id, None)
        if client_id in self.token.holders:
            self.token.holders.discard(client_id)
            actions += self.sharing.gone(self, client_id, now)
        return self._after(actions)

    def on_hook(self, client_id: int, seq: int, msg: hp.Message) -> list[Action]:
        """One decoded frame from a hook."""
        client = self.clients.get(client_id)
        if client is None:
            return []
        now = self.clock()
        if not client.greeted:
            if not isinstance(msg, hp.Hello):
                log.warning("client %d (%s) sent %s before HELLO: connection closed", client_id, client.peer,
                            msg.TYPE.name)
                return [_error(client_id, seq, hp.ErrorCode.NOT_HELLO,
                               f"the first message must be HELLO, got {msg.TYPE.name}"), CloseHook(client_id)]
            return self._on_hello(client, seq, msg, now)
        if isinstance(msg, hp.Hello):
            log.warning("client %d (pid %d) sent HELLO twice: connection closed", client_id, client.pid)
            return [_error(client_id, seq, hp.ErrorCode.PROTOCOL, "HELLO sent twice on one connection"),
                    CloseHook(client_id)]
        if isinstance(msg, hp.TokenRequest):
            return self._after(self._on_token_request(client, seq, msg, now))
        if isinstance(msg, hp.TokenRelease):
            return self._after(self._on_token_release(client, seq, msg, now))
        if isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            if self.ledger.limit is None:
                if self.link.unknown_reason:
                    return [_error(client_id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text())]
                self._deferred.append(_Deferred(now + WELCOME_WAIT_S, client_id, seq, msg))
                return []
            return self._memory(client, seq, msg, now)
        if isinstance(msg, hp.BoardQuery):
            slot, path = self._board_for_hooks()
            client.board_told = self.board_generation
            return [ToHook(client_id, seq, hp.BoardInfo(board_slot=slot, board_path=path))]
        if isinstance(msg, hp.Residency):
            if self.memory_mode != "unified":
                return [ToHook(client_id, seq, hp.Ack())]     # a device group has no residency to report
            # Bounded by what the ledger counts for the client: a report is a hook's word, and 2**62 managed
            # bytes went to gem-schd as the group's size (it never fit, and evicted the others) and stretched an
            # eviction's give-up time to a century.
            reports = self.residency.on_report(client_id, msg, held=client.mem)
            return [ToHook(client_id, seq, hp.Ack())] + self._swapped(*reports)
        return [_error(client_id, seq, hp.ErrorCode.PROTOCOL, f"unexpected {msg.TYPE.name}"), CloseHook(client_id)]

    def _on_hello(self, client: Client, seq: int, msg: hp.Hello, now: float) -> list[Action]:
        if msg.pod_name and msg.pod_name != self.group:
            log.warning("hook %s (pid %d) says group %r; this pod manager serves %r: refused",
                        client.peer, msg.pid, msg.pod_name, self.group)
            return [_error(client.id, seq, hp.ErrorCode.GROUP_MISMATCH,
                           f"this pod manager serves group '{self.group}', not '{msg.pod_name}'"),
                    CloseHook(client.id)]
        if msg.device_uuid and self.device_uuid and msg.device_uuid != self.device_uuid:
            log.warning("hook %s (pid %d) is on device %s; this pod manager serves %s: refused",
                        client.peer, msg.pid, msg.device_uuid, self.device_uuid)
            return [_error(client.id, seq, hp.ErrorCode.DEVICE_MISMATCH,
                           f"this pod manager serves device {self.device_uuid}, not {msg.device_uuid}"),
                    CloseHook(client.id)]
        if self.link.unknown_reason:
            return [_error(client.id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text()), CloseHook(client.id)]
        rejoined = self._rejoin(client.pid if client.creds is not None and client.creds.pid > 0 else msg.pid,
                                msg.mem_in_use)
        refusal = self._claim_refusal(client, msg)
        if refusal is not None:
            return [_error(client.id, seq, hp.ErrorCode.PROTOCOL, refusal), CloseHook(client.id)]
        client.greeted = True
        client.pid_visible = (client.creds is not None and client.creds.pid > 0) or \
            (msg.pid > 0 and self.pid_ns != 0 and msg.pid_ns == self.pid_ns)
        if client.creds is None or client.creds.pid <= 0:
            client.pid = msg.pid    # TCP (or a pid namespace we cannot see): only the claim is known
        elif msg.pid != client.pid:
            log.debug("client %d: HELLO says pid %d, the kernel %d (another pid namespace?)", client.id, msg.pid,
                      client.pid)
        self.ledger.take(client, msg.mem_in_use)
        client.hello_mem = msg.mem_in_use
        self._count_held_as_managed()
        log.info("client %d: pid %d%s from %s%s", client.id, client.pid,
                 f" uid {client.uid}" if client.creds is not None else "", client.peer,
                 f", already holding {msg.mem_in_use} bytes" if msg.mem_in_use else "")
        actions = self._end_recovery(now) if rejoined and not self.ledger.carried else []
        if self.ledger.limit is None:
            self._deferred.append(_Deferred(now + WELCOME_WAIT_S, client.id, seq, msg))
            return actions
        return [self._hello_ack(client, seq)] + actions

    def _claim_refusal(self, client: Client, msg: hp.Hello) -> str | None:
        """Why the memory a HELLO says its process already holds cannot be counted (None if it can): it must fit
        in what the group's limit leaves, once the limit is known (and in a uint64 with room before that)."""
        claim, limit, used = msg.mem_in_use, self.ledger.limit, self.ledger.used
        room = (limit - used) if limit is not None else MAX_BYTES - used
        if claim <= max(0, room):
            return None
        log.warning("client %d (pid %d) claims %d bytes already held; the group's limit %s leaves %d: refused",
                    client.id, client.pid or msg.pid, claim, limit, max(0, room))
        if limit is None:
            return f"HELLO claims {claim} bytes in use, which no GPU holds"
        return (f"this process holds {claim} bytes, but group '{self.group}' may use only {limit} "
                f"and already uses {used}")

    # --- token -------------------------------------------------------------------------------

    def _on_token_request(self, client: Client, seq: int, msg: hp.TokenRequest, now: float) -> list[Action]:
        if self.claims.usable and client.latency and not self.link.unknown_reason:
            # Latency class: the GPU at once, on the board; gem-schd hears of it when the claim ends. (Only for a
            # hook that was told it is latency class: a batch hook pauses on the board's claim word, its own
            # group's claim included, so a claim granted to it stopped its own next launch until the claim ended.)
            # (an early claim's launches began before this request arrived: from then, on the shared monotonic clock)
            ahead = now - msg.launched_ns / 1e9 if msg.launched_ns > 0 else 0.0
            token_seq, quota_ns, ended = self.claims.request(client.id, now, ahead)
            return self._claim_reports(ended) + [ToHook(client.id, seq, hp.TokenGrant(
                quota_ns=quota_ns, token_seq=token_seq, flags=hp.GRANT_CLAIM | self._board_flag(client.id)))]
        self._note_report(msg.overuse_ns, msg.burst_ns, msg.used_ns)
        if self.link.unknown_reason:
            return [_error(client.id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text())]
        return self.sharing.request(self, client.id, seq, now)

    def _on_token_release(self, client: Client, seq: int, msg: hp.TokenRelease, now: float) -> list[Action]:
        actions: list[Action] = [ToHook(client.id, seq, hp.Ack())]
        if self.claims.owns(msg.token_seq):
            return actions + self._claim_reports(self.claims.release(client.id, msg.token_seq, now,
                                                                     _ms(msg.used_ns)))
        self._note_report(msg.overuse_ns, msg.burst_ns, msg.used_ns)
        return actions + self.sharing.release(self, client.id, msg.token_seq, now)

    def _on_grant(self, msg: sm.Grant, now: float) -> list[Action]:
        token = self.token
        if msg.continuation:
            if (msg.prev_seq == token.token_seq and token.released_seq != msg.prev_seq
                    and self.link.upstream is None):
                # The slot continues: the holders keep the token, and the deadline moves on by the new quota.
                # (Slow to arrive, it counts from now.)
                token.continue_as(msg.token_seq)
                token.deadline = max(token.deadline, now) + msg.quota_ms / 1000.0
            # Otherwise we gave the slot back or asked for the next one meanwhile: gem-schd ends the
            # continuation when that message reaches it, and answers a request with a grant of its own.
            return []
        self.link.upstream = None
        token.fresh(msg.token_seq)      # (a restarted gem-schd numbers from 1 again: no released seq carries over)
        token.deadline = now + msg.quota_ms / 1000.0
        token.holders = set()
        quota_ns = int(msg.quota_ms * NS_PER_MS)
        actions = self.sharing.granted(self, quota_ns, now)
        log.debug("token %d: %.3f ms for %d client(s), %d waiting", msg.token_seq, msg.quota_ms,
                  len(token.holders), len(token.waiting))
        return actions + release_if_unused(self, now)

    def _set_turns(self, turns: bool, now: float) -> list[Action]:
        if turns == self.turns:
            return []
        self.sharing = strategy_for(turns)
        log.info("processes of the group now %s", "take turns" if turns else "share the token together")
        token = self.token
        if turns or not token.waiting:
            return []       # the present holders finish their slot; turns start with the next hand-over
        if not token.valid(now):
            token.holders.clear()
            return self.request_upstream()
        # Together from now on: whoever queued for a turn joins the holders at once.
        actions: list[Action] = []
        waiting, token.waiting = token.waiting, []
        for cid, seq in waiting:
            actions += self.grant(cid, seq, now)
        return actions

    def _refuse_waiting(self) -> list[Action]:
        text = self._unknown_text()
        actions: list[Action] = [_error(cid, seq, hp.ErrorCode.UNKNOWN_GROUP, text)
                                 for cid, seq in self.token.waiting]
        self.token.waiting = []
        self.link.upstream = None
        return actions

    # --- memory ------------------------------------------------------------------------------

    def begin_recovery(self, carried: dict[int, Holder] | None, grace_s: float = REJOIN_GRACE_S) -> list[Action]:
        """This pod manager replaces one that stopped while its processes held memory: `carried` is what that one
        recorded (pid -> Holder), or None if its record could not be read (then the whole grace period is waited
        out). Those bytes are counted at once; allocations wait until every recorded process has re-announced
        (HELLO), is known to be gone, or `grace_s` passed."""
        ledger = self.ledger
        ledger.carried = {pid: h for pid, h in (carried or {}).items() if h.bytes > 0}
        ledger.used += sum(h.bytes for h in ledger.carried.values())
        if carried is not None and not ledger.carried:
            return []
        ledger.recovering_until = self.clock() + grace_s
        log.warning("restarted: the group's allocations wait up to %.1f s for %s to re-announce their memory "
                    "(%d bytes recorded)", grace_s,
                    f"processes {sorted(ledger.carried)}" if carried is not None else "the processes of an "
                    "unreadable record", ledger.used)
        return self._drop_gone_holders(self.clock())

    @property
    def recovering(self) -> bool:
        return self.ledger.recovering_until is not None

    def ledger_record(self) -> dict[int, Holder]:
        """pid -> Holder for every process counted now (re-announced or still carried): what a successor must wait
        for (server.py writes it to the ledger file)."""
        record = dict(self.ledger.carried)
        for c in self._greeted():
            if c.mem > 0:
                prev = record.get(c.pid)
                record[c.pid] = Holder(c.mem + (prev.bytes if prev else 0), c.pid_visible)
        return record

    def _drop_gone_holders(self, now: float) -> list[Action]:
        """Recorded processes this pod manager can look up and that have exited: nothing to wait for."""
        ledger = self.ledger
        if self._process_exists is None or not ledger.carried:
            return []
        gone = [pid for pid, h in ledger.carried.items() if h.visible and not self._process_exists(pid)]
        for pid in gone:
            log.info("pid %d held %d bytes before the restart and has exited", pid, ledger.carried[pid].bytes)
            ledger.used -= ledger.carried.pop(pid).bytes
        if gone and not ledger.carried and ledger.recovering_until is not None:
            return self._end_recovery(now)
        return []

    def _rejoin(self, pid: int, mem_in_use: int) -> bool:
        """A HELLO during recovery: the process's own figure replaces what the previous pod manager recorded."""
        ledger = self.ledger
        if pid not in ledger.carried:
            return False
        recorded = ledger.carried.pop(pid).bytes
        ledger.used -= recorded
        log.info("pid %d re-announced %d bytes (the previous pod manager counted %d); %d process(es) to go",
                 pid, mem_in_use, recorded, len(ledger.carried))
        return True

    def _end_recovery(self, now: float) -> list[Action]:
        """Every recorded process re-announced, or the grace period is over: answer the allocations that waited."""
        ledger = self.ledger
        if ledger.recovering_until is None:
            return []
        for pid, h in sorted(ledger.carried.items()):
            log.warning("pid %d held %d bytes before the restart and has not re-announced within the grace "
                        "period: presumed gone, no longer counted", pid, h.bytes)
            ledger.used -= h.bytes
        ledger.carried = {}
        ledger.recovering_until = None
        held, ledger.held = ledger.held, []
        log.info("the group's memory count is rebuilt (%d bytes in use); %d allocation(s) waited", ledger.used,
                 len(held))
        actions: list[Action] = []
        for d in held:
            client = self.clients.get(d.client_id)
            if client is not None:
                actions += self._memory(client, d.seq, d.msg, now)
        return actions

    def _memory(self, client: Client, seq: int, msg: hp.Message, now: float) -> list[Action]:
        """A memory request once the limit is known: an allocation waits while the count is being rebuilt."""
        if isinstance(msg, hp.MemAlloc) and self.ledger.recovering_until is not None:
            self.ledger.held.append(_Deferred(self.ledger.recovering_until, client.id, seq, msg))
            return []
        return [self._on_memory(client, seq, msg)]

    def _on_memory(self, client: Client, seq: int, msg: hp.Message) -> ToHook:
        ledger = self.ledger
        assert ledger.limit is not None
        if isinstance(msg, hp.MemAlloc):
            if ledger.fits(msg.bytes):
                ledger.take(client, msg.bytes)
                if msg.kind == hp.MemKind.MANAGED:
                    self.residency.allocated(client.id, msg.bytes)
                return self._mem_reply(client.id, seq, hp.MemVerdict.OK)
            log.info("client %d (pid %d): %d bytes denied, group uses %d of %d", client.id, client.pid,
                     msg.bytes, ledger.used, ledger.limit)
            return self._mem_reply(client.id, seq, hp.MemVerdict.DENIED)
        if isinstance(msg, hp.MemFree):
            freed = ledger.give_back(client, msg.bytes)
            if msg.kind == hp.MemKind.MANAGED:
                self.residency.freed(client.id, freed)
            self.residency.bound(client.id, client.mem)     # (a rejoined process's count may hold other kinds)
            if freed < msg.bytes:
                log.warning("client %d (pid %d) frees %d bytes but holds only %d", client.id, client.pid,
                            msg.bytes, freed)
        return self._mem_reply(client.id, seq, hp.MemVerdict.OK)

    def _set_limit(self, limit: int) -> list[Action]:
        ledger = self.ledger
        first = ledger.limit is None
        changed = ledger.limit != limit
        ledger.limit = limit
        actions: list[Action] = []
        if first:
            actions += self._resolve_deferred()
        elif changed:
            # No push to the hooks: they ask (MEM_INFO, MEM_ALLOC) whenever they need the limit.
            log.info("memory limit is now %d bytes (group uses %d)", limit, ledger.used)
        return actions

    def _resolve_deferred(self) -> list[Action]:
        deferred, self._deferred = self._deferred, []
        return self._answer_deferred(deferred)

    def _answer_deferred(self, deferred: list[_Deferred]) -> list[Action]:
        """The first Welcome came (or the wait timed out / the group is unknown): answer what waited."""
        actions: list[Action] = []
        for d in deferred:
            client = self.clients.get(d.client_id)
            if client is None:
                continue
            if isinstance(d.msg, hp.Hello):
                if self.link.unknown_reason:
                    actions += [_error(client.id, d.seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text()),
                                CloseHook(client.id)]
                    continue
                # Counted when it came, before the limit was known: it must fit now that it is.
                self.ledger.used -= client.mem
                refusal = self._claim_refusal(client, d.msg)
                self.ledger.used += client.mem
                if refusal is not None:
                    actions += [_error(client.id, d.seq, hp.ErrorCode.PROTOCOL, refusal), CloseHook(client.id)]
                else:       # the limit may still be unknown (0): the hook learns it from MEM_REPLY later
                    actions.append(self._hello_ack(client, d.seq))
            elif self.ledger.limit is not None:
                actions += self._memory(client, d.seq, d.msg, self.clock())
            elif self.link.unknown_reason:
                actions.append(_error(client.id, d.seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text()))
            else:
                actions.append(_error(client.id, d.seq, hp.ErrorCode.NO_SCHEDULER,
                                      f"no answer from gem-schd at {self.scheduler_addr} yet: "
                                      "the group's memory limit is not known"))
        return actions

    # --- scheduler ---------------------------------------------------------------------------

    def start(self) -> list[Action]:
        """Register with the scheduler."""
        return self._send_hello(self.clock())

    def on_scheduler(self, msg: sm.Message) -> list[Action]:
        now = self.clock()
        link = self.link
        if link.silence_logged:
            log.warning("gem-schd at %s answers again", self.scheduler_addr)
            link.silence_logged = False
        link.last_heard = now
        group = getattr(msg, "group", self.group)
        if group and group != self.group:
            log.warning("ignoring %s for group %r from gem-schd (this pod manager serves %r)",
                        msg.TYPE, group, self.group)
            return []
        if isinstance(msg, sm.Welcome):
            return self._after(self._on_welcome(msg, now))
        if isinstance(msg, sm.Grant):
            return self._after(self._on_grant(msg, now))
        if isinstance(msg, sm.ClaimRight):
            self.claims.set_right(msg.allowed, msg.max_claim_ms)
            return []
        if isinstance(msg, sm.Evict):
            return self._on_evict(msg, now)
        if isinstance(msg, sm.ConfigUpdate):
            self.min_util, self.max_util = msg.min_util, msg.max_util
            self.neighbours = msg.neighbours
            self.sched_class, self.memory_mode = msg.sched_class, msg.memory_mode
            self._count_held_as_managed()
            self._keep_flare()
            return self._after(self._set_turns(msg.turns, now) + self._set_limit(msg.mem_limit))
        if isinstance(msg, sm.HeartbeatAck):
            if link.scheduler_id is not None and msg.scheduler_id != link.scheduler_id:
                log.warning("gem-schd restarted (id %s -> %s): registering again", link.scheduler_id,
                            msg.scheduler_id)
                link.registered = False
                return self._send_hello(now)
            return []
        if isinstance(msg, sm.GroupRemoved):
            log.error("group %r was removed from gem-schd's config: the current token runs out, "
                      "token requests are refused from now on", self.group)
            return self._become_unknown(f"group '{self.group}' was removed from gem-schd's config "
                                        "(resource-config.txt)", now)
        if isinstance(msg, sm.Error):
            return self._on_error(msg, now)
        log.warning("unexpected %s from gem-schd, ignored", msg.TYPE)
        return []

    def _count_held_as_managed(self) -> None:
        """A unified group's processes that said hello before its mode was known (a restarted pod manager hears its
        processes rejoin before gem-schd's welcome): what they hold counts as managed (residency.held)."""
        if self.memory_mode == "unified":
            for client in self.clients.values():
                if client.hello_mem > 0 and not client.hello_mem_counted:
                    client.hello_mem_counted = True
                    self.residency.held(client.id, client.hello_mem)

    def _on_welcome(self, msg: sm.Welcome, now: float) -> list[Action]:
        link = self.link
        if link.unknown_reason:
            log.warning("gem-schd knows group %r again", self.group)
        elif not link.registered:
            log.info("registered with gem-schd %s: MinUtil %g, MaxUtil %g, memory limit %d bytes, class %s",
                     msg.scheduler_id, msg.min_util, msg.max_util, msg.mem_limit, msg.sched_class)
        link.unknown_reason = None
        was_registered = link.registered
        link.registered = True
        link.scheduler_id = msg.scheduler_id
        self.min_util, self.max_util = msg.min_util, msg.max_util
        self.neighbours = msg.neighbours
        self.sched_class, self.memory_mode = msg.sched_class, msg.memory_mode
        self._count_held_as_managed()
        link.last_heartbeat = now
        self._attach_board(msg.board_path, msg.board_slot, msg.scheduler_id)
        actions = self._set_limit(msg.mem_limit)
        if link.upstream is not None and (not was_registered or not link.upstream.sent):
            actions += self._send_upstream()    # the (new) scheduler has not seen our request
        # After the re-send: a switch to together may need a request of its own, and must not send it twice.
        return actions + self._set_turns(msg.turns, now)

    def _on_error(self, msg: sm.Error, now: float) -> list[Action]:
        link = self.link
        if msg.code == sm.ERR_NOT_REGISTERED:
            log.warning("gem-schd does not know this pod manager (%s): registering again", msg.message)
            link.registered = False
            if now - link.last_hello < 0.2:
                return []   # a Hello is on its way already
            return self._send_hello(now)
        if msg.code == sm.ERR_UNKNOWN_GROUP:
            if not link.unknown_reason:
                log.error("gem-schd does not know group %r: add a [%s] section to its resource-config.txt "
                          "(retrying every %.0f s)", self.group, self.group, HELLO_RETRY_S)
            return self._become_unknown(f"group '{self.group}' is not in gem-schd's resource-config.txt", now)
        log.warning("gem-schd error %s: %s", msg.code, msg.message)
        return []

    def _become_unknown(self, reason: str, now: float) -> list[Action]:
        link = self.link
        link.unknown_reason = reason
        link.registered = False
        link.last_hello = now      # retry Hello in HELLO_RETRY_S
        self.claims.set_right(False, 0.0)
        self.claims.end_all(now)
        return self._refuse_waiting() + self._resolve_deferred()

    def upstream_failed(self, msg: sm.Message) -> list[Action]:
        """The server could not hand `msg` to the scheduler link (not connected yet, or gone)."""
        link = self.link
        if isinstance(msg, sm.Hello):
            link.last_hello = -1e18        # nothing went out: try again at the next tick, not in a second
        elif link.upstream is not None and msg is link.upstream.msg:
            link.upstream.sent = False     # sent again once the scheduler is back
        return []

    def tick(self) -> list[Action]:
        """Timers: the first-Welcome wait, Hello retries, heartbeats, re-sends, claims, silence detection."""
        now = self.clock()
        link = self.link
        actions: list[Action] = []
        if self.ledger.recovering_until is not None:
            actions += self._end_recovery(now) if now >= self.ledger.recovering_until else \
                self._drop_gone_holders(now)
        expired = [d for d in self._deferred if d.until <= now]
        if expired:
            self._deferred = [d for d in self._deferred if d.until > now]
            actions += self._answer_deferred(expired)
        if not link.registered:
            if now - link.last_hello >= HELLO_RETRY_S:
                actions += self._send_hello(now)
        else:
            if now - link.last_heartbeat >= HEARTBEAT_S:
                link.last_heartbeat = now
                actions.append(ToScheduler(sm.Heartbeat(group=self.group, mem_used=self.ledger.used,
                                                        clients=len(self._greeted()), members=self.members(),
                                                        managed=self.residency.managed_bytes)))
            if link.upstream is not None and not link.upstream.sent:
                actions += self._send_upstream()
            actions += self.sharing.tick(self, now)
        actions += self._claim_reports(self.claims.expire(now))
        if self.claims.flares is not None:
            self.claims.flares.audit(now)
        expired_evict = self.residency.expire(now)
        if expired_evict is not None:
            log.warning("eviction %d: not every process answered within %.0f s; gem-schd goes on without it",
                        expired_evict.seq, self.residency.timeout_s)
        actions += self._swapped(expired_evict)
        last = link.started if link.last_heard is None else link.last_heard
        if not link.silence_logged and now - last > LINK_SILENT_S:
            link.silence_logged = True
            log.warning("gem-schd at %s has not answered for %.0f s: token requests wait until it does",
                        self.scheduler_addr, now - last)
        return self._after(actions)

    def status(self) -> dict:
        now = self.clock()
        token = self.token
        return {
            "group": self.group, "registered": self.link.registered, "scheduler_id": self.link.scheduler_id,
            "unknown": self.link.unknown_reason, "clients": len(self._greeted()), "mem_used": self.ledger.used,
            "mem_limit": self.ledger.limit, "token_seq": token.token_seq,
            "token_left_ms": max(0.0, token.left(now) * 1000), "holders": sorted(token.holders),
            "waiting": len(token.waiting), "upstream_outstanding": self.link.upstream is not None,
            "sharing": self.sharing.name, "class": self.sched_class, "claim_allowed": self.claims.allowed,
            "claims": self.claims.claims, "flare": self._flare_state(), "members": self.members(),
            "memory_mode": self.memory_mode,
            "managed_bytes": self.residency.managed_bytes, "resident_bytes": self.residency.resident_bytes,
        }

    # --- unified groups: residency ------------------------------------------------------------

    def _on_evict(self, msg: sm.Evict, now: float) -> list[Action]:
        """gem-schd needs the group's memory off the GPU: ask the hooks on the board, wait for their reports."""
        if self.board is None or self.board_slot < 0:
            log.warning("eviction %d asked, but there is no board to reach the hooks: the driver's page faults "
                        "will make room", msg.seq)
            return self._swapped(Report("host", msg.seq, 0, 0.0, complete=False))
        report = self.residency.evict(msg.seq, now)
        self.board.request_evict(self.board_slot, msg.seq)
        return self._swapped(report)

    def _swapped(self, *reports: Report | None) -> list[Action]:
        if not self.link.registered:
            return []
        res = self.residency
        return [ToScheduler(sm.Swapped(group=self.group, direction=r.direction, seq=r.seq, moved_bytes=r.moved_bytes,
                                       took_ms=r.took_s * 1e3, managed=res.managed_bytes,
                                       resident=res.resident_bytes, complete=r.complete))
                for r in reports if r is not None]
