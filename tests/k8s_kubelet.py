"""A fake kubelet for gem-node's tests: the Registration and PodResources services on Unix sockets in a
temporary directory, and a device manager that calls the plugins as the kubelet does.

    kubelet = FakeKubelet(tmp).start()     # tmp/device-plugins/kubelet.sock, tmp/pod-resources/kubelet.sock
    ... gem-node registers its plugins ...
    kubelet.wait_registered({"gemini.io/gpu-percent", "gemini.io/gpu-memory"})
    opts = kubelet.admit("team-a", "train", "main", {"gemini.io/gpu-percent": 30, "gemini.io/gpu-memory": 16})
    kubelet.prestart("team-a", "train", "main")      # PreStartContainer for each resource, as before a start
    kubelet.remove_pod("team-a", "train")             # the kubelet frees a terminated pod's devices

For each container and resource `admit` does what the kubelet's device manager does: the healthy devices not
already allocated, GetPreferredAllocation (when the plugin offers it), the preferred devices topped up from the
rest, Allocate, the devices recorded for PodResources; then the answers of all the container's resources merged
into one set of env and mounts, the first value of a key winning (and a conflict recorded, as the kubelet logs it).
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gemini.k8s.proto import deviceplugin_v1beta1_pb2 as dp
from gemini.k8s.proto import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from gemini.k8s.proto import podresources_v1_pb2 as pr
from gemini.k8s.proto import podresources_v1_pb2_grpc as pr_grpc


class KubeletError(Exception):
    """What the kubelet would report as the pod's admission or start failure."""


@dataclass
class Plugin:
    resource: str
    endpoint: str
    options: dp.DevicePluginOptions
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)       # id -> health
    updates: int = 0


@dataclass
class ContainerOptions:
    envs: dict[str, str]
    mounts: dict[str, tuple[str, bool]]                         # container path -> (host path, read only)
    conflicts: list[str]
    device_ids: dict[str, list[str]]


class FakeKubelet(dp_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.plugin_dir = self.root / "device-plugins"
        self.podres_socket = self.root / "pod-resources" / "kubelet.sock"
        self.plugins: dict[str, Plugin] = {}
        self.registrations: list[dp.RegisterRequest] = []
        # (namespace, pod) -> container -> resource -> device ids
        self.allocated: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
        self.responses: dict[tuple[str, str, str], dict[str, dp.ContainerAllocateResponse]] = {}
        self.preferred_calls: list[tuple[str, list[str]]] = []
        self.list_delay_s = 0.0     # List answers what it saw this long ago (a slow kubelet: its list goes stale)
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None

    # --- the kubelet's own services ------------------------------------------------------------------------------

    def start(self) -> "FakeKubelet":
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.podres_socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_RegistrationServicer_to_server(self, server)
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.plugin_dir / 'kubelet.sock'}")
        server.add_insecure_port(f"unix://{self.podres_socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        for p in self.plugins.values():
            p.channel.close()
        if self._server is not None:
            # Wait for the shutdown to finish: gRPC removes a Unix listener's socket file when its shutdown
            # completes, so an unfinished one can delete the socket file a restarted kubelet has just made at the
            # same path (1 restart in 200 on the development machine; CI saw it as plugins never registering).
            if not self._server.stop(0).wait(10):
                raise RuntimeError("the fake kubelet's gRPC server did not shut down within 10 s")
            self._server = None

    def restart(self) -> None:
        """As a restarting kubelet: forget every plugin, remove the sockets in the directory, serve anew."""
        self.stop()
        self.plugins.clear()
        for sock in self.plugin_dir.glob("*.sock"):
            sock.unlink()
        self.start()

    def Register(self, request, context):
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        channel = grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        plugin = Plugin(request.resource_name, request.endpoint, request.options, channel,
                        dp_grpc.DevicePluginStub(channel))
        old = self.plugins.get(request.resource_name)
        if old is not None:
            old.channel.close()
        with self._cond:
            self.registrations.append(request)
            self.plugins[request.resource_name] = plugin
        threading.Thread(target=self._list_and_watch, args=(plugin,), daemon=True).start()
        return dp.Empty()

    def _list_and_watch(self, plugin: Plugin) -> None:
        try:
            for reply in plugin.stub.ListAndWatch(dp.Empty()):
                with self._cond:
                    plugin.devices = {d.ID: d.health for d in reply.devices}
                    plugin.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            pass        # the plugin went away (or we closed the channel)

    def List(self, request, context):
        reply = pr.ListPodResourcesResponse(pod_resources=[self._pod_resources(k) for k in sorted(self.allocated)])
        if self.list_delay_s:
            time.sleep(self.list_delay_s)
        return reply

    def Get(self, request, context):
        key = (request.pod_namespace, request.pod_name)
        if key not in self.allocated:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key} not found")
        return pr.GetPodResourcesResponse(pod_resources=self._pod_resources(key))

    def _pod_resources(self, key) -> pr.PodResources:
        containers = [pr.ContainerResources(name=c, devices=[pr.ContainerDevices(resource_name=r, device_ids=ids)
                                                             for r, ids in sorted(res.items())])
                      for c, res in sorted(self.allocated[key].items())]
        return pr.PodResources(namespace=key[0], name=key[1], containers=containers)

    # --- the device manager -------------------------------------------------------------------------------------

    def wait_registered(self, resources: set[str], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(r in self.plugins and self.plugins[r].updates for r in resources):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"plugins not registered with devices within {timeout} s: "
                                         f"{sorted(self.plugins)}")
                self._cond.wait(left)

    def capacity(self, resource: str) -> int:
        return sum(1 for h in self.plugins[resource].devices.values() if h == "Healthy")

    def _in_use(self, resource: str) -> set[str]:
        return {d for pod in self.allocated.values() for res in pod.values() for d in res.get(resource, [])}

    def admit(self, namespace: str, pod: str, container: str, requests: dict[str, int],
              order: list[str] | None = None, choose: dict[str, list[str]] | None = None) -> ContainerOptions:
        """Allocate every resource of one container (in `order`, default as given), record them, and return the
        merged options. `choose` overrides the devices the kubelet picks for a resource (as a kubelet that
        ignores the preference). KubeletError as the kubelet would fail the pod."""
        key = (namespace, pod)
        responses: dict[str, dp.ContainerAllocateResponse] = {}
        for resource in order or list(requests):
            count = requests[resource]
            plugin = self.plugins.get(resource)
            if plugin is None:
                raise KubeletError(f"no device plugin for {resource}")
            free = sorted(d for d, h in plugin.devices.items() if h == "Healthy" and d not in self._in_use(resource))
            if count > len(free):
                raise KubeletError(f"insufficient {resource}: want {count}, {len(free)} free")
            chosen: list[str] = []
            if choose and resource in choose:
                chosen = list(choose[resource])
            else:
                if plugin.options.get_preferred_allocation_available:
                    reply = plugin.stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
                        dp.ContainerPreferredAllocationRequest(available_deviceIDs=free, must_include_deviceIDs=[],
                                                               allocation_size=count)]), timeout=10)
                    preferred = list(reply.container_responses[0].deviceIDs)
                    self.preferred_calls.append((resource, preferred))
                    chosen = [d for d in preferred if d in free][:count]
                chosen += [d for d in free if d not in chosen][: count - len(chosen)]
            try:
                reply = plugin.stub.Allocate(dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=chosen)]), timeout=10)
            except grpc.RpcError as exc:
                raise KubeletError(f"Allocate {resource}: {exc.details()}") from None
            responses[resource] = reply.container_responses[0]
            self.allocated.setdefault(key, {}).setdefault(container, {})[resource] = chosen
        self.responses[(namespace, pod, container)] = responses
        return self.options(namespace, pod, container)

    def options(self, namespace: str, pod: str, container: str) -> ContainerOptions:
        envs: dict[str, str] = {}
        mounts: dict[str, tuple[str, bool]] = {}
        conflicts = []
        responses = self.responses[(namespace, pod, container)]
        for resp in responses.values():
            for k, v in resp.envs.items():
                if k in envs:
                    if envs[k] != v:
                        conflicts.append(f"env {k}: {envs[k]} and {v}")
                    continue
                envs[k] = v
            for m in resp.mounts:
                if m.container_path in mounts:
                    if mounts[m.container_path][0] != m.host_path:
                        conflicts.append(f"mount {m.container_path}: {mounts[m.container_path][0]} and {m.host_path}")
                    continue
                mounts[m.container_path] = (m.host_path, m.read_only)
        ids = {r: list(self.allocated[(namespace, pod)][container][r]) for r in responses}
        return ContainerOptions(envs, mounts, conflicts, ids)

    def prestart(self, namespace: str, pod: str, container: str, timeout: float = 30) -> None:
        """PreStartContainer on every resource of the container whose plugin asks for it."""
        for resource, ids in self.allocated[(namespace, pod)][container].items():
            plugin = self.plugins[resource]
            if not plugin.options.pre_start_required:
                continue
            try:
                plugin.stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=ids), timeout=timeout)
            except grpc.RpcError as exc:
                raise KubeletError(f"PreStartContainer {resource}: {exc.code().name}: {exc.details()}") from None

    def remove_pod(self, namespace: str, pod: str) -> None:
        self.allocated.pop((namespace, pod), None)
        for key in [k for k in self.responses if k[:2] == (namespace, pod)]:
            del self.responses[key]
