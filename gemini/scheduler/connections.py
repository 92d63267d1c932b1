"""gem-schd's guard on its zmq connections: each must send a valid message within a deadline, and there are at
most `max_connections` of them.

zmq hides connections behind its ROUTER socket, so the guard watches them through a monitor socket (ACCEPTED,
DISCONNECTED, CLOSED, each carrying the connection's file descriptor) and learns which connection a message
came from by the frame's source descriptor (ZMQ_SRCFD). A connection that has sent nothing valid when its
deadline passes, or that arrives beyond the cap, is shut down (shutdown(2) on its descriptor: zmq sees the peer
go and cleans up as for any disconnect; the descriptor stays zmq's). Before acting on a descriptor the guard
checks that it is still the same socket (its inode), since zmq may have closed and reused the number.

On the socket transport only the backend's user can connect to gem-schd (mode 0600), so this matters for TCP,
where any local process can.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("gemini.scheduler")

HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512


@dataclass
class _Conn:
    accepted: float
    inode: int
    greeted: bool = False


def _inode(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return -1


class ConnectionGuard:
    def __init__(self, sock: zmq.asyncio.Socket, hello_timeout_s: float = HELLO_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        self.sock = sock
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = max_connections
        self.conns: dict[int, _Conn] = {}
        self.closed_silent = 0          # connections closed for saying nothing in time
        self.closed_over_cap = 0
        self._monitor: Optional[zmq.asyncio.Socket] = None
        self._task: Optional[asyncio.Task] = None
        self._logged = 0.0

    def start(self) -> None:
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        self._monitor = self.sock.get_monitor_socket(events)
        self._task = asyncio.create_task(self._watch(), name="gem-schd-connections")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                frames = await self._monitor.recv_multipart()
                event = parse_monitor_message(frames)
            except asyncio.CancelledError:
                raise
            except (zmq.ZMQError, ValueError) as exc:
                if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                continue
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:
                self.conns.pop(fd, None)

    def _accepted(self, fd: int) -> None:
        now = time.monotonic()
        conn = self.conns.get(fd)
        if conn is None or conn.inode != _inode(fd):
            conn = self.conns[fd] = _Conn(now, _inode(fd))
        if len(self.conns) > self.max_connections:
            self.closed_over_cap += 1
            self._close(fd, conn, f"more than {self.max_connections} connections")

    def greeted(self, frame: Any) -> None:
        """A valid message came in this frame: its connection has introduced itself."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, AttributeError, TypeError):
            return
        if not isinstance(fd, int) or fd < 0:
            return
        conn = self.conns.get(fd)
        if conn is None:        # the message overtook its ACCEPTED event
            conn = self.conns[fd] = _Conn(time.monotonic(), _inode(fd))
        conn.greeted = True

    def sweep(self, now: Optional[float] = None) -> None:
        """Shut down the connections that have said nothing valid within the deadline."""
        now = time.monotonic() if now is None else now
        for fd, conn in list(self.conns.items()):
            if not conn.greeted and now - conn.accepted > self.hello_timeout_s:
                self.closed_silent += 1
                self._close(fd, conn, f"no valid message within {self.hello_timeout_s:g} s")

    def _close(self, fd: int, conn: _Conn, why: str) -> None:
        self.conns.pop(fd, None)
        if _inode(fd) != conn.inode:
            return              # zmq closed it and reused the number meanwhile: not ours to touch
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()
        now = time.monotonic()
        if now - self._logged >= 1.0:
            self._logged = now
            log.warning("closed a connection: %s (%d closed for silence, %d over the cap so far)", why,
                        self.closed_silent, self.closed_over_cap)
