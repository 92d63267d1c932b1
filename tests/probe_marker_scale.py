"""A probe, not a CI test: markers placed every N launches, with the interval scaled by the rate at its end marker
(the tree's hook) or at its start (a variant hook, PROBE_VARIANT_HOOK). Loops of kernels of several lengths, no
synchronisation, in a bounded group (beside an idle configured group, or capped at 0.5), 1.5 s each: kernels done,
markers, how many were timed, grows and shrinks.

    git archive REV hook Makefile | tar -x -C /tmp/old && make -C /tmp/old gemini/lib/libgemhook.so.1
    PROBE_VARIANT_HOOK=/tmp/old/gemini/lib/libgemhook.so.1 PROBE_REPS=3 \
        .venv/bin/python -m pytest -s -p no:cacheprovider tests/probe_marker_scale.py
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.harness import Group
from tests.e2e_fixtures import Sim, client_argv, finish, start

KEYS = ("launches", "markers", "markers_timed", "marker_grows", "marker_shrinks", "marker_waits")


@pytest.mark.parametrize("rep", range(int(os.environ.get("PROBE_REPS", "1"))))
@pytest.mark.parametrize("kernel_us", [int(k) for k in os.environ.get("PROBE_KERNELS", "10,40,120,300").split(",")])
@pytest.mark.parametrize("mix", ["idle-neighbour", "capped"])
@pytest.mark.parametrize("hook", ["tree", "variant"])
def test_probe(tmp_path, hook_lib, backends, hook, mix, kernel_us, rep):
    if hook == "variant" and not os.environ.get("PROBE_VARIANT_HOOK"):
        pytest.skip("PROBE_VARIANT_HOOK names no other hook")
    lib = Path(os.environ["PROBE_VARIANT_HOOK"]) if hook == "variant" else hook_lib
    sim = Sim(tmp_path / "sim", lib)
    groups = [Group("train", 0.0, 1.0), Group("idle", 0.5, 1.0)] if mix == "idle-neighbour" else \
        [Group("train", 0.0, 0.5)]
    be = backends(groups, quota_ms=None, min_quota_ms=None, window_ms=None)
    r = finish(start(client_argv("workload-linked", "--json", "--seconds", 1.5, "--kernel-us", kernel_us,
                                 "--sync-every", 0), sim.hooked(be, "train")))
    assert r.rc == 0, r
    st = sim.stats_of(r.json["pid"])
    print(f"\nPROBE {hook:7s} {mix:14s} {kernel_us:4d}us kernels {r.json.get('kernels_done')}",
          {k: int(st.get(k, 0)) for k in KEYS}, f"timed {st['markers_timed'] / max(st['markers'], 1):.2f}")
