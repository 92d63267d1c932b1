"""gem-schd never blocks on its config: a config replaced by a FIFO, or by a symlink to /dev/zero, is an error that
names the file, the last good config stays in force, grants keep flowing and the daemon's memory stays flat.

Reads happen on a thread of their own (gemini/reload.py) and are bounded (gemini.config.read_config_bytes).
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gemini import transport
from gemini.config import MAX_CONFIG_BYTES, ConfigError, read_config_bytes
from gemini.wire import sched as sm
from tests.schd_inproc import FakePodManager

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_read_config_bytes_refuses_what_is_not_a_plain_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"^{fifo}: is a FIFO, not a regular file"):
        read_config_bytes(fifo)             # and returns at once: no writer is waited for
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=f"^{zero}: is a character device, not a regular file"):
        read_config_bytes(zero)
    with pytest.raises(ConfigError, match="is a directory"):
        read_config_bytes(tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"#" * 2048)
    with pytest.raises(ConfigError, match="is 2048 bytes, more than a config can be"):
        read_config_bytes(big, max_bytes=1024)
    assert read_config_bytes(big, max_bytes=4096) == b"#" * 2048
    assert MAX_CONFIG_BYTES >= 1 << 20      # the fuzz tests' megabyte of '[' is still a parse error


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class GrantLoop(threading.Thread):
    """A pod manager of group `a` that asks for the token, holds it 2 ms, gives it back, forever: the time of each
    grant is recorded (a scheduler stuck on its config grants nothing)."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.grants: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with FakePodManager(self.endpoint) as p:
            assert isinstance(p.request(sm.Hello(group="a", pid=1), 5), sm.Welcome)
            while not self.stop.is_set():
                p.send(sm.TokenRequest(group="a"))
                grant = p.recv_type(sm.Grant, 1.0)
                if grant is None:
                    continue
                self.grants.append(time.monotonic())
                time.sleep(0.002)
                p.send(sm.TokenRelease(group="a", token_seq=grant.token_seq))

    def longest_gap(self, since: float) -> float:
        times = [t for t in self.grants if t >= since] + [time.monotonic()]
        return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("inf")


def _limit_memory():
    # Protection for the machine when this test runs against a reader without a size limit: the daemon dies
    # of MemoryError (and the test fails) instead of eating all memory.
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_a_fifo_or_dev_zero_config_neither_blocks_nor_grows_gem_schd(tmp_path):
    path = tmp_path / "resource-config.txt"
    path.write_text("[a]\nMaxUtil = 1\n[b]\nMaxUtil = 0.5\n")
    ipc = tmp_path / "ipc"
    log_path = tmp_path / "gem-schd.log"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "--ipc-dir", str(ipc), "-f", str(path),
                                 "-q", "5", "-m", "2", "-w", "1000", "--log-level", "info"], stdout=log, stderr=log,
                                env=env, preexec_fn=_limit_memory)
    endpoint = transport.ipc_endpoint(str(transport.scheduler_socket(ipc)))
    loop = GrantLoop(endpoint)
    try:
        deadline = time.monotonic() + 15
        while "listening on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        loop.start()
        time.sleep(1.0)
        rss_before = _rss_kib(proc.pid)

        def replace(make, expect: str, groups=(("a", 1.0), ("b", 0.5))) -> None:
            seen = log_path.read_text().count(expect)
            t0 = time.monotonic()
            tmp = path.with_name("new")
            make(tmp)
            os.replace(tmp, path)
            while log_path.read_text().count(expect) <= seen:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                assert time.monotonic() - t0 < 5, f"{expect!r} never logged:\n{log_path.read_text()[-2000:]}"
                time.sleep(0.02)
            time.sleep(0.5)                 # grants go on meanwhile, at their usual pace
            assert loop.longest_gap(t0) < 0.25, f"no grant for {loop.longest_gap(t0):.2f} s"
            with FakePodManager(endpoint) as peer:
                reply = peer.request(sm.StatusRequest(), 2)
                assert isinstance(reply, sm.StatusReply), reply
                assert [(g["name"], g["max_util"]) for g in reply.groups] == list(groups)

        # (the same error twice in a row is logged once: the cases alternate)
        replace(os.mkfifo, f"{path}: is a FIFO, not a regular file")
        replace(lambda p: p.symlink_to("/dev/zero"), f"{path}: is a character device, not a regular file")
        # a FIFO with a writer that never stops
        fifo = path.with_name("fifo2")
        os.mkfifo(fifo)
        writer = subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('[x]\\n' * 999)"],
                                  stdout=os.open(fifo, os.O_RDWR))
        try:
            replace(lambda p: p.symlink_to(fifo), f"{path}: is a FIFO, not a regular file")
        finally:
            writer.kill()
        rss_after = _rss_kib(proc.pid)
        assert rss_after - rss_before < 16 * 1024, (rss_before, rss_after)
        # and a good config applies again
        replace(lambda p: p.write_text("[a]\nMaxUtil = 1\n[b]\nMaxUtil = 0.5\n[c]\n"), "config reloaded",
                (("a", 1.0), ("b", 0.5), ("c", 1.0)))
    finally:
        loop.stop.set()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:     # stuck (a reader that blocks): do not leave it behind
            proc.kill()
            proc.wait()
        loop.join(5)
    assert "Traceback" not in log_path.read_text()


def test_a_slow_read_does_not_stall_the_scheduler(tmp_path, monkeypatch):
    """The read runs on the reader thread: while it takes a whole second (a stuck network file system, say), the
    daemon answers at once."""
    import gemini.reload
    from gemini.config import load_config
    from tests.schd_inproc import DaemonThread
    path = tmp_path / "resource-config.txt"
    path.write_text("[a]\n")
    started = threading.Event()

    def slow_load(p):
        started.set()
        time.sleep(1.0)
        return load_config(p)

    monkeypatch.setattr(gemini.reload, "load_config", slow_load)
    with DaemonThread(load_config(path), config_path=str(path), debounce_s=0.01, settle_s=0.01) as d:
        with FakePodManager(d.endpoint) as peer:
            path.write_text("[a]\n[b]\n")
            assert started.wait(5)
            t0 = time.monotonic()
            assert isinstance(peer.request(sm.StatusRequest(), 2), sm.StatusReply)
            assert time.monotonic() - t0 < 0.3
            deadline = time.monotonic() + 5
            while [g["name"] for g in peer.request(sm.StatusRequest(), 2).groups] != ["a", "b"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
