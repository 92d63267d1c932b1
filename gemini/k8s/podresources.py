"""Which gemini units each container holds, from the kubelet's PodResources API (v1, List) on its Unix socket.

The kubelet records a container's devices when it allocates them, before the container starts, so gem-node
can learn a container's GPU and group between Allocate and PreStartContainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc.aio

from .devices import RESOURCES
from .proto import podresources_v1_pb2 as pb
from .proto import podresources_v1_pb2_grpc as pb_grpc

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 16 << 20     # as the kubelet's own clients: a node with many pods answers in several MiB


@dataclass(frozen=True)
class ContainerUnits:
    """One container that holds gemini units: {resource: device ids}."""
    namespace: str
    pod: str
    container: str
    units: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def pod_key(self) -> tuple[str, str]:
        return (self.namespace, self.pod)


def gemini_containers(response: pb.ListPodResourcesResponse) -> list[ContainerUnits]:
    """The containers of a List answer that hold units of gemini's resources (pure)."""
    out = []
    for pod in response.pod_resources:
        for c in pod.containers:
            units: dict[str, list[str]] = {}
            for d in c.devices:
                if d.resource_name in RESOURCES:
                    units.setdefault(d.resource_name, []).extend(d.device_ids)
            if units:
                out.append(ContainerUnits(pod.namespace, pod.name, c.name,
                                          {r: tuple(sorted(ids)) for r, ids in units.items()}))
    return out


class PodResourcesClient:
    """List over a channel kept open; `close()` at the end."""

    def __init__(self, socket_path: str = POD_RESOURCES_SOCKET):
        self.socket_path = socket_path
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> pb_grpc.PodResourcesListerStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}", options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        return pb_grpc.PodResourcesListerStub(self._channel)

    async def list(self) -> list[ContainerUnits]:
        """Raises grpc.aio.AioRpcError when the kubelet does not answer."""
        reply = await self._stub().List(pb.ListPodResourcesRequest(), timeout=TIMEOUT_S)
        return gemini_containers(reply)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
