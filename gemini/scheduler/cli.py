"""gem-schd: the GPU token scheduler daemon (console script `gem-schd`, or `python -m gemini.scheduler.cli`).

Flags follow the original Gemini scheduler (-P, -q, -m, -w, -f, -p, -v; its underscore spellings work too).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
from pathlib import Path

import click

from gemini.config import ConfigError, load_config, parse_size
from gemini.logs import LEVEL_NAMES, level_from_flags, setup_logging
from gemini.scheduler.capacity import NvmlProbe
from gemini.scheduler.daemon import (DEFAULT_DECIDE_AHEAD_MS, DEFAULT_PORT, MAX_DECIDE_AHEAD_MS, BindError,
                                     SchedulerDaemon)
from gemini.scheduler.policy import (DEFAULT_BASE_QUOTA_MS, DEFAULT_BUCKET_MS, DEFAULT_CAP_FRAME_MS,
                                     DEFAULT_MIN_QUOTA_MS, DEFAULT_WINDOW_MS, MIN_FRAME_QUOTA_MS)
from gemini.shutdown import exit_now

EXIT_USAGE = 2


def _milliseconds(zero_ok: bool):
    """A click callback: a finite number of milliseconds, positive (or 0 where `zero_ok`)."""
    def check(ctx, param, value):
        if value is not None and not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
            raise click.BadParameter(f"must be {'0 or ' if zero_ok else ''}a positive number of milliseconds, "
                                     f"got {value}")
        return value
    return check


_positive = _milliseconds(zero_ok=False)
_non_negative = _milliseconds(zero_ok=True)


def _memory_probe(device_uuid: str | None) -> NvmlProbe:
    """NVML for the GPU this gem-schd serves: its --device-uuid when that is a UUID (it may be any directory name),
    else the first GPU of CUDA_VISIBLE_DEVICES, else GPU 0."""
    if device_uuid and device_uuid.startswith(("GPU-", "MIG-")):
        return NvmlProbe(uuid=device_uuid)
    return NvmlProbe()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-P", "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port to listen on (0: any free port).")
@click.option("--ip", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback lets anyone who reaches it take GPU time.")
@click.option("-q", "--quota", "--base-quota", "quota", type=float, default=DEFAULT_BASE_QUOTA_MS,
              show_default=True, callback=_positive,
              help="Base quota (ms): the longest slot (a lone holder's slot is continued without a handoff).")
@click.option("-m", "--min-quota", "--min_quota", "min_quota", type=float, default=DEFAULT_MIN_QUOTA_MS,
              show_default=True, callback=_positive, help="Shortest slot (ms) worth granting a capped group.")
@click.option("-w", "--window", type=float, default=DEFAULT_WINDOW_MS, show_default=True, callback=_positive,
              help="Sliding window (ms) over which gem-schd reports shares (status, metrics).")
@click.option("--bucket", "bucket", type=float, default=DEFAULT_BUCKET_MS, show_default=True, callback=_positive,
              help="Depth (ms) of the MaxUtil token buckets (caps under 0.2, aligned groups, --frame 0): over any "
                   "interval T such a group gets at most MaxUtil x T + this. Aligned groups' windows are this long.")
@click.option("--frame", "frame", type=float, default=DEFAULT_CAP_FRAME_MS, show_default=True, callback=_non_negative,
              help="Caps are budgets per frame (ms) of the host's clock: MaxUtil x this at every frame boundary "
                   "(100 divides 1 s: a 1 s window holds whole frames). A cap whose quota per frame is under "
                   "--min-frame-quota keeps a token bucket. 0: token buckets for every cap.")
@click.option("--frame-turns/--no-frame-turns", "frame_turns", default=True, show_default=True,
              help="Where the caps of the framed groups held to them add up to 1, or those groups are all the "
                   "active ones, they take turns in the order they "
                   "asked, not by virtual time, each turn held to its part of what is left of the frame, so that "
                   "their slots keep their places in the frames (1 s windows 2.1 / 2.6 points on an H200 against "
                   "6.0 / 6.3 by virtual time; docs/benchmarks.md).")
@click.option("--min-frame-quota", "min_frame_quota", type=click.FloatRange(0.0, 60_000.0),
              default=MIN_FRAME_QUOTA_MS, show_default=True, metavar="MS",
              help="A cap whose quota per frame (MaxUtil x --frame) is under this keeps a token bucket (--bucket) "
                   "instead of a frame's budget: every slot pays a handoff and its queue's drain.")
@click.option("--fair-cycle", "fair_cycle", type=click.FloatRange(0.0, 60_000.0), default=0.0, show_default=True,
              metavar="MS",
              help="Uncapped groups' slots (and those of capped groups that the others' shares hold under their "
                   "caps) as their fair share (MinUtil, or an even part of the rest) of this cycle, taken in turns, "
                   "instead of -q each, so that floors and fair shares hold over windows of whole cycles (100 "
                   "divides 1 s), at the price of a handoff per group and cycle. At most -q. 0: off.")
@click.option("--decide-ahead", "decide_ahead", type=click.FloatRange(0.0, MAX_DECIDE_AHEAD_MS),
              default=DEFAULT_DECIDE_AHEAD_MS, show_default=True, metavar="MS",
              help="Make the decisions due at the end of the running slot this long before it, and send "
                   "their grants at it: the next holder's grant leaves at the deadline at the cost of a send. "
                   "What arrives meanwhile counts as arriving at the deadline. 0: decide at the deadline. Off "
                   "while unified groups are configured.")
@click.option("--board", "board", default="", metavar="PATH",
              help="The GPU's board page (claims, continuations); default a new file in /dev/shm; 'none': no "
                   "board.")
@click.option("-f", "--limit-file", "--limit_file", "limit_file", default="resource-config.txt", show_default=True,
              help="Config file name (or path).")
@click.option("-p", "--limit-file-dir", "--limit_file_dir", "limit_file_dir", default=".", show_default=True,
              help="Directory of the config file.")
@click.option("-v", "--verbose", count=True,
              help="More logging (-v: one line per grant; -vvv: also watchdog's line per file event).")
@click.option("--log-level", type=click.Choice(LEVEL_NAMES, case_sensitive=False), default=None,
              help="Log level (overrides -v).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (on --ip) at /metrics. Needs prometheus_client.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write every slot (grant to release) and config reload to this file as a Chrome trace "
                   "(open it in ui.perfetto.dev, or plot it with gem-ctl plot).")
@click.option("--ipc-dir", default=None, metavar="DIR",
              help="Socket transport: listen on DIR/<gpu>/gem-schd.sock (mode 0600) instead of a TCP port.")
@click.option("--device-uuid", default=None,
              help="With --ipc-dir: the GPU's UUID, which names its subdirectory (default: 'default').")
@click.option("--device-memory", "device_memory", default=None, metavar="SIZE",
              help="GPU memory the groups may hold resident (e.g. 24GiB): unified groups (MemoryMode = unified) "
                   "are swapped to the host to stay within it. Default: the GPU's memory (read through NVML when a "
                   "unified group is configured: the --device-uuid GPU, else CUDA_VISIBLE_DEVICES's first, else "
                   "GPU 0) less a reserve of max(1 GiB, 5%); if it cannot be read, not managed (unified groups "
                   "run on the driver's page faults).")
@click.option("--unified-min-slot", "unified_min_slot", type=click.FloatRange(1.0, 600_000.0), default=2000.0,
              show_default=True, metavar="MS",
              help="While the unified groups do not all fit in --device-memory: the shortest slot of each (longer if "
                   "its swap takes more than a tenth of it), so that a swap is paid by a long slot.")
def main(port, ip, quota, min_quota, window, bucket, frame, frame_turns, min_frame_quota, fair_cycle, decide_ahead,
         board, limit_file, limit_file_dir, verbose, log_level, metrics_port, trace_path, ipc_dir, device_uuid,
         device_memory, unified_min_slot):
    """Schedule GPU time between groups of processes (pod managers connect here)."""
    ctx = click.get_current_context()
    if ipc_dir is not None:
        given = [name for name, p in (("-P/--port", "port"), ("--ip", "ip"))
                 if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--ipc-dir and {', '.join(given)}: choose one transport")
    elif device_uuid is not None:
        raise click.UsageError("--device-uuid needs --ipc-dir")
    if fair_cycle > quota:
        raise click.BadParameter(f"{fair_cycle:g} ms is longer than -q ({quota:g} ms), the longest slot: a share of "
                                 "the cycle must fit in a slot", param_hint="--fair-cycle")
    capacity = None
    if device_memory is not None:
        try:
            capacity = parse_size(device_memory)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--device-memory") from None
        if capacity <= 0:
            raise click.BadParameter("must be greater than 0", param_hint="--device-memory")
    setup_logging("gem-schd", level_from_flags(verbose, log_level, logging.INFO), library_debug=verbose >= 3)
    if metrics_port is not None:
        from gemini.scheduler.metrics import MetricsUnavailable, require_prometheus
        try:
            require_prometheus()
        except MetricsUnavailable as exc:
            click.echo(f"gem-schd: --metrics-port: {exc}", err=True)
            sys.exit(EXIT_USAGE)
    log = logging.getLogger("gemini.scheduler")
    path = Path(limit_file_dir) / limit_file
    try:
        config = load_config(path)
    except ConfigError as exc:
        click.echo(f"gem-schd: bad config: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if ipc_dir is None:
        log.warning("TCP transport: any local process can connect to %s:%d and say hello for any group; --ipc-dir "
                    "(Unix sockets) lets only this user in", ip, port)
    daemon = SchedulerDaemon(config, ip=ip, port=port, base_quota_ms=quota, min_quota_ms=min_quota,
                             window_ms=window, bucket_ms=bucket, cap_frame_ms=frame, config_path=str(path),
                             metrics_port=metrics_port, trace_path=trace_path,
                             board_path=None if board.lower() == "none" else board, ipc_dir=ipc_dir,
                             device_uuid=device_uuid, device_memory=capacity,
                             memory_probe=None if capacity is not None else _memory_probe(device_uuid),
                             unified_min_slot_ms=unified_min_slot, frame_turns=frame_turns,
                             min_frame_quota_ms=min_frame_quota, fair_cycle_ms=fair_cycle,
                             decide_ahead_ms=decide_ahead)

    async def run() -> int:
        # Handlers first: a signal that arrives as soon as the port is bound must stop us cleanly.
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_requested.set)
        try:
            await daemon.start()
        except BindError as exc:
            click.echo(f"gem-schd: {exc}", err=True)
            return EXIT_USAGE
        except OSError as exc:
            if trace_path and exc.filename and os.path.abspath(exc.filename) == os.path.abspath(trace_path):
                click.echo(f"gem-schd: --trace: cannot write {trace_path}: {exc.strerror or exc}", err=True)
            else:   # e.g. the config watcher, past the kernel's inotify limits, once the rest had started
                click.echo(f"gem-schd: cannot start: {exc}", err=True)
            # what start() opened before it failed (its socket, board page, trace): stop() closes it and is safe
            # after a partial start; the process then ends without the teardown that would have flushed files
            daemon.stop()
            return EXIT_USAGE
        if daemon.reloader is not None:
            loop.add_signal_handler(signal.SIGHUP, daemon.reloader.request_reload)
        stopper = asyncio.create_task(stop_requested.wait())
        closed = asyncio.create_task(daemon.wait_closed())
        await asyncio.wait({stopper, closed}, return_when=asyncio.FIRST_COMPLETED)
        if stop_requested.is_set():
            daemon.stop()
            await closed
        stopper.cancel()
        stats = daemon.timer_stats()
        if stats.get("count"):
            log.info("grants at deadlines: %d, lateness p50 %.3f ms, p99 %.3f ms; CPU from a deadline to its grant "
                     "sent p50 %.1f us, p99 %.1f us; wall from the deadline to the grant sent p50 %.3f ms, "
                     "p99 %.3f ms; decided ahead %d (CPU p50 %.1f us, p99 %.1f us), at the deadline %d",
                     stats["count"], stats["p50_ms"], stats["p99_ms"], stats["cpu_p50_us"], stats["cpu_p99_us"],
                     stats["sent_p50_ms"], stats["sent_p99_ms"], stats["decided_ahead"], stats["decide_cpu_p50_us"],
                     stats["decide_cpu_p99_us"], stats["decided_late"])
        return 0

    try:
        code = asyncio.run(run())
    except KeyboardInterrupt:
        code = 0
    exit_now(code)     # stopped cleanly: no interpreter teardown (gemini/shutdown.py)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="gem-schd")
