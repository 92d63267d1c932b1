"""gem-schd --metrics-port: Prometheus metrics scraped over HTTP from a running daemon."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gemini.config import parse_config
from gemini.scheduler.policy import DEFAULT_BUCKET_MS
from gemini.wire.sched import Grant, Hello, StatusReply, StatusRequest, TokenRelease, TokenRequest, Welcome
from gemini.scheduler.daemon import BindError
from tests.schd_inproc import DaemonThread, FakePodManager

REPO = Path(__file__).resolve().parent.parent

CONFIG = parse_config("""\
[a]
MinUtil = 0.2
MaxUtil = 1.0
MemoryLimit = 2GiB
[b]
MinUtil = 0.1
MaxUtil = 0.5
MemoryLimit = 256MiB
""", "rc.txt")

QUOTA_MS = 150.0   # long enough that a loaded machine still releases before the deadline


def _scrape(url: str) -> dict:
    """{(name, frozenset(labels.items())): value} of every sample."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def schd():
    pytest.importorskip("prometheus_client")
    # Continuous buckets (`--frame 0`): with frames b's budget after its slot depends on where the host's clock puts
    # the frame's boundary (the scripted order a, b, a need not hold)
    d = DaemonThread(CONFIG, base_quota_ms=QUOTA_MS, min_quota_ms=10.0, window_ms=10000.0, metrics_port=0,
                     cap_frame_ms=0.0).start()
    yield d
    d.stop()


def test_metrics_after_grants(schd):
    url = schd.daemon.metrics_server.url
    assert url.startswith("http://127.0.0.1:")
    before = _scrape(url)
    # Every group's series exist before its first grant.
    assert _get(before, "gemini_grants_total", group="a") == 0 and _get(before, "gemini_grants_total", group="b") == 0
    assert _get(before, "gemini_token_wait_seconds_count", group="b") == 0

    with FakePodManager(schd.endpoint) as pa, FakePodManager(schd.endpoint) as pb:
        assert isinstance(pa.request(Hello("a", pid=1, mem_used=700 << 20, clients=2)), Welcome)
        assert isinstance(pb.request(Hello("b", pid=2, mem_used=5 << 20, clients=1)), Welcome)
        # a: granted at once, releases after 20 ms while b waits; b: granted at a's release, runs to its deadline;
        # a again, released at once.
        g1 = pa.request(TokenRequest("a"))
        assert isinstance(g1, Grant)
        pb.send(TokenRequest("b"))
        assert isinstance(pb.request(StatusRequest()), StatusReply)    # b's request has arrived
        time.sleep(0.02)
        pa.send(TokenRelease("a", g1.token_seq))
        g2 = pb.recv_type(Grant)
        assert isinstance(g2, Grant)
        g3 = pa.request(TokenRequest("a"), timeout=2.0)   # granted at b's deadline
        assert isinstance(g3, Grant)
        pa.send(TokenRelease("a", g3.token_seq))
        time.sleep(0.05)
        history = schd.call(schd.daemon.policy.history)
        status = {g["name"]: g for g in schd.call(schd.daemon.status_reply).groups}
        samples = _scrape(url)
        status_after = {g["name"]: g for g in schd.call(schd.daemon.status_reply).groups}

    assert [h[0] for h in history] == ["a", "b", "a"]
    assert _get(samples, "gemini_grants_total", group="a") == 2 == status["a"]["grants"]
    assert _get(samples, "gemini_grants_total", group="b") == 1 == status["b"]["grants"]
    # Waits: b waited for a's release (>= the 20 ms sleep); a's second request waited for b's deadline.
    assert _get(samples, "gemini_token_wait_seconds_count", group="b") == 1
    b_wait = _get(samples, "gemini_token_wait_seconds_sum", group="b")
    assert 0.02 <= b_wait <= (history[0][2] - history[0][1]) / 1000.0
    assert _get(samples, "gemini_token_wait_seconds_bucket", group="b", le="0.01") == 0
    assert _get(samples, "gemini_token_wait_seconds_bucket", group="b", le="1.0") == 1
    assert _get(samples, "gemini_token_wait_seconds_count", group="a") == 2
    # Held time: the slots as the policy recorded them (a release ends one early, a deadline at its quota).
    for group in ("a", "b"):
        held = sum(end - start for g, start, end, _ in history if g == group) / 1000.0
        assert _get(samples, "gemini_token_held_seconds_total", group=group) == pytest.approx(held, abs=1e-6)
    # b (MaxUtil 0.5) held what its full token bucket allows: the depth / (1 - 0.5)
    assert _get(samples, "gemini_token_held_seconds_total", group="b") == pytest.approx(
        DEFAULT_BUCKET_MS / (1 - 0.5) / 1000.0)
    # Status gauges: configuration, memory, clients, quota, token state.
    assert _get(samples, "gemini_group_min_util_ratio", group="a") == 0.2
    assert _get(samples, "gemini_group_max_util_ratio", group="b") == 0.5
    assert _get(samples, "gemini_memory_used_bytes", group="a") == 700 << 20
    assert _get(samples, "gemini_memory_limit_bytes", group="b") == 256 << 20
    assert _get(samples, "gemini_group_clients", group="a") == 2
    assert _get(samples, "gemini_group_connected", group="b") == 1
    assert _get(samples, "gemini_quota_seconds", group="b") == pytest.approx(DEFAULT_BUCKET_MS / (1 - 0.5) / 1000.0)
    assert _get(samples, "gemini_token_holder", group="a") == 0 and _get(samples, "gemini_token_holder", group="b") == 0
    assert _get(samples, "gemini_group_waiting", group="a") == 0
    assert _get(samples, "gemini_window_seconds") == 10.0
    assert _get(samples, "gemini_scheduler_info", scheduler_id=schd.daemon.scheduler_id) == 1
    # The share is the status share: over the whole window, and with every slot of the test inside it and nobody
    # holding the token, the status reads before and after the scrape and the scrape all give the same number.
    for group in ("a", "b"):
        share = _get(samples, "gemini_group_share_ratio", group=group)
        assert 0 < share < 1
        assert status_after[group]["share"] == pytest.approx(share, rel=1e-9) == status[group]["share"]


def test_reload_drops_removed_groups_and_counts(schd):
    new = parse_config("[a]\nMaxUtil = 0.7\n[c]\nMinUtil = 0.3\n", "rc.txt")
    schd.call(lambda: schd.daemon.apply_config(new))
    samples = _scrape(schd.daemon.metrics_server.url)
    assert _get(samples, "gemini_config_reloads_total") == 1
    assert _get(samples, "gemini_group_max_util_ratio", group="a") == 0.7
    assert _get(samples, "gemini_group_min_util_ratio", group="c") == 0.3
    assert _get(samples, "gemini_grants_total", group="c") == 0
    assert not any(dict(labels).get("group") == "b" for _, labels in samples)


def test_http_details(schd):
    base = f"http://127.0.0.1:{schd.daemon.metrics_server.port}"
    with urllib.request.urlopen(base + "/", timeout=5) as resp:       # / serves the metrics too
        assert b"gemini_grants_total" in resp.read()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert err.value.code == 404
    req = urllib.request.Request(base + "/metrics", method="HEAD")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200 and int(resp.headers["Content-Length"]) > 0 and resp.read() == b""
    # A client that connects and says nothing does not block the scheduler or other scrapes.
    idle = socket.create_connection(("127.0.0.1", schd.daemon.metrics_server.port))
    try:
        with FakePodManager(schd.endpoint) as p:
            assert isinstance(p.request(Hello("a", pid=1)), Welcome)
        assert b"gemini_grants_total" in urllib.request.urlopen(base + "/metrics", timeout=5).read()
    finally:
        idle.close()


def test_registry_per_daemon():
    pytest.importorskip("prometheus_client")
    with DaemonThread(CONFIG, metrics_port=0) as d1, DaemonThread(CONFIG, metrics_port=0) as d2:
        assert d1.daemon.metrics_server.metrics.registry is not d2.daemon.metrics_server.metrics.registry
        with FakePodManager(d1.endpoint) as p:
            p.request(Hello("a", pid=1))
            assert isinstance(p.request(TokenRequest("a")), Grant)
        time.sleep(0.05)
        assert _get(_scrape(d1.daemon.metrics_server.url), "gemini_grants_total", group="a") == 1
        assert _get(_scrape(d2.daemon.metrics_server.url), "gemini_grants_total", group="a") == 0


def test_metrics_port_busy():
    pytest.importorskip("prometheus_client")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        with pytest.raises(BindError, match=f"metrics: cannot listen on 127.0.0.1:{s.getsockname()[1]}"):
            DaemonThread(CONFIG, metrics_port=s.getsockname()[1]).start()
    finally:
        s.close()


def test_cli_without_prometheus_client_exits_2(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    code = ("import sys; sys.modules['prometheus_client'] = None\n"   # import prometheus_client -> ImportError
            "from gemini.scheduler.cli import main; main(prog_name='gem-schd')")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code, "-P", "0", "--metrics-port", "0", "-p", str(tmp_path)],
                       capture_output=True, text=True, timeout=20, env=env)
    assert r.returncode == 2
    assert "prometheus_client is not installed" in r.stderr and "gemini-gpu[metrics]" in r.stderr


def test_unified_groups_residency_in_metrics():
    """A unified group's memory mode, managed and resident bytes and swap totals, as gem-ctl status shows them."""
    pytest.importorskip("prometheus_client")
    from gemini.wire.sched import Swapped
    config = parse_config("[u]\nMaxUtil = 1.0\nMemoryLimit = 2GiB\nMemoryMode = unified\n"
                          "[d]\nMaxUtil = 1.0\nMemoryLimit = 1GiB\n", "rc.txt")
    d = DaemonThread(config, base_quota_ms=QUOTA_MS, metrics_port=0, device_memory=1 << 30).start()
    try:
        with FakePodManager(d.endpoint) as pu:
            assert isinstance(pu.request(Hello("u", pid=1, mem_used=512 << 20, clients=1, managed=512 << 20)),
                              Welcome)
            assert isinstance(pu.request(TokenRequest("u", managed=512 << 20)), Grant)
            pu.send(Swapped("u", "device", moved_bytes=512 << 20, took_ms=40.0, managed=512 << 20,
                            resident=512 << 20))
            assert isinstance(pu.request(StatusRequest()), StatusReply)     # the report has arrived
            samples = _scrape(d.daemon.metrics_server.url)
    finally:
        d.stop()
    assert _get(samples, "gemini_group_unified", group="u") == 1
    assert _get(samples, "gemini_group_unified", group="d") == 0
    assert _get(samples, "gemini_managed_bytes", group="u") == 512 << 20
    assert _get(samples, "gemini_resident_bytes", group="u") == 512 << 20
    assert _get(samples, "gemini_swapped_in_bytes_total", group="u") == 512 << 20
    assert _get(samples, "gemini_swapped_out_bytes_total", group="u") == 0
    assert _get(samples, "gemini_swap_seconds_total", group="u") == pytest.approx(0.04)
    assert _get(samples, "gemini_evictions_total", group="u") == 0
    assert ("gemini_managed_bytes", frozenset({("group", "d")})) not in samples     # device groups: no series
