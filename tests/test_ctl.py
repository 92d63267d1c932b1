"""gem-ctl against gem-schd run in-process (real zmq), with fake pod managers."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gemini.ctl import HOME, format_bytes, main
from gemini.config import parse_config
from gemini.wire.sched import Grant, Hello, StatusReply, TokenRequest, Welcome, decode
from tests.schd_inproc import DaemonThread, FakePodManager

REPO = Path(__file__).resolve().parent.parent

CONFIG = parse_config("""\
[alpha]
MinUtil = 0.25
MaxUtil = 1.0
MemoryLimit = 4GiB
[beta]
MinUtil = 0.1
MaxUtil = 0.6
MemoryLimit = 512MiB
[gamma]
MaxUtil = 0.5
""", "rc.txt")


@pytest.fixture
def busy_schd():
    """A scheduler where alpha holds the token (a long slot), beta waits for it and gamma is idle."""
    d = DaemonThread(CONFIG, base_quota_ms=5000.0, min_quota_ms=100.0, window_ms=10000.0).start()
    alpha = FakePodManager(d.endpoint)
    beta = FakePodManager(d.endpoint)
    try:
        assert isinstance(alpha.request(Hello("alpha", pid=11, mem_used=3 << 30, clients=3,
                                              members=[[101, 1000], [102, 1000], [103, -1]])), Welcome)
        assert isinstance(beta.request(Hello("beta", pid=12, mem_used=100 << 20, clients=1)), Welcome)
        assert isinstance(alpha.request(TokenRequest("alpha")), Grant)
        beta.send(TokenRequest("beta"))
        time.sleep(0.05)       # beta has been waiting for a while
        yield d
    finally:
        alpha.close()
        beta.close()
        d.stop()


def _rows(table: str) -> dict[str, str]:
    return {line.split()[0]: line for line in table.splitlines()[3:] if line.strip()}


def _share(d: DaemonThread, group: str) -> float:
    return next(g["share"] for g in d.call(d.daemon.status_reply).groups if g["name"] == group)


def test_status_table(busy_schd):
    share_before = _share(busy_schd, "alpha")
    r = CliRunner().invoke(main, ["--port", str(busy_schd.port), "status"])
    share_after = _share(busy_schd, "alpha")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert busy_schd.daemon.scheduler_id in lines[0] and "token: alpha" in lines[0]
    assert lines[2].split()[:4] == ["GROUP", "MIN", "MAX", "SHARE"]
    rows = _rows(r.output)
    assert set(rows) == {"alpha", "beta", "gamma"}
    a, b, c = rows["alpha"].split(), rows["beta"].split(), rows["gamma"].split()
    # Split on blanks: GROUP MIN MAX SHARE used unit / limit unit CLIENTS TOKEN WAIT(1 or 2 words) GRANTS PMGR
    assert a[:3] == ["alpha", "0.25", "1.00"] and b[:3] == ["beta", "0.10", "0.60"] and c[:3] == ["gamma", "0.00",
                                                                                                   "0.50"]
    assert "3.0 GiB / 4.0 GiB" in rows["alpha"] and "100.0 MiB / 512.0 MiB" in rows["beta"]
    assert a[9:11] == ["3", "yes"] and b[9:11] == ["1", "no"] and c[9:11] == ["0", "no"]
    # alpha holds the token, so its share (usage / the window so far) grows: the table's lies between the two
    # status reads taken before and after it (rounded to 0.1 %).
    assert 100 * share_before - 0.05 <= float(a[3].rstrip("%")) <= 100 * share_after + 0.05
    assert share_after > 0
    assert b[3] == "0.0%"
    wait_ms = float(b[11]) if b[12] == "ms" else 1000 * float(b[11])
    assert 40.0 <= wait_ms < 5000.0, rows["beta"]  # beta has waited since its request, alpha not at all
    assert a[11] == "-" and c[11] == "-"
    assert a[-3:-1] == ["1", "up"] and b[-3:-1] == ["0", "up"] and c[-3:-1] == ["0", "down"]
    # each process: pid(uid), uid ? where the pod manager does not know it (TCP); counted only: +N
    assert a[-1] == "101(1000),102(1000),103(?)" and b[-1] == "+1" and c[-1] == "-"


def test_status_json_is_the_status_reply(busy_schd):
    r = CliRunner().invoke(main, ["--port", str(busy_schd.port), "status", "--json"])
    assert r.exit_code == 0, r.output
    reply = decode(r.output.encode())          # the scheduler's own schema
    assert isinstance(reply, StatusReply)
    assert reply.scheduler_id == busy_schd.daemon.scheduler_id and reply.holder == "alpha"
    assert reply.window_ms == 10000.0
    by_name = {g["name"]: g for g in reply.groups}
    assert list(by_name) == ["alpha", "beta", "gamma"]
    assert by_name["alpha"]["mem_used"] == 3 << 30 and by_name["alpha"]["clients"] == 3
    assert by_name["beta"]["mem_limit"] == 512 << 20 and by_name["beta"]["waiting"] is True
    assert by_name["alpha"]["holding"] is True and by_name["beta"]["holding"] is False
    assert by_name["gamma"]["connected"] is False and by_name["alpha"]["grants"] == 1


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_status_over_the_socket_transport(tmp_path):
    d = DaemonThread(CONFIG, ipc_dir=str(tmp_path), device_uuid="GPU-42").start()
    try:
        with FakePodManager(d.daemon.endpoint) as alpha:
            assert isinstance(alpha.request(Hello("alpha", pid=11, clients=1, members=[[4242, 1000]])), Welcome)
            r = CliRunner().invoke(main, ["--ipc-dir", str(tmp_path), "--device-uuid", "GPU-42", "status"])
            assert r.exit_code == 0, r.output
            assert f"at ipc://{tmp_path}/GPU-42/gem-schd.sock" in r.output.splitlines()[0]
            assert _rows(r.output)["alpha"].split()[-1] == "4242(1000)"
            r = CliRunner().invoke(main, ["--ipc-dir", str(tmp_path), "--timeout", "0.3", "status"])
            assert r.exit_code == 1 and "no socket there" in r.output      # no backend for the 'default' GPU
            r = CliRunner().invoke(main, ["--ipc-dir", str(tmp_path), "--port", "5", "status"])
            assert r.exit_code == 2 and "choose one transport" in r.output
    finally:
        d.stop()


def test_no_daemon_is_a_clear_error():
    port = _free_port()
    started = time.monotonic()
    r = CliRunner().invoke(main, ["--port", str(port), "--timeout", "0.3", "status"])
    assert r.exit_code == 1
    assert f"no answer from gem-schd at tcp://127.0.0.1:{port} within 0.3 s" in r.output
    assert "is it running" in r.output
    assert time.monotonic() - started < 5


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _default_sigint() -> None:
    """In gem-ctl: Ctrl-C as at a terminal, even when the test runner was started with SIGINT ignored (a
    `make test &` of a script): such an ignore is inherited, and gem-ctl would not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_redraws_until_ctrl_c(busy_schd):
    proc = subprocess.Popen([sys.executable, "-m", "gemini.ctl", "--port", str(busy_schd.port), "status",
                             "--watch", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            preexec_fn=_default_sigint)
    out = b""
    try:
        deadline = time.monotonic() + 15
        while out.count(HOME.encode()) < 4 and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out += rest
    text = out.decode()
    frames = text.split(HOME)[1:]
    assert len(frames) >= 4, text
    assert proc.returncode == 0, err
    for frame in frames[:3]:
        assert "token: alpha" in frame and "beta" in frame and "Ctrl-C to quit" in frame
    # Each frame is redrawn in place: cursor home, then lines that clear what the last frame left behind.
    assert text.startswith("\x1b[2J" + HOME) and "\x1b[K" in frames[0] and frames[0].endswith("\x1b[J")
    assert b"Traceback" not in err


def test_watch_json_lines_and_no_daemon_keeps_trying():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gemini.ctl", "--port", str(port), "--timeout", "0.1", "status",
                             "--json", "--watch", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            preexec_fn=_default_sigint)
    try:
        lines = []
        deadline = time.monotonic() + 15
        while len(lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(json.loads(line))
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(lines) == 2
    assert all(obj["type"] == "error" and "no answer from gem-schd" in obj["message"] for obj in lines)
    assert proc.returncode == 0


def test_hook_path(monkeypatch, tmp_path):
    lib = tmp_path / "libgemhook.so.1"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv("GEMINI_HOOK_LIB", str(lib))
    r = CliRunner().invoke(main, ["hook-path"])
    assert r.exit_code == 0 and r.output == f"{lib.resolve()}\n"
    monkeypatch.setenv("GEMINI_HOOK_LIB", str(tmp_path / "missing.so"))
    r = CliRunner().invoke(main, ["hook-path"])
    assert r.exit_code == 1
    assert "libgemhook.so.1 not found" in r.output and "missing.so" in r.output


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    trace = tmp_path / "t.json"
    trace.write_text("[\n]\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib now raises ImportError
    r = CliRunner().invoke(main, ["plot", str(trace), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 1
    assert "needs matplotlib" in r.output and "pip install" in r.output
    assert not (tmp_path / "x.png").exists()


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(5 << 30) == "5.0 GiB"
    assert format_bytes((1 << 63) - 1) == "unlimited"


def test_status_text_shows_unified_groups_memory_and_swaps():
    from gemini.ctl import format_table
    from gemini.wire.sched import StatusReply
    base = dict(min_util=0.0, max_util=1.0, share=0.0, mem_used=0, mem_limit=1 << 30, clients=1, holding=False,
                waiting=False, wait_ms=0.0, grants=3, connected=True)
    reply = StatusReply("s1", 10_000.0, "", [
        dict(base, name="dev"),
        dict(base, name="u", memory_mode="unified", managed_bytes=10 << 30, resident_bytes=0,
             swapped_in_bytes=30 << 30, swapped_out_bytes=20 << 30, swap_ms=2500.0, evictions=2)],
        device_memory=24 << 30, swap_gbps=21.5)
    text = format_table(reply, "ipc://x")
    assert "unified memory: capacity 24.0 GiB, swaps at 21.5 GB/s" in text
    lines = text.splitlines()
    head = lines.index("unified memory: capacity 24.0 GiB, swaps at 21.5 GB/s")
    assert lines[head + 1].split() == ["GROUP", "MODE", "MANAGED", "RESIDENT", "SWAPPED", "IN", "SWAPPED", "OUT",
                                       "SWAP", "TIME", "EVICTIONS"]
    assert lines[head + 2].split() == ["u", "unified", "10.0", "GiB", "0", "B", "30.0", "GiB", "20.0", "GiB",
                                       "2.5", "s", "2"]
    assert len(lines) == head + 3           # device-mode groups are not in it
    # without unified groups the table is as before
    plain = format_table(StatusReply("s1", 10_000.0, "", [dict(base, name="dev")]), "ipc://x")
    assert "unified memory" not in plain
