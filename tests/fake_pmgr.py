"""A scripted pod manager for the hook's tests: answers the handshake, records who connected, and hands every
other request to a handler the test supplies (default: MEM_INFO answered with a fixed limit)."""
from __future__ import annotations

import socket
import threading
from typing import Callable, Iterator

from gemini.wire import hook as hp

MiB = 1 << 20


class FakeConn:
    """One hook connection of the fake pod manager."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.hello: hp.Hello | None = None
        self.lock = threading.Lock()

    def send(self, msg: hp.Message, seq: int) -> None:
        self.send_raw(hp.encode(msg, seq))

    def send_raw(self, data: bytes) -> None:
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


Handler = Callable[[FakeConn, int, hp.Message], None]


class FakePmgr:
    """A pod manager on 127.0.0.1 that answers HELLO (recording the hook's pid) and hands every other
    request to `handler` (default: MEM_INFO answered with `mem_limit`, the rest ignored)."""

    def __init__(self, handler: Handler | None = None, mem_limit: int = 64 * MiB):
        self.mem_limit = mem_limit
        self.handler = handler or self.answer_meminfo
        self.hellos: list[hp.Hello] = []
        self.requests: list[tuple[int, hp.Message]] = []      # (hook pid, message)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.conns: list[FakeConn] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def ack(self, hello: hp.Hello) -> hp.HelloAck:
        """The handshake's answer (a subclass may put the hook on a board page)."""
        return hp.HelloAck(client_id=len(self.hellos), mem_limit=self.mem_limit, mem_used=0, group=hello.pod_name)

    def answer_meminfo(self, conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.MemInfo):
            conn.send(hp.MemReply(verdict=0, used=0, limit=self.mem_limit), seq)

    def _accept(self) -> None:
        while not self._stop:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            conn = FakeConn(sock)
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: FakeConn) -> None:
        buf = b""
        while True:
            try:
                chunk = conn.sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while len(buf) >= hp.MSG_SIZE:
                frame, buf = buf[:hp.MSG_SIZE], buf[hp.MSG_SIZE:]
                seq, msg = hp.decode(frame, hp.HOOK_TO_PMGR)
                if isinstance(msg, hp.Hello):
                    conn.hello = msg
                    self.hellos.append(msg)
                    conn.send(self.ack(msg), seq)
                    continue
                self.requests.append((conn.hello.pid if conn.hello else 0, msg))
                self.handler(conn, seq, msg)

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        for c in self.conns:
            c.close()


def fake_pmgrs() -> Iterator[Callable[..., FakePmgr]]:
    """For a fixture: yields make(handler=None, **kw) -> FakePmgr, and closes every one made afterwards."""
    made: list[FakePmgr] = []

    def make(handler: Handler | None = None, **kw) -> FakePmgr:
        f = FakePmgr(handler, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
