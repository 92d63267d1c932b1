"""gem-schd's capacity for unified groups without --device-memory (gemini/scheduler/capacity.py): the GPU's
memory less a reserve, read through a device memory probe (NVML in gem-schd, a fake here), when a unified group
is configured; the flag wins; with no answer, one warning and no management (the old behaviour)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from gemini.config import parse_config
from gemini.ctl import format_table
from gemini.scheduler.capacity import GiB, NvmlProbe, ProbeError, capacity_for, device_from_env, reserve_for
from gemini.wire.sched import StatusReply
from tests.e2e_fixtures import wait_for
from tests.schd_inproc import DaemonThread

import native

UNIFIED = parse_config("[u]\nMemoryMode = unified\n[d]\n", "rc.txt")
DEVICE_ONLY = parse_config("[d]\n", "rc.txt")


class FakeProbe:
    """A card of `total` bytes (None: the probe cannot read it); counts its calls."""

    def __init__(self, total: int | None, delay_s: float = 0.0):
        self.total, self.delay_s, self.calls = total, delay_s, 0
        self.threads: list[str] = []

    def describe(self) -> str:
        return "fake"

    def total_bytes(self) -> int:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.total is None:
            raise ProbeError("no card in this test")
        return self.total


def status(d: DaemonThread) -> StatusReply:
    return d.call(d.daemon.status_reply)


@pytest.fixture
def daemons():
    started = []

    def make(config, **kw) -> DaemonThread:
        d = DaemonThread(config, **kw).start()
        started.append(d)
        return d
    yield make
    for d in started:
        d.stop()


def test_the_reserve_is_a_gib_or_five_percent():
    assert reserve_for(80 * GiB) == 4 * GiB and capacity_for(80 * GiB) == 76 * GiB
    assert reserve_for(16 * GiB) == 1 * GiB and capacity_for(16 * GiB) == 15 * GiB      # 5% < 1 GiB
    assert capacity_for(1 * GiB) == 0                   # smaller than the reserve: nothing to manage


def test_without_the_flag_the_capacity_is_the_card_less_the_reserve(daemons):
    probe = FakeProbe(80 * GiB)
    d = daemons(UNIFIED, memory_probe=probe)
    reply = status(d)
    assert (reply.device_memory, reply.device_memory_source, reply.device_memory_total) == \
        (76 * GiB, "probe", 80 * GiB)
    assert d.daemon.residency.capacity == 76 * GiB and probe.calls == 1
    assert probe.threads[0] != "gem-schd-test"      # read off the event loop's thread
    text = format_table(reply, "tcp://x")
    assert "capacity 76.0 GiB (the GPU's 80.0 GiB less a reserve of 4.0 GiB)" in text


def test_the_flag_wins(daemons):
    probe = FakeProbe(80 * GiB)
    d = daemons(UNIFIED, device_memory=24 * GiB, memory_probe=probe)
    reply = status(d)
    assert (reply.device_memory, reply.device_memory_source) == (24 * GiB, "flag") and probe.calls == 0
    assert "capacity 24.0 GiB (--device-memory)" in format_table(reply, "tcp://x")


def test_no_probe_answer_warns_once_and_manages_nothing(daemons, caplog):
    caplog.set_level(logging.WARNING, logger="gemini.scheduler")
    for probe in (None, FakeProbe(None), FakeProbe(512 << 20)):
        caplog.clear()
        d = daemons(UNIFIED, memory_probe=probe)
        reply = status(d)
        assert (reply.device_memory, reply.device_memory_source) == (0, "")
        assert d.daemon.residency.capacity is None          # unified groups run on page faults, as before
        warnings = [r.getMessage() for r in caplog.records if "--device-memory" in r.getMessage()]
        assert len(warnings) == 1 and "page faults" in warnings[0], warnings
        assert "not managed" in format_table(reply, "tcp://x")
        # a reload does not ask (or warn) again
        more = parse_config("[u]\nMemoryMode = unified\n[v]\nMemoryMode = unified\n", "rc.txt")
        d.call(lambda d=d, more=more: d.daemon.apply_config(more))
        time.sleep(0.05)
        assert len([r for r in caplog.records if "--device-memory" in r.getMessage()]) == 1
        assert probe is None or probe.calls == 1


def test_a_probe_that_never_answers_does_not_hold_up_gem_schd(daemons, caplog, monkeypatch):
    """A wedged driver can block nvmlInit for good: gem-schd waits PROBE_TIMEOUT_S at most, then serves with
    nothing managed (the warning says why), and its stop does not wait for the probe's thread either."""
    import gemini.scheduler.daemon as daemon_mod
    monkeypatch.setattr(daemon_mod, "PROBE_TIMEOUT_S", 0.3)
    caplog.set_level(logging.WARNING, logger="gemini.scheduler")
    t0 = time.monotonic()
    d = daemons(UNIFIED, memory_probe=FakeProbe(80 * GiB, delay_s=60.0))
    reply = status(d)
    assert time.monotonic() - t0 < 10.0
    assert d.daemon.residency.capacity is None and reply.device_memory_source == ""
    warnings = [r.getMessage() for r in caplog.records if "--device-memory" in r.getMessage()]
    assert len(warnings) == 1 and "no answer within 0.3 s" in warnings[0], warnings
    t1 = time.monotonic()
    d.stop()
    assert time.monotonic() - t1 < 10.0


def test_no_unified_group_no_probe_until_a_reload_adds_one(daemons):
    probe = FakeProbe(40 * GiB, delay_s=0.05)
    d = daemons(DEVICE_ONLY, memory_probe=probe)
    assert probe.calls == 0 and status(d).device_memory == 0
    d.call(lambda: d.daemon.apply_config(UNIFIED))
    wait_for(lambda: status(d).device_memory == 38 * GiB, timeout=5, what="the probed capacity")
    assert status(d).device_memory_source == "probe" and probe.calls == 1


# --- NvmlProbe on the simulated libnvidia-ml.so.1 --------------------------------------------------------------

SIM_UUID = "GPU-516d4375-6461-4a40-8000-73696d677001"     # the simulator's device 1


@pytest.fixture
def sim_nvml(hook_lib, monkeypatch) -> str:
    monkeypatch.setenv("SIMNVML_DEVICES", "2")
    monkeypatch.setenv("SIMCUDA_MEM_BYTES", str(24 * GiB))
    return str(native.sim_lib_dir() / "libnvidia-ml.so.1")


def test_nvml_probe_reads_the_card_by_index_and_uuid(sim_nvml):
    assert NvmlProbe(index=1, library=sim_nvml).total_bytes() == 24 * GiB
    assert NvmlProbe(uuid=SIM_UUID, library=sim_nvml).total_bytes() == 24 * GiB
    with pytest.raises(ProbeError, match="nvmlDeviceGetHandleByUUID.*Not Found"):
        NvmlProbe(uuid="GPU-00000000-0000-0000-0000-000000000000", library=sim_nvml).total_bytes()
    with pytest.raises(ProbeError, match="nvmlDeviceGetHandleByIndex_v2"):
        NvmlProbe(index=7, library=sim_nvml).total_bytes()
    with pytest.raises(ProbeError, match="cannot load"):
        NvmlProbe(index=0, library="libnvidia-ml-not-here.so.1").total_bytes()


def test_the_probe_follows_cuda_visible_devices():
    assert device_from_env({}) == (None, 0)
    assert device_from_env({"CUDA_VISIBLE_DEVICES": "3,1"}) == (None, 3)
    assert device_from_env({"CUDA_VISIBLE_DEVICES": f"{SIM_UUID},0"}) == (SIM_UUID, 0)


def test_gem_schd_takes_the_simulated_card_without_the_flag(sim_nvml, tmp_path):
    """gem-schd itself (the CLI, NVML through ctypes): a unified group, no --device-memory, the simulated NVML
    on the library path: status says the capacity and where it came from."""
    (tmp_path / "resource-config.txt").write_text("[u]\nMemoryMode = unified\n")
    env = dict(os.environ, PYTHONPATH=str(native.REPO_ROOT), LD_LIBRARY_PATH=str(native.sim_lib_dir()),
               CUDA_VISIBLE_DEVICES="1")
    ipc = tmp_path / "ipc"
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "--ipc-dir", str(ipc), "-p",
                             str(tmp_path)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        def ask() -> dict | None:
            out = subprocess.run([sys.executable, "-m", "gemini.ctl", "--ipc-dir", str(ipc), "status", "--json"],
                                 capture_output=True, text=True, timeout=30, env=env)
            return json.loads(out.stdout) if out.returncode == 0 else None
        wait_for(lambda: ask() is not None, timeout=20, what="gem-schd answering")
        reply = ask()
        assert reply is not None
        assert (reply["device_memory"], reply["device_memory_source"], reply["device_memory_total"]) == \
            (capacity_for(24 * GiB), "probe", 24 * GiB)      # less 5% = 1.2 GiB
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "NVML, GPU index 1" in err, err
