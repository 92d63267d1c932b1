"""Which unified groups' memory is on the GPU: gem-schd's residency policy. Pure logic, time passed in (ms).

Unified groups (MemoryMode = unified) make their allocations as managed memory, so together they may hold more
than the GPU has. gem-schd keeps their *resident sets* within the GPU's configured capacity (`--device-memory`):

* Before a unified group's slot is granted, its whole managed memory must fit next to what stays resident: the
  memory of device-mode groups, the device-only part of unified groups (VMM, arrays), and the resident sets of
  the other unified groups. If it does not, the resident unified groups that ran least recently are evicted
  (their hooks prefetch everything to the host) until it does; the grant goes out when they have answered, and
  the granted group's hooks prefetch its memory before their first kernel. So a grant and the memory it needs
  arrive together, and the GPU never holds more than the capacity (page-fault thrashing never starts).
* A swap costs bytes out / the measured bandwidth to the host + bytes in / the measured bandwidth to the GPU.
  Each direction is measured apart from the hooks' reports (an average weighted by bytes moved; `default_gbps`
  until a large move was measured), because they differ by an order of magnitude: on an H100 a 12.5 GB set
  went to the host at 1.8-22 GB/s (varying a lot) and came back at 43 GB/s. A move to the GPU counts only when
  the group's memory had been moved to the host: a new job's first prefetch finds its pages on the GPU already
  (10 GB "in 13 ms"), and counting it made the bandwidth look 8 GB/s and the floors too short for 10%. While
  the unified groups do not all fit, each one's slot is made at least `swap / swap_fraction` long
  (`quota_floor_ms`), so swapping takes at most that fraction (10%) of the GPU's time.
* A slot that ends early (its hooks went idle: host work between steps) must not start a swap each time:
  a grant that needs an eviction is *paced*: after one, the next may not come before the swapped-in group's
  slot floor has passed (`swap_gate`, the earliest time each group whose grant would evict may be granted;
  gem-schd hands it to the policy as `Policy.not_before`). Meanwhile the GPU goes to groups that fit without
  an eviction (resident ones, device-mode ones), or stays with the releaser when it asks again; so swapping
  stays within `swap_fraction` of the time whatever the slots' lengths. Without this, three jobs with 40 ms
  of host work per step swapped ~10 GiB at every step on an H100 and the bench never finished.
* A group that cannot fit even alone (its memory exceeds the capacity) runs anyway with everything else evicted:
  the driver then pages the rest on demand, slowly; gem-schd says so in its log.

Without a capacity (None) nothing is managed: unified groups run on the driver's page faults alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_GBPS = 10.0           # a PCIe 4 x16 host link, roughly; replaced by measurements
SWAP_FRACTION = 0.1           # swapping takes at most this part of a unified group's slot
MIN_MEASURED_BYTES = 64 << 20  # smaller moves are dominated by latency: not used to measure bandwidth
# The shortest unified slot while swapping: small groups' swaps are fast by bandwidth, but an eviction also waits
# for the hooks' 2 ms polls, the messages, and an eviction delegate's hold (up to 1 s, hook/residency.c). A held
# grant's slot runs while its evictions are answered; shorter than that, it ended before they were, the other
# group was granted and evicted the first in turn, and the two alternated, neither running (on the simulator:
# 268 ms floors against a 1 s hold, ten evictions in 2.4 s).
SLOT_FLOOR_MIN_MS = 2000.0
# The longest: a floor follows the measured bandwidth, and one slow or mismeasured move (an H100 once moved
# 12.5 GB to the host at 1.8 GB/s; a hook that under-counted what it moved made it look 0.5 GB/s) made floors of
# 107 s, so each group waited minutes for its turn. Above this, swapping may take more than swap_fraction.
SLOT_FLOOR_MAX_MS = 30_000.0


@dataclass
class Tenant:
    unified: bool = False
    managed: int = 0            # managed bytes the group holds (its resident set when resident)
    mem_used: int = 0           # all the bytes it holds (device-mode memory, or managed + device-only)
    resident: bool = False      # counted on the GPU
    last_run: float = -math.inf
    evict_seq: int = 0          # an eviction asked for and not answered yet (0: none)
    on_host: bool = False       # its memory was moved to the host and not back yet (its next prefetch moves it)
    # totals, for status / metrics
    swapped_in: int = 0
    swapped_out: int = 0
    swap_ms: float = 0.0
    evictions: int = 0

    @property
    def fixed(self) -> int:
        """Bytes that stay on the GPU whatever residency decides."""
        return max(0, self.mem_used - self.managed) if self.unified else self.mem_used


@dataclass(frozen=True)
class Eviction:
    group: str
    seq: int
    bytes: int


@dataclass
class ResidencyPolicy:
    capacity: Optional[int]                       # bytes; None: residency is not managed
    # the shortest slot of a unified group while they do not all fit (gem-schd --unified-min-slot)
    slot_floor_min_ms: float = SLOT_FLOOR_MIN_MS
    default_gbps: float = DEFAULT_GBPS
    swap_fraction: float = SWAP_FRACTION
    tenants: dict[str, Tenant] = field(default_factory=dict)
    _seq: int = 0
    _epoch: Optional[tuple[float, str]] = None    # (when, group): the last grant that needed evictions
    # bytes and ms of the moves measured so far, per direction ("host": evictions, "device": prefetches)
    _measured: dict[str, list[float]] = field(default_factory=lambda: {"host": [0.0, 0.0], "device": [0.0, 0.0]})

    # --- what the groups are and hold -------------------------------------------------------

    def configure(self, unified: dict[str, bool]) -> None:
        """The config's groups and which are unified (a reload may change both)."""
        for name in [n for n in self.tenants if n not in unified]:
            del self.tenants[name]
        for name, is_unified in unified.items():
            t = self.tenants.setdefault(name, Tenant())
            if t.unified and not is_unified:
                t.resident, t.evict_seq = False, 0
            t.unified = is_unified

    def update(self, group: str, managed: int, mem_used: Optional[int] = None) -> None:
        """A pod manager's report of what its group holds."""
        t = self.tenants.get(group)
        if t is None:
            return
        t.managed = max(0, managed)
        if mem_used is not None:
            t.mem_used = max(0, mem_used)
        if t.managed == 0 and t.unified:
            t.resident = t.on_host = False      # nothing to keep (a killed process's memory is gone)

    def disconnected(self, group: str) -> None:
        """The group's pod manager went away: its processes' memory went with them."""
        t = self.tenants.get(group)
        if t is not None:
            t.managed = t.mem_used = 0
            t.resident, t.evict_seq, t.on_host = False, 0, False

    # --- decisions ----------------------------------------------------------------------------

    @property
    def managed_here(self) -> bool:
        return self.capacity is not None

    def resident_bytes(self, group: str) -> int:
        t = self.tenants.get(group)
        return t.managed if t is not None and t.unified and t.resident else 0

    def in_use(self, exclude: Optional[str] = None) -> int:
        """Bytes counted on the GPU: every group's fixed memory and the resident unified sets."""
        total = 0
        for name, t in self.tenants.items():
            total += t.fixed
            if name != exclude and t.unified and t.resident:
                total += t.managed
        return total

    def any_unified(self) -> bool:
        """Is any group unified? Without one, a grant has nothing to evict or wait for (configure clears a group's
        outstanding eviction when it stops being unified)."""
        return any(t.unified for t in self.tenants.values())

    def before_grant(self, group: str, now: float) -> list[Eviction]:
        """`group` is about to be granted the GPU at `now`: the evictions that must finish first (least
        recently run first), with the group counted resident from now on."""
        t = self.tenants.get(group)
        if t is None or not t.unified:
            return []
        t.last_run = now
        if self.capacity is None or (t.resident and self.in_use() <= self.capacity):
            t.resident = True
            return []
        swapped_in = not t.resident and t.on_host      # its memory comes back from the host
        t.resident = True
        out = self._evict_least_recent(keep=group)
        if out or swapped_in:
            # A group swapped in gets its floor before a grant may push it out again, whether or not it needed
            # an eviction (on an H100 a job brought back into room a finished job left was evicted 0.4 s later).
            self._epoch = (now, group)
        return out

    def _evict_least_recent(self, keep: Optional[str]) -> list[Eviction]:
        """Mark the resident unified groups other than `keep` evicted, least recently run first, until the
        resident sets fit the capacity (an evicted group is no longer resident: it is not asked twice)."""
        assert self.capacity is not None
        out: list[Eviction] = []
        victims = sorted((v.last_run, name) for name, v in self.tenants.items()
                         if name != keep and v.unified and v.resident and v.managed > 0)
        for _, name in victims:
            if self.in_use() <= self.capacity:
                break
            v = self.tenants[name]
            self._seq += 1
            v.resident, v.evict_seq = False, self._seq
            v.evictions += 1
            out.append(Eviction(name, self._seq, v.managed))
        return out

    def overflow(self, holder: Optional[str], now: float) -> list[Eviction]:
        """The evictions that bring the resident sets back within the capacity after a group grew past it (the
        holder allocating in its slot): the least recently run residents other than the holder. While they
        stay resident, the driver makes room by page faults, which is what explicit residency is there to
        avoid."""
        if self.capacity is None or self.in_use() <= self.capacity:
            return []
        out = self._evict_least_recent(keep=holder)
        t = self.tenants.get(holder) if holder is not None else None
        if out and holder is not None and t is not None and t.unified and t.managed > 0:
            # the holder's growth swapped the others out as a grant would have: pace their way back the same
            # way (else the group it pushed out, if the last grant's, came straight back and evicted it). Not
            # for a holder without a slot floor (device-mode): its gate would be open, the last one's lost.
            self._epoch = (now, holder)
        return out

    def needs_eviction(self, group: str) -> bool:
        """Would granting `group` now evict another unified group (what `before_grant` would do)?"""
        t = self.tenants.get(group)
        if self.capacity is None or t is None or not t.unified or t.managed <= 0:
            return False
        if self.in_use(exclude=group) + t.managed <= self.capacity:
            return False
        return any(name != group and v.unified and v.resident and v.managed > 0
                   for name, v in self.tenants.items())

    def swap_gate(self) -> dict[str, float]:
        """The earliest time (ms) each group whose grant would need an eviction may be granted: the last such
        grant's time plus its group's slot floor (10x its swap). Groups that fit without one are not listed, nor
        is the group that grant swapped in: its floor is its own time on the GPU. It needs an eviction again only
        when it grew past the capacity in its slot (a PyTorch job allocates most of its memory in its first
        steps); pacing it then left every group paced and the GPU idle until the gate opened (105 s on an
        H100); its next grant evicts what no longer fits instead. Once evicted itself, it is paced like any."""
        if self._epoch is None:
            return {}
        since, owner = self._epoch
        floor = self.quota_floor_ms().get(owner, 0.0)
        if floor <= 0:
            return {}
        owner_resident = owner in self.tenants and self.tenants[owner].resident
        return {name: since + floor for name in self.tenants
                if (name != owner or not owner_resident) and self.needs_eviction(name)}

    def fits_alone(self, group: str) -> bool:
        t = self.tenants.get(group)
        return self.capacity is None or t is None or self.in_use() <= self.capacity

    def evicted(self, group: str, seq: int, moved: int, took_ms: float) -> bool:
        """The group's hooks answered eviction `seq`. True if it was the one outstanding."""
        t = self.tenants.get(group)
        if t is None:
            return False
        t.swapped_out += moved
        t.swap_ms += took_ms
        self._measure("host", moved, took_ms)
        if moved > 0:
            t.on_host = True
        if t.evict_seq == 0 or seq != t.evict_seq:
            return False
        t.evict_seq = 0
        return True

    def outstanding(self) -> set[str]:
        """The groups asked to evict that have not answered yet: no grant may go out before they have (their
        memory may still be on the GPU), whichever grant asked for them."""
        return {name for name, t in self.tenants.items() if t.evict_seq != 0}

    def abandon(self, group: str) -> None:
        """Stop waiting for the group's eviction (it did not answer in time): the driver's page faults make the
        rest of the room, and later grants do not wait for it again."""
        t = self.tenants.get(group)
        if t is not None:
            t.evict_seq = 0

    def prefetched(self, group: str, moved: int, took_ms: float) -> None:
        t = self.tenants.get(group)
        if t is None:
            return
        t.swapped_in += moved
        t.swap_ms += took_ms
        if t.on_host:           # else the pages were on the GPU already: nothing was really moved
            self._measure("device", moved, took_ms)
        t.on_host = False

    def _measure(self, direction: str, moved: int, took_ms: float) -> None:
        if moved >= MIN_MEASURED_BYTES and took_ms > 0:
            m = self._measured[direction]
            m[0] += moved
            m[1] += took_ms

    def bytes_per_ms(self, direction: str) -> float:
        """Measured speed of moves to the host ("host") or to the GPU ("device"), bytes per ms."""
        moved, ms = self._measured[direction]
        return moved / ms if ms > 0 else self.default_gbps * 1e6

    def swap_ms(self, nbytes: int) -> float:
        """What moving `nbytes` out and as many in costs."""
        return nbytes / self.bytes_per_ms("host") + nbytes / self.bytes_per_ms("device")

    @property
    def measured_gbps(self) -> float:
        """Both directions' measured moves together (gem-ctl status); 0 before any."""
        moved = sum(m[0] for m in self._measured.values())
        ms = sum(m[1] for m in self._measured.values())
        return moved / ms / 1e6 if ms > 0 else 0.0

    def oversubscribed(self) -> bool:
        """Do the unified groups' memories not all fit at once (so slots end in swaps)?"""
        if self.capacity is None:
            return False
        return sum(t.fixed + (t.managed if t.unified else 0) for t in self.tenants.values()) > self.capacity

    def quota_floor_ms(self) -> dict[str, float]:
        """The shortest slot of each unified group: swapping (its memory in, as much out) takes at most
        `swap_fraction` of it. Empty while everything fits."""
        if not self.oversubscribed():
            return {}
        floors = {}
        for name, t in self.tenants.items():
            if t.unified and t.managed > 0:
                floors[name] = min(max(SLOT_FLOOR_MAX_MS, self.slot_floor_min_ms),
                                   max(self.slot_floor_min_ms, self.swap_ms(t.managed) / self.swap_fraction))
        return floors
