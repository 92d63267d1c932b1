"""The pod manager's ledger file: which processes held how much of the group's memory, for its successor.

A pod manager that dies takes its count of the group's memory with it. Its successor (launch-backend restarts it
at once) reads this file to learn which processes held memory, counts their bytes from the start, and holds the
group's allocations until each of them has re-announced what it holds (manager.PodManager.begin_recovery). The
file is small (one line per process that holds memory), rewritten by rename (a reader never sees half of it), and
lives beside the group's socket on the socket transport (a directory only the backend's user can write), or where
`gem-pmgr --ledger` says. A clean stop with nothing held removes it.

Format, version 1: {"version": 1, "group": NAME, "holders": [[pid, bytes, visible], ...]}, `visible` 1 when the
pid is one the pod manager can look up (its own pid namespace): a successor does not wait for such a process once
it has exited.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .manager import Holder

log = logging.getLogger("gemini.podmgr")

VERSION = 1
MAX_FILE_BYTES = 1 << 20    # far above 1024 connections' worth; a larger file is not ours


class LedgerError(ValueError):
    """The file exists but is not a ledger this version can read."""


def encode(group: str, holders: dict[int, Holder]) -> str:
    return json.dumps({"version": VERSION, "group": group,
                       "holders": sorted([p, h.bytes, int(h.visible)] for p, h in holders.items())})


def decode(text: str, group: str) -> dict[int, Holder]:
    """pid -> Holder; LedgerError says what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise LedgerError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise LedgerError(f"not a version {VERSION} ledger")
    if doc.get("group") != group:
        raise LedgerError(f"the ledger of group {doc.get('group')!r}, not {group!r}")
    holders: dict[int, Holder] = {}
    entries = doc.get("holders")
    if not isinstance(entries, list):
        raise LedgerError("'holders' is not a list")
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != 3 or not all(type(v) is int for v in entry)
                or entry[0] <= 0 or not 0 <= entry[1] < 2**63 or entry[2] not in (0, 1) or entry[0] in holders):
            raise LedgerError(f"bad holder {entry!r}: expected [pid, bytes, visible], one per pid")
        holders[entry[0]] = Holder(entry[1], bool(entry[2]))
    return holders


@dataclass
class Loaded:
    """What a starting pod manager found: no file (a first start), a record, or an unreadable file."""
    found: bool
    holders: dict[int, Holder] | None  # None: found but unreadable (wait out the whole grace period)


def load(path: Path, group: str) -> Loaded:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return Loaded(False, {})
    except OSError as exc:
        log.error("cannot read the ledger %s: %s; the group's allocations wait out the grace period", path, exc)
        return Loaded(True, None)
    try:
        if len(data) > MAX_FILE_BYTES:
            raise LedgerError(f"larger than {MAX_FILE_BYTES} bytes")
        return Loaded(True, decode(data.decode("utf-8", "replace"), group))
    except LedgerError as exc:
        log.error("the ledger %s is unusable (%s); the group's allocations wait out the grace period", path, exc)
        return Loaded(True, None)


class LedgerFile:
    """Writes the record when it changes: at once when the set of holders changes (a successor must wait for each
    of them), at most every `min_interval_s` when only their byte counts do (the successor takes each process's
    own figure from its HELLO anyway). A write that fails is logged once and retried at the next change."""

    def __init__(self, path: Path, group: str, min_interval_s: float = 1.0):
        self.path = path
        self.group = group
        self.min_interval_s = min_interval_s
        self._written: dict[int, Holder] | None = None
        self._written_at = -1e18
        self._failing = False

    def update(self, holders: dict[int, Holder], now: float) -> None:
        last = self._written
        if last == holders:
            return
        if last is not None and last.keys() == holders.keys() and now - self._written_at < self.min_interval_s:
            return
        self._write(holders, now)

    def _write(self, holders: dict[int, Holder], now: float) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(encode(self.group, holders))
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self._failing:
                log.error("cannot write the ledger %s: %s; a restarted pod manager would not know who held memory",
                          self.path, exc)
            self._failing = True
            return
        self._failing = False
        self._written, self._written_at = dict(holders), now

    def close(self, holders: dict[int, Holder]) -> None:
        """Stopping: the record stays if anything is held (a successor needs it), else it goes."""
        if holders:
            self._write(holders, 0.0)
            return
        for p in (self.path, self.path.with_name(self.path.name + ".tmp")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove the ledger %s: %s", p, exc)
