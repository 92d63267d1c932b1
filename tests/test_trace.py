"""gem-schd --trace (Chrome trace events) and gem-ctl plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gemini.ctl import main as ctl_main
from gemini.config import parse_config
from gemini.scheduler.policy import DEFAULT_BUCKET_MS
from gemini.wire.sched import Grant, Hello, StatusReply, StatusRequest, TokenRelease, TokenRequest, Welcome
from tests.schd_inproc import DaemonThread, FakePodManager
from gemini.scheduler.trace import SchedulerTrace, TraceFormatError, read_trace

REPO = Path(__file__).resolve().parent.parent

CONFIG = parse_config("[a]\nMinUtil = 0.2\nMaxUtil = 1.0\n[b]\nMaxUtil = 0.5\n", "rc.txt")
QUOTA_MS = 150.0   # long enough that a loaded machine still releases before the deadline
# b (MaxUtil 0.5) is granted what its full token bucket allows: the default depth / (1 - 0.5)
B_QUOTA_MS = DEFAULT_BUCKET_MS / (1 - 0.5)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """A daemon run with a trace: a released slot, a slot that runs to its deadline, a reload that adds c and
    removes b, a slot of c; then a clean stop. Returns (trace path, the policy's history before the stop)."""
    path = tmp_path_factory.mktemp("trace") / "schd.json"
    # Continuous buckets (`--frame 0`): with frames b's budget after its slot depends on where the host's clock
    # puts the frame's boundary, and one that passed during its slot continued it (a, b, b, c: a flake)
    d = DaemonThread(CONFIG, base_quota_ms=QUOTA_MS, min_quota_ms=10.0, window_ms=1000.0,
                     trace_path=str(path), cap_frame_ms=0.0).start()
    try:
        with FakePodManager(d.endpoint) as pa, FakePodManager(d.endpoint) as pb:
            assert isinstance(pa.request(Hello("a", pid=1)), Welcome)
            assert isinstance(pb.request(Hello("b", pid=2)), Welcome)
            g1 = pa.request(TokenRequest("a"))
            assert isinstance(g1, Grant)
            pb.send(TokenRequest("b"))
            assert isinstance(pb.request(StatusRequest()), StatusReply)     # b's request has arrived
            time.sleep(0.015)
            pa.send(TokenRelease("a", g1.token_seq))
            assert isinstance(pb.recv_type(Grant), Grant)
            time.sleep(QUOTA_MS / 1000.0 + 0.03)          # b's slot runs out
            d.call(lambda: d.daemon.apply_config(parse_config("[a]\nMaxUtil = 0.8\n[c]\n", "rc.txt")))
            with FakePodManager(d.endpoint) as pc:
                assert isinstance(pc.request(Hello("c", pid=3)), Welcome)
                g3 = pc.request(TokenRequest("c"))
                assert isinstance(g3, Grant)
                time.sleep(0.01)
                pc.send(TokenRelease("c", g3.token_seq))
                assert isinstance(pc.request(StatusRequest()), StatusReply)   # the release has been handled
            history = d.call(d.daemon.policy.history)
    finally:
        d.stop()
    return path, history


def test_trace_is_json_with_viewer_fields(traced_run):
    path, history = traced_run
    events = json.loads(path.read_text())          # a clean stop closes the array: strict JSON
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("M", "X", "i", "C") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
    assert len({e["pid"] for e in events}) == 1
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(process) == 1 and process[0]["args"]["name"].startswith("gem-schd ")
    assert events[-1]["name"] == "gem-schd stopped" and events[-1]["ph"] == "i"


def test_one_track_per_group_and_slots_match_grants(traced_run):
    path, history = traced_run
    events = read_trace(path)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slots = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in slots] == [h[0] for h in history] == ["a", "b", "c"]
    tids = {}
    for e in slots:
        assert e["cat"] == "slot" and e["dur"] >= 0
        assert tids.setdefault(e["name"], e["tid"]) == e["tid"]          # one track per group
        assert names[e["tid"]] == f"group {e['name']}"
    assert len(set(tids.values())) == 3 and 0 not in tids.values()         # tid 0 is the scheduler's own track
    # Each slot is the policy's entry: same start, same length (us, rounded to ns).
    for e, (_group, start, end, seq) in zip(slots, history):
        assert e["args"]["token_seq"] == seq
        assert e["ts"] == pytest.approx(start * 1000.0, abs=0.002)
        assert e["dur"] == pytest.approx((end - start) * 1000.0, abs=0.002)
    a, b, c = slots
    assert a["args"]["quota_ms"] == c["args"]["quota_ms"] == QUOTA_MS and b["args"]["quota_ms"] == B_QUOTA_MS
    assert a["args"]["ended"] == "release" and 10_000 <= a["dur"] < QUOTA_MS * 1000
    assert b["args"]["ended"] == "deadline" and b["dur"] == pytest.approx(B_QUOTA_MS * 1000)
    assert b["args"]["wait_ms"] >= 15.0 and a["args"]["wait_ms"] == 0.0    # b waited for a's release
    assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=0.002)        # handed over at the release


def test_config_events(traced_run):
    path, _ = traced_run
    configs = [e for e in read_trace(path) if e["ph"] == "i" and e["name"] == "config"]
    assert len(configs) == 2
    start, reload = configs
    assert start["ts"] == 0 and start["s"] == "g" and start["args"]["reason"] == "start"
    assert start["args"]["window_ms"] == 1000.0 and start["args"]["groups"]["b"]["max_util"] == 0.5
    assert reload["args"]["reason"] == "reload" and reload["s"] == "g"
    assert (reload["args"]["added"], reload["args"]["changed"], reload["args"]["removed"]) == (["c"], ["a"], ["b"])
    assert set(reload["args"]["groups"]) == {"a", "c"} and reload["args"]["groups"]["a"]["max_util"] == 0.8
    trace = SchedulerTrace.load(path)
    assert trace.groups == ["a", "b", "c"] and trace.window_s == 1.0 and len(trace.configs) == 2


def test_killed_daemon_leaves_an_openable_trace(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\n[b]\n")
    trace = tmp_path / "killed.json"
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "-q", "2000", "-m", "10",
                             "-p", str(tmp_path), "--trace", str(trace)], stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        endpoint, lines = None, []
        deadline = time.monotonic() + 15
        while endpoint is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "listening on tcp://" in line:
                endpoint = line.split("listening on ")[1].split()[0]
        assert endpoint, lines
        with FakePodManager(endpoint) as pa, FakePodManager(endpoint) as pb:
            assert isinstance(pa.request(Hello("a", pid=1)), Welcome)
            assert isinstance(pb.request(Hello("b", pid=2)), Welcome)
            for _ in range(3):
                for p, group in ((pa, "a"), (pb, "b")):
                    g = p.request(TokenRequest(group))
                    assert isinstance(g, Grant)
                    p.send(TokenRelease(group, g.token_seq))
                    assert isinstance(p.request(StatusRequest()), StatusReply)   # release handled
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = trace.read_text()
    assert not text.rstrip().endswith("]")
    events = json.loads(text + "]")           # strict JSON once the array is closed
    slots = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in slots] == ["a", "b"] * 3
    assert all(e["args"]["ended"] == "release" and 0 <= e["dur"] < 2_000_000 for e in slots)
    assert [e["args"]["token_seq"] for e in slots] == list(range(1, 7))
    assert read_trace(trace) == events


def test_read_trace_formats(tmp_path):
    ev = {"ph": "X", "cat": "slot", "name": "a", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1, "args": {}}
    cut = tmp_path / "cut.json"
    cut.write_text("[\n" + json.dumps(ev) + "\n," + json.dumps(ev)[:17])     # killed mid-write
    assert read_trace(cut) == [ev]
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"traceEvents": [ev, ev]}))
    assert read_trace(obj) == [ev, ev]
    bad = tmp_path / "bad.json"
    bad.write_text("hello\n")
    with pytest.raises(TraceFormatError):
        read_trace(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("[\n" + json.dumps(ev) + "\n,{oops\n," + json.dumps(ev) + "\n")
    with pytest.raises(TraceFormatError, match=":3:"):
        read_trace(broken)


def test_cli_trace_unwritable_exits_2(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    r = subprocess.run([sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "-p", str(tmp_path), "--trace",
                        str(tmp_path / "no" / "such" / "dir" / "t.json")], capture_output=True, text=True,
                       timeout=20, env=_env())
    assert r.returncode == 2
    assert "--trace" in r.stderr and "t.json" in r.stderr


def test_a_scheduler_whose_start_fails_part_way_leaves_no_board_page_or_socket(tmp_path):
    """The trace is opened after gem-schd has its board page and its socket: a start that fails there closes both
    (the daemon's stop after a partial start), as the process ends without the interpreter's teardown. Before, the
    board page stayed in /dev/shm."""
    import re
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    ipc = tmp_path / "ipc"
    r = subprocess.run([sys.executable, "-m", "gemini.scheduler.cli", "--ipc-dir", str(ipc), "-p", str(tmp_path),
                        "--trace", str(tmp_path / "no" / "such" / "dir" / "t.json")], capture_output=True, text=True,
                       timeout=20, env=_env())
    assert r.returncode == 2 and "--trace: cannot write" in r.stderr, r.stderr
    page = re.search(r"board page (\S+)", r.stderr)
    assert page, r.stderr
    assert not Path(page.group(1)).exists(), f"{page.group(1)} left behind"
    assert not list(ipc.rglob("*.sock")), list(ipc.rglob("*"))


def test_plot_writes_png(traced_run, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = traced_run
    out = tmp_path / "share.png"
    r = CliRunner().invoke(ctl_main, ["plot", str(path), "-o", str(out), "--points", "200"])
    assert r.exit_code == 0, r.output
    assert "3 slots of 3 group(s)" in r.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_bad_trace_is_a_clear_error(tmp_path):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "bad.json"
    bad.write_text("not a trace\n")
    r = CliRunner().invoke(ctl_main, ["plot", str(bad), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 1 and "cannot plot" in r.output and "not a trace" in r.output


def test_swap_events_are_read_and_plotted(tmp_path):
    """A trace with a unified group's swaps (as gem-schd writes them: an eviction asked, the moves reported):
    read_trace and SchedulerTrace take them in, and gem-ctl plot draws the file."""
    from tests.test_share import FakeDaemon
    from gemini.scheduler.trace import TraceWriter
    path = tmp_path / "swaps.json"
    writer = TraceWriter(path, FakeDaemon())
    writer.on_slot_end("a", 1, 100.0, 0.0, 100.0, 0.0, "deadline")
    writer.on_evict("a", 3, 128 << 20, 100.0)
    writer.on_swap("a", "host", 3, 128 << 20, 30.0, 131.0, True)
    writer.on_swap("b", "device", 0, 64 << 20, 15.5, 150.0, True)
    writer.on_slot_end("b", 2, 100.0, 131.0, 231.0, 31.0, "deadline")
    writer.on_stop(240.0)
    events = [e for e in read_trace(path) if e.get("cat") == "swap"]
    ask, out, into = events
    assert (ask["ph"], ask["name"], ask["ts"], ask["args"]) == ("i", "a evict", 100_000.0,
                                                               {"seq": 3, "bytes": 128 << 20})
    assert (out["ph"], out["name"], out["ts"], out["dur"]) == ("X", "a swap out", 101_000.0, 30_000.0)
    assert out["args"] == {"direction": "host", "bytes": 128 << 20, "took_ms": 30.0, "seq": 3, "complete": True}
    assert (into["name"], into["ts"], into["dur"], into["args"]["direction"]) == ("b swap in", 134_500.0, 15_500.0,
                                                                                 "device")
    assert out["tid"] == ask["tid"] != into["tid"]
    trace = SchedulerTrace.load(path)
    assert [(s.group, s.direction, s.bytes, s.start_s) for s in trace.swaps] == \
        [("a", "host", 128 << 20, 0.101), ("b", "device", 64 << 20, 0.1345)]
    assert len(trace.slots) == 2
    pytest.importorskip("matplotlib")
    r = CliRunner().invoke(ctl_main, ["plot", str(path), "-o", str(tmp_path / "swaps.png"), "--points", "50"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "swaps.png").read_bytes()[:4] == b"\x89PNG"
