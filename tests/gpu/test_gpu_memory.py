"""On a real GPU: frameworks see the group's MemoryLimit as the size of the GPU and cannot pass it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench.harness import Backend, Group, last_json, read_stats
from tests.gpu.test_gpu_hook import WORKLOADS, record

pytestmark = pytest.mark.gpu

GiB = 1 << 30
LIMIT = 4 * GiB


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpu-mem-backend")
    groups = [Group("mem", 0.0, 1.0, "4GiB"), Group("pair", 0.0, 1.0, "4GiB")]
    with Backend(workdir, groups, quota_ms=100, min_quota_ms=20, window_ms=2000) as be:
        yield be


def run(backend, group, argv, tmp_path, env_extra=None, timeout=600):
    stats_file = tmp_path / f"stats-{time.monotonic_ns()}"
    env = dict(os.environ, GEMINI_STATS_FILE=str(stats_file), **(env_extra or {}))
    proc = backend.spawn(group, [str(a) for a in argv], env=env, stdin=subprocess.DEVNULL)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return last_json(out), read_stats(stats_file)


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_torch_sees_the_limit_and_stops_at_it(backend, alloc_conf, tmp_path):
    env = {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf else {}
    result, stats = run(backend, "mem", [sys.executable, WORKLOADS / "torch_mem.py", LIMIT], tmp_path, env)
    record(f"torch-mem{'-expandable' if alloc_conf else ''}", **result,
           denied=sum(s.get("mem_denied", 0) for s in stats.values()))
    assert result["total"] == LIMIT, "torch.cuda.mem_get_info() must report the group's limit as the total"
    assert result["free"] <= LIMIT
    assert result["oom"] == "OutOfMemoryError"
    assert LIMIT - 512 * (1 << 20) <= result["allocated"] <= LIMIT


def test_jax_preallocates_its_fraction_of_the_limit(backend, tmp_path):
    result, _ = run(backend, "mem", [sys.executable, WORKLOADS / "jax_mem.py"], tmp_path)
    record("jax-prealloc", **result)
    assert result["bytes_limit"] is not None
    # XLA's default client preallocates 75% of what the device reports as its memory
    assert 0.70 * LIMIT <= result["bytes_limit"] <= 0.80 * LIMIT, result


@pytest.mark.parametrize("mode", ["default", "async"])
def test_cupy_pools_respect_the_limit(backend, mode, tmp_path):
    result, stats = run(backend, "mem", [sys.executable, WORKLOADS / "cupy_mem.py", LIMIT, mode], tmp_path)
    record(f"cupy-{mode}", **result)
    assert result["oom"] == "OutOfMemoryError"
    assert result["allocated"] <= LIMIT
    assert result["total"] == LIMIT


def test_nvml_inside_the_group_shows_the_limit(backend, tmp_path):
    result, _ = run(backend, "mem", [sys.executable, WORKLOADS / "nvml_mem.py"], tmp_path)
    record("pynvml", v1_total=result["v1"]["total"], v2=str(result["v2"])[:200])
    assert result["v1"]["total"] == LIMIT
    assert result["v1"]["free"] <= LIMIT
    if isinstance(result["v2"], dict):
        assert result["v2"]["total"] == LIMIT


def test_nvidia_smi_inside_the_group(backend, tmp_path):
    """nvidia-smi inside a group reports the group's limit as the GPU's memory (it reaches NVML through dlsym)."""
    proc = backend.spawn("mem", ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
                         stdin=subprocess.DEVNULL)
    out, err = proc.communicate(timeout=60)
    record("nvidia-smi", output=out.strip()[:100], rc=proc.returncode)
    assert proc.returncode == 0, err
    total_mib = int(out.strip().splitlines()[0].split(",")[0])
    assert total_mib == LIMIT >> 20, out


def test_two_processes_of_one_group_share_its_limit(backend, tmp_path):
    # a pipe on stdin: the holder keeps its memory until we close it
    holder = backend.spawn("pair", [sys.executable, WORKLOADS / "torch_mem.py", LIMIT, 3 * GiB],
                           stdin=subprocess.PIPE)
    try:
        line = holder.stdout.readline()
        assert json.loads(line)["held"] == 3 * GiB, line + holder.stderr.read()[-2000:]
        second, _ = run(backend, "pair", [sys.executable, WORKLOADS / "torch_mem.py", LIMIT, 3 * GiB], tmp_path)
        assert second.get("oom") == "OutOfMemoryError", "the group's limit is shared: 3 + 3 GiB > 4 GiB"
    finally:
        holder.stdin.close()
        holder.wait(60)
    t0 = time.monotonic()
    third, _ = run(backend, "pair", [sys.executable, WORKLOADS / "torch_mem.py", LIMIT, 3 * GiB], tmp_path)
    record("pair", second=second, third=third, after_s=time.monotonic() - t0)
    assert third["held"] == 3 * GiB, "memory must come back when the holder exits"
