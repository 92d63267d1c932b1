"""One default address and port for every program (gemini/transport.py), the hook's C default included."""
from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from gemini import transport
from gemini.ctl import main as ctl_main
from gemini.launch import backend
from gemini.podmgr.cli import main as pmgr_main
from gemini.scheduler.cli import main as schd_main

REPO = Path(__file__).resolve().parent.parent


def _default(command, option: str) -> object:
    return next(p.default for p in command.params if p.name == option)


def test_every_program_has_the_same_defaults():
    assert transport.DEFAULT_POD_MANAGER_PORT == transport.DEFAULT_SCHEDULER_PORT + 1    # launch-backend's first
    assert _default(schd_main, "port") == transport.DEFAULT_SCHEDULER_PORT
    assert _default(pmgr_main, "port") == transport.DEFAULT_POD_MANAGER_PORT
    assert _default(pmgr_main, "scheduler_port") == transport.DEFAULT_SCHEDULER_PORT
    assert backend.DEFAULT_TCP_PORT == transport.DEFAULT_SCHEDULER_PORT
    out = CliRunner().invoke(ctl_main, ["--help"]).output
    assert f"(default {transport.DEFAULT_SCHEDULER_PORT})" in out.replace("\n", " ").replace("  ", " ")
    # the hook (C) cannot import them: its default must be the same number
    settings = (REPO / "hook" / "settings.c").read_text()
    assert re.search(r"\.pmgr_port = (\d+),", settings).group(1) == str(transport.DEFAULT_POD_MANAGER_PORT)
    assert f'.pmgr_ip = "{transport.DEFAULT_IP}"' in settings


def test_addresses_are_written_one_way():
    assert transport.host_port("::1", 7) == "[::1]:7" and transport.host_port("gpu-node", 7) == "gpu-node:7"
    assert transport.tcp_endpoint("::1", 50051) == "tcp://[::1]:50051"
    assert transport.tcp_endpoint("127.0.0.1", "*") == "tcp://127.0.0.1:*"
