"""What gem-schd tells its observers (the trace writer, the metrics server): slots, claims, swaps of unified
groups' memory, reloads, the stop.

The daemon calls them on its event loop after it has carried out the decisions of one event (every grant and
message of them is sent before anyone is told about any of them), in the order the decisions were made. An
observer's exception is logged and never reaches the daemon.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gemini.config import Config


@runtime_checkable
class SchedulerObserver(Protocol):
    def on_grant(self, group: str, token_seq: int, quota_ms: float, start_ms: float, wait_ms: float) -> None:
        """A slot was granted (start_ms: when it starts; a continuation's is the old slot's deadline)."""

    def on_slot_end(self, group: str, token_seq: int, quota_ms: float, start_ms: float, end_ms: float,
                    wait_ms: float, reason: str) -> None:
        """A slot ended: reason "release", "deadline", "continued" or "stop"."""

    def on_claim(self, group: str, start_ms: float, end_ms: float) -> None:
        """A latency group reported a claim it made (times on the daemon's clock)."""

    def on_evict(self, group: str, seq: int, nbytes: int, now_ms: float) -> None:
        """gem-schd asked a unified group to move its memory to the host (eviction `seq`, `nbytes` resident), to
        make room for another group's grant."""

    def on_swap(self, group: str, direction: str, seq: int, moved_bytes: int, took_ms: float, end_ms: float,
                complete: bool) -> None:
        """A unified group's hooks reported a move of its memory that ended at end_ms (the report's arrival) and
        took took_ms: direction "host" answers eviction `seq` (`complete` false: given up on a process that did
        not answer), "device" is a prefetch at a grant (seq 0)."""

    def on_config(self, config: Config, diff: Any, now_ms: float) -> None:
        """A reload was applied."""

    def on_stop(self, now_ms: float) -> None:
        """The daemon stops."""


class ObserverBase:
    """Does nothing for every event; observers override what they need."""

    def on_grant(self, group: str, token_seq: int, quota_ms: float, start_ms: float, wait_ms: float) -> None:
        pass

    def on_slot_end(self, group: str, token_seq: int, quota_ms: float, start_ms: float, end_ms: float,
                    wait_ms: float, reason: str) -> None:
        pass

    def on_claim(self, group: str, start_ms: float, end_ms: float) -> None:
        pass

    def on_evict(self, group: str, seq: int, nbytes: int, now_ms: float) -> None:
        pass

    def on_swap(self, group: str, direction: str, seq: int, moved_bytes: int, took_ms: float, end_ms: float,
                complete: bool) -> None:
        pass

    def on_config(self, config: Config, diff: Any, now_ms: float) -> None:
        pass

    def on_stop(self, now_ms: float) -> None:
        pass
