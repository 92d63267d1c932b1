"""Put test processes into Kubernetes-shaped cgroups, as a kubelet would put a container's processes.

Real cgroups when this process may make them (root and a writable cgroup hierarchy: cgroup v2 if there is
one, else v1's pids hierarchy), named as the systemd driver names them:

    <hierarchy>/gemini-test-<n>/kubepods-besteffort-pod<uid_>.slice/cri-containerd-<id>.scope

Otherwise fixture files: a fake proc root where each process's <root>/<pid>/cgroup says the same, which the
pod managers are pointed at (gem-pmgr --proc-root). `mode` says which, and tests print it.

A process is placed by running it through `argv(pod_uid, argv)`: a tiny wrapper that moves itself (or writes
its fixture) and then execs the program, so the program's pid is the one placed, before it can connect.
"""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

WRAPPER = r"""
import os, sys
target, kind = sys.argv[1], sys.argv[2]
if kind == "real":
    with open(os.path.join(target, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
else:
    os.makedirs(os.path.join(target, str(os.getpid())), exist_ok=True)
    with open(os.path.join(target, str(os.getpid()), "cgroup"), "w") as f:
        f.write(sys.argv[3])
os.execvp(sys.argv[4], sys.argv[4:])
"""


def _writable_hierarchy() -> tuple[Path, str] | None:
    if os.geteuid() != 0:
        return None
    candidates = []
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        candidates.append((Path("/sys/fs/cgroup"), "0:"))
    if Path("/sys/fs/cgroup/unified/cgroup.controllers").exists():
        candidates.append((Path("/sys/fs/cgroup/unified"), "0:"))
    if Path("/sys/fs/cgroup/pids/cgroup.procs").exists():
        candidates.append((Path("/sys/fs/cgroup/pids"), "pids"))
    for root, kind in candidates:
        probe = root / f"gemini-probe-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
            probe.rmdir()
            return root, kind
        except OSError:
            continue
    return None


class PodCgroups:
    def __init__(self, tmp: Path, force_fixture: bool = False):
        found = None if force_fixture else _writable_hierarchy()
        self.made: list[Path] = []
        self.base: Path | None = None
        if found is not None:
            self.hierarchy, kind = found
            self.mode = f"real cgroups under {self.hierarchy}"
            self.base = self.hierarchy / f"gemini-test-{secrets.token_hex(4)}"
            self.base.mkdir()
            self.made.append(self.base)
            self.proc_root = "/proc"
        else:
            self.mode = "fixture /proc/<pid>/cgroup files (cgroups cannot be created here)"
            self.proc_root = str(Path(tmp) / "proc")
            Path(self.proc_root).mkdir(parents=True, exist_ok=True)

    @property
    def real(self) -> bool:
        return self.base is not None

    def _slice(self, pod_uid: str) -> str:
        return f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"

    def argv(self, pod_uid: str | None, argv: list[str], container_id: str | None = None) -> list[str]:
        """argv run inside the pod's cgroup (pod_uid None: in no pod, e.g. a host process)."""
        cid = container_id or secrets.token_hex(32)
        if pod_uid is None:
            path = "/user.slice/user-0.slice/session-1.scope"
            if self.base is not None:
                return list(argv)       # left where the test runs: in no pod
            return [sys.executable, "-c", WRAPPER, self.proc_root, "fixture", f"0::{path}\n", *argv]
        rel = f"{self._slice(pod_uid)}/cri-containerd-{cid}.scope"
        if self.base is not None:
            target = self.base / rel
            target.mkdir(parents=True, exist_ok=True)
            self.made += [target.parent, target]
            return [sys.executable, "-c", WRAPPER, str(target), "real", "-", *argv]
        return [sys.executable, "-c", WRAPPER, self.proc_root, "fixture", f"0::/kubepods.slice/{rel}\n", *argv]

    def cleanup(self) -> None:
        """Remove the cgroups made (their processes must have exited)."""
        for path in sorted(set(self.made), key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir()
            except OSError:
                pass
