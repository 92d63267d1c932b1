"""gem-node's Prometheus metrics: every gemini container's configured and achieved share and memory, labelled
with its namespace, pod and container (needs prometheus_client, in the k8s extra).

Each GPU's gem-schd is asked for its status (the reply gem-ctl status shows) every POLL_S; a scrape reads the
last answers, joined with gem-node's own map of groups to containers, so a scrape never waits on a daemon.

Per container (labels namespace, pod, container, gpu, group):

    gemini_pod_gpu_share_ratio              gauge    GPU time used over gem-schd's window / window (achieved)
    gemini_pod_gpu_min_share_ratio          gauge    configured MinUtil (gemini.io/gpu-percent / 100)
    gemini_pod_gpu_max_share_ratio          gauge    configured MaxUtil (gemini.io/max-util)
    gemini_pod_gpu_memory_used_bytes        gauge    GPU memory the container's processes hold
    gemini_pod_gpu_memory_limit_bytes       gauge    configured limit (gemini.io/gpu-memory x 256 MiB)
    gemini_pod_gpu_token_grants_total       counter  slots granted (rate() = slots a second)
    gemini_pod_gpu_token_waiting            gauge    1 while the container's group waits for the GPU
    gemini_pod_gpu_token_wait_seconds       gauge    how long it has waited so far (0 when not waiting)
    gemini_pod_gpu_token_holder             gauge    1 while it holds the GPU
    gemini_pod_gpu_processes                gauge    processes connected to its pod manager
    gemini_pod_gpu_target_share_ratio       gauge    the share gem-schd steers it to now (0 when idle)
    gemini_pod_gpu_claims_total             counter  latency class: claims of the GPU made
    gemini_pod_gpu_claim_seconds_total      counter  latency class: GPU time its claims took

Per node: gemini_node_pod_refused{namespace,pod,container,reason} (1 per container gem-node will not serve),
gemini_node_gpu_scheduler_up{gpu} (1 when the GPU's gem-schd answered the last poll).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterator

from gemini.wire import sched as sm

from .launch import scheduler_endpoint, scheduler_status

log = logging.getLogger("gemini.k8s.metrics")

POLL_S = 2.0
LABELS = ["namespace", "pod", "container", "gpu", "group"]
MAX_REASON = 120
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024


class _Collector:
    def __init__(self, owner: "NodeMetrics"):
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        gauges = {
            "share": GaugeMetricFamily("gemini_pod_gpu_share_ratio",
                                       "GPU time the container used over the scheduler's window", labels=LABELS),
            "min": GaugeMetricFamily("gemini_pod_gpu_min_share_ratio", "Configured guaranteed share (MinUtil)",
                                     labels=LABELS),
            "max": GaugeMetricFamily("gemini_pod_gpu_max_share_ratio", "Configured share cap (MaxUtil)", labels=LABELS),
            "used": GaugeMetricFamily("gemini_pod_gpu_memory_used_bytes", "GPU memory held by the container",
                                      labels=LABELS),
            "limit": GaugeMetricFamily("gemini_pod_gpu_memory_limit_bytes", "Configured GPU memory limit",
                                       labels=LABELS),
            "waiting": GaugeMetricFamily("gemini_pod_gpu_token_waiting", "1 while the container waits for the GPU",
                                         labels=LABELS),
            "wait": GaugeMetricFamily("gemini_pod_gpu_token_wait_seconds", "How long the current wait has lasted",
                                      labels=LABELS),
            "holder": GaugeMetricFamily("gemini_pod_gpu_token_holder", "1 while the container holds the GPU",
                                        labels=LABELS),
            "clients": GaugeMetricFamily("gemini_pod_gpu_processes", "Processes connected to the pod manager",
                                         labels=LABELS),
        }
        gauges["target"] = GaugeMetricFamily("gemini_pod_gpu_target_share_ratio",
                                             "The share the scheduler steers the container to now", labels=LABELS)
        grants = CounterMetricFamily("gemini_pod_gpu_token_grants", "GPU slots granted to the container",
                                     labels=LABELS)
        claims = CounterMetricFamily("gemini_pod_gpu_claims", "Claims of the GPU made (latency class)",
                                     labels=LABELS)
        claim_s = CounterMetricFamily("gemini_pod_gpu_claim_seconds", "GPU time the container's claims took",
                                      labels=LABELS)
        for labels, placement, status in self.owner.rows():
            c = placement.config
            gauges["min"].add_metric(labels, c.min_util)
            gauges["max"].add_metric(labels, c.max_util)
            gauges["limit"].add_metric(labels, float(c.mem_limit))
            if status is None:
                continue
            gauges["share"].add_metric(labels, float(status["share"]))
            gauges["used"].add_metric(labels, float(status["mem_used"]))
            gauges["waiting"].add_metric(labels, float(bool(status["waiting"])))
            gauges["wait"].add_metric(labels, float(status["wait_ms"]) / 1000.0 if status["waiting"] else 0.0)
            gauges["holder"].add_metric(labels, float(bool(status["holding"])))
            gauges["clients"].add_metric(labels, float(status["clients"]))
            gauges["target"].add_metric(labels, float(status.get("target", 0.0)))
            grants.add_metric(labels, float(status["grants"]))
            claims.add_metric(labels, float(status.get("claims", 0)))
            claim_s.add_metric(labels, float(status.get("claim_ms", 0.0)) / 1000.0)
        yield from gauges.values()
        yield from (grants, claims, claim_s)
        refused = GaugeMetricFamily("gemini_node_pod_refused", "Containers gem-node will not serve, and why",
                                    labels=["namespace", "pod", "container", "reason"])
        for p in self.owner.agent.plan.problems:
            if not p.kept:
                refused.add_metric([p.namespace, p.pod, p.container, p.reason[:MAX_REASON]], 1.0)
        yield refused
        up = GaugeMetricFamily("gemini_node_gpu_scheduler_up", "1 when the GPU's gem-schd answered the last poll",
                               labels=["gpu"])
        for uuid in self.owner.agent.gpus:
            up.add_metric([uuid], 1.0 if uuid in self.owner.statuses else 0.0)
        yield up


class NodeMetrics:
    """Polls each GPU's gem-schd and serves /metrics (reusing gem-schd's small HTTP server)."""

    def __init__(self, agent: Any, ipc_root: str,
                 status: Callable[[str], Awaitable[sm.StatusReply]] | None = None, poll_s: float = POLL_S):
        from prometheus_client import CollectorRegistry
        self.agent = agent
        self.ipc_root = ipc_root
        self._status = status or (lambda uuid: scheduler_status(scheduler_endpoint(ipc_root, uuid)))

        self.poll_s = poll_s
        self.statuses: dict[str, dict[str, dict]] = {}     # gpu -> group -> GroupStatus as a dict
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._task: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    def rows(self):
        for placement in sorted(self.agent.plan.placements, key=lambda p: (p.namespace, p.pod, p.container)):
            labels = [placement.namespace, placement.pod, placement.container, placement.gpu, placement.group]
            yield labels, placement, self.statuses.get(placement.gpu, {}).get(placement.group)

    async def poll_once(self) -> None:
        for uuid, state in self.agent.gpus.items():
            if state.scheduler is None:
                self.statuses.pop(uuid, None)
                continue
            try:
                reply = await self._status(uuid)
            except Exception as exc:     # a restarting gem-schd: its series pause, nothing else does
                log.debug("status of gem-schd on %s: %s", uuid, exc)
                self.statuses.pop(uuid, None)
                continue
            self.statuses[uuid] = {g["name"]: g for g in reply.groups}

    async def _poll(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def start(self, ip: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host=ip, port=port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1] if self._server.sockets else port
        log.info("Prometheus metrics on http://%s:%d/metrics", ip, self.port)
        self._task = asyncio.create_task(self._poll(), name="node-metrics")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            if parts[:1] == ["GET"] and path in ("/metrics", "/"):
                body, ctype, status = *self.exposition(), "200 OK"
            else:
                body, ctype, status = b"GET /metrics\n", "text/plain", "404 Not Found"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:   # a bug in a scrape must not take gem-node down
            log.exception("metrics request failed")
        finally:
            writer.close()
