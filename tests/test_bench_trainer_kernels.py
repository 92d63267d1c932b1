"""bench/trainer_kernels.py's arithmetic: kernels read from a profiler trace, and a random arrival's mean wait."""
from __future__ import annotations

import pytest

from bench.trainer_kernels import kernel_lengths_ms, summary


def test_only_kernels_are_read_from_the_trace():
    trace = {"traceEvents": [{"cat": "kernel", "dur": 1500}, {"cat": "cpu_op", "dur": 9000},
                             {"cat": "kernel", "dur": 250.0}, {"cat": "kernel"}, {"cat": "gpu_memcpy", "dur": 40}]}
    assert kernel_lengths_ms(trace) == [1.5, 0.25]


def test_a_random_arrival_waits_for_the_long_kernels_more_than_their_count_says():
    """Three kernels of 1, 1 and 2 ms: a moment of busy time falls in the 2 ms one half the time, so the mean wait
    for the kernel in flight to end is (1 + 1 + 4) / (2 * 4) = 0.75 ms, not half the mean length (0.67)."""
    s = summary([1.0, 2.0, 1.0])
    assert s["kernels"] == 3 and s["busy_ms"] == pytest.approx(4.0) and s["max_ms"] == 2.0
    assert s["mean_residual_ms"] == pytest.approx(0.75)
    assert s["busy_in_over_1ms"] == pytest.approx(0.5) and s["busy_in_over_0.25ms"] == pytest.approx(1.0)
    assert summary([]) == {"kernels": 0}
