"""Which pod a process belongs to, from its cgroup: the identity gem-node trusts (never the environment).

The kubelet puts every container of a pod under a cgroup named after the pod's UID, whatever the runtime
and driver. /proc/<pid>/cgroup is written by the kernel, so a process cannot change what it says about
itself (short of being privileged enough to write to the host's cgroup tree: see docs/kubernetes.md).

Forms recognised (one line per hierarchy on cgroup v1, one "0::" line on v2; paths may start with "/.."
components when the reader is in another cgroup namespace, or with a kubelet --cgroup-root prefix):

    cgroupfs driver:  /kubepods/burstable/pod<uid>/<container-id>            (containerd, docker)
                      /kubepods/pod<uid>/crio-<container-id>                (CRI-O; Guaranteed pods have no QoS level)
    systemd driver:   /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/
                          cri-containerd-<id>.scope | crio-<id>.scope | docker-<id>.scope
                      (the UID's dashes become underscores in slice names; a prefix such as "kubelet-" may come
                      before "kubepods" when the kubelet has a --cgroup-root)

parse_proc_cgroup() is a pure function of the file's text; CgroupAuthorizer reads the file of a connecting
process (its pid from SO_PEERCRED) and allows it only into its own pod's group.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gemini.peercred import PeerCredentials

log = logging.getLogger("gemini.k8s.cgroup")

_HEX = "0-9a-fA-F"
# A pod UID: an RFC 4122 UUID (API pods) or 32 hex digits (static pods: a hash of the manifest).
_UID = rf"[{_HEX}]{{8}}[-_][{_HEX}]{{4}}[-_][{_HEX}]{{4}}[-_][{_HEX}]{{4}}[-_][{_HEX}]{{12}}|[{_HEX}]{{32}}"
_QOS = r"(?:burstable|besteffort|guaranteed)"
_CGROUPFS_POD = re.compile(rf"^pod({_UID})$")
_SYSTEMD_POD = re.compile(rf"^(?:[A-Za-z0-9_.]+-)?kubepods(?:-{_QOS})?-pod({_UID})\.slice$")
_CONTAINER = re.compile(rf"^(?:(?:cri-containerd|crio|docker)-)?([{_HEX}]{{64}})(?:\.scope)?$")
MAX_CGROUP_BYTES = 64 * 1024     # a real file is a few hundred bytes; anything bigger is not one


class CgroupError(ValueError):
    """A cgroup file that names more than one pod, or that cannot be read."""


@dataclass(frozen=True)
class CgroupIdentity:
    pod_uid: str                    # canonical form: lower case, dashes
    container_id: str | None        # the runtime's 64-hex id, when the process is in a container's cgroup


def _canonical_uid(raw: str) -> str:
    return raw.replace("_", "-").lower()


def identity_from_path(path: str) -> CgroupIdentity | None:
    """The pod (and container) a cgroup path lies in, or None for a path outside any pod."""
    parts = [p for p in path.strip().split("/") if p and p not in (".", "..")]
    for i, part in enumerate(parts):
        m = _SYSTEMD_POD.match(part)
        if m is None:
            m = _CGROUPFS_POD.match(part)
            # cgroupfs names are plain "pod<uid>": only under a "kubepods" level, so that some other
            # cgroup that happens to be called pod<hex> is not taken for a pod
            if m is not None and not any(p == "kubepods" or p.endswith("-kubepods") or p.endswith("kubepods.slice")
                                         for p in parts[:i]):
                m = None
        if m is None:
            continue
        container = None
        if i + 1 < len(parts):
            c = _CONTAINER.match(parts[i + 1])
            container = c.group(1).lower() if c else None
        return CgroupIdentity(_canonical_uid(m.group(1)), container)
    return None


def parse_proc_cgroup(text: str) -> CgroupIdentity | None:
    """The pod of a process from the text of its /proc/<pid>/cgroup; None if it is in no pod.

    Every hierarchy that places the process in a pod must name the same pod (and the same container where
    one is named), else CgroupError: a process is in exactly one pod.
    """
    found: CgroupIdentity | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split(":", 2)
        if len(fields) != 3:
            raise CgroupError(f"line {number}: expected 'hierarchy:controllers:path', got {line[:80]!r}")
        ident = identity_from_path(fields[2])
        if ident is None:
            continue
        if found is None:
            found = ident
            continue
        if ident.pod_uid != found.pod_uid:
            raise CgroupError(f"the process is in the cgroups of two pods: {found.pod_uid} and {ident.pod_uid}")
        if ident.container_id and found.container_id and ident.container_id != found.container_id:
            raise CgroupError(f"the process is in the cgroups of two containers of pod {found.pod_uid}")
        if found.container_id is None and ident.container_id:
            found = ident
    return found


def read_proc_cgroup(pid: int, proc_root: str | Path = "/proc") -> str:
    """The text of /proc/<pid>/cgroup (bounded). CgroupError if it cannot be read (the process is gone,
    or lives in a pid namespace this one cannot see)."""
    path = Path(proc_root) / str(int(pid)) / "cgroup"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CGROUP_BYTES + 1)
    except OSError as exc:
        raise CgroupError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CGROUP_BYTES:
        raise CgroupError(f"{path} is larger than {MAX_CGROUP_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


class CgroupAuthorizer:
    """A pod manager's PeerAuthorizer (gemini/podmgr/auth.py) on Kubernetes: a client may join only if the
    kernel places it in the pod this pod manager serves. `authorize` returns None to allow, else the reason for
    the refusal (the client sees it). The group name the client says in its HELLO plays no part in the
    decision."""

    def __init__(self, pod_uid: str, pod: str, read_cgroup: Callable[[int], str] = read_proc_cgroup):
        self.pod_uid = _canonical_uid(pod_uid)
        self.pod = pod                  # "namespace/name", for messages
        self._read = read_cgroup

    def authorize(self, creds: PeerCredentials, hello_group: str) -> str | None:
        pid = int(getattr(creds, "pid", 0) or 0)
        if pid <= 0:
            # SO_PEERCRED reports pid 0 for a peer in a pid namespace this process cannot see.
            return "gem-node cannot see the connecting process (run gem-node with hostPID: true)"
        try:
            ident = parse_proc_cgroup(self._read(pid))
        except CgroupError as exc:
            log.warning("refusing pid %d for pod %s: %s", pid, self.pod, exc)
            return f"cannot tell the pod of process {pid}: {exc}"
        if ident is None:
            log.warning("refusing pid %d for pod %s: it is in no pod's cgroup", pid, self.pod)
            return f"process {pid} is not in a Kubernetes pod; this group belongs to pod {self.pod}"
        if ident.pod_uid != self.pod_uid:
            log.warning("refusing pid %d (pod uid %s) for pod %s (uid %s)", pid, ident.pod_uid, self.pod,
                        self.pod_uid)
            return f"process {pid} belongs to another pod (uid {ident.pod_uid}); this group belongs to pod {self.pod}"
        return None
