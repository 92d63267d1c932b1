"""ProcessSharing = turns against together for a group of several inference processes next to a trainer.

    python bench/bench_sharing.py --procs 4 --seconds 10 --repeats 2 --workload mlp:periodic:50

Issue 14 asks which ProcessSharing default suits v2 groups. In one session, with gem-schd's DEFAULT flags:

1. native: one inference process alone (the yardstick: its p99), then `--procs` of them at once, alone, and
   next to the trainer under the driver's time-slicing;
2. gemini, once per `--classes` entry (a fresh backend each): the trainer in group `train` (MinUtil 0);
   `--procs` inference processes at once in group `infer-turns` (ProcessSharing = turns) or `infer-together`
   (together), both MinUtil --min-util and that Class, alternating run by run. Both groups are in the config all
   along; the idle one holds nothing.

Every run records each process's p50 / p99 and the trainer's steps/s over the same span. Summaries: the median
over repeats of the worst process's p99, against the one-process alone p99, and the trainer's rate against its
alone rate. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_inference import WORKLOADS, Trainer  # noqa: E402
from bench.harness import Backend, Group, last_json  # noqa: E402


def run_all(argvs: list[list[str]], env: dict, timeout: float) -> list[dict]:
    """Start every argv at once and wait for all; each prints serve.py's JSON."""
    procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"serve exited {p.returncode}: {se[-2000:]}")
        out.append(last_json(so))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workload", default="mlp:periodic:50", help="MODEL:ARRIVAL:RATE (serve.py), per process")
    p.add_argument("--trainer", default="eager", choices=["eager", "graph"])
    p.add_argument("--min-util", type=float, default=0.5)
    p.add_argument("--alone-seconds", type=float, default=6)
    p.add_argument("--classes", default="batch,latency", help="the inference groups' Class, one backend each")
    args = p.parse_args(argv)
    model, arrival, rate = args.workload.split(":")
    env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    serve = [sys.executable, str(WORKLOADS / "serve.py"), model, arrival, rate, str(args.seconds)]
    train_argv = [sys.executable, str(WORKLOADS / "train_loop.py"), args.trainer, "100000"]
    out: dict = {"procs": args.procs, "seconds": args.seconds, "repeats": args.repeats, "workload": args.workload,
                 "trainer": args.trainer, "min_util": args.min_util, "runs": []}
    timeout = args.seconds + 300

    def record(case: str, results: list[dict], trainer: Trainer | None = None) -> None:
        row = {"case": case, "p99_ms": [r["p99_ms"] for r in results], "p50_ms": [r["p50_ms"] for r in results],
               "worst_p99_ms": max(r["p99_ms"] for r in results), "requests": sum(r["requests"] for r in results)}
        if trainer is not None:
            row["train_steps_per_s"] = trainer.rate(max(r["t0"] for r in results), min(r["t1"] for r in results))
        out["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    run_all([serve[:-1] + ["3"]], env, timeout)         # discarded warm-up
    for _ in range(args.repeats):
        record("alone-1", run_all([serve], env, timeout))
        record("alone-n", run_all([serve] * args.procs, env, timeout))
    trainer = Trainer(train_argv, env)
    try:
        trainer.wait_ready()
        out["train_alone_native"] = trainer.measure_alone(args.alone_seconds)
        for _ in range(args.repeats):
            record("native", run_all([serve] * args.procs, env, timeout), trainer)
    finally:
        trainer.stop()

    for cls in args.classes.split(","):
        groups = [Group("train", 0.0, 1.0, "40GiB"),
                  Group("infer-turns", args.min_util, 1.0, "40GiB", turns=True, sched_class=cls),
                  Group("infer-together", args.min_util, 1.0, "40GiB", turns=False, sched_class=cls)]
        # gem-schd's default flags: no -q/-m/-w given; one backend per class (a latency group in the config
        # changes how every batch group's grants are bounded)
        with Backend(work / f"backend-{cls}", groups, env=env, quota_ms=None, min_quota_ms=None,
                     window_ms=None) as be:
            trainer = Trainer(be.command("train", train_argv), env)
            try:
                trainer.wait_ready()
                out[f"train_alone_gemini_{cls}"] = trainer.measure_alone(args.alone_seconds)
                for _ in range(args.repeats):
                    for sharing in ("turns", "together"):
                        results = run_all([be.command(f"infer-{sharing}", serve)] * args.procs, env, timeout)
                        record(f"gemini-{cls}-{sharing}", results, trainer)
                        time.sleep(0.5)
            except Exception as exc:
                raise RuntimeError(f"{exc}\nbackend logs:\n{be.logs()}") from exc
            finally:
                trainer.stop()

    base = min(r["worst_p99_ms"] for r in out["runs"] if r["case"] == "alone-1")
    summary: dict = {"alone_1_p99_ms": base}
    for case in ["alone-n", "native"] + [f"gemini-{c}-{t}" for c in args.classes.split(",")
                                         for t in ("turns", "together")]:
        rows = [r for r in out["runs"] if r["case"] == case]
        s = {"worst_p99_ms": statistics.median(r["worst_p99_ms"] for r in rows),
             "median_p99_ms": statistics.median(statistics.median(r["p99_ms"]) for r in rows)}
        s["worst_p99_vs_alone"] = s["worst_p99_ms"] / base
        if case != "alone-n":
            s["train_steps_per_s"] = statistics.median(r["train_steps_per_s"] for r in rows)
            alone = out["train_alone_native" if case == "native" else f"train_alone_gemini_{case.split('-')[1]}"]
            s["train_vs_alone"] = s["train_steps_per_s"] / alone
        summary[case] = s
    out["summary"] = summary
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
