"""The share gem-schd reports (gemini/scheduler/share.py): over the whole window, so that a group the policy holds to
its cap never reads above it, also right after an idle start; one computation for gem-ctl status, the metrics and
the trace's samples that gem-ctl plot draws."""
from __future__ import annotations

import time

import pytest

from gemini.config import parse_config
from gemini.plot import share_curves
from gemini.scheduler.share import reported_share, share_series
from gemini.scheduler.policy import Policy
from gemini.scheduler.trace import SchedulerTrace, ShareSample, SlotEvent, TraceWriter
from gemini.wire.sched import Grant, Hello, StatusReply, StatusRequest, TokenRelease, TokenRequest, Welcome
from tests.policy_sim import Busy, Model
from tests.schd_inproc import DaemonThread, FakePodManager


def test_share_series_divides_by_the_whole_window():
    slots = [(2.0, 3.0), (0.0, 1.0)]
    # slot time in [t - 2, t] / 2 from the first moment on (not / min(2, t): one slot alone is not 100%)
    assert share_series(slots, [0.5, 1.0, 2.0, 2.5, 3.0, 4.0, 6.0], 2.0) == \
        pytest.approx([0.25, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0])


@pytest.mark.parametrize("cap", [0.3, 0.6])
def test_a_capped_group_never_reads_above_its_cap_after_an_idle_start(cap):
    """A busy group that comes 30 s after the scheduler started, in the model of the real system
    (tests/policy_sim.py): sampled every 10 ms, its reported share never passes its cap by more than the policy's
    own bound over an interval (`cap_burst_ms`), and after a whole window it is at the cap."""
    window = 10_000.0
    m = Model([("a", 0.0, cap)], {"a": Busy(start_ms=30_000.0)}, window_ms=window)
    samples = []
    t = 30_000.0
    while t <= 45_000.0:
        m.run(t)
        samples.append((t, reported_share(m.policy.usage("a", t), window)))
        t += 10.0
    assert max(s for _, s in samples) <= cap + m.policy.cap_burst_ms("a") / window + 1e-9
    late = [s for t, s in samples if t >= 30_000.0 + window + 500]
    assert min(late) >= cap - 0.02


def _status_shares(d: DaemonThread) -> dict[str, float]:
    return {g["name"]: g["share"] for g in d.call(d.daemon.status_reply).groups}


def test_status_reads_the_first_slot_over_the_whole_window(tmp_path):
    config = parse_config("[a]\nMaxUtil = 0.5\n", "rc.txt")
    d = DaemonThread(config, window_ms=2000.0, base_quota_ms=100.0).start()
    try:
        with FakePodManager(d.endpoint) as p:
            assert isinstance(p.request(Hello("a", pid=1)), Welcome)
            g = p.request(TokenRequest("a"))
            assert isinstance(g, Grant)
            time.sleep(0.02)
            share = _status_shares(d)["a"]
            # its first slot so far, over 2 s: far below the cap (it read 1.0 divided by the time since the request)
            assert 0 < share <= 0.5
            p.send(TokenRelease("a", g.token_seq))
            assert isinstance(p.request(StatusRequest()), StatusReply)
            assert _status_shares(d)["a"] <= 0.5
    finally:
        d.stop()


def test_status_and_trace_samples_are_one_computation(tmp_path):
    """gem-ctl status and the trace's share samples both come from SchedulerDaemon.reported_shares, at their own
    moment; the samples go on while a share decays after the group went idle, then stop at 0."""
    path = tmp_path / "trace.json"
    config = parse_config("[a]\nMaxUtil = 0.5\n[b]\n", "rc.txt")
    window_ms = 500.0
    d = DaemonThread(config, window_ms=window_ms, base_quota_ms=40.0, trace_path=str(path)).start()
    calls: list[tuple[float, dict]] = []
    original = d.daemon.reported_shares

    def recording(now):
        result = original(now)
        calls.append((now, result))
        return result

    d.call(lambda: setattr(d.daemon, "reported_shares", recording))
    try:
        with FakePodManager(d.endpoint) as pa:
            assert isinstance(pa.request(Hello("a", pid=1)), Welcome)
            g = pa.request(TokenRequest("a"))
            assert isinstance(g, Grant)
            time.sleep(0.03)
            pa.send(TokenRelease("a", g.token_seq, overuse_ms=5.0))
            reply = pa.request(StatusRequest())
            # On a slow machine the slot can run out before the release arrives: a lone holder's continuation then
            # comes first (CI's 33rd-session failure). Hand it back too; the status reply follows it.
            while isinstance(reply, Grant):
                pa.send(TokenRelease("a", reply.token_seq))
                reply = pa.recv()
            assert isinstance(reply, StatusReply)
            # status: what reported_shares said (read on the loop, before a trace sample can come in between)
            shares, said = d.call(lambda: ({g["name"]: g["share"] for g in d.daemon.status_reply().groups},
                                           calls[-1][1]))
            assert shares == said
            time.sleep(3 * window_ms / 1000)                       # a's slot leaves the window
    finally:
        d.stop()
    trace = SchedulerTrace.load(path)
    recorded = [s for s in trace.samples if s.t_s * 1000 >= calls[0][0] - 1e-3]
    assert recorded
    for sample in recorded:                                        # each sample: what reported_shares said then
        now, result = min(calls, key=lambda c: abs(c[0] - sample.t_s * 1000))
        assert abs(now - sample.t_s * 1000) < 1e-5 and sample.shares == pytest.approx(result, abs=1e-6)
    a = [(s.t_s, s.shares["a"]) for s in trace.samples]
    peak = max(range(len(a)), key=lambda i: a[i][1])
    assert a[peak][1] > 0 and a[-1][1] == 0                        # it decayed to 0 as the window slid on
    assert sum(1 for _, v in a[peak:] if v == 0) <= 2              # idle: the first 0 and the one at the stop


class FakeDaemon:
    """What TraceWriter reads of a daemon, with shares the test sets."""

    def __init__(self):
        self.config = parse_config("[a]\n[b]\n", "rc.txt")
        self.scheduler_id, self.endpoint, self.ip = "test", "", "127.0.0.1"
        self.policy = Policy(self.config, window_ms=1000.0)
        self.now, self.shares = 0.0, {"a": 0.0, "b": 0.0}

    def now_ms(self) -> float:
        return self.now

    def reported_shares(self, now: float) -> dict[str, float]:
        return dict(self.shares)


def test_trace_samples_skip_idle_repeats(tmp_path):
    daemon = FakeDaemon()
    writer = TraceWriter(tmp_path / "t.json", daemon)     # outside a loop: samples only when asked
    for t, a in [(1, 0.0), (2, 0.0), (3, 0.1), (4, 0.2), (5, 0.0), (6, 0.0), (7, 0.0)]:
        daemon.now, daemon.shares["a"] = float(t), a
        writer._sample()
    writer.on_stop(8.0)
    samples = SchedulerTrace.load(tmp_path / "t.json").samples
    assert [(round(s.t_s * 1000), s.shares["a"]) for s in samples] == \
        [(0, 0.0), (3, 0.1), (4, 0.2), (5, 0.0), (8, 0.0)]


def test_the_plot_draws_the_samples_and_computes_only_without_them():
    trace = SchedulerTrace(slots=[SlotEvent("a", 0.0, 1.0, 1, 1000.0, "deadline")],
                           samples=[ShareSample(0.5, {"a": 0.2}), ShareSample(1.0, {"a": 0.4}),
                                    ShareSample(2.0, {"b": 0.1})],
                           window_s=2.0, groups=["a", "b"])
    curves = share_curves(trace, [1.0, 2.0])
    assert curves["a"][0] == [0.5, 1.0, 2.0] and curves["a"][1][:2] == [0.2, 0.4]
    assert curves["b"][1][2] == 0.1
    trace.samples = []
    assert share_curves(trace, [1.0, 2.0])["a"] == ([1.0, 2.0], pytest.approx([0.5, 0.5]))
    trace.samples = [ShareSample(0.5, {"a": 0.2})]
    assert share_curves(trace, [1.0], window_s=4.0)["a"] == ([1.0], pytest.approx([0.25]))   # another window
