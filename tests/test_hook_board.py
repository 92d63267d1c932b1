"""The hook against a board page the test writes (hook/gate.c, the watcher).

gem-schd publishes each group's current slot on the board; when a slot ends before its deadline (the group
released it, or its pod manager's request crossed the continuation gem-schd granted it) the daemon rewrites the
line with the earlier end. A hook that took a continuation up from the board hears of that from nobody else: the
pod manager answers only hooks that ask. Here a scripted pod manager grants a busy process a slot of 400 ms and
publishes it on a real board page; the test then ends the slot on the board 100 ms in. The process must stop
launching (expire, drain and ask again) within a few milliseconds, not run to the old deadline while another
group holds the GPU.
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
SLOT_MS = 400
WITHDRAW_AFTER_MS = 100


class BoardPmgr(FakePmgr):
    """A pod manager that puts its hooks on a board page (line 0) and grants every token request a slot of
    SLOT_MS, published on the board as gem-schd would, recording when each request arrived."""

    def __init__(self, board: Board):
        self.board = board
        self.seq = 6
        self.asked: list[int] = []          # CLOCK_MONOTONIC ns of each token request
        self.granted = threading.Event()
        super().__init__(self.answer)

    def ack(self, hello: hp.Hello) -> hp.HelloAck:
        return hp.HelloAck(client_id=len(self.hellos), mem_limit=self.mem_limit, mem_used=0, group=hello.pod_name,
                           board_slot=0, board_path=str(self.board.path))

    def answer(self, conn: FakeConn, seq: int, msg: hp.Message) -> None:
        if isinstance(msg, hp.TokenRequest):
            self.asked.append(now_ns())
            self.seq += 1
            self.board.publish(0, self.seq, 0, now_ns() + SLOT_MS * 1_000_000)
            conn.send(hp.TokenGrant(quota_ns=SLOT_MS * 1_000_000, token_seq=self.seq), seq)
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


def test_a_slot_ended_on_the_board_stops_the_holders_launches(sim, board):
    pmgr = BoardPmgr(board)
    try:
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_IP="127.0.0.1",
                      GEMINI_POD_MANAGER_PORT=pmgr.port)
        proc = start(native.client_cmd("workload-linked", "--kernel-us", "200", "--seconds", "0.8",
                                       "--sync-every", "8"), env)
        assert pmgr.granted.wait(10), "the process never asked for a token"
        time.sleep(WITHDRAW_AFTER_MS / 1000)
        ended = now_ns()
        board.publish(0, pmgr.seq, 0, ended)        # gem-schd ended the slot now
        r = finish(proc, timeout=30)
        assert r.rc == 0, r
        later = [t for t in pmgr.asked if t > ended]
        assert later, f"the process never asked again: {pmgr.asked}"
        reacted_ms = (later[0] - ended) / 1e6
        # The watcher looks at the board every GEMINI_IDLE_RELEASE_MS (5 ms) in a burst; then a drain of at most
        # 8 kernels of 0.2 ms. Without the look the next request came at the old deadline, ~300 ms after.
        assert reacted_ms < 60, f"asked again {reacted_ms:.1f} ms after its slot ended on the board"
        stats = sim.stats_of(proc.pid)
        assert stats["withdrawals"] >= 1, stats
    finally:
        pmgr.close()
