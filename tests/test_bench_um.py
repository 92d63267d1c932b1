"""bench/bench_um.py's bounded runs, without a GPU: jobs that stall are killed at their phase's limit and the bench
still reports what it has (steps done per job, gem-ctl status, the swap counters, the backend's logs), instead of
dying with a TimeoutExpired and nothing else (what happened on the H100 before gem-schd paced its swaps)."""
from __future__ import annotations

import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from bench.bench_um import Budget, StatusPoller, gemini_run, run_jobs
from bench.harness import free_port_base
from tests.e2e_fixtures import clean_env

# A stand-in for the bench's job: ready, `steps` progress lines, done -- or after `stall_at` steps it hangs
# (ignoring SIGTERM, as a process stuck in a driver call would).
FAKE_JOB = r'''
import json, signal, sys, time
steps, stall_at = int(sys.argv[1]), int(sys.argv[2])
t0 = time.monotonic()
print(json.dumps({"ready": True, "t0": t0}), flush=True)
for i in range(steps):
    if i == stall_at:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stuck", flush=True)
        time.sleep(3600)
    time.sleep(0.01)
    print(json.dumps({"step": i + 1, "t": time.monotonic()}), flush=True)
t1 = time.monotonic()
print(json.dumps({"done": True, "steps": steps, "t0": t0, "t1": t1, "seconds": t1 - t0,
                  "steps_per_s": steps / (t1 - t0)}), flush=True)
'''


def fake_job(tmp_path: Path, steps: int, stall_at: int = -1) -> list[str]:
    path = tmp_path / "job.py"
    path.write_text(FAKE_JOB)
    return [sys.executable, str(path), str(steps), str(stall_at)]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_jobs_that_finish_report_their_results(tmp_path):
    ran = run_jobs({"a": fake_job(tmp_path, 5), "b": fake_job(tmp_path, 3)}, dict(os.environ), 30, "t")
    assert ran["ok"] and not ran["timed_out"]
    assert {n: j["steps_done"] for n, j in ran["jobs"].items()} == {"a": 5, "b": 3}
    assert ran["jobs"]["a"]["result"]["steps"] == 5 and ran["jobs"]["a"]["rc"] == 0


def test_a_stalled_job_is_killed_at_the_limit_and_its_progress_kept(tmp_path, caplog):
    caplog.set_level("INFO", logger="bench.um")
    t0 = time.monotonic()
    ran = run_jobs({"a": fake_job(tmp_path, 4), "b": fake_job(tmp_path, 50, stall_at=20)}, dict(os.environ),
                   3.0, "t", stall_s=1.0)
    took = time.monotonic() - t0
    assert ran["timed_out"] and not ran["ok"]
    assert 3.0 <= took < 3.0 + 15, took          # the limit, then SIGTERM (ignored) and SIGKILL
    a, b = ran["jobs"]["a"], ran["jobs"]["b"]
    assert a["result"] is not None and a["steps_done"] == 4
    assert b["result"] is None and b["steps_done"] == 20 and b["rc"] != 0 and "stuck" in b["tail"]
    text = caplog.text
    assert "t/b: step 20" in text and "t/b: no progress for" in text and "time limit 3 s reached" in text


def test_a_gemini_phase_that_times_out_reports_status_counters_and_logs(tmp_path):
    args = Namespace(jobs=2, job_gib=0.1, capacity_gib=1.0, stall_s=30.0, status_every_s=1.0)
    env = dict(clean_env(), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    before = set(os.listdir("/proc"))
    out = gemini_run(fake_job(tmp_path, 50, stall_at=2), args, tmp_path, env, "gemini", limit_s=5.0)
    assert out["ok"] is False and out["timed_out"] is True
    assert out["steps_done"] == {"j0": 2, "j1": 2}
    assert {g["name"] for g in out["status"]["groups"]} == {"j0", "j1"}
    assert set(out["swap_counters"]["per_group"]) == {"j0", "j1"} and out["evictions"] == 0
    assert "gem-schd" in out["backend_logs"] or "scheduler" in out["backend_logs"]
    # gem-ctl status sampled while it ran (every second here): each sample answered, the jobs' groups in it
    samples = out["status_samples"]
    assert len(samples) >= 3 and all("error" not in s for s in samples), samples
    assert all(set(s["groups"]) == {"j0", "j1"} for s in samples) and samples[-1]["t_s"] >= 3.0
    # nothing left behind: the jobs (and launch-command, and the program below it) are gone
    new = [int(p) for p in set(os.listdir("/proc")) - before if p.isdigit()]
    assert not [p for p in new if alive(p) and "job.py" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


def test_the_budget_gives_each_phase_its_limit_or_what_is_left():
    b = Budget(100.0)
    assert b.limit(30.0) == 30.0
    assert 99.0 < (b.limit(500.0) or 0) <= 100.0
    assert Budget(10.0).limit(30.0) is None      # under 15 s left: the phase is skipped, not started


class _Nowhere:
    """A backend where nothing listens (gem-ctl's options point at a free port)."""

    def __init__(self):
        self.port = free_port_base(1)

    def where_args(self) -> list[str]:
        return ["--port", str(self.port)]


def test_status_samples_record_when_gem_schd_does_not_answer():
    with StatusPoller(_Nowhere(), every_s=0.3, timeout_s=0.3) as poller:   # type: ignore[arg-type]
        time.sleep(1.0)
    assert poller.samples
    assert all("no answer from gem-schd" in s["error"] and s["took_s"] >= 0.3 for s in poller.samples), \
        poller.samples


def test_slot_shares_reads_each_groups_slot_time_between_two_moments(tmp_path):
    """bench_um's per-job share: slot time in gem-schd's trace, lined up with the jobs' monotonic clock through
    the trace's start event (unix_time_at_ts0), clipped to the span asked for."""
    from bench.bench_um import slot_shares
    mono_to_unix = time.time() - time.monotonic()
    first = time.monotonic() - 100.0                 # the span: 10 s, starting 100 s ago ...
    ts0 = first + mono_to_unix - 5.0                 # ... 5 s after the daemon's ts 0
    events = [{"ph": "i", "name": "config", "cat": "config", "ts": 0.0, "args": {"unix_time_at_ts0": ts0}},
              # a: 2 s inside the span, 1 s before it (not counted); b: 3 s, of which 1 s past the end
              {"ph": "X", "name": "a", "cat": "slot", "ts": 4e6, "dur": 3e6},
              {"ph": "X", "name": "b", "cat": "slot", "ts": 13e6, "dur": 3e6},
              {"ph": "X", "name": "a", "cat": "claim", "ts": 6e6, "dur": 5e6}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    got = slot_shares(path, ["a", "b", "c"], first, first + 10.0)
    assert got == pytest.approx({"a": 0.2, "b": 0.2, "c": 0.0}, abs=1e-3)
    assert "error" in slot_shares(tmp_path / "missing.json", ["a"], first, first + 1)


ENV_JOB = r'''
import json, os, sys, time
t0 = time.monotonic()
print(json.dumps({"ready": True, "t0": t0}), flush=True)
print(json.dumps({"step": 1, "t": time.monotonic()}), flush=True)
t1 = time.monotonic()
print(json.dumps({"done": True, "steps": 1, "t0": t0, "t1": t1, "seconds": t1 - t0, "steps_per_s": 1.0,
                  "delegate": os.environ.get("GEMINI_TORCH_EMPTY_CACHE_ON_EVICT"),
                  "site_first": os.environ.get("PYTHONPATH", "").split(os.pathsep)[0].endswith("torch_site")}),
      flush=True)
'''


@pytest.mark.parametrize("torch_cache", [False, True])
def test_the_torch_cache_phase_runs_the_jobs_with_the_eviction_delegate(tmp_path, torch_cache):
    """--torch-cache's phase is the gemini phase with launch-command --torch-empty-cache-on-evict: the jobs get
    gemini's sitecustomize first on PYTHONPATH and the variable that turns it on; the plain phase gets neither."""
    job = tmp_path / "env_job.py"
    job.write_text(ENV_JOB)
    args = Namespace(jobs=1, job_gib=0.1, cached_gib=0.5, capacity_gib=1.0, stall_s=30.0, status_every_s=1.0)
    env = dict(clean_env(), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = gemini_run([sys.executable, str(job)], args, tmp_path, env, "torch_cache", limit_s=30.0,
                     torch_cache=torch_cache)
    assert out["ok"], out
    assert [(j["delegate"], j["site_first"]) for j in out["jobs"]] == \
        ([("1", True)] if torch_cache else [(None, False)])
