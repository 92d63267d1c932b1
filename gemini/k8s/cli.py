"""gem-node: gemini's Kubernetes node agent (one per GPU node, as a DaemonSet; see docs/kubernetes.md).

    gem-node --node-name "$NODE_NAME" [--config /etc/gemini/node.yaml] [--kubelet-dir /var/lib/kubelet]
             [--root /var/lib/gemini] [--board-root /run/gemini/board] [--kubeconfig FILE] [--metrics-port N] [-v]
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click

from gemini.logs import setup_logging

log = logging.getLogger("gemini.k8s")


def _core_api(kubeconfig: str | None):
    from kubernetes import client, config
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        config.load_incluster_config()
    return client.CoreV1Api()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--node-name", envvar="NODE_NAME", required=True,
              help="This node's name (the DaemonSet passes spec.nodeName). [env: NODE_NAME]")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="The node settings (node.yaml from the ConfigMap); every key optional.")
@click.option("--kubelet-dir", default="/var/lib/kubelet", show_default=True,
              help="The kubelet's directory (device-plugins/ and pod-resources/ below it).")
@click.option("--root", default="/var/lib/gemini", show_default=True,
              help="gem-node's host directory: lib/ (the hook, mounted into containers), ipc/ (the group sockets, "
                   "mounted into containers), schd/ (gem-schd's sockets), conf/ "
                   "(the hook settings of each group, mounted into its containers), state/.")
@click.option("--board-root", default="/run/gemini/board", show_default=True,
              help="Host directory of gem-schd's board pages (a directory per GPU, mounted into containers); "
                   "on a tmpfs, as the host's /run is.")
@click.option("--kubeconfig", default=None, help="Reach the API server with this file instead of in-cluster config.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Prometheus metrics port (default: the config's metricsPort, 9400; 0 = none).")
@click.option("-v", "--verbose", count=True, help="More logging (-v debug).")
def main(node_name: str, config_path: str | None, kubelet_dir: str, root: str, board_root: str,
         kubeconfig: str | None, metrics_port: int | None, verbose: int) -> None:
    """Run gemini on this Kubernetes node: device plugins for gemini.io/gpu-percent and gemini.io/gpu-memory,
    gem-schd per GPU, a pod manager per container, settings from the pods' annotations."""
    from gemini.hookpath import HookNotFound, hook_path

    from . import devices as dv
    from .launch import ProcessLauncher
    from .nodeconfig import NodeConfigError, load_node_config
    from .service import DiscoveryError, GemNode, NodeOptions, discover_gpus

    setup_logging("gem-node", logging.DEBUG if verbose else logging.INFO)
    try:
        cfg = load_node_config(config_path)
        gpus = cfg.gpus or discover_gpus()
        hook = hook_path()
    except (NodeConfigError, DiscoveryError, HookNotFound) as exc:
        click.echo(f"gem-node: {exc}", err=True)
        sys.exit(2)
    if not gpus:
        click.echo("gem-node: no GPU found on this node", err=True)
        sys.exit(2)
    base = Path(root)
    layout = dv.HostLayout(hook=str(base / "lib" / "libgemhook.so.1"), preload=str(base / "lib" / "ld.so.preload"),
                           ipc_root=str(base / "ipc"), settings_root=str(base / "conf"), board_root=board_root,
                           schd_root=str(base / "schd"))
    options = NodeOptions(node_name=node_name, state_dir=base / "state", layout=layout,
                          plugin_dir=Path(kubelet_dir) / "device-plugins",
                          pod_resources_socket=str(Path(kubelet_dir) / "pod-resources" / "kubelet.sock"),
                          defaults=cfg.defaults, hook_source=hook,
                          metrics_port=cfg.metrics_port if metrics_port is None else metrics_port)
    try:
        inventory = dv.Inventory(tuple(gpus), cfg.reserved_memory)
    except ValueError as exc:   # a GPU listed twice, a UUID no directory can be named after
        click.echo(f"gem-node: {config_path or 'the GPUs found'}: {exc}", err=True)
        sys.exit(2)
    launcher = ProcessLauncher(layout.ipc_root, log_dir=base / "log", schd_args=list(cfg.scheduler_args),
                               board_root=layout.board_root, schd_root=layout.scheduler_root)
    for g in gpus:
        log.info("GPU %d %s: %d MiB, %d memory units of 256 MiB", g.index, g.uuid, g.memory_bytes >> 20,
                 inventory.memory_units(g))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await GemNode(options, inventory, launcher, _core_api(kubeconfig)).run(stop)

    asyncio.run(run())


if __name__ == "__main__":   # pragma: no cover
    main()
