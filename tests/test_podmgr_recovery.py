"""A restarted pod manager rebuilds the group's memory count before it grants anything new (issue 17, item 3):
the pure logic on simulated time (manager.PodManager.begin_recovery) and the ledger file (ledger.py).

The end-to-end check, with a real hook that re-announces on its own and a SIGKILLed pod manager, is
tests/test_e2e_memory_holes.py::test_a_restarted_pod_manager_counts_an_idle_holder_before_granting.
"""
from __future__ import annotations

import json
import os

from gemini.podmgr import ledger
from gemini.podmgr.manager import REJOIN_GRACE_S, Holder, PodManager, ToHook
from gemini.wire import hook as hp
from gemini.wire import sched as sm
from pmgr_helpers import FakeClock

GROUP = "g"
MiB = 1 << 20
NS = 4026531836     # a pid namespace inode


def replies(actions, cid=None) -> list:
    return [a.msg for a in actions if isinstance(a, ToHook) and (cid is None or a.client_id == cid)]


class Restarted:
    """A pod manager started after one that recorded `carried`, with a 128 MiB limit."""

    def __init__(self, carried: dict[int, Holder] | None, alive: set[int] = frozenset(), **kw):
        self.clock = FakeClock()
        self.alive = set(alive)
        self.m = PodManager(GROUP, self.clock, pid=99, pid_ns=NS, process_exists=lambda pid: pid in self.alive)
        self.first = self.m.begin_recovery(carried, **kw)
        self.m.start()
        self.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.1, max_util=1.0, mem_limit=128 * MiB,
                                       scheduler_id="s"))

    def hook(self, pid: int, mem_in_use: int = 0, pid_ns: int = NS) -> tuple[int, list]:
        cid = self.m.connect(f"peer{pid}")
        return cid, self.m.on_hook(cid, 1, hp.Hello(pid=pid, pod_name=GROUP, mem_in_use=mem_in_use, pid_ns=pid_ns))

    def alloc(self, cid: int, nbytes: int, seq: int = 2) -> list:
        return self.m.on_hook(cid, seq, hp.MemAlloc(bytes=nbytes))


def test_allocations_wait_until_every_recorded_holder_has_re_announced():
    """The predecessor recorded pid 100 with 96 MiB. A newcomer's 64 MiB waits (no reply) while pid 100 has not
    re-announced; its HELLO (with its own figure) ends the wait, and the 64 MiB are refused: 96 + 64 > 128."""
    r = Restarted({100: Holder(96 * MiB, visible=True)}, alive={100})
    assert r.m.mem_used == 96 * MiB and r.m.recovering
    newcomer, _ = r.hook(pid=200)
    assert r.alloc(newcomer, 64 * MiB) == []
    assert replies(r.m.on_hook(newcomer, 3, hp.MemInfo())) == [hp.MemReply(verdict=0, used=96 * MiB,
                                                                             limit=128 * MiB)]
    r.clock.advance(1.0)
    assert replies(r.m.tick()) == []                    # still waiting: pid 100 lives and has not come back
    holder, acts = r.hook(pid=100, mem_in_use=96 * MiB)
    assert [type(m) for m in replies(acts, holder)] == [hp.HelloAck]
    assert replies(acts, newcomer) == [hp.MemReply(verdict=int(hp.MemVerdict.DENIED), used=96 * MiB,
                                                   limit=128 * MiB)]
    assert not r.m.recovering
    assert replies(r.alloc(newcomer, 32 * MiB, seq=4)) == [hp.MemReply(verdict=0, used=128 * MiB,
                                                                       limit=128 * MiB)]


def test_the_holders_own_figure_replaces_the_record():
    """The record may lag (it is written when the holders change, their byte counts at most once a second): the
    re-announced figure is what counts."""
    r = Restarted({100: Holder(32 * MiB, visible=True)}, alive={100})
    r.hook(pid=100, mem_in_use=48 * MiB)
    assert r.m.mem_used == 48 * MiB and not r.m.recovering


def test_a_holder_that_never_comes_back_is_waited_for_at_most_the_grace_period():
    """A recorded process the pod manager cannot look up (another pid namespace, on TCP) and that does not
    re-announce: the allocations wait REJOIN_GRACE_S, then its bytes are dropped and they are answered."""
    r = Restarted({100: Holder(96 * MiB, visible=False)})
    newcomer, _ = r.hook(pid=200)
    assert r.alloc(newcomer, 64 * MiB) == []
    r.clock.advance(REJOIN_GRACE_S - 0.01)
    assert replies(r.m.tick()) == []
    r.clock.advance(0.02)
    assert replies(r.m.tick()) == [hp.MemReply(verdict=0, used=64 * MiB, limit=128 * MiB)]
    assert not r.m.recovering


def test_a_recorded_holder_that_has_exited_is_not_waited_for():
    """A visible pid that no longer exists (it died while no pod manager ran) is dropped at once; one that dies
    during the wait, at the next tick."""
    r = Restarted({100: Holder(16 * MiB, visible=True), 101: Holder(32 * MiB, visible=True)}, alive={101})
    assert r.m.mem_used == 32 * MiB and r.m.recovering     # 100 is gone already
    newcomer, _ = r.hook(pid=200)
    assert r.alloc(newcomer, 64 * MiB) == []
    r.alive.clear()
    r.clock.advance(0.05)
    assert replies(r.m.tick()) == [hp.MemReply(verdict=0, used=64 * MiB, limit=128 * MiB)]
    assert not r.m.recovering


def test_an_unreadable_record_waits_out_the_grace_period():
    """A ledger file that exists but cannot be read: the predecessor had holders, but nobody knows which; the
    allocations wait the whole grace period, while re-announced holders are counted as they come."""
    r = Restarted(None)
    assert r.m.recovering and r.m.mem_used == 0
    holder, _ = r.hook(pid=100, mem_in_use=96 * MiB)
    newcomer, _ = r.hook(pid=200)
    assert r.alloc(newcomer, 64 * MiB) == []
    r.clock.advance(REJOIN_GRACE_S)
    assert replies(r.m.tick()) == [hp.MemReply(verdict=int(hp.MemVerdict.DENIED), used=96 * MiB,
                                               limit=128 * MiB)]


def test_a_first_start_or_an_empty_record_waits_for_nothing():
    for carried in ({}, {100: Holder(0, True)}):
        r = Restarted(carried)
        assert not r.m.recovering
        newcomer, _ = r.hook(pid=200)
        assert replies(r.alloc(newcomer, 64 * MiB)) == [hp.MemReply(verdict=0, used=64 * MiB, limit=128 * MiB)]


def test_the_record_names_every_holder_and_whether_its_pid_can_be_looked_up():
    r = Restarted({300: Holder(8 * MiB, visible=True)}, alive={300})
    same, _ = r.hook(pid=100)
    other, _ = r.hook(pid=101, pid_ns=NS + 1)           # a hook in another pid namespace (TCP from a container)
    idle, _ = r.hook(pid=102)
    r.clock.advance(REJOIN_GRACE_S)
    r.m.tick()                                          # 300 never came back: its record ends with the wait
    r.alloc(same, 16 * MiB)
    r.alloc(other, 8 * MiB)
    assert r.m.ledger_record() == {100: Holder(16 * MiB, True), 101: Holder(8 * MiB, False)}
    r.m.on_hook(same, 5, hp.MemFree(bytes=16 * MiB))
    r.m.disconnect(idle)
    assert r.m.ledger_record() == {101: Holder(8 * MiB, False)}


# --- the file -------------------------------------------------------------------------------------------------

def test_the_ledger_file_round_trips_and_is_written_when_the_holders_change(tmp_path):
    path = tmp_path / "group.g.ledger"
    f = ledger.LedgerFile(path, GROUP, min_interval_s=1.0)
    assert ledger.load(path, GROUP) == ledger.Loaded(False, {})
    f.update({1: Holder(10, True)}, now=0.0)
    assert ledger.load(path, GROUP) == ledger.Loaded(True, {1: Holder(10, True)})
    f.update({1: Holder(20, True)}, now=0.5)            # only the bytes changed, within the interval: not yet
    assert ledger.load(path, GROUP).holders == {1: Holder(10, True)}
    f.update({1: Holder(20, True), 2: Holder(5, False)}, now=0.6)   # a new holder: at once
    assert ledger.load(path, GROUP).holders == {1: Holder(20, True), 2: Holder(5, False)}
    f.update({1: Holder(30, True), 2: Holder(5, False)}, now=1.7)   # bytes, after the interval
    assert ledger.load(path, GROUP).holders == {1: Holder(30, True), 2: Holder(5, False)}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    f.close({})
    assert not path.exists()


def test_a_ledger_that_is_not_ours_or_is_broken_is_reported_and_unreadable(tmp_path, caplog):
    path = tmp_path / "l"
    for text, why in [("{", "not JSON"), (json.dumps({"version": 9}), "not a version 1"),
                      (ledger.encode("other", {}), "group 'other'"),
                      (json.dumps({"version": 1, "group": GROUP, "holders": [[1, -5, 0]]}), "bad holder"),
                      (json.dumps({"version": 1, "group": GROUP, "holders": [[1, 5, 0], [1, 6, 0]]}), "one per pid")]:
        path.write_text(text)
        caplog.clear()
        assert ledger.load(path, GROUP) == ledger.Loaded(True, None)
        assert why in caplog.text, (text, caplog.text)
