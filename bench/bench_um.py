"""Unified groups on a real GPU: more training jobs than fit in gemini's configured capacity, swapped by gem-schd.

    python bench/bench_um.py [--jobs 3] [--job-gib 10] [--capacity-gib 24] [--steps 300] [--cpu-ms 40]
                             [--budget-s 440] [--skip no_cache,alone] [--cached-gib N --torch-cache]

Each job (written to a temp file, PyTorch) trains an MLP whose weights, gradients and Adam state take about
--job-gib GiB, with --cpu-ms of host work per step (an input pipeline), printing a line per step. Runs:
  1. sequential: the jobs natively, one after another (what a user must do without this);
  2. gemini: one unified group per job (MaxUtil 1), all at once, gem-schd --device-memory CAPACITY;
  3. no_cache: as 2 with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (cached-but-unused blocks are not swapped);
  4. alone: one job in a device-mode group, then in a unified group (nothing to swap: the cost of managed memory);
  (2b. torch_cache, only with --torch-cache: as 2 with launch-command --torch-empty-cache-on-evict, PyTorch's cache
  emptied before each eviction; with --cached-gib N each job also leaves an N GiB temporary in PyTorch's cache, so
  "torch_cache_saved_gib_per_switch" -- the gemini phase's bytes per switch less this one's -- shows what was not
  swapped: about 2N GiB, N not moved out and N not moved back in, plus whatever else was cached at the eviction.)
Reports throughput of all jobs together relative to sequential: `throughput_vs_sequential` counts steps only (the
jobs' step phases one after another, against the span from the first step of any job to the last), and
`wall_vs_sequential` whole runs with their start-ups (which the gemini phase overlaps); each job's share of the
gemini span (its slot time in gem-schd's trace, kept with --trace-dir) against its MaxUtil; the unified-alone
loss; and the swap cost (bytes per switch, GB/s, time per switch) from gem-ctl status.

Bounded: each phase has its own time limit (--seq-s, --gemini-s, --alone-s), all within --budget-s; a phase
that would start with less than 15 s left is skipped. The jobs' progress lines are read as they come and logged
(stderr) every 10 steps, and a job silent for --stall-s is named; at a phase's limit its jobs are killed and the
phase reports what it has: steps done per job, and for a gemini phase gem-ctl status --json, the swap counters
and the tail of the backend's logs. While a gemini phase runs, gem-ctl status is sampled every --status-every-s
(5 s): its "status_samples" (holder, each group's waiting/holding/grants/managed/resident/evictions, or the error
and how long gem-ctl waited) show when gem-schd stopped granting or answering. The JSON is printed whatever
happened; the exit status is 1 if a phase failed.

SAFETY (the lent GPU hangs if managed memory exceeds what the card has free): before anything runs, the card's
free memory is read (nvidia-smi) and the run aborts unless jobs x (job-gib + cached-gib + 1 GiB of slack) stays below
--max-fraction (0.8) of it, and the capacity below that too. Oversubscription is only against gemini's capacity.
Prints one JSON object (its keys: docs/benchmarks.md, "Unified memory").
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Backend, Group, children_of, cmdline, ctl_status  # noqa: E402
from gemini.scheduler.trace import SchedulerTrace, TraceFormatError  # noqa: E402

log = logging.getLogger("bench.um")

GiB = 1 << 30
MIN_PHASE_S = 15.0      # a phase with less time left than this is skipped, not started
PROGRESS_EVERY = 10     # steps between two progress lines in the log

JOB = r'''
import json, sys, time, torch
gib, steps, cpu_ms = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
cached_gib = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
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
if cached_gib > 0:       # a temporary freed at once: PyTorch keeps it cached (--cached-gib)
    tmp = torch.empty(int(cached_gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    tmp.fill_(1)
    del tmp
torch.cuda.synchronize()
t0 = time.monotonic()
print(json.dumps({"ready": True, "layers": layers, "t0": t0,
                  "cached_gib": (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / (1 << 30)}),
      flush=True)
for i in range(steps):
    cpu_work(cpu_ms)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    print(json.dumps({"step": i + 1, "t": time.monotonic()}), flush=True)
t1 = time.monotonic()
print(json.dumps({"done": True, "steps": steps, "seconds": t1 - t0, "t0": t0, "t1": t1,
                  "steps_per_s": steps / (t1 - t0)}), flush=True)
'''


def free_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(out.split()[0]) / 1024.0


# --- running jobs, bounded, their progress read as it comes ---------------------------------------------------

@dataclass
class _Job:
    name: str
    proc: subprocess.Popen
    started: float
    steps: int = 0
    ready: bool = False
    result: Optional[dict] = None
    last_line: float = 0.0
    stall_logged: bool = False
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))


def _read(job: _Job, tag: str) -> None:
    """The job's output, line by line as it comes: progress counted and logged, other lines kept (a tail)."""
    assert job.proc.stdout is not None
    for line in job.proc.stdout:
        job.last_line = time.monotonic()
        job.stall_logged = False
        text = line.strip()
        msg = None
        if text.startswith("{"):
            try:
                msg = json.loads(text)
            except json.JSONDecodeError:
                msg = None
        if not isinstance(msg, dict):
            job.tail.append(text)
            continue
        since = job.last_line - job.started
        if "step" in msg:
            job.steps = int(msg["step"])
            if job.steps % PROGRESS_EVERY == 0:
                log.info("%s/%s: step %d at %.1f s", tag, job.name, job.steps, since)
        elif msg.get("ready"):
            job.ready = True
            log.info("%s/%s: ready at %.1f s", tag, job.name, since)
        elif msg.get("done"):
            job.result = msg
            log.info("%s/%s: done, %d steps at %.1f s", tag, job.name, msg.get("steps", job.steps), since)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def _kill_all(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Each job and what it started: SIGTERM to its process group (launch-command forwards it to the program's own
    group), then SIGKILL to every process below it still there. The jobs share one grace period, so N stuck jobs
    take grace_s to end, not N times it."""
    procs = [p for p in procs if p.poll() is None]
    below: dict[int, dict[int, str]] = {}
    for proc in procs:
        below[proc.pid] = {pid: cmdline(pid) for pid in _descendants(proc.pid)}
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        left = below[proc.pid]
        left.update({pid: cmdline(pid) for pid in _descendants(proc.pid)})
        for pid, argv in left.items():
            if argv and cmdline(pid) == argv:       # still that process (not a reused pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run_jobs(argvs: dict[str, list[str]], env: dict, limit_s: float, tag: str, stall_s: float = 30.0) -> dict:
    """Run the jobs at once and wait for them, at most `limit_s`; then kill what is left. Returns
    {"ok", "timed_out", "wall_s", "jobs": {name: {"steps_done", "ready", "result", "rc", "tail"?}}}."""
    t0 = time.monotonic()
    jobs = []
    for name, argv in argvs.items():
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        jobs.append(_Job(name, proc, t0, last_line=t0))
    readers = [threading.Thread(target=_read, args=(j, tag), daemon=True) for j in jobs]
    for r in readers:
        r.start()
    deadline = t0 + limit_s
    timed_out = False
    while any(j.proc.poll() is None for j in jobs):
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            log.warning("%s: time limit %.0f s reached: killing %s (steps done: %s)", tag, limit_s,
                        ", ".join(j.name for j in jobs if j.proc.poll() is None),
                        {j.name: j.steps for j in jobs})
            break
        for j in jobs:
            if j.proc.poll() is None and not j.stall_logged and now - j.last_line > stall_s:
                j.stall_logged = True
                log.warning("%s/%s: no progress for %.0f s (step %d, ready %s)", tag, j.name, now - j.last_line,
                            j.steps, j.ready)
        time.sleep(0.2)
    _kill_all([j.proc for j in jobs])
    for r in readers:
        r.join(timeout=5)
    out: dict = {"ok": not timed_out, "timed_out": timed_out, "wall_s": time.monotonic() - t0, "jobs": {}}
    for j in jobs:
        rc = j.proc.returncode
        one = {"steps_done": j.steps, "ready": j.ready, "result": j.result, "rc": rc}
        if rc != 0 or j.result is None:
            out["ok"] = False
            one["tail"] = "\n".join(j.tail)[-3000:]
        out["jobs"][j.name] = one
    return out


# --- the phases -----------------------------------------------------------------------------------------------

STATUS_EVERY_S = 5.0


def status_sample(status: dict) -> dict:
    """What a periodic sample keeps of gem-ctl status: the holder and, per group, what it waits for and holds."""
    keys = ("holding", "waiting", "wait_ms", "grants", "clients", "managed_bytes", "resident_bytes", "evictions")
    return {"holder": status.get("holder", ""),
            "groups": {g["name"]: {k: g.get(k) for k in keys} for g in status.get("groups", [])}}


class StatusPoller:
    """gem-ctl status every `every_s` while a phase runs, each sample (or the error, and how long gem-ctl took)
    kept in `samples` with its time since the start: after a hang they show when gem-schd stopped answering or
    stopped granting (issue 19: gem-ctl status failed only at the end, and nothing said since when)."""

    def __init__(self, be: Backend, every_s: float = STATUS_EVERY_S, timeout_s: float = 5.0):
        self.be, self.every_s, self.timeout_s = be, every_s, timeout_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def __enter__(self) -> "StatusPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            t = time.monotonic()
            sample: dict = {"t_s": round(t - self._t0, 1)}
            try:
                sample.update(status_sample(ctl_status(self.be, self.timeout_s)))
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                stderr = getattr(exc, "stderr", "") or ""
                sample["error"] = (stderr.strip() or str(exc))[-300:]
                log.warning("gem-ctl status failed at %.1f s: %s", sample["t_s"], sample["error"])
            sample["took_s"] = round(time.monotonic() - t, 2)
            self.samples.append(sample)
            if self._stop.wait(max(0.0, self.every_s - (time.monotonic() - t))):
                return


def swap_counters(status: dict) -> dict:
    """gem-ctl status's swap figures, per group and in total."""
    groups = {g["name"]: g for g in status.get("groups", [])}
    keys = ("managed_bytes", "resident_bytes", "swapped_in_bytes", "swapped_out_bytes", "swap_ms", "evictions")
    per = {n: {k: g.get(k, 0) for k in keys} for n, g in groups.items()}
    moved = sum(g["swapped_in_bytes"] + g["swapped_out_bytes"] for g in per.values())
    return {"per_group": per, "evictions": sum(g["evictions"] for g in per.values()), "moved_bytes": moved,
            "swap_ms": sum(g["swap_ms"] for g in per.values()), "swap_gbps": status.get("swap_gbps", 0.0)}


def slot_shares(trace_path: Path, groups: list[str], first_s: float, last_s: float) -> dict:
    """Each group's slot time in gem-schd's trace between two moments (time.monotonic(), the jobs' clock), as a
    fraction of that span. The trace's start event gives the wall-clock time of its ts 0; the offset between
    this host's wall clock and its monotonic clock lines the two up."""
    try:
        trace = SchedulerTrace.load(trace_path)
    except (OSError, TraceFormatError) as exc:
        return {"error": str(exc)}
    if trace.unix_t0 is None:
        return {"error": f"{trace_path}: no start event"}
    mono_to_unix = time.time() - time.monotonic()
    lo, hi = first_s + mono_to_unix - trace.unix_t0, last_s + mono_to_unix - trace.unix_t0
    used = dict.fromkeys(groups, 0.0)
    for slot in trace.slots:
        if slot.group in used:
            used[slot.group] += max(0.0, min(slot.start_s + slot.dur_s, hi) - max(slot.start_s, lo))
    return {g: v / (hi - lo) for g, v in used.items()} if hi > lo else {}


def gemini_run(job_argv: list[str], args, work: Path, env: dict, tag: str, limit_s: float,
               torch_cache: bool = False) -> dict:
    """All jobs at once, one unified group each. Always returns a dict: the measures when every job finished,
    else "ok": False with the steps done, gem-ctl status, the swap counters and the backend's log tail.
    torch_cache: the jobs run with launch-command --torch-empty-cache-on-evict (PyTorch's cache emptied before
    each eviction)."""
    groups = [Group(f"j{i}", 0.0, 1.0, f"{int(args.job_gib + getattr(args, 'cached_gib', 0.0) + 2)}GiB",
                    memory_mode="unified")
              for i in range(args.jobs)]
    trace_dir = Path(args.trace_dir) if getattr(args, "trace_dir", None) else work
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace_path = trace_dir / f"um-{tag}-trace.json"
    t_start = time.monotonic()
    with Backend(work / tag, groups, env=env, quota_ms=None, min_quota_ms=None, window_ms=None,
                 extra_args=["--device-memory", f"{args.capacity_gib}GiB",
                             f"--schd-arg=--trace={trace_path}"]) as be:
        left = limit_s - (time.monotonic() - t_start)
        t0 = time.monotonic()
        with StatusPoller(be, getattr(args, "status_every_s", STATUS_EVERY_S)) as poller:
            commands = {g.name: be.command(g.name, job_argv) for g in groups}
            if torch_cache:
                for cmd in commands.values():
                    cmd.insert(cmd.index("--"), "--torch-empty-cache-on-evict")
            ran = run_jobs(commands, env, left, tag, args.stall_s)
        span = time.monotonic() - t0
        try:
            status: dict = ctl_status(be)
        except Exception as exc:  # noqa: BLE001 -- reported, the rest of the bench goes on
            stderr = getattr(exc, "stderr", "") or ""
            status = {"error": f"gem-ctl status failed: {stderr.strip() or exc}"}
        logs = be.logs(4000) if not ran["ok"] else ""
    counters = swap_counters(status) if "groups" in status else {}
    out: dict = {"ok": ran["ok"], "span_s": span, "steps_done": {n: j["steps_done"] for n, j in ran["jobs"].items()},
                 **{k: counters.get(k) for k in ("evictions", "moved_bytes", "swap_ms", "swap_gbps")},
                 "status_samples": poller.samples}
    if not ran["ok"]:
        out.update(timed_out=ran["timed_out"], jobs=ran["jobs"], status=status, swap_counters=counters,
                   backend_logs=logs)
        return out
    res = [j["result"] for j in ran["jobs"].values()]
    groups_st = {g["name"]: g for g in status.get("groups", [])}
    first = min(r["t0"] for r in res)
    last = max(r["t1"] for r in res)
    evictions = counters.get("evictions") or 0
    shares = slot_shares(trace_path, [g.name for g in groups], first, last)
    out.update({"measured_span_s": last - first, "jobs": res, "trace": str(trace_path),
                "shares_vs_maxutil": {g.name: {"share": shares.get(g.name), "max_util": g.max_util,
                                               "window_share_at_end": groups_st.get(g.name, {}).get("share")}
                                      for g in groups},
                "bytes_per_switch": (counters.get("moved_bytes") or 0) / evictions if evictions else 0,
                "ms_per_switch": (counters.get("swap_ms") or 0.0) / evictions if evictions else 0,
                "swap_fraction": (counters.get("swap_ms") or 0.0) / 1e3 / (last - first) if last > first else None,
                "swap_counters": counters})
    return out


class Budget:
    """The whole run's time, shared by its phases: each gets its own limit or what is left, if less."""

    def __init__(self, total_s: float):
        self.deadline = time.monotonic() + total_s

    def limit(self, phase_s: float) -> Optional[float]:
        left = self.deadline - time.monotonic()
        return min(phase_s, left) if left >= MIN_PHASE_S else None


def skipped(why: str = "out of time (--budget-s)") -> dict:
    return {"ok": False, "skipped": why}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--job-gib", type=float, default=10.0)
    p.add_argument("--capacity-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cpu-ms", type=float, default=40.0, help="host work per step (an input pipeline)")
    p.add_argument("--max-fraction", type=float, default=0.8)
    p.add_argument("--budget-s", type=float, default=440.0, help="the whole run's time limit")
    p.add_argument("--seq-s", type=float, default=200.0, help="time limit of the sequential phase (all jobs)")
    p.add_argument("--gemini-s", type=float, default=150.0, help="time limit of each gemini phase")
    p.add_argument("--alone-s", type=float, default=50.0, help="time limit of each alone run")
    p.add_argument("--stall-s", type=float, default=30.0, help="log a job that printed nothing for this long")
    p.add_argument("--status-every-s", type=float, default=STATUS_EVERY_S,
                   help="a gemini phase samples gem-ctl status this often (its status_samples)")
    p.add_argument("--skip", default="", help="comma list of runs to skip: no_cache,alone")
    p.add_argument("--cached-gib", type=float, default=0.0,
                   help="each job allocates and frees a temporary of this size after building its model, so "
                        "PyTorch keeps it cached (counted in the safety check and the groups' MemoryLimit)")
    p.add_argument("--torch-cache", action="store_true",
                   help="also run the phase torch_cache: the gemini phase with PyTorch's cache emptied before each "
                        "eviction (launch-command --torch-empty-cache-on-evict), against the gemini phase")
    p.add_argument("--trace-dir", default=None, help="keep gem-schd's trace of each gemini phase here "
                                                     "(um-<phase>-trace.json; default: the run's temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    free = free_gib()
    managed = args.jobs * (args.job_gib + args.cached_gib + 1.0)
    if managed > args.max_fraction * free or args.capacity_gib > args.max_fraction * free:
        print(json.dumps({"aborted": f"the jobs would hold {managed:.1f} GiB of managed memory (capacity "
                                     f"{args.capacity_gib} GiB) but the GPU has {free:.1f} GiB free: above "
                                     f"{args.max_fraction:.0%} of it the lent GPU can hang. Lower --jobs/--job-gib."}))
        return 2
    budget = Budget(args.budget_s)
    work = Path(tempfile.mkdtemp(prefix="bench-um-"))
    job_file = work / "job.py"
    job_file.write_text(JOB)
    job_argv = [sys.executable, str(job_file), str(args.job_gib), str(args.steps), str(args.cpu_ms),
                str(args.cached_gib)]
    env = dict(os.environ)
    out: dict = {"free_gib": free, "jobs": args.jobs, "job_gib": args.job_gib, "capacity_gib": args.capacity_gib,
                 "cached_gib": args.cached_gib,
                 "steps": args.steps, "cpu_ms": args.cpu_ms, "budget_s": args.budget_s}
    t_run = time.monotonic()

    # 1. sequential: one job after another, all within the phase's limit
    limit = budget.limit(args.seq_s)
    if limit is None:
        out["sequential"] = skipped()
    else:
        t0 = time.monotonic()
        seq: dict = {"ok": True, "jobs": []}
        for i in range(args.jobs):
            left = limit - (time.monotonic() - t0)
            if left < 1:
                seq.update(ok=False, timed_out=True)
                break
            ran = run_jobs({f"s{i}": job_argv}, env, left, "sequential", args.stall_s)
            one = ran["jobs"][f"s{i}"]
            seq["jobs"].append(one["result"] if ran["ok"] else one)
            if not ran["ok"]:
                seq.update(ok=False, timed_out=ran["timed_out"])
                break
        seq["span_s"] = time.monotonic() - t0
        if seq["ok"]:
            # the jobs' own step phases, one after another: what the swapped run's measured span is compared with
            seq["work_s"] = sum(j["seconds"] for j in seq["jobs"])
        out["sequential"] = seq

    # 2. (and 3.) gemini: the jobs at once in unified groups
    runs = [("gemini", env)]
    if args.torch_cache:
        runs.append(("torch_cache", env))
    if "no_cache" not in args.skip:
        runs.append(("no_cache", dict(env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")))
    for tag, run_env in runs:
        limit = budget.limit(args.gemini_s)
        out[tag] = skipped() if limit is None else \
            gemini_run(job_argv, args, work, run_env, tag, limit, torch_cache=tag == "torch_cache")
        if out["sequential"].get("ok") and out[tag].get("ok"):
            # Steps only (each job's start-up left out on both sides): the sum of the jobs' step phases run one
            # after another, against the span from the first job's first step to the last job's last step.
            out[tag]["throughput_vs_sequential"] = out["sequential"]["work_s"] / out[tag]["measured_span_s"]
            # Whole runs, start-ups included (the gemini phase overlaps them, the sequential one cannot).
            out[tag]["wall_vs_sequential"] = out["sequential"]["span_s"] / out[tag]["span_s"]
    if args.torch_cache and out["gemini"].get("ok") and out["torch_cache"].get("ok"):
        # what emptying the cache before each eviction saved: bytes moved per switch (out and back in)
        plain, emptied = out["gemini"]["bytes_per_switch"], out["torch_cache"]["bytes_per_switch"]
        out["torch_cache_saved_gib_per_switch"] = (plain - emptied) / GiB
    out["throughput_vs_sequential"] = out["gemini"].get("throughput_vs_sequential")
    out["wall_vs_sequential"] = out["gemini"].get("wall_vs_sequential")

    # 4. one job alone: device mode against unified mode
    if "alone" not in args.skip:
        alone: dict = {}
        for mode in ("device", "unified"):
            limit = budget.limit(args.alone_s)
            if limit is None:
                alone[mode] = skipped()
                continue
            g = Group("solo", 0.0, 1.0, f"{int(args.job_gib + 2)}GiB", memory_mode=mode)
            t0 = time.monotonic()
            with Backend(work / f"alone-{mode}", [g], env=env, quota_ms=None, min_quota_ms=None, window_ms=None,
                         extra_args=["--device-memory", f"{args.capacity_gib}GiB"]) as be:
                left = limit - (time.monotonic() - t0)
                ran = run_jobs({"solo": be.command("solo", job_argv)}, env, left, f"alone-{mode}", args.stall_s)
                alone[mode] = ran["jobs"]["solo"]["result"]["steps_per_s"] if ran["ok"] else \
                    {**skipped("failed"), "timed_out": ran["timed_out"], **ran["jobs"]["solo"],
                     "backend_logs": be.logs(3000)}
        out["alone_steps_per_s"] = alone
        if all(isinstance(v, float) for v in alone.values()):
            out["unified_alone_loss_pct"] = 100.0 * (1 - alone["unified"] / alone["device"])
    out["wall_s"] = time.monotonic() - t_run
    phases = [out["sequential"], *(out[t] for t, _ in runs)] + \
        [v for v in out.get("alone_steps_per_s", {}).values() if isinstance(v, dict)]
    out["ok"] = all(ph.get("ok", True) for ph in phases)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
