"""End to end on the simulated driver: latency-class groups claim the GPU next to a trainer, claims end when
their tenant dies or stops, the claim budget is the MinUtil, a lone holder's slot continues without a drain,
a capped group's deep queue does not carry it past its cap inside a slot, and its queue is kept within the
slot (deep enough to hide its host's pauses) unless a latency group may claim the GPU.

The simulated GPU runs the kernels of all processes one at a time in the order they were queued, so a
trainer's queue delays a latency tenant's kernels exactly as long as the hook lets it grow.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from bench.harness import Group, Trace, common_span, shares_over, write_config
from gemini.scheduler.policy import DEFAULT_BUCKET_MS
from tests import native
from tests.e2e_fixtures import Sim, client_argv, finish, held_for_claims, start

log = logging.getLogger(__name__)

KERNEL_US = 1000      # the trainer's kernels: 1 ms each


def trainer(seconds: float, *extra: object) -> list[str]:
    return client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", seconds,
                       "--sync-every", 64, *extra)


def requests(seconds: float, *extra: object) -> list[str]:
    """A request every 20 ms: two 0.5 ms kernels, then a synchronisation (1 ms of GPU work)."""
    return client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", seconds, "--period-us", 20000,
                       "--sync-every", 2, *extra)


def gaps_after(rows, pid: int, t_ns: int) -> float:
    """The longest pause (ms) between the given process's kernels after t_ns."""
    starts = [r[2] for r in rows if r[0] == pid and r[2] >= t_ns]
    return max((b - a for a, b in zip(starts, starts[1:])), default=0) / 1e6


def _serving(sim, backends, cls: str):
    be = backends([Group("inf", 0.5, 1.0, sched_class=cls), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    train = start(trainer(4.0), sim.hooked(be, "train"))
    time.sleep(0.5)
    inf = finish(start(requests(2.5), sim.hooked(be, "inf")))
    tr = finish(train)
    assert inf.rc == 0 and tr.rc == 0, (inf, tr)
    return inf.json, tr.json


def test_a_latency_group_claims_the_gpu_next_to_a_deep_queue(tmp_path, hook_lib, backends):
    """The trainer queues 64 kernels of 1 ms between synchronisations. A batch-class inference group waits for
    the trainer's slots to end; a latency-class one claims the GPU at once, the trainer pauses and its queued work
    is held at its next wait (the GPU-side gate), so a request waits for one or two of its kernels, not for its
    slot."""
    lat_inf, lat_train = _serving(Sim(tmp_path / "lat", hook_lib), backends, "latency")
    batch_inf, batch_train = _serving(Sim(tmp_path / "batch", hook_lib), backends, "batch")
    assert lat_inf["requests"] >= 100 and batch_inf["requests"] >= 100
    lat, batch = lat_inf["latency_us"], batch_inf["latency_us"]
    assert batch["p99"] > 30_000, batch                  # it waits for the trainer's 100 ms slots
    assert lat["p50"] < 6_000 and lat["p99"] < 15_000, lat
    assert lat["p99"] < batch["p99"] / 4, (lat, batch)
    # what the claims cost the trainer: about the inference's own GPU time (5%), not more than 15%
    assert lat_train["kernels_done"] >= 0.85 * batch_train["kernels_done"], (lat_train, batch_train)


def test_a_latency_group_configured_while_a_lone_holder_runs_gets_a_short_queue(tmp_path, hook_lib, backends):
    """The trainer holds the GPU alone (uncapped, no latency group: no bound on its queue) and is continued slot
    after slot, so it never receives another grant. The inference group then becomes latency class by a live
    config edit: the trainer's queue must become bounded, with the GPU-side gate's waits in it, at its next
    continuation, not at its next grant (which never comes), or every claim waits behind its queued kernels."""
    sim = Sim(tmp_path / "sim", hook_lib)
    groups = [Group("inf", 0.5, 1.0), Group("train", 0.0, 1.0)]
    # long slots: few deadlines, so few chances for a continuation that comes late (then the slot expires and is
    # granted afresh, with the new flags, and the case under test is gone)
    be = backends(groups, quota_ms=400, min_quota_ms=5, window_ms=10_000)
    # no synchronisation at all: one burst, so no burst renewal asks for a fresh grant either
    train = start(client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", 4.5,
                              "--sync-every", 0), sim.hooked(be, "train"))
    time.sleep(0.8)
    tmp = be.config_path.with_suffix(".new")
    write_config(tmp, [Group("inf", 0.5, 1.0, sched_class="latency"), groups[1]])
    os.replace(tmp, be.config_path)
    time.sleep(0.9)     # the reload, and a continuation of the trainer's 400 ms slot
    inf = finish(start(requests(2.5), sim.hooked(be, "inf")))
    tr = finish(train)
    assert inf.rc == 0 and tr.rc == 0, (inf, tr)
    st = sim.stats_of(tr.json["pid"])
    if st["grants"] > 1:
        pytest.skip(f"a continuation came late and the trainer was granted afresh (the case under test is gone): {st}")
    # granted once, continued ever since, and bounding its queue (markers, each behind a wait) since the edit
    assert st["continuations"] >= 5, st
    assert st["markers"] >= 100 and st["gpu_gate_waits"] >= 100 and held_for_claims(st) >= 50, st
    # (the simulated GPU interleaves the two processes kernel by kernel, so the latency itself does not show
    # the queue's depth here; on a GPU a claim waits for the queued work)


def test_a_group_configured_while_a_lone_uncapped_holder_runs_finds_its_queue_bounded(tmp_path, hook_lib, backends):
    """The trainer is the only group (uncapped: no bound on its queue, as nothing else could want the GPU) and is
    continued slot after slot, so it never receives another grant. A live edit then adds a second group: gem-pmgr
    would grant the trainer GRANT_BOUND now (it has a neighbour), but no grant comes, so the hook reads the board's
    count of groups at its next continuation; before, its queue stayed unbounded until a fresh grant, and the new
    group's first slot would start after the whole of it."""
    sim = Sim(tmp_path / "sim", hook_lib)
    train = Group("train", 0.0, 1.0)
    be = backends([train], quota_ms=400, min_quota_ms=5, window_ms=10_000)
    tr = start(client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", 3.5,
                           "--sync-every", 0), sim.hooked(be, "train"))
    time.sleep(0.8)
    tmp = be.config_path.with_suffix(".new")
    write_config(tmp, [train, Group("other", 0.0, 1.0)])
    os.replace(tmp, be.config_path)
    tr = finish(tr)
    assert tr.rc == 0, tr
    st = sim.stats_of(tr.json["pid"])
    if st["grants"] > 1:
        pytest.skip(f"a continuation came late and the trainer was granted afresh (the case under test is gone): {st}")
    assert st["continuations"] >= 5, st
    # bounded since the edit: a marker every few of its 1 ms kernels (none before, with the GPU to itself)
    assert st["markers"] >= 100, st


def _claims_beside_a_trainer(tmp_path, hook_lib, backends, period_us: int):
    """A latency tenant's requests (two 0.5 ms kernels and a synchronisation, every `period_us`; 0: back to back)
    beside the trainer: the tenant's and the trainer's counters, and the tenant's JSON report."""
    sim = Sim(tmp_path / "sim", hook_lib)
    be = backends([Group("inf", 0.5, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    train = start(trainer(3.0), sim.hooked(be, "train"))
    time.sleep(0.3)
    inf = finish(start(client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", 2.0,
                                   "--period-us", period_us, "--sync-every", 2), sim.hooked(be, "inf")))
    tr = finish(train)
    assert inf.rc == 0 and tr.rc == 0, (inf, tr)
    return sim.stats_of(inf.json["pid"]), sim.stats_of(tr.json["pid"]), inf.json


def test_requests_that_arrive_apart_give_the_claim_back_at_once(tmp_path, hook_lib, backends):
    """Requests 20 ms apart: holding the claim GEMINI_CLAIM_IDLE_MS (0.5 ms) after each would only keep the
    trainer paused that much longer per request (on the H100 0.5 ms of a 2 ms pause, 50 times a second). The
    hook sees that its bursts never follow within that time and gives each claim back as its burst ends."""
    inf, tr, _ = _claims_beside_a_trainer(tmp_path, hook_lib, backends, 20_000)
    assert held_for_claims(tr) >= 30 and inf["early_releases"] >= 30, (inf, tr)
    # Most claims went back as their burst ended (all but the first 8 requests' on an idle machine: too few gaps
    # seen to judge). Not all: on a loaded machine the client falls behind its schedule and sends requests back
    # to back, and then holding the claim is right.
    assert inf["quick_claim_releases"] >= 0.5 * inf["early_releases"], inf
    # (the simulated GPU does not show the trainer's shorter pauses: each of its pauses is dominated by the
    # request's wait for the trainer's own queued 1 ms kernels; bench_inference measures them on the GPU)


def test_a_latency_request_launches_before_its_claim_is_answered(tmp_path, hook_lib, backends):
    """Once its group has claimed, a latency process knows the answer to its next request: another claim. It
    launches the request's kernels at once and its claimer thread asks meanwhile, so no request waits for the
    pod manager (0.35-0.43 ms a request on the H100, 0.5 ms here). The claims still reach the board: the trainer
    pauses for each. (With GEMINI_EARLY_CLAIM_MS=0 every request's first launch waits.)"""
    inf, tr, _ = _claims_beside_a_trainer(tmp_path, hook_lib, backends, 20_000)
    assert inf["grants"] >= 30 and held_for_claims(tr) >= 30, (inf, tr)
    # every claim after the first was asked for early; only the first request waited for its answer
    assert inf["early_claims"] >= inf["grants"] - 2, inf
    assert inf["waits"] <= 2, inf
    assert inf["gate_errors"] == 0, inf
    # how long each such request ran before its claim's answer is counted (the pod manager's way: 0.4-0.6 ms
    # here), so that an operator sees how much of a request ran before the batch holders made way
    lag_ms = inf["early_claim_lag_ms"] / inf["early_claims"]
    assert 0.01 < lag_ms < 50, inf
    # ... which the group's flare covers: each early request raised it at its first launch (hook/flare.h), and the
    # pod manager's audit never took the right away (every flare was followed by its request)
    assert inf["flares"] >= inf["early_claims"] - 2, inf


def test_back_to_back_bursts_keep_their_claim(tmp_path, hook_lib, backends):
    """Bursts that follow each other at once (a decoding loop that synchronises every token) keep the claim
    through the idle hold: giving it back between them would make each burst ask again."""
    inf, tr, _ = _claims_beside_a_trainer(tmp_path, hook_lib, backends, 0)
    assert inf["quick_claim_releases"] == 0, inf
    assert inf["grants"] <= 0.2 * inf["launches"] / 2, inf     # far fewer claims than bursts


def test_the_claim_budget_is_the_min_util(tmp_path, hook_lib, backends):
    """A latency tenant that never stops (a claim after another) with MinUtil 0.3 next to a busy trainer:
    gem-schd takes its right to claim away when the budget is spent, and the trainer keeps most of the GPU
    it would get against a batch group with the same floor."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("inf", 0.3, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    traces = {g: tmp_path / f"{g}.trace" for g in ("inf", "train")}
    procs = {"train": start(trainer(5.0, "--trace", traces["train"]), sim.hooked(be, "train")),
             "inf": start(client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", 5.0,
                                      "--sync-every", 2, "--trace", traces["inf"]), sim.hooked(be, "inf"))}
    results = {g: finish(p) for g, p in procs.items()}
    for r in results.values():
        assert r.rc == 0, r
    loaded = {g: Trace.read(p) for g, p in traces.items()}
    s, e = common_span(loaded, trim_s=1.0)
    shares = shares_over(loaded, s, e)
    # without the budget the claims would take the GPU (the trainer paused at every claim): 0.09 with the right
    # never taken away; with it 0.44-0.52 here beside three CPU hogs (CI had 0.448 on 2 cores), ~0.5 against a
    # batch group with the same floor
    assert shares["train"] >= 0.35, shares
    assert shares["inf"] >= 0.25, shares        # and the floor holds
    assert held_for_claims(sim.stats_of(results["train"].json["pid"])) > 0, "no claim ever held the trainer"
    # early claims only while the right lasts: once a request is answered with a slot, the hook asks before
    # launching until it is granted a claim again (else each request after the first would go early)
    st = sim.stats_of(results["inf"].json["pid"])
    assert st["gate_errors"] == 0 and 0 < st["early_claims"] < st["grants"] - 1, st


def _flat_out_latency_and_trainer(tmp_path, hook_lib, backends):
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("inf", 0.5, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    train = start(trainer(4.0), sim.hooked(be, "train"))
    inf = start(client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", 30, "--sync-every", 2),
                sim.hooked(be, "inf"))
    time.sleep(1.5)
    return sim, train, inf


def test_a_latency_tenant_killed_mid_claim_frees_the_gpu(tmp_path, hook_lib, backends):
    sim, train, inf = _flat_out_latency_and_trainer(tmp_path, hook_lib, backends)
    killed = time.monotonic_ns()
    inf.send_signal(signal.SIGKILL)
    inf.wait()
    tr = finish(train)
    assert tr.rc == 0, tr
    rows = native.read_trace(sim.trace)
    # its pod manager ends the claim when the connection closes; the trainer's kernels go on at once
    assert gaps_after(rows, tr.json["pid"], killed + 50_000_000) < 60, gaps_after(rows, tr.json["pid"], killed)


def test_a_stopped_latency_tenant_cannot_hold_the_gpu(tmp_path, hook_lib, backends):
    """SIGSTOP mid-claim: its connection stays open, but a claim lasts at most 20 ms (on the board and in its
    pod manager). A tenant that never stops has spent its claim budget and queues for slots like any other,
    so it may be stopped in a 100 ms slot of its own: the trainer is paused for at most that slot."""
    sim, train, inf = _flat_out_latency_and_trainer(tmp_path, hook_lib, backends)
    stopped = time.monotonic_ns()
    os.kill(inf.pid, signal.SIGSTOP)
    try:
        tr = finish(train)
    finally:
        os.kill(inf.pid, signal.SIGKILL)
        inf.wait()
    assert tr.rc == 0, tr
    rows = native.read_trace(sim.trace)
    assert gaps_after(rows, tr.json["pid"], stopped + 150_000_000) < 150


def test_a_lone_holder_keeps_its_slot_without_draining(sim, backends):
    """Alone on the GPU, a busy group's slots are continued at every deadline: it never drains or asks."""
    be = backends([Group("solo", 0.0, 1.0)], quota_ms=20, min_quota_ms=5, window_ms=1000)
    r = finish(start(trainer(1.5), sim.hooked(be, "solo")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    # 1.5 s of 20 ms slots: continued at nearly every deadline (a late timer on a loaded machine may miss one)
    assert st["continuations"] >= 50, st
    assert st["drains"] <= 8 and st["grants"] <= 8, st


def test_a_capped_group_with_a_deep_queue_stays_under_its_cap_every_second(tmp_path, hook_lib, backends):
    """MaxUtil 0.05 and 800 kernels of 1 ms queued between synchronisations: without a short queue the first
    slot's queue alone is 0.8 s of GPU. The cap's bucket (25 ms) is granted whole, once it has refilled: its slots
    (each with its drain, a burst of kernels) start at least 400 ms apart (500 ms of refill at 0.05, less what the
    charges miss of the overlaps with the neighbour at either end of a slot), its share over whole periods at most 0.3
    points over the cap (and at most a point under: beside CPU hogs its charges ran long, 0.045-0.049), and every 1 s
    window (from the simulator's record of every kernel) is within the bucket's bound: MaxUtil x 1 s + the depth
    (0.075), plus the halves of its overruns that the next holder paid (_settle splits an overrun evenly; the
    simulator runs it all as this group's). Usually a window holds two bursts (0.053-0.058, and 0.055 on an H200 in
    the thirty-second session, under issue 13's goal of 0.07, which bench/ measures on the GPU); but a period shortened
    by such a charge puts three in one (0.072 on CI's machine, 0.0755 here beside two CPU hogs): the bucket bounds
    every interval to 0.075, not 0.07. It starts alone, so that the neighbour joins at its virtual
    time and it has the least at the neighbour's slot ends: granted there as soon as half a bucket allowed a slot,
    it ran 16 ms every 316 ms (0.055 over whole periods, 0.068-0.077 in its worst second), which the periods'
    bound catches."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("small", 0.0, 0.05), Group("other", 0.0, 1.0)], quota_ms=100, min_quota_ms=5,
                  window_ms=10_000)
    small = start(client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", 5,
                              "--sync-every", 800), sim.hooked(be, "small"))
    time.sleep(0.3)
    other = start(trainer(5.0), sim.hooked(be, "other"))
    results = {"small": finish(small), "other": finish(other)}
    for r in results.values():
        assert r.rc == 0, r
    pid, other_pid = results["small"].json["pid"], results["other"].json["pid"]
    rows = native.read_trace(sim.trace)
    kernels = sorted((r[2], r[3]) for r in rows if r[0] == pid and r[4] == "gem_spin")
    assert len(kernels) > 100
    bursts = [[kernels[0]]]         # a slot and its drain: kernels less than 100 ms apart
    for k in kernels[1:]:
        if k[0] - bursts[-1][-1][1] > 100_000_000:
            bursts.append([k])
        else:
            bursts[-1].append(k)
    # from the neighbour's first kernel on (alone, a capped group is granted half a bucket, as before)
    joined = min(r[2] for r in rows if r[0] == other_pid and r[4] == "gem_spin")
    bursts = [b for b in bursts if b[0][0] >= joined]
    starts = [b[0][0] for b in bursts]
    periods = [(b - a) / 1e6 for a, b in zip(starts, starts[1:])]
    assert len(bursts) >= 7 and min(periods) >= 0.8 * DEFAULT_BUCKET_MS / 0.05, periods
    mean = sum(e - s for b in bursts[:-1] for s, e in b) / (starts[-1] - starts[0])
    assert 0.04 <= mean <= 0.053, (mean, periods)
    t0, t1 = kernels[0][0], kernels[-1][1]
    worst = 0.0
    t = t0 + 1_000_000_000
    while t <= t1:
        busy = sum(max(0, min(e, t) - max(s, t - 1_000_000_000)) for s, e in kernels)
        worst = max(worst, busy / 1e9)
        t += 100_000_000
    assert worst <= 0.05 + DEFAULT_BUCKET_MS / 1000 + 0.005, (worst, periods)


def _capped_loop_share(tmp_path, hook_lib, backends, neighbour: Group | None, **env) -> tuple[float, dict]:
    """The GPU share (busy time over the run, from the simulator's record of every kernel) of a MaxUtil 0.5
    loop whose host side pauses 6 ms after every 8 launches of 1 ms kernels, as a training loop's Python and
    data loading do, and its hook's counters; a neighbour group, if any, only sits in the config. `env`: more
    settings of the loop's process (the hook's or the simulated driver's)."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    groups = [Group("capped", 0.0, 0.5)] + ([neighbour] if neighbour else [])
    be = backends(groups, quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", 3,
                                 "--sync-every", 0, "--pause-us", 6000, "--pause-every", 8),
                     sim.hooked(be, "capped", **env)))
    assert r.rc == 0, r
    kernels = sorted((row[2], row[3]) for row in native.read_trace(sim.trace)
                     if row[0] == r.json["pid"] and row[4] == "gem_spin")
    assert len(kernels) > 100
    t0, t1 = kernels[0][0] + 500_000_000, kernels[-1][1]       # past the first half second's full bucket
    busy = sum(max(0, min(e, t1) - max(s, t0)) for s, e in kernels)
    return busy / (t1 - t0), sim.stats_of(r.json["pid"])


def test_a_capped_loop_with_host_pauses_keeps_its_slot_queued(tmp_path, hook_lib, backends):
    """With no latency group in the config a capped group's queue may hold half the time left in its slot: its
    host pauses (6 ms per 8 ms of GPU work) are mostly hidden behind the queue, and it runs at 0.43 of the GPU
    under its cap of 0.5 (the rest: each slot's end drains the queue and the next starts empty), against 0.34
    with the 1 ms queue that a latency group's presence asks for (the next test: the same loop)."""
    share, _ = _capped_loop_share(tmp_path, hook_lib, backends, None)
    assert 0.40 <= share <= 0.55, share


def test_next_to_a_latency_group_a_capped_loop_keeps_its_slot_queued_behind_the_gpu_gate(tmp_path, hook_lib,
                                                                                         backends):
    """A latency group in the config may claim at any moment. The GPU-side gate (hook/gpugate.h) stops the batch
    stream at its next marker's wait when a claim begins, so a claim need not wait for the queue: the loop keeps
    as much queued as without a latency group, and its host pauses stay hidden (0.34 of the GPU with the 1 ms
    queue claims needed before the gate: the next test)."""
    share, st = _capped_loop_share(tmp_path, hook_lib, backends, Group("inf", 0.2, 1.0, sched_class="latency"))
    assert st["gpu_gate_waits"] >= 100 and st["gpu_gate_failures"] == 0, st
    assert 0.40 <= share <= 0.55, share


@pytest.mark.parametrize("launchers", [1, 4])
def test_a_claim_holds_a_deep_batch_queue_on_the_gpu(tmp_path, hook_lib, backends, client_script, launchers):
    """The trainer launches 1 ms kernels without ever synchronising, beside an idle-but-configured latency group,
    so its queue may be tens of ms deep. Every 60 ms the latency tenant runs a request of 16 kernels of 0.5 ms.
    The simulated GPU runs the two processes' queued kernels in turn (as a GPU time-slices them), so whatever the
    trainer has queued past its next wait would run inside the request: held at its wait by the claim, at most
    the kernel already past it does, and whatever came before the claim was written (the request's first kernels
    go ahead of their claim). With the word never raised, 7-8 of the trainer's kernels ran inside each request.
    `launchers` = 4: four threads of the trainer launch on one stream they share (each places its own markers by
    its own kernels' costs, and a kernel measured alone between one thread's markers may have others' with it).
    Three quarters of the requests, not nine tenths: on a starved host (two cores, CI's, beside CPU hogs) a request
    here and there is not covered by a claim while it runs -- its early claim answered tens of ms after its launch
    (its flare holds the trainer for 2 ms), or its 20 ms claim run out before the tenant's starved threads had run its
    kernels -- and up to four of some thirty requests ran with the trainer's kernels. A gate that fails does so in
    most requests: with the word never raised every request had 7-8 of them, and when the launches of a coarse
    clock's tick after a claim's end went past the markers (hook/gate.h) a second of requests had 15 each."""
    sim = Sim(tmp_path / "sim", hook_lib, trace=tmp_path / "kernels.trace")
    be = backends([Group("inf", 0.5, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    argv = (client_argv("workload-linked", "--kernel-us", KERNEL_US, "--json", "--seconds", 3.0, "--sync-every", 0)
            if launchers == 1 else client_argv("e2e", "threads", 3.0, launchers, KERNEL_US, 0, script=client_script))
    train = start(argv, sim.hooked(be, "train"))
    time.sleep(0.5)
    inf = finish(start(client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", 2.0,
                                   "--period-us", 60_000, "--sync-every", 16), sim.hooked(be, "inf")))
    tr = finish(train)
    assert inf.rc == 0 and tr.rc == 0, (inf, tr)
    st = sim.stats_of(tr.json["pid"])
    assert st["gpu_gate_waits"] >= 100 and st["gpu_gate_raises"] >= 15, st
    rows = [r for r in native.read_trace(sim.trace) if r[4] == "gem_spin"]
    req = sorted((r[2], r[3]) for r in rows if r[0] == inf.json["pid"])
    trained = sorted(r[2] for r in rows if r[0] == tr.json["pid"])
    # the requests: runs of the tenant's kernels, split where the tenant's GPU sat idle for 20 ms
    spans, first, last = [], req[0][0], req[0][1]
    for s, e in req[1:]:
        if s - last > 20_000_000:
            spans.append((first, last))
            first = s
        last = e
    spans.append((first, last))
    inside = sorted(sum(1 for t in trained if a < t < b) for a, b in spans)
    assert len(inside) >= 20, inside
    assert inside[len(inside) // 2] <= 2 and inside[int(len(inside) * 0.75)] <= 3, inside


def test_without_the_gpu_gate_a_capped_loop_next_to_a_latency_group_keeps_its_queue_tight(tmp_path, hook_lib,
                                                                                          backends):
    """On a driver without stream memory operations the hook says so and goes on without the gate (as with
    GEMINI_GPU_GATE=0, which test_a_queue_too_deep_for_its_markers_is_caught_at_the_synchronisation relies on): a
    claim then takes effect only after the batch group's queued work, so that queue stays about 1 ms
    (GEM_GRANT_TIGHT), and the same loop idles the GPU during its host pauses."""
    share, st = _capped_loop_share(tmp_path, hook_lib, backends, Group("inf", 0.2, 1.0, sched_class="latency"),
                                   SIMCUDA_NO_STREAM_MEMOPS="1")
    assert st["gpu_gate_waits"] == 0 and st["gpu_gate_failures"] == 1, st
    assert share <= 0.37, share


def test_short_kernels_never_queue_far_past_a_capped_slot(sim, backends):
    """20 us kernels with no synchronisation at MaxUtil 0.3: the marker rate grows to hundreds of launches per
    marker, yet every interval it measures is scaled to the rate in force, so it never overshoots; each slot's
    queued work ends within a few ms of its deadline (a rate judged on intervals measured at a lower rate grew
    to 4096 launches per marker: about 100 ms past every deadline, 8 slots in 3 s, where its cap's frames allow 30)."""
    be = backends([Group("capped", 0.0, 0.3)], quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--kernel-us", 20, "--json", "--seconds", 3, "--sync-every", 0),
                     sim.hooked(be, "capped")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["grants"] >= 25, st           # a slot per 100 ms frame of the cap
    assert st["overuse_ms"] / st["grants"] <= 10, st
    assert st["markers"] > 0, st


def _lone_loop_beside_an_idle_group(sim, backends, seconds: float) -> dict:
    """The hook's counters of a loop of 20 us kernels that never synchronises, in an uncapped group beside a batch
    group that is configured but never comes: its grants carry GEM_GRANT_BOUND, so it places a marker every N
    launches (gem-pmgr `_grant_flags`)."""
    be = backends([Group("train", 0.0, 1.0), Group("idle", 0.5, 1.0)], quota_ms=None, min_quota_ms=None,
                  window_ms=None)
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", seconds, "--kernel-us", 20,
                                 "--sync-every", 0), sim.hooked(be, "train")))
    assert r.rc == 0, r
    return sim.stats_of(r.json["pid"])


def test_markers_placed_every_n_launches_are_sampled_once_n_holds(sim, backends):
    """Markers placed every N launches come every quarter to half millisecond of GPU work, and a timed one costs an
    H200 about 2.2 us between kernels: an uncapped trainer beside a configured but idle group paid it at every one.
    Once an interval judged at the rate in force has left N where it is, only a pair in eight is timed, but for the
    markers after a halving of N (inflight.c, marker_timed). Here 29-45% are (47% beside two CPU hogs): the simulated
    driver's kernels run 20-40 us as its host threads are scheduled, and such intervals halve N now and then. Fails with
    GEMINI_MARKER_SAMPLING=0 and with the rule before this one (every marker placed every N launches timed): 100%.
    (Not shown here: that N still finds its first level with every marker timed, as the review of `0d73272` asked; on
    this driver the noise hides how fast N grows, and a version sampled from the first measure ramped no slower.)"""
    st = _lone_loop_beside_an_idle_group(sim, backends, 1.5)
    assert st["markers"] >= 200 and st["marker_grows"] >= 3, st
    assert st["markers_timed"] <= 0.7 * st["markers"], st



def _bounded(backends):
    """A batch group beside an idle latency group (so its queue is bounded)."""
    return backends([Group("lat", 0.2, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                    min_quota_ms=5, window_ms=10_000)


def test_a_long_chain_times_few_of_its_markers(sim, backends):
    """A timed event's record makes the GPU finish the work before it (2.2 us between 20 us kernels on the H200,
    as much as the gate's wait; an untimed one nothing measurable: bench/marker_cost.c). Beside a latency group a
    loop of 20 us kernels that never synchronises records a marker every half millisecond: once an interval of its
    chain has been measured, only the markers whose time is read are timed -- those around a kernel measured alone,
    and a pair in every eight. GEMINI_MARKER_SAMPLING=0 (every marker timed, as before) fails this. (A capped loop's
    markers, placed every N launches, are timed while N finds its level, then sampled too:
    test_markers_placed_every_n_launches_are_sampled_once_n_holds.)"""
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 1.5, "--kernel-us", 20, "--sync-every", 0),
                     sim.hooked(_bounded(backends), "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["markers"] >= 200 and st["kernel_costs_learnt"] >= 1, st
    # A kernel measured alone times the markers on both its sides, and how many are measured varies from run to run
    # (a cost check measures the next 64 launches alone: 228-751 kernels in five runs), so those are set aside. The
    # rest: 25-30% (a pair in eight, and each chain's first markers); 100% with every marker timed.
    assert st["markers_timed"] - 2 * st["kernels_measured"] <= 0.35 * st["markers"], st


def test_marker_events_the_driver_made_only_in_part_are_given_back(sim, backends):
    """A stream's ring of marker events is created at its first marker: 64 timed and 64 untimed events. When the
    driver refuses one part-way (here the third untimed one), the events already made are destroyed and the ring is
    tried again some markers later; before, they were left behind, and every marker tried again and left more.
    The simulated driver counts the process's live untimed events (only the markers make them): one ring's 64."""
    env = sim.hooked(_bounded(backends), "train")
    env["SIMCUDA_UNTIMED_EVENT_FAIL_AT"] = "3"
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 1.0, "--kernel-us", 20, "--sync-every", 0),
                     env))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["markers"] >= 50, st                  # the ring was made on a later try, and the queue bounded
    assert r.json["live_untimed_events"] == 64, r.json


@pytest.mark.parametrize("sync", ["ctx", "stream"])
def test_a_loop_that_synchronises_after_every_second_launch_learns_its_kernel(sim, backends, sync):
    """Beside a latency group a kernel new to the cost table is measured alone: a marker before it, and its end
    recorded when its thread next launches. A program that synchronises after every second launch never launched
    again before the synchronisation restarted the chain: the kernel was never learnt, and every second launch was
    measured alone again, a marker each (about 5 us of the thread's time on an H100). Its end is now recorded
    before the synchronisation (gate.c, gem_gate_end_unit_before_sync)."""
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 1.0, "--kernel-us", 20, "--sync-every", 2,
                                 "--sync", sync), sim.hooked(_bounded(backends), "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["launches"] >= 1000 and st["kernel_costs_learnt"] >= 1, st
    # Before, every second launch was measured alone, a marker each (nothing learnt). Now a handful are measured: 2-4
    # on an idle 2-core machine, up to 44 in 2400 launches with six CPU hogs beside it (a measure stretched by a
    # stall learns a cost too long, measured again). The markers: one in 17-20 launches idle; under CPU load
    # one in 5-7, as the costs learnt too long place them closer (CI: 1799 in 9434).
    assert st["kernels_measured"] <= st["launches"] / 10, st
    assert st["markers"] <= st["launches"] / 4, st


@pytest.mark.parametrize("first", ["40:2000", "620:600"])
def test_a_kernel_whose_cost_was_learnt_too_long_is_measured_again_at_once(sim, backends, first):
    """The same kernel (function and grid) runs 2 ms (0.6 ms) for its first 40 (620) launches, then 20 us: a
    program's shapes changed. Its cost was learnt long, past the marker target, so every launch got a marker
    before it and the next one after it -- yet only one launch in GEM_KCOST_RELEARN measured it again (the next
    after the 620th is the 1597th), and a shorter measure moves the cost a quarter of the way: thousands of
    launches at a marker each. One noisy measure did the same on a starved CI machine (a 20 us kernel learnt as
    0.7 ms: a marker per synchronisation in test_a_loop_that_synchronises_after_every_second_launch_learns_its_
    kernel). Now a launch predicted past the target, which has markers on both sides anyway, is measured alone
    (gate.h; "620:600" fails without it), and an exact measure that brings the cost down but leaves it above twice
    the measure has the thread measure its next launch of the kernel alone (kcost.c, inflight.c's learn; "40:2000"
    fails without it: the cost stalls just under the target, two launches past it)."""
    n = int(first.split(":")[0])
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 1.0, "--kernel-us", 20, "--first", first,
                                 "--sync-every", 2), sim.hooked(_bounded(backends), "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    # (docs/benchmarks.md's numbers: pytest -m timed -o log_cli=true --log-cli-level=INFO -k learnt_too_long)
    log.info("%s: %s", first, {k: st[k] for k in ("launches", "markers", "kernels_measured", "kernel_costs_learnt",
                                                  "kernel_cost_learnt_ms", "kernel_cost_remeasures")})
    assert st["launches"] >= n + 2000 and st["kernel_costs_learnt"] >= 2, st
    # The long launches are measured alone ("620:600": 320-328 of them, beside three CPU hogs too; 14-16 without
    # gate.h's rule). After them about one marker in 20-26 launches (one in 11 beside three hogs); without kcost.c's
    # rule "40:2000" had one in 4.5, and without gate.h's "620:600" one in 7, as one make test run had with both
    # rules (one in 8 was the bound then): a cost learnt too long under a CPU stall places markers just as densely.
    assert st["kernels_measured"] >= n / 4, st
    # In a second the program gets about 1000 markers (700-1100 in 13000-17700 launches; without kcost.c's rule
    # "40:2000" about 3300): on a starved machine the simulator's kernels and the launches slow down, the markers
    # do not (thirty-third session's make test: 1012 markers in 5606 launches, one in 5.5), so the bound per launch
    # gives way to a second's usual markers there.
    assert st["markers"] - n <= max((st["launches"] - n) / 6, 1200), st


@pytest.mark.parametrize("sync,stream", [("ctx", "legacy"), ("stream", "created"), ("stream", "per-thread")])
def test_a_loop_that_synchronises_often_keeps_its_marker_rate(sim, backends, sync, stream):
    """Bursts of 128 short kernels, each ended by a synchronisation (of the context, or of the stream they run on)
    and 2 ms of host work. The synchronisation empties the queue, so the marker chain starts afresh after it: the
    interval across the host's work is not taken for the kernels' length. Measured, it halved the rate at every
    synchronisation and the next burst doubled it again (a grow and a shrink per burst, and on an H100 about 5 us
    more per marker for the measurement: +180 ns per launch beside a latency group)."""
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 2.0, "--kernel-us", 0, "--sync-every", 128,
                                 "--think-us", 2000, "--sync", sync, "--stream", stream),
                     sim.hooked(_bounded(backends), "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["launches"] >= 128 * 100 and st["markers"] >= 100, st
    assert st["marker_grows"] + st["marker_shrinks"] <= 20, st  # the rate found once, then kept


@pytest.mark.parametrize("kernel_costs", ["0", "1"])
def test_a_loop_of_bursts_shorter_than_the_budget_still_finds_its_marker_rate(sim, backends, kernel_costs):
    """Bursts of 32 short kernels (under 1 ms of work) between context-wide synchronisations: a chain of markers
    never grows as long as the queue's depth, so no marker is ever waited for. The last interval of each
    chain is measured at the synchronisation instead (its events are done then, and it costs the launches
    nothing), and the rate grows until a marker covers about a quarter of the budget. Without that the rate
    stopped at 2 launches per marker (a marker, with its event record and query, costs a few
    microseconds on a GPU: more than the launches it bounds). The count's rule (`GEMINI_KERNEL_COSTS=0`; a capped
    group's); by default beside a latency group the markers follow the kernels' learnt costs (kcost.h), and the
    kernels measured alone are learnt at the synchronisation too."""
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 2.0, "--kernel-us", 0, "--sync-every", 32,
                                 "--think-us", 2000),
                     sim.hooked(_bounded(backends), "train", GEMINI_KERNEL_COSTS=kernel_costs)))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["launches"] >= 32 * 100, st
    if kernel_costs == "0":
        assert st["marker_grows"] >= 3, st
    else:
        assert st["kernel_costs_learnt"] >= 1, st
    print("STATS", st)
    assert st["markers"] <= st["launches"] / 8, st      # 2 launches per marker without the measurement


@pytest.mark.parametrize("kernel_costs", ["0", "1"])
def test_a_queue_too_deep_for_its_markers_is_caught_at_the_synchronisation(sim, backends, client_script,
                                                                           kernel_costs):
    """The marker rate grows on short kernels; then the kernels take 1 ms, 16 launches between context-wide
    synchronisations: too few markers in a chain to wait for one or measure an interval, so only the
    synchronisation sees the queue. It waited for all of it, more than twice the 1 ms budget: the rate halves and
    the depth learns the kernels' length, and within a few synchronisations markers hold the queue near the
    budget. Without that judgement every synchronisation waited for the whole 16 ms. (With the GPU-side gate off:
    with it, a batch holder's budget beside a latency group is half its slot, and the 16 ms queue fits.) That is the
    count's rule (`GEMINI_KERNEL_COSTS=0`, a capped group's); by default beside a latency group a 1 ms kernel, once
    measured alone, gets a marker of its own (kcost.h), and the queue stays near the budget from the start."""
    r = finish(start(client_argv("e2e", "phases", "3000:0:1000", "320:1000:16", script=client_script),
                     sim.hooked(_bounded(backends), "train", GEMINI_GPU_GATE="0", GEMINI_KERNEL_COSTS=kernel_costs)))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    waits = r.json["waits_ms"]
    assert len(waits) == 20, (waits, st)
    if kernel_costs == "0":
        assert st["marker_grows"] >= 3, (waits, st)     # the rate grew on the short kernels
        assert st["marker_sync_shrinks"] >= 1, (waits, st)
    late = sorted(waits[10:])
    assert late[len(late) // 2] <= 5.0, (waits, st)


def test_graph_replays_between_eager_kernels_do_not_set_off_the_cost_checks(sim, backends, client_script):
    """Beside a latency group the markers follow the eager kernels' learnt costs (kcost.h), and a graph launch is a
    unit of its own: a marker before it and one before the next launch, its interval judged against nothing. A
    graph of 1.6 ms replayed between 0.02 ms kernels, its interval judged with theirs, was far longer than they were
    predicted to take at every replay, and the next 64 launches were measured alone again and again."""
    r = finish(start(client_argv("e2e", "graphmix", 1.5, "8:200", "40:20", 8, script=client_script),
                     sim.hooked(_bounded(backends), "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert r.json["rounds"] >= 50 and st["markers"] >= 2 * r.json["rounds"], (r.json, st)
    assert st["kernel_costs_learnt"] >= 1, st
    # 0-6 on a laptop (the simulated GPU's own hiccups make an eager interval long now and then); 60 with the graph's
    # interval judged with the kernels after it
    assert st["kernel_cost_checks"] <= 15, st


def test_one_gpus_silent_pod_manager_does_not_hold_up_early_claims_on_another(tmp_path, hook_lib, backends):
    """One latency process drives two GPUs, a thread each, and one claimer thread asks for both GPUs' early
    claims in turn. While GPU 1's pod manager is stopped, the claimer waits for its answer; GPU 0's requests must
    not wait behind it: a launch whose early claim's time is up and whose request the claimer has not sent yet
    sends it itself."""
    from tests.test_e2e_hook import sim_uuid
    sim = Sim(tmp_path / "sim", hook_lib, devices=2, trace=tmp_path / "kernels.trace")
    # MinUtil 1: the claim budget never runs out, so every request after the first is an early claim's
    kw = dict(quota_ms=20, min_quota_ms=5, window_ms=1000)
    be0 = backends([Group("g", 1.0, 1.0, sched_class="latency")], **kw)
    be1 = backends([Group("g", 1.0, 1.0, sched_class="latency")], **kw)
    where = ",".join(f"{sim_uuid(i)}=127.0.0.1:{be.ports['g']}" for i, be in enumerate((be0, be1)))
    # back-to-back bursts: each GPU's claim runs out every 20 ms and the next one is asked for early
    proc = start(client_argv("pyclient.py", "--devices", "0,1", "--seconds", 3, "--kernel-us", 500,
                             "--sync-every", 2, "--json"), sim.hooked(be0, "g", GEMINI_POD_MANAGERS=where))
    time.sleep(1.0)
    pmgr1 = be1.daemon_pids()["g"]
    stopped = time.monotonic_ns()
    os.kill(pmgr1, signal.SIGSTOP)
    try:
        time.sleep(0.6)
    finally:
        os.kill(pmgr1, signal.SIGCONT)
    resumed = time.monotonic_ns()
    r = finish(proc)
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    assert st["early_claims"] >= 50 and st["gate_errors"] == 0, st
    mine = [row for row in native.read_trace(sim.trace) if row[0] == r.json["pid"]]
    during = {dev: [row[2] for row in mine if row[1] == dev and stopped <= row[2] <= resumed] for dev in (0, 1)}
    # GPU 1 waited for its pod manager; GPU 0 kept going all along (behind the claimer: 0.6 s without a kernel)
    assert len(during[1]) < len(during[0]) / 4, {d: len(v) for d, v in during.items()}
    edges = [stopped] + during[0] + [resumed]
    assert max(b - a for a, b in zip(edges, edges[1:])) < 150e6, (len(during[0]), st)


def test_a_failed_early_claim_is_the_waiting_launchs_failure(tmp_path, hook_lib, backends):
    """The claimer's early request times out (its pod manager is stopped) while a launch waits for its answer:
    that launch fails with it, after one token timeout. Asking again from the launch would wait a second
    timeout before the program hears of the problem (and log it twice)."""
    sim = Sim(tmp_path / "sim", hook_lib)
    # MinUtil 1: the claim budget never runs out, so every request after the first is an early claim's
    be = backends([Group("g", 1.0, 1.0, sched_class="latency")], quota_ms=20, min_quota_ms=5, window_ms=1000)
    timeout_ms = 700
    # back-to-back bursts: the claim runs out every 20 ms and the next request goes early; the first failed
    # launch ends the program (exit 1)
    proc = start(client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", 20, "--sync-every", 2),
                 sim.hooked(be, "g", GEMINI_TOKEN_TIMEOUT_MS=timeout_ms))
    time.sleep(1.0)
    pmgr = be.daemon_pids()["g"]
    os.kill(pmgr, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        r = finish(proc, timeout=30)
        ended = time.monotonic()
    finally:
        os.kill(pmgr, signal.SIGCONT)
    assert r.rc == 1, r
    assert "cuLaunchKernel failed: 802 CUDA_ERROR_SYSTEM_NOT_READY" in r.err, r.err[-2000:]
    assert r.err.count("no token from the pod manager") == 1, r.err[-2000:]
    # The claimer's request went out within a claim (20 ms) of the stop; the launch failed when it timed out (a
    # second ask would have logged a second line, above). Unless the stop caught a claim's release in flight: the
    # release waits up to 5 s for its reply with the launches held behind it (hook/gate.c, send_release), and one
    # make-test run in many took 5.7 s here. Bounded either way: the program is never held past that.
    assert ended - stopped < timeout_ms / 1000 * 1.6 + 5.0, (ended - stopped, r.err[-2000:])


def test_processes_running_through_a_scheduler_restart_pause_for_claims_on_its_new_board(tmp_path, hook_lib,
                                                                                          backends):
    """gem-schd is SIGKILLed while a trainer runs; launch-backend restarts it and the new gem-schd makes a new
    board page. The trainer's pod manager moves to it and marks the group's line on the old page `moved`, so the
    trainer asks where the new page is at its next grant and pauses for the claims of a latency tenant that
    starts after the restart (which its own pod manager writes on the new page). Before, a process connected
    before the restart read the old page for good: it never paused once."""
    from tests.e2e_fixtures import all_registered, wait_for

    sim = Sim(tmp_path / "sim", hook_lib)
    be = backends([Group("inf", 0.5, 1.0, sched_class="latency"), Group("train", 0.0, 1.0)], quota_ms=100,
                  min_quota_ms=5, window_ms=10_000)
    train = start(trainer(6.0), sim.hooked(be, "train"))
    time.sleep(0.5)
    old = be.daemon_pids()["gem-schd"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: be.daemon_pids().get("gem-schd", old) != old, 10, what="gem-schd restarted")
    wait_for(lambda: all_registered(be), 10, step=0.1, what="both pod managers registered with the new gem-schd")
    time.sleep(0.3)     # the trainer's slot under the old gem-schd ends, and it is granted by the new one
    inf = finish(start(requests(2.5), sim.hooked(be, "inf")))
    tr = finish(train)
    assert inf.rc == 0 and tr.rc == 0, (inf, tr)
    st = sim.stats_of(tr.json["pid"])
    assert held_for_claims(st) >= 30, st
    assert st["board_moves"] >= 1, st

