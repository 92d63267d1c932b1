"""bench/bench_overhead.py's interleaved runs on the simulated driver: native, hooked with the group alone, and hooked
beside a neighbour that is configured but idle (the case whose markers cost a lone trainer on the GPU,
docs/benchmarks.md "Twenty-seventh session")."""
import os

from bench import bench_overhead as bo
from tests.e2e_fixtures import Sim
from tests.test_e2e_hook import workload


def test_train_rounds_run_native_alone_and_beside_an_idle_neighbour(tmp_path, hook_lib, monkeypatch):
    sim = Sim(tmp_path / "sim", hook_lib)
    monkeypatch.setattr(os, "environ", dict(sim.env()))
    program = workload("workload-procaddr", "--seconds", 0.4, "--sync-every", 4, "--json")
    r = bo.interleaved("t", 1, None, program, "kernels_done", 60, idle_neighbour=True)
    assert len(r["native"]) == len(r["hooked"]) == len(r["hooked_idle_neighbour"]) == 1, r
    assert len(r["runs"]["hooked_idle_neighbour"]) == 1, r
    assert min(r["native"] + r["hooked"] + r["hooked_idle_neighbour"]) > 100, r
    alone = [s for s in r["hook_stats"].values()]
    beside = [s for s in r["hook_stats_idle_neighbour"].values()]
    assert len(alone) == len(beside) == 1, r
    # alone its grants carry no bound: no markers; beside the configured neighbour, markers (sampled once N holds)
    assert alone[0]["markers"] == 0, alone
    assert beside[0]["markers"] > 50 and 0 < beside[0]["markers_timed"] <= beside[0]["markers"], beside
