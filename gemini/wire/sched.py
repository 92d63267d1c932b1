"""Messages between gem-pmgr (zmq DEALER) and gem-schd (zmq ROUTER), and gem-ctl.

Each zmq message is one frame holding a JSON object with a "type" field. The
dataclasses below are the schema; `encode`/`decode` are the only way in and
out, and `decode` rejects anything that does not fit the schema with a
MessageError, so a bad peer can be logged and ignored.

Durations are in milliseconds (floats) so that the JSON stays readable in traces. Instants that both sides
must agree on (a continued slot's deadline, a claim's span) are absolute CLOCK_MONOTONIC seconds (`*_s`): the
daemons of one GPU run on one machine and share that clock.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union

MAX_MESSAGE_BYTES = 64 * 1024  # larger frames are dropped before parsing


class MessageError(ValueError):
    """A frame that does not decode to a known message."""


# --- pod manager -> scheduler ------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """First message from a pod manager, and again whenever the scheduler says it does not know it."""
    TYPE: ClassVar[str] = "hello"
    group: str
    pid: int
    mem_used: int = 0           # bytes the group's clients hold (rebuilds accounting after a restart)
    clients: int = 0
    members: list = field(default_factory=list)     # [pid, uid] per client (uid -1: not known, on TCP)
    managed: int = 0            # unified group: managed bytes its clients hold (what residency moves)


@dataclass(frozen=True)
class TokenRequest:
    TYPE: ClassVar[str] = "token_request"
    group: str
    overuse_ms: float = 0.0     # worst overuse reported by the group's clients since the last request
    burst_ms: float = 0.0       # largest burst prediction of the group's clients; 0 = none
    used_ms: float = 0.0        # GPU time the group's last slot really used (hook events); 0 = not measured
    managed: int = 0            # unified group: managed bytes its clients hold now (what a grant prefetches)


@dataclass(frozen=True)
class TokenRelease:
    """The group's clients are all idle: end the slot now (work-conserving)."""
    TYPE: ClassVar[str] = "token_release"
    group: str
    token_seq: int
    overuse_ms: float = 0.0
    used_ms: float = 0.0


@dataclass(frozen=True)
class ClaimReport:
    """A latency group's claim is over: it held the GPU from start_s to end_s (CLOCK_MONOTONIC seconds)."""
    TYPE: ClassVar[str] = "claim_report"
    group: str
    start_s: float
    end_s: float
    used_ms: float = 0.0        # GPU time its processes measured in it (0: not measured)
    # an early claim: its processes launched this long before start_s, when the claim was not yet on the board
    # (charged to the group, credited to no one: the others were not paused then); at most MAX_CLAIM_AHEAD_MS
    ahead_ms: float = 0.0
    # of ahead_ms, how long the others were held already (the group's flare page was raised, hook/flare.h): credited
    # to the groups it paused, as the span is
    held_ahead_ms: float = 0.0


# The most of an early claim's time ahead that either side believes: hooks launch at most GEMINI_EARLY_CLAIM_MS (2 ms)
# ahead of their answer. The pod manager clamps what its hooks say, gem-schd what a pod manager says.
MAX_CLAIM_AHEAD_MS = 5.0


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    group: str
    mem_used: int = 0
    clients: int = 0
    members: list = field(default_factory=list)     # as in Hello
    managed: int = 0            # as in Hello


@dataclass(frozen=True)
class Swapped:
    """A unified group's hooks moved its managed memory: to the host (direction "host": eviction `seq` is done,
    or given up on when `complete` is false) or to the GPU at a grant (direction "device")."""
    TYPE: ClassVar[str] = "swapped"
    group: str
    direction: str
    seq: int = 0
    moved_bytes: int = 0
    took_ms: float = 0.0
    managed: int = 0            # the group's managed bytes now
    resident: int = 0           # of which on the GPU
    complete: bool = True


@dataclass(frozen=True)
class StatusRequest:
    """From gem-ctl (or anyone): ask for the status table."""
    TYPE: ClassVar[str] = "status"


# --- scheduler -> pod manager ------------------------------------------------------------

@dataclass(frozen=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    group: str
    min_util: float
    max_util: float
    mem_limit: int
    scheduler_id: str           # changes when gem-schd restarts
    turns: bool = False         # ProcessSharing = turns: the group's processes hold the token one at a time
    sched_class: str = "batch"  # Class: batch or latency
    memory_mode: str = "device"  # MemoryMode: device or unified
    board_path: str = ""        # the GPU's board page ("" if none)
    board_slot: int = -1        # the group's line on it
    neighbours: int = 0         # the other groups configured on the GPU (some: the group's queue ends with its slot)


@dataclass(frozen=True)
class Grant:
    TYPE: ClassVar[str] = "grant"
    group: str
    quota_ms: float
    token_seq: int
    continuation: bool = False  # the group keeps the GPU: slot prev_seq runs on until deadline_s
    prev_seq: int = 0
    deadline_s: float = 0.0     # the slot's end on gem-schd's clock (CLOCK_MONOTONIC seconds); 0 = now + quota


@dataclass(frozen=True)
class Evict:
    """Move the unified group's managed memory to the host (answered by Swapped with the same seq)."""
    TYPE: ClassVar[str] = "evict"
    group: str
    seq: int


@dataclass(frozen=True)
class ClaimRight:
    """A latency group may (or may no longer) claim the GPU; each claim lasts at most max_claim_ms."""
    TYPE: ClassVar[str] = "claim_right"
    group: str
    allowed: bool
    max_claim_ms: float


@dataclass(frozen=True)
class ConfigUpdate:
    """Pushed to a group's pod manager when a reload changes its settings."""
    TYPE: ClassVar[str] = "config"
    group: str
    min_util: float
    max_util: float
    mem_limit: int
    turns: bool = False
    sched_class: str = "batch"
    memory_mode: str = "device"
    neighbours: int = 0         # as in Welcome (also pushed to every group when a reload changes it)


@dataclass(frozen=True)
class GroupRemoved:
    TYPE: ClassVar[str] = "group_removed"
    group: str


@dataclass(frozen=True)
class HeartbeatAck:
    TYPE: ClassVar[str] = "heartbeat_ack"
    scheduler_id: str


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    code: str                   # one of the ERR_* strings below
    message: str
    group: str = ""


ERR_UNKNOWN_GROUP = "unknown_group"
ERR_NOT_REGISTERED = "not_registered"
ERR_BAD_MESSAGE = "bad_message"


@dataclass(frozen=True)
class GroupStatus:
    name: str
    min_util: float
    max_util: float
    share: float                # usage over the window / window
    mem_used: int
    mem_limit: int
    clients: int
    holding: bool
    waiting: bool
    wait_ms: float              # how long its current request has waited (0 if none)
    quota_ms: float
    grants: int
    connected: bool
    sched_class: str = "batch"
    target: float = 0.0         # the share the policy steers it to now (0 when it is not active)
    continuations: int = 0      # slots it kept without a handoff
    claims: int = 0             # latency class: claims made, and the GPU time they took
    claim_ms: float = 0.0
    claim_allowed: bool = False
    members: list = field(default_factory=list)     # [pid, uid] of the group's processes (uid -1: TCP)
    memory_mode: str = "device"
    managed_bytes: int = 0      # unified: managed memory the group holds
    resident_bytes: int = 0     # unified: of which gem-schd counts on the GPU
    swapped_in_bytes: int = 0   # unified: bytes moved to the GPU at its grants, in all
    swapped_out_bytes: int = 0  # unified: bytes moved to the host when evicted, in all
    swap_ms: float = 0.0        # unified: time its moves took, in all
    evictions: int = 0


@dataclass(frozen=True)
class StatusReply:
    TYPE: ClassVar[str] = "status_reply"
    scheduler_id: str
    window_ms: float
    holder: str
    groups: list = field(default_factory=list)   # list of GroupStatus as dicts
    config_rejected: str = ""   # why the config file's current content is not in force (last edit rejected)
    device_memory: int = 0      # the capacity unified groups' resident memory must fit in (0: not managed)
    swap_gbps: float = 0.0      # measured speed of the moves (GB/s; 0: none measured yet)
    device_memory_source: str = ""   # where device_memory came from: "flag" (--device-memory), "probe" (the
                                     # GPU's memory less a reserve), "" (not managed)
    device_memory_total: int = 0     # with "probe": the GPU's memory as read


Message = Union[Hello, TokenRequest, TokenRelease, ClaimReport, Heartbeat, Swapped, StatusRequest, Welcome, Grant,
                Evict, ClaimRight, ConfigUpdate, GroupRemoved, HeartbeatAck, Error, StatusReply]
_BY_TYPE: dict[str, type] = {cls.TYPE: cls for cls in Message.__args__}  # type: ignore[attr-defined]

TO_SCHEDULER = frozenset({Hello, TokenRequest, TokenRelease, ClaimReport, Heartbeat, Swapped, StatusRequest})
FROM_SCHEDULER = frozenset({Welcome, Grant, Evict, ClaimRight, ConfigUpdate, GroupRemoved, HeartbeatAck, Error,
                            StatusReply})

_CHECKS = {
    "str": lambda v: isinstance(v, str) and len(v) <= 4096,
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**64,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list) and len(v) <= 1024,
}


# Each message type's field names, in order. Every field is a str, int, float, bool or list (of JSON values): a
# shallow read of the fields gives what dataclasses.asdict would, whose deep copy cost gem-schd 60 µs of CPU at
# every grant (bench/bench_schd_ceiling.py, docs/benchmarks.md "Twenty-seventh session").
_FIELD_NAMES: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in _BY_TYPE.values()}


# One encoder for every message: json.dumps with separators builds a new one at each call (its own cache serves
# the default separators only), a cost on gem-schd's path from a deadline to the grant sent.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(msg: Message) -> bytes:
    body: dict[str, Any] = {"type": msg.TYPE}
    for name in _FIELD_NAMES[type(msg)]:
        body[name] = getattr(msg, name)
    return _ENCODER.encode(body).encode()


def decode(frame: bytes, allowed: frozenset[type] | None = None) -> Message:
    """Parse one frame. Raises MessageError naming what is wrong."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"not JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:   # a number of thousands of digits, nesting too deep
        raise MessageError(f"unparsable JSON: {type(exc).__name__}: {str(exc)[:80]}") from None
    if not isinstance(body, dict):
        raise MessageError("message is not a JSON object")
    mtype = body.pop("type", None)
    cls = _BY_TYPE.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {mtype!r}")
    if allowed is not None and cls not in allowed:
        raise MessageError(f"message type {mtype!r} is not accepted here")
    values = {}
    for f in fields(cls):
        if f.name in body:
            value = body.pop(f.name)
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if not _CHECKS[kind](value):
                raise MessageError(f"{mtype}.{f.name}: bad value {value!r} (expected {kind})")
            values[f.name] = float(value) if kind == "float" else value
    missing = [f.name for f in fields(cls)
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise MessageError(f"{mtype}: missing field(s) {', '.join(missing)}")
    if body:
        raise MessageError(f"{mtype}: unknown field(s) {', '.join(sorted(body))}")
    return cls(**values)
