"""How many hook connections a pod manager keeps, and from whom (pure; server.py asks it at every accept).

A flood of connections must cost whoever floods, not the group: the pod manager refuses a connection beyond
`per_pid` from one process or `per_uid` from one user (known from SO_PEERCRED on the socket transport), and
beyond `total` from anyone. A hook opens one connection per GPU, plus a reconnect now and then, so `per_pid`
is generous. Every connection must also say HELLO within `hello_timeout_s` (server.py closes it otherwise), so
idle connections cannot pile up either.

On TCP nobody's uid is known: only `total` applies, and a local flood can fill it (docs/reliability.md); the
socket transport is the answer to that.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from gemini.peercred import PeerCredentials


@dataclass(frozen=True)
class Limits:
    total: int = 1024
    per_uid: int = 256
    per_pid: int = 16
    hello_timeout_s: float = 5.0


class Admission:
    """Counts of open connections by uid and pid."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._creds: dict[int, PeerCredentials | None] = {}
        self._by_uid: collections.Counter[int] = collections.Counter()
        self._by_pid: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._creds)

    def admit(self, client_id: int, creds: PeerCredentials | None) -> str | None:
        """Count the connection in and return None, or return why it is refused (and count nothing)."""
        lim = self.limits
        if len(self._creds) >= lim.total:
            return f"the pod manager has {lim.total} connections already"
        if creds is not None:
            if self._by_uid[creds.uid] >= lim.per_uid:
                return f"uid {creds.uid} has {lim.per_uid} connections to this pod manager already"
            if creds.pid > 0 and self._by_pid[creds.pid] >= lim.per_pid:
                return f"process {creds.pid} has {lim.per_pid} connections to this pod manager already"
            self._by_uid[creds.uid] += 1
            if creds.pid > 0:
                self._by_pid[creds.pid] += 1
        self._creds[client_id] = creds
        return None

    def release(self, client_id: int) -> None:
        if client_id not in self._creds:
            return
        creds = self._creds.pop(client_id)
        if creds is not None:
            self._by_uid[creds.uid] -= 1
            if self._by_uid[creds.uid] <= 0:
                del self._by_uid[creds.uid]
            if creds.pid > 0:
                self._by_pid[creds.pid] -= 1
                if self._by_pid[creds.pid] <= 0:
                    del self._by_pid[creds.pid]
