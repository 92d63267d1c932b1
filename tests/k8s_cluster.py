"""One Kubernetes node, as far as gem-node can tell: the fake kubelet, the API server double driven by the official
client, the real gem-node with real gem-schd and pod managers (socket transport), and cgroups shaped as the
kubelet makes them. Used by the end-to-end tests on the simulated driver and on a GPU.

    with Cluster(tmp_path, gpus, hook_source=hook_lib) as c:
        uid, opts = c.admit_pod("team-a", "train", {PCT: 30, MEM: 4}, {"gemini.io/max-util": "0.3"})
        env = c.container_env(opts, base_env)        # Allocate's env, container paths mapped to host paths
        proc = subprocess.Popen(c.in_pod(uid, argv), env=env)
        c.delete_pod("team-a", "train")
"""
from __future__ import annotations

import sys
from pathlib import Path

from gemini.k8s import devices as dv
from gemini.k8s.launch import ProcessLauncher
from tests.k8s_apiserver import ApiServer, pod as api_pod
from tests.k8s_cgroups import PodCgroups
from tests.k8s_harness import NodeHarness
from tests.k8s_kubelet import ContainerOptions


def container_env(opts: ContainerOptions, base: dict) -> dict:
    """`base` plus the container's env from its Allocate answers, with every container path that a mount
    provides turned into the host path behind it (what the container would reach there)."""
    env = dict(base)
    for key, value in opts.envs.items():
        v = value.rstrip("/")
        for cpath, (hpath, _ro) in opts.mounts.items():
            if value == cpath:
                value = hpath
                break
            suffix = cpath[len(v):]
            if cpath.startswith(v + "/") and hpath.endswith(suffix):     # a parent of a mount: its host parent
                value = hpath[: len(hpath) - len(suffix)]
                break
        env[key] = value
    return env


def core_api(url: str):
    from kubernetes import client
    cfg = client.Configuration()
    cfg.host = url
    return client.CoreV1Api(client.ApiClient(cfg))


class Cluster:
    def __init__(self, tmp: Path, node_gpus: tuple[dv.Gpu, ...], hook_source: Path | None = None,
                 force_fixture: bool = False, schd_args: list[str] | None = None):
        self.tmp = Path(tmp)
        self.api = ApiServer()
        self.cgroups = PodCgroups(self.tmp, force_fixture=force_fixture)
        self.node = NodeHarness(self.tmp, node_gpus, hook_source=hook_source)
        self.log_dir = self.tmp / "logs"
        self.node.launcher = ProcessLauncher(self.node.layout.ipc_root, log_dir=self.log_dir,
                                             schd_args=schd_args or ["-q", "20", "-m", "5", "-w", "1000"],
                                             pmgr_args=["--proc-root", self.cgroups.proc_root],
                                             board_root=self.node.layout.board_root)

    def __enter__(self) -> "Cluster":
        self.api.start()
        self.node.core_api = core_api(self.api.url)
        try:
            self.node.__enter__()
        except BaseException:
            self.api.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.node.__exit__(*exc)
        finally:
            self.api.stop()
            self.cgroups.cleanup()

    def admit_pod(self, namespace: str, name: str, requests: dict[str, int], annotations: dict | None = None,
                  container: str = "main") -> tuple[str, ContainerOptions]:
        """The pod created in the API, its container admitted and started as the kubelet would (Allocate, then
        PreStartContainer, which returns once gem-node serves it). (pod uid, the container's options)."""
        obj = self.api.create(api_pod(namespace, name, self.node.options.node_name, annotations))
        opts = self.node.kubelet.admit(namespace, name, container, requests)
        self.node.kubelet.prestart(namespace, name, container)
        return obj["metadata"]["uid"], opts

    def delete_pod(self, namespace: str, name: str) -> None:
        """As a pod deletion: gone from the API, its devices freed by the kubelet (its processes: the caller)."""
        self.api.delete(namespace, name)
        self.node.kubelet.remove_pod(namespace, name)

    def container_env(self, opts: ContainerOptions, base: dict) -> dict:
        return container_env(opts, base)

    def in_pod(self, pod_uid: str | None, argv: list) -> list[str]:
        return self.cgroups.argv(pod_uid, [str(a) for a in argv])

    def logs(self, tail: int = 6000) -> str:
        parts = []
        for log in sorted(self.log_dir.glob("*.log")) if self.log_dir.exists() else []:
            parts.append(f"--- {log.name}\n{log.read_text()[-tail:]}")
        return "\n".join(parts)

    def dump_logs(self) -> None:
        sys.stderr.write(self.logs() + "\n")
