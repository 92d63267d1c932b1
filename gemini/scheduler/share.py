"""A group's share as gem-schd reports it -- SHARE in `gem-ctl status`, `gemini_group_share_ratio` in the metrics,
the share samples of a `gem-schd --trace` that `gem-ctl plot` draws: the GPU time the policy charged the group in
the last whole sliding window, divided by that window.

* The charge is the policy's own (`Policy.usage`: slots as it settled them, with the hooks' overuse and measured
  use, and latency claims), so the report agrees with what the policy enforces; nothing here re-derives it.
* The divisor is always the whole window, in the first window after the scheduler starts too. Divided by the
  time since the first request instead, a group's first slot alone read as 100% in the first second after the
  scheduler had been idle, far above a cap the policy was holding; over the whole window a capped group reads
  at most MaxUtil + its burst / window (the policy's bound over any interval, `Policy.cap_burst_ms`: up to 0.58
  points with the default 100 ms frames and a 10 s window, 0.25 for a cap under 0.2, which keeps a 25 ms bucket).
* The daemon computes it in one place (`SchedulerDaemon.reported_shares`), and the trace records what that
  returned, every `sample_interval(window)`, so the plot draws the numbers `gem-ctl status` showed; `share_series`
  is only for traces without samples (an older gem-schd, or `gem-ctl plot --window` asking for another window),
  and counts the slots as granted, without the policy's corrections.
"""
from __future__ import annotations

from typing import Iterable, Sequence


def reported_share(charged_ms: float, window_ms: float) -> float:
    """The share reported for a group charged `charged_ms` in the last window of `window_ms`."""
    return min(1.0, max(0.0, charged_ms / window_ms)) if window_ms > 0 else 0.0


def sample_interval(window: float) -> float:
    """How often the trace records the reported shares: 50 samples a window, in the window's unit."""
    return window / 50.0


def share_series(slots: Iterable[tuple[float, float]], times: Sequence[float], window: float) -> list[float]:
    """The slot time of one group's (start, end) slots inside [t - window, t], divided by the whole window, at
    each of `times` (sorted)."""
    ordered = sorted(slots)
    ends = _cumulative(ordered, times)
    begins = _cumulative(ordered, [t - window for t in times])
    return [reported_share(e - b, window) for e, b in zip(ends, begins)]


def _cumulative(slots: Sequence[tuple[float, float]], times: Sequence[float]) -> list[float]:
    """Slot time before each t of `times` (sorted); `slots` sorted and not overlapping."""
    out = []
    i, done = 0, 0.0       # slots before i have ended by the current t
    for t in times:
        while i < len(slots) and slots[i][1] <= t:
            done += slots[i][1] - slots[i][0]
            i += 1
        partial = t - slots[i][0] if i < len(slots) and slots[i][0] < t else 0.0
        out.append(done + partial)
    return out
