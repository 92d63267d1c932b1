"""bench/bench_schd_ceiling.py runs gem-schd alone against fake pod managers and reports its CPU per slot and the
CPU its loop spends from a deadline to the grant sent (its own measure, read from its log at exit)."""
import json
import os

import pytest

from bench import bench_schd_ceiling as bc


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the bench pins gem-schd and the load to two cores")
def test_one_point_of_each_mode_reports_slots_and_cpu(capsys):
    cores = os.sched_getaffinity(0)
    assert bc.main(["--groups", "3", "--seconds", "0.5", "--warmup", "0.3", "--bare-sends", "20"]) == 0
    assert os.sched_getaffinity(0) == cores         # the load's pinning does not outlive the bench
    out = json.loads(capsys.readouterr().out)
    # the machine's own cost of one send after a slot's quiet, beside gem-schd's
    assert out["bare_send"]["sends"] == 20 and 0 < out["bare_send"]["cpu_p50_us"] < 10_000, out["bare_send"]
    rows = {r["mode"]: r for r in out["rows"]}
    assert set(rows) == {"deadline", "ceiling"}, rows
    for r in rows.values():
        assert r["groups"] == 3 and r["slots"] > 10 and 0 < r["schd_cpu_per_slot_ms"] < 100, r
    # every slot of the deadline mode ends at gem-schd's timer: its CPU to each grant is measured and logged
    d = rows["deadline"]
    assert d["deadline_to_grant_cpu_p50_us"] is not None and 0 < d["deadline_to_grant_cpu_p50_us"], d
    assert d["deadline_to_grant_wall_p50_ms"] is not None and 0 < d["deadline_to_grant_wall_p50_ms"], d
    # decided ahead of the deadlines (gem-schd's default --decide-ahead), the grants sent at them
    assert d["decided_ahead"] and d["decided_ahead"] > d["decided_at_deadline"] and d["decide_ahead_cpu_p50_us"], d
    # 5 ms slots: at most about 200 a second; releasing at once, many more
    assert d["slots_per_s"] < 260 and rows["ceiling"]["slots_per_s"] > d["slots_per_s"], rows
