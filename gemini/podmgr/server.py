"""gem-pmgr's I/O: hook connections (asyncio, a Unix socket or TCP) and the scheduler link (zmq DEALER).

This module only moves frames: it decodes what comes in, hands it to manager.PodManager and carries out
the actions it returns. Each hook connection is read continuously, so a TOKEN_REQUEST that waits for a
grant never holds up a MEM_ALLOC sent on the same connection by another thread of the process.

Peers. On the socket transport (`ipc_dir`) the kernel names every client (SO_PEERCRED): its pid is used for
the dead-client check (a pidfd: the connection is dropped when the process is gone, even if its descriptor
lives on in another process), pid and uid go to gem-ctl status, and a PeerAuthorizer may refuse it. Every
connection must say HELLO within `limits.hello_timeout_s`; connections are capped per process, per user and
in all (admission.py). What a client reports is bounded before the manager sees it (`bounded`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import zmq
import zmq.asyncio

from gemini import transport
from gemini.peercred import PeerCredentials, peer_credentials
from gemini.wire import sched as sm
from gemini.wire import hook as hp

from gemini.board import Board, Flare

from .admission import Admission, Limits
from .auth import AllowAll, PeerAuthorizer
from .ledger import LedgerFile
from .ledger import load as load_ledger
from .manager import REJOIN_GRACE_S, Action, CloseHook, PodManager, ToHook, ToScheduler

log = logging.getLogger("gemini.podmgr")

TICK_S = 0.05
MAX_WRITE_BUFFER = 1 << 20  # a hook that stops reading its replies is dropped past this
MAX_REPORT_NS = 60 * 10**9  # a burst, overuse or use reported by a hook counts for at most a minute


def bounded(msg: hp.Message) -> hp.Message:
    """A hook's report with its times clamped to [0, MAX_REPORT_NS]: no client can ask for an hour-long slot
    or overflow a sum (gem-schd caps the burst again, at its longest slot)."""
    if isinstance(msg, (hp.TokenRequest, hp.TokenRelease)):
        changes = {f: min(max(getattr(msg, f), 0), MAX_REPORT_NS) for f in ("overuse_ns", "burst_ns", "used_ns")}
        if any(changes[f] != getattr(msg, f) for f in changes):
            return dataclasses.replace(msg, **changes)
    return msg


def own_pid_namespace() -> int:
    """The inode of this process's pid namespace (what hooks send in HELLO's pid_ns), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def process_exists(pid: int) -> bool:
    """Is there a process `pid` in this pid namespace? (Not allowed to signal it still means it exists.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _peer_name(writer: asyncio.StreamWriter, creds: PeerCredentials | None) -> str:
    if creds is not None:
        return f"pid {creds.pid} uid {creds.uid}"
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "unix"


class PodManagerServer:
    """Serves one group: `await start()`, then `await stop()`.

    TCP (the default, Gemini's): hooks on ip:port, gem-schd at scheduler_ip:scheduler_port. Socket transport
    (`ipc_dir` given): hooks on DIR/<gpu>/group.<name>.sock with `socket_access`, gem-schd at
    SDIR/<gpu>/gem-schd.sock, SDIR `scheduler_ipc_dir` or else DIR (see gemini/transport.py); no TCP port is opened.
    """

    def __init__(self, group: str, ip: str = transport.DEFAULT_IP, port: int = transport.DEFAULT_POD_MANAGER_PORT, *,
                 scheduler_ip: str = transport.DEFAULT_IP, scheduler_port: int = transport.DEFAULT_SCHEDULER_PORT,
                 device_uuid: str | None = None, clock: Callable[[], float] = time.monotonic,
                 ipc_dir: str | os.PathLike | None = None,
                 socket_access: transport.SocketAccess | None = None,
                 authorizer: PeerAuthorizer | None = None, limits: Limits | None = None,
                 ledger_path: str | os.PathLike | None = None, rejoin_grace_s: float = REJOIN_GRACE_S,
                 scheduler_ipc_dir: str | os.PathLike | None = None):
        self.ip = ip
        self.requested_port = port
        self.ipc_dir = Path(os.path.abspath(ipc_dir)) if ipc_dir is not None else None
        self.scheduler_ipc_dir = Path(os.path.abspath(scheduler_ipc_dir)) if scheduler_ipc_dir else self.ipc_dir
        self.device_uuid = device_uuid
        self.socket_access = socket_access or transport.SocketAccess()
        self.authorizer: PeerAuthorizer = authorizer or AllowAll()
        self.admission = Admission(limits or Limits())
        self.socket_path: Path | None = None
        self._socket_inode: int | None = None
        self._scheduler_path: transport.ShortPath | None = None
        if self.ipc_dir is not None:
            self.socket_path = transport.group_socket(self.ipc_dir, group, device_uuid)
            assert self.scheduler_ipc_dir is not None
            self.scheduler_endpoint = transport.ipc_endpoint(str(transport.scheduler_socket(self.scheduler_ipc_dir,
                                                                                             device_uuid)))
            self._scheduler_ipv6 = False
        else:
            self.scheduler_endpoint = transport.tcp_endpoint(scheduler_ip, scheduler_port)
            self._scheduler_ipv6 = transport.is_ipv6(scheduler_ip)
        self.manager = PodManager(group, clock, device_uuid=device_uuid, scheduler_addr=self.scheduler_endpoint,
                                  board_open=Board.open, flare_create=Flare.create, pid_ns=own_pid_namespace(),
                                  process_exists=process_exists)
        # The ledger file (ledger.py): beside the group's socket, or where --ledger says; none on TCP without it.
        if ledger_path is None and self.socket_path is not None:
            ledger_path = self.socket_path.with_name(self.socket_path.name.removesuffix(".sock") + ".ledger")
        self._ledger: LedgerFile | None = None
        if ledger_path is not None:
            path = Path(os.path.abspath(ledger_path))
            found = load_ledger(path, group)
            if found.found:
                self.manager.begin_recovery(found.holders, rejoin_grace_s)
            self._ledger = LedgerFile(path, group)
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._pidfds: dict[int, int] = {}
        self._server: asyncio.base_events.Server | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._hook_tasks: set[asyncio.Task] = set()
        self._refusals_logged = 0.0

    @property
    def port(self) -> int:
        """The TCP port actually bound (useful with port 0); 0 on the socket transport."""
        assert self._server is not None and self._server.sockets
        name = self._server.sockets[0].getsockname()
        return name[1] if isinstance(name, tuple) else 0

    @property
    def where(self) -> str:
        """Where the hooks reach this pod manager, for messages."""
        return str(self.socket_path) if self.socket_path is not None else f"{self.ip}:{self.port}"

    async def start(self) -> None:
        """Listen for hooks (OSError if the port is busy, TransportError for an unusable socket), connect to the
        scheduler, register."""
        await self._listen()
        self._ctx = zmq.asyncio.Context()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, f"{self.manager.group}:{os.getpid()}".encode())
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue only to a live connection: while the scheduler is away a send fails at once (the manager
        # re-sends what matters) instead of piling up heartbeats to be replayed later.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self._scheduler_ipv6:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self._scheduler_connect_endpoint())
        self._dealer = dealer
        log.info("group %r: hooks on %s, gem-schd at %s", self.manager.group, self.where, self.scheduler_endpoint)
        self._dispatch(self.manager.start())
        self._tasks = [asyncio.create_task(self._scheduler_reader(), name="pmgr-scheduler"),
                       asyncio.create_task(self._ticker(), name="pmgr-tick")]

    async def _listen(self) -> None:
        if self.socket_path is None:
            self._server = await asyncio.start_server(self._serve_hook, self.ip, self.requested_port)
            return
        assert self.ipc_dir is not None
        transport.ensure_socket_dir(self.ipc_dir, self.device_uuid)
        sock = transport.bind_unix(self.socket_path, self.socket_access, f"gem-pmgr for group {self.manager.group!r}")
        self._socket_inode = os.lstat(self.socket_path).st_ino
        self._server = await asyncio.start_unix_server(self._serve_hook, sock=sock)

    def _scheduler_connect_endpoint(self) -> str:
        if self.scheduler_ipc_dir is None:
            return self.scheduler_endpoint
        # zmq reconnects with this address for as long as we run: a long path's directory stays open
        self._scheduler_path = transport.ShortPath(transport.scheduler_socket(self.scheduler_ipc_dir,
                                                                              self.device_uuid))
        return transport.ipc_endpoint(self._scheduler_path.address)

    async def stop(self, farewell: str | None = None) -> None:
        """Stop serving. `farewell`: why, told to every connected hook first (an ERROR push, UNKNOWN_GROUP), so
        that its process can say so rather than only that the pod manager went away."""
        self.manager.drop_flare()       # its flares counted only while this pod manager audited them
        if self._ledger is not None:    # before the connections close: what a successor must wait for
            self._ledger.close({} if farewell else self.manager.ledger_record())
            self._ledger = None
        if farewell:
            for cid, client in self.manager.clients.items():
                writer = self._writers.get(cid)
                if client.greeted and writer is not None and not writer.is_closing():
                    writer.write(hp.error_frame(hp.ErrorCode.UNKNOWN_GROUP, farewell, 0))
        if self._server is not None:
            self._server.close()
        if self.socket_path is not None:
            transport.unlink_if_ours(self.socket_path, self._socket_inode)
        for task in self._tasks + list(self._hook_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._hook_tasks, return_exceptions=True)
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()
        for cid in list(self._pidfds):
            self._forget_pid(cid)
        if self._server is not None:
            await self._server.wait_closed()
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._scheduler_path is not None:
            self._scheduler_path.close()
        self._tasks = []

    # --- actions -----------------------------------------------------------------------------

    def _dispatch(self, actions: Iterable[Action]) -> None:
        self._record()
        for action in actions:
            if isinstance(action, ToHook):
                self._write_hook(action)
            elif isinstance(action, CloseHook):
                writer = self._writers.pop(action.client_id, None)
                if writer is not None:
                    writer.close()      # the reader task sees the close and tells the manager
            elif isinstance(action, ToScheduler):
                self._send_scheduler(action.msg)

    def _record(self) -> None:
        """Keep the ledger file up to date (before any reply goes out: a holder is on record before it is told)."""
        if self._ledger is not None:
            self._ledger.update(self.manager.ledger_record(), time.monotonic())

    def _write_hook(self, action: ToHook) -> None:
        writer = self._writers.get(action.client_id)
        if writer is None or writer.is_closing():
            return
        msg = action.msg
        try:
            if isinstance(msg, hp.Error):
                frame = hp.error_frame(hp.ErrorCode(msg.code), msg.message, action.seq)
            else:
                frame = hp.encode(msg, action.seq)
        except (ValueError, OverflowError, TypeError) as exc:
            # A reply that does not fit its frame is our bug, not the hook's: it gets an error naming it instead of
            # no answer, and the actions after it still go out.
            log.error("cannot encode %s for client %d: %s", msg.TYPE.name, action.client_id, exc)
            frame = hp.error_frame(hp.ErrorCode.INTERNAL, f"the pod manager could not encode its {msg.TYPE.name}: "
                                   f"{exc}", action.seq)
        writer.write(frame)
        if writer.transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.warning("client %d does not read its replies: closing it", action.client_id)
            self._writers.pop(action.client_id, None)
            writer.transport.abort()

    def _send_scheduler(self, msg: sm.Message) -> None:
        assert self._dealer is not None
        future: Any = self._dealer.send(sm.encode(msg), flags=zmq.NOBLOCK)
        if future.done() and future.exception() is not None:
            log.debug("gem-schd link down: %s not sent", msg.TYPE)
            self._dispatch(self.manager.upstream_failed(msg))

    # --- hook connections ----------------------------------------------------------------------

    def _refuse(self, writer: asyncio.StreamWriter, peer: str, text: str, seq: int = 0) -> None:
        """Tell a connection why it is refused, and close it. Logged at most once a second (floods)."""
        now = time.monotonic()
        if now - self._refusals_logged >= 1.0:
            self._refusals_logged = now
            log.warning("refused a connection (%s): %s", peer, text)
        try:
            writer.write(hp.error_frame(hp.ErrorCode.REFUSED, text[:hp.ERRMSG_LEN - 1], seq))
        except (ConnectionError, OSError):
            pass
        writer.close()

    async def _serve_hook(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._hook_tasks.add(task)
        creds = peer_credentials(writer.get_extra_info("socket"))
        peer = _peer_name(writer, creds)
        cid = self.manager.connect(peer, creds)
        refusal = self.admission.admit(cid, creds)
        if refusal is not None:
            self.manager.disconnect(cid)
            self._refuse(writer, peer, refusal)
            if task is not None:
                self._hook_tasks.discard(task)
            return
        self._writers[cid] = writer
        self._watch_pid(cid, creds)
        greeted = False
        try:
            while cid in self._writers:
                if greeted:
                    frame = await self._read_frame(cid, peer, reader)
                else:
                    frame = await self._read_hello(cid, peer, reader)
                if frame is None:
                    break
                seq, msg = frame
                if not greeted and isinstance(msg, hp.Hello) and creds is not None:
                    refusal = self._authorize(creds, msg.pod_name)
                    if refusal is not None:
                        self._writers.pop(cid, None)
                        self._refuse(writer, peer, refusal, seq)
                        break
                greeted = True
                try:
                    actions = self.manager.on_hook(cid, seq, bounded(msg))
                except Exception:   # a bug: this connection ends, the daemon keeps serving the others
                    log.exception("client %d (%s): handling %s failed", cid, peer, msg.TYPE.name)
                    actions = [ToHook(cid, seq, hp.Error(code=int(hp.ErrorCode.INTERNAL),
                                                         message="internal error in gem-pmgr (see its log)")),
                               CloseHook(cid)]
                self._dispatch(actions)
        except (ConnectionError, OSError) as exc:
            log.info("client %d (%s): connection lost: %s", cid, peer, exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._writers.pop(cid, None)
            writer.close()
            self._forget_pid(cid)
            self.admission.release(cid)
            self._dispatch(self.manager.disconnect(cid))
            if task is not None:
                self._hook_tasks.discard(task)

    def _authorize(self, creds: PeerCredentials, hello_group: str) -> str | None:
        try:
            return self.authorizer.authorize(creds, hello_group)
        except Exception:   # a broken authorizer refuses: it must never let everyone in
            log.exception("the peer authorizer failed for pid %d uid %d", creds.pid, creds.uid)
            return "the pod manager could not check this process (see its log)"

    async def _read_hello(self, cid: int, peer: str, reader: asyncio.StreamReader):
        """The first frame, which must come within the HELLO deadline (else the connection is closed)."""
        try:
            return await asyncio.wait_for(self._read_frame(cid, peer, reader), self.admission.limits.hello_timeout_s)
        except asyncio.TimeoutError:
            now = time.monotonic()
            if now - self._refusals_logged >= 1.0:
                self._refusals_logged = now
                log.warning("client %d (%s) said nothing for %.1f s: closed", cid, peer,
                            self.admission.limits.hello_timeout_s)
            return None

    async def _read_frame(self, cid: int, peer: str, reader: asyncio.StreamReader):
        """(seq, message), or None when the connection is over (EOF, or a bad frame answered and logged)."""
        seq, in_frame = 0, False
        try:
            head = await reader.readexactly(hp.HEADER_SIZE)
            in_frame = True
            seq = hp.decode_header(head).seq
            rest = await reader.readexactly(hp.MSG_SIZE - hp.HEADER_SIZE)
            return hp.decode(head + rest, hp.HOOK_TO_PMGR)
        except asyncio.IncompleteReadError as exc:
            if exc.partial or in_frame:
                self._reject(cid, peer, hp.ProtocolError(
                    hp.ErrorCode.PROTOCOL, f"truncated frame: the connection closed {len(exc.partial)} "
                    f"bytes into a {exc.expected}-byte read"), seq)
            return None
        except hp.ProtocolError as exc:
            self._reject(cid, peer, exc, seq)
            return None

    def _reject(self, cid: int, peer: str, exc: hp.ProtocolError, seq: int) -> None:
        log.warning("client %d (%s): %s; closing that connection", cid, peer, exc.message)
        self._dispatch([ToHook(cid, seq, hp.Error(code=int(exc.code), message=exc.message)), CloseHook(cid)])

    # --- dead clients --------------------------------------------------------------------------

    def _watch_pid(self, cid: int, creds: PeerCredentials | None) -> None:
        """Drop the connection as soon as its process is gone, even if the socket lives on in another process
        (a descriptor inherited or passed on). A pidfd names exactly that process, so a reused pid cannot fool
        it. Without pidfds (old kernels) only the connection's close counts, as on TCP."""
        if creds is None or creds.pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(creds.pid)
        except OSError:     # already gone (ESRCH), or not allowed: the close will tell
            return
        self._pidfds[cid] = fd
        asyncio.get_running_loop().add_reader(fd, self._process_gone, cid, creds.pid)

    def _process_gone(self, cid: int, pid: int) -> None:
        self._forget_pid(cid)
        writer = self._writers.pop(cid, None)
        if writer is not None:
            log.info("client %d: process %d has exited but its connection is still open: dropped", cid, pid)
            writer.transport.abort()    # the reader task ends and the manager releases what it held

    def _forget_pid(self, cid: int) -> None:
        fd = self._pidfds.pop(cid, None)
        if fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(fd)
            except RuntimeError:
                pass
            os.close(fd)

    # --- scheduler link ----------------------------------------------------------------------

    async def _scheduler_reader(self) -> None:
        assert self._dealer is not None
        while True:
            frames = await self._dealer.recv_multipart()
            try:
                msg = sm.decode(frames[-1], sm.FROM_SCHEDULER)
            except sm.MessageError as exc:
                log.warning("bad message from gem-schd dropped: %s", exc)
                continue
            except Exception as exc:   # never let one frame end the link to the scheduler
                log.warning("undecodable message from gem-schd dropped: %s: %s", type(exc).__name__,
                            str(exc)[:120])
                continue
            try:
                self._dispatch(self.manager.on_scheduler(msg))
            except Exception:   # a bug must not take the group down
                log.exception("handling %s from gem-schd failed", msg.TYPE)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self._dispatch(self.manager.tick())
            except Exception:
                log.exception("pod manager timer failed")
