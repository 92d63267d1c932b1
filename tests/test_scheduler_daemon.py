"""gem-schd over real zmq on an ephemeral port, with fake pod managers (DEALER sockets)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from gemini.config import parse_config
from gemini.wire.sched import (ERR_BAD_MESSAGE, ERR_NOT_REGISTERED, ERR_UNKNOWN_GROUP, ClaimReport, ConfigUpdate, Error,
                             Grant, GroupRemoved, GroupStatus, Heartbeat, HeartbeatAck, Hello, StatusReply,
                             StatusRequest, TokenRelease, TokenRequest, Welcome, decode, encode)
from gemini.scheduler.daemon import MAX_DECIDE_AHEAD_MS
from gemini.scheduler.policy import GrantDecision
from tests.schd_inproc import DaemonThread, FakePodManager

MAX_AHEAD = MAX_DECIDE_AHEAD_MS

REPO = Path(__file__).resolve().parent.parent

CONFIG = parse_config("""\
[a]
MinUtil = 0.0
MaxUtil = 1.0
MemoryLimit = 1GiB
[b]
MinUtil = 0.2
MaxUtil = 0.9
MemoryLimit = 2GiB
[c]
MaxUtil = 0.5
""", "rc.txt")

QUOTA = 60.0  # ms: short slots keep the tests short


@pytest.fixture
def schd():
    d = DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0, window_ms=10000.0).start()
    yield d
    d.stop()


@pytest.fixture
def pmgrs(schd):
    made = []

    def make(group=None, identity=None):
        p = FakePodManager(schd.endpoint, identity=identity)
        made.append(p)
        if group is not None:
            w = p.request(Hello(group, pid=os.getpid()))
            assert isinstance(w, Welcome), w
        return p
    yield make
    for p in made:
        p.close()


def test_hello_welcome(schd, pmgrs):
    p = pmgrs()
    w = p.request(Hello("b", pid=42, mem_used=5, clients=2))
    assert isinstance(w, Welcome)
    assert (w.group, w.min_util, w.max_util, w.mem_limit, w.neighbours) == ("b", 0.2, 0.9, 2 << 30, 2)
    assert w.scheduler_id == schd.daemon.scheduler_id
    st = p.request(StatusRequest())
    row = next(g for g in st.groups if g["name"] == "b")
    assert row["connected"] and row["mem_used"] == 5 and row["clients"] == 2


def test_hello_for_unknown_group(pmgrs):
    p = pmgrs()
    e = p.request(Hello("nope", pid=1))
    assert isinstance(e, Error) and e.code == ERR_UNKNOWN_GROUP and e.group == "nope"
    assert "nope" in e.message and "rc.txt" in e.message


def test_heartbeat(schd, pmgrs):
    p = pmgrs("a")
    ack = p.request(Heartbeat("a", mem_used=100, clients=3))
    assert ack == HeartbeatAck(schd.daemon.scheduler_id)
    q = pmgrs()
    e = q.request(Heartbeat("a"))
    assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED and e.group == "a"
    e = q.request(Heartbeat("zzz"))
    assert isinstance(e, Error) and e.code == ERR_UNKNOWN_GROUP


def test_token_requests_need_registration(pmgrs):
    p = pmgrs()
    e = p.request(TokenRequest("a"))
    assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED
    e = p.request(TokenRelease("a", 1))
    assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED
    e = p.request(TokenRequest("zzz"))
    assert isinstance(e, Error) and e.code == ERR_UNKNOWN_GROUP
    # registered for a, asking for b
    p.request(Hello("a", pid=1))
    e = p.request(TokenRequest("b"))
    assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED and e.group == "b"


def test_grant_ordering_and_deadline(pmgrs):
    pa, pb = pmgrs("a"), pmgrs("b")
    ga = pa.request(TokenRequest("a"))
    t_a = time.monotonic()
    assert isinstance(ga, Grant) and ga.group == "a" and ga.quota_ms == QUOTA
    pb.send(TokenRequest("b"))
    gb = pb.recv(2.0)
    t_b = time.monotonic()
    assert isinstance(gb, Grant) and gb.group == "b" and gb.token_seq == ga.token_seq + 1
    # b was granted at a's deadline, not before
    assert (t_b - t_a) * 1000 >= QUOTA - 5
    assert (t_b - t_a) * 1000 <= QUOTA + 40
    # a asks again while b holds it: granted at b's deadline
    pa.send(TokenRequest("a", overuse_ms=0.5))
    ga2 = pa.recv(2.0)
    assert isinstance(ga2, Grant) and ga2.token_seq == gb.token_seq + 1
    assert pb.drain() == []


def test_early_release_hands_over_at_once(pmgrs):
    pa, pb = pmgrs("a"), pmgrs("b")
    ga = pa.request(TokenRequest("a"))
    pb.send(TokenRequest("b"))
    assert pb.recv(0.01) is None
    t0 = time.monotonic()
    pa.send(TokenRelease("a", ga.token_seq))
    gb = pb.recv(1.0)
    assert isinstance(gb, Grant) and gb.group == "b"
    assert (time.monotonic() - t0) * 1000 < 20


def test_a_request_that_crosses_a_continuation_is_answered(schd, pmgrs):
    """A lone holder's pod manager asks for its next slot after gem-schd continued its slot but before the
    continuation began: the pod manager ignores a continuation while its request is out, so gem-schd must answer
    the request with a fresh grant. It kept continuing the slot instead, and the request waited out the pod
    manager's 300 s token timeout (a rare hang of test_faults.py::test_sigkill_of_a_pod_manager). The lead is
    30 ms here (2 ms by default), so that the request surely arrives before the continuation begins."""
    schd.daemon.policy.continue_lead_ms = 30.0
    pa = pmgrs("a")
    ga = pa.request(TokenRequest("a"))
    assert isinstance(ga, Grant)
    cont = pa.recv_type(Grant, 1.0)
    assert isinstance(cont, Grant) and cont.continuation and cont.prev_seq == ga.token_seq
    pa.send(TokenRequest("a"))
    fresh = pa.recv_type(Grant, 1.0)
    assert isinstance(fresh, Grant) and not fresh.continuation and fresh.token_seq > cont.token_seq, fresh
    assert fresh.deadline_s < cont.deadline_s       # granted now, not at the continuation's start


def test_a_voided_continuation_is_withdrawn_from_the_board(schd, pmgrs):
    """The continuation voided by a crossing request stays on the board unless gem-schd takes it back, and the
    holder's other hooks take a continuation up from the board when their slot runs out: they would launch
    until its deadline while b, granted instead, holds the GPU. Its line must end where the continuation was to
    begin."""
    schd.daemon.policy.continue_lead_ms = 30.0
    pa, pb = pmgrs("a"), pmgrs("b")
    g1 = pa.request(TokenRequest("a"))
    pb.send(TokenRequest("b"))                      # b waits, and is behind at a's lead point: b goes next
    gb = pb.recv_type(Grant, 1.0)
    assert isinstance(gb, Grant) and gb.group == "b" and not gb.continuation
    pa.send(TokenRequest("a"))                      # a waits; b gives its slot back at once: a's turn
    pb.send(TokenRelease("b", gb.token_seq))
    g3 = pa.recv_type(Grant, 1.0)
    assert isinstance(g3, Grant) and not g3.continuation and g3.token_seq > g1.token_seq
    cont = pa.recv_type(Grant, 1.0)                 # nobody waits at the lead point: a is continued
    assert isinstance(cont, Grant) and cont.continuation and cont.prev_seq == g3.token_seq
    pb.send(TokenRequest("b"))                      # b asks in the lead time: it has used far less than a
    st = pb.request(StatusRequest())                # (answered after b's request: b surely waits when a asks)
    assert isinstance(st, StatusReply) and next(g for g in st.groups if g["name"] == "b")["waiting"], st
    pa.send(TokenRequest("a"))                      # a's request crosses its continuation: void, b goes first
    gb2 = pb.recv_type(Grant, 1.0)
    assert isinstance(gb2, Grant) and gb2.group == "b", gb2
    slot = schd.daemon._board_slots["a"]
    seq, prev, deadline_ns = schd.daemon.board.read(slot)
    assert (seq, prev) == (cont.token_seq, g3.token_seq)
    # the line ends where the continuation was to begin (g3's deadline), not at the continuation's own
    assert deadline_ns <= int((cont.deadline_s - cont.quota_ms / 1000.0) * 1e9) + 1000, \
        (deadline_ns, cont.deadline_s)


def test_a_continuation_of_a_group_removed_in_its_lead_time_is_voided(schd, pmgrs):
    """a is continued (nobody waits at its lead point); b asks, and a reload removes a before the continuation
    begins. Nobody will run it: it is voided, withdrawn from the board (a's old hooks take a continuation up from
    there), and b is granted when a's slot runs out. Before, b waited a whole slot more at an idle GPU (found by an
    independent review's fuzzing of reloads). The lead is 40 ms here (2 ms by default) so that the reload surely
    lands in it."""
    schd.daemon.policy.continue_lead_ms = 40.0
    pa, pb = pmgrs("a"), pmgrs("b")
    g1 = pa.request(TokenRequest("a"))
    cont = pa.recv_type(Grant, 1.0)
    assert isinstance(cont, Grant) and cont.continuation and cont.prev_seq == g1.token_seq, cont
    slot = schd.call(lambda: schd.daemon._board_slots["a"])
    pb.send(TokenRequest("b"))
    no_a = parse_config("[b]\nMinUtil = 0.2\nMaxUtil = 0.9\nMemoryLimit = 2GiB\n[c]\nMaxUtil = 0.5\n", "rc.txt")
    schd.call(lambda: schd.daemon.apply_config(no_a))
    cont_start = cont.deadline_s - cont.quota_ms / 1000.0
    assert time.monotonic() < cont_start, "the reload came after the continuation began: the case did not arise"
    gb = pb.recv_type(Grant, 1.0)
    assert isinstance(gb, Grant) and gb.group == "b" and not gb.continuation, gb
    assert gb.deadline_s - gb.quota_ms / 1000.0 <= cont_start + 0.01, (gb, cont)   # at a's deadline
    seq, prev, deadline_ns = schd.call(lambda: schd.daemon.board.read(slot))
    assert (seq, prev) == (cont.token_seq, g1.token_seq) and deadline_ns <= int(cont_start * 1e9) + 1000


def test_bad_frames_are_dropped_and_the_daemon_keeps_running(schd, pmgrs):
    p = pmgrs("a")
    bad_frames = [b"", b"garbage", b"\xff\xfe", b"[]", b"null", b'{"type": "nope"}', b'{"no": "type"}',
                  b'{"type": "hello", "group": 5, "pid": 1}', b'{"type": "hello", "group": "a"}',
                  b'{"type": "hello", "group": "a", "pid": 1, "evil": 1}',
                  b'{"type": "token_request", "group": "a", "overuse_ms": NaN}',
                  b'{"type": "token_request", "group": "a", "overuse_ms": true}',
                  encode(Grant("a", 1.0, 1)),                            # a scheduler-to-pmgr message
                  b"x" * (70 * 1024)]                                    # over MAX_MESSAGE_BYTES
    for frame in bad_frames:
        p.send_raw(frame)
        e = p.recv(2.0)
        assert isinstance(e, Error) and e.code == ERR_BAD_MESSAGE, (frame[:40], e)
    # several frames where one is expected: dropped without a reply
    p.send_raw(b"one", b"two", b"three")
    assert p.recv(0.2) is None
    # a frame far too large for zmq's limit: that connection is cut by zmq, the daemon lives on
    big = FakePodManager(schd.endpoint)
    big.send_raw(b"y" * (4 << 20))
    big.close()
    # still serving, and the registration survived
    assert isinstance(p.request(TokenRequest("a")), Grant)
    assert isinstance(p.request(StatusRequest()), StatusReply)


def test_status_reply(schd, pmgrs):
    pa = pmgrs("a")
    pa.request(TokenRequest("a"))
    pb = pmgrs("b")
    pb.send(TokenRequest("b"))
    time.sleep(0.02)
    st = pmgrs().request(StatusRequest())
    assert isinstance(st, StatusReply)
    assert st.scheduler_id == schd.daemon.scheduler_id and st.window_ms == 10000.0 and st.holder == "a"
    rows = {g["name"]: GroupStatus(**g) for g in st.groups}
    assert list(rows) == ["a", "b", "c"]
    assert rows["a"].holding and rows["a"].grants == 1 and rows["a"].quota_ms == QUOTA and rows["a"].share > 0
    assert rows["b"].waiting and rows["b"].wait_ms >= 10 and not rows["b"].holding
    assert rows["b"].mem_limit == 2 << 30 and rows["b"].min_util == 0.2
    assert not rows["c"].connected and rows["c"].grants == 0


def test_status_from_a_req_socket(schd):
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(schd.endpoint)
    req.send(encode(StatusRequest()))
    assert req.poll(2000)
    st = decode(req.recv())
    assert isinstance(st, StatusReply) and len(st.groups) == 3
    req.close()
    ctx.term()


def test_latest_hello_wins(schd, pmgrs, caplog):
    old = pmgrs("a", identity=b"a:1")
    new = pmgrs("a", identity=b"a:2")
    g = new.request(TokenRequest("a"))
    assert isinstance(g, Grant)
    # the replaced pod manager is told it is no longer registered
    e = old.request(Heartbeat("a"))
    assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED


def test_a_new_pod_manager_does_not_inherit_the_old_ones_request(pmgrs):
    pa = pmgrs("a")
    ga = pa.request(TokenRequest("a"))
    old_b = pmgrs("b", identity=b"b:1")
    old_b.send(TokenRequest("b"))                  # waits behind a
    time.sleep(0.01)
    new_b = pmgrs("b", identity=b"b:2")            # b's pod manager restarted
    pa.send(TokenRelease("a", ga.token_seq))
    assert new_b.recv(0.2) is None                 # no grant it did not ask for
    assert isinstance(new_b.request(TokenRequest("b")), Grant)


def test_silent_pod_manager_is_disconnected_and_its_request_dropped():
    d = DaemonThread(CONFIG, base_quota_ms=5000.0, min_quota_ms=20.0, heartbeat_timeout_s=0.3).start()
    try:
        pa = FakePodManager(d.endpoint)
        pb = FakePodManager(d.endpoint)
        pa.request(Hello("a", pid=1))
        pb.request(Hello("b", pid=2))
        ga = pa.request(TokenRequest("a"))           # a holds the token for 5 s
        assert isinstance(ga, Grant)
        pb.send(TokenRequest("b"))                    # b waits, then falls silent
        slot_b = d.call(lambda: d.daemon._board_slots["b"])
        d.call(lambda: d.daemon.board.set_flare(slot_b, True))    # (as a latency group's pod manager does)
        for _ in range(14):                          # a keeps its heartbeat going
            time.sleep(0.1)
            pa.send(Heartbeat("a"))
        status = {g["name"]: g for g in d.call(d.daemon.status_reply).groups}
        assert status["a"]["connected"] and not status["b"]["connected"]
        assert not status["b"]["waiting"]
        # its flares were its pod manager's to audit: they count no more
        assert not d.call(lambda: d.daemon.board.flare(slot_b))
        # a releases: nobody is waiting any more, so nobody gets the token
        pa.send(TokenRelease("a", ga.token_seq))
        time.sleep(0.05)
        assert [m for m in pb.drain() if isinstance(m, Grant)] == []
        assert d.call(lambda: d.daemon.policy.holder) is None
        # when b speaks again it is asked to register (and, as a pod manager does then, to re-send its request)
        e = pb.request(Heartbeat("b"))
        assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED
        pa.close()
        pb.close()
    finally:
        d.stop()


def test_scheduler_restart_leads_to_re_hello(pmgrs):
    d1 = DaemonThread(CONFIG, base_quota_ms=QUOTA).start()
    port = d1.port
    p = FakePodManager(f"tcp://127.0.0.1:{port}")
    try:
        w1 = p.request(Hello("a", pid=1))
        first_id = w1.scheduler_id
        assert isinstance(p.request(TokenRequest("a")), Grant)
        d1.stop()
        d2 = DaemonThread(CONFIG, base_quota_ms=QUOTA, port=port).start()
        try:
            # the DEALER reconnects by itself; the new scheduler does not know it
            e = None
            for _ in range(50):
                p.send(Heartbeat("a"))
                e = p.recv(0.2)
                if e is not None:
                    break
            assert isinstance(e, Error) and e.code == ERR_NOT_REGISTERED
            w2 = p.request(Hello("a", pid=1, mem_used=77))
            assert isinstance(w2, Welcome) and w2.scheduler_id != first_id
            assert isinstance(p.request(TokenRequest("a")), Grant)
            st = p.request(StatusRequest())
            assert next(g for g in st.groups if g["name"] == "a")["mem_used"] == 77
        finally:
            d2.stop()
    finally:
        p.close()


def test_a_reload_that_changes_how_many_groups_share_the_gpu_tells_every_group(schd, pmgrs):
    """Each pod manager knows its neighbours (with any, an uncapped group's hooks keep their queue within its slots):
    a reload down to one group tells the one left, whose own settings did not change, that it is alone now."""
    pa, pb = pmgrs("a"), pmgrs("b")
    alone = parse_config("[a]\nMaxUtil = 1.0\nMemoryLimit = 1GiB\n", "rc.txt")
    schd.call(lambda: schd.daemon.apply_config(alone))
    assert pa.recv(1.0) == ConfigUpdate("a", 0.0, 1.0, 1 << 30, neighbours=0)
    assert GroupRemoved("b") in [pb.recv(1.0), pb.recv(1.0)]
    assert pmgrs("a").request(Hello("a", pid=5)).neighbours == 0


def test_reload_pushes_updates_and_removals(schd, pmgrs):
    pa, pb, pc = pmgrs("a"), pmgrs("b"), pmgrs("c")
    pa.request(TokenRequest("a"))                 # a holds the token
    pc.send(TokenRequest("c"))                    # c waits
    time.sleep(0.01)
    slot_c = schd.call(lambda: schd.daemon._board_slots["c"])
    schd.call(lambda: schd.daemon.board.set_flare(slot_c, True))
    new = parse_config("[a]\nMaxUtil = 1.0\nMemoryLimit = 1GiB\n[b]\nMinUtil = 0.1\nMaxUtil = 0.8\n"
                       "MemoryLimit = 3GiB\n[d]\n", "rc.txt")
    schd.call(lambda: schd.daemon.apply_config(new))
    upd = pb.recv(1.0)
    assert upd == ConfigUpdate("b", 0.1, 0.8, 3 << 30, neighbours=2)
    got = [pc.recv(1.0), pc.recv(1.0)]
    assert Error(ERR_UNKNOWN_GROUP, "group 'c' was removed from rc.txt", "c") in got
    assert GroupRemoved("c") in got
    assert not schd.call(lambda: schd.daemon.board.flare(slot_c))   # a removed group's flares count no more
    assert pa.drain() == []                        # a's settings did not change: nothing pushed
    # c is gone: its heartbeat and its hello are answered with unknown_group
    e = pc.request(Heartbeat("c"))
    assert isinstance(e, Error) and e.code == ERR_UNKNOWN_GROUP
    e = pc.request(Hello("c", pid=3))
    assert isinstance(e, Error) and e.code == ERR_UNKNOWN_GROUP
    # the new group d can register
    assert isinstance(pmgrs().request(Hello("d", pid=4)), Welcome)
    st = pa.request(StatusRequest())
    assert [g["name"] for g in st.groups] == ["a", "b", "d"]


def test_grant_at_deadline_is_punctual(pmgrs, schd):
    pa, pb = pmgrs("a"), pmgrs("b")
    pa.request(TokenRequest("a"))
    for i in range(6):   # ping-pong: each asks while the other holds; every grant is made at a deadline
        (pb if i % 2 == 0 else pa).send(TokenRequest("b" if i % 2 == 0 else "a"))
        g = (pb if i % 2 == 0 else pa).recv(2.0)
        assert isinstance(g, Grant)
    stats = schd.call(schd.daemon.timer_stats)
    assert stats["count"] >= 5
    assert stats["p50_ms"] < 1.0, stats
    # the loop's CPU from each of those timers to its grant sent is measured (issue 14's scale goal), and the wall
    # time from the deadline to the send
    assert 0.0 < stats["cpu_p50_us"] <= stats["cpu_p99_us"] < 1e6, stats
    assert 0.0 < stats["sent_p50_ms"] <= stats["sent_p99_ms"] < 1000.0, stats


def _watch_grants(d, events):
    """Record, on the daemon's loop, each Grant as it is sent and each observer call: ("sent", group, wall s) and
    ("on_grant", group) / ("on_slot_end", group, reason); and each policy tick: ("tick", policy ms, daemon ms)."""
    class Watch:
        def on_grant(self, group, *_):
            events.append(("on_grant", group))

        def on_slot_end(self, group, *args):
            events.append(("on_slot_end", group, args[-1]))

    def watch():
        d.daemon.observers.append(Watch())
        send, tick = d.daemon._send, d.daemon.policy.tick

        def sent(identity, msg, envelope=None, frame=None):
            if isinstance(msg, Grant):
                events.append(("sent", msg.group, time.monotonic(), msg.deadline_s, msg.quota_ms, msg.continuation))
            send(identity, msg, envelope, frame)

        def ticked(now):
            events.append(("tick", now, d.daemon.now_ms(), d.daemon.policy.holder_deadline))
            return tick(now)
        d.daemon._send, d.daemon.policy.tick = sent, ticked
    d.call(watch)


def _sent_before_their_start(d, events):
    """Fresh grants sent before the start the policy gave them (their deadline less their quota), beyond 50 us (a
    continuation goes out continue_lead_ms before the slot it continues ends, by design)."""
    return [e for e in events if e[0] == "sent" and not e[5] and e[2] < e[3] - e[4] / 1000.0 - 50e-6]


@contextlib.contextmanager
def _a_holds_and_b_asks(d):
    """Pod managers for a and b say hello; a is granted the GPU, then b asks (and is granted at a's deadline). Yields
    their fake pod managers and a's grant (its token_seq also as d.daemon._a_seq, for injected callbacks)."""
    with FakePodManager(d.endpoint) as pa, FakePodManager(d.endpoint) as pb:
        assert isinstance(pa.request(Hello("a", pid=os.getpid())), Welcome)
        assert isinstance(pb.request(Hello("b", pid=os.getpid())), Welcome)
        grant = pa.request(TokenRequest("a"))
        assert isinstance(grant, Grant)
        d.daemon._a_seq = grant.token_seq
        pb.send(TokenRequest("b"))
        yield pa, pb, grant


def test_a_grant_at_a_deadline_leaves_before_the_observers_hear_of_the_slot_that_ended():
    """The metrics and the trace of the slot that ended at a deadline are not on the next holder's path: deciding at
    the deadline (--decide-ahead 0), they are told after the grant has gone, in the order the decisions were made."""
    events = []
    with DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=0.0) as d:
        _watch_grants(d, events)
        with _a_holds_and_b_asks(d) as (pa, pb, _grant):
            assert isinstance(pb.recv(2.0), Grant)          # at a's deadline
            seen = [e[:3] if e[0] != "sent" else e[:2] for e in d.call(lambda: list(events)) if e[0] != "tick"]
    at = seen.index(("on_slot_end", "a", "deadline"))
    assert seen[at - 1] == ("sent", "b") and seen[at + 1] == ("on_grant", "b"), seen


def _until_it_happens(scenario, tries=4):
    """Run scenario(), a case that needs gem-schd's timer to fire before a deadline, until it returns something
    other than None. On a loaded machine the timer now and then fires later than the lead and decides at the
    deadline, and the case does not arise. Skipped if it never did."""
    for _ in range(tries):
        out = scenario()
        if out is not None:
            return out
    pytest.skip(f"the case did not arise in {tries} tries: gem-schd's timers late on a loaded machine")


def test_the_decisions_due_at_a_deadline_are_made_ahead_and_their_grant_leaves_at_it():
    """By default the policy decides decide_ahead_ms before a deadline, as at the deadline, and the grant waits
    for it: it never leaves before the deadline, and all the CPU from the deadline to it is the send."""
    def run():
        events = []
        with DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0) as d:
            _watch_grants(d, events)
            with FakePodManager(d.endpoint) as pa, FakePodManager(d.endpoint) as pb:
                assert isinstance(pa.request(Hello("a", pid=os.getpid())), Welcome)
                assert isinstance(pb.request(Hello("b", pid=os.getpid())), Welcome)
                assert isinstance(pa.request(TokenRequest("a")), Grant)
                for i in range(4):  # ping-pong: each asks while the other holds, granted at the other's deadline
                    (pb if i % 2 == 0 else pa).send(TokenRequest("b" if i % 2 == 0 else "a"))
                    assert isinstance((pb if i % 2 == 0 else pa).recv(2.0), Grant)
            seen = d.call(lambda: list(events))
            stats = d.call(d.daemon.timer_stats)
        return (d, seen, stats) if stats["decided_ahead"] >= 1 else None
    d, seen, stats = _until_it_happens(run)
    t0 = d.daemon._t0
    deadlines = [(e[1], seen[i + 1:]) for i, e in enumerate(seen) if e[0] == "tick" and e[1] > e[2] + 0.1]
    # deadlines' ticks ran ahead (their time more than 0.1 ms past the daemon's clock; one a busy loop wakes late
    # decides at once), and each grant was sent at its deadline or after it, never before
    for due, rest in deadlines:
        grant = next((e for e in rest if e[0] == "sent"), None)
        assert grant is not None, seen
        assert grant[2] >= t0 + due / 1000.0 - 1e-6, (due, grant, seen)
    # only the ends of running slots are decided ahead (not the point continue_lead_ms before them)
    assert all(e[3] is not None and abs(e[1] - e[3]) < 1e-6 for e in seen if e[0] == "tick" and e[1] > e[2]), seen
    assert not _sent_before_their_start(d, seen), seen
    assert stats["decide_cpu_p50_us"] > 0, stats
    assert stats["decided_ahead"] + stats["decided_late"] == stats["count"] >= 4, stats


def test_with_decide_ahead_off_the_policy_decides_at_the_deadline():
    """The mechanism switched off (--decide-ahead 0): no tick runs ahead of the daemon's clock."""
    events = []
    with DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=0.0) as d:
        _watch_grants(d, events)
        with _a_holds_and_b_asks(d) as (pa, pb, _grant):
            assert isinstance(pb.recv(2.0), Grant)
        seen = d.call(lambda: list(events))
        stats = d.call(d.daemon.timer_stats)
    assert not [e for e in seen if e[0] == "tick" and e[1] > e[2]], seen
    assert stats["decided_ahead"] == 0 and stats["decided_late"] >= 1, stats


def test_a_grant_decided_ahead_whose_pod_manager_leaves_before_it_goes_out_is_never_sent():
    """b's grant, decided ahead of a's deadline, waits for it; b's pod manager is dropped meanwhile (as the sweep
    drops a silent one): b's grant never goes out, and c gets the GPU at a's deadline, not after b's slot."""
    def run():
        events = []
        with DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=MAX_AHEAD) as d:
            def leave(group):
                daemon = d.daemon
                daemon._forget_peer(next(i for i, p in daemon._peers.items() if p.group == group))
                t = daemon.now_ms()
                daemon._dispatch(daemon.policy.cancel(group, t), t)
                events.append(("left", group, list(daemon._early)))

            def watch():
                tick = d.daemon.policy.tick

                def ticked(now):
                    out = tick(now)
                    granted = [x.group for x in out if isinstance(x, GrantDecision) and x.group != "a"]
                    if now > d.daemon.now_ms() and granted and not [e for e in events if e[0] == "left"]:
                        d.loop.call_soon(leave, granted[0])     # right after the decision, before its grant goes out
                    return out
                d.daemon.policy.tick = ticked
            d.call(watch)
            _watch_grants(d, events)
            with FakePodManager(d.endpoint) as pa, FakePodManager(d.endpoint) as pb, \
                    FakePodManager(d.endpoint) as pc:
                for pm, g in ((pa, "a"), (pb, "b"), (pc, "c")):
                    assert isinstance(pm.request(Hello(g, pid=os.getpid())), Welcome)
                grant = pa.request(TokenRequest("a"))
                assert isinstance(grant, Grant)
                pb.send(TokenRequest("b"))
                pc.send(TokenRequest("c"))
                time.sleep(grant.quota_ms / 1000.0 + 0.1)
                seen = d.call(lambda: list(events))
        return (grant, seen) if [e for e in seen if e[0] == "left" and e[2]] else None     # (left in the window)
    grant, seen = _until_it_happens(run)
    left = [e for e in seen if e[0] == "left"]
    assert len(left) == 1, seen
    gone = left[0][1]
    assert [x[0].group for x in left[0][2]] == [gone], seen     # it left while its grant waited for a's deadline
    other = ({"b", "c"} - {gone}).pop()
    # never sent, and nobody told of a slot that never began
    assert gone not in [e[1] for e in seen if e[0] == "sent"] and ("on_grant", gone) not in seen, seen
    sent = next(e for e in seen if e[0] == "sent" and e[1] == other)
    # the other one at a's deadline (as the grant to a group without a pod manager is handed straight back), not
    # after the gone group's slot
    assert grant.deadline_s - 1e-6 <= sent[2] < grant.deadline_s + QUOTA / 2000.0, (grant.deadline_s, sent)


def test_a_request_that_finds_the_gpu_free_at_a_deadline_decided_ahead_waits_for_it():
    """c (MaxUtil 0.5) alone: its slot ends at its frame's budget, and the decision ahead of that deadline leaves the
    GPU free then. b asks in between: the policy grants b at the deadline, and b's grant must wait for it (sent at
    once, b's hooks would launch while c's slot still runs)."""
    def run():
        events = []
        with DaemonThread(CONFIG, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=MAX_AHEAD) as d:
            def ask(group, due_ms):
                daemon = d.daemon
                events.append(("asked", group, time.monotonic(), daemon._t0 + due_ms / 1000.0))
                t = daemon.now_ms()
                daemon._dispatch(daemon.policy.request(group, now=t), t)

            def watch():
                tick = d.daemon.policy.tick

                def ticked(now):
                    out = tick(now)
                    if now > d.daemon.now_ms() and d.daemon.policy.holder is None \
                            and not [e for e in events if e[0] == "asked"]:
                        d.loop.call_soon(ask, "b", now)     # in the window: the GPU is free at the deadline
                    return out
                d.daemon.policy.tick = ticked
            d.call(watch)
            _watch_grants(d, events)
            with FakePodManager(d.endpoint) as pb, FakePodManager(d.endpoint) as pc:
                for pm, g in ((pb, "b"), (pc, "c")):
                    assert isinstance(pm.request(Hello(g, pid=os.getpid())), Welcome)
                grant = pc.request(TokenRequest("c"))
                assert isinstance(grant, Grant)
                got = pb.recv(2.0)
                seen = d.call(lambda: list(events))
        asked = next((e for e in seen if e[0] == "asked"), None)
        if asked is None or asked[2] >= asked[3]:
            return None             # (b did not ask before c's deadline: not the case)
        assert isinstance(got, Grant) and got.group == "b", got
        return d, seen, asked
    d, seen, asked = _until_it_happens(run)
    sent = next(e for e in seen if e[0] == "sent" and e[1] == "b")
    due = asked[3]                  # the deadline of c's slot (its first, or a continuation's) decided ahead
    assert sent[2] >= due - 1e-6, (due, sent, seen)         # granted at it, not before
    assert not _sent_before_their_start(d, seen), seen


def _decided_ahead_for_b(d, inject, at_first_tick_ahead=False):
    """gem-schd deciding 5 ms ahead, groups a and b: a holds, b asks; right after b's grant is decided ahead of a's
    deadline (before it goes out), or after the first tick made ahead of its time, inject(daemon) runs on the
    loop. Returns the events (_watch_grants)."""
    events = []

    def watch():
        tick = d.daemon.policy.tick

        def ticked(now):
            out = tick(now)
            b_granted = any(isinstance(x, GrantDecision) and x.group == "b" for x in out)
            if now > d.daemon.now_ms() and (b_granted or at_first_tick_ahead) \
                    and not [e for e in events if e[0] == "injected"]:
                events.append(("injected", d.daemon.now_ms()))
                d.loop.call_soon(run, d.daemon)
            return out

        def run(daemon):
            # (on a loaded machine a message handled first may find the window's time come and send the grants)
            events.append(("ran", daemon.now_ms(), daemon._ahead_until is not None))
            inject(daemon)
        d.daemon.policy.tick = ticked
    d.call(watch)
    _watch_grants(d, events)
    return events


def _injected(result):
    """result (its last item the events) if the injection ran while the grants decided ahead still waited, else
    None (for _until_it_happens)."""
    return result if [e for e in result[-1] if e[0] == "ran" and e[2]] else None


def _b_grants_when(inject, quota_ms=QUOTA, min_quota_ms=20.0):
    """One try, groups a and b, deciding 5 ms ahead: inject(daemon) right after b's grant is decided ahead of a's
    deadline. (b's grants received within 0.2 s, the events) if the injection happened, else None."""
    with DaemonThread(TWO, base_quota_ms=quota_ms, min_quota_ms=min_quota_ms, decide_ahead_ms=MAX_AHEAD) as d:
        events = _decided_ahead_for_b(d, inject)
        with _a_holds_and_b_asks(d) as (_pa, pb, _grant):
            time.sleep(0.2)
            got = [m for m in pb.drain() if isinstance(m, Grant)]
            seen = d.call(lambda: list(events))
    return _injected((got, seen))


TWO = parse_config("[a]\nMaxUtil = 1.0\n[b]\nMaxUtil = 1.0\n", "rc.txt")


def test_the_holders_release_while_the_next_grant_waits_for_its_deadline_sends_nothing_early():
    """a releases (and asks again) right after the first decision made ahead of its time (the policy's clock moved
    on): b's grant leaves at a's deadline, never before the start the policy gave it. (Deciding ahead of the
    point continue_lead_ms before a deadline too, and letting the clock run on with the holder in place, sent b's
    grant at a's release, up to 2.8 ms before its start.)"""
    def run():
        with DaemonThread(TWO, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=MAX_AHEAD) as d:
            def release(daemon):
                t = daemon.now_ms()
                seqs = [x[0].prev_seq for x in daemon._early if x[0].group == "a"] + [daemon._a_seq]
                daemon._dispatch(daemon.policy.release("a", seqs[0], 0.0, t), t)
                daemon._dispatch(daemon.policy.request("a", t), t)
            events = _decided_ahead_for_b(d, release, at_first_tick_ahead=True)
            with _a_holds_and_b_asks(d) as (pa, pb, grant):
                assert isinstance(pb.recv(2.0), Grant)
                time.sleep(0.1)
                seen = d.call(lambda: list(events))
        return _injected((d, seen))
    d, seen = _until_it_happens(run)
    assert not _sent_before_their_start(d, seen), seen


def test_a_grant_decided_ahead_does_not_go_to_a_pod_manager_that_replaced_the_one_that_asked():
    """b's grant waits for a's deadline; a new pod manager says hello for b meanwhile (the old one's request is
    dropped): the new one, which never asked, gets no grant, and nobody is told of it."""
    def run():
        with DaemonThread(TWO, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=MAX_AHEAD) as d:
            events = _decided_ahead_for_b(d, lambda daemon: daemon._on_hello(b"new-b", Hello("b", pid=os.getpid()),
                                                                             "test", []))
            with FakePodManager(d.endpoint) as pa, FakePodManager(d.endpoint) as pb, \
                    FakePodManager(d.endpoint, identity=b"new-b") as pb2:
                assert isinstance(pa.request(Hello("a", pid=os.getpid())), Welcome)
                assert isinstance(pb.request(Hello("b", pid=os.getpid())), Welcome)
                pb2.send(TokenRequest("zz"))        # (connects it: answered with an error)
                pb2.recv(1.0)
                pa.request(TokenRequest("a"))
                pb.send(TokenRequest("b"))
                time.sleep(0.2)
                got = [m for m in pb.drain() + pb2.drain() if isinstance(m, Grant)]
                seen = d.call(lambda: list(events))
        return _injected((got, seen))
    got, seen = _until_it_happens(run)
    assert got == [] and ("on_grant", "b") not in seen, (got, seen)


def test_a_grant_for_a_group_without_a_pod_manager_is_handed_back_and_nobody_is_told_of_it():
    """Deciding at the deadline (--decide-ahead 0): b asked, then its pod manager is gone before a's deadline (the
    policy not told: the race the hand-back is for). b's grant goes nowhere and is handed back at once, and the
    observers hear of neither it nor its end, as for a grant decided ahead (told of it, the metrics counted a grant
    nobody got and the trace drew a slot of no length)."""
    events = []
    with DaemonThread(TWO, base_quota_ms=QUOTA, min_quota_ms=20.0, decide_ahead_ms=0.0) as d:
        _watch_grants(d, events)
        with _a_holds_and_b_asks(d) as (pa, pb, _grant):
            time.sleep(0.05)
            d.call(lambda: d.daemon._owners.pop("b"))
            pa.send(TokenRequest("a"))                      # a asks again: granted once b's grant is handed back
            assert isinstance(pa.recv_type(Grant, 3.0), Grant)
            seen = d.call(lambda: list(events))
            assert pb.drain() == []
    assert not [e for e in seen if e[0] in ("on_grant", "on_slot_end") and e[1] == "b"], seen


def test_a_grant_decided_ahead_for_a_group_a_reload_removed_is_not_sent_nor_counted():
    """b's grant waits for a's deadline; a reload removes b meanwhile: the grant goes nowhere, and the observers
    hear of no grant of b's (told of one, the metrics brought the removed group's series back)."""
    only_a = parse_config("[a]\nMaxUtil = 1.0\n", "rc.txt")
    got, seen = _until_it_happens(lambda: _b_grants_when(lambda daemon: daemon.apply_config(only_a)))
    assert got == [] and ("on_grant", "b") not in seen, (got, seen)


def test_a_grant_decided_ahead_that_the_policy_continues_in_the_window_still_goes_out_before_its_continuation():
    """Slots of 2 ms (no longer than continue_lead_ms): the policy continues b's slot, decided ahead of a's deadline,
    as soon as anything calls it in the window (here a's release of its old slot). b's fresh grant must still go
    out, before the continuation: a pod manager takes up only a continuation of a slot it was granted, and dropped,
    b's pod manager (which asks once) waited for good. (Found by a second review.)"""
    def stale_release(daemon):
        t = daemon.now_ms()
        daemon._dispatch(daemon.policy.release("a", daemon._a_seq, 0.0, t), t)
    got, seen = _until_it_happens(lambda: _b_grants_when(stale_release, quota_ms=2.0, min_quota_ms=1.0))
    assert got and not got[0].continuation, got[:5]
    # each continuation continues the grant b's pod manager received just before it
    for before, after in zip(got, got[1:]):
        assert not after.continuation or after.prev_seq == before.token_seq, got[:8]
    ends = [e for e in seen if e[0] in ("on_grant", "on_slot_end") and e[1] == "b"]
    assert ends[0] == ("on_grant", "b"), ends       # its end told after its grant


def test_a_grant_decided_ahead_whose_slot_runs_out_before_it_goes_out_is_asked_again():
    """The loop held up past a's deadline T and past b's whole slot (5 ms) before the grant waiting for T went out,
    and a message handled first moved the policy's clock past b's deadline: b's slot ran out unsent. b's pod
    manager asked once: its request goes back in the queue (dropped, it waited for good). (Found by a second
    review.)"""
    def run():
        with DaemonThread(TWO, base_quota_ms=5.0, min_quota_ms=5.0, decide_ahead_ms=MAX_AHEAD) as d:
            d.call(lambda: setattr(d.daemon.policy, "continuation", False))     # (so that b's slot runs out)

            def busy_then_message(daemon):
                due = daemon._ahead_until + 5.0 + 0.5
                while daemon.now_ms() < due:        # the loop busy (a long pause) ...
                    pass
                t = daemon.now_ms()                 # ... then a message handled before the grants waiting for T
                daemon._dispatch(daemon.policy.release("a", daemon._a_seq, 0.0, t), t)
            events = _decided_ahead_for_b(d, busy_then_message)
            with _a_holds_and_b_asks(d) as (pa, pb, grant):
                got = pb.recv_type(Grant, 2.0)
                seen = d.call(lambda: list(events))
        return _injected((got, seen))
    got, seen = _until_it_happens(run)
    assert got is not None and not got.continuation, (got, [e for e in seen if e[0] != "tick"][:20])


def test_pod_managers_that_release_and_ask_at_random_never_get_a_grant_before_its_slot_starts():
    """Three groups (one uncapped, two capped) whose pod managers release early or late and ask again at random
    for 3 s, gem-schd deciding 5 ms ahead so that their messages often fall in the windows: no fresh grant leaves
    before the start the policy gave it, every group is served, and decisions were made ahead."""
    import random
    rng = random.Random(1234)
    events = []
    with DaemonThread(CONFIG, base_quota_ms=20.0, min_quota_ms=5.0, decide_ahead_ms=MAX_AHEAD) as d:
        _watch_grants(d, events)
        pms = {g: FakePodManager(d.endpoint) for g in ("a", "b", "c")}
        try:
            for g, pm in pms.items():
                assert isinstance(pm.request(Hello(g, pid=os.getpid())), Welcome)
            holding = {g: None for g in pms}        # (token_seq, when to release)
            ask_at = {g: time.monotonic() + rng.uniform(0, 0.02) for g in pms}
            grants = {g: 0 for g in pms}
            poller = zmq.Poller()
            for pm in pms.values():
                poller.register(pm.sock, zmq.POLLIN)
            stop = time.monotonic() + 3.0
            while time.monotonic() < stop:
                ready = dict(poller.poll(1))
                now = time.monotonic()
                for g, pm in pms.items():
                    if pm.sock in ready:
                        for msg in pm.drain():
                            if isinstance(msg, Grant):
                                grants[g] += 1
                                end = msg.deadline_s + rng.choice([-0.004, -0.001, 0.0003, 0.002]) \
                                    if msg.continuation or rng.random() < 0.6 else \
                                    now + rng.uniform(0.0, msg.quota_ms / 1000.0)
                                holding[g] = (msg.token_seq, end)
                    held = holding[g]
                    if held is not None and now >= held[1]:
                        pm.send(TokenRelease(g, held[0], used_ms=rng.uniform(0.0, 20.0)))
                        holding[g] = None
                        ask_at[g] = now + rng.choice([0.0, 0.0, 0.0005, 0.003, 0.02])
                    if holding[g] is None and ask_at[g] is not None and now >= ask_at[g]:
                        pm.send(TokenRequest(g))
                        ask_at[g] = None
                    if holding[g] is None and ask_at[g] is None and rng.random() < 0.002:
                        ask_at[g] = now        # (asked again while its request waits: harmless)
            seen = d.call(lambda: list(events))
            stats = d.call(d.daemon.timer_stats)
        finally:
            for pm in pms.values():
                pm.close()
    assert not _sent_before_their_start(d, seen), _sent_before_their_start(d, seen)
    assert all(n >= 3 for n in grants.values()), grants
    assert stats["decided_ahead"] >= 5, stats


# --- the command line -------------------------------------------------------------------------------------------------

def _run_cli(*args, timeout=10, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "gemini.scheduler.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_cli_bad_config_exits_2_naming_file_and_line(tmp_path):
    (tmp_path / "rc.txt").write_text("[a]\nMaxUtil = 7\n")
    r = _run_cli("-p", str(tmp_path), "-f", "rc.txt", "-P", "0")
    assert r.returncode == 2
    assert f"{tmp_path / 'rc.txt'}:2:" in r.stderr
    r = _run_cli("-p", str(tmp_path), "-f", "missing.txt", "-P", "0")
    assert r.returncode == 2 and f"{tmp_path / 'missing.txt'}: no such file" in r.stderr


def test_cli_bad_flags_exit_2(tmp_path):
    assert _run_cli("-q", "-5").returncode == 2
    assert _run_cli("-P", "70000").returncode == 2
    assert _run_cli("--bogus").returncode == 2


def test_cli_port_busy_exits_2(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = _run_cli("-P", str(port), cwd=tmp_path)
        assert r.returncode == 2
        assert "already in use" in r.stderr and str(port) in r.stderr
    finally:
        s.close()


def test_cli_serves_and_stops_cleanly_on_sigterm(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\nMaxUtil = 1\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "-v", "-q", "50",
                             "--limit_file_dir", str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        endpoint = None
        lines = []
        deadline = time.monotonic() + 10
        while endpoint is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "listening on tcp://" in line:
                endpoint = line.split("listening on ")[1].split()[0]
        assert endpoint, lines
        with FakePodManager(endpoint) as p:
            assert isinstance(p.request(Hello("a", pid=1)), Welcome)
            g = p.request(TokenRequest("a"))
            assert isinstance(g, Grant) and g.quota_ms == 50.0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert "grant a quota 50.000 ms" in "".join(lines) + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_non_loopback_bind_warns(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "--ip", "0.0.0.0"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if "listening on tcp://" in line and "gem-schd" in line and "not a loopback" not in line:
                break
        assert any("not a loopback address" in s for s in seen), seen
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
        assert proc.returncode == 0


def test_a_claim_report_charges_its_time_ahead():
    """gem-schd hands a claim report's time ahead (an early claim's launches before the claim reached the board)
    to the policy: the claimer is charged what its hooks measured, up to the span plus that time."""
    config = parse_config("[inf]\nMinUtil = 0.5\nMaxUtil = 1.0\nClass = latency\n[train]\nMaxUtil = 1.0\n", "rc.txt")
    with DaemonThread(config, base_quota_ms=QUOTA, min_quota_ms=20.0, window_ms=10000.0) as d:
        with FakePodManager(d.endpoint) as p:
            assert isinstance(p.request(Hello("inf", pid=os.getpid())), Welcome)
            now = time.monotonic()
            p.send(ClaimReport("inf", start_s=now - 0.003, end_s=now - 0.001, used_ms=2.4, ahead_ms=0.5))
            deadline = time.monotonic() + 5
            row: dict = {}
            while time.monotonic() < deadline:
                p.send(StatusRequest())
                reply = p.recv_type(StatusReply)        # (a claim_right may come first)
                assert isinstance(reply, StatusReply), reply
                row = next(g for g in reply.groups if g["name"] == "inf")
                if row["claims"]:
                    break
                time.sleep(0.05)
            assert row["claims"] == 1 and row["claim_ms"] == pytest.approx(2.4, abs=1e-3), row


def test_a_policy_error_at_a_deadline_does_not_stop_the_timer(schd, pmgrs, caplog):
    """An exception from the policy at a deadline (a bug, or a config it cannot handle: MaxUtil 0 with aligned
    slots divided by zero) is logged, and the timer is armed again: otherwise no later deadline is decided and
    every group waits until some message happens to arrive."""
    policy = schd.daemon.policy
    real_tick = policy.tick
    failures = []

    def tick_failing_once(now):
        if not failures:
            failures.append(now)
            raise ZeroDivisionError("float division by zero")
        return real_tick(now)

    policy.tick = tick_failing_once
    pa, pb = pmgrs("a"), pmgrs("b")
    ga = pa.request(TokenRequest("a"))
    t_a = time.monotonic()
    assert isinstance(ga, Grant)
    pb.send(TokenRequest("b"))
    gb = pb.recv(2.0)           # a's deadline: the first tick fails, the next one grants b
    waited_ms = (time.monotonic() - t_a) * 1000
    assert failures, "the failing tick was not reached"
    assert isinstance(gb, Grant) and gb.group == "b", gb
    # at a's deadline, not at whatever message comes next (a heartbeat, a second later)
    assert waited_ms <= QUOTA + 100, waited_ms
    assert "internal error while deciding at a deadline" in caplog.text


def test_a_policy_error_that_recurs_is_retried_without_spinning(schd, pmgrs, caplog):
    """An error at every deadline for half a second: retried every 10 ms (not at once, in a loop that would take
    the event loop), one traceback logged a second, and the grants come back when the error stops."""
    policy = schd.daemon.policy
    real_tick = policy.tick
    calls = []
    failing_until = time.monotonic() + 0.5

    def tick_failing(now):
        if time.monotonic() < failing_until:
            calls.append(now)
            raise RuntimeError("a policy bug")
        return real_tick(now)

    policy.tick = tick_failing
    pa, pb = pmgrs("a"), pmgrs("b")
    assert isinstance(pa.request(TokenRequest("a")), Grant)
    pb.send(TokenRequest("b"))
    gb = pb.recv(3.0)
    assert isinstance(gb, Grant) and gb.group == "b", gb
    # a's deadline comes 60 ms into the half second: about 44 retries of 10 ms, not thousands
    assert 10 <= len(calls) <= 80, len(calls)
    assert caplog.text.count("internal error while deciding at a deadline") == 1, caplog.text[-2000:]


LATENCY_NEVER_CLAIMS = parse_config("[lat]\nClass = latency\nMinUtil = 0\nMaxUtil = 1.0\n[b]\nMaxUtil = 1.0\n",
                                    "rc.txt")


def test_an_idle_daemon_with_a_latency_group_that_never_claims_does_not_spin():
    """A latency group with MinUtil 0 never gets the right to claim. gem-schd's timer used to wake at its claim
    budget's refill, which was always now: an idle daemon ran thousands of ticks a second, a core at 100%."""
    with DaemonThread(LATENCY_NEVER_CLAIMS, board_path=None) as d:
        ticks = [0]

        def count_ticks():
            tick = d.daemon.policy.tick

            def counted(now):
                ticks[0] += 1
                return tick(now)
            d.daemon.policy.tick = counted
            d.daemon._arm_timer()
        d.call(count_ticks)
        time.sleep(0.5)
        n = d.call(lambda: ticks[0])
    assert n < 10, f"{n} ticks in 0.5 s of an idle daemon"


def test_observers_are_told_of_the_claim_the_policy_took_not_the_raw_report():
    """A claim report with a stale start (100 s ago): the policy takes at most max_claim_ms + 5 ms of it; the
    metrics (gemini_claim_seconds_total) and the trace were told of the whole 100 s."""
    cfg = parse_config("[lat]\nClass = latency\nMinUtil = 0.3\nMaxUtil = 1.0\n[b]\nMaxUtil = 1.0\n", "rc.txt")

    class Claims:
        def __init__(self):
            self.spans = []

        def on_claim(self, group, start, end):
            self.spans.append(end - start)

    with DaemonThread(cfg, board_path=None) as d:
        seen = Claims()
        d.call(lambda: d.daemon.observers.append(seen))
        with FakePodManager(d.endpoint) as pm:
            assert isinstance(pm.request(Hello("lat", pid=os.getpid())), Welcome)
            pm.drain()
            now = time.monotonic()
            pm.send(ClaimReport("lat", start_s=now - 100.0, end_s=now - 0.001, used_ms=5.0))
            st = pm.request(StatusRequest())
            while not isinstance(st, StatusReply):
                st = pm.recv()
        claim_ms = next(g["claim_ms"] for g in st.groups if g["name"] == "lat")
        max_span = d.daemon.policy.max_claim_ms + 5.0
    assert 0 < claim_ms <= max_span
    assert len(seen.spans) == 1 and 0 < seen.spans[0] <= max_span + 1e-6, seen.spans
