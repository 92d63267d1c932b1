"""Kubernetes end to end on a real GPU: the fake kubelet, the API server double, the real gem-node (device plugins,
pod watch, gem-schd, a pod manager per container) and the real hook, with PyTorch and spin workloads started
with exactly the env their Allocate answers gave, inside cgroups shaped as the kubelet makes them (real cgroups
where this process may create them; else fixture /proc files, and the report says so).

Needs the k8s wheels (grpcio, protobuf, kubernetes and their dependencies: docs/kubernetes.md); skipped, saying
which is missing, otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("grpc", reason="grpcio is not installed (bring the k8s wheels: docs/kubernetes.md)")
pytest.importorskip("kubernetes", reason="kubernetes is not installed (bring the k8s wheels: docs/kubernetes.md)")

from gemini.k8s import devices as dv  # noqa: E402
from gemini.k8s.service import discover_gpus  # noqa: E402
from tests.gpu.test_gpu_hook import record  # noqa: E402
from tests.k8s_cluster import Cluster  # noqa: E402
from tests.native import CLIENTS_SRC  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "gemini" / "lib" / "libgemhook.so.1"
PCT, MEM = dv.RESOURCE_PERCENT, dv.RESOURCE_MEMORY
GiB = 1 << 30

TORCH = r"""
import json, sys, torch
limit_gib = float(sys.argv[1])
free, total = torch.cuda.mem_get_info()
a = torch.randn(2048, 2048, device="cuda")
ok = bool(torch.allclose((a @ torch.eye(2048, device="cuda")).cpu(), a.cpu()))
try:
    torch.empty(int((limit_gib + 1) * 2**30), dtype=torch.uint8, device="cuda")
    over = "allocated"
except torch.OutOfMemoryError:
    over = "OutOfMemoryError"
x = torch.empty(int((limit_gib - 1) * 2**30), dtype=torch.uint8, device="cuda")
print(json.dumps({"total": total, "matmul_ok": ok, "over_limit": over, "within": x.numel()}))
"""


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMINI_") and k != "LD_PRELOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p])
    return env


def run(c: Cluster, uid: str, opts, argv: list, timeout: float = 300) -> dict:
    env = c.container_env(opts, base_env())
    env["CUDA_VISIBLE_DEVICES"] = opts.envs["NVIDIA_VISIBLE_DEVICES"]   # what the NVIDIA runtime would isolate
    p = subprocess.run(c.in_pod(uid, [str(a) for a in argv]), env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}\n{c.logs()}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def start(c: Cluster, uid: str, opts, argv: list) -> subprocess.Popen:
    env = c.container_env(opts, base_env())
    env["CUDA_VISIBLE_DEVICES"] = opts.envs["NVIDIA_VISIBLE_DEVICES"]
    return subprocess.Popen(c.in_pod(uid, [str(a) for a in argv]), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_pods_on_a_real_gpu_get_their_shares_and_limits(tmp_path):
    assert HOOK.is_file() and b"GEMINI_IPC_DIR" in HOOK.read_bytes(), f"{HOOK}: build it with make hook"
    gpu = discover_gpus()[0]
    with Cluster(tmp_path, (gpu,), hook_source=HOOK, schd_args=["-q", "50", "-m", "20", "-w", "10000"]) as c:
        mode = c.cgroups.mode
        print(f"identity through {mode}")
        uid_a, a = c.admit_pod("team-a", "capped", {PCT: 10, MEM: 16}, {"gemini.io/max-util": "0.3"})   # 4 GiB
        uid_b, b = c.admit_pod("team-b", "wider", {PCT: 20, MEM: 32}, {"gemini.io/max-util": "0.6"})    # 8 GiB

        torch_a = run(c, uid_a, a, [sys.executable, "-c", TORCH, 4])
        spin = [sys.executable, CLIENTS_SRC / "pyclient.py", "--seconds", 10, "--kernel-us", 1000, "--sync-every", 1,
                "--json"]
        pa, pb = start(c, uid_a, a, spin), start(c, uid_b, b, spin)
        outs = [p.communicate(timeout=300) for p in (pa, pb)]
        assert pa.returncode == 0 and pb.returncode == 0, (outs, c.logs())
        ra, rb = (json.loads(o[0].strip().splitlines()[-1]) for o in outs)
        share_a, share_b = ra["onchip_ns"] / ra["wall_ns"], rb["onchip_ns"] / rb["wall_ns"]

        # pod B deleted: its pod manager goes; its units and its memory go to the next pod
        c.delete_pod("team-b", "wider")
        state = c.node.agent.gpus[gpu.uuid]
        c.node.wait(lambda: b.envs["GEMINI_GROUP_NAME"] not in state.config_path.read_text(), timeout=20,
                    what="pod B's group gone")
        uid_n, n = c.admit_pod("team-c", "next", {PCT: 20, MEM: 32})
        torch_n = run(c, uid_n, n, [sys.executable, "-c", TORCH, 8])
        record("k8s", identity=mode, share_capped_03=share_a, share_capped_06=share_b, torch_a=torch_a,
               torch_next=torch_n, gpu=gpu.uuid)
        assert torch_a == {"total": 4 * GiB, "matmul_ok": True, "over_limit": "OutOfMemoryError",
                           "within": 3 * GiB}, torch_a
        assert torch_n["total"] == 8 * GiB and torch_n["within"] == 7 * GiB, torch_n
        assert abs(share_a - 0.3) < 0.05 and abs(share_b - 0.6) < 0.06, (share_a, share_b)


def test_a_latency_pod_on_a_real_gpu_claims_it_in_a_containers_view(tmp_path):
    """The latency class in pods: processes run with a container's view of the files (their own /dev/shm and
    /run; the daemons' directories only through the Allocate mounts; the hook's settings from the mounted file,
    through the test build of the hook), on the real GPU. A lone batch pod's slots are continued through the
    board; a latency pod's requests claim the GPU and the batch pod's hook pauses for them."""
    from bench.harness import read_stats
    from tests import k8s_container
    from tests.native import build_native, client_path

    if not k8s_container.available():
        pytest.skip("no mount namespace can be made here (root or user namespaces): the container view needs one")
    build_native()
    made = subprocess.run(["make", "-s", "testhook"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    test_hook = REPO / "build" / "testhook" / "libgemhook.so.1"
    stats_file = tmp_path / "stats.txt"
    gpu = discover_gpus()[0]
    with Cluster(tmp_path, (gpu,), hook_source=test_hook, schd_args=["-q", "50", "-m", "20", "-w", "10000"]) as c:
        def launch(uid: str, opts, argv: list) -> subprocess.Popen:
            env = k8s_container.container_view_env(opts, base_env())
            env["CUDA_VISIBLE_DEVICES"] = opts.envs["NVIDIA_VISIBLE_DEVICES"]
            env["GEMINI_STATS_FILE"] = str(stats_file)
            return subprocess.Popen(c.in_pod(uid, k8s_container.container_argv(opts, [str(a) for a in argv])),
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def result(p: subprocess.Popen) -> dict:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"rc {p.returncode}\n{out[-2000:]}\n{err[-4000:]}\n{c.logs()}"
            return json.loads(out.strip().splitlines()[-1])

        trainer = [client_path("workload-linked"), "--kernel-us", 1000, "--sync-every", 64, "--json", "--seconds"]
        requests = [client_path("workload-linked"), "--kernel-us", 500, "--sync-every", 2, "--period-us", 20000,
                    "--json", "--seconds", 5]
        uid_t, t = c.admit_pod("team-a", "train", {PCT: 10, MEM: 16})
        uid_l, lat = c.admit_pod("team-b", "serve", {PCT: 30, MEM: 8}, {"gemini.io/class": "latency"})
        alone = result(launch(uid_t, t, trainer + [3]))
        train = launch(uid_t, t, trainer + [8])
        served = result(launch(uid_l, lat, requests))
        trained = result(train)
        stats = read_stats(stats_file)
        alone_st, trained_st = stats.get(alone["pid"], {}), stats.get(trained["pid"], {})
        record("k8s-latency", identity=c.cgroups.mode, continuations_alone=alone_st.get("continuations"),
               drains_alone=alone_st.get("drains"), claim_pauses=trained_st.get("claim_pauses"),
               requests=served.get("requests"), latency_us=served.get("latency_us"), gpu=gpu.uuid)
        # 3 s of 50 ms slots alone: continued at nearly every deadline (through the board in the mounted dir)
        assert alone_st.get("continuations", 0) >= 30, alone_st
        # ~250 requests, each a claim the trainer's hook reads on the board and pauses for
        assert served["requests"] >= 150 and trained_st.get("claim_pauses", 0) >= 50, (served, trained_st)
