"""launch-backend: start gem-schd and one gem-pmgr per group, keep them running, follow config edits.

    launch-backend [--ipc-dir DIR | --ip IP --port PORT] [--device-uuid GPU-...] [--config FILE]
                   [--base_quota MS] [--min_quota MS] [--window MS] [--schd-path PATH] [--pmgr-path PATH]
                   [--log-dir DIR] [--ports-file FILE] [-v]

Two transports (gemini/transport.py):
- Unix sockets (the default; --ipc-dir, default /tmp/gemini/ipc): gem-schd on DIR/<gpu>/gem-schd.sock, each
  group's pod manager on DIR/<gpu>/group.<name>.sock, owned and moded as the config's SocketOwner, SocketGroup
  and SocketMode say (default: this user, mode 0660). <gpu> is --device-uuid, or `default`. No TCP port.
- TCP (Gemini's; chosen by --port or --ip): gem-schd on PORT, the groups' pod managers on PORT+1, PORT+2, ...
  in the order of the config file.
When every daemon listens, a table "group port" (or "group socket") is printed on stdout (and written as JSON
{group: port or socket path} to --ports-file). Edits of the config are followed: a new group gets a pod
manager (on the next free port), a removed group's pod manager is stopped, a group whose socket settings
changed gets them at once, a bad edit changes nothing (gem-schd reloads the file by itself). A daemon that
dies is restarted (on its port or socket, with the same owner and mode) with backoff. SIGINT/SIGTERM stop
everything: SIGTERM, then SIGKILL after a grace period. Children never see a shell: every argument is argv.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

from gemini import transport
from gemini.config import Config, ConfigError, GroupConfig, load_config
from gemini.logs import setup_logging
from gemini.reload import ConfigReloader
from gemini.shutdown import exit_now

log = logging.getLogger("gemini.launch")

PROG = "launch-backend"
LISTEN_TIMEOUT_S = 15.0
KILL_GRACE_S = 3.0
DEBOUNCE_S = 0.1
POLL_S = 0.05
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_S = 10.0         # a daemon that ran this long restarts with the initial backoff again


class BackendError(Exception):
    """A reason not to start (or to give up); the text is for the user."""


# --- helpers -----------------------------------------------------------------------------------

def connect_host(ip: str) -> str:
    """Where to connect to reach a daemon bound to `ip` (wildcard binds are reached on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(ip, ip)


def port_free(ip: str, port: int) -> bool:
    family = socket.AF_INET6 if transport.is_ipv6(ip) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the daemons bind: TIME_WAIT is no obstacle
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def listening(ip: str, port: int) -> bool:
    try:
        socket.create_connection((connect_host(ip), port), timeout=0.5).close()
        return True
    except OSError:
        return False


def daemon_command(explicit: str | None, script: str, module: str) -> list[str]:
    """argv prefix of a daemon: --*-path if given, else the console script installed beside this Python
    (or on PATH), else `python -m module` with this interpreter."""
    if explicit:
        path = Path(explicit)
        if path.suffix == ".py":
            return [sys.executable, str(path)]
        return [str(path)]
    beside = Path(sys.executable).parent / script
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which(script)
    return [found] if found else [sys.executable, "-m", module]


def _child_env() -> dict:
    """The daemons' environment: ours, with the source tree we run from importable by `python -m`."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for name in ("POD_NAME", "POD_MANAGER_IP", "POD_MANAGER_PORT"):  # flags say it all; no stray defaults
        env.pop(name, None)
        env.pop("GEMINI_" + name, None)
    return env


def _pdeathsig_preexec():
    """A preexec_fn making the child get SIGTERM when launch-backend dies, even by SIGKILL (Linux only;
    None elsewhere). prctl is looked up here, in the parent, so the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)     # PR_SET_PDEATHSIG
        if os.getppid() != parent:                  # the parent died before the call: nothing to serve
            os._exit(1)
    return preexec


# --- supervised daemons -----------------------------------------------------------------------

@dataclass
class Child:
    label: str                      # "gem-schd" or the group name
    argv: list[str]
    port: int                       # 0 on the socket transport
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff: float = BACKOFF_START_S
    restart_at: float | None = None
    restarts: int = 0
    socket: Path | None = None      # where it listens on the socket transport
    access: transport.SocketAccess | None = None    # a group socket's owner and mode
    _log_file: IO | None = field(default=None, repr=False)

    @property
    def what(self) -> str:
        return "gem-schd" if self.label == "gem-schd" else f"gem-pmgr for group '{self.label}'"

    @property
    def where(self) -> str:
        return str(self.socket) if self.socket is not None else f"port {self.port}"

    def spawn(self, env: dict) -> None:
        if self._log_file is None and self.log_path is not None:
            # 0640 whatever the umask: logs name groups, ports and processes
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
            os.fchmod(fd, 0o640)
            self._log_file = os.fdopen(fd, "ab", buffering=0)
        out = self._log_file if self._log_file is not None else sys.stderr
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True,   # terminal Ctrl-C reaches us; we stop them
                                     preexec_fn=_pdeathsig_preexec())
        self.started_at = time.monotonic()
        self.restart_at = None
        log.debug("started %s (pid %d): %s", self.what, self.proc.pid, self.argv)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)     # its own session: the daemon and anything it started
            except ProcessLookupError:
                pass

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def stop_children(children: list[Child], grace: float = KILL_GRACE_S, sig: int = signal.SIGTERM) -> None:
    """`sig` (SIGTERM) to all, wait up to `grace`, SIGKILL what is left, reap everything."""
    for c in children:
        c.signal(sig)
    deadline = time.monotonic() + grace
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.005)   # the daemons exit within about 15 ms of the signal: a stop should not wait much longer
    for c in children:
        if c.alive():
            log.warning("%s did not stop within %.0f s: killing it", c.what, grace)
            c.signal(signal.SIGKILL)
    for c in children:
        if c.proc is not None:
            c.proc.wait()
        c.close_log()


class Interrupted(Exception):
    """SIGINT/SIGTERM while waiting for a daemon."""


def child_listening(child: Child, ip: str) -> bool:
    if child.socket is not None:
        return transport.socket_in_use(child.socket)
    return listening(ip, child.port)


async def wait_listening(child: Child, ip: str, stop: asyncio.Event, timeout: float = LISTEN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not child_listening(child, ip):
        if stop.is_set():
            raise Interrupted
        if not child.alive():
            code = child.proc.returncode if child.proc else None
            where = f" (see {child.log_path})" if child.log_path else ""
            raise BackendError(f"{child.what} exited with code {code} before listening on {child.where}{where}")
        if time.monotonic() > deadline:
            raise BackendError(f"{child.what} is not listening on {child.where} after {timeout:g} s")
        await asyncio.sleep(0.005)     # a look is one connect(): cheap, and every start (and restart) waits on it


def socket_access(group: GroupConfig) -> transport.SocketAccess:
    """The group socket's owner, group and mode from the config (SocketOwner, SocketGroup, SocketMode)."""
    mode = transport.DEFAULT_GROUP_SOCKET_MODE if group.socket_mode is None else group.socket_mode
    return transport.SocketAccess(group.socket_owner, group.socket_group, mode)


# --- the backend --------------------------------------------------------------------------------

class Backend:
    """Runs on an asyncio loop: `await start()`, `await run()` until stop is set, then `shutdown()`."""

    def __init__(self, opts: argparse.Namespace, out: IO = sys.stdout):
        self.opts = opts
        self.out = out
        self.ip: str = opts.ip or "127.0.0.1"
        self.port: int = opts.port or 0
        self.ipc_dir: Path | None = Path(os.path.abspath(opts.ipc_dir)) if opts.ipc_dir else None
        self.device_uuid: str | None = opts.device_uuid or None
        self.config_path = Path(os.path.abspath(opts.config))   # not resolved: a symlinked config stays one
        self.log_dir = Path(opts.log_dir).resolve() if opts.log_dir else None
        self.schd_cmd = daemon_command(opts.schd_path, "gem-schd", "gemini.scheduler.cli")
        self.pmgr_cmd = daemon_command(opts.pmgr_path, "gem-pmgr", "gemini.podmgr.cli")
        self.env = _child_env()
        self.scheduler: Child | None = None
        self.groups: dict[str, Child] = {}      # in config order
        self.ledger_dir: Path | None = None     # TCP: the pod managers' ledgers (_ledger_path)
        self.stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._new_config: Config | None = None  # handed over by the reloader, applied by run()
        self._reloader: ConfigReloader | None = None

    # -- building the children --

    def _verbosity(self) -> list[str]:
        return ["-v"] * self.opts.verbose

    def _log_path(self, label: str) -> Path | None:
        if self.log_dir is None:
            return None
        if label == "gem-schd":
            return self.log_dir / "gem-schd.log"
        # A group name may hold '/', '..' and the like: such a name gets a safe part and a short hash, so that
        # no name points outside the log directory and two names never share a file.
        if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", label):
            return self.log_dir / f"gem-pmgr-{label}.log"
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", label).lstrip(".")[:40] or "group"
        digest = hashlib.sha1(label.encode()).hexdigest()[:8]
        return self.log_dir / f"gem-pmgr-{safe}-{digest}.log"

    def _scheduler_child(self) -> Child:
        if self.ipc_dir is not None:
            where = ["--ipc-dir", str(self.ipc_dir)] + (["--device-uuid", self.device_uuid] if self.device_uuid else [])
        else:
            where = ["--ip", self.ip, "-P", str(self.port)]
        argv = self.schd_cmd + where + ["-f", str(self.config_path), "-p", str(self.config_path.parent)]
        for flag, value in (("-q", self.opts.base_quota), ("-m", self.opts.min_quota), ("-w", self.opts.window)):
            if value is not None:
                argv += [flag, f"{value:g}"]
        if getattr(self.opts, "device_memory", None):
            argv += ["--device-memory", self.opts.device_memory]
        child = Child("gem-schd", argv + self._verbosity() + list(self.opts.schd_arg or []), self.port,
                      self._log_path("gem-schd"))
        if self.ipc_dir is not None:
            child.socket = transport.scheduler_socket(self.ipc_dir, self.device_uuid)
        return child

    def _pmgr_argv(self, group: str, port: int, access: transport.SocketAccess | None) -> list[str]:
        argv = self.pmgr_cmd + ["--name", group]
        if self.device_uuid:
            argv += ["--device-uuid", self.device_uuid]
        if self.ipc_dir is None:
            argv += ["--ip", self.ip, "--port", str(port), "--scheduler-ip", connect_host(self.ip),
                     "--scheduler-port", str(self.port), "--ledger", str(self._ledger_path(group))]
        else:
            assert access is not None
            argv += ["--ipc-dir", str(self.ipc_dir), "--socket-mode", f"{access.mode:04o}"]
            if access.owner is not None:
                argv += ["--socket-owner", access.owner]
            if access.group is not None:
                argv += ["--socket-group", access.group]
        return argv + self._verbosity() + list(getattr(self.opts, "pmgr_arg", None) or [])

    def _ledger_path(self, group: str) -> Path:
        """TCP: where a group's pod manager keeps its ledger (gemini/podmgr/ledger.py), so that the one this backend
        restarts after a crash knows who held memory. A private directory for this backend's life; on the socket
        transport the ledger lives beside the group's socket instead."""
        if self.ledger_dir is None:
            self.ledger_dir = Path(tempfile.mkdtemp(prefix="gemini-ledgers-"))
        return self.ledger_dir / ("group-" + hashlib.sha1(group.encode()).hexdigest()[:16] + ".ledger")

    def _pmgr_child(self, group: str, port: int, config: GroupConfig | None = None) -> Child:
        access = socket_access(config) if config is not None and self.ipc_dir is not None else None
        if self.ipc_dir is not None and access is None:
            access = transport.SocketAccess()
        child = Child(group, self._pmgr_argv(group, port, access), port, self._log_path(group), access=access)
        if self.ipc_dir is not None:
            child.socket = transport.group_socket(self.ipc_dir, group, self.device_uuid)
        return child

    def _next_free_port(self) -> int:
        used = {c.port for c in self.groups.values()} | {self.port}
        port = self.port + 1
        while port in used or not port_free(self.ip, port):
            port += 1
            if port > 65535:
                raise BackendError("no free port left for a pod manager")
        return port

    # -- start / stop --

    def _check_tcp(self, config: Config) -> list[tuple[str, int]]:
        wanted = [("gem-schd", self.port)] + [(g, self.port + i) for i, g in enumerate(config.names, 1)]
        if wanted[-1][1] > 65535:
            raise BackendError(f"{len(config.names)} groups do not fit above port {self.port}")
        busy = [(label, port) for label, port in wanted if not port_free(self.ip, port)]
        if busy:
            what = ", ".join(f"{port} (for {'gem-schd' if label == 'gem-schd' else 'group ' + repr(label)})"
                             for label, port in busy)
            raise BackendError(f"port(s) already in use on {self.ip}: {what}; stop whatever holds them or "
                               "choose another --port")
        return wanted

    def _check_ipc(self, config: Config) -> list[tuple[str, int]]:
        """The socket directory is safe (created if missing), no other backend serves this GPU there, and every
        group's SocketOwner/SocketGroup/SocketMode can be applied by this user."""
        assert self.ipc_dir is not None
        try:
            directory = transport.ensure_socket_dir(self.ipc_dir, self.device_uuid)
            for g in config.groups:
                socket_access(g).check()
        except transport.TransportError as exc:
            raise BackendError(str(exc)) from None
        schd = transport.scheduler_socket(self.ipc_dir, self.device_uuid)
        if transport.socket_in_use(schd):
            raise BackendError(f"a gem-schd already listens on {schd}: is another launch-backend serving "
                               f"{directory}? (stop it, or give this one another --ipc-dir or --device-uuid)")
        return [("gem-schd", 0)] + [(g, 0) for g in config.names]

    async def start(self) -> None:
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            raise BackendError(f"bad config: {exc}") from None
        for warning in config.warnings:
            log.warning("%s", warning)
        wanted = self._check_ipc(config) if self.ipc_dir is not None else self._check_tcp(config)
        if self.log_dir is not None:
            self.log_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            os.chmod(self.log_dir, 0o750)   # mkdir's mode is filtered by the umask
        self.scheduler = self._scheduler_child()
        self.scheduler.spawn(self.env)
        # The pod managers start beside gem-schd, not after it: each start is mostly Python's imports (a quarter of
        # a second), and a pod manager whose first HELLO finds nobody sends it again at its next tick once its link
        # connects (gemini/podmgr/manager.py, upstream_failed).
        for label, port in wanted[1:]:
            self.groups[label] = self._pmgr_child(label, port, config.group(label))
            self.groups[label].spawn(self.env)
        await wait_listening(self.scheduler, self.ip, self.stop)
        for child in self.groups.values():
            await wait_listening(child, self.ip, self.stop)
        self._reloader = ConfigReloader(self.config_path, self._config_saved, debounce_s=DEBOUNCE_S, current=config)
        self._reloader.start()
        self._write_ports_file()
        self._print_table()

    def children(self) -> list[Child]:
        return ([self.scheduler] if self.scheduler else []) + list(self.groups.values())

    def shutdown(self) -> None:
        if self._reloader is not None:
            self._reloader.stop()
        stop_children(self.children(), self.opts.kill_grace)
        for child in self.children():
            if child.socket is not None:
                self._remove_socket(child)      # one that had to be killed left its socket
        if self.ledger_dir is not None:
            shutil.rmtree(self.ledger_dir, ignore_errors=True)

    # -- output --

    def _emit(self, line: str) -> None:
        try:
            print(line, file=self.out, flush=True)
        except (BrokenPipeError, ValueError):
            pass

    def _print_table(self) -> None:
        width = max([5] + [len(g) for g in self.groups])
        if self.ipc_dir is not None:
            assert self.scheduler is not None
            self._emit(f"gem-schd listening on {self.scheduler.socket} (config {self.config_path})")
            self._emit(f"{'GROUP':<{width}}  SOCKET")
        else:
            self._emit(f"gem-schd listening on {self.ip}:{self.port} (config {self.config_path})")
            self._emit(f"{'GROUP':<{width}}  PORT")
        for group, child in self.groups.items():
            self._emit(f"{group:<{width}}  {child.socket or child.port}")
        self._emit("ready")

    def ports(self) -> dict[str, int | str]:
        """Where each group's pod manager listens: its port, or its socket's path."""
        return {g: str(c.socket) if c.socket is not None else c.port for g, c in self.groups.items()}

    def _write_ports_file(self) -> None:
        if not self.opts.ports_file:
            return
        path = Path(self.opts.ports_file)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.ports(), indent=1) + "\n")
        os.replace(tmp, path)

    # -- the loop --

    def _config_saved(self, config: Config) -> None:
        """The reloader's callback (on the loop): a new, valid config. Applied by run(), one at a time."""
        self._new_config = config
        self._wake.set()

    async def run(self) -> None:
        while not self.stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self.stop.is_set():
                break
            if self._new_config is not None:
                config, self._new_config = self._new_config, None
                try:
                    await self.apply(config)
                except Interrupted:
                    break
            self._supervise(time.monotonic())

    def _supervise(self, now: float) -> None:
        for child in self.children():
            if child.alive():
                if now - child.started_at >= STABLE_S:
                    child.backoff = BACKOFF_START_S
                continue
            if child.restart_at is None:
                code = child.proc.returncode if child.proc else None
                child.restart_at = now + child.backoff
                log.error("%s (%s) exited unexpectedly with code %s; restarting in %.1f s",
                          child.what, child.where, code, child.backoff)
                child.backoff = min(child.backoff * 2, BACKOFF_MAX_S)
            elif now >= child.restart_at:
                child.restarts += 1
                try:
                    child.spawn(self.env)
                    log.warning("restarted %s on %s (restart %d)", child.what, child.where, child.restarts)
                except OSError as exc:
                    child.restart_at = now + child.backoff
                    log.error("cannot restart %s: %s", child.what, exc)

    async def apply(self, config: Config) -> None:
        """Start pod managers for new groups, stop those of removed groups, give sockets their new owner and mode
        (gem-schd reloads by itself)."""
        removed = [g for g in self.groups if g not in config.names]
        added = [g for g in config.names if g not in self.groups]
        events = []
        # SIGUSR1: gem-pmgr tells its processes that their group was removed before it stops
        stop_children([self.groups[g] for g in removed], self.opts.kill_grace, signal.SIGUSR1)
        for g in removed:
            child = self.groups.pop(g)
            if child.socket is not None:
                self._remove_socket(child)
            events.append(f"removed {g} {child.socket or child.port}")
        if self.ipc_dir is not None:
            for gc in config.groups:
                if gc.name in self.groups:
                    self._update_access(self.groups[gc.name], socket_access(gc))
        started = []
        for g in added:
            try:
                port = self._next_free_port() if self.ipc_dir is None else 0
                if self.ipc_dir is not None:
                    socket_access(config.group(g)).check()      # type: ignore[arg-type]
            except (BackendError, transport.TransportError) as exc:
                log.error("cannot start a pod manager for new group '%s': %s", g, exc)
                continue
            self.groups[g] = self._pmgr_child(g, port, config.group(g))
            self.groups[g].spawn(self.env)
            started.append(g)
        for g in started:
            try:
                await wait_listening(self.groups[g], self.ip, self.stop)
            except BackendError as exc:
                log.error("%s", exc)    # supervision restarts it
            events.append(f"added {g} {self.groups[g].socket or self.groups[g].port}")
        self.groups = {g: self.groups[g] for g in config.names if g in self.groups}   # the config's order
        if events:
            self._write_ports_file()    # before the lines, so that a reader of both never sees them disagree
            for line in events:
                self._emit(line)


    def _update_access(self, child: Child, access: transport.SocketAccess) -> None:
        """A group's SocketOwner/SocketGroup/SocketMode changed: its live socket gets them now, and a restart of
        its pod manager keeps them (its argv says them)."""
        if access == child.access:
            return
        try:
            access.check()
            if child.socket is not None and os.path.lexists(child.socket):
                transport.apply_access(child.socket, access)
        except (transport.TransportError, OSError) as exc:
            log.error("group '%s': cannot give its socket %s: %s (it keeps %s)", child.label, access.describe(),
                      exc, child.access.describe() if child.access else "what it had")
            return
        child.access = access
        child.argv = self._pmgr_argv(child.label, child.port, access)
        log.info("group '%s': socket %s now has %s", child.label, child.socket, access.describe())

    @staticmethod
    def _remove_socket(child: Child) -> None:
        """A stopped pod manager's socket, if it left one (killed): nobody listens there any more."""
        try:
            transport.remove_stale(child.socket, child.what)    # type: ignore[arg-type]
        except transport.TransportError as exc:
            log.warning("%s", exc)


# --- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Start gem-schd and one gem-pmgr per group of the config.")
    p.add_argument("--ipc-dir", default=None, metavar="DIR",
                   help=f"Unix sockets in DIR/<gpu>/ (the default transport, DIR {transport.DEFAULT_IPC_DIR})")
    p.add_argument("--device-uuid", default=None, metavar="GPU-...",
                   help="the GPU this backend serves: names its socket subdirectory (default 'default'), and the "
                        "pod managers refuse hooks on other GPUs")
    p.add_argument("--ip", default=None,
                   help="TCP transport: address of every daemon (default 127.0.0.1 when --port is given)")
    p.add_argument("--port", type=int, default=None,
                   help="TCP transport: gem-schd's port; pod managers use the next ones (e.g. 50051)")
    p.add_argument("--config", default="resource-config.txt", help="the groups (default %(default)s)")
    p.add_argument("--base_quota", "--base-quota", type=float, default=None, metavar="MS",
                   help="gem-schd's base quota in ms (default: gem-schd's)")
    p.add_argument("--min_quota", "--min-quota", type=float, default=None, metavar="MS",
                   help="gem-schd's minimum quota in ms (default: gem-schd's)")
    p.add_argument("--window", type=float, default=None, metavar="MS",
                   help="gem-schd's sliding window in ms (default: gem-schd's)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="GPU memory the groups may hold resident, e.g. 24GiB: unified groups are swapped to the host "
                        "to stay within it (gem-schd's --device-memory). Default: the GPU's memory less a reserve "
                        "of max(1 GiB, 5%%), read through NVML when a unified group is configured (the "
                        "--device-uuid GPU, else CUDA_VISIBLE_DEVICES's first, else GPU 0); where NVML cannot be "
                        "read, not managed (unified groups run on page faults; gem-schd's log says so)")
    p.add_argument("--schd-path", default=None, help="gem-schd executable (default: the installed one)")
    p.add_argument("--pmgr-path", default=None, help="gem-pmgr executable (default: the installed one)")
    p.add_argument("--log-dir", default=None, help="write each daemon's log to DIR/<daemon>.log")
    p.add_argument("--ports-file", default=None, help="keep a JSON {group: port} in this file")
    p.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, metavar="S",
                   help="seconds between SIGTERM and SIGKILL at shutdown (default %(default)s)")
    p.add_argument("--schd-arg", action="append", metavar="ARG",
                   help="pass ARG on to gem-schd (repeatable), e.g. --schd-arg=--trace=grants.json")
    p.add_argument("--pmgr-arg", action="append", metavar="ARG",
                   help="pass ARG on to every gem-pmgr (repeatable), e.g. --pmgr-arg=--authorizer=mod:Judge")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more output, passed on to the daemons (-vv debug; -vvv also watchdog's line per "
                   "file event, which loops when this program's log file is in the config's directory)")
    return p


async def _main(backend: Backend) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, backend.stop.set)
    try:
        await backend.start()
        await backend.run()
        log.info("stopping")
        return 0
    except BackendError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        log.info("interrupted while starting")
        return 130
    finally:
        backend.shutdown()


DEFAULT_TCP_PORT = transport.DEFAULT_SCHEDULER_PORT


def choose_transport(opts: argparse.Namespace) -> str | None:
    """Fill in the transport's defaults; the reason the options do not make sense, or None."""
    tcp = opts.ip is not None or opts.port is not None
    if tcp and opts.ipc_dir is not None:
        return "--ipc-dir and --ip/--port: choose one transport"
    if tcp:
        opts.ip = opts.ip or transport.DEFAULT_IP
        opts.port = DEFAULT_TCP_PORT if opts.port is None else opts.port
        if not 1 <= opts.port <= 65534:
            return f"--port {opts.port} is not usable (gem-schd's port, pod managers above it)"
    else:
        opts.ipc_dir = opts.ipc_dir or transport.DEFAULT_IPC_DIR
    if opts.device_uuid:
        try:
            transport.gpu_dir_name(opts.device_uuid)
        except transport.TransportError as exc:
            return f"--device-uuid: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    problem = choose_transport(opts)
    if problem:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    # -v makes the daemons say more (it is passed on); -vv launch-backend too
    setup_logging(PROG, logging.DEBUG if opts.verbose >= 2 else logging.INFO, library_debug=opts.verbose >= 3)
    return asyncio.run(_main(Backend(opts)))


def program() -> NoReturn:
    """The `launch-backend` command: main(), then the exit without the interpreter's teardown (gemini/shutdown.py)."""
    exit_now(main())
