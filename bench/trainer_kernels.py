"""How long the benchmark trainers' kernels run (tests/gpu/workloads/train_loop.py), from torch.profiler's trace.

A latency group's request that arrives while a batch process runs waits, at best, for the batch kernel in flight to
end: the GPU-side gate stops the batch stream at its next wait (between kernels), not inside a kernel, and native
time-slicing preempts only at the end of its time slice. For a request that arrives at a random moment of the
trainer's busy time, that wait is the kernel's residual life: its mean is E[d^2] / 2 E[d] over the kernels' lengths
d, and its tail is set by the longest kernels. This prints, per trainer mode, the kernels' count and lengths (mean,
p50, p90, p99, max, in ms), the share of busy time in kernels longer than 0.25 / 0.5 / 1 ms, and the mean residual.

    python bench/trainer_kernels.py [--modes eager,graph] [--steps 30]

Prints one JSON object. Run it natively (no hook needed).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "gpu" / "workloads"))

log = logging.getLogger("bench.trainer_kernels")


def kernel_lengths_ms(trace: dict) -> list[float]:
    """Every GPU kernel's length (ms) in a Chrome trace from torch.profiler."""
    return [float(e["dur"]) / 1000.0 for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel" and isinstance(e.get("dur"), (int, float))]


def summary(lengths: list[float]) -> dict:
    """Count, lengths and the mean residual wait of a random arrival (all ms), and the busy time in long kernels."""
    if not lengths:
        return {"kernels": 0}
    d = sorted(lengths)
    busy = sum(d)

    def pick(q: float) -> float:
        return d[min(len(d) - 1, int(q * len(d)))]

    out = {"kernels": len(d), "busy_ms": busy, "mean_ms": busy / len(d), "p50_ms": pick(0.5), "p90_ms": pick(0.9),
           "p99_ms": pick(0.99), "max_ms": d[-1], "mean_residual_ms": sum(x * x for x in d) / (2 * busy)}
    for cut in (0.25, 0.5, 1.0):
        out[f"busy_in_over_{cut:g}ms"] = sum(x for x in d if x > cut) / busy
    return out


def profile(mode: str, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from train_loop import make_step
    step = make_step(mode)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return {"steps": steps, **summary(kernel_lengths_ms(trace))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = {}
    for mode in [m for m in args.modes.split(",") if m]:
        out[mode] = profile(mode, args.steps)
        log.info("%s: %s", mode, out[mode])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
