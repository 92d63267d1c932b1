"""`make gpu-check`: everything that needs a real GPU, in one command, with a report.

    python bench/gpu_check.py --out $OUT [--quick] [--steps probe,tests,launch,share,train]

Steps (each runs even if an earlier one failed; each result lands in results.json):
  env      the device, driver and framework versions
  build    libgemhook, the spin workload and the launch-cost program
  probe    the driver's cuGetProcAddress returns the pointers dlsym gives (the hook routes by pointer)
  tests    pytest -m gpu (tests/gpu): frameworks under the hook, gating, static cudart, -lcuda
  launch   host cost per launch: native, hooked and hooked beside an idle latency group, interleaved; and
           inside each process, the hook's cuLaunchKernel against the driver's own in alternate batches
  markers  the GPU time an in-flight marker's operations add (the gate's wait, a timed event; marker_cost.c)
  alloc    cuMemAlloc/cuMemFree latency through the pod manager, native vs hooked
  share    always-busy spin tenants: native time-slicing, then gemini with MaxUtil 0.3 / 0.6
  reaction how fast a config edit shows on the GPU
  infer    inference latency alone, natively next to a trainer, and under gemini as a batch and as a
           latency group (bench_inference.py; eager trainer; `infer_graph`: a CUDA-graph trainer); refused at once
           when its plan (bench_inference.planned_seconds) passes the step's 590 s
  kernels  how long the benchmark trainers' kernels run (bench/trainer_kernels.py): what a request waits for at best
  sharing  4 inference processes of one group next to a trainer: ProcessSharing turns against together
  floor    MinUtil 0.7 vs 0 with two busy PyTorch trainers (bench_trainers.py)
  trainers MaxUtil 0.3 / 0.6 with two busy PyTorch trainers (bench_trainers.py)
  soak     8 processes in 4 groups for 2 minutes, ProcessSharing = turns and together
  policy_cost  CPU per scheduling decision at 2/16/64/256 groups on one pinned core (no GPU used), the default mix
           of groups and every group capped (under `capped`); and gem-schd itself against fake pod managers
           (bench_schd_ceiling.py, under `schd`): its CPU from a deadline to the grant sent, slots/s at most, and
           the machine's cost of one bare zmq send
  train    ResNet-18 single-tenant overhead, native vs hooked, interleaved
  um       unified groups: 3 PyTorch jobs of ~10 GiB against gemini's 24 GiB capacity, sequential vs swapped
           by gem-schd (bench_um.py; aborts unless their managed memory stays below 80% of the free memory)

Writes OUT/report.md (human), OUT/results.json (everything), OUT/gpu-tests.log.
No network is needed; Python packages missing on the node are installed from wheels beforehand
(see docs/gpu-node.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_inference import planned_seconds  # noqa: E402

ALL_STEPS = ["env", "build", "probe", "tests", "launch", "markers", "alloc", "share", "transport", "reaction",
             "infer", "infer_graph", "kernels", "sharing", "floor", "trainers", "soak", "policy_cost", "train", "um"]


def sh(cmd: list | str, timeout: float, cwd: Path = REPO, env: dict | None = None, log: Path | None = None) -> str:
    argv = cmd if isinstance(cmd, list) else shlex.split(cmd)
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, argv))}\n{text}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{text[-3000:]}")
    return proc.stdout


def header() -> dict:
    """When and on what GPU: the report's title, also for a call whose steps leave `env` out."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        info["gpu"] = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         30).strip()
    except Exception as exc:  # noqa: BLE001 -- recorded, not fatal
        info["gpu"] = f"nvidia-smi failed: {exc}"
    return info


def step_env(ctx) -> dict:
    info = {"host": platform.node(), "python": sys.version.split()[0], **header()}
    for mod in ("torch", "cupy", "jax", "numba", "triton", "zmq", "cffi", "watchdog"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"missing ({type(exc).__name__})"
    try:
        info["cuda_runtime"] = sh([sys.executable, "-c", "import torch; print(torch.version.cuda)"], 60).strip()
    except Exception:  # noqa: BLE001
        pass
    return info


def step_build(ctx) -> dict:
    sh(["make", "-s", "hook", "bench-native"], 300, log=ctx.log)
    sh(["make", "-s", "-f", "tests/simcuda/sim.mk", "clients"], 300, log=ctx.log)
    probe = REPO / "build" / "bench" / "probe_procaddr"
    sh(["cc", "-O2", "-o", probe, "tests/gpu/probe_procaddr.c", "-ldl"], 120, log=ctx.log)
    return {"hook": str(REPO / "gemini" / "lib" / "libgemhook.so.1")}


def step_probe(ctx) -> dict:
    proc = subprocess.run([str(REPO / "build" / "bench" / "probe_procaddr")], capture_output=True, text=True,
                          timeout=60)
    lines = proc.stdout.splitlines()
    (ctx.out / "probe.txt").write_text(proc.stdout + proc.stderr)
    diffs = [ln for ln in lines if ln.startswith("DIFF")]
    return {"ok": proc.returncode == 0, "checks": len([ln for ln in lines if ln[:4] in ("ok  ", "DIFF")]),
            "mismatches": diffs, "driver": lines[0] if lines else ""}


def step_tests(ctx) -> dict:
    report = ctx.out / "gpu-tests.jsonl"
    report.unlink(missing_ok=True)
    env = dict(os.environ, GEMINI_GPU_REPORT=str(report))
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rA", "-q", "tests/gpu",
            "--timeout", "900"]
    if ctx.args.k:
        argv += ["-k", ctx.args.k]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.args.tests_timeout)
    (ctx.out / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    rows = [json.loads(ln) for ln in report.read_text().splitlines()] if report.exists() else []
    return {"ok": proc.returncode == 0, "summary": summary, "rows": rows}


def bench(ctx, argv: list, timeout: float) -> dict:
    out = sh([sys.executable, *argv], timeout, log=ctx.log)
    return json.loads(out)


def step_launch(ctx) -> dict:
    # native, hooked, and hooked beside an idle latency group (the in-flight bound on), paired in each round
    return bench(ctx, ["bench/bench_overhead.py", "launch", "--rounds", "5" if ctx.args.quick else "11"], 300)


def step_alloc(ctx) -> dict:
    return bench(ctx, ["bench/bench_overhead.py", "alloc", "--rounds", "3"], 300)


WORK = ["--work-iters", "30000", "--blocks", "1056"]  # compute-bound, 8 blocks of 256 threads per SM
SHARE_RUNS = [
    # (name, arguments, plot title or None). Spin kernels measure on-chip time; the -work runs use
    # compute-bound kernels measured by throughput, the only fair yardstick for MPS.
    ("native-1", ["--mode", "native", "--tenants", "1"], None),
    # one hooked tenant alone, uncapped (no in-flight bound) and capped just below 1 (the bound on): what the hook
    # adds to a tenant's own gaps between kernels, against native-1
    ("gemini-1", ["--mode", "gemini", "--caps", "1.0"], None),
    ("gemini-1-bound", ["--mode", "gemini", "--caps", "0.999"], None),
    ("native-2", ["--mode", "native", "--tenants", "2"], "native time-slicing, 2 tenants"),
    ("native-3", ["--mode", "native", "--tenants", "3"], None),
    ("gemini-0.3-0.6", ["--mode", "gemini", "--caps", "0.3,0.6"], "gemini, MaxUtil 0.3 / 0.6"),
    # the caps' mechanism named: budgets per 100 ms frame (the default) against continuous token buckets (--frame 0)
    ("gemini-0.3-0.6-frame100", ["--mode", "gemini", "--caps", "0.3,0.6", "--schd-arg=--frame=100"], None),
    ("gemini-0.3-0.6-frame0", ["--mode", "gemini", "--caps", "0.3,0.6", "--schd-arg=--frame=0"], None),
    ("gemini-0.3-0.6-q20", ["--mode", "gemini", "--caps", "0.3,0.6", "--quota", "20"], None),
    ("gemini-0.3-0.6-ipc", ["--mode", "gemini", "--caps", "0.3,0.6", "--transport", "ipc"], None),  # Unix sockets
    # a capped group whose program queues 800 kernels of 1 ms between synchronisations, beside a busy one
    ("gemini-deep-0.05", ["--mode", "gemini", "--caps", "0.05,1.0", "--sync-every", "800"], None),
    ("gemini-deep-0.05-frame0", ["--mode", "gemini", "--caps", "0.05,1.0", "--sync-every", "800",
                                 "--schd-arg=--frame=0"], None),
    # deep queues whose caps add up to 1: they take turns (a fixed order), by virtual time with --no-frame-turns
    ("gemini-deep-0.3-0.7", ["--mode", "gemini", "--caps", "0.3,0.7", "--sync-every", "800"], None),
    ("gemini-deep-0.3-0.7-vtime", ["--mode", "gemini", "--caps", "0.3,0.7", "--sync-every", "800",
                                   "--schd-arg=--no-frame-turns"], None),
    ("gemini-deep-0.1", ["--mode", "gemini", "--caps", "0.1,1.0", "--sync-every", "800"], None),
    ("gemini-deep-0.1-mfq10", ["--mode", "gemini", "--caps", "0.1,1.0", "--sync-every", "800",
                               "--schd-arg=--min-frame-quota=10"], None),
    ("gemini-0.4-0.6", ["--mode", "gemini", "--caps", "0.4,0.6"], None),
    # the floor of issue 13 (MinUtil 0.7 beside 0, both uncapped) on spin tenants: its windows on-chip, which the
    # trainers' progress can resolve only to a few points (bench_trainers.py)
    ("gemini-floor-0.7", ["--mode", "gemini", "--caps", "1.0,1.0", "--mins", "0.7,0"], None),
    ("gemini-floor-0.7-cycle100", ["--mode", "gemini", "--caps", "1.0,1.0", "--mins", "0.7,0",
                                   "--schd-arg=--fair-cycle=100"], None),
    ("gemini-3", ["--mode", "gemini", "--caps", "0.2,0.3,0.5"], "gemini, MaxUtil 0.2 / 0.3 / 0.5"),
    # framed caps that the others' shares hold below them, by less than half: a third each (the thirty-third
    # session's _overflow_walk and _yields; in the model 0.209 / 0.289 / 0.499 and 0.239 / 0.339 / 0.419 before)
    ("gemini-below-0.4-0.5-1", ["--mode", "gemini", "--caps", "0.4,0.5,1.0"], None),
    ("gemini-below-0.4-0.6-0.8", ["--mode", "gemini", "--caps", "0.4,0.6,0.8"], None),
    ("gemini-3-frame100", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--schd-arg=--frame=100"], None),
    ("gemini-3-frame0", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--schd-arg=--frame=0"], None),
    ("gemini-0.4-0.6-frame100", ["--mode", "gemini", "--caps", "0.4,0.6", "--schd-arg=--frame=100"], None),
    ("gemini-0.4-0.6-frame0", ["--mode", "gemini", "--caps", "0.4,0.6", "--schd-arg=--frame=0"], None),
    # gem-schd --no-frame-turns: framed groups at their caps ordered by virtual time (before the twenty-first session)
    ("gemini-3-vtime", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--schd-arg=--no-frame-turns"], None),
    ("gemini-0.4-0.6-vtime", ["--mode", "gemini", "--caps", "0.4,0.6", "--schd-arg=--no-frame-turns"], None),
    # frames of 200 ms: half the handoffs, and caps from 0.1 framed (their quota 20 ms)
    ("gemini-3-frame200", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--schd-arg=--frame=200"], None),
    ("gemini-0.4-0.6-frame200", ["--mode", "gemini", "--caps", "0.4,0.6", "--schd-arg=--frame=200"], None),
    # and with a base quota of 200 ms, so that no frame's budget is split (the policy model: 0.07 points over 1 s, half
    # the handoffs; the simulated driver: docs/benchmarks.md, "Twenty-fourth session")
    ("gemini-3-frame200-q200", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--quota", "200",
                                "--schd-arg=--frame=200"], None),
    ("gemini-0.4-0.6-frame200-q200", ["--mode", "gemini", "--caps", "0.4,0.6", "--quota", "200",
                                      "--schd-arg=--frame=200"], None),
    ("gemini-0.3-0.6-frame200-q200", ["--mode", "gemini", "--caps", "0.3,0.6", "--quota", "200",
                                      "--schd-arg=--frame=200"], None),
    # the same with every grant logged (hooks, pod managers, gem-schd): where a slot's first kernel starts late
    ("gemini-3-debug", ["--mode", "gemini", "--caps", "0.2,0.3,0.5", "--debug-logs"], None),
    ("native-2-work", ["--mode", "native", "--tenants", "2", *WORK], None),
    ("gemini-0.3-0.6-work", ["--mode", "gemini", "--caps", "0.3,0.6", *WORK], None),
    ("mps-0.3-0.6-work", ["--mode", "mps", "--caps", "0.3,0.6", *WORK], "MPS, active thread percentage 30 / 60"),
    ("mps-3-work", ["--mode", "mps", "--caps", "0.2,0.3,0.5", *WORK], None),
]


def sync_cost_us(hook_stats: dict) -> float | None:
    """The hook's own time per synchronisation over a run's processes (`sync_tail_ms` + `burst_begin_ms` over
    `syncs`): what it adds between the GPU's last kernel and the program's next launch. None without counters."""
    syncs = sum(st.get("syncs", 0) for st in hook_stats.values())
    if not syncs:
        return None
    ms = sum(st.get("sync_tail_ms", 0) + st.get("burst_begin_ms", 0) for st in hook_stats.values())
    return ms * 1000 / syncs


def marker_summary(hook_stats: dict) -> str | None:
    """The busiest process's markers (the trainer's, beside a latency group): launches per marker, and how many were
    placed to measure a kernel alone (`kernels_measured`), after a cost check (`kernel_cost_checks`) or to bring a
    cost learnt too long down (`kernel_cost_remeasures`): what the cost table (hook/kcost.h) spends. None without
    counters."""
    busiest = max(hook_stats.values(), key=lambda st: st.get("launches", 0), default=None)
    if not busiest or not busiest.get("launches"):
        return None
    launches, markers = busiest["launches"], busiest.get("markers", 0)
    learnt = busiest.get("kernel_costs_learnt", 0)
    mean_us = busiest.get("kernel_cost_learnt_ms", 0) * 1000 / learnt if learnt else None
    return (f"{launches:.0f} launches, a marker per {fmt(launches / markers if markers else None, 1)}, "
            f"{busiest.get('kernels_measured', 0):.0f} measured alone, {learnt:.0f} learnt (mean "
            f"{fmt(mean_us, 1)} us), {busiest.get('kernel_cost_checks', 0):.0f} cost checks, "
            f"{busiest.get('kernel_cost_remeasures', 0):.0f} remeasures")


def schd_flags(ctx, extra: list) -> list:
    """gem-schd flags for a share run: none (its defaults) unless --quota/--window were given."""
    flags = []
    if ctx.args.quota is not None and "--quota" not in extra:
        flags += ["--quota", str(ctx.args.quota)]
    if ctx.args.window is not None:
        flags += ["--window", str(ctx.args.window)]
    return flags


def step_share(ctx, only: str | None = None) -> dict:
    secs = str(ctx.args.share_seconds) if ctx.args.share_seconds else "8" if ctx.args.quick else "14"
    out = {}
    for name, extra, title in SHARE_RUNS:
        if ctx.args.share_runs and name not in ctx.args.share_runs.split(","):
            continue
        flags = schd_flags(ctx, extra)
        argv = ["bench/bench_share.py", *extra, "--seconds", secs, *flags, "--out", ctx.out / f"share-{name}"]
        if title:
            argv += ["--plot", ctx.out / f"share-{name}.png", "--title", title]
        try:
            r = bench(ctx, argv, 200 + 2 * int(float(secs)))
            r.pop("results", None)
            out[name] = r
        except Exception as exc:  # noqa: BLE001 -- one configuration failing (MPS absent) keeps the others
            out[name] = {"error": str(exc)[-1000:]}
    return out


def step_transport(ctx) -> dict:
    """The token round trip through both daemons, and a hooked program's wait for each fresh grant, on TCP and
    on Unix sockets (the share runs compare the shares: gemini-0.3-0.6 and gemini-0.3-0.6-ipc)."""
    seconds = "5" if ctx.args.quick else "10"
    return bench(ctx, ["bench/bench_transport.py", "-n", "2000", "--cuda", "--seconds", seconds], 300)


def step_reaction(ctx) -> dict:
    r = bench(ctx, ["bench/bench_reaction.py", "--seconds", "3", "--repeats", "4"], 200)
    r.pop("results", None)
    return r


INFER_LIMIT_S = 590


def step_infer(ctx, trainer: str = "eager") -> dict:
    a = ctx.args
    seconds = 8.0 if a.quick else float(a.infer_seconds)
    workloads = len([w for w in a.infer_workloads.split(",") if w])
    plan = planned_seconds(seconds, a.infer_repeats, workloads, len([c for c in a.infer_classes.split(",") if c]),
                           variants=len([v for v in a.infer_variants.split(";") if v.strip()]),
                           gemini_only=a.infer_gemini_only,
                           itb_seconds=30.0 if a.infer_idle_then_busy else 0.0)
    if plan > INFER_LIMIT_S:
        # the step would be killed at its limit with nothing to show (a 590 s call lost this way, seventeenth session)
        raise RuntimeError(f"the serving runs would take about {plan:.0f} s, over the step's {INFER_LIMIT_S} s limit: "
                           f"lower --infer-repeats ({a.infer_repeats}) or --infer-seconds ({seconds:g}), or give "
                           f"--infer-workloads one workload a call ({workloads} now)")
    argv = ["bench/bench_inference.py", "--seconds", f"{seconds:g}", "--repeats", str(a.infer_repeats),
            "--trainer", trainer, "--workloads", a.infer_workloads, "--latency-variants", a.infer_variants,
            "--idle-then-busy", a.infer_idle_then_busy, *(["--gemini-only"] if a.infer_gemini_only else []),
            "--classes", a.infer_classes,
            *(["--timeline", "--timeline-dir", str(ctx.out / "timelines")] if a.infer_timeline else [])]
    return bench(ctx, argv, INFER_LIMIT_S)   # hook_stats kept: claims, pauses and waits per process


def step_infer_graph(ctx) -> dict:
    return step_infer(ctx, "graph")


def step_kernels(ctx) -> dict:
    return bench(ctx, ["bench/trainer_kernels.py"], 300)


def step_sharing(ctx) -> dict:
    # ProcessSharing turns against together: 4 inference processes of one group next to a trainer
    return bench(ctx, ["bench/bench_sharing.py", "--procs", "4", "--seconds", "6" if ctx.args.quick else "10",
                       "--repeats", str(ctx.args.infer_repeats), "--classes", ctx.args.sharing_classes], 590)


def step_markers(ctx) -> dict:
    """The GPU time a marker's stream operations add between back-to-back kernels (bench/marker_cost.c), at 20 us
    and at 200 us kernels (a batch stream gets a marker every half millisecond of its kernels)."""
    prog = str(REPO / "build" / "bench" / "marker_cost")
    return {f"kernel_{us}us": json.loads(sh([prog, "--kernel-us", str(us), "--kernels", str(n), "--every", str(e)],
                                            120, log=ctx.log))
            for us, n, e in ((20, 20000, 10), (200, 4000, 2))}


def step_policy_cost(ctx) -> dict:
    # no GPU needed: the node's idle cores give a quieter number than a shared development machine
    res = bench(ctx, ["bench/bench_policy_cost.py", "--groups", "2,16,64,256"], 300)
    res["capped"] = bench(ctx, ["bench/bench_policy_cost.py", "--groups", "2,16,64,256", "--mix", "capped"], 300)
    # the whole daemon, messages and board included (issue 14's goal: <= 100 us at p50 at 64 groups); the
    # development machine, a nested VM, is no place for that number (docs/benchmarks.md, "Twenty-eighth session")
    try:    # (its failure keeps the policy's measures above)
        # (each point with the defaults, then deciding at the deadline: what --decide-ahead gains, side by side)
        res["schd"] = bench(ctx, ["bench/bench_schd_ceiling.py", "--groups", "2,16,64,256",
                                  "--seconds", "3" if ctx.args.quick else "5", "--compare",
                                  "--schd-arg=--decide-ahead=0"], 400)
    except Exception as exc:
        res["schd"] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
    return res


def step_floor(ctx) -> dict:
    return bench(ctx, ["bench/bench_trainers.py", "--groups", "a:0.7:1,b:0:1", "--seconds",
                       "15" if ctx.args.quick else "25"], 400)


def step_trainers(ctx) -> dict:
    """Caps with gem-schd's default flags (each --trainers-groups set; the first is the result, the others under
    `more`), then once per --trainers-variants entry (flags to compare) on the first set."""
    sets = [s.strip() for s in ctx.args.trainers_groups.split(";") if s.strip()]
    secs = "15" if ctx.args.quick else "25"
    argv = ["bench/bench_trainers.py", "--groups", sets[0], "--seconds", secs]
    res = bench(ctx, argv, 400)

    def also(section: str, key: str, run_argv: list, keep: tuple) -> None:
        """One more run, kept under res[section][key]; its failure keeps the others."""
        try:
            one = bench(ctx, run_argv, 400)
            kept = {k: one.get(k) for k in keep}
            if one.get("error"):    # a run that measured nothing says so (bench_trainers.unmeasured)
                kept["error"] = one["error"]
            res.setdefault(section, {})[key] = kept
        except Exception as exc:  # noqa: BLE001
            res.setdefault(section, {})[key] = {"error": str(exc)[-1000:]}

    for groups in sets[1:]:
        also("more", groups, ["bench/bench_trainers.py", "--groups", groups, "--seconds", secs],
             ("shares", "window_10s", "sliding_1s", "sliding_10s", "alone_steps_per_s", "charged"))
    for v in [v.strip() for v in (ctx.args.trainers_variants or "").split(";") if v.strip()]:
        also("variants", v, argv + [f"--schd-args={v}"],
             ("shares", "window_10s", "sliding_1s", "sliding_10s", "hook_stats", "charged"))
    return res


def step_soak(ctx) -> dict:
    """8 always-busy processes in 4 groups, once per ProcessSharing mode."""
    secs = "30" if ctx.args.quick else str(ctx.args.soak_seconds)
    out = {}
    variants = ctx.args.soak_variants.split(",")
    for sharing in ctx.args.soak_sharing.split(","):
        for v in variants:
            # a variant is more gem-schd flags, space-separated (e.g. "--frame=200 --quota=200"), "" its defaults;
            # results keyed by both
            key = f"{sharing} {v}" if v else sharing
            name = f"share-soak-{sharing}" + ("-" + "".join(f.strip("-").replace("=", "") for f in v.split())
                                              if v else "")
            argv = ["bench/bench_share.py", "--mode", "gemini", "--caps", "0.1,0.2,0.3,0.4", "--per-group", "2",
                    "--seconds", secs, *schd_flags(ctx, []), *[f"--schd-arg={f}" for f in v.split()],
                    "--out", ctx.out / name, "--plot", ctx.out / f"{name}.png",
                    "--title", f"gemini, 8 processes in 4 groups (ProcessSharing = {sharing}{', ' + v if v else ''}), "
                               "MaxUtil 0.1 / 0.2 / 0.3 / 0.4"]
            try:
                r = bench(ctx, argv + (["--turns"] if sharing == "turns" else []), float(secs) + 280)
                r.pop("results", None)
                out[key] = r
            except Exception as exc:  # noqa: BLE001 -- one mode failing keeps the other
                out[key] = {"error": str(exc)[-1000:]}
    return out


def step_train(ctx) -> dict:
    rounds, secs = ("2", "6") if ctx.args.quick else ("3", "10")
    # three runs a round (native, hooked, hooked beside an idle neighbour), each with torch's start-up
    return bench(ctx, ["bench/bench_overhead.py", "train", "--rounds", rounds, "--seconds", secs, "--idle-neighbour"],
                 750)


def step_um(ctx) -> dict:
    argv = ["bench/bench_um.py", "--jobs", "3", "--job-gib", "10", "--capacity-gib", "24",
            "--trace-dir", str(ctx.out)]
    if ctx.args.quick:
        argv += ["--steps", "150", "--skip", "no_cache"]
    else:
        argv += ["--budget-s", "540"]
    if ctx.args.um_steps:
        argv += ["--steps", str(ctx.args.um_steps)]
    if ctx.args.um_skip is not None:
        argv += ["--skip", ctx.args.um_skip]
    if ctx.args.um_extra:
        argv += shlex.split(ctx.args.um_extra)
    # bench_um bounds its phases itself (--budget-s, 440 s by default) and prints its JSON even when a phase
    # failed or timed out (exit 1): keep that JSON, it says how far each job got and what gem-schd saw.
    argv = [sys.executable, *argv]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    with open(ctx.log, "a") as f:
        f.write(f"$ {' '.join(map(str, argv))}\n{proc.stdout}{proc.stderr}\n")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"bench_um.py exited {proc.returncode} without a result:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


STEP_FUNCS = {"env": step_env, "build": step_build, "probe": step_probe, "tests": step_tests,
              "launch": step_launch, "markers": step_markers, "alloc": step_alloc, "share": step_share,
              "transport": step_transport,
              "reaction": step_reaction,
              "infer": step_infer, "infer_graph": step_infer_graph, "kernels": step_kernels, "sharing": step_sharing,
              "floor": step_floor, "trainers": step_trainers,
              "soak": step_soak, "policy_cost": step_policy_cost, "train": step_train, "um": step_um}


def fmt(v, nd=1):
    return "n/a" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def write_report(ctx, results: dict) -> None:
    r = results
    head = r.get("env") or getattr(ctx, "header", None) or {}
    lines = [f"# gemini gpu-check — {head.get('gpu', '?')}", "",
             f"Date: {head.get('date', '?')}. Command: `{' '.join(sys.argv)}`.", ""]
    for name in ALL_STEPS:
        if name not in r:
            continue
        res = r[name]
        status = "FAILED" if isinstance(res, dict) and (res.get("error") or (name == "um" and res.get("ok") is False)) \
            else "ok"
        lines.append(f"## {name}: {status} ({fmt(ctx.durations.get(name), 0)} s)")
        if isinstance(res, dict) and res.get("error"):
            lines += ["```", res["error"][-1500:], "```"]
        elif name == "probe":
            lines.append(f"{res['checks']} checks, mismatches: {res['mismatches'] or 'none'}; {res['driver']}")
        elif name == "tests":
            lines.append(res["summary"])
            for row in res["rows"]:
                lines.append(f"- {row['test']}: " + ", ".join(f"{k}={fmt(v, 3)}" for k, v in row.items()
                                                             if k != "test"))
        elif name == "markers":
            for key, one in res.items():
                lines.append(f"- {key}: GPU time added per operation (median of {one['rounds']} rounds, ns): "
                             + ", ".join(f"{v} {fmt(one.get(v + '_ns'))}" for v in (
                                 "record", "record_nt", "wait", "marker", "marker_nt", "record_wait", "device_wait"))
                             + f"; a kernel alone {fmt(one.get('kernel_ns_none'))} ns")
        elif name == "launch":
            lines.append(f"in one process, alternate batches through the hook and the driver's own cuLaunchKernel: "
                         f"added {fmt(res.get('in_process_added_ns'))} ns per launch, beside a latency group "
                         f"{fmt(res.get('in_process_added_ns_bound'))} ns; native control "
                         f"{fmt(res.get('in_process_native_control_ns'))} ns "
                         f"(rounds: {res.get('in_process_each_round')}); hooks: {res.get('hook_stats')}")
            lines.append(f"native {fmt(res['native_median'])} ns, hooked {fmt(res['hooked_median'])} ns, beside a "
                         f"latency group {fmt(res['bound_median'])} ns; added per launch (median of each round's "
                         f"difference, one core) {fmt(res['added_ns_per_launch'])} ns, with the in-flight bound "
                         f"{fmt(res['added_ns_per_launch_bound'])} ns (rounds: {res['added_each_round']} / "
                         f"{res['added_bound_each_round']}); clock_gettime {fmt(res.get('clock_monotonic_ns'))} ns, "
                         f"coarse {fmt(res.get('clock_coarse_ns'))} ns (tick {res.get('coarse_resolution_ns')} ns)")
        elif name == "alloc":
            nat, hk = res["runs"]["native"][-1], res["runs"]["hooked"][-1]
            lines.append(f"cuMemAlloc 2 MiB p50/p99: native {nat['alloc_us_p50']}/{nat['alloc_us_p99']} us, hooked "
                         f"{hk['alloc_us_p50']}/{hk['alloc_us_p99']} us; cuMemFree: native {nat['free_us_p50']}/"
                         f"{nat['free_us_p99']} us, hooked {hk['free_us_p50']}/{hk['free_us_p99']} us")
        elif name == "share":
            for run, one in res.items():
                if one.get("error"):
                    lines.append(f"- {run}: FAILED {one['error'][-300:]}")
                    continue
                shares = ", ".join(f"{k}: {v:.3f}" for k, v in one["shares"].items())
                line = f"- {run}: shares {{{shares}}}, useful {one['useful']:.3f}"
                caps = one.get("caps") or {}
                if any(abs(v - caps.get(k, v)) > 5e-4 for k, v in (one.get("entitled") or {}).items()):
                    # caps adding up to more than 1: what each is owed differs from its cap
                    line += ", owed {" + ", ".join(f"{k}: {v:.3f}" for k, v in one["entitled"].items()) + "}"
                if "share_error_pp" in one:
                    line += (f", error pp {fmt(max(one['share_error_pp'].values()), 2)}, worst 1 s window pp "
                             f"{fmt(max(one['window_error_1s_pp'].values()), 2)}")
                    if "window_error_10s_pp" in one:
                        line += f", worst 10 s window pp {fmt(max(one['window_error_10s_pp'].values()), 2)}"
                if one.get("handoff_gap_us_p50") is not None and run.startswith("gemini"):
                    line += (f", handoff gap p50/p99 {fmt(one['handoff_gap_us_p50'])}/"
                             f"{fmt(one['handoff_gap_us_p99'])} us")
                gaps = [v for v in (one.get("own_gap_us_mean") or {}).values() if v is not None]
                if gaps:
                    line += f", own gap mean {fmt(min(gaps))}-{fmt(max(gaps))} us"
                per_sync = sync_cost_us(one.get("hook_stats") or {})
                if per_sync is not None:
                    line += f", the hook's time per synchronisation {fmt(per_sync, 2)} us"
                lines.append(line)
        elif name == "reaction":
            lines.append(f"save -> new shares on the GPU: {res['reactions_ms']} ms (median {res['median_ms']})")
        elif name in ("infer", "infer_graph"):
            markers = marker_summary(res.get("hook_stats") or {})
            if markers:
                lines.append(f"busiest hooked process (a trainer: one per variant), whole run: {markers}")
            lines.append(f"trainer alone: native {fmt(res.get('train_alone_native'), 2)} steps/s, hooked "
                         f"{fmt(res.get('train_alone_gemini'), 2)} steps/s, hooked beside an idle latency group "
                         f"{fmt(res.get('train_latency_idle_gemini'), 2)} steps/s")
            for key, one in res.get("summary", {}).items():
                lines.append(f"- {key}: p50 {fmt(one['p50_ms'], 2)} / p99 {fmt(one['p99_ms'], 2)} / p99.9 "
                             f"{fmt(one['p999_ms'], 2)} ms, p99 x{fmt(one.get('p99_vs_alone'), 2)} of alone, "
                             f"p99.9 x{fmt(one.get('p999_vs_alone'), 2)}; trainer "
                             f"{fmt(one.get('train_vs_alone'), 3)} of alone, "
                             f"{fmt(one.get('train_vs_native'), 3)} of native"
                             + (f"; the server's slots held {fmt(one['server_used_share'], 3)} of the GPU"
                                if one.get("server_used_share") is not None else ""))
                tl = one.get("timeline_tail")
                if tl:
                    parts = one["timeline"]
                    lines.append("  first kernel's wait p50 / p99 " + f"{fmt(parts['to_gpu']['p50_ms'], 3)} / "
                                 f"{fmt(parts['to_gpu']['p99_ms'], 3)} ms; slowest 1%: " +
                                 ", ".join(f"{k} {fmt(v, 3)}" for k, v in tl.items()))
        elif name in ("floor", "trainers"):
            lines.append(f"groups {res['groups']}: shares of alone throughput "
                         f"{ {k: round(v, 3) for k, v in res['shares'].items()} }, 10 s windows "
                         f"{ {k: (round(v['min'], 3), round(v['max'], 3)) for k, v in res['window_10s'].items()} }, "
                         f"sliding 1 s windows (least, largest, worst and p95 from the mean in points) "
                         f"{ {k: tuple(round(v.get(f, float('nan')), 3) for f in ('min', 'max', 'worst_from_mean_pp', 'p95_from_mean_pp')) for k, v in res.get('sliding_1s', {}).items()} }, "  # noqa: E501
                         f"charged by gem-schd {res.get('charged')}")
            for groups, one in res.get("more", {}).items():
                if "error" in one:
                    lines.append(f"- groups {groups}: FAILED {one['error'][-300:]}")
                    continue
                windows = {k: (round(v["min"], 3), round(v["max"], 3)) for k, v in one["window_10s"].items()}
                lines.append(f"- groups {groups}: shares { {k: round(v, 3) for k, v in one['shares'].items()} }, "
                             f"10 s windows {windows}, charged by gem-schd {one.get('charged')}")
            for flags, one in res.get("variants", {}).items():
                lines.append(f"- with gem-schd {flags}: " + (f"FAILED {one['error'][-300:]}" if "error" in one else
                             f"shares { {k: round(v, 3) for k, v in one['shares'].items()} }, charged "
                             f"{one.get('charged')}"))
        elif name == "soak":
            for sharing, one in res.items():
                if one.get("error"):
                    lines.append(f"- {sharing}: FAILED {one['error'][-300:]}")
                    continue
                lines.append(f"- ProcessSharing = {sharing}, {one['span_s']:.0f} s, 8 processes in 4 groups: on-chip "
                             f"shares { {k: round(v, 3) for k, v in one['shares'].items()} } (error pp "
                             f"{fmt(max(one['share_error_pp'].values()), 2)}, worst 1 s window pp "
                             f"{fmt(max(one.get('window_error_1s_pp', {'-': None}).values()), 2)}, worst 10 s "
                             f"window pp "
                             f"{fmt(max(one.get('window_error_10s_pp', {'-': None}).values()), 2)}); shares of GPU "
                             f"time { {k: round(v, 3) for k, v in one.get('time_shares', {}).items()} }; errors "
                             f"{one['errors']}")
        elif name == "um":
            failed = {k: v for k, v in res.items() if isinstance(v, dict) and v.get("ok") is False}
            failed.update({f"alone-{k}": v for k, v in res.get("alone_steps_per_s", {}).items()
                           if isinstance(v, dict)})
            if res.get("aborted"):
                lines.append(f"ABORTED: {res['aborted']}")
            elif failed:
                for phase, v in failed.items():
                    why = v.get("skipped") or ("timed out" if v.get("timed_out") else "error")
                    lines.append(f"- {phase} FAILED ({why}): steps done {v.get('steps_done')}, evictions "
                                 f"{v.get('evictions')}, swap {fmt((v.get('swap_ms') or 0) / 1e3, 1)} s")
                    if v.get("backend_logs"):
                        lines.append("```\n" + v["backend_logs"][-1500:] + "\n```")
            else:
                g = res["gemini"]
                lines.append(f"{res['jobs']} jobs of {res['job_gib']} GiB, capacity {res['capacity_gib']} GiB: "
                             f"sequential {fmt(res['sequential']['span_s'], 1)} s, gemini {fmt(g['span_s'], 1)} s: "
                             f"throughput x{fmt(res['throughput_vs_sequential'], 2)} of sequential (steps), "
                             f"x{fmt(res.get('wall_vs_sequential'), 2)} (whole runs); shares "
                             f"{ {k: fmt(v['share'], 3) for k, v in g['shares_vs_maxutil'].items()} } (MaxUtil 1)")
                per_switch = (g['bytes_per_switch'] or 0) / 2**30
                lines.append(f"- swaps: {g['evictions']} evictions, {fmt(per_switch, 2)} GiB and "
                             f"{fmt(g['ms_per_switch'], 1)} ms per switch, {fmt(g['swap_gbps'], 1)} GB/s, swapping "
                             f"{fmt(100 * (g['swap_fraction'] or 0), 1)}% of the span")
                if "no_cache" in res:
                    n = res["no_cache"]
                    lines.append(f"- PYTORCH_NO_CUDA_MEMORY_CACHING=1: x{fmt(n['throughput_vs_sequential'], 2)}, "
                                 f"{fmt((n.get('bytes_per_switch') or 0) / 2**30, 2)} GiB per switch")
                if "alone_steps_per_s" in res:
                    lines.append(f"- alone: device {fmt(res['alone_steps_per_s']['device'], 2)} steps/s, unified "
                                 f"{fmt(res['alone_steps_per_s']['unified'], 2)}: loss "
                                 f"{fmt(res['unified_alone_loss_pct'], 2)}%")
        elif name == "policy_cost":
            schd = res.get("schd") or {}
            if schd.get("error"):
                lines.append(f"- gem-schd's ceiling bench FAILED: {schd['error'][-300:]}")
            for row in schd.get("rows", []):
                flags = " ".join(row.get("schd_args") or []) or "defaults"
                lines.append(f"- gem-schd ({flags}), {row['groups']} groups, {row['mode']}: "
                             f"{fmt(row['slots_per_s'])} slots/s, CPU per slot "
                             f"{fmt(row['schd_cpu_per_slot_ms'], 3)} ms (ceiling "
                             f"{fmt(row['ceiling_slots_per_s'], 0)} slots/s); deadline to grant sent: CPU p50 "
                             f"{fmt(row['deadline_to_grant_cpu_p50_us'])} us, p99 "
                             f"{fmt(row['deadline_to_grant_cpu_p99_us'])} us, wall p50 "
                             f"{fmt(row.get('deadline_to_grant_wall_p50_ms'), 3)} ms; decided ahead "
                             f"{row.get('decided_ahead')} (CPU p50 {fmt(row.get('decide_ahead_cpu_p50_us'))} us), "
                             f"at the deadline {row.get('decided_at_deadline')}")
            if "bare_send" in schd:
                b = schd["bare_send"]
                lines.append(f"- one bare zmq send after {fmt(b['gap_ms'])} ms of quiet (the machine's own cost): "
                             f"p50 {fmt(b['cpu_p50_us'])} us, p99 {fmt(b['cpu_p99_us'])} us")
            rest = {k: v for k, v in res.items() if k != "schd"}
            lines.append("```\n" + json.dumps(rest, indent=1)[:1500] + "\n```")
        elif name == "train":
            lines.append(f"ResNet-18 steps/s native {fmt(res['native_median'], 2)}, "
                         f"hooked {fmt(res['hooked_median'], 2)}"
                         f": overhead {fmt(res['overhead_pct'], 2)}% (rounds {res['native']} / {res['hooked']})")
            if "hooked_idle_neighbour_median" in res:
                beside = res.get("hook_stats_idle_neighbour", {}).values()
                timed = sum(v.get("markers_timed", 0) for v in beside)
                markers = sum(v.get("markers", 0) for v in beside)
                lines.append(f"beside an idle neighbour (configured, MinUtil 0.5): "
                             f"{fmt(res['hooked_idle_neighbour_median'], 2)} steps/s, overhead "
                             f"{fmt(res['overhead_idle_neighbour_pct'], 2)}% (rounds {res['hooked_idle_neighbour']}; "
                             f"{int(timed)} of {int(markers)} markers timed)")
        else:
            lines.append("```\n" + json.dumps(res, indent=1)[:1500] + "\n```")
        lines.append("")
    (ctx.out / "report.md").write_text("\n".join(lines))


class Ctx:
    pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--quick", action="store_true", help="shorter runs, for development")
    p.add_argument("--steps", default=",".join(ALL_STEPS))
    p.add_argument("-k", help="pytest -k expression for the tests step")
    p.add_argument("--tests-timeout", type=float, default=420)
    p.add_argument("--quota", type=float, default=None,
                   help="gem-schd base quota (ms) for the share benchmarks (default: gem-schd's own)")
    p.add_argument("--window", type=float, default=None, help="gem-schd's reporting window (default: its own)")
    p.add_argument("--infer-seconds", type=float, default=12)
    p.add_argument("--infer-repeats", type=int, default=2)
    p.add_argument("--infer-workloads", default="mlp:periodic:50,resnet18:poisson:100")
    p.add_argument("--infer-variants", default="", help="bench_inference --latency-variants")
    p.add_argument("--infer-gemini-only", action="store_true",
                   help="bench_inference --gemini-only: no alone or native runs (A/B of hook changes on one machine)")
    p.add_argument("--infer-classes", default="batch,latency",
                   help="bench_inference --classes: the serving group's classes under gemini (latency alone is faster; "
                        "latency@MU: the latency class with MinUtil MU, its claim budget, e.g. latency,latency@0.15)")
    p.add_argument("--infer-timeline", action="store_true",
                   help="bench_inference --timeline: where each request's time went (two stamp kernels a request)")
    p.add_argument("--infer-idle-then-busy", default="", metavar="BUSY:IDLE",
                   help="bench_inference --idle-then-busy: each workload also served with pauses (e.g. 2:3)")
    p.add_argument("--share-runs", help="comma-separated subset of the share configurations")
    p.add_argument("--share-seconds", type=float, default=None,
                   help="each share run's length (default 14, 8 with --quick): 10 s windows want 25 or more")
    p.add_argument("--trainers-groups", default="a:0:0.3,b:0:0.6",
                   help="the trainers step's group sets (name:min:max,...), ';' between sets")
    p.add_argument("--trainers-variants", default="",
                   help="';'-separated gem-schd flag sets the trainers step also runs, e.g. '--bucket 25'")
    p.add_argument("--sharing-classes", default="batch,latency",
                   help="the inference groups' Class in the sharing step, one backend each")
    p.add_argument("--soak-sharing", default="turns,together", help="ProcessSharing modes the soak step runs")
    p.add_argument("--soak-seconds", type=float, default=120)
    p.add_argument("--soak-variants", default="",
                   help="comma-separated gem-schd variants, one soak run each ('' its defaults), a variant's flags "
                        "space-separated, e.g. ',--no-frame-turns,--frame=200 --quota=200'")
    p.add_argument("--um-steps", type=int, default=None, help="steps of each bench_um job (default: bench_um's)")
    p.add_argument("--um-skip", default=None, help="bench_um runs to skip (no_cache,alone)")
    p.add_argument("--um-extra", default="", help="more bench_um arguments, one shell-quoted string "
                                                   "(e.g. '--cached-gib 2 --torch-cache'; a single option "
                                                   "needs '=': --um-extra=--torch-cache)")
    args = p.parse_args(argv)
    ctx = Ctx()
    ctx.args = args
    ctx.out = Path(args.out).resolve()
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.log = ctx.out / "steps.log"
    ctx.durations = {}
    results: dict = {}
    if "env" not in args.steps.split(","):
        ctx.header = header()
    for name in args.steps.split(","):
        t0 = time.time()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            results[name] = STEP_FUNCS[name](ctx)
        except Exception as exc:  # noqa: BLE001 -- every step reports, none stops the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
        ctx.durations[name] = time.time() - t0
        print(f"[gpu-check] {name}: {'FAILED' if results[name].get('error') else 'ok'} "
              f"({ctx.durations[name]:.0f} s)", flush=True)
        (ctx.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        write_report(ctx, results)
    bundle(ctx.out)
    print((ctx.out / "report.md").read_text())
    return 0 if all(not r.get("error") for r in results.values()) else 1


def bundle(out: Path) -> None:
    """Traces, kernel logs and plots go into one artifacts.tgz (a device call returns few files)."""
    import shutil
    import tarfile
    extra = [p for p in out.iterdir() if p.name.startswith("share-") or p.suffix == ".png"]
    if not extra:
        return
    with tarfile.open(out / "artifacts.tgz", "w:gz") as tar:
        for p in extra:
            tar.add(p, arcname=p.name)
    for p in extra:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


if __name__ == "__main__":
    sys.exit(main())
