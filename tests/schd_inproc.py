"""Helpers to run gem-schd in-process (tests, benchmarks): the daemon on a background thread with its own event
loop, and a minimal synchronous fake pod manager (a zmq DEALER speaking gemini.wire.sched)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Callable, Optional

import zmq

from gemini.config import Config
from gemini.wire.sched import FROM_SCHEDULER, Message, decode, encode
from gemini.scheduler.daemon import SchedulerDaemon


class DaemonThread:
    """A SchedulerDaemon serving on 127.0.0.1 (port 0 = a free one) from a background thread."""

    def __init__(self, config: Config, **kwargs: Any):
        kwargs.setdefault("port", 0)
        self._kwargs = kwargs
        self._config = config
        self.daemon: Optional[SchedulerDaemon] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self) -> "DaemonThread":
        self._thread = threading.Thread(target=self._run, name="gem-schd-test", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.daemon = SchedulerDaemon(self._config, **self._kwargs)
            try:
                await self.daemon.start()
            except BaseException as exc:  # report bind errors etc. to start()
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            await self.daemon.wait_closed()
        asyncio.run(main())

    @property
    def port(self) -> int:
        assert self.daemon is not None
        return self.daemon.port

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run fn() on the daemon's loop and return its result."""
        assert self.loop is not None
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
        self.loop.call_soon_threadsafe(run)
        return fut.result(timeout)

    def stop(self) -> None:
        if self.loop is not None and self.daemon is not None and self._thread is not None and self._thread.is_alive():
            try:
                self.loop.call_soon_threadsafe(self.daemon.stop)
            except RuntimeError:
                pass
            self._thread.join(10)

    def __enter__(self) -> "DaemonThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class FakePodManager:
    """A synchronous DEALER: send() messages, recv() decoded replies (None on timeout)."""

    def __init__(self, endpoint: str, identity: Optional[bytes] = None, ctx: Optional[zmq.Context] = None):
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 2.0) -> Optional[Message]:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv(), allowed=FROM_SCHEDULER)

    def recv_type(self, cls: type, timeout: float = 2.0) -> Optional[Message]:
        """Receive until a message of type cls arrives (others are dropped); None on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            msg = self.recv(left)
            if msg is None or isinstance(msg, cls):
                return msg

    def request(self, msg: Message, timeout: float = 2.0) -> Optional[Message]:
        self.send(msg)
        return self.recv(timeout)

    def drain(self) -> list:
        out = []
        while self.sock.poll(0):
            out.append(decode(self.sock.recv(), allowed=FROM_SCHEDULER))
        return out

    def close(self) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> "FakePodManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
