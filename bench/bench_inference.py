"""Latency of a batch-1 inference tenant with a guaranteed share while another tenant trains.

    python bench/bench_inference.py --seconds 15 --period-ms 20 --quota 10

Runs, in the same session: inference alone (native), inference alone under gemini, inference next to a
ResNet-18 training tenant with the driver's time-slicing, and the same under gemini with the inference
group at MinUtil 0.5 (training MinUtil 0). Prints one JSON object with p50/p99 of each and the p99
inflation against inference alone.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO_ROOT, Backend, Group, last_json, read_stats  # noqa: E402

WORKLOADS = REPO_ROOT / "tests" / "gpu" / "workloads"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--period-ms", type=float, default=20)
    p.add_argument("--quota", type=float, default=10, help="gem-schd base quota (ms)")
    p.add_argument("--min-quota", type=float, default=2)
    p.add_argument("--window", type=float, default=2000)
    p.add_argument("--min-util", type=float, default=0.5)
    args = p.parse_args(argv)
    infer = [sys.executable, str(WORKLOADS / "infer_latency.py"), str(args.seconds), str(args.period_ms)]
    train = [sys.executable, str(WORKLOADS / "resnet_train.py"), str(args.seconds + 25), "64"]
    work = Path(tempfile.mkdtemp(prefix="bench-infer-"))
    env = dict(os.environ)
    results: dict = {"seconds": args.seconds, "period_ms": args.period_ms, "quota_ms": args.quota,
                     "min_util": args.min_util}

    def run(cmd):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.seconds + 240)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        return last_json(proc.stdout)

    def with_trainer(train_cmd, infer_cmd, henv=None):
        trainer = subprocess.Popen(train_cmd, env=henv or env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        time.sleep(20)  # the trainer is past start-up (imports, cudnn autotuning) and busy
        try:
            proc = subprocess.run(infer_cmd, env=henv or env, capture_output=True, text=True,
                                  timeout=args.seconds + 240)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-2000:])
            return last_json(proc.stdout)
        finally:
            trainer.terminate()
            trainer.wait(30)

    results["alone_native"] = run(infer)
    results["with_train_native"] = with_trainer(train, infer)
    groups = [Group("infer", args.min_util, 1.0, "40GiB"), Group("train", 0.0, 1.0, "40GiB")]
    stats_file = work / "stats"
    with Backend(work / "backend", groups, quota_ms=args.quota, min_quota_ms=args.min_quota,
                 window_ms=args.window, env=env) as be:
        henv = dict(env, GEMINI_STATS_FILE=str(stats_file))
        try:
            results["alone_gemini"] = run(be.command("infer", infer))
            results["with_train_gemini"] = with_trainer(be.command("train", train), be.command("infer", infer),
                                                        henv)
        except Exception as exc:
            raise RuntimeError(f"{exc}\nbackend ports {be.ports}; logs:\n{be.logs()}") from exc
    base = results["alone_native"]["p99_ms"]
    for key in ("alone_gemini", "with_train_native", "with_train_gemini"):
        results[key]["p99_inflation"] = results[key]["p99_ms"] / base
    results["hook_stats"] = {str(k): v for k, v in read_stats(stats_file).items()}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
