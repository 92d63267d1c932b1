"""On a real GPU: gem-schd without --device-memory takes the card's memory less a reserve as the capacity of its
unified groups, read through NVML (gemini/scheduler/capacity.py). Nothing is allocated on the GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gemini.scheduler.capacity import capacity_for
from tests.gpu.test_gpu_hook import record

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def smi_total_bytes() -> int:
    """nvidia-smi's memory.total of the GPU gem-schd reads: the first of CUDA_VISIBLE_DEVICES, else GPU 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    out = subprocess.run(["nvidia-smi", "-i", first, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.split()[0]) << 20      # MiB


def test_gem_schd_takes_the_cards_memory_less_a_reserve(tmp_path):
    (tmp_path / "resource-config.txt").write_text("[u]\nMemoryMode = unified\n[d]\n")
    ipc = tmp_path / "ipc"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "--ipc-dir", str(ipc), "-p",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env)
    reply = None
    try:
        deadline = time.monotonic() + 60
        while reply is None and time.monotonic() < deadline and proc.poll() is None:
            out = subprocess.run([sys.executable, "-m", "gemini.ctl", "--ipc-dir", str(ipc), "status", "--json"],
                                 capture_output=True, text=True, timeout=30, env=env)
            if out.returncode == 0:
                reply = json.loads(out.stdout)
            else:
                time.sleep(0.2)
        text = subprocess.run([sys.executable, "-m", "gemini.ctl", "--ipc-dir", str(ipc), "status"],
                              capture_output=True, text=True, timeout=30, env=env).stdout
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert reply is not None, err[-4000:]
    total = smi_total_bytes()
    record("gem-schd-capacity", capacity=reply["device_memory"], source=reply["device_memory_source"],
           nvml_total=reply["device_memory_total"], smi_total=total)
    assert reply["device_memory_source"] == "probe", err[-4000:]
    assert 0.80 * total <= reply["device_memory"] <= total, (reply["device_memory"], total)
    assert reply["device_memory"] == capacity_for(reply["device_memory_total"])
    assert "less a reserve of" in text, text
