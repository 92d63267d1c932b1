"""bench/bench_inference.py's bookkeeping, with its processes replaced by fakes: which cases run, and how the
idle-then-busy runs are summarised (the requests just after each pause against the same requests alone, and the
trainer against native time-slicing in the same pattern)."""
from __future__ import annotations

import json
import re
import types

import pytest

import bench.bench_inference as bi

# What the fake serve.py reports in each case: its p99, and with --idle-gaps the p99 just after the pauses.
P99 = {"alone": 2.0, "native": 6.0, "gemini-batch": 90.0, "gemini-latency": 4.0, "gemini-latency@0.15": 5.0}
AFTER_IDLE_P99 = {"alone": 1.5, "native": 7.0, "gemini-latency": 6.0}
# The fake trainer's steps/s over each case's span.
TRAIN = {"native": 60.0, "native-itb": 62.0, "gemini-batch": 55.0, "gemini-latency": 50.0, "gemini-latency@0.15": 57.0,
         "gemini-latency-itb": 54.0}


class FakeWorld:
    """Stands in for subprocess, the trainers and the backend, and tells the cases apart as the bench runs them:
    a run through launch-command is gemini's (its class read from the live config), otherwise native when a
    trainer is running, else alone."""

    def __init__(self):
        self.trainers = 0
        self.config = None
        self.last = ""
        self.served: list[str] = []
        self.pids: dict[str, list[int]] = {}      # each case's serving processes
        # what planned_seconds counts: serving seconds, process starts, the trainers' alone measurements
        self.serve_s = 0.0
        self.starts = 0
        self.alone_s = 0.0

    def run(self, argv, **_kw):
        at = next(i for i, a in enumerate(argv) if str(a).endswith("serve.py"))
        self.serve_s += float(argv[at + 4])
        self.starts += 1
        if argv[0] == "launch-command":
            infer = re.search(r"\[infer\]([^[]*)", self.config.read_text()).group(1)
            case = "gemini-" + re.search(r"Class = (\w+)", infer).group(1)
            min_util = float(re.search(r"MinUtil = ([0-9.]+)", infer).group(1))
            if case == "gemini-latency" and min_util != 0.5:    # --min-util's default: a latency@MU class
                case += f"@{min_util:g}"
        else:
            case = "native" if self.trainers else "alone"
        itb = "--idle-gaps" in argv
        self.last = case + ("-itb" if itb else "")
        self.served.append(self.last)
        p99 = P99.get(case, 4.5)
        pid = 1000 + self.starts
        self.pids.setdefault(self.last, []).append(pid)
        res = {"ok": True, "p50_ms": 1.0, "p99_ms": p99, "p999_ms": 2 * p99, "mean_ms": 1.0,
               "requests": 100, "late": 0, "t0": 0.0, "t1": 2.0, "pid": pid}
        if itb:
            res["after_idle"] = {"phases": 5, "requests": 50, "p50_ms": 1.0, "p99_ms": AFTER_IDLE_P99[case],
                                 "max_ms": 9.0, "first_ms": [1.0] * 5}
        if "--timeline" in argv:     # a request each ms; the gemini-latency case's GPU waits 3 ms in 1 of 100
            path = argv[argv.index("--timeline") + 1]
            res["timeline_file"] = path
            with open(path, "w") as f:
                for i in range(100):
                    a = i * 1_000_000
                    wait = 3_000_000 if case == "gemini-latency" and i == 50 else 0
                    f.write(f"{a} {a + 10_000} {a + 13_000} {a + 20_000 + wait} {a + 400_000} "
                            f"{a + 520_000 + wait} {a + 530_000 + wait}\n")
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(res), stderr="")


@pytest.fixture
def world(monkeypatch):
    w = FakeWorld()

    class Trainer:
        def __init__(self, argv, env):
            w.trainers += 1
            w.starts += 1

        def wait_ready(self):
            pass

        def measure_alone(self, seconds):
            w.alone_s += seconds
            return 64.0

        def rate(self, t0, t1):
            return TRAIN.get(w.last, 52.0)

        def stop(self):
            w.trainers -= 1

    class Backend:
        def __init__(self, workdir, groups, config=None, **kw):
            w.config = config
            w.starts += 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def command(self, group, argv):
            return ["launch-command", group, *argv]

        def logs(self):
            return ""

    monkeypatch.setattr(bi, "subprocess", types.SimpleNamespace(run=w.run))
    monkeypatch.setattr(bi, "Trainer", Trainer)
    monkeypatch.setattr(bi, "Backend", Backend)
    monkeypatch.setattr(bi, "read_stats", lambda path: {})
    monkeypatch.setattr(bi, "time", types.SimpleNamespace(sleep=lambda s: None))
    return w


def run_bench(capsys, *extra) -> dict:
    assert bi.main(["--seconds", "1", "--repeats", "1", "--workloads", "mlp:poisson:100", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_idle_then_busy_runs_alone_native_and_latency_and_compares_the_requests_after_a_pause(world, capsys):
    out = run_bench(capsys, "--idle-then-busy", "2:3")
    assert [c for c in world.served if c.endswith("-itb")] == ["alone-itb", "native-itb", "gemini-latency-itb"]
    s = out["summary"]
    itb = s["mlp:poisson:100 gemini-latency-itb"]
    assert itb["after_idle"]["p99_ms"] == 6.0
    assert itb["after_idle_p99_vs_alone_itb"] == pytest.approx(6.0 / 1.5)    # the same requests served alone
    assert itb["after_idle_p99_vs_alone"] == pytest.approx(6.0 / 2.0)        # the steady alone p99
    # the trainer against native time-slicing with the same pauses, not against the steady native run
    assert itb["train_vs_native"] == pytest.approx(54.0 / 62.0)
    assert s["mlp:poisson:100 gemini-latency"]["train_vs_native"] == pytest.approx(50.0 / 60.0)
    assert s["mlp:poisson:100 native-itb"]["after_idle_p99_vs_alone_itb"] == pytest.approx(7.0 / 1.5)


def test_without_pauses_no_idle_then_busy_run(world, capsys):
    out = run_bench(capsys)
    assert not [c for c in world.served if c.endswith("-itb")]
    assert not [k for k in out["summary"] if k.endswith("-itb")]


def test_timeline_names_the_part_of_a_slow_request_that_waited(world, capsys, tmp_path):
    out = run_bench(capsys, "--timeline", "--timeline-dir", str(tmp_path))
    s = out["summary"]
    tail = s["mlp:poisson:100 gemini-latency"]["timeline_tail"]
    assert tail["requests"] == 1
    assert tail["to_gpu_ms"] == pytest.approx(3.0)      # the slowest request waited for the GPU
    assert tail["span_ms"] == pytest.approx(0.5)
    assert tail["late_ms"] == pytest.approx(0.01) and tail["back_ms"] == pytest.approx(0.0)
    assert s["mlp:poisson:100 alone"]["timeline_tail"]["to_gpu_ms"] == pytest.approx(0.0)
    assert s["mlp:poisson:100 gemini-latency"]["timeline"]["slowest"][0]["to_gpu"] == pytest.approx(3.0)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == len(out["runs"]) and any("gemini-latency" in name for name in kept)


def test_without_timeline_serve_gets_no_timeline_file(world, capsys):
    out = run_bench(capsys)
    assert not [k for k, v in out["summary"].items() if "timeline" in v]


def test_classes_latency_alone_skips_the_batch_class_runs(world, capsys):
    out = run_bench(capsys, "--classes", "latency")
    assert "gemini-batch" not in world.served and "gemini-latency" in world.served
    assert "mlp:poisson:100 gemini-batch" not in out["summary"]


def test_each_gemini_case_reports_what_its_servers_slots_held_of_the_gpu(world, capsys, monkeypatch):
    """The serving processes' own hook counters (by pid, in the stats file) give what their slots or claims held of
    the GPU over each 2 s run: the median per case, beside what the trainer lost. Unhooked servers (alone, native)
    have no counters and report none."""
    def stats(path):
        used = {"gemini-latency": [500.0, 700.0, 600.0], "gemini-batch": [100.0, 100.0, 100.0]}
        return {pid: {"used_ms": used[case][i]} for case in used for i, pid in enumerate(world.pids[case])}
    monkeypatch.setattr(bi, "read_stats", stats)
    out = run_bench(capsys, "--repeats", "3")
    summary = out["summary"]
    assert summary["mlp:poisson:100 gemini-latency"]["server_used_share"] == pytest.approx(0.3)
    assert summary["mlp:poisson:100 gemini-batch"]["server_used_share"] == pytest.approx(0.05)
    assert "server_used_share" not in summary["mlp:poisson:100 native"]
    assert not [r for r in out["runs"] if "server_pid" in r or "span_s" in r]


@pytest.mark.parametrize("classes", ["latency,turbo", "latency@0", "latency@1.5", "batch@0.2", "latency@x"])
def test_an_unknown_class_is_a_clear_error(world, capsys, classes):
    with pytest.raises(SystemExit):
        bi.main(["--classes", classes])
    assert "--classes" in capsys.readouterr().err


def test_a_latency_class_at_another_claim_budget_is_served_and_summarised_apart(world, capsys):
    """`latency@0.15`: the serving group's MinUtil (its claim budget) is 0.15 in those runs, interleaved with the
    default budget's; each is summarised on its own, with the trainer against native time-slicing."""
    out = run_bench(capsys, "--classes", "latency,latency@0.15", "--repeats", "2")
    assert world.served.count("gemini-latency") == 2 and world.served.count("gemini-latency@0.15") == 2
    at = world.served.index("gemini-latency")
    assert world.served[at:at + 4] == ["gemini-latency", "gemini-latency@0.15"] * 2     # interleaved
    small = out["summary"]["mlp:poisson:100 gemini-latency@0.15"]
    assert small["p99_vs_alone"] == pytest.approx(5.0 / 2.0)
    assert small["train_vs_native"] == pytest.approx(57.0 / 60.0)
    assert out["summary"]["mlp:poisson:100 gemini-latency"]["train_vs_native"] == pytest.approx(50.0 / 60.0)


@pytest.mark.parametrize("extra,plan", [
    ((), dict(classes=2)),
    (("--repeats", "2", "--workloads", "mlp:periodic:50,resnet18:poisson:100", "--classes", "latency"),
     dict(repeats=2, workloads=2, classes=1)),
    (("--latency-variants", "a:GEMINI_INFLIGHT_MS=2;b:GEMINI_KERNEL_COSTS=0", "--idle-then-busy", "2:3"),
     dict(classes=2, variants=2, itb_seconds=30.0)),
    (("--gemini-only", "--classes", "latency"), dict(classes=1, gemini_only=True)),
    (("--classes", "latency,latency@0.2,latency@0.1"), dict(classes=3)),
])
def test_the_plan_counts_what_the_bench_runs(world, capsys, extra, plan):
    """gpu-check refuses a serving step whose plan passes its time limit (a call was lost to a run killed at it):
    the plan must count every serving run, trainer, backend and alone measurement the bench makes."""
    run_bench(capsys, *extra)
    measured = world.serve_s + world.alone_s + world.starts * bi.START_S
    args = dict(seconds=1.0, repeats=1, workloads=1, classes=2) | plan
    assert bi.planned_seconds(**args) == pytest.approx(measured)


def test_gpu_check_refuses_a_serving_step_longer_than_its_limit(monkeypatch):
    """The seventeenth session's lost call: two workloads, gpu-check's default 2 repeats, 60 s runs (about 920 s
    planned against the step's 590 s). It is refused at once, naming what to lower; one workload a call passes."""
    import bench.gpu_check as gc
    ran = []
    monkeypatch.setattr(gc, "bench", lambda ctx, argv, timeout: ran.append(argv) or {})
    args = types.SimpleNamespace(quick=False, infer_seconds=60.0, infer_repeats=2,
                                 infer_workloads="mlp:periodic:50,resnet18:poisson:100", infer_classes="latency",
                                 infer_variants="", infer_idle_then_busy="", infer_gemini_only=False,
                                 infer_timeline=False)
    ctx = types.SimpleNamespace(args=args, out=None)
    with pytest.raises(RuntimeError, match=r"about 920 s, over the step's 590 s limit.*--infer-repeats"):
        gc.step_infer(ctx)
    assert not ran
    args.infer_repeats, args.infer_workloads = 1, "mlp:periodic:50"
    gc.step_infer(ctx)
    assert len(ran) == 1

