"""gem-node's pod watch, driven by the official kubernetes client against the API server double: pods created,
annotated, moved and deleted; watches that end and resume; a 410 Gone that forces a new list."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("kubernetes")

from gemini.k8s.apiwatch import PodWatcher  # noqa: E402
from tests.k8s_apiserver import ApiServer, pod  # noqa: E402

NODE = "node-1"


def core_api(url: str):
    from kubernetes import client
    cfg = client.Configuration()
    cfg.host = url
    return client.CoreV1Api(client.ApiClient(cfg))


class Seen:
    """What the watcher handed over, with a wait for a condition on the latest set."""

    def __init__(self):
        self.cond = threading.Condition()
        self.snapshots: list[dict] = []

    def __call__(self, pods):
        with self.cond:
            self.snapshots.append(pods)
            self.cond.notify_all()

    @property
    def latest(self) -> dict:
        return self.snapshots[-1] if self.snapshots else {}

    def wait(self, predicate, timeout=10.0, what="condition"):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self.latest):
                left = deadline - time.monotonic()
                assert left > 0, f"{what} not seen within {timeout} s; last: {self.latest}"
                self.cond.wait(left)


@pytest.fixture
def api():
    server = ApiServer().start()
    yield server
    server.stop()


@pytest.fixture
def watching(api):
    started = []

    def start(**kw) -> tuple[PodWatcher, Seen]:
        seen = Seen()
        w = PodWatcher(core_api(api.url), NODE, seen, backoff_start_s=0.05, **kw)
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        started.append((w, t))
        return w, seen
    yield start
    for w, t in started:
        w.stop()
        deadline = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < deadline:
            api.drop_watches()       # ends a watch that began just as stop() was called
            t.join(0.1)
        assert not t.is_alive(), "the watcher did not stop"


def test_pods_created_annotated_moved_and_deleted(api, watching):
    api.create(pod("team-a", "train", NODE, {"gemini.io/max-util": "0.5"}))
    api.create(pod("team-b", "elsewhere", "node-2"))
    w, seen = watching()
    seen.wait(lambda p: ("team-a", "train") in p, what="the first list")
    assert set(seen.latest) == {("team-a", "train")}          # only this node's pods
    assert seen.latest[("team-a", "train")].annotations == {"gemini.io/max-util": "0.5"}

    api.create(pod("team-a", "infer", NODE))
    seen.wait(lambda p: ("team-a", "infer") in p, what="a created pod")
    api.annotate("team-a", "train", {"gemini.io/max-util": "0.25", "gemini.io/class": "latency"})
    seen.wait(lambda p: p[("team-a", "train")].annotations.get("gemini.io/max-util") == "0.25", what="an annotation")
    assert seen.latest[("team-a", "train")].annotations["gemini.io/class"] == "latency"

    api.move("team-a", "train", "node-2")                      # leaves this node's selector: DELETED for us
    seen.wait(lambda p: ("team-a", "train") not in p, what="a pod moved away")
    api.move("team-b", "elsewhere", NODE)                      # enters it: ADDED
    seen.wait(lambda p: ("team-b", "elsewhere") in p, what="a pod moved here")
    api.set_phase("team-a", "infer", "Succeeded")
    seen.wait(lambda p: p[("team-a", "infer")].phase == "Succeeded", what="a phase change")
    api.delete("team-a", "infer")
    seen.wait(lambda p: set(p) == {("team-b", "elsewhere")}, what="a deleted pod")
    assert w.lists == 1, "no event was missed, so nothing had to be listed again"
    # every request narrowed to this node
    assert all(q.get("fieldSelector") == f"spec.nodeName={NODE}" for _, q in api.requests)


def test_a_watch_that_ends_is_resumed_from_its_version(api, watching):
    api.create(pod("team-a", "train", NODE))
    w, seen = watching()
    seen.wait(lambda p: ("team-a", "train") in p)
    for round_ in range(3):
        api.drop_watches()                                    # the server ends the watch (as at its timeout)
        api.annotate("team-a", "train", {"round": str(round_)})
        seen.wait(lambda p, r=round_: p[("team-a", "train")].annotations.get("round") == str(r), what=f"round {round_}")
    assert w.lists == 1, "a watch that merely ended must be resumed, not replaced by a new list"
    assert api.count("watch") >= 2
    resumed = [q for k, q in api.requests if k == "watch"][1:]
    assert all(int(q["resourceVersion"]) > 100 for q in resumed), resumed   # from the last version seen


def test_410_gone_lists_again_and_misses_nothing(api, watching):
    api.create(pod("team-a", "train", NODE))
    w, seen = watching()
    seen.wait(lambda p: ("team-a", "train") in p)
    with api._lock:       # atomically: a change, the history forgotten, the watch ended, before anyone sees it
        api.annotate("team-a", "train", {"gemini.io/max-util": "0.1"})
        api.create(pod("team-a", "late", NODE))
        api.compact()
        api.drop_watches()
    seen.wait(lambda p: ("team-a", "late") in p
              and p[("team-a", "train")].annotations.get("gemini.io/max-util") == "0.1", what="the state after a 410")
    assert w.lists == 2, "a 410 must be answered with a new list"


def test_an_unreachable_api_server_is_retried(api, watching):
    api.fail_next = [500, 503]
    api.create(pod("team-a", "train", NODE))
    w, seen = watching()
    seen.wait(lambda p: ("team-a", "train") in p, what="the list after two failures")
    assert api.count("fail") == 2
