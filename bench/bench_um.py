"""Unified groups on a real GPU: more training jobs than fit in gemini's configured capacity, swapped by gem-schd.

    python bench/bench_um.py [--jobs 3] [--job-gib 10] [--capacity-gib 24] [--steps 150] [--cpu-ms 40]

Each job (written to a temp file, PyTorch) trains an MLP whose weights, gradients and Adam state take about
--job-gib GiB, with --cpu-ms of host work per step (an input pipeline), printing its progress. Runs:
  1. sequential: the jobs natively, one after another (what a user must do without this);
  2. gemini: one unified group per job (MaxUtil 1), all at once, gem-schd --device-memory CAPACITY;
  3. no_cache: as 2 with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (cached-but-unused blocks are not swapped);
  4. alone: one job in a device-mode group, then in a unified group (nothing to swap: the cost of managed memory).
Reports throughput of all jobs together relative to sequential, each job's share of the gemini span against its
MaxUtil, the unified-alone loss, and the swap cost (bytes per switch, GB/s, time per switch) from gem-ctl status.

SAFETY (the lent GPU hangs if managed memory exceeds what the card has free): before anything runs, the card's
free memory is read (nvidia-smi) and the run aborts unless jobs x (job-gib + 1 GiB of slack) stays below
--max-fraction (0.8) of it, and the capacity below that too. Oversubscription is only against gemini's capacity.
Prints one JSON object.
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

from bench.harness import Backend, Group  # noqa: E402

GiB = 1 << 30

JOB = r'''
import json, sys, time, torch
gib, steps, cpu_ms = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
width = 4096
layer_bytes = width * width * 4 * 4           # fp32 weight + grad + two Adam moments
layers = max(1, int(gib * (1 << 30) * 0.9 // layer_bytes))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-6)
x = torch.randn(256, width, device="cuda")
def cpu_work(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
for i in range(3):
    opt.zero_grad(set_to_none=True); model(x).square().mean().backward(); opt.step()
torch.cuda.synchronize()
t0 = time.monotonic()
print(json.dumps({"ready": True, "layers": layers, "t0": t0}), flush=True)
for i in range(steps):
    cpu_work(cpu_ms)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
t1 = time.monotonic()
print(json.dumps({"done": True, "steps": steps, "seconds": t1 - t0, "t0": t0, "t1": t1,
                  "steps_per_s": steps / (t1 - t0)}), flush=True)
'''


def free_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(out.split()[0]) / 1024.0


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result from the job:\n{text[-2000:]}")


def run_jobs(argvs: list[list[str]], env: dict, timeout: float) -> list[dict]:
    procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in argvs]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"job exited {p.returncode}:\n{text[-3000:]}")
        out.append(last_json(text))
    return out


def ctl_status(be: Backend) -> dict:
    text = subprocess.run([sys.executable, "-m", "gemini.ctl", *be.where_args(), "status", "--json"],
                          capture_output=True, text=True, timeout=30, check=True,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))).stdout
    return json.loads(text)


def gemini_run(job_argv, args, work: Path, env: dict, tag: str) -> dict:
    groups = [Group(f"j{i}", 0.0, 1.0, f"{int(args.job_gib + 2)}GiB", memory_mode="unified")
              for i in range(args.jobs)]
    with Backend(work / tag, groups, env=env, quota_ms=None, min_quota_ms=None, window_ms=None,
                 extra_args=["--device-memory", f"{args.capacity_gib}GiB"]) as be:
        t0 = time.monotonic()
        res = run_jobs([be.command(g.name, job_argv) for g in groups], env, args.timeout)
        span = time.monotonic() - t0
        status = ctl_status(be)
    groups_st = {g["name"]: g for g in status["groups"]}
    moved = sum(g.get("swapped_in_bytes", 0) + g.get("swapped_out_bytes", 0) for g in groups_st.values())
    swap_ms = sum(g.get("swap_ms", 0.0) for g in groups_st.values())
    evictions = sum(g.get("evictions", 0) for g in groups_st.values())
    first = min(r["t0"] for r in res)
    last = max(r["t1"] for r in res)
    return {"span_s": span, "measured_span_s": last - first, "jobs": res,
            "shares_vs_maxutil": {g.name: {"share": groups_st[g.name]["share"], "max_util": g.max_util}
                                  for g in groups},
            "evictions": evictions, "moved_bytes": moved, "swap_ms": swap_ms,
            "bytes_per_switch": moved / evictions if evictions else 0,
            "ms_per_switch": swap_ms / evictions if evictions else 0,
            "swap_gbps": status.get("swap_gbps", 0.0),
            "swap_fraction": swap_ms / 1e3 / (last - first) if last > first else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--job-gib", type=float, default=10.0)
    p.add_argument("--capacity-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--cpu-ms", type=float, default=40.0, help="host work per step (an input pipeline)")
    p.add_argument("--max-fraction", type=float, default=0.8)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--skip", default="", help="comma list of runs to skip: no_cache,alone")
    args = p.parse_args(argv)
    free = free_gib()
    managed = args.jobs * (args.job_gib + 1.0)
    if managed > args.max_fraction * free or args.capacity_gib > args.max_fraction * free:
        print(json.dumps({"aborted": f"the jobs would hold {managed:.1f} GiB of managed memory (capacity "
                                     f"{args.capacity_gib} GiB) but the GPU has {free:.1f} GiB free: above "
                                     f"{args.max_fraction:.0%} of it the lent GPU can hang. Lower --jobs/--job-gib."}))
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-um-"))
    job_file = work / "job.py"
    job_file.write_text(JOB)
    job_argv = [sys.executable, str(job_file), str(args.job_gib), str(args.steps), str(args.cpu_ms)]
    env = dict(os.environ)
    out: dict = {"free_gib": free, "jobs": args.jobs, "job_gib": args.job_gib, "capacity_gib": args.capacity_gib,
                 "steps": args.steps, "cpu_ms": args.cpu_ms}
    t0 = time.monotonic()
    seq = [run_jobs([job_argv], env, args.timeout)[0] for _ in range(args.jobs)]
    out["sequential"] = {"span_s": time.monotonic() - t0, "jobs": seq}
    out["gemini"] = gemini_run(job_argv, args, work, env, "gemini")
    out["throughput_vs_sequential"] = out["sequential"]["span_s"] / out["gemini"]["span_s"]
    if "no_cache" not in args.skip:
        nc_env = dict(env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        out["no_cache"] = gemini_run(job_argv, args, work, nc_env, "no_cache")
        out["no_cache"]["throughput_vs_sequential"] = out["sequential"]["span_s"] / out["no_cache"]["span_s"]
    if "alone" not in args.skip:
        alone = {}
        for mode in ("device", "unified"):
            g = Group("solo", 0.0, 1.0, f"{int(args.job_gib + 2)}GiB", memory_mode=mode)
            with Backend(work / f"alone-{mode}", [g], env=env, quota_ms=None, min_quota_ms=None, window_ms=None,
                         extra_args=["--device-memory", f"{args.capacity_gib}GiB"]) as be:
                alone[mode] = run_jobs([be.command("solo", job_argv)], env, args.timeout)[0]["steps_per_s"]
        out["alone_steps_per_s"] = alone
        out["unified_alone_loss_pct"] = 100.0 * (1 - alone["unified"] / alone["device"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
