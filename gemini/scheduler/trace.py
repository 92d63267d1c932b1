"""Chrome trace of gem-schd's slots (`gem-schd --trace FILE`), for Perfetto (ui.perfetto.dev), chrome://tracing
and `gem-ctl plot`.

Format: the Trace Event "JSON array" format, one event per line, the separating comma at the start of the line:

    [
    {"ph":"M","name":"process_name","pid":...,"tid":0,"args":{"name":"gem-schd ..."}}
    ,{"ph":"M","name":"thread_name","pid":...,"tid":1,"args":{"name":"group a"}}
    ,{"ph":"i","s":"g","name":"config","cat":"config","ts":0.0,...,"args":{"reason":"start","groups":{...},...}}
    ,{"ph":"X","name":"a","cat":"slot","ts":1234.5,"dur":250000.0,"pid":...,"tid":1,"args":{"token_seq":1,...}}
    ...

* one "X" (complete) event per slot -- a grant and its end -- written when the slot ends, with ts (the grant)
  and dur in microseconds since the daemon started; args: token_seq, quota_ms, wait_ms (how long the request
  waited), ended ("release": the group's clients went idle or asked again; "deadline": the quota ran out;
  "continued": the holder kept the GPU in a new slot that starts where this one ends; "stop": the daemon
  stopped);
* one "X" event (cat "claim") per claim a latency group reported, on its track;
* unified groups' swaps (MemoryMode = unified), cat "swap", on the group's track: an instant "<group> evict"
  when gem-schd asks the group to move its memory to the host to make room for another group's grant (args:
  seq, bytes: what gem-schd counted resident), and an "X" event "<group> swap out" when the group's hooks answer
  that eviction, or "<group> swap in" when they report the prefetch at a grant (args: direction "host" or
  "device", bytes moved, took_ms; for swap out also seq and complete: false when the pod manager gave up on a
  process that did not answer). Its dur is took_ms, ending when the report reached gem-schd. A prefetch that
  moved nothing is not reported, so not written; an eviction that moved nothing is (bytes 0);
* a counter event "share" on the scheduler's track 50 times a window, args {group: share}: each group's share
  as gem-ctl status reported it at that moment (gemini/scheduler/share.py); Perfetto draws it as a counter track,
  gem-ctl plot as the share curves. While every share stays 0 (an idle scheduler) only the first 0 is written;
* one track (tid) per group, named by "thread_name" metadata, in config order;
* an instant event "config" at the start and at every applied reload (args: the groups' MinUtil, MaxUtil,
  MemoryLimit, and what the reload added, changed and removed), so that a plot can draw the limits in force.

Every line is flushed as it is written, so the file of a daemon that was killed holds every event so far and is
a trace the viewers open as it is (the array format allows a missing "]"), and strict JSON once "]" is appended.
A daemon that stops cleanly ends the file with a "stopped" event and "]". `read_trace` reads either.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from gemini.config import Config
from gemini.scheduler.observers import ObserverBase
from gemini.scheduler.share import sample_interval

log = logging.getLogger("gemini.scheduler.trace")

SCHEDULER_TID = 0      # the track of scheduler-wide events (config, stop)


def _groups_arg(config: Config) -> dict[str, dict[str, Any]]:
    return {g.name: {"min_util": g.min_util, "max_util": g.max_util, "mem_limit": g.mem_limit,
                     "process_sharing": "turns" if g.turns else "together", "class": g.sched_class}
            for g in config.groups}


class TraceWriter(ObserverBase):
    """A daemon observer that writes the trace file. Opened (truncated) at construction; OSError if it cannot."""

    def __init__(self, path: str | os.PathLike, daemon: Any):
        self.path = Path(path)
        self._daemon = daemon
        self._sampler: Optional[asyncio.TimerHandle] = None
        self._idle_written = False    # the last sample written was all zeros
        self._file: Optional[IO[str]] = open(self.path, "w", encoding="utf-8")
        self._pid = os.getpid()
        self._tids: dict[str, int] = {}
        self._separator = ""          # before the next event: nothing before the first one, then a comma
        self._write_raw("[\n")
        self._event({"ph": "M", "name": "process_name", "tid": SCHEDULER_TID,
                     "args": {"name": f"gem-schd {daemon.scheduler_id} ({daemon.endpoint or daemon.ip})"}})
        self._event({"ph": "M", "name": "thread_name", "tid": SCHEDULER_TID, "args": {"name": "scheduler"}})
        self._event({"ph": "M", "name": "thread_sort_index", "tid": SCHEDULER_TID, "args": {"sort_index": 0}})
        for name in daemon.config.names:
            self._tid(name)
        policy = daemon.policy
        # Wall-clock time of ts = 0, so that a trace can be lined up with logs.
        unix_t0 = time.time() - daemon.now_ms() / 1000.0
        self._event({"ph": "i", "s": "g", "name": "config", "cat": "config", "ts": 0.0, "tid": SCHEDULER_TID,
                     "args": {"reason": "start", "scheduler_id": daemon.scheduler_id, "unix_time_at_ts0": unix_t0,
                              "window_ms": policy.window_ms, "base_quota_ms": policy.base_quota_ms,
                              "min_quota_ms": policy.min_quota_ms, "fair_cycle_ms": policy.fair_cycle_ms,
                              "config_path": daemon.config.path,
                              "groups": _groups_arg(daemon.config)}})
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:      # built outside a loop (a test): no periodic samples
            self._loop = None
        self._interval_s = sample_interval(policy.window_ms) / 1000.0
        self._sample()

    # --- observer interface (called by the daemon, on its loop) --------------------------------------------------

    def on_slot_end(self, group: str, token_seq: int, quota_ms: float, start_ms: float, end_ms: float,
                    wait_ms: float, reason: str) -> None:
        # Written when the slot ends: a complete event needs its duration.
        self._event({"ph": "X", "name": group, "cat": "slot", "ts": _us(start_ms), "dur": _us(end_ms - start_ms),
                     "tid": self._tid(group),
                     "args": {"token_seq": token_seq, "quota_ms": round(quota_ms, 3), "wait_ms": round(wait_ms, 3),
                              "ended": reason}})

    def on_claim(self, group: str, start_ms: float, end_ms: float) -> None:
        self._event({"ph": "X", "name": f"{group} claim", "cat": "claim", "ts": _us(start_ms),
                     "dur": _us(max(0.0, end_ms - start_ms)), "tid": self._tid(group), "args": {}})

    def on_evict(self, group: str, seq: int, nbytes: int, now_ms: float) -> None:
        # An instant: the request. What it moved and how long it took come with the hooks' answer (on_swap).
        self._event({"ph": "i", "s": "t", "name": f"{group} evict", "cat": "swap", "ts": _us(now_ms),
                     "tid": self._tid(group), "args": {"seq": seq, "bytes": nbytes}})

    def on_swap(self, group: str, direction: str, seq: int, moved_bytes: int, took_ms: float, end_ms: float,
                complete: bool) -> None:
        # The hooks time their moves; the report arrives when they are done, so the move ends at end_ms.
        took = round(max(0.0, took_ms), 3)
        args: dict[str, Any] = {"direction": direction, "bytes": moved_bytes, "took_ms": took}
        if direction == "host":
            args.update(seq=seq, complete=complete)
        name = f"{group} swap out" if direction == "host" else f"{group} swap in"
        self._event({"ph": "X", "name": name, "cat": "swap", "ts": _us(end_ms - took), "dur": _us(took),
                     "tid": self._tid(group), "args": args})

    def on_config(self, config: Config, diff: Any, now_ms: float) -> None:
        for name in config.names:
            self._tid(name)
        self._event({"ph": "i", "s": "g", "name": "config", "cat": "config", "ts": _us(now_ms),
                     "tid": SCHEDULER_TID,
                     "args": {"reason": "reload", "added": list(diff.added), "changed": list(diff.changed),
                              "removed": list(diff.removed), "groups": _groups_arg(config)}})

    def on_stop(self, now_ms: float) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None
        if self._file is None:
            return
        self._write_sample(now_ms, force=True)
        self._event({"ph": "i", "s": "g", "name": "gem-schd stopped", "cat": "config", "ts": _us(now_ms),
                     "tid": SCHEDULER_TID})
        self._write_raw("]\n")
        self.close()

    # --- share samples ----------------------------------------------------------------------------------------------

    def _sample(self) -> None:
        """Record the reported shares now, and again in a 50th of a window (on the daemon's loop)."""
        self._sampler = None
        if self._file is None:
            return
        self._write_sample(self._daemon.now_ms())
        if self._loop is not None and not self._loop.is_closed():
            self._sampler = self._loop.call_later(self._interval_s, self._sample)

    def _write_sample(self, now_ms: float, force: bool = False) -> None:
        try:
            shares = self._daemon.reported_shares(now_ms)
        except Exception:     # the trace must never take the scheduler down
            log.exception("trace: cannot read the shares")
            return
        idle = not any(shares.values())
        if idle and self._idle_written and not force:
            return
        self._idle_written = idle
        self._event({"ph": "C", "name": "share", "cat": "share", "ts": _us(now_ms), "tid": SCHEDULER_TID,
                     "args": {g: round(v, 6) for g, v in shares.items()}})

    # --- internals ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                log.warning("trace %s: %s", self.path, exc)
            self._file = None

    def _tid(self, group: str) -> int:
        tid = self._tids.get(group)
        if tid is None:
            tid = self._tids[group] = len(self._tids) + 1
            self._event({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": f"group {group}"}})
            self._event({"ph": "M", "name": "thread_sort_index", "tid": tid, "args": {"sort_index": tid}})
        return tid

    def _event(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            event["pid"] = self._pid
            self._write_raw(self._separator + json.dumps(event, separators=(",", ":")) + "\n")
            self._separator = ","

    def _write_raw(self, text: str) -> None:
        if self._file is None:
            return
        try:
            self._file.write(text)
            self._file.flush()   # a killed daemon must still leave every event it wrote
        except OSError as exc:
            log.error("trace %s: cannot write (%s); tracing stopped", self.path, exc)
            self._file = None


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


# --- reading ------------------------------------------------------------------------------------------------------

class TraceFormatError(ValueError):
    """A file that is not a trace written by gem-schd --trace (or any JSON trace)."""


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a trace file: the JSON array format (closed or not, and with a last line cut short by a kill
    as gem-schd writes it) or the JSON object format ({"traceEvents": [...]})."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        events = data.get("traceEvents")
        if not isinstance(events, list):
            raise TraceFormatError(f"{path}: a JSON object without a traceEvents list")
        return [e for e in events if isinstance(e, dict)]
    if isinstance(data, list):
        return [e for e in data if isinstance(e, dict)]
    # An unterminated array, as a killed daemon leaves it: one event per line.
    lines = text.splitlines()
    if not lines or lines[0].strip() != "[":
        raise TraceFormatError(f"{path}: not a trace (expected a JSON array)")
    events = []
    body = [line.strip() for line in lines[1:]]
    while body and body[-1] in ("", "]"):
        body.pop()
    for n, line in enumerate(body, start=2):
        if not line or line == "]":
            continue
        try:
            event = json.loads(line.strip(","))
        except json.JSONDecodeError:
            if n == len(body) + 1:    # the last line, cut short by a kill: drop it
                log.warning("%s: dropped an incomplete last line", path)
                break
            raise TraceFormatError(f"{path}:{n}: not a trace event") from None
        if isinstance(event, dict):
            events.append(event)
    return events


@dataclass(frozen=True)
class SlotEvent:
    group: str
    start_s: float
    dur_s: float
    token_seq: int
    quota_ms: float
    ended: str


@dataclass(frozen=True)
class SwapEvent:
    """A unified group's memory moved: direction "host" (an eviction) or "device" (a prefetch at a grant)."""
    group: str
    start_s: float
    dur_s: float
    direction: str
    bytes: int


@dataclass(frozen=True)
class ShareSample:
    """Each group's share as gem-schd reported it at t_s."""
    t_s: float
    shares: dict[str, float]


@dataclass(frozen=True)
class ConfigEvent:
    t_s: float
    groups: dict[str, dict[str, Any]]


@dataclass
class SchedulerTrace:
    """A trace file's slots (sorted by start), swaps, config changes and window, in seconds since the daemon started."""
    slots: list[SlotEvent] = field(default_factory=list)
    configs: list[ConfigEvent] = field(default_factory=list)
    samples: list[ShareSample] = field(default_factory=list)     # sorted by time
    swaps: list[SwapEvent] = field(default_factory=list)         # sorted by start
    window_s: float = 10.0
    end_s: float = 0.0
    groups: list[str] = field(default_factory=list)   # every group seen, in order of first appearance
    unix_t0: Optional[float] = None     # wall-clock time of ts 0 (the start event's unix_time_at_ts0)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SchedulerTrace":
        events = read_trace(path)
        trace = cls()
        seen: dict[str, None] = {}
        for e in events:
            ph, args = e.get("ph"), e.get("args") or {}
            if ph == "i" and e.get("cat") == "config" and trace.unix_t0 is None and "unix_time_at_ts0" in args:
                trace.unix_t0 = float(args["unix_time_at_ts0"])
            if ph == "X" and e.get("cat") == "slot":
                try:
                    slot = SlotEvent(str(e["name"]), float(e["ts"]) / 1e6, float(e["dur"]) / 1e6,
                                     int(args.get("token_seq", 0)), float(args.get("quota_ms", 0.0)),
                                     str(args.get("ended", "")))
                except (KeyError, TypeError, ValueError):
                    raise TraceFormatError(f"{path}: bad slot event {e!r}") from None
                trace.slots.append(slot)
                seen.setdefault(slot.group)
                trace.end_s = max(trace.end_s, slot.start_s + slot.dur_s)
            elif ph == "X" and e.get("cat") == "swap":
                try:
                    group = str(e["name"]).rsplit(" swap ", 1)[0]     # "<group> swap in|out" (no spaces in names)
                    swap = SwapEvent(group, float(e["ts"]) / 1e6, float(e["dur"]) / 1e6,
                                     str(args.get("direction", "")), int(args.get("bytes", 0)))
                except (KeyError, TypeError, ValueError):
                    raise TraceFormatError(f"{path}: bad swap event {e!r}") from None
                trace.swaps.append(swap)
                seen.setdefault(swap.group)
                trace.end_s = max(trace.end_s, swap.start_s + swap.dur_s)
            elif ph == "i" and e.get("cat") == "config" and isinstance(args.get("groups"), dict):
                t = float(e.get("ts", 0.0)) / 1e6
                trace.configs.append(ConfigEvent(t, args["groups"]))
                for name in args["groups"]:
                    seen.setdefault(name)
                if "window_ms" in args:
                    trace.window_s = float(args["window_ms"]) / 1000.0
                trace.end_s = max(trace.end_s, t)
            elif ph == "C" and e.get("name") == "share":
                try:
                    sample = ShareSample(float(e["ts"]) / 1e6, {str(g): float(v) for g, v in args.items()})
                except (KeyError, TypeError, ValueError):
                    raise TraceFormatError(f"{path}: bad share sample {e!r}") from None
                trace.samples.append(sample)
                trace.end_s = max(trace.end_s, sample.t_s)
            elif ph == "i" and "ts" in e:
                trace.end_s = max(trace.end_s, float(e["ts"]) / 1e6)
        trace.slots.sort(key=lambda s: s.start_s)
        trace.samples.sort(key=lambda s: s.t_s)
        trace.swaps.sort(key=lambda s: s.start_s)
        trace.configs.sort(key=lambda c: c.t_s)
        trace.groups = list(seen)
        return trace
