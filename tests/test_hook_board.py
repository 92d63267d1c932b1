"""The hook against a board page the test writes (hook/gate.c, the watcher).

gem-schd publishes each group's current slot on the board; a holder's hooks take a continuation up from there
at their deadline, without asking anybody. When a slot ends before its deadline (the group released it, or its
pod manager's request crossed the continuation) the daemon rewrites the line with the earlier end -- and a hook
that took the continuation up hears of that from nobody else: the pod manager answers only hooks that ask.

Here a scripted pod manager grants a busy process slots of 100 ms and publishes them on a real board page (as
gem-schd would, 5 ms earlier than the quota it hands the hook: the grant's way through the pod manager); the
test continues the slot on the board, and once the process has taken the continuation up, ends it there. The
process must stop launching (expire, drain and ask again) within a few milliseconds, not run to the
continuation's old deadline while another group holds the GPU -- and it must not cut its fresh grants short to
the board's earlier deadline (the GPU would idle while the next group's grant travels).
"""
from __future__ import annotations

import threading
import time

import pytest

from gemini.board import Board, now_ns
from gemini.wire import hook as hp
from tests import native
from tests.e2e_fixtures import finish, start
from tests.fake_pmgr import FakeConn, FakePmgr

MiB = 1 << 20
SLOT_MS = 100
CONTINUED_MS = 400
TRANSIT_MS = 5          # the board's deadline of a fresh grant is this much earlier than the hook's


class BoardPmgr(FakePmgr):
    """A pod manager that puts its hooks on a board page (line 0) and grants every token request a slot of
    SLOT_MS, published on the board as gem-schd would, recording when each request arrived."""

    grant_flags = 0     # what every grant carries (hp.GRANT_*)

    def __init__(self, board: Board):
        self.board = board
        self.seq = 6
        self.asked: list[int] = []          # CLOCK_MONOTONIC ns of each token request
        self.granted_at = 0
        self.granted = threading.Event()
        super().__init__(self.answer)

    def ack(self, hello: hp.Hello) -> hp.HelloAck:
        return hp.HelloAck(client_id=len(self.hellos), mem_limit=self.mem_limit, mem_used=0, group=hello.pod_name,
                           board_slot=0, board_path=str(self.board.path))

    def run_workload(self, sim, *args, **env) -> dict:
        """workload-linked ARGS --json under this pod manager (GEMINI_* and SIMCUDA_* settings in `env`), to its end:
        the hook's counters of the process."""
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_IP="127.0.0.1",
                      GEMINI_POD_MANAGER_PORT=self.port, **{"GEMINI_LOG_LEVEL": "warn", **env})
        r = finish(start(native.client_cmd("workload-linked", *map(str, args), "--json"), env), timeout=30)
        assert r.rc == 0, r
        self.last_json = r.json     # what the workload itself printed (the simulator's counts among it)
        return sim.stats_of(r.json["pid"])

    def answer(self, conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.TokenRequest):
            self.asked.append(now_ns())
            self.seq += 1
            self.granted_at = now_ns()
            self.board.publish(0, self.seq, 0, self.granted_at + (SLOT_MS - TRANSIT_MS) * 1_000_000)
            conn.send(hp.TokenGrant(quota_ns=SLOT_MS * 1_000_000, token_seq=self.seq, flags=self.grant_flags), seq)
            self.granted.set()
        elif isinstance(msg, hp.TokenRelease):
            conn.send(hp.Ack(), seq)
        elif isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            conn.send(hp.MemReply(verdict=0, used=0, limit=self.mem_limit), seq)


@pytest.fixture
def board(tmp_path):
    b = Board.create(tmp_path / "board")
    yield b
    b.close()


def test_a_continuation_ended_on_the_board_stops_the_holders_launches(sim, board):
    pmgr = BoardPmgr(board)
    try:
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_IP="127.0.0.1",
                      GEMINI_POD_MANAGER_PORT=pmgr.port)
        proc = start(native.client_cmd("workload-linked", "--kernel-us", "200", "--seconds", "1.0",
                                       "--sync-every", "8"), env)
        assert pmgr.granted.wait(10), "the process never asked for a token"
        first, granted_at = pmgr.seq, pmgr.granted_at
        continued_until = granted_at + (SLOT_MS + CONTINUED_MS) * 1_000_000
        board.publish(0, first + 1, first, continued_until)       # gem-schd continues the slot
        time.sleep((SLOT_MS + 100) / 1000)                         # the hook took it up at its deadline
        assert pmgr.asked == [pmgr.asked[0]], "the process asked again instead of taking the continuation up"
        ended = now_ns()
        board.publish(0, first + 1, first, ended)                 # ... and ends it now
        r = finish(proc, timeout=30)
        assert r.rc == 0, r
        later = [t for t in pmgr.asked if t > ended]
        assert later, f"the process never asked again: {pmgr.asked}"
        reacted_ms = (later[0] - ended) / 1e6
        # The watcher looks at the board every GEMINI_IDLE_RELEASE_MS (5 ms) in a burst; then a drain of at most
        # 8 kernels of 0.2 ms (~7 ms in all here; the bound leaves room for a loaded machine). Without the look the
        # next request came at the old deadline, ~300 ms after.
        assert reacted_ms < 150, f"asked again {reacted_ms:.1f} ms after its continuation ended on the board"
        stats = sim.stats_of(proc.pid)
        assert stats["continuations"] == 1 and stats["withdrawals"] == 1, stats
        # the fresh grants after it ran to their own deadlines, not to the board's 5 ms earlier ones
        assert stats["expiries"] >= 2, stats
    finally:
        pmgr.close()


IDLE_UNIFIED_JOB = r'''
"""A process of a unified group with managed memory that launches nothing (so is never granted the token): it says
"ready" and waits for stdin to close."""
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
byref, vp = ctypes.byref, ctypes.c_void_p
def check(rc, what):
    if rc != 0:
        sys.exit(f"idle job: {what} failed: {rc}")
dev, ctx, p = ctypes.c_int(), vp(), ctypes.c_ulonglong()
check(cu.cuInit(0), "cuInit")
check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
check(cu.cuMemAlloc_v2(byref(p), ctypes.c_size_t(int(sys.argv[1]))), "cuMemAlloc_v2")
print("ready", os.getpid(), flush=True)
sys.stdin.read()
'''


class MovingPmgr(FakePmgr):
    """A unified group's pod manager on board page `first` (line 0), which answers BOARD_QUERY with `now` (line 3)
    and records the hooks' RESIDENCY reports."""

    def __init__(self, first: Board):
        self.first, self.now = first, first
        self.now_slot = 0
        self.queries = 0
        self.evictions: list[int] = []      # evict_seq of each report of a move to the host
        super().__init__(self.answer, mem_limit=1 << 30)

    def ack(self, hello: hp.Hello) -> hp.HelloAck:
        return hp.HelloAck(client_id=len(self.hellos), mem_limit=self.mem_limit, mem_used=0, group=hello.pod_name,
                           flags=hp.ACK_UNIFIED, board_slot=0, board_path=str(self.first.path))

    def answer(self, conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.BoardQuery):
            self.queries += 1
            conn.send(hp.BoardInfo(board_slot=self.now_slot, board_path=str(self.now.path)), seq)
        elif isinstance(msg, hp.Residency):
            if msg.direction == hp.RESIDENCY_TO_HOST:
                self.evictions.append(msg.evict_seq)
            conn.send(hp.Ack(), seq)
        elif isinstance(msg, (hp.MemAlloc, hp.MemFree, hp.MemInfo)):
            conn.send(hp.MemReply(verdict=0, used=0, limit=self.mem_limit), seq)


@pytest.mark.parametrize("same_name", [False, True], ids=["new-name", "same-name"])
def test_an_idle_unified_process_follows_its_pod_manager_to_a_new_board(sim, tmp_path, same_name):
    """gem-schd restarts: its new board page is a new file, where its eviction numbers start again at 1. A unified
    group's process that is idle (never granted, so it gets no grant to learn from) must still answer an eviction
    asked on the new page: its watcher sees its line on the old page marked `moved`, asks its pod manager where the
    new page is (BOARD_QUERY), and answers eviction 1 there although it answered eviction 3 on the old one.
    Before, it read the old page for good, and each such eviction waited out the pod manager's 10 s. Under the same
    name (`gem-schd --board PATH`) the new page is a new file renamed over the old one: the hook maps it anew."""
    import subprocess
    import sys

    first = Board.create(tmp_path / "board-1")
    pmgr = MovingPmgr(first)
    script = tmp_path / "idle.py"
    script.write_text(IDLE_UNIFIED_JOB)
    env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="u", GEMINI_POD_MANAGER_IP="127.0.0.1",
                  GEMINI_POD_MANAGER_PORT=pmgr.port)
    proc = subprocess.Popen([sys.executable, str(script), str(64 * MiB)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("ready")

        def answered(seq: int, timeout: float = 5.0) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if seq in pmgr.evictions:
                    return True
                time.sleep(0.01)
            return False

        first.request_evict(0, 3)                       # the old gem-schd's third eviction
        assert answered(3), f"the eviction on the first page was never answered: {pmgr.evictions}"
        second = Board.create(tmp_path / ("board-1" if same_name else "board-2"))    # a new gem-schd's page
        pmgr.now, pmgr.now_slot = second, 3             # the pod manager moves to it ...
        first.mark_moved(0)                             # ... and marks its line on the old one
        second.request_evict(3, 1)                      # the new gem-schd's first eviction
        assert answered(1), (f"the eviction asked on the new page was never answered (queries {pmgr.queries}, "
                             f"answered {pmgr.evictions})")
        assert pmgr.queries >= 1
    finally:
        proc.stdin.close()   # type: ignore[union-attr]
        proc.wait(timeout=30)
        pmgr.close()
        first.close()
        if pmgr.now is not first:
            pmgr.now.close()


class ClaimedPmgr(BoardPmgr):
    """BoardPmgr for a batch group beside a latency group: its grants ask for a bounded queue with claims
    (GRANT_BOUND | GRANT_TIGHT), so the process's streams wait on its GPU-side gate before each marker."""

    grant_flags = hp.GRANT_BOUND | hp.GRANT_TIGHT

    def start_busy(self, sim, seconds: float, log_level: str):
        """A busy process of 0.2 ms kernels (a synchronisation every 16) for `seconds`, started under this pod
        manager and running with its first slot for 0.3 s."""
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_IP="127.0.0.1",
                      GEMINI_POD_MANAGER_PORT=self.port, GEMINI_LOG_LEVEL=log_level)
        proc = start(native.client_cmd("workload-linked", "--kernel-us", "200", "--seconds", str(seconds),
                                       "--sync-every", "16", "--json"), env)
        assert self.granted.wait(10), "the process never asked for a token"
        time.sleep(0.3)
        return proc


def test_a_claim_whose_end_is_wrong_holds_the_gpu_gate_at_most_two_seconds(sim, board):
    """A claim on the board that would last 30 s (a pod manager's bug, a clock of its own): the batch process's
    launches pause at most 2 s and go on (gate.c), and its GPU-side gate lowers its word after 2 s of holding and
    ignores that claim until the board's claims change (gpugate.c), so the work already queued behind a wait runs
    and the program ends in time. Without the gate's limit the queued work, and every synchronisation behind it,
    waited for the claim's 30 s."""
    board.set_counts(1, 2, 2)                  # one latency group, lines 0 and 1 in use
    pmgr = ClaimedPmgr(board)
    try:
        # It still launches when both 2 s limits are up (its launches' pause began a little before the gate's
        # hold): the work it queues then waits behind the gate's word. (With 1.5 s of work it once ended between
        # the two, its queue already run, before the gate said anything.)
        proc = pmgr.start_busy(sim, 3.0, "warn")
        t0 = time.monotonic()
        board.claim(1, now_ns() + 30 * 1_000_000_000)           # line 1: the latency group's
        r = finish(proc, timeout=60)
        took = time.monotonic() - t0
        assert r.rc == 0, r
        assert took < 3.0 + 2 * 2 + 2, f"the process ended {took:.1f} s after the claim began"
        st = sim.stats_of(r.json["pid"])
        assert st["gpu_gate_waits"] >= 10 and st["gpu_gate_raises"] >= 1, st
        assert "has held this process's queued work 2 s" in r.err, r.err[-2000:]
    finally:
        pmgr.close()


class CappedPmgr(BoardPmgr):
    """BoardPmgr for a capped group with no latency group beside it: a bounded queue, no gate."""

    grant_flags = hp.GRANT_BOUND


def test_the_gpu_gates_waits_come_twice_as_often_as_a_capped_groups_markers(sim, board):
    """A claim takes effect at the batch stream's next wait, so a request waits for the rest of the marker interval
    in flight: while the markers carry the GPU-side gate's waits, the interval aims at an eighth to a quarter of
    GEMINI_INFLIGHT_MS instead of a quarter to a half. The same 0.1 ms kernels: about one marker every 2 launches
    beside a latency group, every 4 for a capped group alone (with the spacing not halved: the same for both). This
    is the count's rule, which a latency group's neighbours follow with `GEMINI_KERNEL_COSTS=0` (by default their
    markers follow the kernels' costs: test_hook_flare.py)."""
    board.set_counts(1, 2, 2)
    rates = {}
    for name, pmgr_class in (("capped", CappedPmgr), ("gated", ClaimedPmgr)):
        pmgr = pmgr_class(board)
        try:
            st = pmgr.run_workload(sim, "--kernel-us", 100, "--seconds", 1.0, "--sync-every", 256,
                                   GEMINI_KERNEL_COSTS="0")
            assert st["markers"] >= 100, (name, st)
            rates[name] = st["markers"] / st["launches"]
            if name == "gated":
                assert st["gpu_gate_waits"] >= 100, st
        finally:
            pmgr.close()
    assert rates["gated"] >= 1.6 * rates["capped"], rates
