"""gem-pmgr's I/O: hook connections (asyncio TCP) and the scheduler link (zmq DEALER).

This module only moves frames: it decodes what comes in, hands it to manager.PodManager and carries out
the actions it returns. Each hook connection is read continuously, so a TOKEN_REQUEST that waits for a
grant never holds up a MEM_ALLOC sent on the same connection by another thread of the process.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, Iterable

import zmq
import zmq.asyncio

from gemini.wire import sched as sm
from gemini.wire import hook as hp

from gemini.board import Board

from .manager import Action, CloseHook, PodManager, ToHook, ToScheduler

log = logging.getLogger("gemini.podmgr")

TICK_S = 0.05
MAX_WRITE_BUFFER = 1 << 20  # a hook that stops reading its replies is dropped past this


def zmq_endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class PodManagerServer:
    """Serves one group: `await start()`, then `await stop()`."""

    def __init__(self, group: str, ip: str = "127.0.0.1", port: int = 50052, *,
                 scheduler_ip: str = "127.0.0.1", scheduler_port: int = 50051,
                 device_uuid: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.ip = ip
        self.requested_port = port
        self.scheduler_endpoint = zmq_endpoint(scheduler_ip, scheduler_port)
        self.manager = PodManager(group, clock, device_uuid=device_uuid, scheduler_addr=self.scheduler_endpoint,
                                  board_open=Board.open)
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.base_events.Server | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._hook_tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        """The port actually bound (useful with port 0)."""
        assert self._server is not None and self._server.sockets
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """Bind the hook port (OSError if it is busy), connect to the scheduler, register."""
        self._server = await asyncio.start_server(self._serve_hook, self.ip, self.requested_port)
        self._ctx = zmq.asyncio.Context()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, f"{self.manager.group}:{os.getpid()}".encode())
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue only to a live connection: while the scheduler is away a send fails at once (the manager
        # re-sends what matters) instead of piling up heartbeats to be replayed later.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if ":" in self.scheduler_endpoint[len("tcp://"):].split("]")[0]:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self.scheduler_endpoint)
        self._dealer = dealer
        log.info("group %r: hooks on %s:%d, gem-schd at %s", self.manager.group, self.ip, self.port,
                 self.scheduler_endpoint)
        self._dispatch(self.manager.start())
        self._tasks = [asyncio.create_task(self._scheduler_reader(), name="pmgr-scheduler"),
                       asyncio.create_task(self._ticker(), name="pmgr-tick")]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks + list(self._hook_tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._hook_tasks, return_exceptions=True)
        for writer in list(self._writers.values()):
            writer.close()
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._tasks = []

    # --- actions -----------------------------------------------------------------------------

    def _dispatch(self, actions: Iterable[Action]) -> None:
        for action in actions:
            if isinstance(action, ToHook):
                self._write_hook(action)
            elif isinstance(action, CloseHook):
                writer = self._writers.pop(action.client_id, None)
                if writer is not None:
                    writer.close()      # the reader task sees the close and tells the manager
            elif isinstance(action, ToScheduler):
                self._send_scheduler(action.msg)

    def _write_hook(self, action: ToHook) -> None:
        writer = self._writers.get(action.client_id)
        if writer is None or writer.is_closing():
            return
        msg = action.msg
        if isinstance(msg, hp.Error):
            frame = hp.error_frame(hp.ErrorCode(msg.code), msg.message, action.seq)
        else:
            frame = hp.encode(msg, action.seq)
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

    async def _serve_hook(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._hook_tasks.add(task)
        peer = _peer_name(writer)
        cid = self.manager.connect(peer)
        self._writers[cid] = writer
        try:
            while cid in self._writers:
                frame = await self._read_frame(cid, peer, reader)
                if frame is None:
                    break
                seq, msg = frame
                try:
                    actions = self.manager.on_hook(cid, seq, msg)
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
            self._dispatch(self.manager.disconnect(cid))
            if task is not None:
                self._hook_tasks.discard(task)

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
