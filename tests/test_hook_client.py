"""The hook's connection to its pod manager (hook/client.c) against a misbehaving pod manager.

The real hook runs preloaded in a ctypes program on the simulated driver; the pod manager is a scripted fake
(FakePmgr) that answers the handshake and then does what a test tells it: answer late, send half a frame,
close the connection at a chosen moment. Each test shows one promise of client.c holding:

- a partial frame never blocks a call past the 5 s bound (it breaks the connection instead);
- a connection that breaks while other threads still use its descriptor never lets their frames land in
  another descriptor of the program that reuses the number;
- a fork child never uses its parent's connections (NVML's included).
"""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gemini.wire import hook as hp
from tests.e2e_fixtures import Holder, Sim, client_argv, finish, start, wait_for
from tests.fake_pmgr import FakeConn, FakePmgr, fake_pmgrs

MiB = 1 << 20


@pytest.fixture
def fake_pmgr():
    yield from fake_pmgrs()


# --- programs --------------------------------------------------------------------------------------------

CLIENT = r'''
import ctypes, json, os, socket, sys, threading, time
c_void_p, c_size_t, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
CUdeviceptr, byref = ctypes.c_ulonglong, ctypes.byref
cu = ctypes.CDLL("libcuda.so.1")

def setup():
    dev, ctx = c_int(), c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    return ctx

def meminfo():
    free, total = c_size_t(), c_size_t()
    t0 = time.monotonic()
    rc = cu.cuMemGetInfo_v2(byref(free), byref(total))
    return {"rc": rc, "free": free.value, "total": total.value, "seconds": time.monotonic() - t0}

def partial(_args):
    setup()
    print(json.dumps(meminfo()), flush=True)

def reuse(args):
    # Thread R waits for the reply to an allocation (the pod manager never answers it, then closes the
    # connection); thread W's MEM_INFO frame is held back in send() (the test's send shim) until after the
    # break. Meanwhile the program opens sockets of its own. Returns how many bytes reached them.
    ctx = setup()
    results = {}
    def alloc():
        cu.cuCtxSetCurrent(ctx)
        p = CUdeviceptr()
        results["alloc"] = cu.cuMemAlloc_v2(byref(p), c_size_t(1 << 20))
    def info():
        cu.cuCtxSetCurrent(ctx)
        results["meminfo"] = meminfo()
    r = threading.Thread(target=alloc)
    r.start()
    time.sleep(0.2)
    w = threading.Thread(target=info)
    w.start()
    r.join()                          # the connection broke: the allocation failed
    pairs = [socket.socketpair() for _ in range(32)]   # the program's own descriptors, numbers reused
    w.join()                          # W's held-back frame went out (or failed) meanwhile
    stray = 0
    for a, b in pairs:
        for s in (a, b):
            s.setblocking(False)
            try:
                stray += len(s.recv(4096))
            except BlockingIOError:
                pass
    results["stray_bytes"] = stray
    print(json.dumps(results), flush=True)

def nvml_fork(_args):
    # A thread of the parent asks NVML all along (each answer takes the pod manager 0.5 s); the main thread
    # forks, and the child asks once.
    nv = ctypes.CDLL("libnvidia-ml.so.1")
    assert nv.nvmlInit_v2() == 0
    class Mem(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
    h = c_void_p()
    assert nv.nvmlDeviceGetHandleByIndex_v2(0, byref(h)) == 0
    def total():
        m = Mem()
        assert nv.nvmlDeviceGetMemoryInfo(h, byref(m)) == 0
        return m.total
    parent_totals, stop = [total()], threading.Event()
    def ask():
        while not stop.is_set():
            parent_totals.append(total())
    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.7)                   # the thread is waiting for an answer now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        got = total()
        os.write(w, json.dumps({"pid": os.getpid(), "total": got, "seconds": time.monotonic() - t0}).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = json.loads(f.read() or "{}")
    os.waitpid(pid, 0)
    stop.set()
    t.join()
    print(json.dumps({"pid": os.getpid(), "child": child, "parent_totals": parent_totals}), flush=True)

{"partial": partial, "reuse": reuse, "nvml_fork": nvml_fork}[sys.argv[1]](sys.argv[2:])
'''

# Holds back each MEM_INFO frame the hook sends after its first MEM_ALLOC for GEMTEST_HOLD_MEM_INFO_MS, then sends it
# with a raw system call: the window in which another thread breaks the connection and the program reuses numbers.
# (Only after a MEM_ALLOC: the hook's own MEM_INFO at start-up, held too, took the window, and the allocation went
# out after the held frame, not before it.)
SEND_SHIM = r'''
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
ssize_t send(int fd, const void *buf, size_t len, int flags) {
    const char *hold = getenv("GEMTEST_HOLD_MEM_INFO_MS");
    uint16_t type = 0;
    if (len == 256) memcpy(&type, (const char *)buf + 6, 2);
    static int alloc_sent;
    if (type == 7) __atomic_store_n(&alloc_sent, 1, __ATOMIC_SEQ_CST);
    if (hold && type == 9 && __atomic_load_n(&alloc_sent, __ATOMIC_SEQ_CST)) usleep((useconds_t)atoi(hold) * 1000);
    return syscall(SYS_sendto, fd, buf, len, flags, NULL, 0);
}
'''


@pytest.fixture(scope="module")
def client_py(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("client") / "client.py"
    path.write_text(CLIENT)
    return path


@pytest.fixture(scope="module")
def send_shim(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SEND_SHIM)
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o", str(d / "libsendshim.so"),
                    str(d / "shim.c")], check=True)
    return d / "libsendshim.so"


def hooked_env(sim: Sim, pmgr: FakePmgr, **extra) -> dict:
    return sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_IP="127.0.0.1",
                   GEMINI_POD_MANAGER_PORT=pmgr.port, **extra)


def test_a_partial_frame_breaks_the_connection_within_5_s(sim, fake_pmgr, client_py):
    """The pod manager sends the first 100 bytes of a reply and then nothing, keeping the connection open.
    The call gives up on the frame within the 5 s bound (the connection breaks, the CUDA call still returns
    the driver's numbers) instead of blocking in recv forever."""
    def half_a_reply(conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.MemInfo):
            conn.send_raw(hp.encode(hp.MemReply(verdict=0, used=0, limit=1 * MiB), seq)[:100])

    pmgr = fake_pmgr(half_a_reply)
    proc = start([sys.executable, str(client_py), "partial"], hooked_env(sim, pmgr))
    r = finish(proc, timeout=20)
    assert r.rc == 0, r
    out = r.json
    assert out["rc"] == 0 and out["total"] == sim.mem_bytes, out     # unclamped: the pod manager's answer was lost
    assert 4.5 < out["seconds"] < 8, out
    assert "truncated frame" in r.err, r


def test_a_broken_connections_descriptor_is_not_reused_under_a_writer(sim, fake_pmgr, client_py, send_shim):
    """Thread R waits for an answer; thread W's request is held back inside send(). The pod manager closes
    the connection: R sees it break and the allocation fails. The program then opens 32 socket pairs. W's
    frame must not go out on any of them: the broken connection's descriptor stays reserved (shut down) until
    W, its last user, leaves. (Until the twenty-seventh session the shim held the hook's own MEM_INFO at start-up
    instead of W's, R's allocation went out after it, and a hook built to close the descriptor at the first
    user's leave passed this test.)"""
    closed = threading.Event()
    pmgr = None

    def close_after_alloc(conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.MemAlloc):
            if not closed.is_set():
                closed.set()
                threading.Timer(0.5, conn.close).start()    # after W's frame is held back in send()
            else:       # (an allocation on a later connection: refused at once, not left to the call timeout)
                conn.send(hp.MemReply(verdict=hp.MemVerdict.DENIED, used=0, limit=pmgr.mem_limit), seq)
        else:
            # MEM_INFO answered: unanswered, W and then R waited out the hook's 10 s call timeout (the test took
            # 12 s of CI's time; 3 s now, with the same order of events)
            pmgr.answer_meminfo(conn, seq, msg)

    pmgr = fake_pmgr(close_after_alloc)
    env = hooked_env(sim, pmgr, GEMTEST_HOLD_MEM_INFO_MS=1500)
    env["LD_PRELOAD"] = f"{sim.hook} {send_shim}"
    r = finish(start([sys.executable, str(client_py), "reuse"], env), timeout=40)
    assert r.rc == 0, r
    out = r.json
    assert closed.is_set()
    assert out["alloc"] != 0, out                              # the break reached R
    assert out["stray_bytes"] == 0, f"a frame of the hook landed in a socket of the program: {out}"


def test_a_fork_child_gets_its_own_nvml_connection(sim, fake_pmgr, client_py):
    """The parent's NVML connection is busy (a thread waits for an answer) when the program forks. The child's
    NVML query must open a connection of its own (a HELLO with its pid) and get its group's limit promptly,
    not wait behind the parent's reader it inherited, nor talk on the parent's socket."""
    limit = 48 * MiB

    def slow_answer(conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.MemInfo):
            threading.Timer(0.5, conn.send, (hp.MemReply(verdict=0, used=0, limit=limit), seq)).start()

    pmgr = fake_pmgr(slow_answer, mem_limit=limit)
    r = finish(start([sys.executable, str(client_py), "nvml_fork"], hooked_env(sim, pmgr)), timeout=60)
    assert r.rc == 0, r
    out = r.json
    child = out["child"]
    assert child["total"] == limit and child["seconds"] < 3, child
    assert child["pid"] in {h.pid for h in pmgr.hellos}, f"the child used its parent's connection: {pmgr.hellos}"
    assert set(out["parent_totals"]) == {limit}, out["parent_totals"]


def test_a_pod_manager_restart_seen_while_idle_leaves_no_descriptor_behind(sim, fake_pmgr, client_script):
    """A process that holds memory and sits idle notices its pod manager going away (the rejoin thread's look every
    100 ms) and reconnects at once to re-announce its memory. The old connection's descriptor must be closed: no
    call was using it, so nobody else would (each restart kept one open for good, and a long-lived server that
    outlives many pod manager restarts ran out of descriptors)."""
    def answer(conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            conn.send(hp.MemReply(verdict=0, used=0, limit=64 * MiB), seq)

    pmgr = fake_pmgr(answer)
    holder = Holder(client_argv("e2e", "serve", script=client_script), hooked_env(sim, pmgr))
    try:
        assert holder.alloc(1 * MiB) == 0
        fds = lambda: len(os.listdir(f"/proc/{holder.pid}/fd"))  # noqa: E731
        before = fds()
        for restart in range(5):
            hellos = len(pmgr.hellos)
            for conn in list(pmgr.conns):
                conn.close()
            wait_for(lambda n=hellos: len(pmgr.hellos) > n, timeout=10, what=f"the reconnect after restart {restart}")
        time.sleep(0.3)
        assert fds() == before, f"{fds() - before} more descriptors after 5 pod manager restarts"
    finally:
        holder.close()


class SlowHandshakePmgr(FakePmgr):
    """Counts each connection's memory as the real pod manager does (HELLO's mem_in_use, plus allocations, less
    frees), and answers every HELLO after the first one `late_s` late. With `close_after_alloc` set, it closes the
    connection as soon as it has answered the next allocation (a pod manager restarting as it grants)."""

    def __init__(self, late_s: float = 0.5):
        self.count: dict[int, int] = {}
        self.late_s = late_s
        self.close_after_alloc = False
        super().__init__(self.handle)

    def ack(self, hello: hp.Hello) -> hp.HelloAck:
        if len(self.hellos) > 1:
            time.sleep(self.late_s)
        self.count[len(self.hellos)] = hello.mem_in_use
        return super().ack(hello)

    def handle(self, conn: FakeConn, seq: int, msg: hp.Message) -> None:
        session = len(self.hellos)
        if isinstance(msg, hp.MemAlloc):
            self.count[session] = self.count.get(session, 0) + msg.bytes
        elif isinstance(msg, hp.MemFree):
            self.count[session] = self.count.get(session, 0) - msg.bytes
        if isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            conn.send(hp.MemReply(verdict=0, used=0, limit=64 * MiB), seq)
        if isinstance(msg, hp.MemAlloc) and self.close_after_alloc:
            self.close_after_alloc = False
            conn.close()


def test_a_free_while_the_process_reconnects_reaches_the_pod_manager_that_counts_it(sim, client_script):
    """The pod manager restarts; the process's rejoin thread reconnects at once, and its HELLO says it holds
    16 MiB. The program frees them while that handshake is still unanswered. The free must reach the new session
    (whose count includes the bytes): sent nowhere, the new pod manager counted the 16 MiB until the process
    exited, and the group's room shrank by that much for good."""
    pmgr = SlowHandshakePmgr()
    holder = Holder(client_argv("e2e", "serve", script=client_script), hooked_env(sim, pmgr))
    try:
        assert holder.alloc(16 * MiB) == 0
        for conn in list(pmgr.conns):
            conn.close()                                         # the pod manager restarts
        wait_for(lambda: len(pmgr.hellos) > 1, timeout=10, what="the rejoin thread's HELLO")
        assert holder.ask("free") == [0]                         # while that HELLO waits for its answer
        wait_for(lambda: 2 in pmgr.count, timeout=10, what="the second handshake")
        assert pmgr.hellos[1].mem_in_use == 16 * MiB
        wait_for(lambda: pmgr.count[2] == 0, timeout=5, what=f"the free on the new session (counts {pmgr.count})")
    finally:
        holder.close()
        pmgr.close()


def test_an_allocation_granted_as_its_pod_manager_restarts_is_counted_by_the_new_one(sim, test_hook_lib,
                                                                                    client_script):
    """The pod manager grants 16 MiB and restarts at once (closes the connection). The process's rejoin thread
    reconnects within 100 ms, and its HELLO says what the process holds. Here the grant is counted 300 ms after
    it came (the test build's pause: a preempted thread, in life), so that HELLO left the 16 MiB out, and the pod
    manager that granted them is gone: counted by nobody, the group could have exceeded its limit by that much
    for good. The hook sees that the count it would add to is no longer the granting session's, and asks the new
    pod manager for them."""
    pmgr = SlowHandshakePmgr(late_s=0)
    env = hooked_env(sim, pmgr, GEMINI_TEST_PAUSE_BEFORE_COUNT_MS=300)
    env["LD_PRELOAD"] = str(test_hook_lib)
    holder = Holder(client_argv("e2e", "serve", script=client_script), env)
    try:
        assert holder.alloc(1 * MiB) == 0          # the rejoin thread watches from the first allocation on
        pmgr.close_after_alloc = True
        assert holder.alloc(16 * MiB) == 0
        assert len(pmgr.hellos) == 2, pmgr.hellos   # the rejoin thread's HELLO came during the pause
        assert pmgr.hellos[1].mem_in_use == 1 * MiB
        wait_for(lambda: pmgr.count.get(2) == 17 * MiB, timeout=5,
                 what=f"the new pod manager counting the 17 MiB the process holds (counts {pmgr.count})")
        time.sleep(0.3)
        assert pmgr.count == {1: 17 * MiB, 2: 17 * MiB}, pmgr.count
    finally:
        holder.close()
    assert sim.stats_of(holder.pid)["mem_recounts"] == 1


def test_a_pod_manager_that_leaves_while_the_process_is_idle_is_heard_saying_why(sim, fake_pmgr, client_script):
    """The pod manager says why it goes (an ERROR push: its group was removed) and closes, while the process sits
    idle holding memory. The rejoin thread notices the closed connection first; it must read that last word before
    it drops the connection, so that the process says why its pod manager is gone -- not that it is unreachable and
    how to start one (the race made tests/test_messages.py fail under load)."""
    pmgr = fake_pmgr(lambda conn, seq, msg: conn.send(hp.MemReply(verdict=0, used=0, limit=64 * MiB), seq)
                     if isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)) else None)
    holder = Holder(client_argv("e2e", "serve", script=client_script),
                    hooked_env(sim, pmgr, GEMINI_CONNECT_TIMEOUT_MS=300))
    try:
        assert holder.alloc(1 * MiB) == 0
        pmgr._stop = True                                       # nobody to reconnect to (shutdown: a close would
        pmgr.listener.shutdown(socket.SHUT_RDWR)                # leave the accept in progress listening)
        for conn in list(pmgr.conns):
            conn.send_raw(hp.error_frame(hp.ErrorCode.UNKNOWN_GROUP, "group 'g' was removed from the config"))
            conn.close()
        time.sleep(1.5)                                         # the rejoin thread looked and tried again
    finally:
        r = holder.close()
    assert "is gone" in r.err and "group 'g' was removed from the config" in r.err.split("is gone", 1)[1], r.err


def test_a_pod_manager_that_resets_the_connection_is_heard_saying_why_at_the_next_call(sim, fake_pmgr,
                                                                                       client_script):
    """The pod manager says why it goes (an ERROR push) and resets the connection (it closed with a request of
    the process unread: TCP answers with a reset). The process holds no memory, so no thread watches the
    connection: its next call's send fails first. The push is still queued on the socket, and the call must read
    it before it drops the connection -- else the process says its pod manager is unreachable and how to start
    one (a failure of tests/test_messages.py once under load)."""
    pmgr = fake_pmgr(lambda conn, seq, msg: conn.send(hp.MemReply(verdict=0, used=0, limit=64 * MiB), seq)
                     if isinstance(msg, hp.MemInfo) else None)
    holder = Holder(client_argv("e2e", "serve", script=client_script),
                    hooked_env(sim, pmgr, GEMINI_CONNECT_TIMEOUT_MS=300))
    try:
        holder.meminfo()                                        # connected (no memory held: no rejoin thread)
        assert len(pmgr.hellos) == 1, pmgr.hellos
        pmgr._stop = True
        pmgr.listener.shutdown(socket.SHUT_RDWR)
        for conn in list(pmgr.conns):
            conn.send_raw(hp.error_frame(hp.ErrorCode.UNKNOWN_GROUP, "group 'g' was removed from the config"))
            conn.sock.shutdown(socket.SHUT_RD)                  # its reading thread returns and lets go of it
            time.sleep(0.1)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))    # a reset
            conn.sock.close()
        time.sleep(0.2)                                         # the reset has arrived
        holder.meminfo()                                        # its send fails; the driver's numbers come back
        holder.meminfo()                                        # it tries to connect again, and says why it can't
    finally:
        r = holder.close()
    assert "is gone" in r.err and "group 'g' was removed from the config" in r.err.split("is gone", 1)[1], r.err
    assert "launch-backend" not in r.err, r.err
