"""A Kubernetes API server double for gem-node's tests: the real REST and watch protocol for pods, nothing else.

    api = ApiServer().start()                  # http://127.0.0.1:<port>
    api.create(pod("team-a", "train", node="node-1", annotations={...}))
    api.annotate("team-a", "train", {"gemini.io/max-util": "0.5"})
    api.move("team-a", "train", "node-2")       # as a field-selector watch sees it: DELETED here, ADDED there
    api.delete("team-a", "train")
    api.compact()                               # forget history: resuming from an older version gets 410 Gone
    api.drop_watches()                          # end every open watch (the client must resume)

Serves GET /api/v1/pods (list, and watch=true as a chunked stream of JSON lines: ADDED / MODIFIED / DELETED /
BOOKMARK / ERROR) and GET /api/v1/namespaces/{ns}/pods/{name}, with fieldSelector=spec.nodeName=X,
resourceVersion, timeoutSeconds and allowWatchBookmarks. Every request is recorded (`requests`).
"""
from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def pod(namespace: str, name: str, node: str = "node-1", annotations: dict | None = None,
        resources: dict | None = None, uid: str | None = None, phase: str = "Running") -> dict:
    """A minimal v1 Pod object."""
    limits = resources or {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()),
                     "annotations": dict(annotations or {})},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox",
                                                   "resources": {"limits": limits, "requests": limits}}]},
        "status": {"phase": phase},
    }


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _node_of(obj: dict | None) -> str | None:
    return None if obj is None else obj.get("spec", {}).get("nodeName")


class ApiServer:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.rv = 100
        self.objects: dict[tuple[str, str], dict] = {}
        self.events: list[tuple[int, dict | None, dict | None]] = []     # (rv, old, new)
        self.oldest_rv = self.rv        # versions below this are gone (compacted)
        self.requests: list[tuple[str, dict]] = []
        self._generation = 0            # bumped by drop_watches()
        self._server: ThreadingHTTPServer | None = None
        self.fail_next: list[int] = []  # status codes to answer the next requests with

    # --- test side ------------------------------------------------------------------------------------------------

    def start(self) -> "ApiServer":
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="api-double", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self.drop_watches()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _record(self, old: dict | None, new: dict | None) -> None:
        with self._lock:
            self.rv += 1
            if new is not None:
                new["metadata"]["resourceVersion"] = str(self.rv)
                self.objects[(new["metadata"]["namespace"], new["metadata"]["name"])] = new
            else:
                assert old is not None
                self.objects.pop((old["metadata"]["namespace"], old["metadata"]["name"]), None)
            self.events.append((self.rv, copy.deepcopy(old), copy.deepcopy(new)))
            self._lock.notify_all()

    def create(self, obj: dict) -> dict:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        assert key not in self.objects, f"{key} exists"
        self._record(None, copy.deepcopy(obj))
        return self.objects[key]

    def get(self, namespace: str, name: str) -> dict:
        return self.objects[(namespace, name)]

    def _update(self, namespace: str, name: str, change) -> dict:
        with self._lock:
            old = self.objects[(namespace, name)]
            new = copy.deepcopy(old)
            change(new)
            self._record(old, new)
            return new

    def annotate(self, namespace: str, name: str, annotations: dict) -> dict:
        def change(obj):
            ann = obj["metadata"].setdefault("annotations", {})
            for k, v in annotations.items():
                if v is None:
                    ann.pop(k, None)
                else:
                    ann[k] = v
        return self._update(namespace, name, change)

    def set_phase(self, namespace: str, name: str, phase: str) -> dict:
        return self._update(namespace, name, lambda obj: obj["status"].__setitem__("phase", phase))

    def move(self, namespace: str, name: str, node: str) -> dict:
        return self._update(namespace, name, lambda obj: obj["spec"].__setitem__("nodeName", node))

    def delete(self, namespace: str, name: str) -> None:
        with self._lock:
            self._record(self.objects[(namespace, name)], None)

    def compact(self) -> None:
        """Forget every event so far: a watch resuming from an older version gets 410 Gone."""
        with self._lock:
            self.oldest_rv = self.rv + 1
            self.events.clear()
            self._lock.notify_all()

    def drop_watches(self) -> None:
        with self._lock:
            self._generation += 1
            self._lock.notify_all()

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.requests if k == kind)

    # --- server side ----------------------------------------------------------------------------------------------

    def list_pods(self, node: str | None, namespace: str | None = None) -> dict:
        with self._lock:
            items = [copy.deepcopy(o) for o in self.objects.values()
                     if (node is None or _node_of(o) == node)
                     and (namespace is None or o["metadata"]["namespace"] == namespace)]
            return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                    "items": items}

    def watch_events(self, node: str | None, since: int, generation: int, deadline: float, bookmarks: bool):
        """Yield (type, object) from version `since` on, until the deadline or drop_watches()."""
        sent = since
        with self._lock:
            if since < self.oldest_rv - 1:
                yield "ERROR", _status(410, "Expired", f"too old resource version: {since} ({self.oldest_rv - 1})")
                return
        while True:
            with self._lock:
                if generation != self._generation:
                    # ended: what changed after drop_watches() is for the next watch (delivering it here made
                    # test_a_watch_that_ends_is_resumed_from_its_version pass with one watch, or fail, by timing)
                    break
                pending = [e for e in self.events if e[0] > sent]
                if not pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(min(left, 0.2))
                    continue
            for rv, old, new in pending:
                sent = rv
                was, now = old is not None and (node is None or _node_of(old) == node), \
                    new is not None and (node is None or _node_of(new) == node)
                if was and now:
                    yield "MODIFIED", new
                elif now:
                    yield "ADDED", new
                elif was:
                    gone = copy.deepcopy(new if new is not None else old)
                    gone["metadata"]["resourceVersion"] = str(rv)
                    yield "DELETED", gone
        if bookmarks:
            yield "BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(sent)}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: ApiServer

    def log_message(self, format, *args):   # quiet
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        selector = q.get("fieldSelector", "")
        node = selector.split("=", 1)[1] if selector.startswith("spec.nodeName=") else None
        parts = url.path.strip("/").split("/")
        api = self.api
        if api.fail_next:
            code = api.fail_next.pop(0)
            api.requests.append(("fail", q))
            self._json(code, _status(code, "InternalError", "injected failure"))
            return
        if parts[:3] == ["api", "v1", "pods"] and len(parts) == 3:
            if q.get("watch") in ("true", "1"):
                api.requests.append(("watch", q))
                self._watch(node, q)
            else:
                api.requests.append(("list", q))
                self._json(200, api.list_pods(node))
            return
        if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            api.requests.append(("get", q))
            obj = api.objects.get((parts[3], parts[5]))
            if obj is None:
                self._json(404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
            else:
                self._json(200, copy.deepcopy(obj))
            return
        self._json(404, _status(404, "NotFound", f"the double does not serve {url.path}"))

    def _watch(self, node: str | None, q: dict) -> None:
        api = self.api
        since = int(q.get("resourceVersion") or api.rv)
        timeout = float(q.get("timeoutSeconds", 1800))
        with api._lock:
            generation = api._generation
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for kind, obj in api.watch_events(node, since, generation, time.monotonic() + timeout,
                                              q.get("allowWatchBookmarks") == "true"):
                self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True
