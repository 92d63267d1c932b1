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


# --- issue 17: VMM memory and cudaDeviceReset --------------------------------------------------------------

MiB = 1 << 20


def group_used(backend, group: str) -> int:
    """The group's memory as its pod manager counts it (asked as a fresh client of the group)."""
    from gemini.wire import hook as hp
    from tests.pmgr_helpers import BlockingHook
    probe = BlockingHook(backend.ports[group], timeout=5)
    try:
        assert isinstance(probe.call(hp.Hello(pid=os.getpid(), pod_name=group)), hp.HelloAck)
        return probe.call(hp.MemInfo()).used
    finally:
        probe.close()


def test_mapped_vmm_memory_is_counted_until_unmapped(backend):
    """cuMemCreate 3 GiB, map it, cuMemRelease the handle (PyTorch's and NCCL's pattern): the driver keeps the
    memory, and the group's count keeps it until the unmap; meanwhile 2 GiB more do not fit in the 4 GiB group.
    (Before the fix the release gave it back and the group could hold 5 GiB.)"""
    from tests.native import CLIENTS_SRC
    holder = backend.spawn("pair", [sys.executable, str(CLIENTS_SRC / "memholder.py")], stdin=subprocess.PIPE)

    def ask(cmd: str) -> list[int]:
        holder.stdin.write(cmd + "\n")
        holder.stdin.flush()
        return [int(x) for x in holder.stdout.readline().split()]
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()[-2000:]
        base = group_used(backend, "pair")
        steps = {"vmm": ask(f"vmm {3 * GiB}"), "used_mapped": group_used(backend, "pair") - base,
                 "alloc_2g": ask(f"alloc {2 * GiB}"), "retain": ask("retain 0"), "unmap": ask("unmap 0"),
                 "used_retained": group_used(backend, "pair") - base, "release": ask("release 0"),
                 "used_after": group_used(backend, "pair") - base, "alloc_2g_after": ask(f"alloc {2 * GiB}")}
        record("vmm-mapped", **steps)
        assert steps["vmm"] == [0] * 5, steps
        assert steps["used_mapped"] == 3 * GiB, steps
        assert steps["alloc_2g"] == [2], steps          # CUDA_ERROR_OUT_OF_MEMORY: 3 + 2 > 4 GiB
        assert steps["used_retained"] == 3 * GiB, steps  # the retained handle keeps it after the unmap
        assert steps["used_after"] == 0 and steps["alloc_2g_after"] == [0], steps
    finally:
        holder.stdin.close()
        holder.wait(60)


def test_cuda_device_reset_gives_the_memory_back(backend, tmp_path):
    """cudaDeviceReset (cuda-bindings: a static cudart, cuDevicePrimaryCtxReset_v2 from cuGetProcAddress) frees the
    3 GiB the process held: the group's count drops, and 3 GiB fit in the 4 GiB group again (before the fix the count
    kept them: a false out-of-memory)."""
    result, _ = run(backend, "mem", [sys.executable, WORKLOADS / "device_reset.py", 3 * GiB], tmp_path)
    record("cuda-device-reset", **result)
    assert result["total"] == LIMIT
    assert result["used_holding"] >= 3 * GiB
    assert result["used_after_reset"] < 256 * MiB, result
    assert result["second"] == "ok", result
