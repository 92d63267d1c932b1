"""Plots for docs/benchmarks.md, from a bench_share.py run directory (needs matplotlib).

    python bench/plots.py RUN_DIR -o share.png

Top: each tenant's share of GPU time measured on the GPU (on-chip time of its kernels over a sliding
1 s window), with its configured cap. Bottom: the token timeline from gem-schd's trace (grants.json),
or, without one, which tenant had kernels on the GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import GroupTrace, Trace  # noqa: E402


def plot_run(run_dir: Path, output: Path, window_s: float = 1.0, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    report = json.loads((run_dir / "share.json").read_text())
    tenants = sorted(p.stem for p in run_dir.glob("t*.trace"))
    tenant_traces = {n: Trace.read(run_dir / f"{n}.trace") for n in tenants}
    # processes t<i>-<j> belong to group t<i>; the plot shows groups
    names = sorted({n.split("-")[0] for n in tenants})
    traces = {g: GroupTrace([tenant_traces[n] for n in tenants if n.split("-")[0] == g]) for g in names}
    t0 = min(t.host_ns[0] for t in tenant_traces.values())
    t1 = max(t.host_ns[-1] for t in tenant_traces.values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    caps = report.get("caps", {})
    owed = report.get("entitled", caps)     # what each is owed (its cap unless the caps add up to more than 1)
    step = 0.05e9
    for i, (name, tr) in enumerate(traces.items()):
        xs, ys = [], []
        t = t0 + window_s * 1e9
        while t <= t1:
            xs.append((t - t0) / 1e9)
            ys.append((tr.onchip_at(t) - tr.onchip_at(t - window_s * 1e9)) / (window_s * 1e9))
            t += step
        color = colors[i % len(colors)]
        label = f"{name}" + (f" (cap {caps[name]:g})" if name in caps else "")
        if name in owed and name in caps and abs(owed[name] - caps[name]) > 5e-4:
            label = f"{name} (cap {caps[name]:g}, owed {owed[name]:.3g})"
        top.plot(xs, ys, color=color, label=label)
        if name in owed:
            top.axhline(owed[name], color=color, linestyle="--", linewidth=0.8)
    top.set_ylabel(f"GPU share ({window_s:g} s window)")
    top.set_ylim(0, 1.05)
    top.legend(loc="upper right")
    top.set_title(title or f"{report['mode']}: on-chip share per tenant")
    grants = run_dir / "grants.json"
    rows = {n: i for i, n in enumerate(names)}
    if grants.exists():
        from gemini.scheduler.trace import SchedulerTrace
        st = SchedulerTrace.load(grants)
        # the trace's clock starts with the daemon; align its first slot with the first kernel
        first_kernel = min(_first_kernel_ns(run_dir, n) for n in tenants)
        offset = (first_kernel - t0) / 1e9 - (st.slots[0].start_s if st.slots else 0.0)
        for s in st.slots:
            if s.group in rows:
                bottom.broken_barh([(s.start_s + offset, s.dur_s)], (rows[s.group] - 0.4, 0.8),
                                   color=colors[rows[s.group] % len(colors)])
        bottom.set_ylabel("token holder")
    else:
        for n in tenants:
            g = n.split("-")[0]
            spans = _kernel_spans(run_dir, n, t0)
            bottom.broken_barh(spans, (rows[g] - 0.4, 0.8), color=colors[rows[g] % len(colors)])
        bottom.set_ylabel("kernels on GPU")
    bottom.set_yticks(range(len(names)), names)
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def _first_kernel_ns(run_dir: Path, name: str) -> float:
    tr = Trace.read(run_dir / f"{name}.trace")
    return tr.host_ns[0]


def _kernel_spans(run_dir: Path, name: str, t0: float) -> list[tuple[float, float]]:
    """Kernel spans on the device clock, shifted so that the first kernel starts at its first sync's host time."""
    path = run_dir / f"{name}.kernels"
    if not path.exists():
        return []
    rows = [tuple(int(x) for x in line.split()) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return []
    first_host = Trace.read(run_dir / f"{name}.trace").host_ns[0]
    shift = first_host - rows[0][1]
    return [((s + shift - t0) / 1e9, (e - s) / 1e9) for s, e, _ in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--title")
    args = p.parse_args(argv)
    print(plot_run(Path(args.run_dir), Path(args.output), title=args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
