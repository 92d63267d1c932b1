#!/usr/bin/env python3
"""Grant latency through gem-schd on loopback.

1. free token: a pod manager sends TokenRequest while nobody holds the token and waits for the Grant
   (then releases it); round-trip p50/p99 over N requests.
2. handoff at deadline: two pod managers ping-pong with a short quota; each grant to the waiting one should go out
   at the holder's deadline. Lateness = arrival of the grant - (arrival of the holder's grant + quota), measured
   by the client (the daemon's deadline timer is a thread that sleeps precisely; see gemini/scheduler/daemon.py).

Runs gem-schd as a subprocess (python -m gemini.scheduler.cli). Prints a JSON object.
Usage: python bench/bench_grant_latency.py [-n 2000] [--handoffs 200] [--quota-ms 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import percentile  # noqa: E402
from gemini.wire.sched import Grant, Hello, TokenRelease, TokenRequest, Welcome  # noqa: E402
from tests.schd_inproc import FakePodManager  # noqa: E402



def summary(values_ms):
    return {"n": len(values_ms), "p50_ms": round(percentile(values_ms, 0.5), 4),
            "p99_ms": round(percentile(values_ms, 0.99), 4),
            "max_ms": round(max(values_ms), 4), "mean_ms": round(sum(values_ms) / len(values_ms), 4)}


class Daemon:
    def __init__(self, directory: Path, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "-P", "0", "-p", str(directory),
                                      "--log-level", "info", *args], stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 15
        self.endpoint = None
        while self.endpoint is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("gem-schd exited early")
            if "listening on tcp://" in line:
                self.endpoint = line.split("listening on ")[1].split()[0]
        if self.endpoint is None:
            self.stop()
            raise RuntimeError("gem-schd did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_token_latency(endpoint: str, n: int):
    out = []
    with FakePodManager(endpoint) as p:
        assert isinstance(p.request(Hello("a", pid=os.getpid())), Welcome)
        for i in range(n + 50):
            t0 = time.perf_counter()
            p.send(TokenRequest("a"))
            g = p.recv(5.0)
            t1 = time.perf_counter()
            assert isinstance(g, Grant), g
            p.send(TokenRelease("a", g.token_seq))
            if i >= 50:  # warm-up
                out.append((t1 - t0) * 1000)
    return out


def handoff_lateness(endpoint: str, handoffs: int, quota_ms: float):
    lateness = []
    with FakePodManager(endpoint) as pa, FakePodManager(endpoint) as pb:
        assert isinstance(pa.request(Hello("a", pid=1)), Welcome)
        assert isinstance(pb.request(Hello("b", pid=2)), Welcome)
        holder, waiter = (pa, "a"), (pb, "b")
        holder[0].send(TokenRequest(holder[1]))
        g = holder[0].recv(5.0)
        t_prev = time.perf_counter()
        quota = g.quota_ms
        for i in range(handoffs + 10):
            waiter[0].send(TokenRequest(waiter[1]))
            g = waiter[0].recv(5.0)
            t = time.perf_counter()
            assert isinstance(g, Grant), g
            if i >= 10:
                lateness.append((t - t_prev) * 1000 - quota)
            t_prev, quota = t, g.quota_ms
            holder, waiter = waiter, holder
    return lateness


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=2000, help="free-token requests")
    ap.add_argument("--handoffs", type=int, default=200)
    ap.add_argument("--quota-ms", type=float, default=5.0, help="slot length for the handoff test")
    args = ap.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "resource-config.txt").write_text("[a]\n[b]\n")
        d = Daemon(Path(tmp), "-q", str(args.quota_ms), "-m", str(min(args.quota_ms, 100.0)))
        try:
            result["free_token_rtt"] = summary(free_token_latency(d.endpoint, args.n))
            result["handoff_lateness_precise"] = summary(handoff_lateness(d.endpoint, args.handoffs, args.quota_ms))
        finally:
            d.stop()
    result["note"] = ("rtt: request -> grant with the token free; lateness: grant arrival - (previous grant arrival "
                      "+ quota), client-side, loopback")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
