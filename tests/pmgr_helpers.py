"""Test doubles for the pod manager: a fake hook client (the wire protocol over TCP, asyncio or blocking)
and a fake gem-schd (a zmq ROUTER that records what pod managers send and answers like the real one)."""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from contextlib import asynccontextmanager
from typing import Callable

import zmq
import zmq.asyncio

from gemini import transport
from gemini.wire import sched as sm
from gemini.wire import hook as hp
from gemini.podmgr.server import PodManagerServer

TIMEOUT = 5.0
REPO_ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- hook side ---------------------------------------------------------------------------------

class AsyncHook:
    """One hook connection. `request()` sends and returns the seq; replies are matched by seq."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._seq = 0
        self._replies: dict[int, asyncio.Future] = {}
        self.pushes: asyncio.Queue = asyncio.Queue()      # seq-0 frames (errors sent before a HELLO was read)
        self.closed = asyncio.Event()
        self._reader_task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: "int | PodManagerServer", ip: str = "127.0.0.1") -> "AsyncHook":
        """To a TCP port, or to a PodManagerServer on whichever transport it serves."""
        if isinstance(port, PodManagerServer):
            if port.socket_path is not None:
                sock = transport.connect_unix(port.socket_path, TIMEOUT)
                sock.setblocking(False)
                reader, writer = await asyncio.open_unix_connection(sock=sock)
                return cls(reader, writer)
            port = port.port
        reader, writer = await asyncio.open_connection(ip, port)
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.reader.readexactly(hp.MSG_SIZE)
                seq, msg = hp.decode(frame, hp.PMGR_TO_HOOK)
                fut = self._replies.pop(seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                else:
                    self.pushes.put_nowait(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.closed.set()

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def request(self, msg: hp.Message) -> asyncio.Future:
        self._seq += 1
        fut = asyncio.get_running_loop().create_future()
        self._replies[self._seq] = fut
        self.writer.write(hp.encode(msg, self._seq))
        return fut

    async def call(self, msg: hp.Message, timeout: float = TIMEOUT) -> hp.Message:
        return await asyncio.wait_for(self.request(msg), timeout)

    async def hello(self, group: str, pid: int = 4242, **kw) -> hp.Message:
        return await self.call(hp.Hello(pid=pid, pod_name=group, **kw))

    @classmethod
    async def greeted(cls, port: "int | PodManagerServer", group: str, pid: int = 4242) -> "AsyncHook":
        """Connected and past the handshake."""
        hook = await cls.connect(port)
        ack = await hook.hello(group, pid)
        assert isinstance(ack, hp.HelloAck), ack
        return hook

    async def wait_closed(self, timeout: float = TIMEOUT) -> None:
        await asyncio.wait_for(self.closed.wait(), timeout)

    async def close(self) -> None:
        self.writer.close()
        self._reader_task.cancel()
        try:
            await self._reader_task
        except asyncio.CancelledError:
            pass


class BlockingHook:
    """A blocking hook client, for subprocesses and launch tests."""

    def __init__(self, port: "int | str | Path", ip: str = "127.0.0.1", timeout: float = TIMEOUT):
        """To ip:port, or (a str or Path) to a Unix socket."""
        if isinstance(port, (str, Path)):
            self.sock = transport.connect_unix(port, timeout)
        else:
            self.sock = socket.create_connection((ip, port), timeout=timeout)
        self._seq = 0

    def send(self, msg: hp.Message) -> int:
        self._seq += 1
        self.sock.sendall(hp.encode(msg, self._seq))
        return self._seq

    def recv(self) -> tuple[int, hp.Message]:
        buf = b""
        while len(buf) < hp.MSG_SIZE:
            chunk = self.sock.recv(hp.MSG_SIZE - len(buf))
            if not chunk:
                raise ConnectionError("pod manager closed the connection")
            buf += chunk
        return hp.decode(buf, hp.PMGR_TO_HOOK)

    def call(self, msg: hp.Message) -> hp.Message:
        seq = self.send(msg)
        while True:
            rseq, reply = self.recv()
            if rseq == seq:
                return reply

    def close(self) -> None:
        self.sock.close()


# --- scheduler side -----------------------------------------------------------------------------

class FakeScheduler:
    """A ROUTER standing in for gem-schd. Answers Hello/Heartbeat by itself (`auto`), records every message,
    and lets the test send Grants, ConfigUpdates and errors to the pod manager."""

    def __init__(self, groups: dict[str, int] | None = None, port: int | None = None,
                 scheduler_id: str = "sched-1", auto: bool = True, ipc_path: Path | None = None):
        self.groups = dict(groups or {})          # group -> memory limit
        self.scheduler_id = scheduler_id
        self.auto = auto
        self.registered: dict[str, bytes] = {}    # group -> identity
        self.received: list[tuple[bytes, sm.Message]] = []
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ipc_path = ipc_path
        if ipc_path is not None:
            self._short = transport.ShortPath(ipc_path)
            self.sock.bind(transport.ipc_endpoint(self._short.address))
            self.port = 0
        elif port is None:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        self.token_seq = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            identity, payload = await self.sock.recv_multipart()
            msg = sm.decode(payload, sm.TO_SCHEDULER)
            self.received.append((identity, msg))
            if self.auto:
                await self._answer(identity, msg)
            self.inbox.put_nowait((identity, msg))

    async def _answer(self, identity: bytes, msg: sm.Message) -> None:
        if isinstance(msg, sm.Hello):
            if msg.group in self.groups:
                self.registered[msg.group] = identity
                await self.send(msg.group, sm.Welcome(group=msg.group, min_util=0.0, max_util=1.0,
                                                      mem_limit=self.groups[msg.group],
                                                      scheduler_id=self.scheduler_id))
            else:
                await self.send_to(identity, sm.Error(code=sm.ERR_UNKNOWN_GROUP, group=msg.group,
                                                      message=f"unknown group {msg.group!r}"))
        elif isinstance(msg, sm.Heartbeat):
            if self.registered.get(msg.group) == identity:
                await self.send_to(identity, sm.HeartbeatAck(scheduler_id=self.scheduler_id))
            else:
                await self.send_to(identity, sm.Error(code=sm.ERR_NOT_REGISTERED, group=msg.group,
                                                      message="say hello first"))

    async def send_to(self, identity: bytes, msg: sm.Message) -> None:
        await self.sock.send_multipart([identity, sm.encode(msg)])

    async def send(self, group: str, msg: sm.Message) -> None:
        await self.send_to(self.registered[group], msg)

    async def grant(self, group: str, quota_ms: float) -> int:
        self.token_seq += 1
        await self.send(group, sm.Grant(group=group, quota_ms=quota_ms, token_seq=self.token_seq))
        return self.token_seq

    async def expect(self, kind: type, timeout: float = TIMEOUT,
                     where: Callable[[sm.Message], bool] | None = None) -> sm.Message:
        """The next message of `kind` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind.__name__} within {timeout} s; got {self.kinds()}")
            try:
                _, msg = await asyncio.wait_for(self.inbox.get(), left)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, kind) and (where is None or where(msg)):
                return msg

    async def wait_registered(self, group: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while group not in self.registered:
            if time.monotonic() > deadline:
                raise AssertionError(f"{group} never said hello")
            await asyncio.sleep(0.01)

    def count(self, kind: type) -> int:
        return sum(1 for _, m in self.received if isinstance(m, kind))

    def kinds(self) -> list[str]:
        return [type(m).__name__ for _, m in self.received]

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.sock.close(linger=0)
        self.ctx.term()
        if self.ipc_path is not None:
            self._short.close()


@asynccontextmanager
async def running_pmgr(group: str = "g", mem_limit: int = 1000, *, groups: dict[str, int] | None = None,
                       device_uuid: str | None = None, start_scheduler: bool = True, scheduler_port: int = 0,
                       ipc_dir: Path | None = None, **server_kw):
    """A FakeScheduler (knowing `groups`, default {group: mem_limit}) and a PodManagerServer on ephemeral ports
    (or, with `ipc_dir`, on the socket transport in that directory), registered with it if it knows the group.
    Yields (server, scheduler); scheduler is None when start_scheduler is False."""
    ipc_path = None
    if ipc_dir is not None:
        transport.ensure_socket_dir(ipc_dir, device_uuid)
        ipc_path = transport.scheduler_socket(ipc_dir, device_uuid)
    sched = FakeScheduler(groups if groups is not None else {group: mem_limit},
                          port=scheduler_port or None, ipc_path=ipc_path) if start_scheduler else None
    port = sched.port if sched else (scheduler_port or free_port())
    server = PodManagerServer(group, "127.0.0.1", 0, scheduler_port=port, device_uuid=device_uuid, ipc_dir=ipc_dir,
                              **server_kw)
    await server.start()
    try:
        if sched is not None and group in sched.groups:
            await sched.wait_registered(group)
            await eventually(lambda: server.manager.registered, what="Welcome handled")
        yield server, sched
    finally:
        await server.stop()
        if sched is not None:
            await sched.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def eventually(predicate: Callable[[], bool], timeout: float = TIMEOUT, what: str = "condition") -> float:
    """Wait until predicate() is true; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


class BackgroundPmgr:
    """A fake scheduler and a real PodManagerServer running in a thread of their own, for tests that drive
    them from outside (subprocesses such as launch-command)."""

    def __init__(self, group: str, groups: dict[str, int]):
        import threading
        self.group = group
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.port = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(groups,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self.error:
            raise RuntimeError(f"background pod manager did not start: {self.error}")

    def _main(self, groups) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(groups))

    async def _serve(self, groups) -> None:
        self._stop = asyncio.Event()
        try:
            async with running_pmgr(self.group, groups=groups) as (server, sched):
                self.server, self.sched = server, sched
                self.port = server.port
                deadline = time.monotonic() + 5        # until the scheduler has answered its Hello
                while not (server.manager.registered or server.manager.unknown_reason):
                    if time.monotonic() > deadline:
                        raise RuntimeError("no answer from the fake scheduler")
                    await asyncio.sleep(0.01)
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self.error = exc
            self._ready.set()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()


def wait_port(port: int, proc=None, timeout: float = 15.0) -> None:
    """Until something accepts connections on 127.0.0.1:port (and `proc`, if given, is still running)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"process exited with {proc.returncode} before listening on {port}") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {port} after {timeout} s") from None
            time.sleep(0.05)
