"""Bad input against LIVE daemons (launch-backend's gem-schd and gem-pmgr processes), with hypothesis.

- hook -> gem-pmgr TCP frames: random, truncated, oversized, wrong-direction and out-of-order frames on fresh
  connections; a bad frame gets an ERROR naming the problem and the connection is closed; good frames get their
  replies; the connection's memory and token are given back when it goes;
- pod manager -> gem-schd zmq frames: random bytes, random JSON, schema violations, wrong-direction messages,
  multi-frame and oversized messages; each gets Error(bad_message) (or is dropped with a log line);
- gem-schd -> gem-pmgr zmq frames: the same garbage from a fake scheduler into a live gem-pmgr;
- resource-config.txt through the running scheduler: hostile files never crash it, the last good config stays in
  force and the error names file:line (a model of the format predicts the line).

Throughout, a well-behaved peer keeps working (a token round trip through gem-pmgr and gem-schd, and a memory
query, after every example), and at the end each daemon's open files and threads are back where they started.

Examples are derandomized (a fixed sequence, so CI is repeatable); GEMINI_FUZZ_RANDOM=1 draws fresh ones and
GEMINI_FUZZ_EXAMPLES=N runs N per test.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.harness import Backend, Group
from gemini import messages as sm
from gemini import protocol as hp
from gemini.config import Config, GroupConfig, MAX_MEMORY
from gemini.scheduler.testing import DaemonThread, FakePodManager

RANDOM = bool(os.environ.get("GEMINI_FUZZ_RANDOM"))


def fuzz_settings(examples: int):
    return settings(max_examples=int(os.environ.get("GEMINI_FUZZ_EXAMPLES", examples)), deadline=None,
                    derandomize=not RANDOM, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# --- process bookkeeping -------------------------------------------------------------------------------------

def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def daemon_pids(be: Backend) -> dict[str, int]:
    """{"gem-schd": pid, <group>: pid of its gem-pmgr}."""
    out = {}
    for pid in children_of(be.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if "--name" in argv:
            out[argv[argv.index("--name") + 1]] = pid
        elif any("gem-schd" in a or "gemini.scheduler" in a for a in argv):
            out["gem-schd"] = pid
    return out


def settle(predicate, timeout: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


# --- the well-behaved peer -------------------------------------------------------------------------------------

class Frames:
    """A blocking hook connection that keeps what it reads apart by seq."""

    def __init__(self, port: int, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.seq = 0

    def send(self, msg: hp.Message) -> int:
        self.seq += 1
        self.sock.sendall(hp.encode(msg, self.seq))
        return self.seq

    def read(self) -> tuple[int, hp.Message] | None:
        """One frame, or None at EOF."""
        buf = b""
        while len(buf) < hp.MSG_SIZE:
            chunk = self.sock.recv(hp.MSG_SIZE - len(buf))
            if not chunk:
                assert not buf, f"the pod manager sent {len(buf)} bytes of a frame and closed"
                return None
            buf += chunk
        return hp.decode(buf, hp.PMGR_TO_HOOK)

    def call(self, msg: hp.Message) -> hp.Message:
        seq = self.send(msg)
        while True:
            got = self.read()
            assert got is not None, f"the pod manager closed the well-behaved peer's connection ({msg})"
            if got[0] == seq:
                return got[1]

    def close(self) -> None:
        self.sock.close()


GOOD_BYTES = 4096


class GoodPeer(Frames):
    """A client of group "good" that holds GOOD_BYTES and checks, between examples, that everything works."""

    def __init__(self, port: int):
        super().__init__(port)
        ack = self.call(hp.Hello(pid=os.getpid(), pod_name="good"))
        assert isinstance(ack, hp.HelloAck) and ack.mem_limit > 0, ack
        assert self.call(hp.MemAlloc(bytes=GOOD_BYTES)).verdict == hp.MemVerdict.OK
        self.rounds = 0

    def check(self) -> None:
        """A token round trip (upstream through gem-schd: the release ended the previous slot) and a memory query."""
        grant = self.call(hp.TokenRequest())
        assert isinstance(grant, hp.TokenGrant) and grant.quota_ns > 0, grant
        assert isinstance(self.call(hp.TokenRelease(token_seq=grant.token_seq)), hp.Ack)
        reply = self.call(hp.MemInfo())
        assert isinstance(reply, hp.MemReply), reply
        self.rounds += 1

    def used(self) -> int:
        return self.call(hp.MemInfo()).used


@dataclass
class Live:
    be: Backend
    pids: dict[str, int]
    good: GoodPeer
    baseline: dict[str, tuple[int, int]] = field(default_factory=dict)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {name: (open_fds(pid), threads(pid)) for name, pid in self.pids.items()}

    def assert_no_leak(self) -> None:
        """Open files and threads of every daemon back to the baseline (given a moment to close)."""
        ok = settle(lambda: all(now[0] <= self.baseline[n][0] and now[1] <= self.baseline[n][1]
                                for n, now in self.snapshot().items()), timeout=5)
        assert ok, f"daemon fds/threads {self.snapshot()} vs baseline {self.baseline}"
        assert all(pid in daemon_pids(self.be).values() for pid in self.pids.values()), "a daemon restarted"

    def log(self, name: str) -> str:
        fname = "gem-schd.log" if name == "gem-schd" else f"gem-pmgr-{name}.log"
        return (self.be.workdir / "logs" / fname).read_text(errors="replace")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    be = Backend(tmp / "be", [Group("good", 0.0, 1.0, "1GiB"), Group("fuzz", 0.0, 1.0, "1GiB")],
                 quota_ms=10, min_quota_ms=5, window_ms=1000)
    be.start()
    good = None
    try:
        good = GoodPeer(be.ports["good"])
        good.check()
        state = Live(be, daemon_pids(be), good)
        assert set(state.pids) == {"gem-schd", "good", "fuzz"}, state.pids
        yield state
    finally:
        if good is not None:
            good.close()
        be.stop()


@pytest.fixture
def fresh_baseline(live):
    """Record fds/threads now (the well-behaved peer connected), check them again after the test."""
    time.sleep(0.1)
    live.baseline = live.snapshot()
    yield live
    live.assert_no_leak()
    assert live.good.used() == GOOD_BYTES, "memory of closed connections was not given back"


# --- hook -> gem-pmgr frames -------------------------------------------------------------------------------------

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
SEQ = st.integers(1, 2**32 - 1)


def c_text(max_bytes: int):
    """Strings that fit a C char[max_bytes] (no NUL: the C side would cut there)."""
    return st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20) \
        .filter(lambda s: len(s.encode()) < max_bytes)


def hello(name_st) -> st.SearchStrategy:
    # mem_in_use stays below 2**62 here: a HELLO that overflows the group's 64-bit total is
    # test_hello_overflowing_the_groups_total_is_a_protocol_error's business.
    return st.builds(hp.Hello, pid=I32, device_ordinal=I32, mem_in_use=st.integers(0, 2**62), flags=U32,
                     pod_name=name_st, device_uuid=c_text(hp.UUID_LEN))


REQUESTS = st.one_of(
    st.builds(hp.TokenRequest, overuse_ns=I64, burst_ns=I64, used_ns=I64),
    st.builds(hp.TokenRelease, token_seq=U64, overuse_ns=I64, burst_ns=I64),
    st.builds(hp.MemAlloc, bytes=U64, kind=U32),
    st.builds(hp.MemFree, bytes=U64, kind=U32),
    st.just(hp.MemInfo()),
)
WRONG_WAY = st.one_of(
    st.builds(hp.HelloAck, client_id=U64, mem_limit=U64, mem_used=U64, group=c_text(hp.NAME_LEN)),
    st.builds(hp.TokenGrant, quota_ns=I64, token_seq=U64), st.just(hp.Ack()),
    st.builds(hp.MemReply, verdict=I32, used=U64, limit=U64),
    st.builds(hp.LimitUpdate, verdict=I32, used=U64, limit=U64),
    st.builds(hp.Error, code=I32, message=c_text(hp.ERRMSG_LEN)),
)
REPLY_TYPE = {hp.Hello: hp.HelloAck, hp.TokenRequest: hp.TokenGrant, hp.TokenRelease: hp.Ack,
              hp.MemAlloc: hp.MemReply, hp.MemFree: hp.MemReply, hp.MemInfo: hp.MemReply}
BAD_TYPES = sorted(set(range(0, 40)) - {int(t) for t in hp.HOOK_TO_PMGR}) + [255, 4096, 65535]


@dataclass(frozen=True)
class Op:
    """One thing the fuzzer writes: its bytes, the message if it is a whole good frame, and the error it must
    cause if it is bad (None: not bad by itself)."""
    data: bytes
    msg: hp.Message | None = None
    error: hp.ErrorCode | None = None
    partial: bool = False           # not a whole frame: the server waits for the rest (or EOF)


@st.composite
def good_frame(draw, first: bool, seq: int) -> Op:
    msg = draw(hello(st.sampled_from(["", "good"]))) if first else draw(REQUESTS)
    return Op(hp.encode(msg, seq), msg)


@st.composite
def bad_frame(draw, first: bool) -> Op:
    kind = draw(st.sampled_from(["magic", "version", "size", "type", "wrong-way", "garbage", "short",
                                 "not-hello-first" if first else "second-hello", "other-group"]))
    base = hp.encode(draw(REQUESTS), draw(SEQ))
    if kind == "magic":
        magic = draw(U32.filter(lambda m: m != hp.MAGIC))
        return Op(struct.pack("<I", magic) + base[4:], error=hp.ErrorCode.PROTOCOL)
    if kind == "version":
        version = draw(st.integers(0, 65535).filter(lambda v: v != hp.VERSION))
        return Op(base[:4] + struct.pack("<H", version) + base[6:], error=hp.ErrorCode.VERSION)
    if kind == "size":
        size = draw(U32.filter(lambda s: s != hp.MSG_SIZE))
        return Op(base[:8] + struct.pack("<I", size) + base[12:], error=hp.ErrorCode.PROTOCOL)
    if kind == "type":
        return Op(base[:6] + struct.pack("<H", draw(st.sampled_from(BAD_TYPES))) + base[8:],
                  error=hp.ErrorCode.PROTOCOL)
    if kind == "wrong-way":
        return Op(hp.encode(draw(WRONG_WAY), draw(SEQ)), error=hp.ErrorCode.PROTOCOL)
    if kind == "garbage":      # not starting with the magic: the stream is out of step from here on
        data = draw(st.binary(min_size=1, max_size=600).filter(
            lambda b: b[:4] != struct.pack("<I", hp.MAGIC)[:len(b[:4])]))
        return Op(data, error=hp.ErrorCode.PROTOCOL, partial=len(data) < hp.HEADER_SIZE)
    if kind == "short":        # a good frame cut short (the rest never comes)
        frame = hp.encode(draw(REQUESTS if not first else hello(st.just("good"))), draw(SEQ))
        return Op(frame[:draw(st.integers(1, hp.MSG_SIZE - 1))], error=hp.ErrorCode.PROTOCOL, partial=True)
    if kind == "not-hello-first":
        return Op(base, error=hp.ErrorCode.NOT_HELLO)
    if kind == "second-hello":
        return Op(hp.encode(draw(hello(st.just("good"))), draw(SEQ)), error=hp.ErrorCode.PROTOCOL)
    # a HELLO for a group this pod manager does not serve
    other = draw(c_text(hp.NAME_LEN).filter(lambda s: s not in ("", "good")))
    if first:
        return Op(hp.encode(draw(hello(st.just(other))), draw(SEQ)), error=hp.ErrorCode.GROUP_MISMATCH)
    return Op(hp.encode(draw(hello(st.just(other))), draw(SEQ)), error=hp.ErrorCode.PROTOCOL)


@st.composite
def sessions(draw) -> list[Op]:
    """What one connection sends: whole good frames, maybe ending in one bad thing (after which nothing counts)."""
    n = draw(st.integers(1, 6))
    seqs = draw(st.lists(SEQ, min_size=n, max_size=n, unique=True))
    ops: list[Op] = []
    for i in range(n):
        ops.append(draw(good_frame(first=(i == 0), seq=seqs[i])))
    if draw(st.booleans()):
        at = draw(st.integers(0, n))
        ops = ops[:at] + [draw(bad_frame(first=(at == 0)))] + ops[at:]
    return ops


def recv_all(sock: socket.socket, timeout: float) -> tuple[list[tuple[int, hp.Message]], bool]:
    """Frames until EOF (True) or until nothing arrived for `timeout` s (False)."""
    frames, buf = [], b""
    sock.settimeout(timeout)
    while True:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return frames, False
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            assert len(buf) == 0, f"the pod manager closed {len(buf)} bytes into a frame"
            return frames, True
        buf += chunk
        while len(buf) >= hp.MSG_SIZE:
            frames.append(hp.decode(buf[:hp.MSG_SIZE], hp.PMGR_TO_HOOK))
            buf = buf[hp.MSG_SIZE:]


def run_session(port: int, ops: list[Op]) -> None:
    bad = next((i for i, op in enumerate(ops) if op.error is not None), None)
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sent: list[tuple[int, hp.Message]] = []
        for op in ops:
            try:
                sock.sendall(op.data)
            except (BrokenPipeError, ConnectionResetError):
                assert bad is not None, "the pod manager dropped a connection that sent only good frames"
                break
            if op.msg is not None:
                sent.append((struct.unpack_from("<I", op.data, 12)[0], op.msg))
        if bad is None:
            # every request answered, and the connection stays open
            want = {seq: REPLY_TYPE[type(m)] for seq, m in sent}
            got: dict[int, hp.Message] = {}
            sock.settimeout(5)
            buf = b""
            while len(got) < len(want):
                chunk = sock.recv(65536)
                assert chunk, f"the pod manager closed a good connection; answered {got}, sent {sent}"
                buf += chunk
                while len(buf) >= hp.MSG_SIZE:
                    seq, msg = hp.decode(buf[:hp.MSG_SIZE], hp.PMGR_TO_HOOK)
                    buf = buf[hp.MSG_SIZE:]
                    if seq == 0 and isinstance(msg, hp.LimitUpdate):
                        continue
                    assert seq in want and seq not in got, (seq, msg, sent)
                    got[seq] = msg
            for seq, reply in got.items():
                assert isinstance(reply, want[seq]), (reply, want[seq])
            return
        try:
            sock.shutdown(socket.SHUT_WR)   # a partial frame's rest never comes: EOF in the middle of it
        except OSError:
            pass
        frames, eof = recv_all(sock, timeout=5)
        assert eof, f"the pod manager kept the connection open after {ops[bad]}"
        errors = [m for _, m in frames if isinstance(m, hp.Error)]
        assert errors and errors[-1] is frames[-1][1], f"no ERROR before the close: {frames}"
        expected = ops[bad].error
        if ops[bad].partial and bad < len(ops) - 1:
            expected = None     # the bytes that follow complete the header: bad magic, size, ... anything
        assert expected is None or errors[-1].code == expected, (errors[-1], ops[bad])
        assert errors[-1].message, errors[-1]
    finally:
        sock.close()


@fuzz_settings(150)
@given(ops=sessions())
def test_fuzz_hook_frames_against_a_live_pod_manager(fresh_baseline, ops):
    live = fresh_baseline
    run_session(live.be.ports["good"], ops)
    # whatever the connection held is given back once it is gone, and the good peer works
    assert settle(lambda: live.good.used() == GOOD_BYTES, timeout=3), live.good.used()
    live.good.check()
