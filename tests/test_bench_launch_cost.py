"""bench/launch_cost.c's in-process comparison: the driver's own cuLaunchKernel, found in libcuda's dynamic symbol
table, against the pointer cuGetProcAddress gave (the hook's, when it is preloaded). On the simulated driver."""
from __future__ import annotations

import subprocess

import pytest

from bench.harness import Group
from tests.e2e_fixtures import REPO_ROOT, run

LAUNCH_COST = REPO_ROOT / "build" / "bench" / "launch_cost"


def build_launch_cost() -> None:
    proc = subprocess.run(["make", "--no-print-directory", "-s", "bench-native"], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("sync", ["ctx", "stream"])
def test_natively_both_pointers_are_the_drivers(sim, sync):
    build_launch_cost()
    res = run([str(LAUNCH_COST), "40", "16", sync], sim.env())
    assert res.rc == 0, res
    out = res.json
    assert out["paired_found"] is True          # the symbol table lookup found cuLaunchKernel in libcuda
    assert out["paired_same_function"] is True  # no hook: cuGetProcAddress gave the driver's own function
    assert out["paired_pairs"] == 20


def test_under_the_hook_the_pairs_compare_the_hook_with_the_driver(sim, backends):
    build_launch_cost()
    be = backends([Group("solo", 0.0, 1.0)], quota_ms=5000, min_quota_ms=10)
    res = run([str(LAUNCH_COST), "40", "16"], sim.hooked(be, "solo"))
    assert res.rc == 0, res
    out = res.json
    assert out["paired_found"] is True
    # the lookup bypassed the hook: the pointer it found is not the one the hook handed out
    assert out["paired_same_function"] is False
    assert out["paired_via_median"] > 0 and out["paired_driver_median"] > 0
    # only the hooked half of the launches went through the hook: 200 warm-up + 40 batches + 20 of the 40 paired
    (stats,) = sim.stats().values()
    assert stats["launches"] == 200 + 40 * 16 + 20 * 16


MARKER_COST = REPO_ROOT / "build" / "bench" / "marker_cost"


def test_marker_cost_finds_the_gpu_time_a_wait_holds(sim):
    """bench/marker_cost.c on the simulated driver, each wait made to hold the device 2 ms
    (SIMCUDA_WAIT_VALUE_GPU_US): the waits and the markers are found about that much dearer than no operation, the
    events (which cost the simulated device nothing) far cheaper. Without the model the wait reads far less. (The
    bounds leave room for a starved host's timer: on two busy cores a run's noise came to 0.3 ms an operation over 39
    of them, and with a 1 ms model a wait once read 0.69 ms; now 79 operations, and the median of five rounds.)"""
    build_launch_cost()
    argv = [str(MARKER_COST), "--kernel-us", "100", "--kernels", "400", "--every", "5", "--rounds", "5"]
    sim.kernel_us = 100
    res = run(argv, sim.env(SIMCUDA_WAIT_VALUE_GPU_US="2000"))
    assert res.rc == 0, res
    out = res.json
    assert out["ops"] == 79
    assert all(1_400_000 < out[v + "_ns"] < 3_500_000 for v in ("wait", "marker", "marker_nt", "record_wait",
                                                                  "device_wait")), out
    assert max(abs(out["record_ns"]), abs(out["record_nt_ns"])) < out["wait_ns"] / 3, out
    plain = run(argv, sim.env())
    assert plain.rc == 0, plain
    assert abs(plain.json["wait_ns"]) < 600_000, plain.json    # (under two busy loops on two cores: 360 us)


@pytest.mark.parametrize("bad", [["--every", "0"], ["--kernels", "x"], ["--every", "50", "--kernels", "50"],
                                 ["stray"]])
def test_marker_cost_refuses_bad_arguments(sim, bad):
    build_launch_cost()
    res = run([str(MARKER_COST), *bad], sim.env())
    assert res.rc == 2 and "usage" in res.err, res
