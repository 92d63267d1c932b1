"""Latency of a batch-1 serving tenant next to a trainer, and what it costs the trainer.

    python bench/bench_inference.py --seconds 15 --repeats 2 \
        --workloads mlp:periodic:50,resnet18:poisson:100 --trainer eager

For each trainer (eager ResNet-18, or an MLP trainer compiled with torch.compile(mode="reduce-overhead")), in
one session:

1. native phase: the trainer alone (its rate); each inference workload alone; then each next to the trainer
   under the driver's time-slicing;
2. gemini phase, gem-schd's DEFAULT flags: the trainer hooked (group `train`, MinUtil 0) alone (its rate), and
   alone again with group `infer` configured `Class = latency` but idle (what the short queue costs it),
   then each inference workload in group `infer` (MinUtil 0.5) with `Class = batch` and with
   `Class = latency`, alternating, the class switched by a live config edit while the trainer runs;
3. with --latency-variants, each variant of the hooks' settings (GEMINI_INFLIGHT_MS, GEMINI_CLAIM_IDLE_MS, ...)
   with a fresh trainer: its rate beside the idle latency group, then each workload served as `Class = latency`;
4. with --idle-then-busy BUSY:IDLE, each workload once more alone, next to the native trainer and as
   `Class = latency` next to the hooked one, its requests arriving for BUSY s and then pausing for IDLE s: the
   requests in the first 0.5 s after each pause (cases `*-itb`, serve.py's `after_idle`) are those of a serving
   group that comes back from idle while the trainer had the GPU to itself.

Every run records the inference p50 / p99 / p99.9 and the trainer's steps/s over the same span (from its
progress lines); with --timeline, also where each request's time went (bench/request_timeline.py: on the host
before it was issued, before its first kernel started on the GPU, between its first and last kernels, after).
Ratios: inference p99 against its best alone p99 (the native one, measured in the same session
after a discarded warm-up run; medians over repeats);
trainer rate against its alone rate in the same phase and against its rate under native time-slicing.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import queue
import subprocess
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import request_timeline  # noqa: E402
from bench.harness import REPO_ROOT, Backend, Group, last_json, read_stats  # noqa: E402

WORKLOADS = REPO_ROOT / "tests" / "gpu" / "workloads"


# What a process start costs a run on the H100 nodes (python, torch, CUDA, the model; gem-schd's too): the calls of
# the seventeenth session took 259, 366 and 177 s where the plan below gives 277, 365 and 187 (and 920 s for the
# call it lost, killed at 590).
START_S = 10.0
WARMUP_S = 3.0      # the discarded first run of each workload


def class_min_util(cls: str, default: float) -> float | None:
    """The serving group's MinUtil in class `cls` (`batch`, `latency`, or `latency@MU`); None if `cls` is none of
    those."""
    name, at, mu = cls.partition("@")
    if not at:
        return default if name in ("batch", "latency") else None
    try:
        value = float(mu)
    except ValueError:
        return None
    return value if name == "latency" and 0 < value <= 1 else None


def planned_seconds(seconds: float, repeats: int, workloads: int, classes: int, variants: int = 0,
                    gemini_only: bool = False, itb_seconds: float = 0.0, alone_seconds: float = 8.0) -> float:
    """About how long a bench_inference run takes, from its arguments: each serving run and each of the trainer's
    alone measurements, plus START_S a process (serving runs, trainers, the backend). gpu-check refuses a plan
    longer than its step's limit before it starts, rather than spend device time on a run it will kill."""
    itb = 1 if itb_seconds > 0 else 0
    serve_runs = repeats * workloads * (classes + variants)          # gemini phase, and each variant's
    serve_s = serve_runs * seconds + workloads * itb * itb_seconds
    alone = 2 + variants                                             # gemini alone, beside the idle latency group
    trainers = 1 + variants
    starts = serve_runs + workloads * itb + trainers + 1             # + the backend
    if not gemini_only:
        native_runs = 2 * repeats * workloads                        # alone, then beside the native trainer
        serve_s += native_runs * seconds + 2 * workloads * itb * itb_seconds + workloads * WARMUP_S
        alone += 1
        trainers += 1
        starts += native_runs + 2 * workloads * itb + workloads + 1
    return serve_s + alone * alone_seconds + starts * START_S


def steps_at(points: list[tuple[float, int]], t: float) -> float | None:
    """A trainer's step count at time t, interpolated between the progress points around it (each point is taken
    at a synchronisation, so its count is work the GPU finished); None outside the points."""
    if not points or t < points[0][0] or t > points[-1][0]:
        return None
    i = bisect.bisect_left(points, (t, float("-inf")))
    if points[i][0] == t:
        return float(points[i][1])
    (ta, sa), (tb, sb) = points[i - 1], points[i]
    return sa + (sb - sa) * (t - ta) / (tb - ta)


def rate_between(points: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Steps per second over exactly [t0, t1], nan where the points do not cover it. Taking the rate between the
    points inside the span instead measured a 1 s window over as little as half a second, and a trainer in 0.7 s
    slots every second read 0.48-1.0 of its rate (tests/test_bench_share.py)."""
    a, b = steps_at(points, t0), steps_at(points, t1)
    if a is None or b is None or t1 <= t0:
        return float("nan")
    return (b - a) / (t1 - t0)


class Trainer:
    """A train_loop.py process whose progress lines are read in the background."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.points: list[tuple[float, int]] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if "t" in obj and "steps" in obj:
                self.points.append((obj["t"], obj["steps"]))

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until it reports progress (imports, warm-up and compilation are behind it)."""
        deadline = time.monotonic() + timeout
        while len(self.points) < 3:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("trainer did not start within the timeout")
            time.sleep(0.2)

    def wait_past(self, t: float, wait_s: float = 10.0) -> None:
        """Until it has a progress point at or after `t` (its next synchronisation after a span that ends now), it
        has exited, or `wait_s` passed. A bench that stops it must wait first, or the span's end is not covered."""
        deadline = time.monotonic() + wait_s
        while (not self.points or self.points[-1][0] < t) and self.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    def rate(self, t0: float, t1: float) -> float:
        """Steps per second over exactly [t0, t1] (CLOCK_MONOTONIC), from its progress points (rate_between)."""
        self.wait_past(t1)
        return rate_between(list(self.points), t0, t1)

    def measure_alone(self, seconds: float) -> float:
        t0 = time.monotonic()
        time.sleep(seconds)
        return self.rate(t0, time.monotonic())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        # every line it printed is in self.points (bounded: a child it left behind, e.g. torch.compile's workers,
        # may hold its stdout open)
        self._reader.join(2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15, help="length of each inference run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workloads", default="mlp:periodic:50,resnet18:poisson:100",
                   help="MODEL:ARRIVAL:RATE,... (serve.py)")
    p.add_argument("--trainer", default="eager", choices=["eager", "graph"])
    p.add_argument("--min-util", type=float, default=0.5)
    p.add_argument("--alone-seconds", type=float, default=8, help="the trainer's rate alone is measured this long")
    p.add_argument("--gemini-only", action="store_true", help="skip the native phase")
    p.add_argument("--idle-then-busy", default="", metavar="BUSY:IDLE",
                   help="also serve each workload with pauses: BUSY s of requests, IDLE s of none (e.g. 2:3)")
    p.add_argument("--idle-then-busy-seconds", type=float, default=30,
                   help="length of each --idle-then-busy run (pauses included)")
    p.add_argument("--latency-variants", default="",
                   help="NAME:VAR=V,VAR=V;... after the gemini phase, for each: a fresh trainer and server with these "
                        "GEMINI_* settings in their environment, `Class = latency` (e.g. "
                        "'inflight2:GEMINI_INFLIGHT_MS=2;idle025:GEMINI_CLAIM_IDLE_MS=0.25')")
    p.add_argument("--classes", default="batch,latency",
                   help="the gemini phase's classes for the serving group (`latency` alone saves a quarter of a run "
                        "whose batch-class p99, the trainer's slot, is known); `latency@MU` serves as a latency group "
                        "with MinUtil MU, its claim budget, instead of --min-util: what a smaller budget trades of "
                        "the server's p99 for the trainer's steps, in the same interleaved repeats")
    p.add_argument("--timeline", action="store_true",
                   help="time each request's parts on the GPU too (serve.py --timeline; two stamp kernels a request)")
    p.add_argument("--timeline-dir", default="", help="with --timeline, keep each run's request lines here too")
    args = p.parse_args(argv)
    workloads = [tuple(w.split(":")) for w in args.workloads.split(",") if w]
    classes = [c for c in args.classes.split(",") if c]
    if not classes or any(class_min_util(c, args.min_util) is None for c in classes):
        p.error(f"--classes {args.classes!r}: a comma-separated list of batch, latency and latency@MU "
                f"(MU a MinUtil above 0 and at most 1)")
    # --latency-variants, parsed once: {name: the GEMINI_* settings it adds}
    variants: dict[str, dict[str, str]] = {}
    for spec in (v.strip() for v in args.latency_variants.split(";")):
        if spec:
            name, _, assigns = spec.partition(":")
            variants[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
    env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="bench-infer-"))
    train_argv = [sys.executable, str(WORKLOADS / "train_loop.py"), args.trainer, "100000"]
    out: dict = {"seconds": args.seconds, "repeats": args.repeats, "trainer": args.trainer,
                 "min_util": args.min_util, "runs": []}

    gaps = ["--idle-gaps", args.idle_then_busy] if args.idle_then_busy else []
    itb_seconds = args.idle_then_busy_seconds

    timelines = iter(work / f"timeline-{n}.txt" for n in range(1 << 30))

    def timeline_args() -> list[str]:
        return ["--timeline", str(next(timelines))] if args.timeline else []

    def serve(model, arrival, rate, run_env, seconds=None, extra=()):
        argv = [sys.executable, str(WORKLOADS / "serve.py"), model, arrival, rate, str(seconds or args.seconds),
                *extra, *timeline_args()]
        proc = subprocess.run(argv, env=run_env, capture_output=True, text=True,
                              timeout=(seconds or args.seconds) + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stderr[-2000:]}")
        return last_json(proc.stdout)

    def serve_in(be, w, run_env, extra=(), seconds=None):
        """The inference workload in group `infer`, through launch-command."""
        model, arrival, rate = w
        argv = be.command("infer", [sys.executable, str(WORKLOADS / "serve.py"), model, arrival, rate,
                                    str(seconds or args.seconds), *extra, *timeline_args()])
        proc = subprocess.run(argv, env=run_env, capture_output=True, text=True,
                              timeout=(seconds or args.seconds) + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stderr[-2000:]}")
        return last_json(proc.stdout)

    def record(case, w, res, trainer=None):
        row = {"case": case, "workload": ":".join(w), **{k: res[k] for k in ("p50_ms", "p99_ms", "p999_ms",
                                                                             "mean_ms", "requests", "late")}}
        if "after_idle" in res:
            row["after_idle"] = res["after_idle"]
        if args.timeline:
            times = request_timeline.read(res["timeline_file"])
            row["timeline"] = request_timeline.summarise(times)
            row["timeline"]["slowest"] = request_timeline.slowest(times, 10)
            if args.timeline_dir:
                Path(args.timeline_dir).mkdir(parents=True, exist_ok=True)
                name = "".join(c if c.isalnum() or c in "-." else "_"
                               for c in f"{len(out['runs']):02d}-{case}-{':'.join(w)}.txt")
                (Path(args.timeline_dir) / name).write_text("".join(t.line() + "\n" for t in times))
        if trainer is not None:
            row["train_steps_per_s"] = trainer.rate(res["t0"], res["t1"])
        if "pid" in res:    # its hook's counters, read at the end (a hooked server's: gemini's cases)
            row["server_pid"], row["span_s"] = res["pid"], res["t1"] - res["t0"]
        out["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    if not args.gemini_only:
        for w in workloads:
            serve(*w, env, seconds=3)     # discarded: the first process after an idle GPU pays its warm-up
        for _ in range(args.repeats):
            for w in workloads:
                record("alone", w, serve(*w, env))
        for w in workloads if gaps else ():
            record("alone-itb", w, serve(*w, env, seconds=itb_seconds, extra=gaps))
        trainer = Trainer(train_argv, env)
        try:
            trainer.wait_ready()
            out["train_alone_native"] = trainer.measure_alone(args.alone_seconds)
            for _ in range(args.repeats):
                for w in workloads:
                    record("native", w, serve(*w, env), trainer)
            for w in workloads if gaps else ():
                record("native-itb", w, serve(*w, env, seconds=itb_seconds, extra=gaps), trainer)
        finally:
            trainer.stop()

    config = work / "resource-config.txt"

    def write_config(cls: str) -> None:
        """The serving group as `cls`: batch, latency, or latency@MU (MinUtil MU instead of --min-util)."""
        tmp = config.with_suffix(".tmp")
        tmp.write_text(f"[infer]\nMinUtil = {class_min_util(cls, args.min_util)}\nMemoryLimit = 40GiB\n"
                       f"Class = {cls.partition('@')[0]}\n[train]\nMinUtil = 0\nMemoryLimit = 40GiB\n")
        os.replace(tmp, config)

    write_config("batch")
    stats_file = work / "stats"
    # gem-schd's default flags: no -q/-m/-w given
    be = Backend(work / "backend", [Group("infer"), Group("train")], config=config, env=env, quota_ms=None,
                 min_quota_ms=None, window_ms=None)
    with be:
        henv = dict(env, GEMINI_STATS_FILE=str(stats_file))
        trainer = Trainer(be.command("train", train_argv), henv)
        try:
            trainer.wait_ready()
            out["train_alone_gemini"] = trainer.measure_alone(args.alone_seconds)
            # The same with the inference group latency class but idle: what the short queue alone costs the
            # trainer (GEM_GRANT_TIGHT is on whenever a latency group is configured), apart from the claims.
            write_config("latency")
            time.sleep(0.5)
            out["train_latency_idle_gemini"] = trainer.measure_alone(args.alone_seconds)
            for _ in range(args.repeats):
                for w in workloads:
                    for cls in classes:
                        write_config(cls)
                        time.sleep(0.5)       # the edit is in force (gem-schd reloads within ~10 ms)
                        record(f"gemini-{cls}", w, serve_in(be, w, henv), trainer)
            if gaps:
                write_config("latency")
                time.sleep(0.5)
                for w in workloads:
                    record("gemini-latency-itb", w, serve_in(be, w, henv, extra=gaps, seconds=itb_seconds), trainer)
        except Exception as exc:
            raise RuntimeError(f"{exc}\nbackend logs:\n{be.logs()}") from exc
        finally:
            trainer.stop()
        # Variants of the latency class's hook settings, each with a trainer of its own (its settings are read at
        # start): its rate with the latency group idle, then each workload served beside it.
        write_config("latency")
        for name, settings in variants.items():
            venv = dict(henv, **settings)
            trainer = Trainer(be.command("train", train_argv), venv)
            try:
                trainer.wait_ready()
                out.setdefault("train_latency_idle_variants", {})[name] = trainer.measure_alone(args.alone_seconds)
                for _ in range(args.repeats):
                    for w in workloads:
                        record(f"gemini-latency[{name}]", w, serve_in(be, w, venv), trainer)
            except Exception as exc:
                raise RuntimeError(f"variant {name}: {exc}\nbackend logs:\n{be.logs()}") from exc
            finally:
                trainer.stop()
    out["hook_stats"] = {str(k): v for k, v in read_stats(stats_file).items()}
    for row in out["runs"]:
        # What the server's slots or claims held of the GPU over its run, as its hook measured them (from each
        # slot's first kernel to its drain, idle gaps after a synchronisation taken off): what the trainer could not
        # have, set beside what the trainer lost
        used = out["hook_stats"].get(str(row.pop("server_pid", None)), {}).get("used_ms")
        span = row.pop("span_s", None)
        if used is not None and span:
            row["server_used_share"] = used / 1000.0 / span
    # summaries: medians over repeats; ratios against the best alone p99 (an idle GPU's clocks make single alone
    # runs slow at times, and the best one is the strictest yardstick)
    summary: dict = {}
    for w in workloads:
        key = ":".join(w)
        alone_rows = [r for r in out["runs"] if r["workload"] == key and r["case"] == "alone"]
        base = min(r["p99_ms"] for r in alone_rows) if alone_rows else None
        base999 = min(r["p999_ms"] for r in alone_rows) if alone_rows else None   # p99.9 against p99.9
        variant_cases = {f"gemini-latency[{name}]": name for name in variants}
        itb_alone = next((r["after_idle"] for r in out["runs"]
                          if r["workload"] == key and r["case"] == "alone-itb" and r["after_idle"].get("requests")),
                         None)
        budgets = [f"gemini-{c}" for c in classes if "@" in c]     # the latency class at other claim budgets
        for case in ("alone", "native", "gemini-batch", "gemini-latency", *budgets, *variant_cases,
                     "alone-itb", "native-itb", "gemini-latency-itb"):
            rows = [r for r in out["runs"] if r["workload"] == key and r["case"] == case]
            if not rows:
                continue
            med = lambda k, rows=rows: statistics.median(r[k] for r in rows)  # noqa: E731
            s = {"p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"), "p999_ms": med("p999_ms"),
                 "worst_p99_ms": max(r["p99_ms"] for r in rows), "alone_best_p99_ms": base}
            if base:
                s["p99_vs_alone"] = s["p99_ms"] / base
                s["p999_vs_alone"] = s["p999_ms"] / base999
                s["worst_p99_vs_alone"] = s["worst_p99_ms"] / base
            timed = [r["timeline"] for r in rows if r.get("timeline", {}).get("requests")]
            if timed:   # the first repeat's: where the slowest 1% of its requests spent their time
                s["timeline"] = timed[0]
                s["timeline_tail"] = timed[0]["tail"]
            after = [r["after_idle"] for r in rows if r.get("after_idle", {}).get("requests")]
            if after:
                # the requests just after each pause, against the same requests served alone and against the
                # steady alone p99
                s["after_idle"] = after[0]
                if base:
                    s["after_idle_p99_vs_alone"] = after[0]["p99_ms"] / base
                if itb_alone:
                    s["after_idle_p99_vs_alone_itb"] = after[0]["p99_ms"] / itb_alone["p99_ms"]
            held = [r["server_used_share"] for r in rows if "server_used_share" in r]
            if held:
                s["server_used_share"] = statistics.median(held)
            if case not in ("alone", "alone-itb"):
                s["train_steps_per_s"] = med("train_steps_per_s")
                alone_rate = out.get("train_alone_native" if case.startswith("native") else "train_alone_gemini")
                if case in variant_cases:   # against the trainer hooked alone (batch config, default settings)
                    s["train_latency_idle"] = out["train_latency_idle_variants"][variant_cases[case]]
                if alone_rate:
                    s["train_vs_alone"] = s["train_steps_per_s"] / alone_rate
            summary[f"{key} {case}"] = s
    native_rates = {k.split(" ")[0]: v.get("train_steps_per_s") for k, v in summary.items() if k.endswith(" native")}
    itb_native_rates = {k.split(" ")[0]: v.get("train_steps_per_s") for k, v in summary.items()
                        if k.endswith(" native-itb")}
    for k, v in summary.items():
        w = k.split(" ")[0]
        rates = itb_native_rates if k.endswith("-itb") else native_rates
        if "gemini" in k and rates.get(w):
            v["train_vs_native"] = v["train_steps_per_s"] / rates[w]
    out["summary"] = summary
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
