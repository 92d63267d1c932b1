"""gem-pmgr: the pod manager of one group (console script)."""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import signal
import sys

import click

from gemini.wire import hook as hp

from . import (DEFAULT_IP, DEFAULT_PORT, DEFAULT_SCHEDULER_PORT, ENV_POD_MANAGER_IP, ENV_POD_MANAGER_PORT,
               ENV_POD_NAME, ENV_SCHEDULER_IP, ENV_SCHEDULER_PORT)
from .server import PodManagerServer

log = logging.getLogger("gemini.podmgr")

LOG_LEVELS = ("debug", "info", "warning", "error")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def setup_logging(verbose: int, log_level: str | None, tag: str) -> None:
    if log_level:
        level = getattr(logging, log_level.upper())
    else:
        level = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {tag} %(levelname)s: %(message)s")


async def serve(server: PodManagerServer) -> None:
    """Run until SIGINT/SIGTERM."""
    # Handlers first: a signal that arrives as soon as the port is listening must stop us cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await server.stop()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--name", envvar=list(ENV_POD_NAME), required=True,
              help="The group this pod manager serves (a section of resource-config.txt). [env: POD_NAME]")
@click.option("--ip", envvar=list(ENV_POD_MANAGER_IP), default=DEFAULT_IP, show_default=True,
              help="Address the hooks connect to. [env: POD_MANAGER_IP]")
@click.option("--port", envvar=list(ENV_POD_MANAGER_PORT), default=DEFAULT_PORT, show_default=True,
              type=click.IntRange(0, 65535), help="Port the hooks connect to. [env: POD_MANAGER_PORT]")
@click.option("--scheduler-ip", envvar=list(ENV_SCHEDULER_IP), default="127.0.0.1", show_default=True,
              help="Address of gem-schd. [env: SCHEDULER_IP]")
@click.option("--scheduler-port", envvar=list(ENV_SCHEDULER_PORT), default=DEFAULT_SCHEDULER_PORT,
              show_default=True, type=click.IntRange(1, 65535), help="Port of gem-schd. [env: SCHEDULER_PORT]")
@click.option("--device-uuid", default=None,
              help="Serve only hooks on this GPU (\"GPU-...\"); hooks reporting another device are refused.")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default=None,
              help="Log level (overrides -v).")
def main(name: str, ip: str, port: int, scheduler_ip: str, scheduler_port: int, device_uuid: str | None,
         verbose: int, log_level: str | None) -> None:
    """Pod manager of one group: shares the group's GPU token between its processes and accounts its memory."""
    if not name or len(name.encode()) >= hp.NAME_LEN:
        raise click.BadParameter(f"must be 1 to {hp.NAME_LEN - 1} bytes", param_hint="--name")
    setup_logging(verbose, log_level, f"gem-pmgr[{name}]")
    if not is_loopback(ip):
        log.warning("listening on %s, which is not a loopback address: anyone who can reach it can take the "
                    "group's GPU time and memory", ip)
    try:
        asyncio.run(serve(PodManagerServer(name, ip, port, scheduler_ip=scheduler_ip,
                                           scheduler_port=scheduler_port, device_uuid=device_uuid)))
    except OSError as exc:
        why = "address already in use (another gem-pmgr?)" if exc.errno == errno.EADDRINUSE else \
            (exc.strerror or str(exc))
        click.echo(f"gem-pmgr: cannot listen on {ip}:{port}: {why}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
