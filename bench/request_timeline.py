"""Where a serving request's time goes: on the host before it is issued, before its first kernel starts on the
GPU, on the GPU from its first kernel to its last, and after that until the host has the result.

tests/gpu/workloads/serve.py --timeline FILE brackets each request with two one-thread kernels that write the
GPU's %globaltimer (ns), and writes one line per request (ns; host times on CLOCK_MONOTONIC):

    arrival issue launched first launched_last last done

its arrival; when the host began it; when the first stamp's launch returned (the hook's way into a claim is in
that launch); the first stamp on the GPU; when the last stamp's launch returned (the request's kernels are all
queued); the last stamp on the GPU; when the result was on the host. The two clocks have an unknown offset, so
the parts that cross from one to the other ("to_gpu", "behind", "back") are given above their least value in the
run: a request whose first kernel started as soon as it could reads 0 there. The parts:

    late      issue - arrival           the host began it after its arrival (the previous request was slow)
    launch    launched - issue          the first launch's host time
    to_gpu    first - launched          queued on the GPU before its first kernel ran (another context's work)
    launching launched_last - launched  the host's time to launch the request's kernels
    behind    last - launched_last      how far the GPU still was behind the host at the request's end
    span      last - first              the request on the GPU, first kernel to last
    back      done - last               the result's way back to the host

A request alone is host-bound: its kernels run as they are launched (span ~ launching, behind ~ 0). A p99 that
grows beside a trainer is then one of: the GPU ran the trainer's queued work first (to_gpu), or between the
request's kernels (behind), or the host was slow (late, launch, launching, back). `summarise` gives each part's
p50 / p99 over all requests and its mean over the slowest 1% (the tail), all in ms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from bench.harness import percentile

PARTS = ("late", "launch", "to_gpu", "launching", "behind", "span", "back")


@dataclass(frozen=True)
class RequestTimes:
    """One request's times (ns): first and last on the GPU's clock, the others on the host's monotonic clock."""
    arrival: int
    issue: int
    launched: int
    first: int
    launched_last: int
    last: int
    done: int

    @classmethod
    def parse(cls, line: str) -> "RequestTimes":
        return cls(*(int(v) for v in line.split()))

    def line(self) -> str:
        return " ".join(str(v) for v in (self.arrival, self.issue, self.launched, self.first, self.launched_last,
                                         self.last, self.done))



def parts(requests: Iterable[RequestTimes]) -> list[dict]:
    """Each stamped request's total and parts (ns), the clock-crossing ones above their least value in the run."""
    reqs = [r for r in requests if r.last >= r.first > 0]
    if not reqs:
        return []
    to_gpu0 = min(r.first - r.launched for r in reqs)
    behind0 = min(r.last - r.launched_last for r in reqs)
    back0 = min(r.done - r.last for r in reqs)
    return [{"total": r.done - r.arrival, "late": r.issue - r.arrival, "launch": r.launched - r.issue,
             "to_gpu": r.first - r.launched - to_gpu0, "launching": r.launched_last - r.launched,
             "behind": r.last - r.launched_last - behind0, "span": r.last - r.first,
             "back": r.done - r.last - back0} for r in reqs]


def summarise(requests: Iterable[RequestTimes], tail: float = 0.01) -> dict:
    """Each part's p50 / p99 (ms) and its mean over the slowest `tail` of the requests by total latency."""
    rows = parts(requests)
    if not rows:
        return {"requests": 0}
    ms = 1e-6
    out: dict = {"requests": len(rows)}
    for part in ("total", *PARTS):
        vals = [row[part] * ms for row in rows]
        out[part] = {"p50_ms": percentile(vals, 0.5), "p99_ms": percentile(vals, 0.99),
                     "mean_ms": sum(vals) / len(vals)}
    rows.sort(key=lambda row: row["total"])
    slow = rows[-max(1, int(round(len(rows) * tail))):]
    out["tail"] = {"requests": len(slow), **{f"{part}_ms": sum(row[part] for row in slow) * ms / len(slow)
                                             for part in ("total", *PARTS)}}
    return out


def slowest(requests: Iterable[RequestTimes], n: int = 20) -> list[dict]:
    """The n slowest requests' parts (ms), slowest first: what the tail's mean hides."""
    rows = sorted(parts(requests), key=lambda row: row["total"], reverse=True)[:n]
    return [{k: round(v * 1e-6, 4) for k, v in row.items()} for row in rows]


def read(path) -> list[RequestTimes]:
    with open(path) as f:
        return [RequestTimes.parse(line) for line in f if line.strip()]
