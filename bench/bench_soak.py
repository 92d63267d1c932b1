#!/usr/bin/env python3
"""Soak: many protocol-speaking clients in many groups against one gem-schd, for minutes.

    python bench/bench_soak.py [--minutes 10] [--quick] [--groups 16] [--clients-per-group 4] [--out DIR]

launch-backend starts gem-schd and one gem-pmgr per group (bench.harness.Backend). The clients are fake hooks in
this process (asyncio, one TCP connection each, the real wire format): each one thinks for a while, asks for the
token, holds it for a burst (never past the quota it was given), gives it back, and now and then allocates and
frees a little memory. No GPU and no driver are needed, so the numbers are those of the daemons.

Checked and reported (JSON in DIR/soak.json, a Markdown table on stdout and in DIR/soak.md):
- lost grants: a TOKEN_REQUEST not answered by a TOKEN_GRANT within --grant-timeout (default 30 s), an ERROR
  reply, or a connection the daemons dropped; must be 0;
- grant latency (TOKEN_REQUEST -> TOKEN_GRANT at the client, queueing behind other groups included): p50, p99,
  p99.9, max, overall and per sampling interval;
- daemon RSS (VmRSS from /proc/<pid>/status) sampled every --sample-s: flat if it grew by at most
  max(2 MiB, 5 %) from the end of the warm-up (the first 20 % of the run) to the end;
- daemon CPU (utime + stime from /proc/<pid>/stat) as a share of one core;
- memory accounting: once every client is gone, each group's pod manager must account 0 bytes.
Exit status 0 when there were no lost grants, the RSS stayed flat and the accounting came back to 0; else 1.
"""
from __future__ import annotations

import argparse
import array
import asyncio
import json
import logging
import os
import random
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import Backend, Group  # noqa: E402
from gemini.wire import hook as hp  # noqa: E402
from gemini.logs import setup_logging  # noqa: E402

log = logging.getLogger("bench.soak")

MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- load model ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadModel:
    think_ms: float = 10.0          # mean idle time between bursts (exponential)
    burst_ms: tuple[float, float] = (1.0, 8.0)   # burst length, uniform; cut to the quota granted
    mem_every: int = 25             # every N-th burst also allocates and frees memory
    mem_bytes: int = 256 * 1024
    grant_timeout_s: float = 30.0


@dataclass
class LoadStats:
    """What all clients saw. Latencies (ms) are kept per sampling interval."""
    requests: int = 0
    grants: int = 0
    lost: int = 0                   # timeouts, ERROR replies, dropped connections
    problems: list[str] = field(default_factory=list)
    latencies: array.array = field(default_factory=lambda: array.array("f"))
    interval: array.array = field(default_factory=lambda: array.array("f"))
    mem_ops: int = 0
    slots: set = field(default_factory=set)   # distinct (group, token_seq): the scheduler's grants

    def note_problem(self, text: str) -> None:
        self.lost += 1
        if len(self.problems) < 20:
            self.problems.append(text)

    def take_interval(self) -> array.array:
        out, self.interval = self.interval, array.array("f")
        return out


class ClientGone(Exception):
    pass


class FakeHook:
    """One client: one connection to its group's pod manager, one request at a time."""

    def __init__(self, name: str, group: str, port: int, model: LoadModel, stats: LoadStats, rng: random.Random):
        self.name, self.group, self.port = name, group, port
        self.model, self.stats, self.rng = model, stats, rng
        self.seq = 0
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, msg: hp.Message, timeout: float) -> hp.Message:
        assert self.reader is not None and self.writer is not None
        self.seq = self.seq % 0xFFFFFFFF + 1
        self.writer.write(hp.encode(msg, self.seq))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                frame = await asyncio.wait_for(self.reader.readexactly(hp.MSG_SIZE), left)
            except asyncio.IncompleteReadError:
                raise ClientGone(f"{self.name}: the pod manager closed the connection") from None
            seq, reply = hp.decode(frame, hp.PMGR_TO_HOOK)
            if seq == self.seq:
                return reply
            # seq 0: a push (an ERROR); anything else is a stale reply

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = await self.call(hp.Hello(pid=os.getpid(), pod_name=self.group), 10.0)
        if not isinstance(ack, hp.HelloAck):
            raise ClientGone(f"{self.name}: HELLO answered with {ack}")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            self.writer = None

    async def burst(self, n: int) -> None:
        m, st = self.model, self.stats
        t0 = time.perf_counter()
        st.requests += 1
        try:
            grant = await self.call(hp.TokenRequest(burst_ns=int(sum(m.burst_ms) / 2 * 1e6)), m.grant_timeout_s)
        except asyncio.TimeoutError:
            st.note_problem(f"{self.name}: no grant within {m.grant_timeout_s} s")
            raise ClientGone("timeout") from None
        latency_ms = (time.perf_counter() - t0) * 1000
        if not isinstance(grant, hp.TokenGrant):
            st.note_problem(f"{self.name}: TOKEN_REQUEST answered with {grant}")
            return
        st.grants += 1
        st.slots.add((self.group, grant.token_seq))
        st.latencies.append(latency_ms)
        st.interval.append(latency_ms)
        hold_ms = min(self.rng.uniform(*m.burst_ms), grant.quota_ns / 1e6)
        await asyncio.sleep(hold_ms / 1000)
        ack = await self.call(hp.TokenRelease(token_seq=grant.token_seq), 10.0)
        if not isinstance(ack, hp.Ack):
            st.note_problem(f"{self.name}: TOKEN_RELEASE answered with {ack}")
        if m.mem_every and n % m.mem_every == 0:
            for msg in (hp.MemAlloc(bytes=m.mem_bytes), hp.MemFree(bytes=m.mem_bytes)):
                reply = await self.call(msg, 10.0)
                if not isinstance(reply, hp.MemReply):
                    st.note_problem(f"{self.name}: {type(msg).__name__} answered with {reply}")
            st.mem_ops += 2

    async def run(self, until: float) -> None:
        try:
            await self.connect()
            n = 0
            while time.monotonic() < until:
                await asyncio.sleep(self.rng.expovariate(1.0 / self.model.think_ms) / 1000)
                n += 1
                await self.burst(n)
        except ClientGone as exc:
            if str(exc) != "timeout":
                self.stats.note_problem(str(exc))
        except (ConnectionError, OSError, hp.ProtocolError) as exc:
            self.stats.note_problem(f"{self.name}: {exc!r}")
        finally:
            await self.close()


# --- daemon probes -----------------------------------------------------------------------------------------------





def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK      # utime, stime


def self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def latency_summary(values) -> dict:
    return {"n": len(values), "p50_ms": round(percentile(values, 0.50), 3),
            "p99_ms": round(percentile(values, 0.99), 3), "p999_ms": round(percentile(values, 0.999), 3),
            "max_ms": round(max(values), 3) if values else None}


# --- one run -----------------------------------------------------------------------------------------------------

def soak_groups(n: int) -> list[Group]:
    """n groups; every fourth has a MinUtil guarantee and every fourth (others) a MaxUtil cap, so the policy's
    guarantee and cap paths are both busy."""
    groups = []
    for i in range(n):
        min_util = 0.04 if i % 4 == 0 else 0.0
        max_util = 0.5 if i % 4 == 2 else 1.0
        groups.append(Group(f"g{i:02d}", min_util, max_util, "1GiB"))
    return groups


async def sample_loop(pids: dict[str, int], stats: LoadStats, start: float, until: float, every: float,
                      samples: list[dict]) -> None:
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    gen0 = self_cpu_seconds()
    t_prev, grants_prev = time.monotonic(), stats.grants
    while True:
        now = time.monotonic()
        await asyncio.sleep(max(0.0, min(every, until - now)))
        now = time.monotonic()
        lat = stats.take_interval()
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        samples.append({
            "t_s": round(now - start, 2),
            "grants_per_s": round((stats.grants - grants_prev) / max(1e-9, now - t_prev), 1),
            "latency": latency_summary(lat),
            "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
            "cpu_s": {name: round(cpu[name] - cpu0[name], 3) for name in pids},
            "loadgen_cpu_s": round(self_cpu_seconds() - gen0, 3),
        })
        t_prev, grants_prev = now, stats.grants
        if now >= until:
            return


async def group_memory(ports: dict[str, int]) -> dict[str, int]:
    """Each group's memory in use, as its pod manager accounts it (asked by a fresh client)."""
    out = {}
    for group, port in ports.items():
        hook = FakeHook("probe", group, port, LoadModel(), LoadStats(), random.Random(0))
        await hook.connect()
        reply = await hook.call(hp.MemInfo(), 10.0)
        out[group] = reply.used
        await hook.close()
    return out


async def drive(be: Backend, groups: int, per_group: int, seconds: float, sample_s: float, model: LoadModel,
                seed: int) -> dict:
    pids = {(k if k == 'gem-schd' else 'pmgr:' + k): v for k, v in be.daemon_pids().items()}
    stats = LoadStats()
    rng = random.Random(seed)
    start = time.monotonic()
    until = start + seconds
    clients = [FakeHook(f"{g}/{i}", g, be.ports[g], model, stats, random.Random(rng.random()))
               for g in list(be.ports)[:groups] for i in range(per_group)]
    samples: list[dict] = []
    sampler = asyncio.create_task(sample_loop(pids, stats, start, until, sample_s, samples))
    await asyncio.gather(*(c.run(until) for c in clients))
    await sampler
    await asyncio.sleep(0.3)            # let the pod managers see the last connections close
    memory = await group_memory(be.ports)
    wall = time.monotonic() - start
    return {"pids": pids, "stats": stats, "samples": samples, "memory_after": memory, "wall_s": wall,
            "clients": len(clients)}


def rss_verdict(samples: list[dict], warmup_fraction: float = 0.2) -> dict:
    """Per daemon: RSS at the end of the warm-up, at the end, the peak, and whether it stayed flat."""
    if not samples:
        return {}
    total = samples[-1]["t_s"]
    warm = next((s for s in samples if s["t_s"] >= warmup_fraction * total), samples[0])
    out = {}
    for name in samples[-1]["rss"]:
        w, e = warm["rss"][name], samples[-1]["rss"][name]
        peak = max(s["rss"][name] for s in samples)
        out[name] = {"warm_mib": round(w / MiB, 2), "end_mib": round(e / MiB, 2), "peak_mib": round(peak / MiB, 2),
                     "growth_mib": round((e - w) / MiB, 2), "flat": e - w <= max(2 * MiB, 0.05 * w)}
    return out


def summarize(run: dict, args: dict) -> dict:
    st: LoadStats = run["stats"]
    samples = run["samples"]
    rss = rss_verdict(samples)
    cpu_total = samples[-1]["cpu_s"] if samples else {}
    wall = samples[-1]["t_s"] if samples else run["wall_s"]
    pmgr = [n for n in cpu_total if n.startswith("pmgr:")]
    return {
        "config": args,
        "clients": run["clients"],
        "duration_s": round(wall, 1),
        "requests": st.requests,
        "grants": st.grants,
        "lost_grants": st.lost,
        "problems": st.problems,
        "grants_per_s": round(st.grants / max(wall, 1e-9), 1),
        "slots": len(st.slots),
        "slots_per_s": round(len(st.slots) / max(wall, 1e-9), 1),
        "gem_schd_cpu_ms_per_slot": round(1000 * cpu_total.get("gem-schd", 0.0) / max(1, len(st.slots)), 4),
        "mem_ops": st.mem_ops,
        "latency": latency_summary(st.latencies),
        "rss": rss,
        "rss_flat": all(v["flat"] for v in rss.values()),
        "cpu_share": {
            "gem-schd": round(cpu_total.get("gem-schd", 0.0) / max(wall, 1e-9), 4),
            "gem-pmgr_total": round(sum(cpu_total[n] for n in pmgr) / max(wall, 1e-9), 4),
            "gem-pmgr_max": round(max((cpu_total[n] for n in pmgr), default=0.0) / max(wall, 1e-9), 4),
            "load_generator": round((samples[-1]["loadgen_cpu_s"] if samples else 0.0) / max(wall, 1e-9), 4),
        },
        "memory_after": run["memory_after"],
        "accounting_back_to_zero": all(v == 0 for v in run["memory_after"].values()),
        "intervals": samples,
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }


def markdown(result: dict) -> str:
    lat, rss, cpu = result["latency"], result["rss"], result["cpu_share"]
    pm = [v for k, v in rss.items() if k.startswith("pmgr:")]
    lines = [
        f"Soak: {result['clients']} clients in {result['config']['groups']} groups, {result['duration_s']} s "
        f"({result['host']['cpus']} CPUs)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| grants (requests) | {result['grants']} ({result['requests']}) |",
        f"| lost grants | {result['lost_grants']} |",
        f"| grants/s (slots/s: grants by gem-schd) | {result['grants_per_s']} ({result['slots_per_s']}) |",
        f"| gem-schd CPU per slot | {result['gem_schd_cpu_ms_per_slot']} ms |",
        f"| grant latency p50 / p99 / p99.9 / max | {lat['p50_ms']} / {lat['p99_ms']} / {lat['p999_ms']} / "
        f"{lat['max_ms']} ms |",
        f"| gem-schd RSS after warm-up -> end (peak) | {rss['gem-schd']['warm_mib']} -> {rss['gem-schd']['end_mib']} "
        f"({rss['gem-schd']['peak_mib']}) MiB |",
        f"| gem-pmgr RSS growth, worst of {len(pm)} | {max(v['growth_mib'] for v in pm)} MiB |",
        f"| RSS flat | {'yes' if result['rss_flat'] else 'NO'} |",
        f"| CPU (share of one core): gem-schd / all gem-pmgr / load generator | {cpu['gem-schd']:.3f} / "
        f"{cpu['gem-pmgr_total']:.3f} / {cpu['load_generator']:.3f} |",
        f"| memory accounted after the clients left | "
        f"{'0 in every group' if result['accounting_back_to_zero'] else result['memory_after']} |",
        "",
        "| t (s) | grants/s | p50 (ms) | p99 (ms) | gem-schd RSS (MiB) | gem-schd CPU (s) |",
        "|---|---|---|---|---|---|",
    ]
    for s in result["intervals"]:
        lines.append(f"| {s['t_s']} | {s['grants_per_s']} | {s['latency']['p50_ms']} | {s['latency']['p99_ms']} | "
                     f"{s['rss']['gem-schd'] / MiB:.2f} | {s['cpu_s']['gem-schd']} |")
    return "\n".join(lines) + "\n"


def run_backend(groups: int, per_group: int, seconds: float, sample_s: float, model: LoadModel, quota_ms: float,
                min_quota_ms: float, window_ms: float, seed: int, workdir: Path) -> dict:
    with Backend(workdir, soak_groups(groups), quota_ms=quota_ms, min_quota_ms=min_quota_ms,
                 window_ms=window_ms) as be:
        return asyncio.run(drive(be, groups, per_group, seconds, sample_s, model, seed))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    ap.add_argument("--quick", action="store_true", help="1 minute (overrides --minutes)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--clients-per-group", type=int, default=4)
    ap.add_argument("--quota-ms", type=float, default=20.0, help="gem-schd's base quota")
    ap.add_argument("--min-quota-ms", type=float, default=5.0)
    ap.add_argument("--window-ms", type=float, default=10000.0)
    ap.add_argument("--think-ms", type=float, default=LoadModel.think_ms, help="mean idle time between bursts")
    ap.add_argument("--grant-timeout", type=float, default=LoadModel.grant_timeout_s)
    ap.add_argument("--sample-s", type=float, default=None, help="sampling interval (default: run / 20, >= 2 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench-out", help="directory for soak.json and soak.md")
    args = ap.parse_args(argv)
    setup_logging("bench-soak", logging.INFO)
    minutes = 1.0 if args.quick else args.minutes
    seconds = minutes * 60
    sample_s = args.sample_s or max(2.0, seconds / 20)
    model = LoadModel(think_ms=args.think_ms, grant_timeout_s=args.grant_timeout)
    with tempfile.TemporaryDirectory(prefix="gemini-soak-") as tmp:
        run = run_backend(args.groups, args.clients_per_group, seconds, sample_s, model, args.quota_ms,
                          args.min_quota_ms, args.window_ms, args.seed, Path(tmp) / "backend")
    config = {"groups": args.groups, "clients_per_group": args.clients_per_group, "minutes": minutes,
              "quota_ms": args.quota_ms, "min_quota_ms": args.min_quota_ms, "window_ms": args.window_ms,
              "think_ms": args.think_ms, "burst_ms": list(model.burst_ms), "seed": args.seed}
    result = summarize(run, config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / "soak.md").write_text(table)
    print(table)
    ok = result["lost_grants"] == 0 and result["rss_flat"] and result["accounting_back_to_zero"]
    if not ok:
        log.error("soak FAILED: lost grants %d, RSS flat %s, accounting back to 0 %s; problems: %s",
                  result["lost_grants"], result["rss_flat"], result["accounting_back_to_zero"], result["problems"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
