"""gem-node's per-container metrics: gem-schd's status joined with the containers' names and settings, served in
the Prometheus text format."""
from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("grpc")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gemini.k8s import devices as dv  # noqa: E402
from gemini.k8s.metrics import NodeMetrics  # noqa: E402
from gemini.wire import sched as sm  # noqa: E402
from tests.k8s_harness import NodeHarness, gpus  # noqa: E402
from tests.test_k8s_node import pod  # noqa: E402

PCT, MEM = dv.RESOURCE_PERCENT, dv.RESOURCE_MEMORY
MiB = 1 << 20


def status_reply(groups: dict[str, dict]) -> sm.StatusReply:
    rows = []
    for name, g in groups.items():
        row = dict(name=name, min_util=0.0, max_util=1.0, share=0.0, mem_used=0, mem_limit=0, clients=0,
                   holding=False, waiting=False, wait_ms=0.0, quota_ms=10.0, grants=0, connected=True)
        row.update(g)
        rows.append(row)
    return sm.StatusReply(scheduler_id="test", window_ms=10000.0, holder="", groups=rows)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_per_container_series_with_names_settings_and_achieved_share(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        a = node.kubelet.admit("team-a", "train", "main", {PCT: 30, MEM: 16})
        node.kubelet.admit("team-b", "bad", "main", {PCT: 10, MEM: 1})      # refused: a class that does not exist
        node.set_pods([pod("team-a", "train", "uid-a", max_util="0.6"),
                       pod("team-b", "bad", "uid-b", **{"class": "x"})])
        node.kubelet.prestart("team-a", "train", "main")
        group, gpu = a.envs["GEMINI_GROUP_NAME"], node.inventory.gpus[0].uuid
        asked = []

        async def fake_status(uuid):
            asked.append(uuid)
            return status_reply({group: dict(share=0.29, mem_used=300 * MiB, waiting=True, wait_ms=1500.0,
                                             grants=42, clients=2, target=0.3, claims=7, claim_ms=250.0)})

        metrics = NodeMetrics(node.agent, node.layout.ipc_root, status=fake_status, poll_s=0.05)
        node.call(metrics.start, "127.0.0.1", 0)
        try:
            node.wait(lambda: asked, what="a status poll")
            node.call(metrics.poll_once)
            m = scrape(metrics.port)
        finally:
            node.call(metrics.close)
        labels = tuple(sorted({"namespace": "team-a", "pod": "train", "container": "main", "gpu": gpu,
                               "group": group}.items()))
        assert m[("gemini_pod_gpu_min_share_ratio", labels)] == pytest.approx(0.3)
        assert m[("gemini_pod_gpu_max_share_ratio", labels)] == pytest.approx(0.6)
        assert m[("gemini_pod_gpu_share_ratio", labels)] == pytest.approx(0.29)
        assert m[("gemini_pod_gpu_memory_limit_bytes", labels)] == 16 * 256 * MiB
        assert m[("gemini_pod_gpu_memory_used_bytes", labels)] == 300 * MiB
        assert m[("gemini_pod_gpu_token_grants_total", labels)] == 42
        assert m[("gemini_pod_gpu_token_waiting", labels)] == 1
        assert m[("gemini_pod_gpu_token_wait_seconds", labels)] == pytest.approx(1.5)
        assert m[("gemini_pod_gpu_processes", labels)] == 2
        assert m[("gemini_pod_gpu_target_share_ratio", labels)] == pytest.approx(0.3)
        assert m[("gemini_pod_gpu_claims_total", labels)] == 7
        assert m[("gemini_pod_gpu_claim_seconds_total", labels)] == pytest.approx(0.25)
        assert m[("gemini_node_gpu_scheduler_up", (("gpu", gpu),))] == 1
        refused = [k for k in m if k[0] == "gemini_node_pod_refused"]
        assert len(refused) == 1 and dict(refused[0][1])["pod"] == "bad"
        assert "gemini.io/class" in dict(refused[0][1])["reason"]
