"""gem-node's daemons as processes: gem-schd per GPU and a pod manager per group, on the socket transport.

    gem-schd   --ipc-dir IPC --device-uuid GPU-... -f <state>/<GPU>/resource-config.txt
               --board <board root>/<GPU>/board-<random>   (a new name each start: see start_scheduler)
    gem-pmgr   python -m gemini.k8s.pmgr --group G --ipc-dir IPC --device-uuid GPU-... --pod-uid UID --pod ns/name/c

Each child gets SIGTERM when gem-node dies (PR_SET_PDEATHSIG), so a killed gem-node leaves no daemon behind;
a restarted gem-node starts them again from the pods (their sockets are replaced atomically).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gemini import transport
from gemini.launch.backend import _pdeathsig_preexec

from gemini.wire import sched as sm

from . import devices as dv
from .policy import Placement

log = logging.getLogger("gemini.k8s.launch")

STOP_GRACE_S = 3.0
STATUS_TIMEOUT_S = 1.0
BOARD_PREFIX = "board-"


def group_socket(ipc_root: str | Path, gpu_uuid: str, group: str) -> Path:
    """Where a group's pod manager listens (gemini.transport's layout)."""
    return transport.group_socket(ipc_root, group, gpu_uuid)


def scheduler_socket(ipc_root: str | Path, gpu_uuid: str) -> Path:
    return transport.scheduler_socket(ipc_root, gpu_uuid)


@dataclass
class ProcessDaemon:
    proc: subprocess.Popen
    socket: Path
    what: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        return self.alive() and self.socket.exists()

    async def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            for _ in range(int(STOP_GRACE_S / 0.02)):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.02)
            else:
                log.warning("%s did not stop within %.0f s: killing it", self.what, STOP_GRACE_S)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)


async def scheduler_status(endpoint: str, timeout_s: float = STATUS_TIMEOUT_S) -> sm.StatusReply:
    """gem-schd's status over zmq (a fresh DEALER each time: a late reply cannot be taken for the next one).
    TimeoutError if it does not answer."""
    import zmq
    import zmq.asyncio
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(sm.encode(sm.StatusRequest()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no status from gem-schd at {endpoint} within {timeout_s:g} s")
            reply = sm.decode(await sock.recv(), allowed=sm.FROM_SCHEDULER)
            if isinstance(reply, sm.StatusReply):
                return reply
    finally:
        sock.close(0)


def scheduler_endpoint(ipc_root: str | Path, gpu_uuid: str) -> str:
    return f"ipc://{scheduler_socket(ipc_root, gpu_uuid)}"


class ProcessLauncher:
    """Starts the daemons as child processes of gem-node, logging to its stderr (or `log_dir`)."""

    def __init__(self, ipc_root: str | Path, log_dir: str | Path | None = None, python: str = sys.executable,
                 schd_args: list[str] | None = None, pmgr_args: list[str] | None = None,
                 env: dict[str, str] | None = None, board_root: str | Path | None = None,
                 schd_root: str | Path | None = None):
        self.ipc_root = Path(ipc_root)
        # gem-schd's sockets, apart from the group sockets that containers see (devices.HostLayout.schd_root)
        self.schd_root = Path(schd_root) if schd_root else dv.default_scheduler_root(self.ipc_root)
        self.board_root = Path(board_root) if board_root is not None else None  # None: gem-schd's default
        self.log_dir = Path(log_dir) if log_dir else None
        self.python = python
        self.schd_args = list(schd_args or [])
        self.pmgr_args = list(pmgr_args or [])
        self.env = dict(os.environ if env is None else env)
        for key in ("LD_PRELOAD", "GEMINI_IPC_DIR", "GEMINI_GROUP_NAME"):   # the daemons are never hooked
            self.env.pop(key, None)

    def _spawn(self, argv: list[str], label: str) -> subprocess.Popen:
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{label}.log", "ab", buffering=0)
        try:
            return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, preexec_fn=_pdeathsig_preexec())
        finally:
            if out is not None:
                out.close()

    def board_path(self, gpu: dv.Gpu) -> Path | None:
        """A new board page for the GPU's next gem-schd, in the directory mounted into containers (old pages
        there removed: their gem-schd is gone, and whoever still maps one keeps it until it lets go).

        A new name each start, because the pod managers and hooks map the page their handshake names and map
        again only when the name changes: a new gem-schd's page under the old name would go unseen."""
        if self.board_root is None:
            return None
        d = self.board_root / gpu.uuid
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
        for old in d.glob(BOARD_PREFIX + "*"):
            try:
                old.unlink()
            except OSError as exc:
                log.warning("cannot remove the old board page %s: %s", old, exc)
        return d / f"{BOARD_PREFIX}{secrets.token_hex(4)}"

    def start_scheduler(self, gpu: dv.Gpu, config_path: Path) -> ProcessDaemon:
        argv = [self.python, "-m", "gemini.scheduler.cli", "--ipc-dir", str(self.schd_root), "--device-uuid", gpu.uuid,
                "-f", str(config_path), "-p", str(config_path.parent)] + self.schd_args
        board = self.board_path(gpu)
        if board is not None:
            argv += ["--board", str(board)]
        proc = self._spawn(argv, f"gem-schd-{gpu.uuid}")
        log.info("GPU %d (%s): gem-schd started (pid %d)", gpu.index, gpu.uuid, proc.pid)
        return ProcessDaemon(proc, scheduler_socket(self.schd_root, gpu.uuid), f"gem-schd of {gpu.uuid}")

    async def registered(self, gpu: dv.Gpu, group: str) -> bool:
        try:
            reply = await scheduler_status(scheduler_endpoint(self.schd_root, gpu.uuid))
        except (TimeoutError, OSError, sm.MessageError):
            return False
        return any(g["name"] == group and g["connected"] for g in reply.groups)

    def start_pod_manager(self, gpu: dv.Gpu, placement: Placement) -> ProcessDaemon:
        argv = [self.python, "-m", "gemini.k8s.pmgr", "--group", placement.group, "--ipc-dir", str(self.ipc_root),
                "--scheduler-ipc-dir", str(self.schd_root),
                "--device-uuid", gpu.uuid, "--pod-uid", placement.pod_uid, "--pod", placement.ref] + self.pmgr_args
        proc = self._spawn(argv, f"gem-pmgr-{placement.group}")
        log.info("GPU %d: pod manager of %s started as group %s (pid %d)", gpu.index, placement.ref,
                 placement.group, proc.pid)
        return ProcessDaemon(proc, group_socket(self.ipc_root, gpu.uuid, placement.group),
                             f"pod manager of {placement.ref}")
