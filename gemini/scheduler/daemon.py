"""gem-schd's I/O: a zmq ROUTER that moves messages between the pod managers and the Policy.

Every decision comes from gemini.scheduler.policy.Policy; this module only keeps the table of pod managers
(who speaks for which group, when it was last heard from, what memory and clients it reports), turns messages
into policy calls and decisions into messages, keeps the timer for the policy's next wakeup, and pushes config
changes made by a live reload.

Frames: one JSON frame per message (gemini.wire.sched) after the ROUTER's identity frame; a REQ peer's empty
delimiter frame is accepted too (gem-ctl may use REQ), and replies keep it.

Observers (metrics, trace; gemini.scheduler.observers): after every decision the daemon tells them about slots
(a grant, and the slot's end as the policy decides it), claims, config changes and the stop. They run on the
loop, after the grant has been sent, and an observer's exception is logged, never raised.

The board (gemini.board): the daemon creates the GPU's board page, gives every group a line on it (in the
Welcome), and publishes each grant there, so that a continued slot reaches the holder's hooks at once.

Timer precision: asyncio's epoll timeouts are rounded UP to whole milliseconds, so a grant due at a slot's
deadline would go out 0-1 ms (plus wakeup latency) late, and every handoff would leave the GPU idle for that
long. Waiting precisely inside the loop (sleep, spin) would instead stall every message that arrives meanwhile,
up to a millisecond or more per slot. So a small thread (`PreciseTimer`) sleeps until the deadline with the
kernel's microsecond timers and hands it to the loop with call_soon_threadsafe; the loop never blocks.
`timer_stats()` reports the measured lateness, and the event loop's CPU time from a deadline's timer to its grant
sent (thread CPU time: the policy, the board and the message; issue 14's scale goal, bench/bench_schd_ceiling.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import ipaddress
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import zmq
import zmq.asyncio

from gemini import transport
from gemini.board import DEFAULT_BOARD_DIR, Board, BoardError, remove_stale_boards
from gemini.config import Config
from gemini.scheduler.capacity import DeviceMemoryProbe, ProbeError, capacity_for, reserve_for
from gemini.scheduler.connections import HELLO_TIMEOUT_S, MAX_CONNECTIONS, ConnectionGuard
from gemini.scheduler.observers import SchedulerObserver
from gemini.scheduler.residency import SLOT_FLOOR_MIN_MS, Eviction, ResidencyPolicy
from gemini.scheduler.share import reported_share
from gemini.scheduler.policy import (DEFAULT_BASE_QUOTA_MS, DEFAULT_BUCKET_MS, DEFAULT_CAP_FRAME_MS,
                                     DEFAULT_MIN_QUOTA_MS, DEFAULT_WINDOW_MS, MIN_FRAME_QUOTA_MS, ClaimRightDecision,
                                     Decision, GrantDecision, Policy, RefuseDecision, SlotEndDecision, diff_configs)
from gemini.wire.sched import (ERR_BAD_MESSAGE, ERR_NOT_REGISTERED, ERR_UNKNOWN_GROUP, MAX_MESSAGE_BYTES,
                               TO_SCHEDULER, ClaimReport, ClaimRight, ConfigUpdate, Error, Evict, Grant, GroupRemoved,
                               GroupStatus, Heartbeat, HeartbeatAck, Hello, Message, MessageError, StatusReply,
                               StatusRequest, Swapped, TokenRelease, TokenRequest, Welcome, decode, encode)

log = logging.getLogger("gemini.scheduler")

DEFAULT_PORT = transport.DEFAULT_SCHEDULER_PORT
HEARTBEAT_TIMEOUT_S = 5.0
MAX_BYTES = 2**63 - 1
EVICT_TIMEOUT_S = 15.0          # a grant waits at most this long for the evictions it needs
EVICT_BYTES_PER_S = 1e9         # ... plus a second per GB to move (the pod managers wait 5 s less)
PROBE_TIMEOUT_S = 10.0          # how long gem-schd's start waits for the card's memory (NVML) at most
MAX_CLIENTS = 1 << 20
MEMBERS_SHOWN = 32              # [pid, uid] pairs kept per group for the status reply
# The policy decides this long (ms) before a running slot's end and the grants go out at it (SchedulerDaemon._on_timer):
# longer than the decision takes after a quiet wake-up (0.1-0.3 ms), short enough that an early release in it
# (its next grant still waits for the deadline) costs little.
DEFAULT_DECIDE_AHEAD_MS = 0.5
MAX_DECIDE_AHEAD_MS = 5.0


class PreciseTimer:
    """Call `callback(when)` on the event loop at monotonic time `when`, to a fraction of a millisecond.
    One pending time at a time: arming again replaces it; arming None cancels."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback):
        self._loop, self._callback = loop, callback
        self._cond = threading.Condition()
        self._when: Optional[float] = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gem-schd-timer", daemon=True)
        self._thread.start()

    def arm(self, when: Optional[float]) -> None:
        with self._cond:
            self._when = when
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._when is None:
                    self._cond.wait()
                    continue
                delay = self._when - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)      # futex with a timeout: wakes within tens of microseconds
                    continue                    # re-check: re-armed, cancelled, or due
                when, self._when = self._when, None
                try:
                    self._loop.call_soon_threadsafe(self._callback, when)
                except RuntimeError:            # the loop is closed: we are shutting down
                    return


class BindError(RuntimeError):
    """The ROUTER (or the metrics server) could not listen (port busy, bad address)."""


@dataclass
class _Peer:
    identity: bytes
    group: str
    pid: int
    address: str
    last_seen: float            # time.monotonic()


@dataclass
class _HeldGrant:
    """A unified group's grant waiting for the groups evicted to make room for it (and for any eviction still
    unanswered: their memory may still be on the GPU)."""
    decision: GrantDecision
    waiting: set
    timer: Any = None


@dataclass
class _GroupInfo:
    mem_used: int = 0
    clients: int = 0
    connected: bool = False
    members: list = field(default_factory=list)     # [pid, uid] of its processes, as its pod manager says


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _members(value: list) -> list:
    """A pod manager's [pid, uid] list, kept only if well formed, and cut to MEMBERS_SHOWN."""
    out = []
    for item in value[:MEMBERS_SHOWN]:
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x < 2**32 for x in item)):
            return []
        out.append(list(item))
    return out


class _RateLimitedLog:
    """At most `per_second` lines a second for one kind of problem (`what`); the rest are counted and summarised."""

    def __init__(self, per_second: int = 20, what: str = "bad frames"):
        self.per_second = per_second
        self.what = what
        self.window_start = 0.0
        self.count = 0
        self.suppressed = 0

    def __call__(self, level: int, fmt: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self.window_start >= 1.0:
            if self.suppressed:
                log.warning("... %d more %s in the last second were not logged", self.suppressed, self.what)
            self.window_start, self.count, self.suppressed = now, 0, 0
        if self.count < self.per_second:
            self.count += 1
            log.log(level, fmt, *args, exc_info=exc_info)
        else:
            self.suppressed += 1


class SchedulerDaemon:
    """The gem-schd daemon. `await start()`, then `await wait_closed()`; `stop()` ends it.

    `config_path`: if given, the file is watched and reloaded live (see gemini/reload.py).
    `ipc_dir`: the socket transport: listen on ipc_dir/<device_uuid or default>/gem-schd.sock, no TCP port.
    """

    def __init__(self, config: Config, *, ip: str = transport.DEFAULT_IP, port: int = DEFAULT_PORT,
                 base_quota_ms: float = DEFAULT_BASE_QUOTA_MS, min_quota_ms: float = DEFAULT_MIN_QUOTA_MS,
                 window_ms: float = DEFAULT_WINDOW_MS, bucket_ms: float = DEFAULT_BUCKET_MS,
                 cap_frame_ms: float = DEFAULT_CAP_FRAME_MS, config_path: Optional[str] = None,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 debounce_s: float = 0.05, settle_s: float = 0.005,
                 metrics_port: Optional[int] = None, trace_path: Optional[str] = None,
                 board_path: Optional[str] = "", ipc_dir: Optional[str] = None, device_uuid: Optional[str] = None,
                 hello_timeout_s: float = HELLO_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 device_memory: Optional[int] = None, evict_timeout_s: float = EVICT_TIMEOUT_S,
                 memory_probe: Optional[DeviceMemoryProbe] = None, unified_min_slot_ms: float = SLOT_FLOOR_MIN_MS,
                 frame_turns: bool = True, min_frame_quota_ms: float = MIN_FRAME_QUOTA_MS, fair_cycle_ms: float = 0.0,
                 decide_ahead_ms: float = DEFAULT_DECIDE_AHEAD_MS):
        if not (math.isfinite(decide_ahead_ms) and 0.0 <= decide_ahead_ms <= MAX_DECIDE_AHEAD_MS):
            raise ValueError(f"decide_ahead_ms must be within 0..{MAX_DECIDE_AHEAD_MS:g}, got {decide_ahead_ms!r}")
        self.config = config
        self.decide_ahead_ms = float(decide_ahead_ms)
        self.ip = ip
        self.port = port
        self.ipc_dir = os.path.abspath(ipc_dir) if ipc_dir else None
        self.device_uuid = device_uuid
        self.socket_path = str(transport.scheduler_socket(self.ipc_dir, device_uuid)) if self.ipc_dir else None
        self._socket_inode: Optional[int] = None
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = max_connections
        self.guard: Optional[ConnectionGuard] = None
        self.config_path = config_path
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.debounce_s = debounce_s
        self.settle_s = settle_s
        self.metrics_port = metrics_port      # serve Prometheus metrics there (0: any free port); see metrics.py
        self.trace_path = trace_path          # write a Chrome trace of the slots there; see trace.py
        self.scheduler_id = f"{uuid.uuid4().hex[:12]}"
        self._t0_ns = time.monotonic_ns()
        self._t0 = self._t0_ns / 1e9
        self.policy = Policy(config, base_quota_ms, min_quota_ms, window_ms, start_ms=0.0, bucket_ms=bucket_ms,
                             clock_origin_ms=self._t0_ns / 1e6, cap_frame_ms=cap_frame_ms, frame_turns=frame_turns,
                             min_frame_quota_ms=min_frame_quota_ms, fair_cycle_ms=fair_cycle_ms)
        # Unified groups' memory on the GPU (residency.py decides; this daemon carries it out): a grant that needs
        # evictions first is held until the evicted groups' pod managers answer (or evict_timeout_s passes).
        self.residency = ResidencyPolicy(device_memory, slot_floor_min_ms=unified_min_slot_ms)
        self.residency.configure({g.name: g.unified for g in config.groups})
        # Without --device-memory the capacity is the card's memory less a reserve (capacity.py), read through
        # memory_probe (NVML in gem-schd) the first time a unified group is configured; None: no way to read it.
        self.memory_probe = memory_probe
        self.capacity_source = "flag" if device_memory is not None else ""   # "flag", "probe" or "": none
        self.device_total: int = 0        # the card's memory as the probe read it (0: not read)
        self._probe_state = "done" if device_memory is not None else "untried"   # untried, running, done
        self._probe_task: Optional[asyncio.Task] = None
        self.evict_timeout_s = evict_timeout_s
        self._held: Optional[_HeldGrant] = None
        # The board page: "" = a fresh file in /dev/shm, None = no board (hooks then drain at every deadline
        # and latency groups cannot claim).
        self._board_path_arg = board_path
        self.board: Optional[Board] = None
        self._board_waiting = False     # what the board's groups_waiting says
        self._board_slots: dict[str, int] = {}
        self._gone_slots: dict[str, int] = {}     # during a reload's dispatch: its removed groups' board lines
        self._peers: dict[bytes, _Peer] = {}
        self._owners: dict[str, bytes] = {}
        self._info: dict[str, _GroupInfo] = {g.name: _GroupInfo() for g in config.groups}
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._recv_task: Optional[asyncio.Task] = None
        self._timer: Optional[PreciseTimer] = None
        self._wake_target: Optional[float] = None     # the policy's time (ms) the timer is for
        self._wake_at: Optional[float] = None         # when it fires (monotonic s): then, or decide_ahead_ms before
        # Deciding ahead: the policy's time was moved on to `_ahead_until` (ms) before it came, and the grants it made
        # then wait in `_early` until that time comes (see _on_timer).
        self._ahead_until: Optional[float] = None
        # (each grant with the pod manager to tell as it was decided; the end of a stashed slot the policy continued
        # meanwhile follows its grant, with None)
        self._early: list[tuple[Union[GrantDecision, SlotEndDecision], Optional[bytes]]] = []
        self._early_frames: dict[int, tuple[Grant, bytes]] = {}     # their messages, by token_seq
        self._early_by_timer = False    # the timer's own decision made one of them (not a message in the window)
        self._voided: set[int] = set()  # token_seqs of grants that go out nowhere (being released)
        self._decide_cpu_ns: collections.deque[int] = collections.deque(maxlen=4096)  # a decision made ahead
        self._decided_ahead = 0         # grants at timers decided ahead (sent at their time), and on time
        self._decided_late = 0
        self._sweep_handle: Optional[asyncio.TimerHandle] = None
        self._closed: Optional[asyncio.Event] = None  # created in start(), on the loop
        self._bad_log = _RateLimitedLog()
        self._lateness: collections.deque[float] = collections.deque(maxlen=4096)
        self._grant_cpu_ns: collections.deque[int] = collections.deque(maxlen=4096)   # a deadline to its grant sent
        self._grant_sent_ms: collections.deque[float] = collections.deque(maxlen=4096)  # (wall time, the same span)
        # While a timer's decisions are carried out: its CPU clock at the start and its deadline (monotonic s), for
        # the measure taken as the grant leaves (what comes after the send is not on the next holder's path).
        self._timer_start: Optional[tuple[int, float]] = None
        # Observer calls made while decisions are carried out wait until every message has gone out (then run in
        # the order they were made): a grant at a deadline must not wait for the metrics and trace of the slot
        # that ended before it.
        self._deferred: Optional[list[tuple[str, tuple]]] = None
        self._tick_error_log = _RateLimitedLog(per_second=1, what="policy errors at a deadline")
        self.reloader: Optional[Any] = None   # ConfigReloader, imported lazily
        self.endpoint = ""
        self.observers: list[SchedulerObserver] = []
        self.metrics_server: Optional[Any] = None   # MetricsServer (prometheus_client is optional)

    # --- time ---------------------------------------------------------------------------------------------------

    def now_ms(self) -> float:
        return (time.monotonic_ns() - self._t0_ns) / 1e6

    def _abs_ns(self, ms: float) -> int:
        """A time of the policy's clock as CLOCK_MONOTONIC nanoseconds (the board's and the hooks' clock)."""
        return self._t0_ns + int(ms * 1e6)

    def _policy_ms(self, abs_s: float) -> float:
        """CLOCK_MONOTONIC seconds (a pod manager's report) on the policy's clock."""
        return (abs_s * 1e9 - self._t0_ns) / 1e6

    # --- the board --------------------------------------------------------------------------------------------------

    def _open_board(self) -> None:
        if self._board_path_arg is None:
            log.warning("no board page (--board none): continuations and latency claims are off")
            return
        if not self._board_path_arg:
            # the default place: what killed gem-schd processes left there goes first (gem-node clears its own)
            gone = remove_stale_boards(DEFAULT_BOARD_DIR)
            if gone:
                log.info("removed %d board page(s) of gem-schd processes that are gone: %s", len(gone),
                         ", ".join(p.name for p in gone[:5]) + (", ..." if len(gone) > 5 else ""))
        path = self._board_path_arg or str(DEFAULT_BOARD_DIR / f"gemini-board-{self.scheduler_id}")
        try:
            self.board = Board.create(path)
        except (BoardError, OSError) as exc:
            log.warning("no board page (%s): continuations and latency claims are off", exc)
            self.board = None
            return
        self._assign_board_slots(self.config)
        log.info("board page %s", self.board.path)

    def _assign_board_slots(self, config: Config) -> None:
        """Every group keeps its line while it exists; a new group takes the lowest free one."""
        for name in [n for n in self._board_slots if config.group(n) is None]:
            gone = self._board_slots.pop(name)
            if self.board is not None:
                self.board.set_flare(gone, False)   # a removed group's processes raise no flare that counts
        if self.board is None:
            return
        used = set(self._board_slots.values())
        free = (i for i in range(self.board.max_groups) if i not in used)
        for name in config.names:
            if name not in self._board_slots:
                slot = next(free, None)
                if slot is None:
                    log.warning("group %s: the board is full (%d groups): its slots are never continued and "
                                "it cannot claim", name, self.board.max_groups)
                    continue
                self._board_slots[name] = slot
        self.board.set_counts(sum(1 for g in config.groups if g.latency),
                              max(self._board_slots.values(), default=-1) + 1, len(config.groups))

    # --- lifecycle ------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._open_board()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * MAX_MESSAGE_BYTES)   # peers sending huge frames are cut off by zmq
        try:
            addr = self._bind(sock)
        except BindError:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            raise
        self._sock = sock
        self.guard = ConnectionGuard(sock, self.hello_timeout_s, self.max_connections)
        self.guard.start()
        try:
            await self._start_observers()
        except BaseException:
            for obs in self.observers:
                _call(obs, "on_stop", self.now_ms())
            self.observers.clear()
            self.guard.stop()
            sock.close(0)
            self._ctx.term()
            self._sock, self._ctx = None, None
            self._unlink_socket()
            raise
        if self.socket_path is None and (addr is None or not addr.is_loopback):
            log.warning("listening on %s, which is not a loopback address: anyone who can reach it can take GPU "
                        "time (there is no authentication)", self.endpoint)
        log.info("gem-schd %s listening on %s (quota %g ms, min quota %g ms, window %g ms, cap frame %g ms%s%s), "
                 "groups: %s", self.scheduler_id, self.endpoint, self.policy.base_quota_ms, self.policy.min_quota_ms,
                 self.policy.window_ms, self.policy.cap_frame_ms, ", turns" if self.policy.frame_turns else "",
                 f", fair cycle {self.policy.fair_cycle_ms:g} ms" if self.policy.fair_cycle_ms > 0 else "",
                 ", ".join(self.config.names))
        for warning in self.config.warnings:
            log.warning("%s", warning)
        if self._needs_probe():
            # before the first message: the first grants already have the capacity
            await self._probe_capacity()
        self._recv_task = asyncio.create_task(self._recv_loop(), name="gem-schd-recv")
        self._sweep_handle = self._loop.call_later(1.0, self._sweep)
        if self.config_path:
            from gemini.reload import ConfigReloader
            self.reloader = ConfigReloader(self.config_path, self.apply_config, loop=self._loop,
                                           debounce_s=self.debounce_s, settle_s=self.settle_s,
                                           current=self.config)
            self.reloader.start()

    def _bind(self, sock: zmq.asyncio.Socket) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        """Bind the ROUTER (TCP, or the socket transport's gem-schd.sock). Returns the TCP address (None for a
        host name or a socket); BindError if it cannot listen."""
        if self.socket_path is not None:
            self._bind_ipc(sock, self.socket_path)
            return None
        try:
            addr = ipaddress.ip_address(self.ip)
        except ValueError:
            addr = None
        if transport.is_ipv6(self.ip):
            sock.setsockopt(zmq.IPV6, 1)
        endpoint = transport.tcp_endpoint(self.ip, self.port if self.port else "*")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise BindError(f"port {self.port} on {self.ip} is already in use (is another gem-schd running?)") \
                    from None
            raise BindError(f"cannot listen on {self.ip}:{self.port}: {exc.strerror}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        return addr

    def _bind_ipc(self, sock: zmq.asyncio.Socket, path: str) -> None:
        """gem-schd.sock, mode 0600: only the backend's user (and root) can speak to gem-schd, so nobody else can
        say hello for a group. A socket left by a dead gem-schd is replaced; a live one is not."""
        assert self.ipc_dir is not None
        try:
            transport.ensure_socket_dir(self.ipc_dir, self.device_uuid)
            transport.remove_stale(path, "gem-schd")
            with transport.ShortPath(path) as short:
                old = os.umask(0o177)       # created 0600 (zmq binds with the process's umask)
                try:
                    sock.bind(transport.ipc_endpoint(short.address))
                finally:
                    os.umask(old)
            os.chmod(path, transport.SCHEDULER_SOCKET_MODE)
            self._socket_inode = os.lstat(path).st_ino
        except transport.TransportError as exc:
            raise BindError(str(exc)) from None
        except (zmq.ZMQError, OSError) as exc:
            raise BindError(f"cannot listen on {path}: {exc.strerror or exc}") from None
        self.endpoint = transport.ipc_endpoint(path)
        self.port = 0

    def _unlink_socket(self) -> None:
        if self.socket_path is not None:
            transport.unlink_if_ours(self.socket_path, self._socket_inode)
            self._socket_inode = None

    async def _start_observers(self) -> None:
        # Imported here: prometheus_client is optional, and neither is needed unless asked for.
        if self.trace_path:
            from gemini.scheduler.trace import TraceWriter
            self.observers.append(TraceWriter(self.trace_path, self))
        if self.metrics_port is not None:
            from gemini.scheduler.metrics import MetricsServer
            server = MetricsServer(self)
            try:
                await server.start(self.ip, self.metrics_port)
            except OSError as exc:
                raise BindError(f"metrics: cannot listen on {self.ip}:{self.metrics_port}: {exc.strerror or exc}") \
                    from None
            self.metrics_server = server
            self.observers.append(server)

    async def wait_closed(self) -> None:
        assert self._closed is not None
        await self._closed.wait()

    def stop(self) -> None:
        """Stop serving (idempotent; call on the loop)."""
        if self._closed is None or self._closed.is_set():
            return
        self._flush_due()
        log.info("gem-schd stopping")
        if self.reloader is not None:
            self.reloader.stop()
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._probe_task is not None:
            self._probe_task.cancel()
        now = self.now_ms()
        self._dispatch(self.policy.stop(now), now)
        self._notify("on_stop", now)
        if self.guard is not None:
            self.guard.stop()
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        self._unlink_socket()
        if self.board is not None:
            self.board.unlink()
            self.board.close()
            self.board = None
        self._closed.set()

    # --- receiving ------------------------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or self._sock.closed:
                    return
                log.warning("receive failed: %s", exc)
                continue
            try:
                self._on_frames(frames)
            except Exception:  # a bug must not take the scheduler down
                log.exception("internal error while handling a message")
            self._arm_timer()

    @staticmethod
    def _peer_address(frame) -> str:
        try:
            return frame.get("Peer-Address") or "?"
        except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
            return "?"

    @staticmethod
    def _name(identity: bytes) -> str:
        text = identity.decode("utf-8", "backslashreplace")
        if not text.isprintable():
            text = identity.hex()
        return text[:80]

    def _on_frames(self, frames) -> None:
        self._flush_due()
        identity = frames[0].bytes
        if len(frames) == 2:
            envelope: list[bytes] = []
            body = frames[1]
        elif len(frames) == 3 and len(frames[1].bytes) == 0:
            envelope = [b""]
            body = frames[2]
        else:
            self._bad_log(logging.WARNING, "peer %s (%s): dropped a message of %d frames (expected 1)",
                          self._name(identity), self._peer_address(frames[-1]), len(frames) - 1)
            return
        data = body.bytes
        try:
            msg = decode(data, allowed=TO_SCHEDULER)
        except MessageError as exc:
            self._bad_log(logging.WARNING, "peer %s (%s): dropped a bad message: %s", self._name(identity),
                          self._peer_address(body), exc)
            self._send(identity, Error(ERR_BAD_MESSAGE, str(exc)[:200]), envelope)
            return
        if self.guard is not None:
            self.guard.greeted(body)
        msg = self._bounded(msg)
        peer = self._peers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if isinstance(msg, Hello):
            self._on_hello(identity, msg, self._peer_address(body), envelope)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(identity, msg, envelope)
        elif isinstance(msg, TokenRequest):
            if self._check_registered(identity, msg.group, envelope):
                now = self.now_ms()
                self._residency_update(msg.group, msg.managed)
                self._dispatch(self.policy.request(msg.group, msg.overuse_ms, msg.burst_ms, now, msg.used_ms), now)
        elif isinstance(msg, TokenRelease):
            if self._check_registered(identity, msg.group, envelope):
                now = self.now_ms()
                self._dispatch(self.policy.release(msg.group, msg.token_seq, msg.overuse_ms, now, msg.used_ms), now)
        elif isinstance(msg, ClaimReport):
            if self._check_registered(identity, msg.group, envelope):
                now = self.now_ms()
                start, end = self._policy_ms(msg.start_s), self._policy_ms(msg.end_s)
                span = self.policy.claim_span(start, end, now)
                decisions = self.policy.claimed(msg.group, start, end, now, used_ms=msg.used_ms,
                                                ahead_ms=msg.ahead_ms, held_ahead_ms=msg.held_ahead_ms)
                if span is not None:
                    # what the policy took: a report's raw span (a stale start) added 100 s to the metrics
                    self._notify("on_claim", msg.group, *span)
                self._dispatch(decisions, now)
        elif isinstance(msg, Swapped):
            if self._check_registered(identity, msg.group, envelope):
                self._on_swapped(msg)
        elif isinstance(msg, StatusRequest):
            self._send(identity, self.status_reply(), envelope)

    def _bounded(self, msg: Message) -> Message:
        """A pod manager's numbers clamped to what they can mean before the policy sees them: a burst to the
        longest slot (the base quota), times to the window, memory to a uint63, counts to MAX_CLIENTS."""
        window, longest = self.policy.window_ms, self.policy.base_quota_ms
        if isinstance(msg, TokenRequest):
            return dataclasses.replace(msg, burst_ms=_clamp(msg.burst_ms, 0.0, longest),
                                       overuse_ms=_clamp(msg.overuse_ms, 0.0, window),
                                       used_ms=_clamp(msg.used_ms, 0.0, window))
        if isinstance(msg, TokenRelease):
            return dataclasses.replace(msg, overuse_ms=_clamp(msg.overuse_ms, 0.0, window),
                                       used_ms=_clamp(msg.used_ms, 0.0, window))
        if isinstance(msg, (Hello, Heartbeat)):
            return dataclasses.replace(msg, mem_used=int(_clamp(msg.mem_used, 0, MAX_BYTES)),
                                       clients=int(_clamp(msg.clients, 0, MAX_CLIENTS)), members=_members(msg.members),
                                       managed=int(_clamp(msg.managed, 0, MAX_BYTES)))
        return msg

    def _check_registered(self, identity: bytes, group: str, envelope: list[bytes]) -> bool:
        peer = self._peers.get(identity)
        if peer is not None and peer.group == group:
            return True
        if group not in self._info:
            self._send(identity, Error(ERR_UNKNOWN_GROUP, self._unknown_text(group), group), envelope)
        else:
            self._send(identity, Error(ERR_NOT_REGISTERED, f"pod manager {self._name(identity)} is not "
                                       f"registered for group {group!r}: say hello first", group), envelope)
        return False

    def _unknown_text(self, group: str) -> str:
        return f"group {group!r} is not in {self.config.path}"

    def _on_hello(self, identity: bytes, msg: Hello, address: str, envelope: list[bytes]) -> None:
        group = msg.group
        gc = self.config.group(group)
        if gc is None:
            log.warning("pod manager %s (%s, pid %d) says hello for group %r, which is not in %s",
                        self._name(identity), address, msg.pid, group, self.config.path)
            self._forget_peer(identity)
            self._send(identity, Error(ERR_UNKNOWN_GROUP, self._unknown_text(group), group), envelope)
            return
        old = self._peers.get(identity)
        if old is not None and old.group != group:
            self._forget_peer(identity)
        owner = self._owners.get(group)
        if owner is not None and owner != identity:
            if owner in self._peers:
                log.warning("group %s: pod manager %s (%s, pid %d) replaces %s (pid %d), which is still registered",
                            group, self._name(identity), address, msg.pid, self._name(owner),
                            self._peers[owner].pid)
                self._forget_peer(owner)
            # The old pod manager's waiting request is not the new one's: it will send its own.
            now = self.now_ms()
            self._dispatch(self.policy.cancel(group, now), now)
        self._peers[identity] = _Peer(identity, group, msg.pid, address, time.monotonic())
        self._owners[group] = identity
        info = self._info.setdefault(group, _GroupInfo())
        info.mem_used, info.clients, info.connected = msg.mem_used, msg.clients, True
        info.members = msg.members
        self._residency_update(group, msg.managed, msg.mem_used)
        log.info("group %s: pod manager %s (%s, pid %d) registered, %d client(s), %d bytes in use", group,
                 self._name(identity), address, msg.pid, msg.clients, msg.mem_used)
        self._send(identity, self._welcome(gc), envelope)
        right = self.policy.claim_right(group)
        if right is not None:
            self._send(identity, ClaimRight(group, right.allowed, right.max_claim_ms), envelope)

    def _welcome(self, gc) -> Welcome:
        slot = self._board_slots.get(gc.name, -1)
        path = str(self.board.path) if self.board is not None and slot >= 0 else ""
        return Welcome(gc.name, gc.min_util, gc.max_util, gc.mem_limit, self.scheduler_id, gc.turns,
                       gc.sched_class, gc.memory_mode, path, slot, self._neighbours())

    def _neighbours(self) -> int:
        """How many other groups the config puts on this GPU (told to each pod manager: with any, an uncapped
        group's hooks keep their queue within its slots, gem-pmgr's _grant_flags)."""
        return max(0, len(self.config.groups) - 1)

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat, envelope: list[bytes]) -> None:
        if not self._check_registered(identity, msg.group, envelope):
            return
        info = self._info.setdefault(msg.group, _GroupInfo())
        info.mem_used, info.clients, info.connected = msg.mem_used, msg.clients, True
        info.members = msg.members
        self._residency_update(msg.group, msg.managed, msg.mem_used)
        self._send(identity, HeartbeatAck(self.scheduler_id), envelope)

    def _forget_peer(self, identity: bytes) -> None:
        peer = self._peers.pop(identity, None)
        if peer is not None and self._owners.get(peer.group) == identity:
            del self._owners[peer.group]
            info = self._info.get(peer.group)
            if info is not None:
                info.connected = False
            self.residency.disconnected(peer.group)
            self._residency_to_policy()
            self._stop_waiting_for(peer.group)

    def _stop_waiting_for(self, group: str) -> None:
        """A held grant waits for no eviction of a group that is gone (its pod manager, and with it its memory, or
        the group itself): kept, the grant and everyone behind it waited out the eviction timeout, 15 s or more,
        while the GPU idled."""
        held = self._held
        if held is not None and group in held.waiting:
            held.waiting.discard(group)
            if not held.waiting:
                self._release_held()

    # --- sending ----------------------------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Message, envelope: Optional[list[bytes]] = None,
              frame: Optional[bytes] = None) -> None:
        """Send msg (`frame`: msg already encoded)."""
        if self._sock is None or self._sock.closed:
            return
        try:
            fut: Any = self._sock.send_multipart([identity, *(envelope or []), frame or encode(msg)])
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %s: %s", msg.TYPE, self._name(identity), exc)
            return
        if not fut.done():
            fut.add_done_callback(_ignore_result)
        elif fut.exception() is not None:
            log.warning("could not send %s to %s: %s", msg.TYPE, self._name(identity), fut.exception())

    def _dispatch(self, decisions: list[Decision], now: Optional[float] = None) -> None:
        """Carry out the policy's decisions made at `now` (ms; default: now)."""
        if now is None:
            now = self.now_ms()
        outermost = self._deferred is None
        if outermost:
            self._deferred = []
        try:
            self._carry_out(decisions, now)
        finally:
            self._publish_waiting(now)
            if outermost:
                deferred, self._deferred = self._deferred or [], None
                for method, args in deferred:
                    self._notify(method, *args)

    def _publish_waiting(self, now: float) -> None:
        """Tell the holder's hooks on the board whether another group could be granted now (after every
        message and timer, which is when that can change; a capped waiter whose bucket fills up meanwhile is
        seen at the next one). Not while decisions made ahead wait for their time: the policy's holder is then
        the next one, while the hooks of the one before it still run their slot."""
        if self.board is None or self._ahead_until is not None:
            return
        waiting = self.policy.others_grantable(now)
        if waiting != self._board_waiting:
            self._board_waiting = waiting
            self.board.set_groups_waiting(waiting)

    def _carry_out(self, decisions: list[Decision], now: float) -> None:
        if self._ahead_until is not None:
            # Decided ahead: grants go out when their time comes, built and encoded now (a grant that waited for
            # nothing else: its quota is whole), to the pod manager that speaks for the group now. All of them
            # first: a slot no longer than continue_lead_ms is continued in the same decisions, its end (and the
            # continuation) listed before its grant.
            for d in decisions:
                if isinstance(d, GrantDecision):
                    self._early.append((d, self._owners.get(d.group)))
                    msg = self._grant_message(d, d.quota_ms)
                    self._early_frames[d.token_seq] = (msg, encode(msg))
            decisions = [d for d in decisions if not isinstance(d, GrantDecision)]
        for d in decisions:
            owner = self._owners.get(d.group)
            if isinstance(d, GrantDecision):
                if owner is None:
                    # Nobody to tell (its pod manager went away after asking): hand the token straight back, and
                    # tell the observers of neither the grant nor its end, as for a grant decided ahead that goes
                    # nowhere (_send_early; told, the metrics counted a grant nobody got)
                    log.warning("group %s was granted the token but has no pod manager; releasing it", d.group)
                    self._voided.add(d.token_seq)
                    try:
                        self._dispatch(self.policy.release(d.group, d.token_seq, 0.0, now), now)
                    finally:
                        self._voided.discard(d.token_seq)
                    continue
                held = self._held
                if d.continuation and held is not None and held.decision.token_seq == d.prev_seq:
                    # The held slot is continued before its grant went out (the evictions took longer than its
                    # quota): its pod manager never saw that slot and would ignore a continuation of it, so the
                    # held grant becomes the continued slot, sent as a fresh grant when the evictions are answered.
                    held.decision = dataclasses.replace(d, continuation=False, prev_seq=0)
                    continue
                if not d.continuation and self._hold_for_evictions(d, now):
                    continue
                if self._held is not None and self._held.decision.group != d.group:
                    self._drop_held("the policy moved on to group " + d.group, now)
                self._send_grant(owner, d)
            elif isinstance(d, SlotEndDecision):
                if d.token_seq in self._voided:
                    continue        # (handed back at its time for want of its pod manager: nobody was told of it)
                early = [(e, o) for e, o in self._early if isinstance(e, GrantDecision) and e.group == d.group
                         and e.token_seq == d.token_seq]
                if early:
                    self._end_early(d, early[0], now)
                    continue
                held = self._held
                if held is not None and held.decision.token_seq == d.token_seq and d.reason != "continued":
                    # Past its deadline (the evictions took longer than its quota) the group asks again; a slot
                    # ended by the group itself (it asked again, which queued it) or by a stop needs nothing.
                    self._drop_held(f"its slot ended ({d.reason}) before the evictions were answered", now,
                                    requeue=d.reason == "deadline")
                self._withdraw_from_board(d)
                self._notify("on_slot_end", d.group, d.token_seq, d.quota_ms, d.start_ms, d.end_ms, d.wait_ms,
                             d.reason)
            elif isinstance(d, ClaimRightDecision):
                log.info("group %s %s claim the GPU", d.group, "may" if d.allowed else "may no longer")
                if owner is not None:
                    self._send(owner, ClaimRight(d.group, d.allowed, d.max_claim_ms))
            elif isinstance(d, RefuseDecision):
                log.info("refused group %s: %s", d.group, d.message)
                if owner is not None:
                    self._send(owner, Error(d.code, d.message, d.group))

    def _withdraw_from_board(self, d: SlotEndDecision) -> None:
        """A slot that ended before its deadline (released, or a continuation voided before it began) ends on the
        board too: a holder's hooks take a continuation up from the board when their own slot runs out, and one
        that read a voided continuation there would launch until its deadline while another group holds the GPU."""
        slot = self._board_slots.get(d.group, self._gone_slots.get(d.group))
        if self.board is None or slot is None or d.reason == "deadline":
            return          # (a slot that ran to its deadline ends there on the board already)
        line = self.board.read(slot)
        if line is None:
            return
        seq, prev, deadline_ns = line
        end_ns = self._abs_ns(d.end_ms)
        if seq == d.token_seq and end_ns < deadline_ns:
            self.board.publish(slot, seq, prev, end_ns)

    def _end_early(self, d: SlotEndDecision, entry: tuple[GrantDecision, Optional[bytes]], now: float) -> None:
        """The policy ended the slot of a grant decided ahead before its time came. Continued (a slot no longer than
        continue_lead_ms, and something called the policy in the window): the grant still goes out, its end and
        the continuation after it (a pod manager takes up only a continuation of a slot it was granted). Ended
        otherwise it never began: nobody is told of it. Unless the daemon stops or the policy queued or granted
        the group again (its own new request), its pod manager still waits for an answer to the request it made
        once (the slot ran out meanwhile, the loop held up past its deadline; a release named a seq it was never
        sent), so the request goes back in the queue."""
        if d.reason == "continued":
            self._early.append((d, None))
            return
        self._early.remove(entry)
        self._early_frames.pop(d.token_seq, None)
        # A continuation ended before it began: the policy ended the slot it continues then too (_shorten_past),
        # so a chain still in the stash (its grants and their ends) never began either.
        prev = entry[0].prev_seq if entry[0].continuation else 0
        while prev:
            chain = [e for e in self._early if e[0].group == d.group and e[0].token_seq == prev]
            if not chain:
                break
            for e in chain:
                self._early.remove(e)
            self._early_frames.pop(prev, None)
            grant = next((e[0] for e in chain if isinstance(e[0], GrantDecision)), None)
            prev = grant.prev_seq if grant is not None and grant.continuation else 0
        if d.reason != "stop" and d.group not in self.policy.waiting() and self.policy.holder != d.group:
            log.info("group %s's grant (seq %d), decided ahead, ended (%s) before its time: it asks again", d.group,
                     d.token_seq, d.reason)
            self._requeue(d.group, now)

    def _send_grant(self, owner: bytes, d: GrantDecision, held: bool = False) -> None:
        deadline = d.start_ms + d.quota_ms
        slot = self._board_slots.get(d.group)
        if self.board is not None and slot is not None:
            # First the board (a continuation reaches the holder's hooks there), then the message.
            self.board.publish(slot, d.token_seq, d.prev_seq, self._abs_ns(deadline))
        early = self._early_frames.pop(d.token_seq, None)
        if early is not None and not held:
            self._send(owner, early[0], frame=early[1])
        else:
            quota = d.quota_ms
            if held and not d.continuation:
                # What is left of the slot: a grant held back for evictions goes out late, and its clock ran
                # meanwhile. A pod manager counts a fresh grant's quota from its arrival; the whole of it ran the
                # hooks as long past gem-schd's deadline as the grant was held, into the next group's slot.
                quota = min(quota, max(0.0, deadline - self.now_ms()))
            self._send(owner, self._grant_message(d, quota))
        if self._timer_start is not None:          # the first grant of a timer's decisions has left
            cpu0, due = self._timer_start
            self._timer_start = None
            self._grant_cpu_ns.append(time.thread_time_ns() - cpu0)
            self._grant_sent_ms.append((time.monotonic() - due) * 1000.0)
        self._notify("on_grant", d.group, d.token_seq, d.quota_ms, d.start_ms, d.wait_ms)
        log.debug("grant %s quota %.3f ms seq %d%s", d.group, d.quota_ms, d.token_seq,
                  " (continued)" if d.continuation else "")

    def _grant_message(self, d: GrantDecision, quota_ms: float) -> Grant:
        return Grant(d.group, quota_ms, d.token_seq, d.continuation, d.prev_seq,
                     self._abs_ns(d.start_ms + d.quota_ms) / 1e9)

    # --- residency (unified groups) -------------------------------------------------------------------------------

    def _needs_probe(self) -> bool:
        """No capacity yet, none asked for, and a unified group to manage."""
        return self._probe_state == "untried" and any(g.unified for g in self.config.groups)

    async def _probe_capacity(self) -> None:
        """Read the card's memory off the event loop (NVML may take a while to start) and take the capacity."""
        self._probe_state = "running"
        probe = self.memory_probe
        if probe is None:
            self._probe_done(None, "no way to read the GPU's memory here")
            return
        assert self._loop is not None
        # A daemon thread, not the loop's executor: a wedged driver can block nvmlInit for good, and neither
        # gem-schd's start nor its exit (asyncio joins the executor's threads) may wait for it.
        fut: asyncio.Future = self._loop.create_future()
        loop = self._loop

        def run_probe() -> None:
            try:
                result: tuple = (probe.total_bytes(), None)
            except Exception as exc:  # noqa: BLE001 -- handed to the loop, which sorts it out
                result = (None, exc)
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda: None if fut.done() else fut.set_result(result))

        threading.Thread(target=run_probe, name="gem-schd-memory-probe", daemon=True).start()
        try:
            total: Optional[int]
            total, error = await asyncio.wait_for(fut, PROBE_TIMEOUT_S)
            if error is not None:
                raise error
            why = ""
        except asyncio.TimeoutError:
            total, why = None, f"no answer within {PROBE_TIMEOUT_S:g} s"
        except ProbeError as exc:
            total, why = None, str(exc)
        except Exception as exc:    # a probe's bug must not take the scheduler down
            log.exception("device memory probe failed")
            total, why = None, f"{type(exc).__name__}: {exc}"
        self._probe_done(total, why, probe.describe())

    def _probe_done(self, total: Optional[int], why: str, where: str = "") -> None:
        self._probe_state = "done"
        if self.residency.capacity is not None:     # (cannot happen: the flag skips the probe)
            return
        capacity = capacity_for(total) if total else 0
        if capacity <= 0:
            if total:
                why = f"the GPU has {total} bytes, no more than the reserve of {reserve_for(total)} bytes"
            log.warning("unified groups are configured but gem-schd cannot take the GPU's memory as their capacity "
                        "(%s): nothing is swapped, unified groups run on the driver's page faults. Give gem-schd "
                        "(or launch-backend) --device-memory SIZE, e.g. --device-memory 24GiB", why)
            return
        self.device_total = total or 0
        self.residency.capacity = capacity
        self.capacity_source = "probe"
        log.info("unified memory: capacity %d bytes (%.1f GiB): the GPU's %d bytes (%s) less a reserve of %d "
                 "bytes; --device-memory sets it", capacity, capacity / 2**30, self.device_total, where,
                 self.device_total - capacity)
        self._residency_to_policy()
        self._arm_timer()

    def _residency_update(self, group: str, managed: int, mem_used: Optional[int] = None) -> None:
        self.residency.update(group, managed, mem_used)
        # A group that grew past the capacity (the holder allocating in its slot) pushes the least recently run
        # out now, rather than at the next grant: meanwhile the driver would make room by page faults.
        holder, now = self.policy.holder, self.now_ms()
        evictions = self.residency.overflow(holder, now)
        self._ask_evictions(evictions, holder or "a group that grew", now)
        if self._held is not None:
            # A grant held for evictions waits for these too: sent before they are answered, its group's prefetch
            # would run while their memory is still on the GPU, past the capacity.
            self._held.waiting |= {ev.group for ev in evictions if ev.group in self._owners}
        self._residency_to_policy()

    def _residency_to_policy(self) -> None:
        """What residency asks of the policy: unified slots long enough for their swaps, and grants that would
        evict paced to one per slot floor (a timer wakes the policy when a paced group becomes eligible)."""
        self.policy.quota_floor = self.residency.quota_floor_ms()
        self.policy.not_before = self.residency.swap_gate()
        self._publish_waiting(self.now_ms())    # the pacing decides who could be granted now

    def _hold_for_evictions(self, d: GrantDecision, now: float) -> bool:
        """A unified group's grant: ask the least recently run groups to evict first if its memory does not fit;
        then the grant waits for their answers (True). The slot's clock runs meanwhile: the swap is part of it."""
        if not self.residency.any_unified():
            # (no unified group: nothing to evict or wait for, and the policy's floors and pacing were set empty
            # when the config said so; the walk below cost 60-110 µs of every grant at 64 groups)
            return False
        evictions = self.residency.before_grant(d.group, now)
        if not self.residency.fits_alone(d.group):
            log.warning("group %s: its memory does not fit in --device-memory %d bytes even with every other "
                        "unified group evicted: it runs on the driver's page faults", d.group,
                        self.residency.capacity or 0)
        self._ask_evictions(evictions, d.group, now)
        # Evictions asked for an earlier grant and not answered yet count too: that memory may still be on the GPU.
        waiting = {g for g in self.residency.outstanding() if g in self._owners}
        self._residency_to_policy()
        if not waiting:
            return False
        if self._held is not None:
            # (a newer grant of the same group answers the same request: no need to ask again)
            self._drop_held("a newer grant", now, requeue=self._held.decision.group != d.group)
        self._held = _HeldGrant(d, waiting)
        if self._loop is not None:
            # plus a second per GB being moved: an H100 moved 12.5 GB to the host in up to 7 s (1.8 GB/s)
            moving = sum(self.residency.tenants[g].managed for g in waiting if g in self.residency.tenants)
            self._held.timer = self._loop.call_later(self.evict_timeout_s + moving / EVICT_BYTES_PER_S,
                                                     self._evict_timed_out, self._held)
        return True

    def _ask_evictions(self, evictions: list[Eviction], for_group: str, now: float) -> None:
        for ev in evictions:
            owner = self._owners.get(ev.group)
            log.info("group %s evicted (%d bytes) to make room for %s", ev.group, ev.bytes, for_group)
            self._notify("on_evict", ev.group, ev.seq, ev.bytes, now)
            if owner is None:
                self.residency.evicted(ev.group, ev.seq, 0, 0.0)
                continue
            self._send(owner, Evict(ev.group, ev.seq))

    def _on_swapped(self, msg: Swapped) -> None:
        self._residency_update(msg.group, msg.managed)
        if msg.direction == "device":
            self.residency.prefetched(msg.group, msg.moved_bytes, msg.took_ms)
            self._notify("on_swap", msg.group, "device", 0, msg.moved_bytes, msg.took_ms, self.now_ms(), True)
            return
        answered = self.residency.evicted(msg.group, msg.seq, msg.moved_bytes, msg.took_ms)
        self._notify("on_swap", msg.group, "host", msg.seq, msg.moved_bytes, msg.took_ms, self.now_ms(),
                     msg.complete)
        if not msg.complete:
            log.warning("group %s: eviction %d incomplete (a process did not answer, or could not move all of its "
                        "memory): the driver's page faults "
                        "make the rest of the room", msg.group, msg.seq)
        held = self._held
        if answered and held is not None and msg.group in held.waiting:
            held.waiting.discard(msg.group)
            if not held.waiting:
                self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        owner = self._owners.get(held.decision.group)
        if owner is None:
            return
        if self.policy.holder_seq == held.decision.token_seq:
            self._send_grant(owner, held.decision, held=True)
        else:
            # (the slot's end and continuation are handled in _dispatch; this is the safety net)
            log.info("held grant of group %s is stale (slot %d is over): asking again", held.decision.group,
                     held.decision.token_seq)
            self._requeue(held.decision.group, self.now_ms())

    def _evict_timed_out(self, held: _HeldGrant) -> None:
        if self._held is not held:
            return
        log.warning("evictions for group %s's grant not answered within %.1f s (%s): granting anyway",
                    held.decision.group, self.evict_timeout_s, ", ".join(sorted(held.waiting)))
        for group in held.waiting:
            self.residency.abandon(group)
        self._release_held()
        self._arm_timer()

    def _drop_held(self, why: str, now: float, requeue: bool = True) -> None:
        """The held grant will not go out. Its group's pod manager still waits for an answer to the request the
        grant answered (it asks only once), so unless gem-schd is stopping, the request goes back in the queue:
        dropped silently, the group's processes waited for the token forever (issue 19)."""
        held, self._held = self._held, None
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        log.info("held grant of group %s dropped (%s)%s", held.decision.group, why,
                 ": it asks again" if requeue else "")
        if requeue:
            self._requeue(held.decision.group, now)

    def _requeue(self, group: str, now: float) -> None:
        """Put a group whose grant never reached it back in the policy's queue (its place: now)."""
        if group in self._owners:
            self._dispatch(self.policy.request(group, now=now), now)

    def _notify(self, method: str, *args) -> None:
        if self._deferred is not None:
            self._deferred.append((method, args))
            return
        for obs in self.observers:
            _call(obs, method, *args)

    # --- timers -----------------------------------------------------------------------------------------------------

    def _flush_due(self) -> None:
        """Grants decided ahead whose time has come go out before anything else is handled: the timer's call at
        that time may still wait behind messages, and a message handled first moves the policy's clock on (past a
        slot that waits in the stash, if the loop was held up longer than it)."""
        if self._ahead_until is not None and self.now_ms() >= self._ahead_until:
            target = self._ahead_until
            self._wake_target = self._wake_at = None        # (the timer's call, when it comes, finds nothing to do)
            self._send_early(target)
            self._arm_timer()

    def _ahead_s(self, wake: float) -> float:
        """How long before the policy's time `wake` (ms) it decides (s): decide_ahead_ms when that is the end of
        the running slot, whose next holder waits for it; 0 for the other times a timer serves (the point
        continue_lead_ms before a deadline, whose continuation needs no haste; a cap lifting or a claim right
        coming back on an idle GPU, where moving the clock on would only hold back a request meanwhile). Not with
        unified groups: a grant of theirs may ask other groups to evict first, and a holder must not be asked
        before its slot is over."""
        if self.decide_ahead_ms <= 0 or self.residency.any_unified():
            return 0.0
        deadline = self.policy.holder_deadline
        if deadline is None or abs(deadline - wake) > 1e-9:
            return 0.0
        return self.decide_ahead_ms / 1000.0

    def _arm_timer(self) -> None:
        if self._loop is None or self._closed is None or self._closed.is_set():
            return
        if self._timer is None:
            self._timer = PreciseTimer(self._loop, self._on_timer)
        at: Optional[float]
        if self._ahead_until is not None:       # grants decided ahead: they go out at their time
            wake: Optional[float] = self._ahead_until
            at = self._t0 + self._ahead_until / 1000.0
        else:
            wake = self.policy.next_wakeup(self.now_ms())
            at = None if wake is None else self._t0 + wake / 1000.0 - self._ahead_s(wake)
        if wake == self._wake_target and at == self._wake_at:
            return
        self._wake_target, self._wake_at = wake, at
        self._timer.arm(at)

    def _on_timer(self, when: float) -> None:
        """A timer fired. The policy's decisions at the end T of the running slot (_ahead_s) are made
        decide_ahead_ms before T, as at T (the policy's clock is moved on to T: what arrives meanwhile counts as
        arriving at T); their grants wait, and go out at T at the cost of a send. From a deadline to the next
        holder's grant sent, gem-schd's event loop ran the policy, built the grant and sent it: 226-249 us of CPU
        at p50 on an H200's host, where what runs after a quiet wake-up is slow (issue 14's goal: 100 us). Late
        (the loop was busy past T), the timer decides and sends at once."""
        target = self._wake_target
        if target is None or self._wake_at is None or abs(self._wake_at - when) > 1e-9:
            return                              # re-armed or cancelled after this one fired
        self._wake_target = self._wake_at = None
        if self._ahead_until is not None:
            self._send_early(target)
            self._arm_timer()
            return
        cpu0 = time.thread_time_ns()
        now = self.now_ms()
        ahead = now < target - 1e-6 and self._ahead_s(target) > 0
        if ahead:
            now, self._ahead_until = target, target
        else:
            self._timer_start = (cpu0, self._t0 + target / 1000.0)
        try:
            decisions = self.policy.tick(now)
            granted = any(isinstance(d, GrantDecision) for d in decisions)
            if granted and not ahead:
                self._decided_late += 1
                self._lateness.append(now - target)
            if not granted:
                self._timer_start = None
            self._dispatch(decisions, now)      # (measured as the grant leaves: _send_grant)
            # Ahead, the timer's time is kept even with no grant made: the slot that ended at it still runs until
            # then, and a grant made meanwhile (a request that finds the GPU free then, or the next one after the
            # holder's release) must not go out before it.
            if ahead and self._early:
                self._early_by_timer = True
                self._decide_cpu_ns.append(time.thread_time_ns() - cpu0)
        except Exception:  # a bug must not stop the timer: the next deadline would never be decided
            # Retried 10 ms later, not at once: an error that recurs must not spin the event loop, nor fill the
            # log (one traceback a second).
            self._tick_error_log(logging.ERROR, "internal error while deciding at a deadline (retried every 10 ms)",
                                 exc_info=True)
            assert self._loop is not None
            self._loop.call_later(0.01, self._arm_timer)
            return
        finally:
            self._timer_start = None
        self._arm_timer()

    @staticmethod
    def _ordered(early: list) -> list:
        """The stash in the order its grants were made (token_seq), each grant's end (a continued slot) right after
        it: a pod manager takes up a continuation only after the grant it continues."""
        grants = sorted((e for e in early if isinstance(e[0], GrantDecision)), key=lambda e: e[0].token_seq)
        ends = [e for e in early if not isinstance(e[0], GrantDecision)]
        out = []
        for g in grants:
            out.append(g)
            out += [e for e in ends if e[0].token_seq == g[0].token_seq]
        seqs = {g[0].token_seq for g in grants}
        return out + [e for e in ends if e[0].token_seq not in seqs]

    def _send_early(self, target: float) -> None:
        """The time the grants in `_early` were decided for has come: send them (measured as in _on_timer). One
        whose group has no pod manager now, or another than when it was decided (a new one said hello: it did not
        ask), or is no longer configured, goes nowhere: it is handed back at once, and nobody is told of it."""
        self._timer_start = (time.thread_time_ns(), self._t0 + target / 1000.0)
        early, self._early, self._ahead_until = self._ordered(self._early), [], None
        by_timer, self._early_by_timer = self._early_by_timer, False
        now = self.now_ms()
        names = {g.name for g in self.config.groups}
        voided: list[GrantDecision] = []
        gone: set[int] = set()          # token_seqs voided: a grant for another pod manager, and what continues it
        for d, owner in early:
            if isinstance(d, GrantDecision) and (owner is None or self._owners.get(d.group) != owner
                                                 or d.group not in names or (d.continuation and d.prev_seq in gone)):
                voided.append(d)
                gone.add(d.token_seq)
        going: list[Decision] = [d for d, _owner in early if d.token_seq not in gone]
        try:
            if any(isinstance(d, GrantDecision) for d in going):
                if by_timer:
                    self._decided_ahead += 1
                self._lateness.append(now - target)
            self._dispatch(going, now)
            self._voided.update(d.token_seq for d in voided)
            try:
                for d in voided:
                    log.info("group %s's grant (seq %d), decided ahead, not sent: %s", d.group, d.token_seq,
                             "its group is no longer configured" if d.group not in names else
                             "it has no pod manager now" if self._owners.get(d.group) is None else
                             "another pod manager speaks for it now")
                    self._dispatch(self.policy.release(d.group, d.token_seq, 0.0, now), now)
            finally:
                self._voided.clear()
        except Exception:   # (as in _on_timer: logged, and the timer goes on)
            self._tick_error_log(logging.ERROR, "internal error while sending grants decided ahead", exc_info=True)
        finally:
            self._timer_start = None
            self._early_frames.clear()

    def timer_stats(self) -> dict:
        """Grants made at a timer (slot deadlines, caps lifting), the last 4096: count, their lateness (ms) p50,
        p99 and max, and from the timer to the grant sent (the grant's message handed to zmq) the loop's CPU time
        (µs) and the wall time from the deadline (ms), p50 and p99."""
        values = sorted(self._lateness)
        if not values:
            return {"count": 0}
        pick = lambda v, q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
        cpu, sent, decide = sorted(self._grant_cpu_ns), sorted(self._grant_sent_ms), sorted(self._decide_cpu_ns)
        return {"count": len(values), "p50_ms": pick(values, 0.5), "p99_ms": pick(values, 0.99), "max_ms": values[-1],
                "cpu_p50_us": pick(cpu, 0.5) / 1000.0 if cpu else 0.0,
                "cpu_p99_us": pick(cpu, 0.99) / 1000.0 if cpu else 0.0,
                "sent_p50_ms": pick(sent, 0.5) if sent else 0.0, "sent_p99_ms": pick(sent, 0.99) if sent else 0.0,
                "decided_ahead": self._decided_ahead, "decided_late": self._decided_late,
                "decide_cpu_p50_us": pick(decide, 0.5) / 1000.0 if decide else 0.0,
                "decide_cpu_p99_us": pick(decide, 0.99) / 1000.0 if decide else 0.0}

    def _sweep(self) -> None:
        """Every second: pod managers silent for too long are marked disconnected and their requests dropped."""
        assert self._loop is not None
        self._flush_due()
        now = time.monotonic()
        for identity, peer in list(self._peers.items()):
            if now - peer.last_seen > self.heartbeat_timeout_s:
                log.warning("group %s: pod manager %s (%s, pid %d) silent for %.1f s: marked disconnected, its "
                            "waiting request dropped", peer.group, self._name(identity), peer.address, peer.pid,
                            now - peer.last_seen)
                self._forget_peer(identity)
                if peer.group not in self._owners:
                    slot = self._board_slots.get(peer.group, -1)
                    if self.board is not None and slot >= 0 and self.board.flare(slot):
                        # its flares were the pod manager's to audit: none count until a pod manager says so again
                        self.board.set_flare(slot, False)
                    t = self.now_ms()
                    self._dispatch(self.policy.cancel(peer.group, t), t)
        if self.guard is not None:
            self.guard.sweep()
        self._arm_timer()
        self._sweep_handle = self._loop.call_later(1.0, self._sweep)

    # --- config -----------------------------------------------------------------------------------------------------

    def apply_config(self, config: Config) -> None:
        """Switch to a new config (from the reloader, on the loop): the policy first, then push the changes."""
        self._flush_due()
        old = self.config
        diff = diff_configs(old, config)
        self.config = config
        # (a removed group's board line, for the reload's own decisions: a continuation of its voided there)
        self._gone_slots = {n: i for n, i in self._board_slots.items() if config.group(n) is None}
        self._assign_board_slots(config)
        self.residency.configure({g.name: g.unified for g in config.groups})
        if self._held is not None:
            # an evictee that is no longer unified (or no longer there) will not answer usefully: not waited for
            for group in sorted(self._held.waiting - self.residency.outstanding()):
                self._stop_waiting_for(group)
        self._residency_to_policy()
        if self._needs_probe() and self._loop is not None:
            # the first unified group: take the capacity as soon as the probe answers (off the loop)
            self._probe_state = "running"
            self._probe_task = self._loop.create_task(self._probe_capacity(), name="gem-schd-memory-probe")
        now = self.now_ms()
        decisions = self.policy.apply_config(config, now)
        # Refusals go to the owners of removed groups: dispatch them before forgetting those owners.
        try:
            self._dispatch(decisions, now)
        finally:
            self._gone_slots = {}
        for name in diff.added:
            self._info.setdefault(name, _GroupInfo())
        # The changed groups, and every group when the number of groups changed (each is told its neighbours).
        recount = len(old.groups) != len(config.groups)
        for name in ([g.name for g in config.groups] if recount else diff.changed):
            owner = self._owners.get(name)
            gc = config.group(name)
            if owner is not None and gc is not None:
                self._send(owner, ConfigUpdate(name, gc.min_util, gc.max_util, gc.mem_limit, gc.turns,
                                               gc.sched_class, gc.memory_mode, self._neighbours()))
        for name in diff.removed:
            owner = self._owners.get(name)
            if owner is not None:
                self._send(owner, GroupRemoved(name))
                self._forget_peer(owner)
            self._info.pop(name, None)
            self._stop_waiting_for(name)
        if not diff.empty:
            log.info("config applied: added %s, changed %s, removed %s", list(diff.added) or "none",
                     list(diff.changed) or "none", list(diff.removed) or "none")
        self._notify("on_config", config, diff, now)
        self._arm_timer()

    # --- status -----------------------------------------------------------------------------------------------------

    def reported_shares(self, now: float) -> dict[str, float]:
        """Each group's share as gem-schd reports it (gemini/scheduler/share.py): the policy's charges over the
        whole window. gem-ctl status, the metrics and the trace's share samples all read it here."""
        return {gc.name: reported_share(self.policy.usage(gc.name, now), self.policy.window_ms)
                for gc in self.config.groups}

    def status_reply(self) -> StatusReply:
        now = self.now_ms()
        pstat = self.policy.status(now)
        shares = self.reported_shares(now)
        groups = []
        for gc in self.config.groups:
            p = pstat.get(gc.name)
            info = self._info.get(gc.name, _GroupInfo())
            if p is None:
                continue
            groups.append(asdict(GroupStatus(
                name=gc.name, min_util=gc.min_util, max_util=gc.max_util, share=shares[gc.name],
                mem_used=info.mem_used, mem_limit=gc.mem_limit, clients=info.clients, holding=p.holding,
                waiting=p.waiting, wait_ms=p.wait_ms, quota_ms=p.quota_ms, grants=p.grants,
                connected=info.connected, sched_class=p.sched_class, target=p.target,
                continuations=p.continuations, claims=p.claims, claim_ms=p.claim_ms,
                claim_allowed=p.claim_allowed, members=info.members if info.connected else [],
                **self._residency_status(gc.name))))
        holder = next((g["name"] for g in groups if g["holding"]), "")
        rejected = self.reloader.rejected if self.reloader is not None else None
        return StatusReply(self.scheduler_id, self.policy.window_ms, holder, groups, rejected or "",
                           self.residency.capacity or 0, self.residency.measured_gbps,
                           self.capacity_source if self.residency.capacity else "", self.device_total)

    def _residency_status(self, group: str) -> dict:
        t = self.residency.tenants.get(group)
        if t is None or not t.unified:
            return {}
        return {"memory_mode": "unified", "managed_bytes": t.managed,
                "resident_bytes": self.residency.resident_bytes(group),
                "swapped_in_bytes": t.swapped_in, "swapped_out_bytes": t.swapped_out, "swap_ms": t.swap_ms,
                "evictions": t.evictions}


def _call(observer, method: str, *args) -> None:
    fn = getattr(observer, method, None)
    if fn is None:
        return
    try:
        fn(*args)
    except Exception:  # an observer's bug must not take the scheduler down
        log.exception("observer %s.%s failed", type(observer).__name__, method)


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
