"""gem-pmgr: the pod manager of one group (console script)."""
from __future__ import annotations

import asyncio
import errno
import importlib
import ipaddress
import logging
import os
import resource
import signal
import sys

import click

from gemini import transport
from gemini.logs import LEVEL_NAMES, level_from_flags, setup_logging
from gemini.shutdown import exit_now
from gemini.wire import hook as hp

from . import (DEFAULT_IP, DEFAULT_PORT, DEFAULT_SCHEDULER_PORT, ENV_POD_MANAGER_IP, ENV_POD_MANAGER_PORT,
               ENV_POD_NAME, ENV_SCHEDULER_IP, ENV_SCHEDULER_PORT)
from .admission import Limits
from .auth import PeerAuthorizer
from .manager import REJOIN_GRACE_S
from .server import PodManagerServer

log = logging.getLogger("gemini.podmgr")

class PortParam(click.ParamType):
    """A TCP port; a bad value from an environment variable is reported with the variable's name."""
    name = "port"

    def __init__(self, lowest: int):
        self.lowest = lowest

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return transport.parse_port(str(value), self.lowest)
        except ValueError as exc:
            if ctx is not None and param is not None and param.name is not None and \
                    ctx.get_parameter_source(param.name) is click.core.ParameterSource.ENVIRONMENT:
                var = next((v for v in (param.envvar or ()) if os.environ.get(v)), "the environment")
                self.fail(f"{var}={value!r} is not usable: {exc}", param, ctx)
            self.fail(str(exc), param, ctx)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def raise_fd_limit(wanted: int) -> None:
    """Let the process hold `wanted` descriptors if the hard limit allows: the connection caps, not the soft
    limit of 1024, must be what stops a flood."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", target, exc)


def _mode(ctx, param, value):
    if value is None:
        return None
    try:
        mode = int(value, 8)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an octal mode such as 0660") from None
    if not 0 <= mode <= 0o777:
        raise click.BadParameter(f"{value!r} is not a file mode")
    if mode & 0o002:
        raise click.BadParameter(f"{value} lets any local user connect (act for the group)")
    return mode


def load_authorizer(spec: str) -> PeerAuthorizer:
    """MODULE:NAME imported and called without arguments; a UsageError that says what went wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.UsageError(f"--authorizer {spec!r}: expected MODULE:NAME")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
        judge = factory()
    except Exception as exc:   # an import error, a missing name, a constructor that fails: all the user's to fix
        raise click.UsageError(f"--authorizer {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(getattr(judge, "authorize", None)):
        raise click.UsageError(f"--authorizer {spec!r}: {type(judge).__name__} has no authorize(creds, hello_group)")
    return judge


async def serve(server: PodManagerServer) -> None:
    """Run until SIGINT/SIGTERM, or SIGUSR1: launch-backend's "your group was removed from the config", which the
    hooks are told before the connections close."""
    # Handlers first: a signal that arrives as soon as the port is listening must stop us cleanly.
    stop = asyncio.Event()
    farewell: list[str] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def removed() -> None:
        farewell.append(f"group '{server.manager.group}' was removed from the config: its pod manager has stopped")
        stop.set()
    loop.add_signal_handler(signal.SIGUSR1, removed)
    await server.start()
    try:
        await stop.wait()
        log.info("stopping%s", f" ({farewell[0]})" if farewell else "")
    finally:
        await server.stop(farewell[0] if farewell else None)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--name", envvar=list(ENV_POD_NAME), required=True,
              help="The group this pod manager serves (a section of resource-config.txt). [env: POD_NAME]")
@click.option("--ip", envvar=list(ENV_POD_MANAGER_IP), default=DEFAULT_IP, show_default=True,
              help="Address the hooks connect to. [env: POD_MANAGER_IP]")
@click.option("--port", envvar=list(ENV_POD_MANAGER_PORT), default=DEFAULT_PORT, show_default=True,
              type=PortParam(0), help="Port the hooks connect to (0: any free port). [env: POD_MANAGER_PORT]")
@click.option("--scheduler-ip", envvar=list(ENV_SCHEDULER_IP), default="127.0.0.1", show_default=True,
              help="Address of gem-schd. [env: SCHEDULER_IP]")
@click.option("--scheduler-port", envvar=list(ENV_SCHEDULER_PORT), default=DEFAULT_SCHEDULER_PORT,
              show_default=True, type=PortParam(1), help="Port of gem-schd. [env: SCHEDULER_PORT]")
@click.option("--device-uuid", default=None,
              help="Serve only hooks on this GPU (\"GPU-...\"); hooks reporting another device are refused. "
                   "With --ipc-dir it also names the GPU's subdirectory (default: 'default').")
@click.option("--ipc-dir", default=None, metavar="DIR",
              help="Socket transport: hooks connect to DIR/<gpu>/group.<name>.sock, gem-schd is reached at "
                   "DIR/<gpu>/gem-schd.sock, no TCP port is opened (--ip/--port are not used).")
@click.option("--socket-owner", default=None, help="Owner of the group's socket (user name or uid; needs root).")
@click.option("--socket-group", default=None, help="Group of the group's socket (group name or gid).")
@click.option("--socket-mode", default=None, callback=_mode, metavar="MODE",
              help="Mode of the group's socket (octal, default 0660; never writable by others).")
@click.option("--authorizer", default=None, metavar="MODULE:NAME",
              help="A PeerAuthorizer (gemini/podmgr/auth.py) to judge each process of the socket transport: "
                   "MODULE:NAME is imported and called without arguments.")
@click.option("--hello-timeout", type=click.FloatRange(0.05, 3600), default=Limits.hello_timeout_s,
              show_default=True, help="Seconds a new connection has to say HELLO before it is closed.")
@click.option("--ledger", default=None, metavar="FILE",
              help="Where to keep the record of which processes hold the group's memory, so that a restarted pod "
                   "manager counts it again before granting anything new (default with --ipc-dir: beside the "
                   "group's socket; on TCP none unless given; launch-backend gives one).")
@click.option("--rejoin-grace", type=click.FloatRange(0, 9), default=REJOIN_GRACE_S, show_default=True,
              help="After a restart: at most how many seconds the group's allocations wait for the processes on "
                   "record to re-announce what they hold (below the hooks' 10 s wait for a memory reply).")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--log-level", type=click.Choice(LEVEL_NAMES, case_sensitive=False), default=None,
              help="Log level (overrides -v).")
def main(name: str, ip: str, port: int, scheduler_ip: str, scheduler_port: int, device_uuid: str | None,
         ipc_dir: str | None, socket_owner: str | None, socket_group: str | None, socket_mode: int | None,
         authorizer: str | None, hello_timeout: float, ledger: str | None, rejoin_grace: float, verbose: int,
         log_level: str | None) -> None:
    """Pod manager of one group: shares the group's GPU token between its processes and accounts its memory."""
    if not name or len(name.encode()) >= hp.NAME_LEN:
        raise click.BadParameter(f"must be 1 to {hp.NAME_LEN - 1} bytes", param_hint="--name")
    ctx = click.get_current_context()
    if ipc_dir is not None:
        given = [f"--{p.replace('_', '-')}" for p in ("ip", "port", "scheduler_ip", "scheduler_port")
                 if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--ipc-dir and {', '.join(given)}: choose one transport")
    elif any(v is not None for v in (socket_owner, socket_group, socket_mode)):
        raise click.UsageError("--socket-owner/--socket-group/--socket-mode need --ipc-dir")
    setup_logging(f"gem-pmgr[{name}]", level_from_flags(verbose, log_level, logging.WARNING))
    access = transport.SocketAccess(socket_owner, socket_group,
                                    transport.DEFAULT_GROUP_SOCKET_MODE if socket_mode is None else socket_mode)
    if ipc_dir is None:
        log.warning("TCP transport: any local process can connect to %s:%d and join group %r, or take its port "
                    "while this pod manager is down; --ipc-dir (Unix sockets) prevents both", ip, port, name)
        if not is_loopback(ip):
            log.warning("listening on %s, which is not a loopback address: anyone who can reach it can take the "
                        "group's GPU time and memory", ip)
    judge = None
    if authorizer is not None:
        if ipc_dir is None:
            raise click.UsageError("--authorizer needs --ipc-dir (TCP peers have no credentials to judge)")
        judge = load_authorizer(authorizer)
    limits = Limits(hello_timeout_s=hello_timeout)
    raise_fd_limit(limits.total + 256)
    server = PodManagerServer(name, ip, port, scheduler_ip=scheduler_ip, scheduler_port=scheduler_port,
                              device_uuid=device_uuid, ipc_dir=ipc_dir, socket_access=access, limits=limits,
                              authorizer=judge, ledger_path=ledger, rejoin_grace_s=rejoin_grace)
    try:
        asyncio.run(serve(server))
    except transport.TransportError as exc:
        click.echo(f"gem-pmgr: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        why = "address already in use (another gem-pmgr?)" if exc.errno == errno.EADDRINUSE else \
            (exc.strerror or str(exc))
        click.echo(f"gem-pmgr: cannot listen on {ip}:{port}: {why}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        pass
    exit_now(0)     # stopped cleanly: no interpreter teardown (gemini/shutdown.py)


if __name__ == "__main__":
    main()
