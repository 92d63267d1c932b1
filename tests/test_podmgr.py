"""gem-pmgr: the pure logic on simulated time, then the daemon on real sockets against a fake gem-schd."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from gemini.wire import sched as sm
from gemini.wire import hook as hp
from gemini.podmgr.manager import (HEARTBEAT_S, WELCOME_WAIT_S, CloseHook, PodManager, ToHook, ToScheduler)
from pmgr_helpers import (REPO_ROOT, AsyncHook, FakeClock, FakeScheduler, eventually, free_port,
                          running_pmgr, wait_port)

GROUP = "g"
MS = 1_000_000  # ns
MiB = 1 << 20


# =============================================================================================
# manager.py on simulated time
# =============================================================================================

def welcome(limit: int = 1000, sid: str = "s1", group: str = GROUP, turns: bool = False) -> sm.Welcome:
    return sm.Welcome(group=group, min_util=0.1, max_util=1.0, mem_limit=limit, scheduler_id=sid, turns=turns)


def upstream(actions) -> list:
    return [a.msg for a in actions if isinstance(a, ToScheduler)]


def to_hook(actions, cid=None) -> list:
    return [a for a in actions if isinstance(a, ToHook) and (cid is None or a.client_id == cid)]


def closes(actions) -> list[int]:
    return [a.client_id for a in actions if isinstance(a, CloseHook)]


class Rig:
    """A PodManager that has said hello and got its Welcome, plus helpers to connect hooks."""

    def __init__(self, limit: int = 1000, welcomed: bool = True, turns: bool = False, **kw):
        self.clock = FakeClock()
        self.m = PodManager(GROUP, self.clock, pid=99, **kw)
        assert upstream(self.m.start()) == [sm.Hello(group=GROUP, pid=99, mem_used=0, clients=0)]
        if welcomed:
            assert self.m.on_scheduler(welcome(limit, turns=turns)) == []
            assert self.m.turns == turns

    def hook(self, mem_in_use: int = 0, pid: int = 1) -> int:
        cid = self.m.connect(f"peer{pid}")
        acts = self.m.on_hook(cid, 1, hp.Hello(pid=pid, pod_name=GROUP, mem_in_use=mem_in_use))
        if self.m.mem_limit is not None:
            [ack] = to_hook(acts)
            assert isinstance(ack.msg, hp.HelloAck) and ack.msg.client_id == cid and ack.seq == 1
        return cid

    def grant(self, quota_ms: float, seq: int):
        return self.m.on_scheduler(sm.Grant(group=GROUP, quota_ms=quota_ms, token_seq=seq))


class TestHandshake:
    def test_hello_ack_carries_limit_usage_and_group(self):
        r = Rig(limit=5000)
        r.hook(mem_in_use=700, pid=1)
        cid = r.m.connect("p")
        [ack] = r.m.on_hook(cid, 9, hp.Hello(pid=2, pod_name=""))   # an empty name joins this group
        assert ack.seq == 9
        assert ack.msg == hp.HelloAck(client_id=cid, mem_limit=5000, mem_used=700, group=GROUP)

    def test_group_mismatch_closes_with_the_served_group_named(self):
        r = Rig()
        cid = r.m.connect("p")
        acts = r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name="other"))
        [err] = to_hook(acts)
        assert err.msg.code == hp.ErrorCode.GROUP_MISMATCH and "'g'" in err.msg.message
        assert closes(acts) == [cid]

    def test_device_mismatch_only_when_both_sides_name_a_device(self):
        r = Rig(device_uuid="GPU-aaa")
        cid = r.m.connect("p")
        acts = r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name=GROUP, device_uuid="GPU-bbb"))
        assert to_hook(acts)[0].msg.code == hp.ErrorCode.DEVICE_MISMATCH and closes(acts) == [cid]
        for uuid in ("GPU-aaa", ""):
            cid = r.m.connect("p")
            assert isinstance(r.m.on_hook(cid, 1, hp.Hello(pid=1, device_uuid=uuid))[0].msg, hp.HelloAck)
        r2 = Rig()   # no --device-uuid: any device is served
        cid = r2.m.connect("p")
        assert isinstance(r2.m.on_hook(cid, 1, hp.Hello(pid=1, device_uuid="GPU-x"))[0].msg, hp.HelloAck)

    @pytest.mark.parametrize("first", [hp.TokenRequest(), hp.MemAlloc(bytes=1), hp.MemInfo(),
                                       hp.TokenRelease(token_seq=1)])
    def test_request_before_hello(self, first):
        r = Rig()
        cid = r.m.connect("p")
        acts = r.m.on_hook(cid, 3, first)
        assert to_hook(acts)[0].msg.code == hp.ErrorCode.NOT_HELLO and to_hook(acts)[0].seq == 3
        assert closes(acts) == [cid]

    def test_second_hello_is_a_protocol_error(self):
        r = Rig()
        cid = r.hook()
        acts = r.m.on_hook(cid, 2, hp.Hello(pid=1))
        assert to_hook(acts)[0].msg.code == hp.ErrorCode.PROTOCOL and closes(acts) == [cid]


class TestTokenSharing:
    def test_second_client_is_granted_at_once_with_the_time_left(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        acts = r.m.on_hook(a, 5, hp.TokenRequest(overuse_ns=2 * MS, burst_ns=7 * MS))
        assert to_hook(acts) == []
        assert upstream(acts) == [sm.TokenRequest(group=GROUP, overuse_ms=2.0, burst_ms=7.0)]
        acts = r.grant(100.0, 7)
        assert to_hook(acts) == [ToHook(a, 5, hp.TokenGrant(quota_ns=100 * MS, token_seq=7))]
        r.clock.advance(0.030)
        acts = r.m.on_hook(b, 6, hp.TokenRequest())
        [g] = to_hook(acts)
        assert g.client_id == b and g.msg.token_seq == 7
        assert g.msg.quota_ns == pytest.approx(70 * MS, abs=1000)
        assert upstream(acts) == [] and r.m.holders == {a, b}

    def test_one_upstream_request_per_expiry_with_worst_overuse_and_largest_burst(self):
        r = Rig()
        a, b, c = r.hook(pid=1), r.hook(pid=2), r.hook(pid=3)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(10.0, 1)
        # reports between the two upstream requests: releases count as well as requests
        r.m.on_hook(b, 1, hp.TokenRequest(overuse_ns=1 * MS, burst_ns=9 * MS))
        r.m.on_hook(c, 1, hp.TokenRelease(token_seq=1, overuse_ns=4 * MS, burst_ns=2 * MS))
        r.clock.advance(0.011)      # expired
        sent = []
        for cid, (over, burst) in zip((a, b, c), ((3, 1), (2, 5), (0, 0))):
            acts = r.m.on_hook(cid, 2, hp.TokenRequest(overuse_ns=over * MS, burst_ns=burst * MS))
            assert to_hook(acts) == []
            sent += upstream(acts)
        assert sent == [sm.TokenRequest(group=GROUP, overuse_ms=4.0, burst_ms=9.0)]
        acts = r.grant(20.0, 2)
        assert sorted(h.client_id for h in to_hook(acts)) == [a, b, c]
        assert all(h.seq == 2 and h.msg == hp.TokenGrant(quota_ns=20 * MS, token_seq=2) for h in to_hook(acts))
        # what b and c reported after the upstream request went out is carried by the next one
        r.clock.advance(0.021)
        acts = r.m.on_hook(a, 3, hp.TokenRequest())
        assert upstream(acts) == [sm.TokenRequest(group=GROUP, overuse_ms=2.0, burst_ms=5.0)]
        r.grant(20.0, 3)
        r.clock.advance(0.021)
        assert upstream(r.m.on_hook(a, 4, hp.TokenRequest())) == [sm.TokenRequest(group=GROUP)]

    def test_token_with_under_half_a_millisecond_left_counts_as_expired(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(10.0, 1)
        r.clock.advance(0.0096)
        acts = r.m.on_hook(b, 1, hp.TokenRequest())
        assert to_hook(acts) == [] and len(upstream(acts)) == 1

    def test_early_release_only_when_the_last_holder_releases(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(100.0, 4)
        r.m.on_hook(b, 1, hp.TokenRequest())
        acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=4, overuse_ns=3 * MS))
        assert to_hook(acts) == [ToHook(a, 2, hp.Ack())] and upstream(acts) == []
        r.clock.advance(0.010)
        acts = r.m.on_hook(b, 2, hp.TokenRelease(token_seq=4))
        assert upstream(acts) == [sm.TokenRelease(group=GROUP, token_seq=4, overuse_ms=3.0)]
        # the slot is over: the next request goes upstream, with no overuse counted twice
        acts = r.m.on_hook(a, 3, hp.TokenRequest())
        assert to_hook(acts) == [] and upstream(acts) == [sm.TokenRequest(group=GROUP)]

    def test_release_of_an_old_token_only_contributes_its_overuse(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(10.0, 1)
        r.clock.advance(0.02)
        r.m.on_hook(a, 2, hp.TokenRequest())
        r.grant(10.0, 2)
        acts = r.m.on_hook(b, 1, hp.TokenRelease(token_seq=1, overuse_ns=6 * MS))
        assert to_hook(acts) == [ToHook(b, 1, hp.Ack())] and upstream(acts) == []
        assert r.m.holders == {a}
        r.clock.advance(0.02)
        assert upstream(r.m.on_hook(a, 3, hp.TokenRequest())) == [sm.TokenRequest(group=GROUP, overuse_ms=6.0)]

    def test_release_after_expiry_sends_nothing(self):
        r = Rig()
        a = r.hook()
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(10.0, 1)
        r.clock.advance(0.011)
        acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1, overuse_ns=MS))
        assert upstream(acts) == [] and to_hook(acts) == [ToHook(a, 2, hp.Ack())]

    def test_holder_disconnect_releases_early(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(50.0, 3)
        r.m.on_hook(b, 1, hp.TokenRequest())
        assert upstream(r.m.disconnect(a)) == []
        assert upstream(r.m.disconnect(b)) == [sm.TokenRelease(group=GROUP, token_seq=3)]
        assert r.m.disconnect(b) == []      # idempotent

    def test_waiter_disconnect_cancels_its_wait_and_an_unneeded_grant_goes_back(self):
        r = Rig()
        a = r.hook()
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.disconnect(a)
        assert r.m.waiting == []
        acts = r.grant(50.0, 8)
        assert to_hook(acts) == [] and upstream(acts) == [sm.TokenRelease(group=GROUP, token_seq=8)]

    def test_requests_before_welcome_go_upstream_once_welcomed(self):
        r = Rig(welcomed=False)
        cid = r.m.connect("p")
        r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name=GROUP))
        assert upstream(r.m.on_hook(cid, 2, hp.TokenRequest(burst_ns=4 * MS))) == []
        acts = r.m.on_scheduler(welcome())
        assert upstream(acts) == [sm.TokenRequest(group=GROUP, burst_ms=4.0)]
        assert to_hook(acts)[0].msg.__class__ is hp.HelloAck


def granted(actions) -> dict[int, float]:
    """client -> quota in ms of the TOKEN_GRANTs among the actions."""
    return {a.client_id: a.msg.quota_ns / MS for a in to_hook(actions) if isinstance(a.msg, hp.TokenGrant)}


class TestTurns:
    """ProcessSharing = turns: one process of the group holds the token at a time."""

    def test_one_holder_at_a_time_first_come_first_served(self):
        r = Rig(turns=True)
        a, b, c = r.hook(pid=1), r.hook(pid=2), r.hook(pid=3)
        assert len(upstream(r.m.on_hook(a, 1, hp.TokenRequest()))) == 1
        assert upstream(r.m.on_hook(b, 1, hp.TokenRequest())) == []     # one upstream request serves all
        assert granted(r.grant(50.0, 1)) == {a: 50.0}
        r.clock.advance(0.010)
        acts = r.m.on_hook(c, 1, hp.TokenRequest())
        assert to_hook(acts) == [] and upstream(acts) == []             # the group has its slot: c queues
        # a's turn ends when its slot runs out; it asks again and goes to the back of the line
        r.clock.advance(0.041)
        acts = r.m.on_hook(a, 2, hp.TokenRequest(used_ns=48 * MS))
        assert to_hook(acts) == [] and upstream(acts) == [sm.TokenRequest(group=GROUP, used_ms=48.0)]
        assert granted(r.grant(50.0, 2)) == {b: 50.0}
        r.clock.advance(0.051)
        r.m.on_hook(b, 2, hp.TokenRequest())
        assert granted(r.grant(50.0, 3)) == {c: 50.0}
        r.clock.advance(0.051)
        r.m.on_hook(c, 2, hp.TokenRequest())
        assert granted(r.grant(50.0, 4)) == {a: 50.0}
        assert [cid for cid, _ in r.m.waiting] == [b, c]

    def test_an_early_release_hands_the_rest_to_the_next_and_uses_add_up(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.clock.advance(0.020)
        acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1, used_ns=19 * MS))
        assert to_hook(acts, a) == [ToHook(a, 2, hp.Ack())]
        assert granted(acts) == {b: pytest.approx(30.0, abs=1e-3)} and upstream(acts) == []
        # b is idle too: nobody waits, so the slot goes back, charged with both turns' use
        r.clock.advance(0.010)
        acts = r.m.on_hook(b, 2, hp.TokenRelease(token_seq=1, used_ns=9 * MS))
        assert upstream(acts) == [sm.TokenRelease(group=GROUP, token_seq=1, used_ms=28.0)]

    def test_too_little_left_for_a_switch_goes_upstream_instead(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.grant(10.0, 1)
        r.clock.advance(0.009)      # 1 ms left: less than a turn is worth
        acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))
        assert granted(acts) == {} and upstream(acts) == [sm.TokenRequest(group=GROUP)]
        assert granted(r.grant(10.0, 2)) == {b: 10.0}

    def test_the_holder_asking_again_with_nobody_waiting_keeps_the_rest(self):
        r = Rig(turns=True)
        a = r.hook(pid=1)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.clock.advance(0.010)
        acts = r.m.on_hook(a, 2, hp.TokenRequest())
        assert granted(acts) == {a: pytest.approx(40.0, abs=1e-3)} and upstream(acts) == []

    def test_a_holder_that_dies_hands_over_at_once(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.clock.advance(0.005)
        assert granted(r.m.disconnect(a)) == {b: pytest.approx(45.0, abs=1e-3)}

    def test_a_silent_holder_is_not_waited_for_past_its_deadline(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.grant(20.0, 1)
        r.clock.advance(0.021)      # past the deadline, but within the grace a report may still come
        assert upstream(r.m.tick()) == []
        r.clock.advance(0.010)      # a is stopped: it never reports
        assert sm.TokenRequest(group=GROUP) in upstream(r.m.tick())
        assert granted(r.grant(20.0, 2)) == {b: 20.0}
        # a wakes up and finds its turn over: it queues like everyone else
        acts = r.m.on_hook(a, 2, hp.TokenRequest())
        assert granted(acts) == {} and upstream(acts) == []

    def test_switching_to_together_lets_the_queue_in_and_back(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.clock.advance(0.010)
        acts = r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0, max_util=1, mem_limit=1000, turns=False))
        assert granted(acts) == {b: pytest.approx(40.0, abs=1e-3)} and r.m.holders == {a, b}
        assert r.m.status()["sharing"] == "together"
        r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0, max_util=1, mem_limit=1000, turns=True))
        r.clock.advance(0.041)
        r.m.on_hook(a, 2, hp.TokenRequest())
        r.m.on_hook(b, 2, hp.TokenRequest())
        assert granted(r.grant(50.0, 2)) == {a: 50.0}

    def test_a_repeated_request_keeps_its_place_and_only_the_newest_is_answered(self):
        r = Rig(turns=True)
        a, b, c = r.hook(pid=1), r.hook(pid=2), r.hook(pid=3)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.m.on_hook(c, 1, hp.TokenRequest())
        assert r.m.on_hook(b, 2, hp.TokenRequest()) == []      # b's hook gave up on seq 1 and asked again
        acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))
        assert [(g.client_id, g.seq) for g in to_hook(acts) if isinstance(g.msg, hp.TokenGrant)] == [(b, 2)]

    def test_a_new_scheduler_that_says_together_gets_one_request(self):
        r = Rig(turns=True)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(50.0, 1)
        r.m.on_hook(b, 1, hp.TokenRequest())
        r.m.on_scheduler(sm.HeartbeatAck(scheduler_id="s2"))    # gem-schd restarted: register again
        r.clock.advance(0.1)                                    # a's slot ran out, a said nothing
        acts = r.m.on_scheduler(welcome(sid="s2", turns=False))
        assert [m for m in upstream(acts) if isinstance(m, sm.TokenRequest)] == [sm.TokenRequest(group=GROUP)]

    def test_together_is_the_default(self):
        r = Rig()
        assert r.m.status()["sharing"] == "together"


class TestMemory:
    def test_verdicts_at_the_exact_limit(self):
        r = Rig(limit=1000)
        a, b = r.hook(pid=1), r.hook(pid=2)
        def alloc(cid, n):
            [rep] = r.m.on_hook(cid, 1, hp.MemAlloc(bytes=n))
            return rep.msg
        assert alloc(a, 600) == hp.MemReply(verdict=hp.MemVerdict.OK, used=600, limit=1000)
        assert alloc(b, 401) == hp.MemReply(verdict=hp.MemVerdict.DENIED, used=600, limit=1000)
        assert alloc(b, 400) == hp.MemReply(verdict=hp.MemVerdict.OK, used=1000, limit=1000)
        assert alloc(a, 1).verdict == hp.MemVerdict.DENIED
        assert alloc(a, 0).verdict == hp.MemVerdict.OK
        [info] = r.m.on_hook(b, 2, hp.MemInfo())
        assert info.msg == hp.MemReply(verdict=0, used=1000, limit=1000)

    def test_free_only_ones_own_and_never_below_zero(self):
        r = Rig(limit=1000)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.MemAlloc(bytes=300))
        r.m.on_hook(b, 1, hp.MemAlloc(bytes=200))
        [rep] = r.m.on_hook(b, 2, hp.MemFree(bytes=500))    # b holds only 200
        assert rep.msg.used == 300 and r.m.clients[b].mem == 0 and r.m.clients[a].mem == 300
        [rep] = r.m.on_hook(a, 2, hp.MemFree(bytes=100))
        assert rep.msg == hp.MemReply(verdict=0, used=200, limit=1000)

    def test_hello_credits_existing_memory_and_disconnect_releases_it(self):
        r = Rig(limit=1000)
        a = r.hook(mem_in_use=900)
        b = r.hook()
        assert r.m.on_hook(b, 1, hp.MemAlloc(bytes=101))[0].msg.verdict == hp.MemVerdict.DENIED
        r.m.disconnect(a)
        assert r.m.mem_used == 0
        assert r.m.on_hook(b, 2, hp.MemAlloc(bytes=1000))[0].msg.verdict == hp.MemVerdict.OK

    def test_limit_change_applies_to_the_next_request_without_a_push(self):
        r = Rig(limit=1000)
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.connect("no-hello-yet")
        r.m.on_hook(a, 1, hp.MemAlloc(bytes=10))
        # nothing is pushed (the hooks ask whenever they need the limit)
        assert r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0, max_util=1, mem_limit=4000)) == []
        assert r.m.on_hook(a, 2, hp.MemInfo()) == [ToHook(a, 2, hp.MemReply(verdict=0, used=10, limit=4000))]
        assert r.m.on_hook(b, 2, hp.MemAlloc(bytes=3990))[0].msg.verdict == hp.MemVerdict.OK

    def test_requests_before_the_first_welcome_wait_then_no_scheduler(self):
        r = Rig(welcomed=False)
        cid = r.m.connect("p")
        assert r.m.on_hook(cid, 1, hp.Hello(pid=1)) == []
        assert r.m.on_hook(cid, 2, hp.MemAlloc(bytes=5)) == []
        r.clock.advance(WELCOME_WAIT_S + 0.01)
        acts = to_hook(r.m.tick())
        assert acts[0] == ToHook(cid, 1, hp.HelloAck(client_id=cid, mem_limit=0, mem_used=0, group=GROUP))
        assert acts[1].seq == 2 and acts[1].msg.code == hp.ErrorCode.NO_SCHEDULER
        assert r.m.on_hook(cid, 3, hp.MemInfo()) == []     # still no limit: waits again

    def test_requests_before_the_first_welcome_are_answered_by_it(self):
        r = Rig(welcomed=False)
        cid = r.m.connect("p")
        r.m.on_hook(cid, 1, hp.Hello(pid=1))
        r.m.on_hook(cid, 2, hp.MemAlloc(bytes=5))
        r.clock.advance(1.0)
        acts = to_hook(r.m.on_scheduler(welcome(limit=10)))
        assert [a.seq for a in acts] == [1, 2]
        assert acts[1].msg == hp.MemReply(verdict=0, used=5, limit=10)


class TestSchedulerLink:
    def test_heartbeat_every_second_with_usage_and_clients(self):
        r = Rig()
        a = r.hook()
        r.m.on_hook(a, 1, hp.MemAlloc(bytes=77))
        beats = []
        for _ in range(20):
            r.clock.advance(0.125)      # 2.5 s in steps a float adds exactly
            beats += upstream(r.m.tick())
        assert beats == [sm.Heartbeat(group=GROUP, mem_used=77, clients=1, members=[[1, -1]])] * int(2.5 / HEARTBEAT_S)

    def test_not_registered_re_hellos_and_resends_the_outstanding_request(self):
        r = Rig()
        a = r.hook(mem_in_use=50)
        r.m.on_hook(a, 1, hp.TokenRequest(burst_ns=3 * MS))
        r.clock.advance(5.0)
        acts = r.m.on_scheduler(sm.Error(code=sm.ERR_NOT_REGISTERED, message="who?"))
        assert upstream(acts) == [sm.Hello(group=GROUP, pid=99, mem_used=50, clients=1, members=[[1, -1]])]
        # more not_registered replies in a burst (queued heartbeats) send no more Hellos
        assert upstream(r.m.on_scheduler(sm.Error(code=sm.ERR_NOT_REGISTERED, message="who?"))) == []
        acts = r.m.on_scheduler(welcome(sid="s2"))
        assert upstream(acts) == [sm.TokenRequest(group=GROUP, burst_ms=3.0)]
        assert to_hook(r.grant(10.0, 1))[0].msg.token_seq == 1

    def test_new_scheduler_id_in_heartbeat_ack_re_registers(self):
        r = Rig()
        a = r.hook()
        r.m.on_hook(a, 1, hp.TokenRequest())
        assert r.m.on_scheduler(sm.HeartbeatAck(scheduler_id="s1")) == []
        acts = r.m.on_scheduler(sm.HeartbeatAck(scheduler_id="s2"))
        assert [type(m) for m in upstream(acts)] == [sm.Hello]
        assert upstream(r.m.on_scheduler(welcome(sid="s2"))) == [sm.TokenRequest(group=GROUP)]
        # a repeated Welcome from the same scheduler does not duplicate the request
        assert upstream(r.m.on_scheduler(welcome(sid="s2"))) == []

    def test_failed_send_is_repeated_when_the_link_is_back(self):
        r = Rig()
        a = r.hook()
        [req] = upstream(r.m.on_hook(a, 1, hp.TokenRequest()))
        r.m.upstream_failed(req)
        r.clock.advance(0.05)
        assert req in upstream(r.m.tick())
        r.clock.advance(0.05)
        assert req not in upstream(r.m.tick())

    def test_unknown_group_refuses_waiters_and_newcomers_and_retries(self):
        r = Rig(welcomed=False)
        cid = r.m.connect("p")
        r.m.on_hook(cid, 1, hp.Hello(pid=1))
        r.m.on_hook(cid, 2, hp.TokenRequest())
        acts = r.m.on_scheduler(sm.Error(code=sm.ERR_UNKNOWN_GROUP, group=GROUP, message="no"))
        codes = {a.seq: a.msg.code for a in to_hook(acts)}
        assert codes == {1: hp.ErrorCode.UNKNOWN_GROUP, 2: hp.ErrorCode.UNKNOWN_GROUP}
        assert closes(acts) == [cid]
        assert "resource-config.txt" in to_hook(acts)[0].msg.message
        late = r.m.connect("q")
        acts = r.m.on_hook(late, 1, hp.Hello(pid=2))
        assert to_hook(acts)[0].msg.code == hp.ErrorCode.UNKNOWN_GROUP and closes(acts) == [late]
        hellos = []
        for _ in range(25):
            r.clock.advance(0.1)
            hellos += [m for m in upstream(r.m.tick()) if isinstance(m, sm.Hello)]
        assert len(hellos) == 2
        r.m.on_scheduler(welcome())     # the config gained the group
        ok = r.m.connect("r")
        assert isinstance(r.m.on_hook(ok, 1, hp.Hello(pid=3))[0].msg, hp.HelloAck)

    def test_group_removed_lets_the_token_run_out_and_refuses_requests(self):
        r = Rig()
        a, b = r.hook(pid=1), r.hook(pid=2)
        r.m.on_hook(a, 1, hp.TokenRequest())
        r.grant(100.0, 1)
        r.clock.advance(0.2)
        r.m.on_hook(b, 1, hp.TokenRequest())     # waits for the next grant
        acts = r.m.on_scheduler(sm.GroupRemoved(group=GROUP))
        assert [(x.client_id, x.seq, x.msg.code) for x in to_hook(acts)] == [(b, 1, hp.ErrorCode.UNKNOWN_GROUP)]
        assert closes(acts) == []
        acts = r.m.on_hook(a, 2, hp.TokenRequest())
        assert to_hook(acts)[0].msg.code == hp.ErrorCode.UNKNOWN_GROUP and upstream(acts) == []
        # memory accounting goes on with the last limit
        assert r.m.on_hook(a, 3, hp.MemAlloc(bytes=10))[0].msg.verdict == hp.MemVerdict.OK

    def test_messages_for_another_group_are_ignored(self):
        r = Rig()
        a = r.hook()
        r.m.on_hook(a, 1, hp.TokenRequest())
        assert r.m.on_scheduler(sm.Grant(group="other", quota_ms=10, token_seq=1)) == []
        assert r.m.waiting == [(a, 1)]

    def test_silence_is_logged_once(self, caplog):
        r = Rig()
        caplog.set_level(logging.WARNING, "gemini.podmgr")
        for _ in range(100):
            r.clock.advance(0.1)
            r.m.tick()
        assert sum("has not answered" in rec.message for rec in caplog.records) == 1
        r.m.on_scheduler(sm.HeartbeatAck(scheduler_id="s1"))
        assert sum("answers again" in rec.message for rec in caplog.records) == 1


# =============================================================================================
# the daemon on real sockets
# =============================================================================================

def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_two_connections_share_one_token_and_one_upstream_request_per_expiry():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            a, b = await AsyncHook.connect(srv.port), await AsyncHook.connect(srv.port)
            await a.hello(GROUP, pid=1)
            await b.hello(GROUP, pid=2)
            fa = a.request(hp.TokenRequest(overuse_ns=1 * MS, burst_ns=2 * MS))
            req = await sched.expect(sm.TokenRequest)
            assert (req.overuse_ms, req.burst_ms) == (1.0, 2.0)
            await sched.grant(GROUP, 200.0)
            ga = await fa
            assert ga.quota_ns == 200 * MS
            await asyncio.sleep(0.05)
            gb = await b.call(hp.TokenRequest(overuse_ns=5 * MS, burst_ns=1 * MS))
            assert gb.token_seq == ga.token_seq
            assert 100 * MS < gb.quota_ns < 155 * MS
            assert sched.count(sm.TokenRequest) == 1
            await asyncio.sleep(0.16)           # expired
            both = [a.request(hp.TokenRequest(overuse_ns=3 * MS, burst_ns=9 * MS)), b.request(hp.TokenRequest())]
            req = await sched.expect(sm.TokenRequest)
            assert (req.overuse_ms, req.burst_ms) == (5.0, 9.0)
            await asyncio.sleep(0.1)
            assert sched.count(sm.TokenRequest) == 2
            seq = await sched.grant(GROUP, 50.0)
            grants = await asyncio.gather(*both)
            assert [g.token_seq for g in grants] == [seq, seq]
            await a.close()
            await b.close()
    run(body())


def test_waiting_token_request_does_not_hold_up_memory_requests_on_the_same_connection():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            h = await AsyncHook.greeted(srv.port, GROUP)
            token = h.request(hp.TokenRequest())
            await sched.expect(sm.TokenRequest)
            assert (await h.call(hp.MemAlloc(bytes=100), timeout=1.0)).verdict == hp.MemVerdict.OK
            assert (await h.call(hp.MemInfo(), timeout=1.0)).used == 100
            assert not token.done()
            await sched.grant(GROUP, 10.0)
            assert (await asyncio.wait_for(token, 2)).quota_ns == 10 * MS
            await h.close()
    run(body())


def test_closed_connection_holding_the_token_releases_it_and_its_memory_within_a_second():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            h = await AsyncHook.greeted(srv.port, GROUP)
            assert (await h.call(hp.MemAlloc(bytes=700))).verdict == hp.MemVerdict.OK
            t = h.request(hp.TokenRequest())
            await sched.expect(sm.TokenRequest)
            seq = await sched.grant(GROUP, 5000.0)
            await t
            start = time.monotonic()
            await h.close()
            rel = await sched.expect(sm.TokenRelease, timeout=1.0)
            assert rel.token_seq == seq and time.monotonic() - start < 1.0
            await eventually(lambda: srv.manager.mem_used == 0, 1.0, "memory released")
            other = await AsyncHook.greeted(srv.port, GROUP)
            assert (await other.call(hp.MemAlloc(bytes=1000))).verdict == hp.MemVerdict.OK
            await other.close()
    run(body())


KILLED_HOOK = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from pmgr_helpers import BlockingHook
    from gemini.wire import hook as hp
    h = BlockingHook(int(sys.argv[1]))
    h.call(hp.Hello(pid=0, pod_name="g"))
    assert h.call(hp.MemAlloc(bytes=600)).verdict == 0
    grant = h.call(hp.TokenRequest())
    print("holding", grant.token_seq, flush=True)
    time.sleep(60)
""")


def test_sigkilled_process_holding_the_token_releases_it_and_its_memory_within_a_second():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", KILLED_HOOK, str(srv.port), str(REPO_ROOT), str(REPO_ROOT / "tests"),
                stdout=asyncio.subprocess.PIPE)
            try:
                await sched.expect(sm.TokenRequest, timeout=10)
                seq = await sched.grant(GROUP, 5000.0)
                line = await asyncio.wait_for(proc.stdout.readline(), 5)
                assert line.split() == [b"holding", str(seq).encode()]
                assert srv.manager.mem_used == 600
                start = time.monotonic()
                proc.kill()
                rel = await sched.expect(sm.TokenRelease, timeout=1.0)
                assert rel.token_seq == seq
                await eventually(lambda: srv.manager.mem_used == 0, 1.0 - (time.monotonic() - start))
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
    run(body())


def test_exact_memory_limit_under_concurrent_requests_from_many_connections():
    limit, each, conns, per = 10_000, 7, 8, 300     # 8*300*7 = 16800 bytes asked for 10000 available
    async def body():
        async with running_pmgr(GROUP, limit) as (srv, sched):
            hooks = [await AsyncHook.connect(srv.port) for _ in range(conns)]
            await asyncio.gather(*(h.hello(GROUP, pid=i) for i, h in enumerate(hooks)))
            futs = [[h.request(hp.MemAlloc(bytes=each)) for _ in range(per)] for h in hooks]
            replies = [await asyncio.gather(*f) for f in futs]
            granted = [sum(each for r in rs if r.verdict == hp.MemVerdict.OK) for rs in replies]
            assert sum(granted) == limit - limit % each
            assert all(r.used <= limit for rs in replies for r in rs)
            assert (await hooks[0].call(hp.MemInfo())).used == sum(granted)
            # frees: a hook can only give back its own bytes
            rich = max(range(conns), key=lambda i: granted[i])
            poor = min(range(conns), key=lambda i: granted[i])
            rep = await hooks[poor].call(hp.MemFree(bytes=granted[poor] + 10_000))
            assert rep.used == sum(granted) - granted[poor]
            await hooks[rich].call(hp.MemFree(bytes=granted[rich]))
            assert srv.manager.mem_used == sum(granted) - granted[poor] - granted[rich]
            # a live limit change is what every hook's next request sees
            await sched.send(GROUP, sm.ConfigUpdate(group=GROUP, min_util=0, max_util=1, mem_limit=2 * limit))
            await eventually(lambda: srv.manager.mem_limit == 2 * limit, what="ConfigUpdate handled")
            infos = await asyncio.gather(*(h.call(hp.MemInfo()) for h in hooks))
            assert all(i == hp.MemReply(verdict=0, used=srv.manager.mem_used, limit=2 * limit) for i in infos)
            assert all(h.pushes.empty() for h in hooks)
            for h in hooks:
                await h.close()
    run(body())


def _header(magic=hp.MAGIC, version=hp.VERSION, mtype=hp.MsgType.HELLO, size=hp.MSG_SIZE, seq=5) -> bytes:
    return struct.pack("<IHHII", magic, version, mtype, size, seq)


BAD_FRAMES = {
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 300, hp.ErrorCode.PROTOCOL),
    "truncated": (hp.encode(hp.Hello(pid=1, pod_name=GROUP), 5)[:100], hp.ErrorCode.PROTOCOL),
    "oversized": (_header(size=1 << 30) + b"\0" * (hp.MSG_SIZE - hp.HEADER_SIZE), hp.ErrorCode.PROTOCOL),
    "wrong-version": (_header(version=hp.VERSION + 1) + b"\0" * 240, hp.ErrorCode.VERSION),
    "unknown-type": (_header(mtype=99) + b"\0" * 240, hp.ErrorCode.PROTOCOL),
    "reply-type": (hp.encode(hp.Ack(), 5), hp.ErrorCode.PROTOCOL),
    "before-hello": (hp.encode(hp.MemAlloc(bytes=1), 5), hp.ErrorCode.NOT_HELLO),
    "short-header": (b"\x47\x45", hp.ErrorCode.PROTOCOL),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_bad_frames_close_only_that_connection(name):
    data, code = BAD_FRAMES[name]
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            good = await AsyncHook.greeted(srv.port, GROUP)
            await good.call(hp.MemAlloc(bytes=10))
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(data)
            if name in ("truncated", "short-header"):
                writer.write_eof()
            reply = await asyncio.wait_for(reader.read(), 3)    # everything until the server closes
            assert len(reply) == hp.MSG_SIZE
            seq, err = hp.decode(reply, hp.PMGR_TO_HOOK)
            assert isinstance(err, hp.Error) and err.code == code and err.message
            writer.close()
            # the daemon goes on serving the other connection and new ones
            assert (await good.call(hp.MemInfo())).used == 10
            again = await AsyncHook.connect(srv.port)
            assert isinstance(await again.hello(GROUP), hp.HelloAck)
            await again.close()
            await good.close()
    run(body())


def test_bad_frame_after_hello_releases_that_connections_memory():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            h = await AsyncHook.greeted(srv.port, GROUP)
            await h.call(hp.MemAlloc(bytes=400))
            h.send_raw(_header(magic=0xDEADBEEF) + b"\0" * 240)
            await h.wait_closed()
            await eventually(lambda: srv.manager.mem_used == 0, 1.0)
    run(body())


def test_garbage_from_the_scheduler_is_logged_and_survived(caplog):
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            ident = sched.registered[GROUP]
            for junk in (b"not json", b"[]", b'{"type":"grant"}', b'{"type":"hello","group":"g","pid":1}', b""):
                await sched.sock.send_multipart([ident, junk])
            h = await AsyncHook.greeted(srv.port, GROUP)
            t = h.request(hp.TokenRequest())
            await sched.expect(sm.TokenRequest)
            await sched.grant(GROUP, 10)
            assert (await asyncio.wait_for(t, 2)).quota_ns == 10 * MS
            await h.close()
    with caplog.at_level(logging.WARNING, "gemini.podmgr"):
        run(body())
    assert sum("bad message from gem-schd" in r.message for r in caplog.records) == 5


def test_scheduler_restart_re_hello_and_re_sent_request():
    async def body():
        async with running_pmgr(GROUP, 1000) as (srv, sched):
            h = await AsyncHook.greeted(srv.port, GROUP)
            await h.call(hp.MemAlloc(bytes=321))
            t = h.request(hp.TokenRequest(burst_ns=4 * MS))
            await sched.expect(sm.TokenRequest)
            port = sched.port
            await sched.close()                         # gem-schd dies with our request queued
            await asyncio.sleep(0.3)
            new = FakeScheduler({GROUP: 1000}, port=port, scheduler_id="sched-2")
            try:
                hello = await new.expect(sm.Hello, timeout=5)
                assert hello.mem_used == 321 and hello.clients == 1
                req = await new.expect(sm.TokenRequest, timeout=2)
                assert req.burst_ms == 4.0
                assert new.kinds()[0] in ("Heartbeat", "Hello")
                seq = await new.grant(GROUP, 25.0)
                g = await asyncio.wait_for(t, 2)
                assert (g.token_seq, g.quota_ns) == (seq, 25 * MS)
                assert srv.manager.scheduler_id == "sched-2"
            finally:
                await h.close()
                await new.close()
    run(body())


def test_token_requests_wait_while_the_scheduler_is_away():
    async def body():
        port = free_port()
        async with running_pmgr(GROUP, start_scheduler=False, scheduler_port=port) as (srv, _):
            h = await AsyncHook.connect(srv.port)
            hello = h.request(hp.Hello(pid=1, pod_name=GROUP))
            ack = await asyncio.wait_for(hello, WELCOME_WAIT_S + 2)   # no scheduler: acked without a limit
            assert ack.mem_limit == 0
            mem = await h.call(hp.MemAlloc(bytes=1), timeout=WELCOME_WAIT_S + 2)
            assert isinstance(mem, hp.Error) and mem.code == hp.ErrorCode.NO_SCHEDULER
            t = h.request(hp.TokenRequest())
            await asyncio.sleep(0.3)
            assert not t.done()
            sched = FakeScheduler({GROUP: 500}, port=port)
            try:
                await sched.expect(sm.TokenRequest, timeout=3)
                await sched.grant(GROUP, 10)
                assert (await asyncio.wait_for(t, 2)).quota_ns == 10 * MS
                assert (await h.call(hp.MemAlloc(bytes=1))).limit == 500
            finally:
                await h.close()
                await sched.close()
    run(body())


def test_unknown_group_is_refused_with_a_clear_error():
    async def body():
        async with running_pmgr(GROUP, groups={"other": 1}) as (srv, sched):
            h = await AsyncHook.connect(srv.port)
            err = await h.hello(GROUP)
            assert err.code == hp.ErrorCode.UNKNOWN_GROUP and "resource-config.txt" in err.message
            await h.wait_closed()
    run(body())


# --- the command ---------------------------------------------------------------------------------

def _pmgr_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemini.podmgr.cli", *args]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("POD_NAME", "POD_MANAGER_IP", "POD_MANAGER_PORT", "SCHEDULER_IP", "SCHEDULER_PORT"):
        env.pop(name, None)
        env.pop("GEMINI_" + name, None)
    return env


def test_cli_busy_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run(_pmgr_cmd("--name", GROUP, "--port", str(port), "--scheduler-port", str(free_port())),
                             env=_env(), capture_output=True, text=True, timeout=20)
    assert res.returncode == 2
    assert f"127.0.0.1:{port}" in res.stderr and "already in use" in res.stderr


@pytest.mark.parametrize("var,value,flag", [("POD_MANAGER_PORT", "abc", "--port"),
                                            ("GEMINI_POD_MANAGER_PORT", "65536", "--port"),
                                            ("SCHEDULER_PORT", "0", "--scheduler-port")])
def test_cli_a_bad_port_variable_is_named(var, value, flag):
    res = subprocess.run(_pmgr_cmd("--name", GROUP), env=dict(_env(), **{var: value}), capture_output=True,
                         text=True, timeout=20)
    assert res.returncode == 2
    assert f"'{flag}'" in res.stderr and f"{var}={value!r} is not usable" in res.stderr, res.stderr


@pytest.mark.parametrize("how", ["env-sigterm", "flags-sigint-wildcard"])
def test_cli_runs_until_signalled(how):
    port = free_port()
    env = _env()
    if how == "env-sigterm":    # Gemini's variables are the defaults of the flags
        env.update(POD_NAME=GROUP, POD_MANAGER_PORT=str(port), SCHEDULER_PORT=str(free_port()))
        args, sig = ["-v"], signal.SIGTERM
    else:
        args = ["--name", GROUP, "--ip", "0.0.0.0", "--port", str(port), "--scheduler-port", str(free_port())]
        sig = signal.SIGINT
    proc = subprocess.Popen(_pmgr_cmd(*args), env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_port(port, proc)
        proc.send_signal(sig)
        assert proc.wait(10) == 0
        err = proc.stderr.read()
        if how == "env-sigterm":
            assert f"hooks on 127.0.0.1:{port}" in err
        else:
            assert "not a loopback address" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- latency class: claims -----------------------------------------------------------------------------------

class FakeBoard:
    def __init__(self):
        self.claims: dict[int, int] = {}
        self.waiters: dict[int, int] = {}
        self.latency_groups = 1

    def claim(self, slot, until_ns):
        self.claims[slot] = until_ns

    def unclaim(self, slot):
        self.claims.pop(slot, None)

    def set_waiters(self, slot, n):
        self.waiters[slot] = n


def latency_rig():
    board = FakeBoard()
    r = Rig(welcomed=False, board_open=lambda path: board)
    w = sm.Welcome(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                   sched_class="latency", board_path="/dev/shm/b", board_slot=3)
    r.m.on_scheduler(w)
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    return r, board


def test_a_latency_hook_is_granted_a_claim_at_once_and_the_board_says_so():
    r, board = latency_rig()
    a, b = r.hook(pid=1), r.hook(pid=2)
    [g] = to_hook(r.m.on_hook(a, 5, hp.TokenRequest()))
    assert upstream([]) == []
    assert g.msg.flags & hp.GRANT_CLAIM and abs(g.msg.quota_ns - 20 * MS) <= 1
    assert abs(board.claims[3] - (r.clock.now + 0.020) * 1e9) <= 1
    r.clock.advance(0.002)
    [g2] = to_hook(r.m.on_hook(b, 6, hp.TokenRequest()))      # joins the same claim
    assert g2.msg.token_seq == g.msg.token_seq
    r.clock.advance(0.001)
    acts = r.m.on_hook(a, 7, hp.TokenRelease(token_seq=g.msg.token_seq, used_ns=1 * MS))
    assert upstream(acts) == [] and 3 in board.claims          # b still holds it
    acts = r.m.on_hook(b, 8, hp.TokenRelease(token_seq=g.msg.token_seq, used_ns=2 * MS))
    [report] = upstream(acts)
    assert isinstance(report, sm.ClaimReport) and report.used_ms == pytest.approx(3.0)
    assert report.end_s - report.start_s == pytest.approx(0.003) and 3 not in board.claims


def test_an_early_claim_reports_how_long_its_launches_went_ahead():
    """A latency hook that launched before asking (an early claim) says when. The claim's span stays
    what the board showed (only that paused -- and credits -- the others); the time ahead is reported with it, to
    be charged to the group: at most 5 ms, and never reaching into the claim that ended before it."""
    r, board = latency_rig()
    a = r.hook(pid=1)
    def launched(ms_ago: float) -> int:
        return int((r.clock.now - ms_ago / 1000.0) * 1e9)

    [g] = to_hook(r.m.on_hook(a, 5, hp.TokenRequest(launched_ns=launched(0.4))))
    r.clock.advance(0.001)
    [first] = upstream(r.m.on_hook(a, 6, hp.TokenRelease(token_seq=g.msg.token_seq, used_ns=int(1.3 * MS))))
    assert first.end_s - first.start_s == pytest.approx(0.001)
    assert first.ahead_ms == pytest.approx(0.4) and first.used_ms == pytest.approx(1.3)    # used: up to span + ahead
    r.clock.advance(0.0001)
    [g] = to_hook(r.m.on_hook(a, 7, hp.TokenRequest(launched_ns=launched(0.5))))  # launched before the last ended
    r.clock.advance(0.001)
    [second] = upstream(r.m.on_hook(a, 8, hp.TokenRelease(token_seq=g.msg.token_seq)))
    assert second.ahead_ms == pytest.approx(0.1)
    r.clock.advance(1.0)
    [g] = to_hook(r.m.on_hook(a, 9, hp.TokenRequest(launched_ns=launched(500))))  # not believed beyond 5 ms
    [third] = upstream(r.m.on_hook(a, 10, hp.TokenRelease(token_seq=g.msg.token_seq)))
    assert third.ahead_ms == pytest.approx(5.0)


def test_a_claim_ends_when_its_holder_dies_or_at_its_end():
    r, board = latency_rig()
    a = r.hook(pid=1)
    r.m.on_hook(a, 5, hp.TokenRequest())
    r.clock.advance(0.001)
    [report] = upstream(r.m.disconnect(a))
    assert isinstance(report, sm.ClaimReport) and 3 not in board.claims
    b = r.hook(pid=2)
    r.m.on_hook(b, 6, hp.TokenRequest())
    r.clock.advance(0.025)                                      # a stopped holder: the claim runs out
    reports = [m for m in upstream(r.m.tick()) if isinstance(m, sm.ClaimReport)]
    assert len(reports) == 1 and reports[0].end_s - reports[0].start_s == pytest.approx(0.020)
    assert 3 not in board.claims


def test_without_the_right_a_latency_group_asks_gem_schd_like_any_other():
    r, board = latency_rig()
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=False, max_claim_ms=20.0))
    a = r.hook(pid=1)
    acts = r.m.on_hook(a, 5, hp.TokenRequest())
    assert to_hook(acts) == [] and upstream(acts) == [sm.TokenRequest(group=GROUP)]
    assert board.claims == {}


@pytest.mark.parametrize("max_util, latency_groups, neighbours, flags", [
    (1.0, 0, 0, 0),                                     # alone on the GPU: nothing to keep short
    (0.5, 0, 0, hp.GRANT_BOUND),                        # a cap: the queue ends with the slot
    (1.0, 0, 1, hp.GRANT_BOUND),                        # another group: its slot must not share ours
    (1.0, 1, 1, hp.GRANT_BOUND | hp.GRANT_TIGHT),       # a claim may come at any moment
    (0.5, 2, 2, hp.GRANT_BOUND | hp.GRANT_TIGHT),
])
@pytest.mark.parametrize("with_board", [True, False])
def test_grant_flags_say_how_short_the_hooks_queue_must_be(max_util, latency_groups, neighbours, flags, with_board):
    """An uncapped group beside another: its queue ran on into the other's slots (on an H200 a deep-queued group
    capped at 0.1 beside an uncapped one got 0.066 of the GPU); bounded, its slot's end takes effect. gem-schd
    says how many other groups the GPU has (Welcome), with or without a board (claims need one)."""
    if not with_board and latency_groups:
        return
    board = FakeBoard()
    board.latency_groups = latency_groups
    r = Rig(welcomed=False, board_open=lambda path: board)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=max_util, mem_limit=1000, scheduler_id="s1",
                                board_path="/dev/shm/b" if with_board else "", board_slot=1 if with_board else -1,
                                neighbours=neighbours))
    a = r.hook(pid=1)
    r.m.on_hook(a, 5, hp.TokenRequest())
    [g] = to_hook(r.grant(50.0, 7))
    assert g.msg.flags == flags


def test_a_reload_that_adds_a_neighbour_bounds_an_uncapped_groups_next_grant():
    """ConfigUpdate carries the new count: alone, nothing is bounded; once a second group is configured, the next
    grant is (and again not once it is gone)."""
    r = Rig(welcomed=False)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000, scheduler_id="s1"))
    a = r.hook(pid=1)
    flags = []
    for seq, neighbours in ((7, None), (8, 1), (9, 0)):
        if neighbours is not None:
            r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000,
                                             neighbours=neighbours))
        r.m.on_hook(a, seq, hp.TokenRequest())
        [g] = to_hook(r.grant(50.0, seq))
        flags.append(g.msg.flags)
        r.m.on_hook(a, seq, hp.TokenRelease(token_seq=seq))
    assert flags == [0, hp.GRANT_BOUND, 0], flags


# --- after review: continued slots, claims that run out, residency reports, class changes ---------------------

def test_a_turn_holder_that_did_not_take_the_continuation_up_still_passes_the_turn_on():
    """Turns: b waits, so a's hook does not take gem-schd's continuation up (the board shows a waiter) and gives
    back the seq it was granted. The pod manager had moved its token to the continuation's seq and ignored that
    release: a stayed a holder, and b waited while gem-schd continued the slot again and again."""
    r = Rig(turns=True)
    a, b = r.hook(pid=1), r.hook(pid=2)
    r.m.on_hook(a, 1, hp.TokenRequest())
    assert granted(r.grant(50.0, 1)) == {a: 50.0}
    r.clock.advance(0.010)
    assert granted(r.m.on_hook(b, 1, hp.TokenRequest())) == {}
    r.clock.advance(0.038)
    assert r.m.on_scheduler(sm.Grant(group=GROUP, quota_ms=50.0, token_seq=2, continuation=True, prev_seq=1)) == []
    r.clock.advance(0.002)
    assert granted(r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))) == {b: pytest.approx(50.0)}


def test_a_latency_hook_that_never_takes_continuations_gives_the_continued_slot_back():
    """A latency group without the right to claim gets slots; its hooks never take a continuation up, so an idle
    one gives back the seq it was granted. That release must give the continued slot back to gem-schd (before:
    ignored, and the GPU sat idle for the rest of the slot)."""
    r, board = latency_rig()
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=False, max_claim_ms=20.0))
    a = r.hook(pid=1)
    r.m.on_hook(a, 1, hp.TokenRequest())
    r.grant(50.0, 1)
    r.clock.advance(0.048)
    r.m.on_scheduler(sm.Grant(group=GROUP, quota_ms=50.0, token_seq=2, continuation=True, prev_seq=1))
    r.clock.advance(0.003)
    [release] = [m for m in upstream(r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))) if isinstance(m, sm.TokenRelease)]
    assert release.token_seq == 2


def test_a_fresh_grant_forgets_the_slot_given_back_before():
    """A restarted gem-schd numbers its slots from 1 again: a fresh slot that happens to carry the seq the group
    last gave back early must still be continued."""
    r = Rig()
    a = r.hook(pid=1)
    r.m.on_hook(a, 1, hp.TokenRequest())
    r.grant(50.0, 1)
    r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))             # given back early
    r.m.on_hook(a, 3, hp.TokenRequest())
    assert granted(r.grant(50.0, 1)) == {a: 50.0}                 # the new gem-schd's first slot
    r.clock.advance(0.048)
    r.m.on_scheduler(sm.Grant(group=GROUP, quota_ms=50.0, token_seq=2, continuation=True, prev_seq=1))
    assert r.m.token.token_seq == 2 and r.m.token.left(r.clock.now) == pytest.approx(0.052)


def test_a_claim_that_runs_out_while_a_holder_is_busy_is_charged_whole():
    """a gives the claim back after 1 ms with 0.5 ms measured; b is still busy when the claim runs out, and its
    measure comes only with its next request, where no claim takes it. The claim is reported as not measured
    (used 0: gem-schd charges the whole span). Before: reported used 0.5 ms, charged a quarter of the span for
    about 20 ms of GPU time, and an honest group's claim budget went four times as far."""
    r, board = latency_rig()
    a, b = r.hook(pid=1), r.hook(pid=2)
    [ga] = to_hook(r.m.on_hook(a, 1, hp.TokenRequest()))
    to_hook(r.m.on_hook(b, 1, hp.TokenRequest()))
    r.clock.advance(0.001)
    assert upstream(r.m.on_hook(a, 2, hp.TokenRelease(token_seq=ga.msg.token_seq, used_ns=MS // 2))) == []
    r.clock.advance(0.0195)
    [report] = [m for m in upstream(r.m.on_hook(b, 2, hp.TokenRequest(used_ns=19 * MS)))
                if isinstance(m, sm.ClaimReport)]
    assert (report.end_s - report.start_s) * 1000 == pytest.approx(20.0) and report.used_ms == 0.0


def unified_rig():
    board = FakeBoard()
    r = Rig(welcomed=False, board_open=lambda path: board)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                                memory_mode="unified", board_path="/dev/shm/b", board_slot=2))
    return r


def test_a_residency_report_is_bounded_by_the_memory_the_client_holds():
    """A hook that holds 400 bytes says it manages 2**62 (resident as much): gem-schd was told the group's size
    from it (it never fit, and the others were evicted for it), and an eviction's give-up time grew to a century."""
    r = unified_rig()
    a = r.hook(pid=1)
    r.m.on_hook(a, 2, hp.MemAlloc(bytes=400, kind=hp.MemKind.MANAGED))
    r.m.on_hook(a, 3, hp.Residency(managed_bytes=2**62, resident_bytes=2**62, direction=hp.RESIDENCY_TO_DEVICE))
    assert r.m.residency.managed_bytes == 400 and r.m.residency.resident_bytes == 400
    r.clock.advance(1.0)
    [hb] = [m for m in upstream(r.m.tick()) if isinstance(m, sm.Heartbeat)]
    assert hb.managed == 400


def test_a_device_groups_residency_reports_are_ignored():
    r = Rig()
    a = r.hook(pid=1)
    [ack] = to_hook(r.m.on_hook(a, 2, hp.Residency(managed_bytes=500, direction=hp.RESIDENCY_TO_DEVICE)))
    assert isinstance(ack.msg, hp.Ack) and r.m.residency.managed_bytes == 0


def test_a_process_that_joined_as_batch_is_not_granted_claims_after_the_group_turns_latency():
    """Its HELLO_ACK said batch, so its hook pauses on the board's claim word, its own group's claims included: a
    claim granted to it stopped its own next launch until the claim ended. It asks gem-schd like a batch hook
    until it restarts (README: processes keep the class they connected with)."""
    board = FakeBoard()
    r = Rig(welcomed=False, board_open=lambda path: board)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                                sched_class="batch", board_path="/dev/shm/b", board_slot=3))
    a = r.hook(pid=1)
    r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, sched_class="latency"))
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    acts = r.m.on_hook(a, 2, hp.TokenRequest())
    assert to_hook(acts) == [] and upstream(acts) == [sm.TokenRequest(group=GROUP)] and board.claims == {}
    b = r.hook(pid=2)                                             # a process that joins now is latency class
    [g] = to_hook(r.m.on_hook(b, 2, hp.TokenRequest()))
    assert g.msg.flags & hp.GRANT_CLAIM


def test_a_board_path_too_long_for_the_hooks_is_refused_and_the_group_runs_without_it(tmp_path, caplog):
    """gem-schd's --board (or k8s --board-root) longer than HELLO_ACK's 127-byte field: the page could be created and
    mapped, but no hook could be told of it -- every HELLO_ACK failed to encode and every process was locked
    out. Now the page is refused where it is made or mapped, with the reason, and the group runs without it."""
    from gemini.board import Board, BoardError
    long_path = tmp_path / ("d" * 70) / ("e" * 70) / "board"
    long_path.parent.mkdir(parents=True)
    with pytest.raises(BoardError, match="bytes; hooks are told paths of at most 127"):
        Board.create(long_path)
    with pytest.raises(BoardError, match="hooks are told paths"):
        Board.open(long_path)
    r = Rig(welcomed=False, board_open=Board.open)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                                sched_class="latency", board_path=str(long_path), board_slot=0))
    assert r.m.board is None and "hooks are told paths" in caplog.text
    cid = r.m.connect("p")
    [ack] = to_hook(r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name=GROUP)))
    assert ack.msg.board_path == "" and ack.msg.board_slot == -1
    hp.encode(ack.msg, ack.seq)                                   # it fits its frame


def test_a_new_scheduler_moves_the_pod_manager_to_its_board_and_the_hooks_are_told_where():
    """gem-schd restarts: its welcome names its new page (here under the same name, as `--board PATH` gives). The
    pod manager maps it afresh, marks its line on the old page `moved` (reaching hooks that get no grant), flags
    its hooks' next grant (GRANT_BOARD) and answers their BOARD_QUERY with the new page. The same gem-schd's
    welcome again changes nothing; a line moved by the same gem-schd is flagged but not marked (that page is live,
    and the old line may be another group's now)."""
    pages: list[tuple[str, "MovableBoard"]] = []

    class MovableBoard(FakeBoard):
        def __init__(self):
            super().__init__()
            self.moved: set[int] = set()
            self.closed = False

        def mark_moved(self, slot):
            self.moved.add(slot)

        def close(self):
            self.closed = True

    def board_open(path):
        pages.append((path, MovableBoard()))
        return pages[-1][1]

    r = Rig(welcomed=False, board_open=board_open)

    def welcome_from(sid: str, slot: int) -> None:
        r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000, scheduler_id=sid,
                                    board_path="/dev/shm/b", board_slot=slot))

    seqs = iter(range(1, 100))

    def granted_flags(cid: int) -> int:
        seq = next(seqs)
        r.m.on_hook(cid, 100 + seq, hp.TokenRequest())
        [g] = to_hook(r.grant(20.0, seq), cid)
        r.m.on_hook(cid, 200 + seq, hp.TokenRelease(token_seq=g.msg.token_seq))
        return g.msg.flags

    welcome_from("s1", 2)
    cid = r.hook()
    assert not granted_flags(cid) & hp.GRANT_BOARD
    welcome_from("s1", 2)
    assert len(pages) == 1 and not pages[0][1].moved
    assert not granted_flags(cid) & hp.GRANT_BOARD
    welcome_from("s2", 2)       # the same name and line, but a new gem-schd: a new file
    assert len(pages) == 2 and pages[0][1].moved == {2} and pages[0][1].closed and not pages[1][1].moved
    assert granted_flags(cid) & hp.GRANT_BOARD and granted_flags(cid) & hp.GRANT_BOARD      # until it asks
    welcome_from("s2", 5)       # the same gem-schd gives the group another line (a reload)
    assert len(pages) == 3 and not pages[1][1].moved
    [info] = to_hook(r.m.on_hook(cid, 7, hp.BoardQuery()))
    assert info.seq == 7 and info.msg == hp.BoardInfo(board_slot=5, board_path="/dev/shm/b")
    hp.encode(info.msg, info.seq)
    assert not granted_flags(cid) & hp.GRANT_BOARD      # told
    # a new gem-schd without a board: the hooks are told there is none
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000, scheduler_id="s3",
                                board_path="", board_slot=-1))
    assert pages[2][1].moved == {5}
    assert granted_flags(cid) & hp.GRANT_BOARD
    [info] = to_hook(r.m.on_hook(cid, 8, hp.BoardQuery()))
    assert info.msg == hp.BoardInfo(board_slot=-1, board_path="")


def test_a_hook_acked_before_the_board_was_mapped_is_told_at_its_first_grant():
    """A pod manager that restarted while gem-schd was away answers a hook's HELLO after WELCOME_WAIT_S with no
    board (it has none yet). When gem-schd's welcome then names one, that hook's grants are flagged
    (GRANT_BOARD) until it asks: it would otherwise never pause for claims or see an eviction request."""
    r = Rig(welcomed=False, board_open=lambda path: FakeBoard())
    cid = r.m.connect("p")
    assert r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name=GROUP)) == []
    r.clock.advance(WELCOME_WAIT_S + 0.01)
    [ack] = to_hook(r.m.tick())
    assert ack.msg.board_slot == -1 and ack.msg.board_path == ""
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                                board_path="/dev/shm/b", board_slot=4))
    r.m.on_hook(cid, 2, hp.TokenRequest())
    [g] = to_hook(r.grant(20.0, 1), cid)
    assert g.msg.flags & hp.GRANT_BOARD
    [info] = to_hook(r.m.on_hook(cid, 3, hp.BoardQuery()))
    assert info.msg == hp.BoardInfo(board_slot=4, board_path="/dev/shm/b")
    r.m.on_hook(cid, 4, hp.TokenRelease(token_seq=g.msg.token_seq))
    r.m.on_hook(cid, 5, hp.TokenRequest())
    [g] = to_hook(r.grant(20.0, 2), cid)
    assert not g.msg.flags & hp.GRANT_BOARD


@pytest.mark.parametrize("welcome_first", [True, False], ids=["welcomed", "before-the-welcome"])
def test_a_rejoined_process_memory_counts_as_managed_in_a_unified_group(welcome_first):
    """A restarted pod manager of a unified group hears a process rejoin holding 150 MiB (its HELLO's mem_in_use;
    often before gem-schd's welcome says the group is unified). Those bytes are managed memory as far as anyone can
    tell: counted as fixed device memory, gem-schd never evicted them, and an eviction was answered at once as
    complete without waiting for the process."""
    board = FakeBoard()
    board.request_evict = lambda slot, seq: None
    r = Rig(welcomed=False, board_open=lambda path: board)
    unified = sm.Welcome(group=GROUP, min_util=0.0, max_util=1.0, mem_limit=1 << 40, scheduler_id="s1",
                         memory_mode="unified", board_path="/dev/shm/b", board_slot=2)
    if welcome_first:
        r.m.on_scheduler(unified)
    cid = r.m.connect("p")
    r.m.on_hook(cid, 1, hp.Hello(pid=1, pod_name=GROUP, mem_in_use=150 * MiB))
    if not welcome_first:
        r.m.on_scheduler(unified)
    assert r.m.ledger.used == 150 * MiB and r.m.residency.managed_bytes == 150 * MiB
    swapped = [m for m in upstream(r.m.on_scheduler(sm.Evict(group=GROUP, seq=7))) if isinstance(m, sm.Swapped)]
    assert swapped == [], f"answered before the process moved its memory: {swapped}"
    r.m.on_scheduler(unified)                                    # a later welcome counts nothing twice
    assert r.m.residency.managed_bytes == 150 * MiB


@pytest.mark.parametrize("turns", [False, True], ids=["together", "turns"])
def test_a_late_release_of_the_continued_seq_does_not_end_the_hooks_new_hold(turns):
    """The hook's slot 1 was continued as slot 2 without the hook taking it up. At its deadline the watcher sends
    release(1), while a launcher asks again; the request arrives first and is granted slot 2 at once. The late
    release(1) names a slot this hook no longer holds: counted, it gave slot 2 back to gem-schd while the hook
    launched on its fresh grant (and another group was granted beside it)."""
    r = Rig(turns=turns)
    a = r.hook(pid=1)
    r.m.on_hook(a, 1, hp.TokenRequest())
    assert granted(r.grant(50.0, 1)) == {a: 50.0}
    r.clock.advance(0.048)
    r.m.on_scheduler(sm.Grant(group=GROUP, quota_ms=50.0, token_seq=2, continuation=True, prev_seq=1))
    r.clock.advance(0.003)
    assert a in granted(r.m.on_hook(a, 3, hp.TokenRequest()))     # slot 2
    acts = r.m.on_hook(a, 2, hp.TokenRelease(token_seq=1))
    assert not [m for m in upstream(acts) if isinstance(m, sm.TokenRelease)] and a in r.m.token.holders


def test_a_rejoined_processs_managed_count_is_a_guess_that_its_reports_and_frees_correct():
    """A rejoined process's HELLO said 800 bytes; it counts as managed until the process says better: a free of
    600 bytes of VMM memory bounds it by what the process still holds, and its next residency report replaces it
    (before, the guess was kept with max() whatever came after)."""
    r = unified_rig()
    a = r.hook(mem_in_use=800, pid=1)
    assert r.m.residency.managed_bytes == 800
    r.m.on_hook(a, 2, hp.MemFree(bytes=600, kind=hp.MemKind.VMM))
    assert r.m.clients[a].mem == 200 and r.m.residency.managed_bytes == 200
    r.m.on_hook(a, 3, hp.Residency(managed_bytes=150, resident_bytes=150, direction=hp.RESIDENCY_TO_DEVICE))
    assert r.m.residency.managed_bytes == 150 and r.m.residency.resident_bytes == 150
    r.m.on_hook(a, 4, hp.Residency(managed_bytes=100, resident_bytes=0, direction=hp.RESIDENCY_TO_HOST))
    assert r.m.residency.managed_bytes == 150          # no longer a guess: a report lowers it no more


# --- latency class: the flare page ---------------------------------------------------------------------------

class FlareRigBoard(FakeBoard):
    def __init__(self):
        super().__init__()
        self.flares: dict[int, bool] = {}

    def set_flare(self, slot, up):
        self.flares[slot] = up

    def flare(self, slot):
        return self.flares.get(slot, False)


class FakeFlarePage:
    def __init__(self):
        self.until = 0
        self.changes = 0
        self.gone = False

    def until_ns(self):
        return self.until

    def changed(self):
        self.changes += 1

    def unlink(self):
        self.gone = True

    def close(self):
        pass


def flare_rig(sched_class: str = "latency"):
    board, pages = FlareRigBoard(), []

    def create(b, slot):
        assert b is board and slot == 3
        pages.append(FakeFlarePage())
        return pages[-1]
    r = Rig(welcomed=False, board_open=lambda path: board, flare_create=create)
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, scheduler_id="s1",
                                sched_class=sched_class, board_path="/dev/shm/b", board_slot=3))
    return r, board, pages


def test_a_latency_groups_flare_counts_while_it_may_claim():
    """The flare page is made with the board; the board line's word says the group's flares count exactly while
    gem-schd lets it claim, and each change wakes the mirrors sleeping on the page."""
    r, board, pages = flare_rig()
    assert len(pages) == 1 and not board.flare(3)
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    assert board.flare(3) and pages[0].changes == 1 and r.m.status()["flare"] == "up"
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=False, max_claim_ms=20.0))
    assert not board.flare(3) and pages[0].changes == 2 and r.m.status()["flare"] == "down"
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    board.flares[3] = False     # gem-schd cleared it (it thought this pod manager gone): said again at the next right
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    assert board.flare(3)
    # a claim and its end wake the page's sleepers too (a mirror may sleep on the page, not on the board)
    before = pages[0].changes
    cid = r.hook(pid=1)
    r.m.clients[cid].latency = True
    [g] = to_hook(r.m.on_hook(cid, 5, hp.TokenRequest()))
    r.m.on_hook(cid, 6, hp.TokenRelease(token_seq=g.msg.token_seq))
    assert pages[0].changes == before + 2
    # a new board: the old page goes, and its flares count no more
    r.m.on_scheduler(sm.Welcome(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, scheduler_id="s2",
                                sched_class="latency", board_path="/dev/shm/b", board_slot=3))
    assert pages[0].gone and len(pages) == 2


def test_a_batch_group_has_no_flare_page_and_one_that_becomes_batch_drops_it():
    r, board, pages = flare_rig("batch")
    assert pages == [] and r.m.status()["flare"] == "none"
    r, board, pages = flare_rig("latency")
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    r.m.on_scheduler(sm.ConfigUpdate(group=GROUP, min_util=0.5, max_util=1.0, mem_limit=1000, sched_class="batch"))
    assert pages[0].gone and not board.flare(3)


def test_an_early_claim_under_a_counted_flare_credits_its_time_ahead():
    """The flare held the others from the early claim's first launch: the report says so (held_ahead_ms), so that
    gem-schd credits them that time too. Without a flare that counts, nothing ahead is credited."""
    r, board, pages = flare_rig()
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    cid = r.hook(pid=1)
    r.m.clients[cid].latency = True
    launched = int((r.clock.now - 0.0004) * 1e9)
    [g] = to_hook(r.m.on_hook(cid, 5, hp.TokenRequest(launched_ns=launched)))
    r.clock.advance(0.001)
    [rep] = upstream(r.m.on_hook(cid, 6, hp.TokenRelease(token_seq=g.msg.token_seq)))
    assert rep.ahead_ms == pytest.approx(0.4) and rep.held_ahead_ms == pytest.approx(0.4)
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=False, max_claim_ms=20.0))
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    r.m.claims.flares.revoked = True            # (as after an audit)
    r.m.claims.flares.follow(True)
    r.clock.advance(0.1)
    launched = int((r.clock.now - 0.0004) * 1e9)
    [g] = to_hook(r.m.on_hook(cid, 7, hp.TokenRequest(launched_ns=launched)))
    [rep] = upstream(r.m.on_hook(cid, 8, hp.TokenRelease(token_seq=g.msg.token_seq)))
    assert rep.ahead_ms == pytest.approx(0.4) and rep.held_ahead_ms == 0.0


def test_flares_raised_without_requests_lose_their_right():
    """A process of the group that keeps its flare up and asks for no claim would hold every batch process at will:
    three ticks in a row of a flare up with no claim begun or running take the flare's right away for good (claims
    go on). An honest flare, followed by its request within a millisecond, never counts a strike."""
    r, board, pages = flare_rig()
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    page = pages[0]
    cid = r.hook(pid=1)
    r.m.clients[cid].latency = True
    for _ in range(10):         # honest: each flare answered by a claim
        page.until = int((r.clock.now + 0.002) * 1e9)
        [g] = to_hook(r.m.on_hook(cid, 5, hp.TokenRequest()))
        r.m.tick()
        r.clock.advance(0.0005)
        r.m.on_hook(cid, 6, hp.TokenRelease(token_seq=g.msg.token_seq))
        page.until = 0
        r.clock.advance(0.05)
        r.m.tick()
    assert board.flare(3) and r.m.claims.flares.strikes == 0
    for i in range(3):          # up, and nobody asks
        page.until = int((r.clock.now + 0.004) * 1e9)
        r.clock.advance(0.05)
        page.until = int((r.clock.now + 0.004) * 1e9)
        r.m.tick()
        assert board.flare(3) == (i < 2)
    assert r.m.claims.flares.revoked and r.m.status()["flare"] == "revoked"
    r.m.on_scheduler(sm.ClaimRight(group=GROUP, allowed=True, max_claim_ms=20.0))
    assert not board.flare(3)
    [g] = to_hook(r.m.on_hook(cid, 9, hp.TokenRequest()))
    assert g.msg.flags & hp.GRANT_CLAIM
