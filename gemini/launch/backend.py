"""launch-backend: start gem-schd and one gem-pmgr per group, keep them running, follow config edits.

    launch-backend [--ip IP] [--port PORT] [--config FILE] [--base_quota MS] [--min_quota MS] [--window MS]
                   [--schd-path PATH] [--pmgr-path PATH] [--log-dir DIR] [--ports-file FILE] [-v]

gem-schd listens on PORT, the groups' pod managers on PORT+1, PORT+2, ... in the order of the config file.
When every daemon listens, a table "group port" is printed on stdout (and written as JSON {group: port} to
--ports-file). Edits of the config are followed: a new group gets a pod manager on the next free port, a
removed group's pod manager is stopped, a bad edit changes nothing (gem-schd reloads the file by itself).
A daemon that dies is restarted on its port with backoff. SIGINT/SIGTERM stop everything: SIGTERM, then
SIGKILL after a grace period. Children never see a shell: every argument is passed as argv.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gemini.config import Config, ConfigError, load_config
from gemini.reload import ConfigReloader

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
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
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
    port: int
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff: float = BACKOFF_START_S
    restart_at: float | None = None
    restarts: int = 0
    _log_file: IO | None = field(default=None, repr=False)

    @property
    def what(self) -> str:
        return "gem-schd" if self.label == "gem-schd" else f"gem-pmgr for group '{self.label}'"

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


def stop_children(children: list[Child], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM all, wait up to `grace`, SIGKILL what is left, reap everything."""
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.02)
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


async def wait_listening(child: Child, ip: str, stop: asyncio.Event, timeout: float = LISTEN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not listening(ip, child.port):
        if stop.is_set():
            raise Interrupted
        if not child.alive():
            code = child.proc.returncode if child.proc else None
            where = f" (see {child.log_path})" if child.log_path else ""
            raise BackendError(f"{child.what} exited with code {code} before listening on port {child.port}{where}")
        if time.monotonic() > deadline:
            raise BackendError(f"{child.what} is not listening on port {child.port} after {timeout:g} s")
        await asyncio.sleep(0.02)


# --- the backend --------------------------------------------------------------------------------

class Backend:
    """Runs on an asyncio loop: `await start()`, `await run()` until stop is set, then `shutdown()`."""

    def __init__(self, opts: argparse.Namespace, out: IO = sys.stdout):
        self.opts = opts
        self.out = out
        self.ip: str = opts.ip
        self.port: int = opts.port
        self.config_path = Path(os.path.abspath(opts.config))   # not resolved: a symlinked config stays one
        self.log_dir = Path(opts.log_dir).resolve() if opts.log_dir else None
        self.schd_cmd = daemon_command(opts.schd_path, "gem-schd", "gemini.scheduler.cli")
        self.pmgr_cmd = daemon_command(opts.pmgr_path, "gem-pmgr", "gemini.podmgr.cli")
        self.env = _child_env()
        self.scheduler: Child | None = None
        self.groups: dict[str, Child] = {}      # in config order
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
        argv = self.schd_cmd + ["--ip", self.ip, "-P", str(self.port), "-f", str(self.config_path),
                                "-p", str(self.config_path.parent)]
        for flag, value in (("-q", self.opts.base_quota), ("-m", self.opts.min_quota), ("-w", self.opts.window)):
            if value is not None:
                argv += [flag, f"{value:g}"]
        return Child("gem-schd", argv + self._verbosity() + list(self.opts.schd_arg or []), self.port,
                     self._log_path("gem-schd"))

    def _pmgr_child(self, group: str, port: int) -> Child:
        argv = self.pmgr_cmd + ["--name", group, "--ip", self.ip, "--port", str(port),
                                "--scheduler-ip", connect_host(self.ip), "--scheduler-port", str(self.port)]
        return Child(group, argv + self._verbosity(), port, self._log_path(group))

    def _next_free_port(self) -> int:
        used = {c.port for c in self.groups.values()} | {self.port}
        port = self.port + 1
        while port in used or not port_free(self.ip, port):
            port += 1
            if port > 65535:
                raise BackendError("no free port left for a pod manager")
        return port

    # -- start / stop --

    async def start(self) -> None:
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            raise BackendError(f"bad config: {exc}") from None
        for warning in config.warnings:
            log.warning("%s", warning)
        wanted = [("gem-schd", self.port)] + [(g, self.port + i) for i, g in enumerate(config.names, 1)]
        if wanted[-1][1] > 65535:
            raise BackendError(f"{len(config.names)} groups do not fit above port {self.port}")
        busy = [(label, port) for label, port in wanted if not port_free(self.ip, port)]
        if busy:
            what = ", ".join(f"{port} (for {'gem-schd' if label == 'gem-schd' else 'group ' + repr(label)})"
                             for label, port in busy)
            raise BackendError(f"port(s) already in use on {self.ip}: {what}; stop whatever holds them or "
                               "choose another --port")
        if self.log_dir is not None:
            self.log_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            os.chmod(self.log_dir, 0o750)   # mkdir's mode is filtered by the umask
        self.scheduler = self._scheduler_child()
        self.scheduler.spawn(self.env)
        await wait_listening(self.scheduler, self.ip, self.stop)
        for label, port in wanted[1:]:
            self.groups[label] = self._pmgr_child(label, port)
            self.groups[label].spawn(self.env)
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

    # -- output --

    def _emit(self, line: str) -> None:
        try:
            print(line, file=self.out, flush=True)
        except (BrokenPipeError, ValueError):
            pass

    def _print_table(self) -> None:
        width = max([5] + [len(g) for g in self.groups])
        self._emit(f"gem-schd listening on {self.ip}:{self.port} (config {self.config_path})")
        self._emit(f"{'GROUP':<{width}}  PORT")
        for group, child in self.groups.items():
            self._emit(f"{group:<{width}}  {child.port}")
        self._emit("ready")

    def ports(self) -> dict[str, int]:
        return {g: c.port for g, c in self.groups.items()}

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
                log.error("%s (port %d) exited unexpectedly with code %s; restarting in %.1f s",
                          child.what, child.port, code, child.backoff)
                child.backoff = min(child.backoff * 2, BACKOFF_MAX_S)
            elif now >= child.restart_at:
                child.restarts += 1
                try:
                    child.spawn(self.env)
                    log.warning("restarted %s on port %d (restart %d)", child.what, child.port, child.restarts)
                except OSError as exc:
                    child.restart_at = now + child.backoff
                    log.error("cannot restart %s: %s", child.what, exc)

    async def apply(self, config: Config) -> None:
        """Start pod managers for new groups, stop those of removed groups (gem-schd reloads by itself)."""
        removed = [g for g in self.groups if g not in config.names]
        added = [g for g in config.names if g not in self.groups]
        events = []
        stop_children([self.groups[g] for g in removed], self.opts.kill_grace)
        for g in removed:
            events.append(f"removed {g} {self.groups.pop(g).port}")
        started = []
        for g in added:
            try:
                port = self._next_free_port()
            except BackendError as exc:
                log.error("cannot start a pod manager for new group '%s': %s", g, exc)
                continue
            self.groups[g] = self._pmgr_child(g, port)
            self.groups[g].spawn(self.env)
            started.append(g)
        for g in started:
            try:
                await wait_listening(self.groups[g], self.ip, self.stop)
            except BackendError as exc:
                log.error("%s", exc)    # supervision restarts it
            events.append(f"added {g} {self.groups[g].port}")
        self.groups = {g: self.groups[g] for g in config.names if g in self.groups}   # the config's order
        if events:
            self._write_ports_file()    # before the lines, so that a reader of both never sees them disagree
            for line in events:
                self._emit(line)


# --- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Start gem-schd and one gem-pmgr per group of the config.")
    p.add_argument("--ip", default="127.0.0.1", help="address of every daemon (default %(default)s)")
    p.add_argument("--port", type=int, default=50051,
                   help="gem-schd's port; pod managers use the next ones (default %(default)s)")
    p.add_argument("--config", default="resource-config.txt", help="the groups (default %(default)s)")
    p.add_argument("--base_quota", "--base-quota", type=float, default=None, metavar="MS",
                   help="gem-schd's base quota in ms (default: gem-schd's)")
    p.add_argument("--min_quota", "--min-quota", type=float, default=None, metavar="MS",
                   help="gem-schd's minimum quota in ms (default: gem-schd's)")
    p.add_argument("--window", type=float, default=None, metavar="MS",
                   help="gem-schd's sliding window in ms (default: gem-schd's)")
    p.add_argument("--schd-path", default=None, help="gem-schd executable (default: the installed one)")
    p.add_argument("--pmgr-path", default=None, help="gem-pmgr executable (default: the installed one)")
    p.add_argument("--log-dir", default=None, help="write each daemon's log to DIR/<daemon>.log")
    p.add_argument("--ports-file", default=None, help="keep a JSON {group: port} in this file")
    p.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, metavar="S",
                   help="seconds between SIGTERM and SIGKILL at shutdown (default %(default)s)")
    p.add_argument("--schd-arg", action="append", metavar="ARG",
                   help="pass ARG on to gem-schd (repeatable), e.g. --schd-arg=--trace=grants.json")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more output (passed on to the daemons)")
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


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not 1 <= opts.port <= 65534:
        print(f"{PROG}: --port {opts.port} is not usable (gem-schd's port, pod managers above it)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if opts.verbose >= 2 else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {PROG} %(levelname)s: %(message)s")
    return asyncio.run(_main(Backend(opts)))
