"""On real GPUs: programs the field runs into, under the hook (issue 17's compatibility rows).

* NCCL (`-k nccl`): a torch.distributed all-reduce of 256 MiB with two ranks, each on its own GPU in a group of
  its own (one backend per GPU, the process maps each device to its pod manager by UUID), NCCL_NVLS_ENABLE=0.
  The result must be right, NCCL's buffers (cuMemCreate: NCCL_CUMEM_ENABLE=1) counted against the rank's group,
  and a cap (MaxUtil 0.3 on both GPUs) must slow a long all-reduce loop against the uncapped run; with
  `Slots = aligned` the loop runs faster than with free slots (still far below its cap).
  Skipped with fewer than two GPUs.
* Hugging Face (`-k hf`): transformers generation with a static KV cache and CUDA graphs
  (torch.compile reduce-overhead) in a capped group: the same tokens as without the hook, the GPU share the hook
  measured against the cap, and the memory.

Run: make gpu-check GPU_CHECK_ARGS="--steps tests -k nccl" (or -k hf); each test writes its row to the report.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from bench.harness import Backend, Group, last_json, read_stats
from tests.gpu.test_gpu_hook import WORKLOADS, record
from tests.gpu.test_gpu_multi import UUIDS

pytestmark = pytest.mark.gpu

GiB = 1 << 30
needs_two = pytest.mark.skipif(len(UUIDS) < 2, reason=f"needs two GPUs, this machine has {len(UUIDS)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allreduce(tmp_path, max_util: float, seconds: float, slots: str = "free") -> list[dict]:
    """Two ranks, rank r on GPU r, in the group of GPU r's own backend (one gem-schd and pod manager per GPU, as in
    test_gpu_multi; both GPUs stay visible, so NCCL can use P2P, and the hook finds each device's pod manager by
    UUID); their JSON lines, by rank."""
    with Backend(tmp_path / f"gpu0-{max_util}-{slots}", [Group("g", 0.0, max_util, "16GiB", slots=slots)],
                 quota_ms=50, min_quota_ms=10, window_ms=2000) as be0, \
            Backend(tmp_path / f"gpu1-{max_util}-{slots}", [Group("g", 0.0, max_util, "16GiB", slots=slots)],
                    quota_ms=50, min_quota_ms=10, window_ms=2000) as be1:
        port = free_port()
        managers = f"{UUIDS[0]}=127.0.0.1:{be0.ports['g']},{UUIDS[1]}=127.0.0.1:{be1.ports['g']}"
        procs = []
        for rank, (be, group) in enumerate(((be0, "g"), (be1, "g"))):
            env = dict(os.environ, NCCL_NVLS_ENABLE="0", NCCL_CUMEM_ENABLE="1", GEMINI_POD_MANAGERS=managers,
                       GEMINI_STATS_FILE=str(tmp_path / f"stats-{max_util}-{slots}-{rank}"))
            procs.append(be.spawn(group, [sys.executable, str(WORKLOADS / "nccl_allreduce.py"), str(rank), "2",
                                          str(port), str(seconds)], env=env, stdin=subprocess.DEVNULL))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-4000:]
            results.append(last_json(out))
        return results


@needs_two
def test_nccl_allreduce_under_the_hook_is_correct_counted_and_capped(tmp_path):
    free = allreduce(tmp_path, 1.0, 10.0)
    capped = allreduce(tmp_path, 0.3, 10.0)
    aligned = allreduce(tmp_path, 0.3, 10.0, slots="aligned")
    ratio = min(r["busbw_gbs"] for r in capped) / min(r["busbw_gbs"] for r in free)
    ratio_aligned = min(r["busbw_gbs"] for r in aligned) / min(r["busbw_gbs"] for r in free)
    record("nccl-allreduce", busbw_uncapped=[r["busbw_gbs"] for r in free],
           busbw_capped_0_3=[r["busbw_gbs"] for r in capped], ratio=ratio,
           busbw_capped_0_3_aligned=[r["busbw_gbs"] for r in aligned], ratio_aligned=ratio_aligned,
           nccl_counted_mib=[r["nccl_counted"] / 2**20 for r in free],
           group_used_mib=[r["after"]["group_used"] / 2**20 for r in free], total=[r["total"] for r in free])
    for r in free + capped + aligned:
        assert r["correct"], r
        assert r["total"] == 16 * GiB, "each rank sees its group's limit as its GPU's memory"
        assert r["after"]["group_used"] <= 16 * GiB
    # NCCL's buffers (cuMemCreate, mapped and released at once) are counted against the rank's group
    assert all(r["nccl_counted"] >= 4 << 20 for r in free), [r["nccl_counted"] for r in free]
    # a cap of 0.3 on both GPUs slows a long loop of all-reduces
    assert ratio < 0.6, (ratio, free, capped)
    # Slots = aligned: both ranks hold their GPUs at the same time. On two H200s that took the capped loop from
    # 0.004 to 0.027 of uncapped, still far from its cap of 0.3 (docs/benchmarks.md: a rank that launched one
    # all-reduce more than its peer before the window closed drains until the peer's next window); this keeps
    # alignment from regressing, it does not claim the cap is reached
    assert ratio_aligned >= 2 * ratio, (ratio_aligned, ratio, aligned)


def run_hf(be: Backend | None, group: str, tmp_path, repeats: int) -> tuple[dict, dict]:
    argv = [sys.executable, str(WORKLOADS / "hf_generate.py"), str(repeats)]
    stats_file = tmp_path / f"stats-hf-{group}-{time.monotonic_ns()}"
    env = dict(os.environ, GEMINI_STATS_FILE=str(stats_file))
    if be is None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        proc = be.spawn(group, argv, env=env, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=900)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, err[-4000:]
    stats = read_stats(stats_file) if be is not None else {}
    # the stats file prints the measured GPU time as used_ms (a key that is not there would make the share 0 and
    # the cap check below pass whatever happened: checked that it is present)
    assert be is None or all("used_ms" in s for s in stats.values()), stats
    used_ms = sum(s.get("used_ms", 0) for s in stats.values())
    return last_json(out), {"share": used_ms / (wall * 1e3), "grants": sum(s.get("grants", 0) for s in stats.values()),
                            "wall_s": wall}


def test_hf_generation_with_static_cache_and_cuda_graphs_in_a_capped_group(tmp_path):
    with Backend(tmp_path / "be", [Group("hf", 0.0, 1.0, "8GiB"), Group("hfcap", 0.0, 0.3, "8GiB")],
                 quota_ms=50, min_quota_ms=10, window_ms=2000) as be:
        native, _ = run_hf(None, "", tmp_path, 20)
        free, free_stats = run_hf(be, "hf", tmp_path, 20)
        capped, capped_stats = run_hf(be, "hfcap", tmp_path, 20)
    record("hf-generate", tokens_per_s_native=native["tokens_per_s"], tokens_per_s_uncapped=free["tokens_per_s"],
           tokens_per_s_capped_0_3=capped["tokens_per_s"], share_capped=capped_stats["share"],
           share_uncapped=free_stats["share"], grants_capped=capped_stats["grants"],
           peak_reserved_mib=capped["peak_reserved"] / 2**20, device_total=capped["device_total"])
    assert free["tokens"] == native["tokens"] and capped["tokens"] == native["tokens"], \
        "the same tokens with the hook, capped or not, as without it"
    assert free["repeat_identical"] and capped["repeat_identical"]
    assert capped["device_total"] == 8 * GiB and capped["peak_reserved"] <= 8 * GiB
    assert capped_stats["grants"] > 0, "the capped group's launches (graph replays) were gated"
    # the GPU time the hook measured stays within the cap (the whole process's wall time: a lower bound)
    assert capped_stats["share"] <= 0.3 + 0.05, capped_stats
