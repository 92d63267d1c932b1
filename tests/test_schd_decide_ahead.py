"""gem-schd deciding ahead (SchedulerDaemon._on_timer, docs/architecture.md "Deciding ahead"), driven without an event
loop or sockets: the daemon's own handlers on a fake clock, fake frames in, its sends and observer calls recorded.
So the cases that need a message to land in the window before a deadline happen every time (the tests beside it in
test_scheduler_daemon.py run a real daemon, whose timers a loaded machine may make late)."""
from __future__ import annotations

from gemini.config import parse_config
from gemini.scheduler.daemon import SchedulerDaemon
from gemini.wire.sched import Grant, Hello, TokenRelease, TokenRequest, encode

TWO = "[a]\nMaxUtil = 1.0\n[b]\nMaxUtil = 1.0\n"


class _Frame:
    def __init__(self, data: bytes):
        self.bytes = data

    def get(self, key):
        return "test"


class Rig:
    """A SchedulerDaemon (2 ms slots, deciding 5 ms ahead) whose clock is `t` (ms), fed messages by `msg`, its timer
    fired by `fire` at what it would be armed for."""

    def __init__(self, cfg: str = TWO, quota: float = 2.0, min_quota: float = 1.0, ahead: float = 5.0):
        self.d = d = SchedulerDaemon(parse_config(cfg, "rc.txt"), board_path=None, base_quota_ms=quota,
                                     min_quota_ms=min_quota, decide_ahead_ms=ahead)
        self.t = 0.0
        d.now_ms = lambda: self.t
        self.sent: list[tuple[float, bytes, object]] = []
        self.events: list[tuple] = []
        d._send = lambda identity, msg, envelope=None, frame=None: self.sent.append((self.t, identity, msg))
        rig = self

        class Observer:
            def on_grant(self, group, seq, *args):
                rig.events.append(("on_grant", group, seq))

            def on_slot_end(self, group, seq, *args):
                rig.events.append(("on_slot_end", group, seq, args[-1]))
        d.observers.append(Observer())

    def msg(self, identity: bytes, m) -> None:
        self.d._on_frames([_Frame(identity), _Frame(encode(m))])

    def fire(self) -> None:
        """Fire the timer as _arm_timer would arm it now (the rig has no loop to arm it)."""
        d = self.d
        if d._ahead_until is not None:
            wake, at = d._ahead_until, d._t0 + d._ahead_until / 1000.0
        else:
            wake = d.policy.next_wakeup(self.t)
            assert wake is not None
            at = d._t0 + wake / 1000.0 - d._ahead_s(wake)
        d._wake_target, d._wake_at = wake, at
        d._on_timer(at)

    def run_to(self, t: float) -> None:
        """Let time run to t, firing every timer due meanwhile."""
        while True:
            d = self.d
            wake = d._ahead_until if d._ahead_until is not None else d.policy.next_wakeup(self.t)
            if wake is None:
                break
            at = wake - (0.0 if d._ahead_until is not None else d._ahead_s(wake) * 1000.0)
            if at > t:
                break
            self.t = max(self.t, at)
            self.fire()
        self.t = t

    def grants(self, identity: bytes | None = None) -> list[Grant]:
        return [m for _, i, m in self.sent if isinstance(m, Grant) and identity in (None, i)]


def _b_stashed_then_continued(r: Rig) -> int:
    """a holds a 2 ms slot from 0; b asks at 0.1; the timer decides 5 ms ahead of a's deadline (T = 2): b's grant
    waits for T. At 0.3 a's stale release calls the policy, which continues b's 2 ms slot (no longer than
    continue_lead_ms): the stash holds b's grant, its end and the continuation. Returns a's token_seq."""
    r.msg(b"pa", Hello("a", pid=1))
    r.msg(b"pb", Hello("b", pid=2))
    r.msg(b"pa", TokenRequest("a"))
    seq_a = r.grants(b"pa")[-1].token_seq
    r.t = 0.1
    r.msg(b"pb", TokenRequest("b"))
    r.fire()
    assert r.d._ahead_until == 2.0 and [d.group for d, _ in r.d._early] == ["b"], r.d._early
    r.t = 0.3
    r.msg(b"pa", TokenRelease("a", seq_a))
    assert sorted(type(d).__name__ for d, _ in r.d._early) == ["GrantDecision", "GrantDecision", "SlotEndDecision"]
    return seq_a


def _continuations_chain(grants: list[Grant]) -> bool:
    """Every continuation a pod manager receives continues the grant it received just before (gem-pmgr takes up
    no other)."""
    return bool(grants) and not grants[0].continuation and all(
        not g.continuation or g.prev_seq == before.token_seq for before, g in zip(grants, grants[1:]))


def test_a_new_pod_manager_that_asks_in_the_window_gets_its_grant():
    """b's stashed grant and its continuation were decided for b's old pod manager; a new one says hello for b in the
    window and asks. At T the old pod manager's grants go nowhere, and the new one's fresh grant goes out (a
    second review found it dropped with them: the new pod manager got only continuations of a slot it never held,
    which gem-pmgr ignores, and waited for good)."""
    r = Rig()
    _b_stashed_then_continued(r)
    r.t = 0.5
    r.msg(b"pb2", Hello("b", pid=3))
    r.msg(b"pb2", TokenRequest("b"))
    r.run_to(20.0)
    assert r.grants(b"pb") == [], r.grants(b"pb")
    assert _continuations_chain(r.grants(b"pb2")), r.grants(b"pb2")
    granted = {e[2] for e in r.events if e[0] == "on_grant"}
    assert all(e[2] in granted for e in r.events if e[0] == "on_slot_end"), r.events  # no end of an untold slot


def test_a_request_sent_again_in_the_window_voids_the_stashed_grant_and_its_continuation():
    """b's pod manager sends its request again in the window (as after re-registering) while its grant and that
    grant's continuation wait: the policy ends both there (the grant at zero length) and queues b. At T only b's new
    grant goes out (a second review found the old one still sent, 2 ms that overlap whoever is granted next), and
    nobody is told of the old ones."""
    r = Rig()
    _b_stashed_then_continued(r)
    stale = {d.token_seq for d, _ in r.d._early}
    r.t = 0.5
    r.msg(b"pb", TokenRequest("b"))
    r.run_to(2.0)
    sent = r.grants(b"pb")
    assert sent and not {g.token_seq for g in sent} & stale, (sent, stale)
    assert _continuations_chain(sent), sent
    assert not [e for e in r.events if e[2] in stale], r.events


def test_a_release_naming_a_seq_never_sent_does_not_cost_a_waiting_grant():
    """b's grant waits for T; a release from b's pod manager names a seq it was never sent (0, or one from before a
    gem-schd restart): the policy ends b's waiting slot, but b's pod manager still waits for an answer to its
    request, so b is granted (dropped silently, it waited for good; deciding at the deadline it was granted at T).
    Found by a fourth review."""
    for stale in (0, 2):
        r = Rig()
        r.msg(b"pa", Hello("a", pid=1))
        r.msg(b"pb", Hello("b", pid=2))
        r.msg(b"pa", TokenRequest("a"))
        r.t = 0.1
        r.msg(b"pb", TokenRequest("b"))
        r.fire()
        assert [d.token_seq for d, _ in r.d._early] == [2], r.d._early
        r.t = 0.5
        r.msg(b"pb", TokenRelease("b", stale))
        r.run_to(10.0)
        assert r.grants(b"pb"), (stale, r.events)
