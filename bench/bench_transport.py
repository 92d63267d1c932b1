#!/usr/bin/env python3
"""What the transport costs: token grants end to end over TCP and over Unix sockets (launch-backend --ipc-dir).

1. protocol (no GPU needed): a client speaking the hook's protocol asks its pod manager for the token, which
   asks gem-schd, and gives it back at once (so the next request goes all the way up again): the round trip
   hook -> gem-pmgr -> gem-schd -> gem-pmgr -> hook, p50/p99 over N requests, on each transport.
2. --cuda (a GPU, or the simulated driver): a hooked CUDA program runs bursts of kernels with host sleeps
   between them longer than the idle release (5 ms), so each burst's first launch waits for a fresh grant;
   the hook's own counters give the mean wait per grant (wait_ms / waits).

    python bench/bench_transport.py -n 2000                  # protocol only
    python bench/bench_transport.py -n 2000 --cuda --seconds 10

Prints one JSON object: per transport, the protocol round trip and (with --cuda) the hook's mean grant wait;
and the difference ipc - tcp of each.
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

from bench.harness import TRANSPORTS, Backend, Group, last_json, percentile, read_stats  # noqa: E402
from gemini.wire import hook as hp  # noqa: E402
from tests.pmgr_helpers import BlockingHook  # noqa: E402



def summary_ms(values):
    return {"n": len(values), "p50_ms": round(percentile(values, 0.5), 4), "p99_ms": round(percentile(values, 0.99), 4),
            "mean_ms": round(sum(values) / len(values), 4)}


def protocol_round_trips(be: Backend, n: int, warmup: int = 100) -> list[float]:
    hook = BlockingHook(be.ports["solo"])
    out = []
    try:
        ack = hook.call(hp.Hello(pid=os.getpid(), pod_name="solo"))
        assert isinstance(ack, hp.HelloAck), ack
        for i in range(n + warmup):
            t0 = time.perf_counter()
            grant = hook.call(hp.TokenRequest())
            t1 = time.perf_counter()
            assert isinstance(grant, hp.TokenGrant), grant
            assert isinstance(hook.call(hp.TokenRelease(token_seq=grant.token_seq)), hp.Ack)
            if i >= warmup:
                out.append((t1 - t0) * 1000)
            time.sleep(0.0005)      # the pod manager hands the slot back before the next request
    finally:
        hook.close()
    return out


def cuda_grant_wait(be: Backend, work: Path, seconds: float) -> dict:
    from gemini.hookpath import hook_path
    from tests.e2e_fixtures import CLIENTS_DIR, E2E_CLIENT
    script = work / "e2e_client.py"
    script.write_text(E2E_CLIENT)
    stats = work / f"stats-{be.transport}"
    stats.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMINI_") and k not in ("LD_PRELOAD",)}
    env.update(be.hook_env("solo"), LD_PRELOAD=str(hook_path()), GEMINI_STATS_FILE=str(stats),
               E2E_CLIENTS_DIR=str(CLIENTS_DIR), PYTHONPATH=str(REPO))
    # bursts of 4 kernels of 500 us, then 20 ms on the host: the token goes back after 5 ms idle every time
    res = subprocess.run([sys.executable, str(script), "idle", str(seconds), "4", "500", "20"], env=env,
                         capture_output=True, text=True, timeout=seconds + 120)
    if res.returncode != 0:
        raise RuntimeError(f"the CUDA client failed: {res.stderr[-2000:]}")
    counters = next(iter(read_stats(stats).values()))
    waits = counters.get("waits", 0)
    return {"bursts": last_json(res.stdout)["bursts"], "grants": counters.get("grants"), "waits": waits,
            "early_releases": counters.get("early_releases"),
            "mean_wait_ms": round(counters["wait_ms"] / waits, 4) if waits else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=2000, help="token round trips per transport")
    p.add_argument("--cuda", action="store_true", help="also run a hooked CUDA program (GPU or simulator)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the CUDA run per transport")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    report: dict = {"n": args.n}
    for t in args.transports.split(","):
        with Backend(work / t, [Group("solo", 0.0, 1.0, "8GiB")], quota_ms=50, min_quota_ms=5, window_ms=10000,
                     transport=t) as be:
            entry = {"protocol": summary_ms(protocol_round_trips(be, args.n))}
            if args.cuda:
                entry["cuda"] = cuda_grant_wait(be, work, args.seconds)
            report[t] = entry
    if "tcp" in report and "ipc" in report:
        ipc, tcp = report["ipc"]["protocol"], report["tcp"]["protocol"]
        report["ipc_minus_tcp_p50_ms"] = round(ipc["p50_ms"] - tcp["p50_ms"], 4)
        if args.cuda and report["ipc"]["cuda"]["mean_wait_ms"] and report["tcp"]["cuda"]["mean_wait_ms"]:
            report["ipc_minus_tcp_cuda_wait_ms"] = round(report["ipc"]["cuda"]["mean_wait_ms"]
                                                         - report["tcp"]["cuda"]["mean_wait_ms"], 4)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
