"""The logic of gem-pmgr, one group's proxy between its hooks and gem-schd.

Pure: no sockets, no tasks, time comes from an injected clock (seconds, monotonic). Every entry point
returns a list of actions (`ToHook`, `CloseHook`, `ToScheduler`) that server.py carries out, so the whole
behaviour can be tested on simulated time.

Token sharing follows Gemini's pod manager: the group holds one token with a deadline. While the token
has time left, a hook's TOKEN_REQUEST is granted at once with the time that remains; only after it ran out
does one TokenRequest go upstream (never two outstanding), carrying the worst overuse and the largest burst
the group's hooks reported since the previous upstream request. When every hook that holds the token has
released it (or gone), the rest of the slot goes back to the scheduler at once (work-conserving).

With ProcessSharing = turns (per group, in resource-config.txt) the processes take turns instead: one
holds the group's token at a time, the others queue (first come, first served). A turn lasts until the
holder's slot runs out or it gives the token back (idle, or a burst that does not fit); the rest of the
slot then goes to the next in line. Processes that run together inside one slot make the GPU switch
contexts between them, and those switches are GPU time nobody uses (about 12% with two busy processes on
an H200); taking turns costs at most one switch per turn, at the price of in-group latency.

Memory for the whole group is accounted here: a hook asks before it allocates and the manager answers
from the group's limit, which comes from the scheduler (Welcome, then ConfigUpdate pushes).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Union

from gemini.wire import sched as sm
from gemini.wire import hook as hp

log = logging.getLogger("gemini.podmgr")

TOKEN_MIN_LEFT_S = 0.0005   # a token with less time left than this counts as expired
WELCOME_WAIT_S = 2.0        # how long HELLO and memory requests wait for the first Welcome
HEARTBEAT_S = 1.0
HELLO_RETRY_S = 1.0
LINK_SILENT_S = 3.0         # no word from gem-schd for this long: log that it is unreachable (once)
MIN_TURN_S = 0.002          # turns: less left than this is not worth a context switch; the slot goes back
TURN_REPORT_GRACE_S = 0.010  # turns: how long after its deadline a silent holder is waited for
NS_PER_MS = 1_000_000
MAX_BYTES = 2**63 - 1         # a group's count must stay encodable (uint64 on the wire) with room to spare


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
    pid: int = 0
    mem: int = 0                # bytes this connection holds


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


class PodManager:
    """One group's token, its hooks and its memory. Feed it events; carry out what it returns."""

    def __init__(self, group: str, clock: Callable[[], float], *, device_uuid: str | None = None,
                 pid: int | None = None, scheduler_addr: str = "gem-schd", turns: bool = False):
        self.group = group
        self.turns = turns          # ProcessSharing = turns; the scheduler's config sets it
        self.clock = clock
        self.device_uuid = device_uuid or None
        self.pid = os.getpid() if pid is None else pid
        self.scheduler_addr = scheduler_addr

        self.clients: dict[int, Client] = {}
        self._next_client_id = 1

        # scheduler link
        self.registered = False          # Welcome received from the current scheduler
        self.scheduler_id: str | None = None
        self.unknown_reason: str | None = None   # set while the scheduler does not know the group
        self.min_util = 0.0
        self.max_util = 0.0
        self._last_hello = -1e18
        self._last_heartbeat = -1e18
        self._last_heard: float | None = None
        self._started = clock()
        self._silence_logged = False

        # memory
        self.mem_limit: int | None = None        # None until the first Welcome
        self.mem_used = 0
        self._deferred: list[_Deferred] = []

        # token
        self.token_seq: int | None = None
        self.deadline = -1e18
        self.holders: set[int] = set()
        self.waiting: list[tuple[int, int]] = []  # (client_id, seq) of TOKEN_REQUESTs not answered yet
        self._upstream: _Upstream | None = None
        self._overuse_ms = 0.0                    # worst overuse reported since the last upstream request
        self._used_ms = 0.0                       # largest GPU time used in the last slot, likewise
        self._burst_ms = 0.0                      # largest burst reported since the last upstream request

    # --- helpers -----------------------------------------------------------------------------

    def token_left(self, now: float) -> float:
        """Seconds left on the group's token (<= 0 when it has none)."""
        return self.deadline - now if self.token_seq is not None else 0.0

    def _token_valid(self, now: float) -> bool:
        if self.token_seq is not None and self.deadline - now > TOKEN_MIN_LEFT_S:
            return True
        self.holders.clear()    # the slot ran out: nobody holds it any more
        return False

    def _note_report(self, overuse_ns: int, burst_ns: int, used_ns: int = 0) -> None:
        self._overuse_ms = max(self._overuse_ms, _ms(overuse_ns))
        self._burst_ms = max(self._burst_ms, _ms(burst_ns))
        # Together, the slot is charged for what the busiest process used (the others ran inside it).
        # Taking turns, the processes used the slot one after another: their uses add up.
        if self.turns:
            self._used_ms += _ms(used_ns)
        else:
            self._used_ms = max(self._used_ms, _ms(used_ns))

    def _greeted(self) -> list[Client]:
        return [c for c in self.clients.values() if c.greeted]

    def _send_hello(self, now: float) -> list[Action]:
        self._last_hello = now
        return [ToScheduler(sm.Hello(group=self.group, pid=self.pid, mem_used=self.mem_used,
                                     clients=len(self._greeted())))]

    def _mem_reply(self, client_id: int, seq: int, verdict: hp.MemVerdict) -> ToHook:
        return ToHook(client_id, seq, hp.MemReply(verdict=int(verdict), used=self.mem_used,
                                                  limit=self.mem_limit or 0))

    def _hello_ack(self, client: Client, seq: int) -> ToHook:
        return ToHook(client.id, seq, hp.HelloAck(client_id=client.id, mem_limit=self.mem_limit or 0,
                                                  mem_used=self.mem_used, group=self.group))

    def _unknown_text(self) -> str:
        return self.unknown_reason or f"group {self.group!r} is not known to gem-schd"

    # --- hook connections ----------------------------------------------------------------------

    def connect(self, peer: str) -> int:
        """A hook connected. Returns its client id."""
        cid = self._next_client_id
        self._next_client_id += 1
        self.clients[cid] = Client(cid, peer)
        return cid

    def disconnect(self, client_id: int) -> list[Action]:
        """A hook connection closed (exit, crash, or closed by us): release all it had."""
        client = self.clients.pop(client_id, None)
        if client is None:
            return []
        now = self.clock()
        if client.mem:
            self.mem_used -= client.mem
            log.info("client %d (pid %d) gone: %d bytes released, group uses %d", client.id, client.pid,
                     client.mem, self.mem_used)
        self._deferred = [d for d in self._deferred if d.client_id != client_id]
        self.waiting = [w for w in self.waiting if w[0] != client_id]
        if client_id in self.holders:
            self.holders.discard(client_id)
            return self._next_turn(now) if self.turns else self._maybe_release(now)
        return []

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
            return self._on_token_request(client, seq, msg, now)
        if isinstance(msg, hp.TokenRelease):
            return self._on_token_release(client, seq, msg, now)
        if isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            if self.mem_limit is None:
                if self.unknown_reason:
                    return [_error(client_id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text())]
                self._deferred.append(_Deferred(now + WELCOME_WAIT_S, client_id, seq, msg))
                return []
            return [self._on_memory(client, seq, msg)]
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
        if self.unknown_reason:
            return [_error(client.id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text()), CloseHook(client.id)]
        if self.mem_used + msg.mem_in_use > MAX_BYTES:
            log.warning("hook %s (pid %d) claims %d bytes already in use: more than any GPU holds, refused",
                        client.peer, msg.pid, msg.mem_in_use)
            return [_error(client.id, seq, hp.ErrorCode.PROTOCOL,
                           f"HELLO claims {msg.mem_in_use} bytes in use, which no GPU holds"), CloseHook(client.id)]
        client.greeted = True
        client.pid = msg.pid
        client.mem = msg.mem_in_use
        self.mem_used += msg.mem_in_use
        log.info("client %d: pid %d from %s%s", client.id, msg.pid, client.peer,
                 f", already holding {msg.mem_in_use} bytes" if msg.mem_in_use else "")
        if self.mem_limit is None:
            self._deferred.append(_Deferred(now + WELCOME_WAIT_S, client.id, seq, msg))
            return []
        return [self._hello_ack(client, seq)]

    # --- token -------------------------------------------------------------------------------

    def _on_token_request(self, client: Client, seq: int, msg: hp.TokenRequest, now: float) -> list[Action]:
        self._note_report(msg.overuse_ns, msg.burst_ns, msg.used_ns)
        if self.unknown_reason:
            return [_error(client.id, seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text())]
        if self.turns:
            self.holders.discard(client.id)     # asking again: its own turn is over
            # One request per connection at a time: a newer one replaces an older the hook gave up on (it
            # timed out), in place, so a turn never goes to a request nobody waits for.
            mine = next((i for i, (cid, _) in enumerate(self.waiting) if cid == client.id), None)
            if mine is not None:
                self.waiting[mine] = (client.id, seq)
                return []
            self.waiting.append((client.id, seq))
            return self._next_turn(now)
        if self._token_valid(now):
            return [self._grant(client.id, seq, now)]
        self.waiting.append((client.id, seq))
        return self._request_upstream()

    def _grant(self, client_id: int, seq: int, now: float, quota_ns: int | None = None) -> ToHook:
        """Make the client a holder of the group's token; its quota is what is left of the slot."""
        self.holders.add(client_id)
        if quota_ns is None:
            quota_ns = int((self.deadline - now) * 1e9)
        assert self.token_seq is not None
        return ToHook(client_id, seq, hp.TokenGrant(quota_ns=quota_ns, token_seq=self.token_seq))

    def _next_turn(self, now: float) -> list[Action]:
        """Turns: with nobody holding the token, hand what is left of the slot to the longest waiter; with too
        little left (or none), ask the scheduler for the next slot; with nobody waiting, give the slot back."""
        if self._token_valid(now):
            if self.holders:
                return []
            if not self.waiting:
                return self._maybe_release(now)
            if self.deadline - now >= MIN_TURN_S:
                return [self._grant(*self.waiting.pop(0), now)]
            self.deadline = now     # not worth a context switch: end the slot (the request below says so)
        return self._request_upstream() if self.waiting else []

    def _request_upstream(self) -> list[Action]:
        if self._upstream is not None:
            return []       # one outstanding upstream request serves every waiting hook
        self._upstream = _Upstream(sm.TokenRequest(group=self.group, overuse_ms=self._overuse_ms,
                                                   burst_ms=self._burst_ms, used_ms=self._used_ms))
        self._overuse_ms = self._burst_ms = self._used_ms = 0.0
        return self._send_upstream()

    def _send_upstream(self) -> list[Action]:
        if self._upstream is None or not self.registered:
            return []       # sent when the scheduler welcomes us
        self._upstream.sent = True
        return [ToScheduler(self._upstream.msg)]

    def _on_token_release(self, client: Client, seq: int, msg: hp.TokenRelease, now: float) -> list[Action]:
        self._note_report(msg.overuse_ns, msg.burst_ns, msg.used_ns)
        actions: list[Action] = [ToHook(client.id, seq, hp.Ack())]
        if self.turns:
            if msg.token_seq == self.token_seq:
                self.holders.discard(client.id)
            actions += self._next_turn(now)     # also after the slot ran out: the next one goes upstream
        elif msg.token_seq == self.token_seq and client.id in self.holders:
            self.holders.discard(client.id)
            actions += self._maybe_release(now)
        # A release of an older token only contributes its overuse, sent with the next upstream message.
        return actions

    def _maybe_release(self, now: float) -> list[Action]:
        """Early release: nobody holds the valid token and nobody waits -> give the slot back now."""
        if self.holders or self.waiting or not self._token_valid(now) or self.token_seq is None:
            return []
        release = sm.TokenRelease(group=self.group, token_seq=self.token_seq, overuse_ms=self._overuse_ms,
                                  used_ms=self._used_ms)
        self._overuse_ms = self._used_ms = 0.0
        self.deadline = now     # the slot is over for us too: the next request goes upstream
        log.debug("token %d released early", release.token_seq)
        return [ToScheduler(release)] if self.registered else []

    def _on_grant(self, msg: sm.Grant, now: float) -> list[Action]:
        self._upstream = None
        self.token_seq = msg.token_seq
        self.deadline = now + msg.quota_ms / 1000.0
        self.holders = set()
        quota_ns = int(msg.quota_ms * NS_PER_MS)
        # Together, every waiter holds the new slot; taking turns, the longest waiter alone.
        served = self.waiting[:1] if self.turns else self.waiting
        self.waiting = self.waiting[len(served):]
        actions: list[Action] = [self._grant(cid, seq, now, quota_ns) for cid, seq in served]
        log.debug("token %d: %.3f ms for %d client(s), %d waiting", msg.token_seq, msg.quota_ms, len(self.holders),
                  len(self.waiting))
        return actions + self._maybe_release(now)

    def _set_turns(self, turns: bool, now: float) -> list[Action]:
        if turns == self.turns:
            return []
        self.turns = turns
        log.info("processes of the group now %s", "take turns" if turns else "share the token together")
        if turns or not self.waiting:
            return []       # the present holders finish their slot; turns start with the next hand-over
        if not self._token_valid(now):
            return self._request_upstream()
        # Together from now on: whoever queued for a turn joins the holders at once.
        actions: list[Action] = [self._grant(cid, seq, now) for cid, seq in self.waiting]
        self.waiting = []
        return actions

    def _refuse_waiting(self) -> list[Action]:
        text = self._unknown_text()
        actions: list[Action] = [_error(cid, seq, hp.ErrorCode.UNKNOWN_GROUP, text) for cid, seq in self.waiting]
        self.waiting = []
        self._upstream = None
        return actions

    # --- memory ------------------------------------------------------------------------------

    def _on_memory(self, client: Client, seq: int, msg: hp.Message) -> ToHook:
        assert self.mem_limit is not None
        if isinstance(msg, hp.MemAlloc):
            if self.mem_used + msg.bytes <= self.mem_limit:
                client.mem += msg.bytes
                self.mem_used += msg.bytes
                return self._mem_reply(client.id, seq, hp.MemVerdict.OK)
            log.info("client %d (pid %d): %d bytes denied, group uses %d of %d", client.id, client.pid,
                     msg.bytes, self.mem_used, self.mem_limit)
            return self._mem_reply(client.id, seq, hp.MemVerdict.DENIED)
        if isinstance(msg, hp.MemFree):
            freed = min(msg.bytes, client.mem)   # never below zero, never another client's bytes
            if freed < msg.bytes:
                log.warning("client %d (pid %d) frees %d bytes but holds only %d", client.id, client.pid,
                            msg.bytes, client.mem)
            client.mem -= freed
            self.mem_used -= freed
        return self._mem_reply(client.id, seq, hp.MemVerdict.OK)

    def _set_limit(self, limit: int) -> list[Action]:
        first = self.mem_limit is None
        changed = self.mem_limit != limit
        self.mem_limit = limit
        actions: list[Action] = []
        if first:
            actions += self._resolve_deferred()
        elif changed:
            log.info("memory limit is now %d bytes (group uses %d)", limit, self.mem_used)
            push = hp.LimitUpdate(verdict=int(hp.MemVerdict.OK), used=self.mem_used, limit=limit)
            actions += [ToHook(c.id, 0, push) for c in self._greeted()]
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
                if self.unknown_reason:
                    actions += [_error(client.id, d.seq, hp.ErrorCode.UNKNOWN_GROUP, self._unknown_text()),
                                CloseHook(client.id)]
                else:       # the limit may still be unknown (0): the hook learns it from MEM_REPLY later
                    actions.append(self._hello_ack(client, d.seq))
            elif self.mem_limit is not None:
                actions.append(self._on_memory(client, d.seq, d.msg))
            elif self.unknown_reason:
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
        if self._silence_logged:
            log.warning("gem-schd at %s answers again", self.scheduler_addr)
            self._silence_logged = False
        self._last_heard = now
        group = getattr(msg, "group", self.group)
        if group and group != self.group:
            log.warning("ignoring %s for group %r from gem-schd (this pod manager serves %r)",
                        msg.TYPE, group, self.group)
            return []
        if isinstance(msg, sm.Welcome):
            return self._on_welcome(msg, now)
        if isinstance(msg, sm.Grant):
            return self._on_grant(msg, now)
        if isinstance(msg, sm.ConfigUpdate):
            self.min_util, self.max_util = msg.min_util, msg.max_util
            return self._set_turns(msg.turns, now) + self._set_limit(msg.mem_limit)
        if isinstance(msg, sm.HeartbeatAck):
            if self.scheduler_id is not None and msg.scheduler_id != self.scheduler_id:
                log.warning("gem-schd restarted (id %s -> %s): registering again", self.scheduler_id,
                            msg.scheduler_id)
                self.registered = False
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

    def _on_welcome(self, msg: sm.Welcome, now: float) -> list[Action]:
        if self.unknown_reason:
            log.warning("gem-schd knows group %r again", self.group)
        elif not self.registered:
            log.info("registered with gem-schd %s: MinUtil %g, MaxUtil %g, memory limit %d bytes",
                     msg.scheduler_id, msg.min_util, msg.max_util, msg.mem_limit)
        self.unknown_reason = None
        was_registered = self.registered
        self.registered = True
        self.scheduler_id = msg.scheduler_id
        self.min_util, self.max_util = msg.min_util, msg.max_util
        self._last_heartbeat = now
        actions = self._set_limit(msg.mem_limit)
        if self._upstream is not None and (not was_registered or not self._upstream.sent):
            actions += self._send_upstream()    # the (new) scheduler has not seen our request
        # After the re-send: a switch to together may need a request of its own, and must not send it twice.
        return actions + self._set_turns(msg.turns, now)

    def _on_error(self, msg: sm.Error, now: float) -> list[Action]:
        if msg.code == sm.ERR_NOT_REGISTERED:
            log.warning("gem-schd does not know this pod manager (%s): registering again", msg.message)
            self.registered = False
            if now - self._last_hello < 0.2:
                return []   # a Hello is on its way already
            return self._send_hello(now)
        if msg.code == sm.ERR_UNKNOWN_GROUP:
            if not self.unknown_reason:
                log.error("gem-schd does not know group %r: add a [%s] section to its resource-config.txt "
                          "(retrying every %.0f s)", self.group, self.group, HELLO_RETRY_S)
            return self._become_unknown(f"group '{self.group}' is not in gem-schd's resource-config.txt", now)
        log.warning("gem-schd error %s: %s", msg.code, msg.message)
        return []

    def _become_unknown(self, reason: str, now: float) -> list[Action]:
        self.unknown_reason = reason
        self.registered = False
        self._last_hello = now      # retry Hello in HELLO_RETRY_S
        return self._refuse_waiting() + self._resolve_deferred()

    def upstream_failed(self, msg: sm.Message) -> list[Action]:
        """The server could not hand `msg` to the scheduler link (not connected yet, or gone)."""
        if isinstance(msg, sm.Hello):
            self._last_hello = -1e18        # nothing went out: try again at the next tick, not in a second
        elif self._upstream is not None and msg is self._upstream.msg:
            self._upstream.sent = False     # sent again once the scheduler is back
        return []

    def tick(self) -> list[Action]:
        """Timers: the first-Welcome wait, Hello retries, heartbeats, re-sends, silence detection."""
        now = self.clock()
        actions: list[Action] = []
        expired = [d for d in self._deferred if d.until <= now]
        if expired:
            self._deferred = [d for d in self._deferred if d.until > now]
            actions += self._answer_deferred(expired)
        if not self.registered:
            if now - self._last_hello >= HELLO_RETRY_S:
                actions += self._send_hello(now)
        else:
            if now - self._last_heartbeat >= HEARTBEAT_S:
                self._last_heartbeat = now
                actions.append(ToScheduler(sm.Heartbeat(group=self.group, mem_used=self.mem_used,
                                                        clients=len(self._greeted()))))
            if self._upstream is not None and not self._upstream.sent:
                actions += self._send_upstream()
            if (self.turns and self.waiting and self._upstream is None and self.token_seq is not None
                    and now >= self.deadline + TURN_REPORT_GRACE_S):
                # The holder's turn ran out and it did not say so (stopped, or stuck in a long drain): the
                # next in line must not wait on it.
                actions += self._next_turn(now)
        last = self._started if self._last_heard is None else self._last_heard
        if not self._silence_logged and now - last > LINK_SILENT_S:
            self._silence_logged = True
            log.warning("gem-schd at %s has not answered for %.0f s: token requests wait until it does",
                        self.scheduler_addr, now - last)
        return actions

    def status(self) -> dict:
        now = self.clock()
        return {
            "group": self.group, "registered": self.registered, "scheduler_id": self.scheduler_id,
            "unknown": self.unknown_reason, "clients": len(self._greeted()), "mem_used": self.mem_used,
            "mem_limit": self.mem_limit, "token_seq": self.token_seq,
            "token_left_ms": max(0.0, self.token_left(now) * 1000), "holders": sorted(self.holders),
            "waiting": len(self.waiting), "upstream_outstanding": self._upstream is not None,
            "sharing": "turns" if self.turns else "together",
        }
