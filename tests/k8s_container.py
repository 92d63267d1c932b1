"""A pod's process with a container's view of the files: run in a mount namespace of its own where, as in a
container, /dev/shm is private and the daemons' directories are reachable only through the Allocate mounts.

    argv = container_argv(opts, argv)          # opts: the container's Allocate answers (tests/k8s_kubelet.py)
    env = container_view_env(opts, base)       # its Allocate env; GEMINI_TEST_SETTINGS_FILE for the test hook

Inside the namespace:
- /dev/shm and /run are empty tmpfs (a container has its own; the host's board pages in /dev/shm are gone);
- every Allocate mount under /run (the GPU's socket directory and board directory) is bind-mounted read-only
  at its container path, and its host directory is hidden under an empty tmpfs, so a path the daemons see
  leads nowhere: only what the container is given can be used;
- the hook settings file is bind-mounted read-only onto itself (its container path, /etc/gemini/hook.conf,
  cannot be created here without writing under the host's /etc): the test build of the hook is pointed at it
  by GEMINI_TEST_SETTINGS_FILE; the hook library and ld.so.preload are reached by their host paths
  (LD_PRELOAD), as tests/k8s_cluster.container_env does.

Needs a mount namespace (root, or unprivileged user namespaces); `available()` says whether there is one. The
wrapper execs the program, so its pid is the one the cgroup wrapper placed.
"""
from __future__ import annotations

import functools
import os
import shlex
import subprocess
from pathlib import Path

from gemini.k8s import devices as dv
from tests.k8s_cluster import container_env
from tests.k8s_kubelet import ContainerOptions


@functools.lru_cache(maxsize=None)
def _unshare() -> tuple[str, ...] | None:
    """The unshare command that gives this user a private mount namespace, or None."""
    candidates = [("unshare", "-m", "--propagation", "private")]
    if os.geteuid() != 0:
        candidates = [("unshare", "-Urm", "--propagation", "private")]
    for cmd in candidates:
        try:
            ok = subprocess.run([*cmd, "sh", "-c", "mount -t tmpfs probe /tmp"], capture_output=True,
                                timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return cmd
    return None


def available() -> bool:
    return _unshare() is not None


def _run_mounts(opts: ContainerOptions) -> dict[str, str]:
    return {c: h for c, (h, _ro) in opts.mounts.items() if c.startswith("/run/")}


def container_argv(opts: ContainerOptions, argv: list[str]) -> list[str]:
    cmd = _unshare()
    assert cmd is not None, "no mount namespace can be made here"
    q = shlex.quote
    lines = ["set -e", "mount -t tmpfs -o mode=755 gemini-test-run /run"]
    if os.path.isdir("/dev/shm") and not os.path.realpath("/dev/shm").startswith("/run/"):
        lines.append("mount -t tmpfs -o mode=1777 gemini-test-shm /dev/shm")
    else:
        lines.append("mkdir -p \"$(readlink -f /dev/shm)\"")
    hide = set()
    for cpath, hpath in _run_mounts(opts).items():
        lines += [f"mkdir -p {q(cpath)}", f"mount --bind {q(hpath)} {q(cpath)}",
                  f"mount -o remount,bind,ro {q(cpath)}"]
        hide.add(str(Path(hpath).parent))
    settings = opts.mounts.get(dv.CONTAINER_SETTINGS)
    if settings is not None:
        lines += [f"mount --bind {q(settings[0])} {q(settings[0])}", f"mount -o remount,bind,ro {q(settings[0])}"]
    lines += [f"mount -t tmpfs -o size=4k gemini-test-hidden {q(h)}" for h in sorted(hide)]
    lines.append('exec "$@"')
    return [*cmd, "sh", "-c", "\n".join(lines), "container", *[str(a) for a in argv]]


def container_view_env(opts: ContainerOptions, base: dict) -> dict:
    """The container's env: its Allocate env with the paths under /run left as the container sees them (they
    are mounted there) and the others mapped to their host paths; the test hook pointed at the settings file."""
    run_mounted = {k: v for k, v in opts.envs.items() if v.startswith("/run/")}
    env = container_env(opts, base)
    env.update(run_mounted)
    settings = opts.mounts.get(dv.CONTAINER_SETTINGS)
    if settings is not None:
        env["GEMINI_TEST_SETTINGS_FILE"] = settings[0]
    return env
