"""End to end on the simulated driver: a capped group is charged the GPU time it used, not its own host's
idle gaps after its synchronisations, so it reaches its cap (issue 14: a tenant synchronising after every 1 ms
kernel sat 3% under its cap on an H100, by its own gaps)."""
from __future__ import annotations

from bench.harness import Group
from tests import native
from tests.e2e_fixtures import Sim, client_argv, finish, start

CAP = 0.3


def test_a_capped_group_that_thinks_after_each_sync_still_reaches_its_cap(tmp_path, hook_lib, backends):
    """1 ms kernels, a synchronisation after each, then 50 us of host work: with the simulator's own launch
    latency the GPU idles ~150 us per kernel, 13% of the group's time. Charged its slots' wall time the group
    got 0.256 of the GPU (measured with the gaps not taken off); charged the GPU time its hooks measured less
    the gaps, its slots stretch over them and its kernels reach 0.288 (the rest: the launch latency after
    each gap, which the host cannot see). The share is the busy time in the simulator's record of every
    kernel, after the first half second (a fresh group's full budget), over whole frames of the cap (a 30 ms slot
    in a partial 100 ms frame moved it by up to 0.6 points)."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("capped", 0.0, CAP)], quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--kernel-us", 1000, "--json", "--seconds", 4,
                                 "--sync-every", 1, "--think-us", 50), sim.hooked(be, "capped")))
    assert r.rc == 0, r
    kernels = sorted((row[2], row[3]) for row in native.read_trace(sim.trace)
                     if row[0] == r.json["pid"] and row[4] == "gem_spin")
    assert len(kernels) > 300
    t0, t1 = kernels[0][0] + 500_000_000, kernels[-1][1]
    t1 = t0 + (t1 - t0) // 100_000_000 * 100_000_000   # whole frames of the cap (100 ms): a partial one is noise
    busy = sum(max(0, min(e, t1) - max(s, t0)) for s, e in kernels)
    share = busy / (t1 - t0)
    # (0.275-0.290 over 14 runs on a 2-core machine, as with the policy before the twenty-fifth session: 0.278-0.290
    # over six; the old bound, 0.28, failed once in a full make test)
    assert CAP - 0.03 <= share <= CAP + 0.015, share


def test_timing_the_gaps_costs_the_program_little_between_a_synchronisation_and_its_next_launch(tmp_path, hook_lib,
                                                                                                 backends):
    """Each gap after a synchronisation is timed by two events, and the program waited for the hook's driver calls
    between the GPU's last kernel and its next launch: the reading of the last gap (cuEventElapsedTime, ~3 us on
    an H100) after the synchronisation returned, and the event before the burst's first kernel (cuEventRecord,
    ~1.6 us; with the bookkeeping 2.4-3 us). Now the reading happens before the next synchronisation, while the
    host waits anyway, and only one gap in eight is timed (the others: the host's measure plus what the timed
    ones exceeded it by). Here a cuEventRecord costs 200 us and a cuEventElapsedTime 1 ms (SIMCUDA_RECORD_US,
    SIMCUDA_ELAPSED_US): the hook's time after a synchronisation (sync_tail_ms: 125 us on average when one gap in
    eight is read there) and at a burst's start (burst_begin_ms) stay far below them, and the
    group is still charged what it used (the gaps are still forgiven: its kernels reach its cap)."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("capped", 0.0, CAP)], quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--kernel-us", 1000, "--json", "--seconds", 3,
                                 "--sync-every", 1, "--think-us", 50),
                     sim.hooked(be, "capped", SIMCUDA_RECORD_US="200", SIMCUDA_ELAPSED_US="1000")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["gaps_timed"] >= 5 and st["gaps_estimated"] >= 5 * st["gaps_timed"], st
    tail_us = st["sync_tail_ms"] * 1000 / st["syncs"]
    assert tail_us < 40, (tail_us, st)      # read after the synchronisation: about 125 us
    begin_us = st["burst_begin_ms"] * 1000 / st["syncs"]
    assert begin_us < 60, (begin_us, st)    # every gap timed: above 200 us each
    kernels = sorted((row[2], row[3]) for row in native.read_trace(sim.trace)
                     if row[0] == r.json["pid"] and row[4] == "gem_spin")
    t0, t1 = kernels[0][0] + 500_000_000, kernels[-1][1]
    t1 = t0 + (t1 - t0) // 100_000_000 * 100_000_000
    busy = sum(max(0, min(e, t1) - max(s, t0)) for s, e in kernels)
    # (the driver's calls, slept here, stretch the group's host gaps: its share is looser than the test above's;
    # 0.267-0.276 in six runs on a 2-core machine, 0.263 once beside another busy process. Its gaps not forgiven,
    # a slot of 1 ms kernels each followed by about 0.4 ms of host time would run about 0.3 / 1.4 = 0.21: an
    # estimate, not measured.)
    assert CAP - 0.045 <= busy / (t1 - t0) <= CAP + 0.015, busy / (t1 - t0)


def test_a_holder_wakes_its_watcher_once_per_slot_not_at_every_synchronisation(tmp_path, hook_lib, backends):
    """With another group waiting, a holder's watcher gives the slot back once the burst is over (the merge gap).
    It used to be woken at every synchronisation, a futex call and the watcher's contention for the gate just
    before the program's next launch (the hook's time after a synchronisation: 3-4 us with three busy groups on
    an H100, 0.8 us alone). Once told, the watcher looks every merge gap while a burst runs, so one wake a slot
    is enough, and the slot still passes on when the group goes idle."""
    sim = Sim(tmp_path / "sim", hook_lib)
    be = backends([Group("a", 0.0, 0.5), Group("b", 0.0, 0.5)], quota_ms=None, min_quota_ms=None, window_ms=None)
    argv = client_argv("workload-linked", "--kernel-us", 1000, "--json", "--seconds", 1.5, "--sync-every", 1)
    procs = [start(argv, sim.hooked(be, g)) for g in ("a", "b")]
    runs = [finish(p) for p in procs]
    for r in runs:
        assert r.rc == 0, r
        st = sim.stats_of(r.json["pid"])
        assert st["syncs"] > 250, st
        assert st["watcher_wakes"] < 0.2 * st["syncs"], st      # woken at every synchronisation: ~1 per sync


def test_a_synchronisation_waits_for_the_hooks_gap_event_only_when_that_gap_is_timed(tmp_path, hook_lib, backends):
    """The event that marks a gap's start goes after the queue's last kernel, just before the program's
    synchronisation, which then waits for it too: on an H100 a tenant of 1 ms kernels idled 4-7 us more per
    synchronisation while every gap was timed. It is recorded only for the gaps that are timed (one in eight).
    Here each cuEventRecord costs 3 ms of host time (SIMCUDA_RECORD_US), three kernels' worth: recorded before
    every synchronisation, the GPU idled about 2 ms after each 1 ms kernel (busy 0.3 of the time)."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("alone", 0.0, 1.0)], quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--kernel-us", 1000, "--json", "--seconds", 1.5,
                                 "--sync-every", 1),
                     sim.hooked(be, "alone", SIMCUDA_RECORD_US="3000")))
    assert r.rc == 0, r
    kernels = sorted((row[2], row[3]) for row in native.read_trace(sim.trace)
                     if row[0] == r.json["pid"] and row[4] == "gem_spin")
    t0, t1 = kernels[0][0] + 500_000_000, kernels[-1][1]
    busy = sum(max(0, min(e, t1) - max(s, t0)) for s, e in kernels) / (t1 - t0)
    assert busy > 0.45, (busy, sim.stats_of(r.json["pid"]))
