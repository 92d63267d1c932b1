#!/usr/bin/env python3
"""gem-schd alone, pinned to one core: its CPU per slot, and the most slots a second it can run, at 2 to 256 groups.

    python bench/bench_schd_ceiling.py [--groups 2,16,64,256] [--seconds 5] [--quota 5] [--schd-arg=--decide-ahead=0
                                       [--compare]] [--out DIR]

Issue 14's scale goal is about gem-schd's own CPU, which bench_scale.py cannot isolate (its pod managers and load
share the machine, and its load offers fewer slots than gem-schd could run). Here one process plays every group's pod
manager over TCP (a DEALER each: HELLO, then TOKEN_REQUEST, and a TOKEN_RELEASE with a new TOKEN_REQUEST as soon as
a slot ends), on another core than gem-schd, which runs with its default flags but `-q`/`-m` (`--quota`), every group
MinUtil 0 and MaxUtil 1. Two modes per group count:
* `deadline`: each group holds its slot to its quota (as a busy group's pod manager would), so gem-schd ends every
  slot at its timer and grants the next waiting group there: gem-schd's CPU per slot, and its own measures from the
  deadline to the grant handed to zmq, at p50 and p99, from its log line at exit: the CPU (thread CPU time; with
  `--decide-ahead`, the default, the decision was made before the deadline and this is the board and the send) and
  the wall time;
* `ceiling`: each group releases at once, so a slot is one release, one decision and one grant: slots/s with
  gem-schd's core saturated or nearly, its CPU per slot, and 1 / that (the ceiling on a whole core).
And one measure of the machine rather than of gem-schd (`bare_send`): the thread CPU of a single ROUTER send from a
process pinned to gem-schd's core, a slot's length after the one before it, to a DEALER on the load's core -- what
the grant's message costs with nothing of gemini around it. On the development machine (a 2-core nested VM) it was
72-156 us after a slot's quiet against 8-15 us back to back: code run just after a wake-up is many times slower there
(docs/benchmarks.md, "Twenty-eighth session").
Prints one JSON object (and writes DIR/schd_ceiling.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from bench.bench_soak import cpu_seconds  # noqa: E402
from bench.harness import Group, write_config  # noqa: E402
from gemini.wire.sched import (FROM_SCHEDULER, Error, Grant, Heartbeat, Hello, TokenRelease,  # noqa: E402
                               TokenRequest, Welcome, decode, encode)

LISTEN_LINE = re.compile(r"listening on tcp://127\.0\.0\.1:([0-9]+)")
CPU_LINE = re.compile(r"CPU from a deadline to its grant sent p50 ([0-9.]+) us, p99 ([0-9.]+) us"
                      r"(?:; wall from the deadline to the grant sent p50 ([0-9.]+) ms, p99 ([0-9.]+) ms)?"
                      r"(?:; decided ahead ([0-9]+) \(CPU p50 ([0-9.]+) us, p99 ([0-9.]+) us\), at the deadline "
                      r"([0-9]+))?")


async def _load(endpoint: str, groups: list[str], seconds: float, hold: bool, warmup: float,
                schd_pid: int) -> tuple[int, float, float]:
    """Play every group's pod manager for warm-up + `seconds`: the grants received after the warm-up, gem-schd's
    CPU seconds and the wall seconds over exactly that span."""
    ctx = zmq.asyncio.Context()
    socks: list = []
    counted = 0
    span: dict[str, float] = {}

    async def play(name: str, s) -> None:
        nonlocal counted
        await s.send(encode(Hello(name, pid=os.getpid())))
        while True:
            msg = decode(await asyncio.wait_for(s.recv(), timeout=10.0), allowed=FROM_SCHEDULER)
            if isinstance(msg, Welcome):
                break
            if isinstance(msg, Error):
                raise RuntimeError(f"gem-schd refused group {name}: {msg.message}")
        await s.send(encode(TokenRequest(name)))
        while time.monotonic() < span["stop_at"]:
            try:
                frame = await asyncio.wait_for(s.recv(), timeout=max(0.01, span["stop_at"] - time.monotonic()))
            except asyncio.TimeoutError:
                return
            msg = decode(frame, allowed=FROM_SCHEDULER)
            if isinstance(msg, Error):
                raise RuntimeError(f"gem-schd, to group {name}: {msg.message}")
            if not isinstance(msg, Grant) or msg.continuation:
                continue
            if span["from"] <= time.monotonic() < span["stop_at"]:
                counted += 1
            if hold:
                await asyncio.sleep(msg.quota_ms / 1000.0)
            await s.send(encode(TokenRelease(name, msg.token_seq, used_ms=msg.quota_ms if hold else 0.0)))
            await s.send(encode(TokenRequest(name)))

    async def heartbeats() -> None:
        # a pod manager silent for HEARTBEAT_TIMEOUT_S (5 s) is dropped with its request: with many groups and
        # long slots a waiting group would be, and the bench would measure fewer groups than it names
        while True:
            await asyncio.sleep(1.0)
            for name, s in zip(groups, socks):
                await s.send(encode(Heartbeat(name)))

    async def measure() -> None:
        await asyncio.sleep(max(0.0, span["from"] - time.monotonic()))
        cpu0, t0 = cpu_seconds(schd_pid), time.monotonic()
        await asyncio.sleep(max(0.0, span["stop_at"] - time.monotonic()))
        span["cpu"], span["wall"] = cpu_seconds(schd_pid) - cpu0, time.monotonic() - t0

    beat = None
    try:
        for _ in groups:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            socks.append(s)
        span["from"] = time.monotonic() + warmup
        span["stop_at"] = span["from"] + seconds
        beat = asyncio.ensure_future(heartbeats())
        await asyncio.gather(measure(), *(play(g, s) for g, s in zip(groups, socks)))
    finally:
        if beat is not None:
            beat.cancel()
        for s in socks:
            s.close()
        ctx.term()
    return counted, span["cpu"], span["wall"]


def run_point(n: int, mode: str, seconds: float, quota_ms: float, schd_cpu: int, load_cpu: int,
              work: Path, warmup: float = 1.0, schd_args: tuple[str, ...] = ()) -> dict:
    groups = [f"g{i}" for i in range(n)]
    config = work / f"rc-{n}-{mode}.txt"
    write_config(config, [Group(g, 0.0, 1.0, "1GiB") for g in groups])
    log = work / f"gem-schd-{n}-{mode}.log"
    argv = [sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "-f", str(config), "-q", str(quota_ms),
            "-m", str(min(quota_ms, 5.0)), "--board", str(work / f"board-{n}-{mode}"), *schd_args]
    affinity = os.sched_getaffinity(0)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)))
    try:
        # (pinned from here, not in a preexec_fn: that is unsafe in a parent with threads, as a test worker has)
        os.sched_setaffinity(proc.pid, {schd_cpu})
        deadline = time.monotonic() + 30
        while (listening := LISTEN_LINE.search(log.read_text())) is None:     # -P 0: the port it took
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gem-schd did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        port = int(listening.group(1))
        os.sched_setaffinity(0, {load_cpu})
        slots, cpu, span = asyncio.run(_load(f"tcp://127.0.0.1:{port}", groups, seconds, mode == "deadline",
                                             warmup, proc.pid))
    finally:
        os.sched_setaffinity(0, affinity)       # (the caller's, and its later children's, cores as they were)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    m = CPU_LINE.search(log.read_text())
    per_slot_ms = cpu / slots * 1000 if slots else None
    return {"groups": n, "mode": mode, "schd_args": list(schd_args), "seconds": round(span, 3), "slots": slots,
            "slots_per_s": slots / span,
            "schd_cpu_cores": cpu / span, "schd_cpu_per_slot_ms": per_slot_ms,
            "ceiling_slots_per_s": 1000.0 / per_slot_ms if per_slot_ms else None,
            "deadline_to_grant_cpu_p50_us": float(m.group(1)) if m else None,
            "deadline_to_grant_cpu_p99_us": float(m.group(2)) if m else None,
            "deadline_to_grant_wall_p50_ms": float(m.group(3)) if m and m.group(3) else None,
            "deadline_to_grant_wall_p99_ms": float(m.group(4)) if m and m.group(4) else None,
            "decided_ahead": int(m.group(5)) if m and m.group(5) else None,
            "decide_ahead_cpu_p50_us": float(m.group(6)) if m and m.group(6) else None,
            "decide_ahead_cpu_p99_us": float(m.group(7)) if m and m.group(7) else None,
            "decided_at_deadline": int(m.group(8)) if m and m.group(8) else None}


BARE_SEND_CHILD = r'''
import json, sys, time, zmq
n, gap_s = int(sys.argv[1]), float(sys.argv[2])
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
if not sock.poll(30000):
    sys.exit("no peer within 30 s")
peer, _ = sock.recv_multipart()
payload = b'{"type": "TOKEN_GRANT", "group": "g0", "quota_ms": 5.0, "token_seq": 1234}'
cpu = []
for _ in range(n):
    time.sleep(gap_s)
    t0 = time.thread_time_ns()
    sock.send_multipart([peer, payload], zmq.NOBLOCK)
    cpu.append(time.thread_time_ns() - t0)
cpu.sort()
print(json.dumps({"p50_us": cpu[len(cpu) // 2] / 1000.0, "p99_us": cpu[int(len(cpu) * 0.99)] / 1000.0}), flush=True)
sock.close()
ctx.term()
'''


def bare_send(schd_cpu: int, load_cpu: int, gap_ms: float, n: int = 300) -> dict:
    """The thread CPU (us, p50 and p99) of one zmq ROUTER send after `gap_ms` of quiet, from a process pinned to
    `schd_cpu` to a DEALER of this process pinned to `load_cpu`: the machine's cost of a grant's message alone."""
    affinity = os.sched_getaffinity(0)
    proc = subprocess.Popen([sys.executable, "-c", BARE_SEND_CHILD, str(n), str(gap_ms / 1000.0)],
                            stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    assert proc.stdout is not None
    try:
        os.sched_setaffinity(proc.pid, {schd_cpu})
        os.sched_setaffinity(0, {load_cpu})
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the bare send's child gave no port (exit {proc.poll()}): {line!r}")
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{int(line)}")
        sock.send(b"hello")
        for _ in range(n):
            if not sock.poll(10000):
                raise RuntimeError("the bare send's child stopped sending")
            sock.recv()
        result = json.loads(proc.stdout.readline())
        proc.wait(timeout=30)
    finally:
        os.sched_setaffinity(0, affinity)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        ctx.destroy(linger=0)       # (closes the DEALER on every path: term() would wait for it)
    return {"gap_ms": gap_ms, "sends": n, "cpu_p50_us": result["p50_us"], "cpu_p99_us": result["p99_us"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="2,16,64,256")
    p.add_argument("--modes", default="deadline,ceiling")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--quota", type=float, default=5.0, help="gem-schd -q (ms): each slot's length in deadline mode")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each point's measured span")
    p.add_argument("--bare-sends", type=int, default=300, help="sends in the machine's bare-send measure")
    p.add_argument("--schd-arg", action="append", default=[], metavar="ARG",
                   help="a flag for gem-schd (repeat it); with --compare, for the second run of every point")
    p.add_argument("--compare", action="store_true",
                   help="run every point twice, with gem-schd's defaults and then with the --schd-arg flags")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two cores: one for gem-schd, one for the load")
    rows = []
    with tempfile.TemporaryDirectory(prefix="schd-ceiling-") as tmp:
        variants = [(), tuple(args.schd_arg)] if args.compare else [tuple(args.schd_arg)]
        for n in (int(x) for x in args.groups.split(",")):
            for mode in args.modes.split(","):
                for extra in variants:
                    rows.append(run_point(n, mode, args.seconds, args.quota, cpus[0], cpus[1], Path(tmp),
                                          args.warmup, extra))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {"quota_ms": args.quota, "seconds": args.seconds, "cpus": {"gem-schd": cpus[0], "load": cpus[1]},
           "rows": rows, "bare_send": bare_send(cpus[0], cpus[1], args.quota, n=args.bare_sends)}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "schd_ceiling.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
