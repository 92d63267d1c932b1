"""gem-ctl: look at a running gem-schd, find the hook library, plot a scheduler trace.

    gem-ctl [--ipc-dir DIR [--device-uuid GPU-...] | --ip IP --port PORT] [--timeout S] status [--json] [--watch [S]]
    gem-ctl hook-path
    gem-ctl plot TRACE [-o share.png]

gem-ctl reaches gem-schd where the pod managers do (a zmq DEALER speaking gemini.wire.sched): its Unix socket
DIR/<gpu>/gem-schd.sock (the default, DIR /tmp/gemini/ipc; the socket is the backend user's, mode 0600), or
--ip/--port on TCP. Exit codes: 0 ok, 1 failure (no answer from gem-schd, missing hook, missing matplotlib, bad
trace), 2 usage.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from dataclasses import asdict
from typing import Optional

import click
import zmq

from gemini import transport
from gemini.wire.sched import (FROM_SCHEDULER, Error, MessageError, StatusReply, StatusRequest, decode, encode)

DEFAULT_IP = transport.DEFAULT_IP
DEFAULT_PORT = transport.DEFAULT_SCHEDULER_PORT
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_WATCH_S = 2.0
UNLIMITED_BYTES = (1 << 63) - 1

# ANSI: cursor home, clear to end of line, clear to end of screen, clear screen.
HOME, CLEAR_EOL, CLEAR_BELOW, CLEAR_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"


class SchedulerUnreachable(RuntimeError):
    """gem-schd did not answer (in time, or sensibly)."""


class StatusClient:
    """Asks gem-schd for its status over a DEALER socket. A request that times out closes the socket, so a late
    reply can never be taken for the answer to the next request. `ipc_path`: gem-schd's Unix socket (else TCP)."""

    def __init__(self, ip: str, port: int, timeout_s: float, ipc_path: Optional[str] = None):
        self.ipc_path = ipc_path
        self.endpoint = transport.ipc_endpoint(ipc_path) if ipc_path else transport.tcp_endpoint(ip, port)
        self.ipv6 = transport.is_ipv6(ip) and not ipc_path
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock: Optional[zmq.Socket] = None
        self._short: Optional[transport.ShortPath] = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            if self.ipc_path:
                if self._short is None:
                    self._short = transport.ShortPath(self.ipc_path)
                sock.connect(transport.ipc_endpoint(self._short.address))
            else:
                sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _unreachable(self) -> str:
        if not self.ipc_path:
            return "(is it running? see --ip/--port)"
        if not os.path.lexists(self.ipc_path):
            return "(no socket there: is launch-backend running? see --ipc-dir/--device-uuid)"
        if not os.access(self.ipc_path, os.W_OK):
            return "(this user may not open its socket: it is the backend user's, mode 0600)"
        return "(is it running?)"

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def status(self) -> StatusReply:
        sock = self._socket()
        sock.send(encode(StatusRequest()))
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                self._reset()
                raise SchedulerUnreachable(f"no answer from gem-schd at {self.endpoint} within {self.timeout_s:g} s "
                                           f"{self._unreachable()}")
            try:
                reply = decode(sock.recv(), allowed=FROM_SCHEDULER)
            except MessageError as exc:
                self._reset()
                raise SchedulerUnreachable(f"{self.endpoint} answered with something that is not gem-schd's: "
                                           f"{exc}") from None
            if isinstance(reply, StatusReply):
                return reply
            if isinstance(reply, Error):
                self._reset()
                raise SchedulerUnreachable(f"gem-schd at {self.endpoint} refused the status request: "
                                           f"{reply.code}: {reply.message}")
            # Anything else is not for us: keep waiting for the status reply.

    def close(self) -> None:
        self._reset()
        self._ctx.term()
        if self._short is not None:
            self._short.close()


# --- formatting -----------------------------------------------------------------------------------------------------

def format_bytes(n: int) -> str:
    if n >= UNLIMITED_BYTES:
        return "unlimited"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_ms(ms: float) -> str:
    if ms >= 10_000:
        return f"{ms / 1000:.0f} s"
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.1f} ms"


COLUMNS = ("GROUP", "MIN", "MAX", "SHARE", "MEMORY USED/LIMIT", "CLIENTS", "TOKEN", "WAIT", "GRANTS", "PMGR",
           "PROCESSES")
PROCESSES_SHOWN = 4


def format_members(members: list, clients: int) -> str:
    """pid(uid) of a group's processes: `4242(1000),4250(1000)+3`; uid `?` on TCP, where the pid is only what the
    process claimed."""
    if not members:
        return "-" if not clients else f"+{clients}"
    shown = [f"{pid}({uid if uid >= 0 else '?'})" for pid, uid in members[:PROCESSES_SHOWN]]
    more = max(clients, len(members)) - len(shown)
    return ",".join(shown) + (f"+{more}" if more > 0 else "")


def status_rows(reply: StatusReply) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for g in reply.groups:
        rows.append((
            g["name"],
            f"{g['min_util']:.2f}",
            f"{g['max_util']:.2f}",
            f"{100.0 * g['share']:.1f}%",
            f"{format_bytes(g['mem_used'])} / {format_bytes(g['mem_limit'])}",
            str(g["clients"]),
            "yes" if g["holding"] else "no",
            format_ms(g["wait_ms"]) if g["waiting"] else "-",
            str(g["grants"]),
            "up" if g["connected"] else "down",
            format_members(g.get("members") or [], g["clients"]),
        ))
    return rows


def format_table(reply: StatusReply, endpoint: str, pods: Optional[dict] = None) -> str:
    """The status table: a header line, then one row per group (with `pods`, {group: name}, a POD column)."""
    rows = status_rows(reply)
    columns: tuple[str, ...] = COLUMNS
    right = {1, 2, 3, 5, 7, 8}     # numbers are right-aligned
    if pods is not None:
        rows = [(r[0], str(pods.get(r[0], "-")), *r[1:]) for r in rows]
        columns, right = (COLUMNS[0], "POD", *COLUMNS[1:]), {i + 1 for i in right}
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(columns)]

    def line(cells: tuple[str, ...]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    head = (f"gem-schd {reply.scheduler_id} at {endpoint}  window {format_ms(reply.window_ms)}  "
            f"token: {reply.holder or '(free)'}")
    lines = [head, "", line(columns)]
    lines.extend(line(r) for r in rows)
    if not rows:
        lines.append("(no groups configured)")
    lines += unified_lines(reply)
    if reply.config_rejected:
        lines += ["", f"The last edit of the config was REJECTED; the groups above are the last good config. "
                      f"{reply.config_rejected}"]
    return "\n".join(lines)


UNIFIED_COLUMNS = ("GROUP", "MODE", "MANAGED", "RESIDENT", "SWAPPED IN", "SWAPPED OUT", "SWAP TIME", "EVICTIONS")


def unified_lines(reply: StatusReply) -> list[str]:
    """Under the table, when a group is unified (MemoryMode = unified): gem-schd's capacity and measured swap
    speed, and per unified group its managed and resident bytes and swap totals."""
    unified = [g for g in reply.groups if g.get("memory_mode") == "unified"]
    if not unified:
        return []
    if not reply.device_memory:
        capacity = "not managed (no --device-memory, and the GPU's memory could not be read: see gem-schd's log)"
    elif reply.device_memory_source == "probe":
        capacity = (f"{format_bytes(reply.device_memory)} (the GPU's {format_bytes(reply.device_memory_total)} less "
                    f"a reserve of {format_bytes(reply.device_memory_total - reply.device_memory)})")
    elif reply.device_memory_source == "flag":
        capacity = f"{format_bytes(reply.device_memory)} (--device-memory)"
    else:
        capacity = format_bytes(reply.device_memory)
    speed = f"{reply.swap_gbps:.1f} GB/s" if reply.swap_gbps else "not measured yet"
    rows = [(g["name"], "unified", format_bytes(g.get("managed_bytes", 0)), format_bytes(g.get("resident_bytes", 0)),
             format_bytes(g.get("swapped_in_bytes", 0)), format_bytes(g.get("swapped_out_bytes", 0)),
             format_ms(g.get("swap_ms", 0.0)), str(g.get("evictions", 0))) for g in unified]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(UNIFIED_COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return ["", f"unified memory: capacity {capacity}, swaps at {speed}", line(UNIFIED_COLUMNS),
            *(line(r) for r in rows)]


def reply_json(reply: StatusReply, indent: Optional[int] = 2) -> str:
    body = {"type": reply.TYPE, **asdict(reply)}
    return json.dumps(body, indent=indent, separators=None if indent else (",", ":"))


# --- commands -------------------------------------------------------------------------------------------------------

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--ipc-dir", default=None, metavar="DIR",
              help=f"gem-schd on the socket transport: DIR/<gpu>/gem-schd.sock (the default, DIR "
                   f"{transport.DEFAULT_IPC_DIR}).")
@click.option("--device-uuid", default=None, help="With the socket transport: the GPU's subdirectory (default "
                                                  "'default').")
@click.option("--ip", default=None, help=f"gem-schd on TCP: its address (default {DEFAULT_IP}).")
@click.option("-P", "--port", type=click.IntRange(1, 65535), default=None,
              help=f"gem-schd on TCP: its port (default {DEFAULT_PORT}).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.01, 600), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds to wait for gem-schd's answer.")
@click.pass_context
def main(ctx: click.Context, ipc_dir: Optional[str], device_uuid: Optional[str], ip: Optional[str],
         port: Optional[int], timeout_s: float) -> None:
    """Operate gemini: status of gem-schd, the hook library's path, plots of scheduler traces."""
    tcp = ip is not None or port is not None
    if tcp and (ipc_dir is not None or device_uuid is not None):
        raise click.UsageError("--ipc-dir/--device-uuid and --ip/--port: choose one transport")
    ipc_path = None
    if not tcp:
        try:
            ipc_path = str(transport.scheduler_socket(ipc_dir or transport.DEFAULT_IPC_DIR, device_uuid))
        except transport.TransportError as exc:
            raise click.UsageError(f"--device-uuid: {exc}") from None
    ctx.obj = {"ip": ip or DEFAULT_IP, "port": port or DEFAULT_PORT, "timeout_s": timeout_s, "ipc_path": ipc_path}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print gem-schd's status reply as JSON.")
@click.option("--watch", type=click.FloatRange(0.05, 3600), is_flag=False, flag_value=DEFAULT_WATCH_S, default=None,
              metavar="[SECONDS]", help=f"Refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C.")
@click.option("--pods", "pods_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSON {group: name} to show beside each group (gem-node keeps one per GPU: "
                   "/var/lib/gemini/state/<GPU>/pods.json).")
@click.pass_obj
def status(obj: dict, as_json: bool, watch: Optional[float], pods_file: Optional[str]) -> None:
    """One row per group: MinUtil, MaxUtil, share of the window used, memory, clients, token, wait."""
    pods = None
    if pods_file is not None:
        try:
            pods = json.loads(Path(pods_file).read_text())
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"--pods {pods_file}: {exc}") from None
        if not isinstance(pods, dict):
            raise click.ClickException(f"--pods {pods_file}: expected a JSON object {{group: name}}")
    client = StatusClient(obj["ip"], obj["port"], obj["timeout_s"], obj["ipc_path"])
    try:
        if watch is None:
            try:
                reply = client.status()
            except SchedulerUnreachable as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(reply_json(reply) if as_json else format_table(reply, client.endpoint, pods))
            return
        _watch(client, watch, as_json, pods)
    finally:
        client.close()


def _watch(client: StatusClient, interval_s: float, as_json: bool, pods: Optional[dict] = None) -> None:
    """Redraw until Ctrl-C. With --json: one JSON line per refresh (for logging), no screen control."""
    out = sys.stdout
    first = True
    try:
        while True:
            started = time.monotonic()
            try:
                reply = client.status()
                text = reply_json(reply, indent=None) if as_json else format_table(reply, client.endpoint, pods)
            except SchedulerUnreachable as exc:
                if as_json:
                    text = json.dumps({"type": "error", "message": str(exc)})
                else:
                    text = f"{exc}\n(retrying every {interval_s:g} s; Ctrl-C to quit)"
            if as_json:
                out.write(text + "\n")
            else:
                stamp = time.strftime("%H:%M:%S")
                text = f"{text}\n\nevery {interval_s:g} s, {stamp}; Ctrl-C to quit"
                lines = text.split("\n")
                out.write((CLEAR_SCREEN if first else "") + HOME +
                          "".join(line + CLEAR_EOL + "\n" for line in lines) + CLEAR_BELOW)
            out.flush()
            first = False
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        if not as_json:
            out.write("\n")
            out.flush()
    except BrokenPipeError:     # the reader went away (e.g. `| head`): nothing left to do
        sys.stderr.close()


@main.command("hook-path")
def hook_path_cmd() -> None:
    """Print the path of the installed libgemhook.so.1 (for LD_PRELOAD)."""
    from gemini.hookpath import HookNotFound, hook_path
    try:
        click.echo(str(hook_path()))
    except HookNotFound as exc:
        raise click.ClickException(f"libgemhook.so.1 not found: {exc}") from None


@main.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", default="share.png", show_default=True, type=click.Path(dir_okay=False),
              help="Image to write (PNG, SVG, PDF: by extension).")
@click.option("--points", type=click.IntRange(10, 100_000), default=1000, show_default=True,
              help="Samples of the share curves.")
@click.option("--window", "window_s", type=click.FloatRange(0.001, None), default=None,
              help="Sliding window in seconds (default: the scheduler's, from the trace).")
def plot(trace: str, output: str, points: int, window_s: Optional[float]) -> None:
    """Plot a `gem-schd --trace` file: each group's share over time against its MinUtil/MaxUtil, and who held the
    token when."""
    from gemini.plot import PlotUnavailable, plot_trace
    from gemini.scheduler.trace import TraceFormatError
    try:
        summary = plot_trace(trace, output, points=points, window_s=window_s)
    except PlotUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    except (TraceFormatError, OSError) as exc:
        raise click.ClickException(f"cannot plot {trace}: {exc}") from None
    click.echo(f"wrote {output}: {summary}")


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="gem-ctl")
