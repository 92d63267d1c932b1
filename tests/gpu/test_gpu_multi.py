"""On a machine with two GPUs: one gem-schd and pod manager per GPU, a process that uses both.

The hook keeps one token, one connection and one memory count per device and finds each device's pod
manager by UUID (GEMINI_POD_MANAGERS). Here GPU 0's group is capped at 0.25 with 4 GiB and GPU 1's is
uncapped with 8 GiB; a process driving both at once must be held to each device's own settings.
Skipped with fewer than two GPUs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from bench.harness import Backend, Group, last_json, read_stats
from tests.gpu.test_gpu_hook import record
from tests.native import CLIENTS_SRC, build_native

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def gpu_uuids() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60).stdout
    return [line.strip() for line in out.splitlines() if line.strip().startswith("GPU-")]


UUIDS = gpu_uuids()
needs_two = pytest.mark.skipif(len(UUIDS) < 2, reason=f"needs two GPUs, this machine has {len(UUIDS)}")


@pytest.fixture(scope="module")
def two_backends(tmp_path_factory):
    build_native()
    be0 = Backend(tmp_path_factory.mktemp("gpu0"), [Group("g", 0.0, 0.25, "4GiB")], quota_ms=50, min_quota_ms=10,
                  window_ms=2000)
    be1 = Backend(tmp_path_factory.mktemp("gpu1"), [Group("g", 0.0, 1.0, "8GiB")], quota_ms=50, min_quota_ms=10,
                  window_ms=2000)
    with be0, be1:
        yield be0, be1


def run_on_both(backends, argv: list, tmp_path, timeout: float = 300):
    be0, be1 = backends
    stats_file = tmp_path / "stats"
    env = dict(os.environ, GEMINI_STATS_FILE=str(stats_file),
               GEMINI_POD_MANAGERS=f"{UUIDS[0]}=127.0.0.1:{be0.ports['g']},{UUIDS[1]}=127.0.0.1:{be1.ports['g']}")
    proc = be0.spawn("g", [str(a) for a in argv], env=env, stdin=subprocess.DEVNULL)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return last_json(out), read_stats(stats_file)


@needs_two
def test_each_gpu_has_its_own_share_and_memory_limit(two_backends, tmp_path):
    result, stats = run_on_both(two_backends, [sys.executable, CLIENTS_SRC / "pyclient.py", "--devices", "0,1",
                                               "--seconds", 8, "--kernel-us", 1000, "--sync-every", 1,
                                               "--meminfo", "--alloc", "5GiB", "--json"], tmp_path)
    d0, d1 = result["devices"]["0"], result["devices"]["1"]
    share0, share1 = d0["onchip_ns"] / d0["wall_ns"], d1["onchip_ns"] / d1["wall_ns"]
    s = next(iter(stats.values()))
    record("two-gpus", share0=share0, share1=share1, total0=d0["mem_total"], total1=d1["mem_total"],
           alloc0=d0["alloc"]["name"], alloc1=d1["alloc"]["name"], grants=s.get("grants"),
           gate_errors=s.get("gate_errors"))
    assert (d0["mem_total"], d1["mem_total"]) == (4 * GiB, 8 * GiB), (d0, d1)
    assert d0["alloc"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY" and d1["alloc"]["result"] == 0, (d0, d1)
    assert abs(share0 - 0.25) < 0.04 and share1 > 0.85, (share0, share1)
    assert s.get("gate_errors", 0) == 0, s


TORCH_TWO = """
import json, torch
out = {}
for d in (0, 1):
    free, total = torch.cuda.mem_get_info(d)
    a = torch.randn(512, 512, device=f"cuda:{d}")
    ok = torch.allclose((a @ torch.eye(512, device=f"cuda:{d}")).cpu(), a.cpu())
    out[d] = {"total": total, "ok": bool(ok)}
try:
    torch.empty(int(6 * 2**30), dtype=torch.uint8, device="cuda:0")
    out["oom0"] = None
except torch.OutOfMemoryError:
    out["oom0"] = "OutOfMemoryError"
x = torch.empty(int(6 * 2**30), dtype=torch.uint8, device="cuda:1")
out["alloc1"] = x.numel()
print(json.dumps(out))
"""


@needs_two
def test_pytorch_on_two_gpus_sees_each_limit(two_backends, tmp_path):
    result, _ = run_on_both(two_backends, [sys.executable, "-c", TORCH_TWO], tmp_path)
    record("torch-two-gpus", **{str(k): v for k, v in result.items()})
    assert result["0"] == {"total": 4 * GiB, "ok": True}, result
    assert result["1"] == {"total": 8 * GiB, "ok": True}, result
    assert result["oom0"] == "OutOfMemoryError" and result["alloc1"] == 6 * GiB, result
