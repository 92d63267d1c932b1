"""`gem-ctl plot`: draw a `gem-schd --trace` file (needs the `plot` extra: matplotlib).

Top panel: each group's share of GPU time over the sliding window, sampled over the trace, against its MinUtil
(dotted) and MaxUtil (dashed) as configured at each moment (reloads included). Bottom panel: who held the token
when (one row per group), and, hatched over a unified group's row, when its memory was moving (swap events).

The share curves are gem-schd's own share samples in the trace: what `gem-ctl status` reported at each moment
(gemini/scheduler/share.py). A trace without them (an older gem-schd), or `--window` asking for another window, gets
curves computed from the slots as granted, over the whole window, without the corrections gem-schd charges (the
hooks' overuse and measured use, claims).
"""
from __future__ import annotations

import math
import os
from typing import Optional

from gemini.scheduler.share import share_series
from gemini.scheduler.trace import SchedulerTrace

INSTALL_HINT = "gem-ctl plot needs matplotlib: pip install 'gemini-gpu[plot]' (or matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is missing."""


def share_curves(trace: SchedulerTrace, times: list[float],
                 window_s: Optional[float] = None) -> dict[str, tuple[list[float], list[float]]]:
    """(times, shares) of each group: gem-schd's share samples, or, without them or for another window, the
    shares computed from the slots at `times` (see the module docstring)."""
    window = window_s if window_s is not None else trace.window_s
    if trace.samples and math.isclose(window, trace.window_s):
        xs = [sm.t_s for sm in trace.samples]
        return {g: (xs, [sm.shares.get(g, math.nan) for sm in trace.samples]) for g in trace.groups}  # NaN: absent
    return {g: (list(times), share_series([(sl.start_s, sl.start_s + sl.dur_s) for sl in trace.slots
                                           if sl.group == g], times, window))
            for g in trace.groups}


def limit_series(trace: SchedulerTrace, group: str, key: str, end_s: float) -> tuple[list[float], list[float]]:
    """(times, values) of a group's configured `key` ("min_util"/"max_util") as a step function; NaN while the
    group is not configured."""
    xs: list[float] = []
    ys: list[float] = []
    for c in trace.configs:
        g = c.groups.get(group)
        xs.append(c.t_s)
        ys.append(float(g[key]) if g else float("nan"))
    if xs:
        xs.append(end_s)
        ys.append(ys[-1])
    return xs, ys


def plot_trace(path: str | os.PathLike, output: str | os.PathLike, points: int = 1000,
               window_s: Optional[float] = None) -> str:
    """Write the two-panel figure of the trace at `path` to `output`; returns a one-line summary."""
    try:
        import matplotlib
        matplotlib.use("Agg")       # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None

    trace = SchedulerTrace.load(path)
    window = window_s if window_s is not None else trace.window_s
    end = max(trace.end_s, 1e-3)
    times = [end * (k + 1) / points for k in range(points)]
    groups = trace.groups
    by_group = {g: [s for s in trace.slots if s.group == g] for g in groups}
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])

    fig, (ax_share, ax_token) = plt.subplots(2, 1, sharex=True, figsize=(11, 3.2 + 0.35 * max(len(groups), 2)),
                                             gridspec_kw={"height_ratios": [3, max(1, 0.35 * len(groups))]})
    curves = share_curves(trace, times, window_s)
    for k, group in enumerate(groups):
        color = colors[k % len(colors)]
        xs, ys = curves[group]
        ax_share.plot(xs, ys, color=color, lw=1.4, label=f"{group} share")
        for key, style in (("max_util", "--"), ("min_util", ":")):
            xs, ys = limit_series(trace, group, key, end)
            if xs and not (key == "min_util" and not any(y > 0 for y in ys)):   # no MinUtil: no line at 0
                ax_share.step(xs, ys, where="post", color=color, ls=style, lw=1.0, alpha=0.8)
        ranges = [(s.start_s, max(s.dur_s, end * 1e-4)) for s in by_group[group]]   # a 0 ms slot stays visible
        if ranges:
            ax_token.broken_barh(ranges, (k - 0.4, 0.8), facecolors=color)
        swaps = [(s.start_s, max(s.dur_s, end * 1e-4)) for s in trace.swaps if s.group == group]
        if swaps:       # unified groups' memory moving (to the host or back): hatched, over the row
            ax_token.broken_barh(swaps, (k - 0.4, 0.8), facecolors="none", edgecolors="black", hatch="////",
                                 lw=0.5)
    for c in trace.configs[1:]:
        ax_share.axvline(c.t_s, color="grey", lw=0.6, alpha=0.6)
    ax_share.set_ylabel(f"share over {window:g} s window")
    ax_share.set_ylim(0, 1.05)
    ax_share.set_title(f"{os.path.basename(str(path))}: share (solid), MaxUtil (dashed), MinUtil (dotted)")
    ax_share.grid(True, alpha=0.3)
    if groups:
        ax_share.legend(loc="upper right", fontsize="small", ncol=min(len(groups), 4))
    ax_token.set_yticks(range(len(groups)))
    ax_token.set_yticklabels(groups)
    ax_token.set_ylim(-0.6, max(len(groups), 1) - 0.4)
    ax_token.invert_yaxis()
    ax_token.set_ylabel("token")
    ax_token.set_xlabel("time since gem-schd started (s)")
    ax_token.set_xlim(0, end)
    ax_token.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return f"{len(trace.slots)} slots of {len(groups)} group(s) over {end:.1f} s"
