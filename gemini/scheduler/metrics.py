"""Prometheus metrics of gem-schd (`gem-schd --metrics-port N`; needs the `metrics` extra: prometheus_client).

Served over HTTP (GET /metrics, or /) by a small asyncio server on the daemon's own loop, bound to the scheduler's
--ip, so a scrape reads the scheduler's state between two messages: no thread, no lock, no torn reads. Every
daemon has its own CollectorRegistry (nothing global, so tests can run many daemons in one process).

Per group (label `group`):

    gemini_group_share_ratio          gauge      GPU time used over the sliding window / window (as gem-ctl status)
    gemini_group_min_util_ratio       gauge      configured MinUtil
    gemini_group_max_util_ratio       gauge      configured MaxUtil
    gemini_grants_total               counter    token grants
    gemini_token_wait_seconds         histogram  how long granted requests waited for the token
    gemini_token_held_seconds_total   counter    time the group held the token (slot lengths, as granted)
    gemini_quota_seconds              gauge      length of the group's last granted slot
    gemini_memory_used_bytes          gauge      GPU memory the group's clients hold (as its pod manager reports)
    gemini_memory_limit_bytes         gauge      configured MemoryLimit
    gemini_group_clients              gauge      processes connected to the group's pod manager
    gemini_token_holder               gauge      1 while the group holds the token, else 0
    gemini_group_waiting              gauge      1 while the group waits for the token, else 0
    gemini_group_connected            gauge      1 while the group's pod manager is registered, else 0
    gemini_group_target_ratio         gauge      the share the policy steers the group to now (0 if inactive)
    gemini_continuations_total        counter    slots the group kept without a handoff
    gemini_claims_total               counter    latency class: claims of the GPU
    gemini_claim_seconds_total        counter    latency class: GPU time claimed
    gemini_group_claim_allowed        gauge      latency class: 1 while the group may claim

Scheduler-wide: gemini_window_seconds (gauge), gemini_config_reloads_total (counter),
gemini_scheduler_info{scheduler_id} (gauge, 1).

Counters and the histogram of a group removed by a reload are dropped with it; a group added later starts again
from 0 (Prometheus' rate() treats that as a counter reset).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

from gemini.config import Config
from gemini.transport import host_port
from gemini.scheduler.observers import ObserverBase
from gemini.wire.sched import StatusReply

log = logging.getLogger("gemini.scheduler.metrics")

# Token waits range from a fraction of a millisecond (an idle GPU) to several slots (a busy one).
WAIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024

INSTALL_HINT = "prometheus_client is not installed: pip install 'gemini-gpu[metrics]' (or prometheus-client)"


class MetricsUnavailable(RuntimeError):
    """prometheus_client is missing."""


def require_prometheus() -> None:
    """Raise MetricsUnavailable (with the install hint) if prometheus_client cannot be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise MetricsUnavailable(INSTALL_HINT) from None


class _StatusCollector:
    """The gauges that describe the scheduler's current state, read from its status reply at scrape time."""

    def __init__(self, status: Callable[[], StatusReply]):
        self._status = status

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        reply = self._status()
        per_group = [
            ("gemini_group_share_ratio", "GPU time the group used over the sliding window, as a fraction of it",
             lambda g: g["share"]),
            ("gemini_group_min_util_ratio", "Configured MinUtil (guaranteed share)", lambda g: g["min_util"]),
            ("gemini_group_max_util_ratio", "Configured MaxUtil (share cap)", lambda g: g["max_util"]),
            ("gemini_quota_seconds", "Length of the group's last granted slot", lambda g: g["quota_ms"] / 1000.0),
            ("gemini_memory_used_bytes", "GPU memory held by the group's clients", lambda g: g["mem_used"]),
            ("gemini_memory_limit_bytes", "Configured MemoryLimit of the group", lambda g: g["mem_limit"]),
            ("gemini_group_clients", "Processes connected to the group's pod manager", lambda g: g["clients"]),
            ("gemini_token_holder", "1 while the group holds the token", lambda g: float(g["holding"])),
            ("gemini_group_waiting", "1 while the group waits for the token", lambda g: float(g["waiting"])),
            ("gemini_group_connected", "1 while the group's pod manager is registered",
             lambda g: float(g["connected"])),
            ("gemini_group_target_ratio", "The share the policy steers the group to now (0 if inactive)",
             lambda g: g["target"]),
            ("gemini_group_claim_allowed", "1 while the (latency-class) group may claim the GPU",
             lambda g: float(g["claim_allowed"])),
        ]
        for name, help_text, value in per_group:
            family = GaugeMetricFamily(name, help_text, labels=["group"])
            for g in reply.groups:
                family.add_metric([g["name"]], value(g))
            yield family
        yield from self._residency(reply)

    @staticmethod
    def _residency(reply: StatusReply) -> Iterator[Any]:
        """Unified groups (MemoryMode = unified): memory mode, managed and resident bytes, and the swap totals
        (series only for unified groups; gemini_group_unified is there for every group)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        mode = GaugeMetricFamily("gemini_group_unified", "1 if the group's memory is unified (swapped by gem-schd)",
                                 labels=["group"])
        for g in reply.groups:
            mode.add_metric([g["name"]], float(g.get("memory_mode") == "unified"))
        yield mode
        unified = [g for g in reply.groups if g.get("memory_mode") == "unified"]
        for name, help_text, key in (
                ("gemini_managed_bytes", "Managed memory the unified group's clients hold", "managed_bytes"),
                ("gemini_resident_bytes", "Of the unified group's managed memory, what gem-schd counts on the GPU",
                 "resident_bytes")):
            family = GaugeMetricFamily(name, help_text, labels=["group"])
            for g in unified:
                family.add_metric([g["name"]], g.get(key, 0))
            yield family
        counters: tuple[tuple[str, str, str, float], ...] = (
            ("gemini_swapped_in_bytes", "Bytes the unified group's hooks moved to the GPU", "swapped_in_bytes", 1.0),
            ("gemini_swapped_out_bytes", "Bytes the unified group's hooks moved to the host", "swapped_out_bytes", 1.0),
            ("gemini_swap_seconds", "Time the unified group's hooks spent moving its memory", "swap_ms", 1e-3),
            ("gemini_evictions", "Times the unified group was evicted to make room", "evictions", 1.0))
        for name, help_text, key, scale in counters:
            counter = CounterMetricFamily(name, help_text, labels=["group"])
            for g in unified:
                counter.add_metric([g["name"]], g.get(key, 0) * scale)
            yield counter
        yield GaugeMetricFamily("gemini_window_seconds", "Sliding window over which shares are measured",
                                value=reply.window_ms / 1000.0)
        info = GaugeMetricFamily("gemini_scheduler_info", "This gem-schd instance", labels=["scheduler_id"])
        info.add_metric([reply.scheduler_id], 1.0)
        yield info


class SchedulerMetrics(ObserverBase):
    """A daemon observer holding the daemon's registry: counts grants, waits and slot time as they happen."""

    def __init__(self, status: Callable[[], StatusReply], config: Config):
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            raise MetricsUnavailable(INSTALL_HINT) from None
        self.registry = CollectorRegistry()
        self.grants = Counter("gemini_grants", "Token grants", ["group"], registry=self.registry)
        self.wait = Histogram("gemini_token_wait_seconds", "How long granted token requests waited", ["group"],
                              buckets=WAIT_BUCKETS_S, registry=self.registry)
        self.held = Counter("gemini_token_held_seconds", "Time the group held the token", ["group"],
                            registry=self.registry)
        self.continuations = Counter("gemini_continuations", "Slots the group kept without a handoff", ["group"],
                                     registry=self.registry)
        self.claims = Counter("gemini_claims", "Claims of the GPU by a latency-class group", ["group"],
                              registry=self.registry)
        self.claimed = Counter("gemini_claim_seconds", "GPU time claimed by a latency-class group", ["group"],
                               registry=self.registry)
        self.reloads = Counter("gemini_config_reloads", "Config reloads applied", registry=self.registry)
        self._per_group = (self.grants, self.wait, self.held, self.continuations, self.claims, self.claimed)
        self.registry.register(_StatusCollector(status))
        self._groups: set[str] = set()
        self._sync_groups(config)

    def _sync_groups(self, config: Config) -> None:
        names = set(config.names)
        for name in config.names:   # series exist (at 0) from the start, not only after the first grant
            if name not in self._groups:
                for metric in self._per_group:
                    metric.labels(name)
        for name in sorted(self._groups - names):
            for metric in self._per_group:
                try:
                    metric.remove(name)
                except KeyError:
                    pass
        self._groups = names

    # --- observer interface ---------------------------------------------------------------------------------------

    def on_grant(self, group: str, token_seq: int, quota_ms: float, start_ms: float, wait_ms: float) -> None:
        self.grants.labels(group).inc()
        self.wait.labels(group).observe(max(wait_ms, 0.0) / 1000.0)

    def on_slot_end(self, group: str, token_seq: int, quota_ms: float, start_ms: float, end_ms: float,
                    wait_ms: float, reason: str) -> None:
        if group in self._groups:
            self.held.labels(group).inc(max(end_ms - start_ms, 0.0) / 1000.0)
            if reason == "continued":
                self.continuations.labels(group).inc()

    def on_claim(self, group: str, start_ms: float, end_ms: float) -> None:
        if group in self._groups:
            self.claims.labels(group).inc()
            self.claimed.labels(group).inc(max(end_ms - start_ms, 0.0) / 1000.0)

    def on_config(self, config: Config, diff: Any, now_ms: float) -> None:
        self.reloads.inc()
        self._sync_groups(config)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format (body, content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsServer(ObserverBase):
    """Serves a daemon's SchedulerMetrics over HTTP from the daemon's event loop. A daemon observer itself (it
    forwards the events to its SchedulerMetrics and closes on the daemon's stop)."""

    def __init__(self, daemon: Any):
        self.metrics = SchedulerMetrics(daemon.status_reply, daemon.config)
        self._server: Optional[asyncio.AbstractServer] = None
        self.port = 0
        self.ip = ""

    async def start(self, ip: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host=ip, port=port, limit=MAX_REQUEST_BYTES)
        sockets = self._server.sockets or ()
        self.port = sockets[0].getsockname()[1] if sockets else port
        self.ip = ip
        log.info("Prometheus metrics on %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{host_port(self.ip, self.port)}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # Observer interface: forwarded.
    def on_grant(self, *args: Any) -> None:
        self.metrics.on_grant(*args)

    def on_slot_end(self, *args: Any) -> None:
        self.metrics.on_slot_end(*args)

    def on_config(self, *args: Any) -> None:
        self.metrics.on_config(*args)

    def on_claim(self, *args: Any) -> None:
        self.metrics.on_claim(*args)

    def on_stop(self, now_ms: float) -> None:
        self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            path = urlsplit(target).path
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"only GET and HEAD\n", "text/plain; charset=utf-8"
            elif path in ("/metrics", "/"):
                body, ctype = self.metrics.exposition()
                status = "200 OK"
            else:
                status, body, ctype = "404 Not Found", b"metrics are at /metrics\n", "text/plain; charset=utf-8"
            header = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                      f"Connection: close\r\n\r\n").encode("latin-1")
            writer.write(header if method == "HEAD" else header + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:   # a bug in a scrape must not take the scheduler down
            log.exception("metrics request failed")
        finally:
            writer.close()
