"""gem-node's device plugins: one gRPC server per resource on a Unix socket in the kubelet's device-plugins
directory, registered with the kubelet, re-registered when the kubelet restarts.

This module only speaks the kubelet's API (v1beta1). What to advertise, which units to prefer and what a
container gets are decided in devices.py; whether a container may start (PreStartContainer) is decided by
the node agent through the `PluginBackend` it is given.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import AsyncIterator, Protocol

import grpc
import grpc.aio

from . import devices as dv
from .proto import deviceplugin_v1beta1_pb2 as pb
from .proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger("gemini.k8s.deviceplugin")

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
REGISTER_TIMEOUT_S = 10.0
WATCH_KUBELET_S = 1.0
# The kubelet gives PreStartContainer 30 s; answer (yes or no) before it gives up on us.
PRESTART_TIMEOUT_S = 25.0


def socket_name(resource: str) -> str:
    """The plugin's socket, e.g. gemini.io/gpu-percent -> gemini-gpu-percent.sock."""
    return resource.replace(".io/", "-").replace("/", "-").replace(".", "-") + ".sock"


class PluginBackend(Protocol):
    """What the device plugins ask of the node agent."""

    inventory: dv.Inventory
    layout: dv.HostLayout

    def unhealthy_gpus(self) -> set[str]:
        """GPUs whose units are advertised as Unhealthy (e.g. their gem-schd cannot run)."""

    def preferred_gpu(self, resource: str) -> str | None:
        """A GPU the next container's units of `resource` should go to, if any (see devices.preferred_allocation)."""

    def allocated(self, resource: str, grant: dv.ContainerGrant, device_ids: list[str]) -> None:
        """The kubelet was given `grant` for these units (the pod is not known yet)."""

    async def prestart(self, resource: str, device_ids: list[str]) -> None:
        """Return when the container holding these units may start; raise AllocationError if it may not."""


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service of one resource."""

    def __init__(self, resource: str, backend: PluginBackend):
        self.resource = resource
        self.backend = backend
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()

    def devices(self) -> list[pb.Device]:
        bad = self.backend.unhealthy_gpus()
        out = []
        for gpu in self.backend.inventory.gpus:
            health = UNHEALTHY if gpu.uuid in bad else HEALTHY
            topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=gpu.numa_node)]) if gpu.numa_node is not None else None
            for did in self.backend.inventory.device_ids(self.resource):
                if did.startswith(gpu.uuid + "-"):
                    out.append(pb.Device(ID=did, health=health, topology=topology))
        return out

    def notify(self) -> None:
        """Health or inventory changed: send the list again."""
        self._changed.set()

    def stop_streams(self) -> None:
        self._stopping.set()
        self._changed.set()

    async def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request, context) -> AsyncIterator[pb.ListAndWatchResponse]:
        while not self._stopping.is_set():
            self._changed.clear()
            yield pb.ListAndWatchResponse(devices=self.devices())
            await self._changed.wait()

    async def GetPreferredAllocation(self, request, context):
        responses = []
        for req in request.container_requests:
            ids = dv.preferred_allocation(self.backend.inventory, self.resource, list(req.available_deviceIDs),
                                          list(req.must_include_deviceIDs), req.allocation_size,
                                          self.backend.preferred_gpu(self.resource))
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request, context):
        responses = []
        for req in request.container_requests:
            ids = list(req.devices_ids)
            try:
                grant = dv.container_grant(self.backend.inventory, self.backend.layout, self.resource, ids)
            except dv.AllocationError as exc:
                log.warning("Allocate %s refused: %s", self.resource, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gemini: {exc}")
                raise   # abort raises; this only tells readers (and mypy) that nothing follows
            self.backend.allocated(self.resource, grant, ids)
            responses.append(pb.ContainerAllocateResponse(
                envs=grant.envs,
                mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                        for m in grant.mounts]))
        return pb.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request, context):
        ids = list(request.devices_ids)
        try:
            await asyncio.wait_for(self.backend.prestart(self.resource, ids), PRESTART_TIMEOUT_S)
        except dv.AllocationError as exc:
            log.warning("container with %s units %s... may not start: %s", self.resource, ids[:1], exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gemini: {exc}")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"gemini: gem-node could not serve the container's group within "
                                f"{PRESTART_TIMEOUT_S:g} s (see gem-node's log)")
        return pb.PreStartContainerResponse()


class DevicePluginServer:
    """Serves and registers one resource; `run()` keeps it registered across kubelet restarts."""

    def __init__(self, resource: str, backend: PluginBackend, plugin_dir: str | Path = DEVICE_PLUGIN_DIR):
        self.resource = resource
        self.plugin_dir = Path(plugin_dir)
        self.endpoint = socket_name(resource)
        self.servicer = DevicePluginServicer(resource, backend)
        self._server: grpc.aio.Server | None = None
        self.registrations = 0
        # True from a successful Register until the next start/stop: a start whose Register failed leaves the
        # socket served, so the socket alone does not say the kubelet knows this plugin
        self.registered = False

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.endpoint

    @property
    def serving(self) -> bool:
        """Listening on its socket and registered with the kubelet that was there when it registered."""
        return self._server is not None and self.registered and self.socket_path.exists()

    async def start(self) -> None:
        """Listen on the plugin socket (replacing a stale one) and register with the kubelet."""
        await self.stop()
        self.servicer = DevicePluginServicer(self.resource, self.servicer.backend)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        if len(str(self.socket_path)) > 107:
            raise OSError(f"{self.socket_path} is too long for a Unix socket address (107 bytes)")
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        await self.register()

    async def register(self) -> None:
        await self._call_register()
        self.registrations += 1
        self.registered = True
        log.info("registered %s with the kubelet (socket %s)", self.resource, self.socket_path)

    async def _call_register(self) -> None:
        """The kubelet's Registration.Register call (raises if the kubelet does not take it)."""
        kubelet = self.plugin_dir / KUBELET_SOCKET
        async with grpc.aio.insecure_channel(f"unix://{kubelet}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            await stub.Register(pb.RegisterRequest(
                version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource,
                options=pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)),
                timeout=REGISTER_TIMEOUT_S)

    async def stop(self) -> None:
        self.registered = False
        if self._server is not None:
            self.servicer.stop_streams()
            await self._server.stop(grace=0.5)
            self._server = None

    def notify(self) -> None:
        self.servicer.notify()


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


async def keep_registered(servers: list[DevicePluginServer], stop: asyncio.Event,
                          poll_s: float = WATCH_KUBELET_S) -> None:
    """Start every plugin, and start them again whenever the kubelet restarts: a restarting kubelet removes
    the plugins' sockets and creates a new kubelet.sock, and forgets every registration."""
    if not servers:
        return
    kubelet = servers[0].plugin_dir / KUBELET_SOCKET
    seen: int | None = None
    retry_s = poll_s
    while not stop.is_set():
        current = _inode(kubelet)
        # (a kubelet's new socket may reuse the old one's inode number, so a plugin whose Register failed stays
        # lost until one succeeds, whatever the inode says)
        lost = [s for s in servers if not s.serving]
        if current is not None and (current != seen or lost):
            # Each plugin on its own: one that fails stays lost (`serving`) and is tried again alone, and the others
            # keep their registration and their ListAndWatch streams (restarting all of them at every retry cut
            # those streams each time).
            failed = False
            for s in (servers if current != seen else lost):
                try:
                    await s.start()
                except Exception as exc:    # the kubelet not answering yet, a socket that cannot be made: retry
                    why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"
                    log.warning("registration of %s with the kubelet at %s failed: %s; retrying in %.0f s",
                                s.resource, kubelet, why, retry_s)
                    failed = True
            seen = current
            retry_s = min(retry_s * 2, 30.0) if failed else poll_s
        try:
            await asyncio.wait_for(stop.wait(), retry_s)
        except asyncio.TimeoutError:
            pass
    for s in servers:
        await s.stop()
