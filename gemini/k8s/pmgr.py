"""The pod manager of one Kubernetes container's group: gem-pmgr on the socket transport, admitting only the
processes the kernel places in that container's pod (cgroup.CgroupAuthorizer).

    python -m gemini.k8s.pmgr --group k8s-3f9c... --ipc-dir /var/lib/gemini/ipc --device-uuid GPU-... \
        --pod-uid 5f0c2a1e-... --pod team-a/train/main

The group's socket is connectable by every user (mode 0666): containers run under any uid, and who may join is
decided by the process's cgroup, not by its uid. The socket's directory stays root's and read-only in the
containers, so no container can replace it.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

import click

from gemini import transport
from gemini.podmgr.admission import Limits
from gemini.logs import level_from_flags, setup_logging
from gemini.podmgr.cli import raise_fd_limit, serve
from gemini.podmgr.server import PodManagerServer

from .cgroup import CgroupAuthorizer, read_proc_cgroup

log = logging.getLogger("gemini.k8s.pmgr")

POD_SOCKET_MODE = 0o666


@dataclass(frozen=True)
class PodSocketAccess(transport.SocketAccess):
    """A group socket any uid may connect to: on Kubernetes the authorizer, not the file mode, says who joins."""
    mode: int = POD_SOCKET_MODE

    def check(self) -> tuple[int, int]:
        return self.ids()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--group", required=True, help="The group (named by gem-node from the container's memory units).")
@click.option("--ipc-dir", required=True, metavar="DIR", help="The sockets' root directory (one subdirectory a GPU).")
@click.option("--scheduler-ipc-dir", metavar="DIR", default=None,
              help="Where gem-schd's socket is (one subdirectory a GPU); default: --ipc-dir.")
@click.option("--device-uuid", required=True, help="The GPU (\"GPU-...\").")
@click.option("--pod-uid", required=True, help="The pod whose processes may join.")
@click.option("--pod", "pod_ref", required=True, help="namespace/name/container, for messages.")
@click.option("--proc-root", default="/proc", show_default=True, help="Where to read /proc/<pid>/cgroup.")
@click.option("-v", "--verbose", count=True)
def main(group: str, ipc_dir: str, scheduler_ipc_dir: str | None, device_uuid: str, pod_uid: str, pod_ref: str,
         proc_root: str, verbose: int) -> None:
    """Pod manager of one container's group on a Kubernetes node."""
    setup_logging(f"gem-pmgr[{pod_ref}]", level_from_flags(verbose or 1, None, logging.WARNING))
    authorizer = CgroupAuthorizer(pod_uid, pod_ref, read_cgroup=lambda pid: read_proc_cgroup(pid, proc_root))
    limits = Limits()
    raise_fd_limit(limits.total + 256)
    server = PodManagerServer(group, device_uuid=device_uuid, ipc_dir=ipc_dir, socket_access=PodSocketAccess(),
                              authorizer=authorizer, limits=limits, scheduler_ipc_dir=scheduler_ipc_dir)
    try:
        asyncio.run(serve(server))
    except (OSError, transport.TransportError) as exc:
        click.echo(f"gem-pmgr[{pod_ref}]: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
