"""bench/request_timeline.py: a request's time split into its parts across the host's and the GPU's clocks."""
from __future__ import annotations

import pytest

from bench.request_timeline import RequestTimes, read, slowest, summarise

OFFSET = 7_000_000_000     # the GPU's clock against the host's: unknown to the summary


def req(arrival: int, late: int, to_gpu: int, span: int, back: int, launching: int = 0) -> RequestTimes:
    """A request whose first launch takes 3 us on the host; its kernels are all launched `launching` after it."""
    issue = arrival + late
    launched = issue + 3_000
    first = launched + to_gpu + OFFSET
    last = first + span
    return RequestTimes(arrival, issue, launched, first, launched + launching, last, last - OFFSET + back)


def test_parts_cross_the_clocks_above_their_least_value():
    reqs = [req(i * 10**7, 5_000, 8_000, 400_000, 12_000) for i in range(99)]
    reqs.append(req(10**9, 5_000, 8_000 + 2_000_000, 400_000, 12_000))   # its first kernel waited 2 ms more
    out = summarise(reqs)
    assert out["requests"] == 100
    assert out["tail"]["requests"] == 1
    assert out["tail"]["to_gpu_ms"] == pytest.approx(2.0)
    assert out["tail"]["span_ms"] == pytest.approx(0.4)
    assert out["tail"]["late_ms"] == pytest.approx(0.005)
    assert out["tail"]["back_ms"] == pytest.approx(0.0)
    assert out["tail"]["launch_ms"] == pytest.approx(0.003)
    assert out["tail"]["total_ms"] == pytest.approx(0.428 + 2.0)
    assert out["span"]["p50_ms"] == pytest.approx(0.4)
    assert out["to_gpu"]["p50_ms"] == pytest.approx(0.0)


def test_a_request_interleaved_on_the_gpu_shows_behind_the_host():
    # host-bound requests: the kernels run as they are launched (400 us), the last one 5 us after its launch
    reqs = [req(i * 10**7, 0, 8_000, 400_000, 12_000, launching=395_000) for i in range(199)]
    # one whose kernels waited 2 ms for someone else's after the first had run
    reqs.append(req(0, 0, 8_000, 2_400_000, 12_000, launching=395_000))
    tail = summarise(reqs, tail=0.005)["tail"]
    assert tail["span_ms"] == pytest.approx(2.4) and tail["to_gpu_ms"] == pytest.approx(0.0)
    assert tail["behind_ms"] == pytest.approx(2.0) and tail["launching_ms"] == pytest.approx(0.395)
    assert slowest(reqs, 1)[0]["behind"] == pytest.approx(2.0)


def test_unstamped_requests_are_left_out_and_lines_round_trip(tmp_path):
    good = req(0, 1, 2, 3, 4)
    path = tmp_path / "t.txt"
    path.write_text(good.line() + "\n" + RequestTimes(5, 6, 7, 0, 8, 0, 9).line() + "\n")
    assert read(path)[0] == good
    assert summarise(read(path))["requests"] == 1
    assert summarise([]) == {"requests": 0}
