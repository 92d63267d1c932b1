"""Shared pytest setup: the source tree on sys.path, and the gpu marker's skip rule."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _have_gpu() -> bool:
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    # The simulated driver answers too; it identifies itself so GPU tests never run on it.
    return not hasattr(lib, "simcuda_is_simulated")


# These modules hold the simulated GPU and the real daemons to wall-clock bounds (shares over a window, reaction
# times, latencies), so they need the machine to themselves: each of their tests is marked `timed`, and `make
# test` runs them one at a time after the others, which it spreads over two pytest-xdist workers. (Run beside
# another worker, a capped group's host gaps grew and its share fell out of its bounds.)
# (Memory limits and the benchmark harness's time limits, with bounds of a second or more, need no such care.)
TIMED_MODULES = frozenset({
    "test_attacks", "test_e2e_charge", "test_e2e_hook", "test_e2e_latency", "test_e2e_unified",
    "test_e2e_unified_torch", "test_faults", "test_hook_board", "test_k8s_e2e", "test_sim_stopped", "test_simcuda",
})


# Tests of those modules with no wall-clock bound in them (limits, files, exit codes, deadlines of a minute) and
# little CPU of their own: they run with the others, two at a time, which keeps CI's serial phase shorter (CI's whole
# run is bounded too). (test_bench_shaped_jobs_evicted_while_starting_all_finish, three Python jobs and a backend,
# stays serial: beside it test_fuzz's idle pod manager once held a descriptor past the 5 s its leak check waited.)
UNTIMED_TESTS = frozenset({
    "test_fork_child_exits_cleanly_and_the_parent_keeps_launching",
    "test_in_a_container_the_environment_cannot_switch_the_hook_off",
    "test_pods_get_their_limits_and_only_their_own_group",
    # 4.3 s of the serial phase at 0.7 s of CPU: its bounds are the hook's own 2 s limits (counted by the hook) and
    # 9 s for 3 s of work
    "test_a_claim_whose_end_is_wrong_holds_the_gpu_gate_at_most_two_seconds",
    # The ones below, 30-37 s of the serial phase (the simulator sleeps their kernels and moves; their CPU, about a
    # second a second, is mostly the daemons' start-up), each with the bounds it has (in brackets: what came beside two
    # CPU hogs). test_the_least_recently_run_group_is_evicted stays serial: beside another worker and the hogs
    # gem-schd's order of grants once differed from the simulator's order of kernels by 15 ms; so does
    # test_three_unified_groups_swap_within_the_capacity, which failed once there (1 of 12 runs).
    # which prefetch ABI the driver's version got: the simulator's record
    "test_prefetch_uses_the_abi_the_driver_answers",
    # gem-ctl status and the simulator's free memory after a SIGKILL; waits of 20 s
    "test_a_killed_processs_resident_memory_comes_back",
    # bytes and flags in gem-schd's trace when every prefetch to the host fails; the jobs' exit codes
    "test_an_eviction_whose_prefetches_fail_is_reported_as_what_it_moved",
    # gem-ctl status's evictions and bytes moved; waits of 20 and 30 s
    "test_memory_allocated_in_a_slot_counts_as_moved_when_evicted",
    # the simulator's answers to two pitched allocations
    "test_a_pitch_allocation_whose_size_does_not_fit_64_bits_is_refused",
    # gem-schd's trace events; a 128 MiB move the simulator sleeps 34 ms for held under 1 s (34-38 ms)
    "test_gem_schd_traces_evictions_and_swaps",
    # 5 s for b's run with a's eviction in it (0.1-0.5 s), against the 10 s a process that never answers costs
    "test_a_starting_process_does_not_hold_up_an_eviction",
    # which blocks moved, the program's report and the files (no delay asserted, unlike its module's other three)
    "test_launch_command_sitecustomize_installs_the_delegate_when_torch_is_imported",
    # a fresh Python's modules and threads
    "test_the_sitecustomize_costs_nothing_without_torch",
    # exit codes, results, the hook's counts of launches and routes; GPU time at least the kernels' own (slept)
    "test_every_client_style_is_intercepted_and_every_launch_counted",
    # dlsym's answers in a program built by the test
    "test_dlsym_keeps_the_callers_semantics",
    # exit codes and empty output of programs without CUDA, and no connection from them
    "test_programs_without_cuda_are_untouched",
    # no capture broken, no launch failed; more than 100 markers in 300 captures (800-900)
    "test_the_queue_bound_never_breaks_a_capture_another_thread_begins",
    # no launch failed; 20 markers in each 200 launches before and after the reset (70-107)
    "test_the_queue_stays_bounded_after_the_primary_context_is_reset",
    # the simulator's count of live events (64); 50 markers in 1 s (1400-2400)
    "test_marker_events_the_driver_made_only_in_part_are_given_back",
    # 7-8 s of the serial phase: exit codes, error text and counters; the error within 5 s (0.1-0.3 s), a restart
    # within 10 s, and GPU time after it: 0.2 s of the survivor's 3000 launches' (3.1-4.2 s), 0.5 s of the bystander's
    # 3 s (1.3-2 s)
    "test_sigkill_of_a_pod_manager",
})


# Tests of other modules that hold the simulated GPU to a bound of a millisecond or so: beside another worker their
# simulator's GPU thread ran late and the bound failed (a flare's queue measured at 0.7 ms where the launch count
# gives 2; a kernel measured alone learnt with the next marker's 300 us in it: 3 of 8 phase-1 runs in the nineteenth
# session failed one of these; the second passed 8 runs of its own beside two CPU hogs).
TIMED_TESTS = frozenset({
    "test_a_flare_stops_a_trainers_mix_of_kernels_within_a_fraction_of_a_millisecond",
    "test_a_kernel_measured_alone_is_not_charged_the_markers_own_host_time",
    # gem-schd's timer held to a p50 under 1 ms over six grants: 1.17 ms once beside another worker (twenty-fifth
    # session's make test)
    "test_grant_at_deadline_is_punctual",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.stem in TIMED_MODULES and item.originalname not in UNTIMED_TESTS) or \
                item.originalname in TIMED_TESTS:
            item.add_marker(pytest.mark.timed)
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU driver (libcuda.so.1) on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The end-to-end fixtures (hook_lib, sim, backends, client_script) for every test module.
pytest_plugins = ["tests.e2e_fixtures", "tests.peer_fixtures"]
