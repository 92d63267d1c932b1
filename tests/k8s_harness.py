"""gem-node run in a thread of the test, against the fake kubelet (and optionally the API server double).

    with NodeHarness(tmp_path, gpus, launcher=FakeLauncher()) as node:
        node.kubelet.admit(...)
        node.set_pods({...})            # without an API double: the pods the watch would have handed over
"""
from __future__ import annotations

import asyncio
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemini.k8s import devices as dv
from gemini.k8s.policy import Defaults, Placement, PodInfo
from gemini.k8s.service import GemNode, NodeOptions
from tests.e2e_fixtures import wait_for
from tests.k8s_kubelet import FakeKubelet

GiB = 1 << 30


def gpus(n: int, memory: int = 8 * GiB) -> tuple[dv.Gpu, ...]:
    return tuple(dv.Gpu(i, f"GPU-{i:08x}-0000-4000-8000-{i:012x}", memory) for i in range(n))


@dataclass
class FakeDaemon:
    what: str
    pid: int
    placement: Placement | None = None
    config_path: Path | None = None
    running: bool = True
    listening: bool = True

    def alive(self) -> bool:
        return self.running

    def ready(self) -> bool:
        return self.running and self.listening

    async def stop(self) -> None:
        self.running = False


@dataclass
class FakeLauncher:
    """Records what gem-node starts; nothing runs."""
    started: list[FakeDaemon] = field(default_factory=list)
    _pid: int = 1000
    broken_schedulers: bool = False     # every gem-schd exits at once (as with a config it cannot use)

    def start_scheduler(self, gpu: dv.Gpu, config_path: Path) -> FakeDaemon:
        self._pid += 1
        d = FakeDaemon(f"gem-schd {gpu.uuid}", self._pid, config_path=config_path,
                       running=not self.broken_schedulers)
        self.started.append(d)
        return d

    def start_pod_manager(self, gpu: dv.Gpu, placement: Placement) -> FakeDaemon:
        self._pid += 1
        d = FakeDaemon(f"pmgr {placement.group}", self._pid, placement=placement)
        self.started.append(d)
        return d

    async def registered(self, gpu: dv.Gpu, group: str) -> bool:
        return any(d.running and d.placement is not None and d.placement.group == group for d in self.started)

    def running(self, kind: str = "pmgr") -> list[FakeDaemon]:
        return [d for d in self.started if d.running and d.what.startswith(kind)]


class NodeHarness:
    def __init__(self, root: Path, node_gpus: tuple[dv.Gpu, ...], launcher: Any = None, core_api: Any = None,
                 node_name: str = "node-1", reserved: int = 0, defaults: Defaults | None = None,
                 hook_source: Path | None = None):
        self.root = Path(root)
        # Unix socket paths must stay under 108 bytes: pytest's tmp_path is often longer
        self._short = tempfile.TemporaryDirectory(prefix="gk8s-", dir="/tmp")
        self.short = Path(self._short.name)
        self.kubelet = FakeKubelet(self.short / "kubelet")
        self.launcher = launcher if launcher is not None else FakeLauncher()
        self.layout = dv.HostLayout(hook=str(self.root / "gemini/lib/libgemhook.so.1"),
                                    preload=str(self.root / "gemini/lib/ld.so.preload"),
                                    ipc_root=str(self.short / "ipc"), board_root=str(self.short / "board"),
                                    settings_root=str(self.root / "gemini/conf"))
        self.options = NodeOptions(node_name=node_name, state_dir=self.root / "gemini/state", layout=self.layout,
                                   plugin_dir=self.kubelet.plugin_dir,
                                   pod_resources_socket=str(self.kubelet.podres_socket),
                                   defaults=defaults or Defaults(), hook_source=hook_source)
        self.inventory = dv.Inventory(node_gpus, reserved)
        self.core_api = core_api
        self.loop = asyncio.new_event_loop()
        self.node: GemNode | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> "NodeHarness":
        self.kubelet.start()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)

            async def main():
                self._stop = asyncio.Event()
                self.node = GemNode(self.options, self.inventory, self.launcher, self.core_api)
                ready.set()
                await self.node.run(self._stop)
            self.loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, name="gem-node", daemon=True)
        self._thread.start()
        assert ready.wait(10)
        self.kubelet.wait_registered(set(dv.RESOURCES))
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(20)
            assert not self._thread.is_alive(), "gem-node did not stop"
        self.kubelet.stop()
        self._short.cleanup()

    @property
    def agent(self):
        assert self.node is not None
        return self.node.agent

    def call(self, fn, *args) -> Any:
        """Run fn(*args) on gem-node's loop (a coroutine function is awaited) and return its result."""
        async def wrapper():
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(60)

    def set_pods(self, pods: list[PodInfo]) -> None:
        self.call(self.agent.set_pods, {p.key: p for p in pods})

    def reconcile(self) -> None:
        self.call(self.agent.reconcile)

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition") -> Any:
        return wait_for(predicate, timeout, what=what)
