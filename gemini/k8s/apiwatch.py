"""The pods bound to this node, kept current from the API server with the official `kubernetes` client.

List, then watch from the list's resourceVersion; a watch that ends (its timeout, a dropped connection) is
resumed from the last version seen; a version the server no longer has (410 Gone, "too old resource version")
means events were missed, so the pods are listed again. Every change hands the whole set to `on_change`,
which gem-node's loop applies (the client is blocking, so this runs in a thread of its own).

RBAC: pods list and watch, cluster-wide, narrowed by the field selector spec.nodeName=<node>.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from .policy import PodInfo

log = logging.getLogger("gemini.k8s.apiwatch")

WATCH_TIMEOUT_S = 300          # the server ends a watch after this; we resume it
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
HTTP_GONE = 410

PodMap = dict[tuple[str, str], PodInfo]


def pod_info(obj: Any) -> PodInfo:
    """PodInfo from a V1Pod model (or anything shaped like one)."""
    meta, spec, status = obj.metadata, obj.spec, obj.status
    return PodInfo(namespace=meta.namespace or "default", name=meta.name, uid=meta.uid or "",
                   node_name=(spec.node_name if spec is not None else "") or "",
                   phase=(status.phase if status is not None else None) or "Pending",
                   annotations=dict(meta.annotations or {}), deleting=meta.deletion_timestamp is not None)


class PodWatcher:
    """`run()` (in a thread) until `stop()`; `on_change(pods)` after the first list and after every event."""

    def __init__(self, core_api: Any, node_name: str, on_change: Callable[[PodMap], None],
                 watch_timeout_s: int = WATCH_TIMEOUT_S, backoff_start_s: float = BACKOFF_START_S):
        self.api = core_api
        self.node_name = node_name
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_start_s = backoff_start_s
        self.pods: PodMap = {}
        self.resource_version: str | None = None
        self.lists = 0            # how many times the pods were listed (1 + relists after 410 or errors)
        self.watches = 0          # how many watch requests were made
        self._stop = threading.Event()
        self._watch: Any = None

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    def stop(self) -> None:
        """Ask run() to return. A watch request already on its way ends when the server answers or ends it."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> None:
        reply = self.api.list_pod_for_all_namespaces(field_selector=self.selector, _request_timeout=30)
        pods = {}
        for obj in reply.items:
            info = pod_info(obj)
            if info.node_name == self.node_name:
                pods[info.key] = info
        self.pods = pods
        self.resource_version = reply.metadata.resource_version
        self.lists += 1
        log.info("listed %d pod(s) on node %s at version %s", len(pods), self.node_name, self.resource_version)
        self.on_change(dict(self.pods))

    def _apply(self, kind: str, obj: Any) -> None:
        info = pod_info(obj)
        if kind == "DELETED" or info.node_name != self.node_name:
            # a pod that stops matching the selector is sent as DELETED; guard anyway
            self.pods.pop(info.key, None)
        elif kind in ("ADDED", "MODIFIED"):
            old = self.pods.get(info.key)
            if old is not None and old.uid != info.uid:
                log.info("pod %s was replaced (uid %s -> %s)", info.ref, old.uid, info.uid)
            self.pods[info.key] = info
        else:
            return
        self.on_change(dict(self.pods))

    def _watch_once(self) -> None:
        from kubernetes import watch
        self._watch = watch.Watch()
        self.watches += 1
        try:
            for event in self._watch.stream(self.api.list_pod_for_all_namespaces, field_selector=self.selector,
                                            resource_version=self.resource_version, allow_watch_bookmarks=True,
                                            timeout_seconds=self.watch_timeout_s,
                                            _request_timeout=self.watch_timeout_s + 30):
                if self._stop.is_set():
                    return
                kind = event.get("type")
                if kind != "BOOKMARK":
                    self._apply(kind, event["object"])
                if self._watch.resource_version:
                    self.resource_version = self._watch.resource_version
        finally:
            self._watch = None

    def run(self) -> None:
        from kubernetes.client.rest import ApiException
        backoff = self.backoff_start_s
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                if self._stop.is_set():
                    return
                self._watch_once()
                backoff = self.backoff_start_s
                continue            # the watch timed out or the server closed it: resume from our version
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("watch of node %s pods: version %s is gone; listing again", self.node_name,
                             self.resource_version)
                    need_list = True
                    continue
                log.warning("API server error on node %s pods: %s %s", self.node_name, exc.status, exc.reason)
                need_list = True
            except Exception as exc:   # connection refused, reset, timeouts: the API server is away
                if self._stop.is_set():
                    return
                log.warning("API server unreachable (%s: %s); retrying in %.1f s", type(exc).__name__,
                            str(exc)[:200], backoff)
                need_list = True
            self._stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
