"""The simulated driver and a stopped process: on a GPU the kernels of a process that is stopped (SIGSTOP, a
debugger) still run out and other processes' kernels follow; the simulator must not hold the device for it."""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

import native


@pytest.fixture(scope="module", autouse=True)
def _built():
    native.build_native()


def test_a_stopped_process_does_not_hold_the_device(tmp_path):
    env = native.sim_env(tmp_path / "simcuda.shm", trace=tmp_path / "kernels.trace")
    # back to back 50 ms kernels: stopped, it owns the device lock or waits first in line for it
    hog = subprocess.Popen(native.client_cmd("workload-linked", "--kernels", 200, "--kernel-us", 50_000, "--json"),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        trace = tmp_path / "kernels.trace"
        while not (trace.exists() and trace.read_text().count("\n") >= 2):
            assert hog.poll() is None and time.monotonic() < deadline, hog.communicate()
            time.sleep(0.01)
        hog.send_signal(signal.SIGSTOP)
        other = subprocess.run(native.client_cmd("workload-linked", "--kernels", 5, "--kernel-us", 1000, "--json"),
                               env=env, capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
        assert json.loads(other.stdout.strip().splitlines()[-1])["kernels_done"] == 5
    finally:
        hog.send_signal(signal.SIGCONT)
        hog.kill()
        hog.communicate()
