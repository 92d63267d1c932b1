"""One log line format (gemini/logs.py) for the daemons, launch-backend and the hook, in one stream."""
from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone
import json
import logging
import re
import signal
import subprocess
import sys
import time

import pytest

from bench.harness import LAUNCH_BACKEND, free_port_base
from gemini.logs import LineFormatter, level_from_flags
from tests.e2e_fixtures import clean_env, client_argv

TZ = "XYZ-05:30"     # POSIX: 5:30 h east of UTC, no daylight saving

# 2026-11-22 16:25:01.123 gem-pmgr[train] warn: message
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (?P<program>\S+) "
                  r"(?P<level>debug|info|warn|error|critical): ")


def test_the_line_format():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(LineFormatter("gem-pmgr[50%]"))     # a group name may hold '%'
    logger = logging.getLogger("test_logs.format")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("lost %d of %s", 3, "them")
        logger.error("boom")
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert [LINE.match(ln).group("program", "level") for ln in lines] == [("gem-pmgr[50%]", "warn"),
                                                                          ("gem-pmgr[50%]", "error")]
    assert lines[0].endswith(" warn: lost 3 of them")


def test_levels_from_flags():
    assert level_from_flags(0, None, logging.INFO) == logging.INFO
    assert level_from_flags(1, None, logging.INFO) == logging.DEBUG
    assert level_from_flags(0, None, logging.WARNING) == logging.WARNING
    assert level_from_flags(1, None, logging.WARNING) == logging.INFO
    assert level_from_flags(5, None, logging.WARNING) == logging.DEBUG
    assert level_from_flags(2, "error", logging.WARNING) == logging.ERROR


@pytest.mark.slow
def test_daemons_and_hook_write_one_format_into_one_stream(tmp_path, sim):
    """launch-backend with its daemons (no --log-dir: their lines go to its stderr) and a hooked program writing
    to the same file, as in a terminal: every line has the one format, and the same clock (a time zone 5:30 h
    east of UTC, so that a hook writing UTC, or a date computed wrongly, would stand out)."""
    stream = tmp_path / "stream.log"
    config = tmp_path / "rc.txt"
    config.write_text("[a]\nMaxUtil = 0.5\n")
    ports_file = tmp_path / "ports.json"
    port = free_port_base(4)
    with open(stream, "ab", buffering=0) as out:
        backend = subprocess.Popen([sys.executable, str(LAUNCH_BACKEND), "--config", str(config), "--port", str(port),
                                    "--ports-file", str(ports_file), "-v"],
                                   stdout=subprocess.DEVNULL, stderr=out, env=dict(clean_env(), TZ=TZ),
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while not ports_file.exists():
                assert backend.poll() is None and time.monotonic() < deadline, stream.read_text()
                time.sleep(0.05)
            pmgr_port = json.loads(ports_file.read_text())["a"]
            env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="a", GEMINI_POD_MANAGER_PORT=pmgr_port,
                          GEMINI_LOG_LEVEL="info", TZ=TZ)
            client = subprocess.run(client_argv("workload-procaddr", "--seconds", "0.3"), env=env,
                                    stdout=subprocess.DEVNULL, stderr=out, timeout=60)
            assert client.returncode == 0, stream.read_text()
            config.write_text("[a]\nMaxUtil = banana\n")         # a rejected edit: an error line of gem-schd
            deadline = time.monotonic() + 30
            while "banana" not in stream.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            backend.send_signal(signal.SIGINT)
            backend.wait(20)
    lines = [ln for ln in stream.read_text().splitlines() if ln.strip()]
    odd = [ln for ln in lines if not LINE.match(ln)]
    assert odd == [], "\n".join(odd[:20])
    programs = {LINE.match(ln).group("program") for ln in lines}
    assert {"launch-backend", "gem-schd", "gem-pmgr[a]"} <= programs, programs
    assert any(re.fullmatch(r"gemini\[\d+\]", p) for p in programs), programs     # the hook
    assert any(" gem-schd error: " in ln and "banana" in ln for ln in lines)
    stamps = {LINE.match(ln).group("program"): datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S.%f") for ln in lines}
    hook = next(t for p, t in stamps.items() if p.startswith("gemini["))
    assert abs((hook - stamps["gem-schd"]).total_seconds()) < 60, stamps
    expected = datetime.now(timezone(timedelta(hours=5, minutes=30))).replace(tzinfo=None)
    assert abs((hook - expected).total_seconds()) < 600, (hook, expected)


def test_debug_logging_beside_the_config_does_not_feed_itself(tmp_path):
    """launch-backend -vv writing its log into the directory of the config it watches: at -vv watchdog's line per
    file event was on, so each line was an event and each event a line (tens of thousands of lines a second, and
    gem-schd's grants ms late). Now those lines need -vvv."""
    from bench.harness import Backend, Group
    with Backend(tmp_path, [Group("a", 0.0, 1.0)], env=clean_env(), verbose=True, extra_args=["-v"]) as be:
        time.sleep(1.0)
        first = be.log_path.stat().st_size
        time.sleep(1.0)
        grown = be.log_path.stat().st_size - first
    assert be.log_path.parent == be.config_path.parent
    assert grown < 20_000, f"backend.log grew {grown} bytes in 1 s with nothing happening"
