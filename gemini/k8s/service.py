"""gem-node assembled: the device plugins, the pod watch, the agent, the daemons and the metrics, on one loop.

    node = GemNode(options, inventory, launcher, core_api)     # core_api None: no pod watch (tests)
    await node.run(stop)                                       # until stop is set; then everything is stopped
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import devices as dv
from .apiwatch import PodWatcher
from .deviceplugin import DEVICE_PLUGIN_DIR, DevicePluginServer, keep_registered
from .node import Launcher, NodeAgent
from .podresources import POD_RESOURCES_SOCKET, PodResourcesClient
from .policy import Defaults

log = logging.getLogger("gemini.k8s.service")


class DiscoveryError(RuntimeError):
    pass


def discover_gpus(nvidia_smi: str = "nvidia-smi") -> tuple[dv.Gpu, ...]:
    """The node's GPUs from nvidia-smi (index, UUID, total memory)."""
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise DiscoveryError(f"cannot list the GPUs with {nvidia_smi}: {exc} (or list them under gpus: in the "
                             "node config)") from None
    return parse_nvidia_smi(out)


def parse_nvidia_smi(text: str) -> tuple[dv.Gpu, ...]:
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise DiscoveryError(f"unexpected nvidia-smi line {line!r}")
        gpus.append(dv.Gpu(int(parts[0]), parts[1], int(float(parts[2])) << 20))
    return tuple(gpus)


def install_hook_files(layout: dv.HostLayout, hook_source: str | Path) -> None:
    """Put the hook library and the ld.so.preload that names it where Allocate mounts them from. Replaced by
    rename: containers running now keep the file they have (a bind mount holds the old inode)."""
    for target, write in ((layout.hook, lambda tmp: shutil.copyfile(hook_source, tmp)),
                          (layout.preload, lambda tmp: Path(tmp).write_text(dv.CONTAINER_HOOK + "\n"))):
        path = Path(target)
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write(tmp)
        os.chmod(tmp, 0o755 if path == Path(layout.hook) else 0o644)
        os.replace(tmp, path)
    Path(layout.ipc_root).mkdir(mode=0o755, parents=True, exist_ok=True)


@dataclass
class NodeOptions:
    node_name: str
    state_dir: Path = Path("/var/lib/gemini/state")
    layout: dv.HostLayout = field(default_factory=dv.HostLayout)
    plugin_dir: Path = Path(DEVICE_PLUGIN_DIR)
    pod_resources_socket: str = POD_RESOURCES_SOCKET
    defaults: Defaults = field(default_factory=Defaults)
    hook_source: Path | None = None       # copied to layout.hook at start (None: leave what is there)
    metrics_port: int = 0
    metrics_ip: str = "0.0.0.0"


class GemNode:
    def __init__(self, options: NodeOptions, inventory: dv.Inventory, launcher: Launcher, core_api: Any = None):
        self.options = options
        self.inventory = inventory
        self.podres = PodResourcesClient(options.pod_resources_socket)
        self.agent = NodeAgent(inventory, options.layout, options.state_dir, launcher, self.podres.list,
                               options.defaults)
        self.plugins = [DevicePluginServer(r, self.agent, options.plugin_dir) for r in dv.RESOURCES]
        self.agent.on_health += [p.notify for p in self.plugins]
        self.core_api = core_api
        self.watcher: PodWatcher | None = None
        self.metrics: Any = None

    async def run(self, stop: asyncio.Event) -> None:
        if self.options.hook_source is not None:
            install_hook_files(self.options.layout, self.options.hook_source)
        loop = asyncio.get_running_loop()
        thread = None
        if self.core_api is not None:
            def handed_over(pods: dict) -> None:     # in the watch thread: to the loop
                loop.call_soon_threadsafe(self.agent.set_pods, pods)
            self.watcher = PodWatcher(self.core_api, self.options.node_name, handed_over)
            thread = threading.Thread(target=self.watcher.run, name="pod-watch", daemon=True)
            thread.start()
        if self.options.metrics_port:
            from .metrics import NodeMetrics
            self.metrics = NodeMetrics(self.agent, self.options.layout.scheduler_root)
            await self.metrics.start(self.options.metrics_ip, self.options.metrics_port)
        tasks = [asyncio.create_task(keep_registered(self.plugins, stop), name="device-plugins"),
                 asyncio.create_task(self.agent.run(stop), name="agent")]
        try:
            await stop.wait()
        finally:
            if self.watcher is not None:
                self.watcher.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.agent.shutdown()
            await self.podres.close()
            if self.metrics is not None:
                self.metrics.close()
            if thread is not None:
                thread.join(timeout=1)
