"""The hook <-> pod-manager wire format, read from hook/gemini_proto.h through cffi.

The C header is the only definition of the format. This module turns its
frames into typed dataclasses and back, and validates what comes off the wire
so that a bad peer gets a ProtocolError (and its connection closed) instead
of crashing the daemon.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Union

from gemini.wire.cdefs import ffi_for

_HEADER_NAME = "gemini_proto.h"


def header_path() -> Path:
    """Where gemini_proto.h lives: inside the installed package, else in the source tree."""
    here = Path(__file__).resolve().parent.parent  # the gemini package
    for candidate in (here / "hook_include" / _HEADER_NAME, here.parent / "hook" / _HEADER_NAME):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{_HEADER_NAME} not found next to the gemini package")


_DEFINE_RE = re.compile(r"^#define\s+\w+\s+(0x[0-9a-fA-F]+|\d+)\s*$")


def cdef_text(path: Path | None = None) -> str:
    """The cffi-parsable region of the header: integer #defines kept, other # lines dropped."""
    text = (path or header_path()).read_text()
    try:
        region = text.split("/* cffi-begin */", 1)[1].split("/* cffi-end */", 1)[0]
    except IndexError as exc:
        raise ValueError(f"{path or header_path()}: cffi-begin/cffi-end markers missing") from exc
    kept = [ln for ln in region.splitlines() if not ln.lstrip().startswith("#") or _DEFINE_RE.match(ln.strip())]
    return "\n".join(kept)


ffi = ffi_for("proto", cdef_text())

_lib = ffi.dlopen(None)  # only for integer constants; dlopen(None) loads nothing new


def _const(name: str) -> int:
    return int(getattr(_lib, name))


MAGIC = _const("GEM_PROTO_MAGIC")
VERSION = _const("GEM_PROTO_VERSION")
MSG_SIZE = _const("GEM_MSG_SIZE")
HEADER_SIZE = _const("GEM_HEADER_SIZE")
NAME_LEN = _const("GEM_NAME_LEN")
UUID_LEN = _const("GEM_UUID_LEN")
ERRMSG_LEN = _const("GEM_ERRMSG_LEN")
HELLO_FLAG_FAIL_OPEN = _const("GEM_HELLO_FLAG_FAIL_OPEN")
ACK_LATENCY = _const("GEM_ACK_LATENCY")
ACK_UNIFIED = _const("GEM_ACK_UNIFIED")
RESIDENCY_TO_DEVICE = _const("GEM_RESIDENCY_TO_DEVICE")
RESIDENCY_TO_HOST = _const("GEM_RESIDENCY_TO_HOST")
GRANT_BOUND = _const("GEM_GRANT_BOUND")
GRANT_CLAIM = _const("GEM_GRANT_CLAIM")
GRANT_TIGHT = _const("GEM_GRANT_TIGHT")
GRANT_BOARD = _const("GEM_GRANT_BOARD")
BOARD_PATH_LEN = _const("GEM_BOARD_PATH_LEN")

assert ffi.sizeof("struct gem_msg") == MSG_SIZE
assert ffi.sizeof("struct gem_header") == HEADER_SIZE


class MsgType(enum.IntEnum):
    HELLO = _const("GEM_MSG_HELLO")
    HELLO_ACK = _const("GEM_MSG_HELLO_ACK")
    TOKEN_REQUEST = _const("GEM_MSG_TOKEN_REQUEST")
    TOKEN_GRANT = _const("GEM_MSG_TOKEN_GRANT")
    TOKEN_RELEASE = _const("GEM_MSG_TOKEN_RELEASE")
    ACK = _const("GEM_MSG_ACK")
    MEM_ALLOC = _const("GEM_MSG_MEM_ALLOC")
    MEM_FREE = _const("GEM_MSG_MEM_FREE")
    MEM_INFO = _const("GEM_MSG_MEM_INFO")
    MEM_REPLY = _const("GEM_MSG_MEM_REPLY")
    ERROR = _const("GEM_MSG_ERROR")
    RESIDENCY = _const("GEM_MSG_RESIDENCY")
    BOARD_QUERY = _const("GEM_MSG_BOARD_QUERY")
    BOARD_INFO = _const("GEM_MSG_BOARD_INFO")


class ErrorCode(enum.IntEnum):
    NONE = _const("GEM_ERR_NONE")
    PROTOCOL = _const("GEM_ERR_PROTOCOL")
    VERSION = _const("GEM_ERR_VERSION")
    GROUP_MISMATCH = _const("GEM_ERR_GROUP_MISMATCH")
    UNKNOWN_GROUP = _const("GEM_ERR_UNKNOWN_GROUP")
    NO_SCHEDULER = _const("GEM_ERR_NO_SCHEDULER")
    NOT_HELLO = _const("GEM_ERR_NOT_HELLO")
    INTERNAL = _const("GEM_ERR_INTERNAL")
    DEVICE_MISMATCH = _const("GEM_ERR_DEVICE_MISMATCH")
    REFUSED = _const("GEM_ERR_REFUSED")


class MemKind(enum.IntEnum):
    DEVICE = _const("GEM_MEM_DEVICE")
    MANAGED = _const("GEM_MEM_MANAGED")
    ASYNC = _const("GEM_MEM_ASYNC")
    VMM = _const("GEM_MEM_VMM")


class MemVerdict(enum.IntEnum):
    OK = _const("GEM_MEM_OK")
    DENIED = _const("GEM_MEM_DENIED")


class ProtocolError(Exception):
    """A frame that must close the connection. `code` is sent back in a GEM_MSG_ERROR."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# --- typed messages -------------------------------------------------------------------
# Each dataclass names its MsgType and the payload struct field it maps to (None: no payload).
# Field names match the C struct members, so packing is a loop over dataclass fields.


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[MsgType] = MsgType.HELLO
    PAYLOAD: ClassVar[str | None] = "hello"
    pid: int
    device_ordinal: int = 0
    mem_in_use: int = 0
    flags: int = 0
    pid_ns: int = 0             # the process's pid namespace (inode); the pod manager's own: it can see `pid`
    pod_name: str = ""
    device_uuid: str = ""


@dataclass(frozen=True)
class HelloAck:
    TYPE: ClassVar[MsgType] = MsgType.HELLO_ACK
    PAYLOAD: ClassVar[str | None] = "hello_ack"
    client_id: int
    mem_limit: int
    mem_used: int
    group: str
    flags: int = 0              # ACK_LATENCY
    board_slot: int = -1        # the group's line on the board page
    board_path: str = ""        # the GPU's board page


@dataclass(frozen=True)
class TokenRequest:
    TYPE: ClassVar[MsgType] = MsgType.TOKEN_REQUEST
    PAYLOAD: ClassVar[str | None] = "token_request"
    overuse_ns: int = 0
    burst_ns: int = 0
    used_ns: int = 0
    launched_ns: int = 0        # an early claim: when its burst began launching (CLOCK_MONOTONIC); 0: it waited


@dataclass(frozen=True)
class TokenGrant:
    TYPE: ClassVar[MsgType] = MsgType.TOKEN_GRANT
    PAYLOAD: ClassVar[str | None] = "token_grant"
    quota_ns: int
    token_seq: int
    flags: int = 0              # GRANT_BOUND | GRANT_TIGHT | GRANT_CLAIM | GRANT_BOARD
    reserved: int = 0


@dataclass(frozen=True)
class TokenRelease:
    TYPE: ClassVar[MsgType] = MsgType.TOKEN_RELEASE
    PAYLOAD: ClassVar[str | None] = "token_release"
    token_seq: int
    overuse_ns: int = 0
    burst_ns: int = 0
    used_ns: int = 0


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[MsgType] = MsgType.ACK
    PAYLOAD: ClassVar[str | None] = None


@dataclass(frozen=True)
class MemAlloc:
    TYPE: ClassVar[MsgType] = MsgType.MEM_ALLOC
    PAYLOAD: ClassVar[str | None] = "mem_request"
    bytes: int
    kind: int = MemKind.DEVICE


@dataclass(frozen=True)
class MemFree:
    TYPE: ClassVar[MsgType] = MsgType.MEM_FREE
    PAYLOAD: ClassVar[str | None] = "mem_request"
    bytes: int
    kind: int = MemKind.DEVICE


@dataclass(frozen=True)
class MemInfo:
    TYPE: ClassVar[MsgType] = MsgType.MEM_INFO
    PAYLOAD: ClassVar[str | None] = None


@dataclass(frozen=True)
class MemReply:
    TYPE: ClassVar[MsgType] = MsgType.MEM_REPLY
    PAYLOAD: ClassVar[str | None] = "mem_reply"
    verdict: int
    used: int
    limit: int


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    PAYLOAD: ClassVar[str | None] = "error"
    code: int
    message: str


@dataclass(frozen=True)
class Residency:
    """A unified group's hook moved its managed memory (to the device at a grant, to the host when asked)."""
    TYPE: ClassVar[MsgType] = MsgType.RESIDENCY
    PAYLOAD: ClassVar[str | None] = "residency"
    evict_seq: int = 0
    moved_bytes: int = 0
    moved_ns: int = 0
    resident_bytes: int = 0
    managed_bytes: int = 0
    direction: int = 0          # RESIDENCY_TO_DEVICE or RESIDENCY_TO_HOST
    reserved: int = 0


@dataclass(frozen=True)
class BoardQuery:
    """Where is the group's board now? (A grant said it changed, GRANT_BOARD, or the hook's line on its page says
    `moved`: gem-schd restarted.)"""
    TYPE: ClassVar[MsgType] = MsgType.BOARD_QUERY
    PAYLOAD: ClassVar[str | None] = None


@dataclass(frozen=True)
class BoardInfo:
    """The group's board page and line now, as HELLO_ACK gives them."""
    TYPE: ClassVar[MsgType] = MsgType.BOARD_INFO
    PAYLOAD: ClassVar[str | None] = "board_info"
    board_slot: int = -1
    reserved: int = 0
    board_path: str = ""


Message = Union[Hello, HelloAck, TokenRequest, TokenGrant, TokenRelease, Ack, MemAlloc, MemFree, MemInfo,
                MemReply, Error, Residency, BoardQuery, BoardInfo]
_BY_TYPE: dict[int, type] = {cls.TYPE: cls for cls in Message.__args__}  # type: ignore[attr-defined]

# Messages each side may receive; anything else is a protocol error at that end.
HOOK_TO_PMGR = frozenset({MsgType.HELLO, MsgType.TOKEN_REQUEST, MsgType.TOKEN_RELEASE,
                          MsgType.MEM_ALLOC, MsgType.MEM_FREE, MsgType.MEM_INFO, MsgType.RESIDENCY,
                          MsgType.BOARD_QUERY})
PMGR_TO_HOOK = frozenset({MsgType.HELLO_ACK, MsgType.TOKEN_GRANT, MsgType.ACK, MsgType.MEM_REPLY,
                          MsgType.ERROR, MsgType.BOARD_INFO})


def _c_string(cdata_array) -> str:
    raw = bytes(ffi.buffer(cdata_array))
    raw = raw.split(b"\0", 1)[0]
    return raw.decode("utf-8", errors="replace")


def encode(msg: Message, seq: int = 0) -> bytes:
    """Pack a message into one GEM_MSG_SIZE frame."""
    frame = ffi.new("struct gem_msg *")
    frame.hdr.magic = MAGIC
    frame.hdr.version = VERSION
    frame.hdr.type = int(msg.TYPE)
    frame.hdr.size = MSG_SIZE
    frame.hdr.seq = seq & 0xFFFFFFFF
    if msg.PAYLOAD is not None:
        payload = getattr(frame.u, msg.PAYLOAD)
        for f in fields(msg):
            value = getattr(msg, f.name)
            if isinstance(value, str):
                data = value.encode("utf-8")
                capacity = ffi.sizeof(getattr(payload, f.name))
                if len(data) >= capacity:
                    raise ValueError(f"{type(msg).__name__}.{f.name} is longer than {capacity - 1} bytes")
                ffi.memmove(getattr(payload, f.name), data, len(data))
            else:
                setattr(payload, f.name, int(value))
    return bytes(ffi.buffer(frame))


@dataclass(frozen=True)
class Header:
    magic: int
    version: int
    type: int
    size: int
    seq: int


def decode_header(data: bytes) -> Header:
    """Validate a frame header. Raises ProtocolError for anything a sane peer would not send."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(ErrorCode.PROTOCOL, f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    hdr = ffi.cast("struct gem_header *", ffi.from_buffer(data))
    header = Header(hdr.magic, hdr.version, hdr.type, hdr.size, hdr.seq)
    if header.magic != MAGIC:
        raise ProtocolError(ErrorCode.PROTOCOL, f"bad magic 0x{header.magic:08x} (expected 0x{MAGIC:08x})")
    if header.version != VERSION:
        raise ProtocolError(ErrorCode.VERSION,
                            f"protocol version {header.version} is not supported (this side speaks {VERSION})")
    if header.size != MSG_SIZE:
        kind = "oversized" if header.size > MSG_SIZE else "undersized"
        raise ProtocolError(ErrorCode.PROTOCOL, f"{kind} frame: {header.size} bytes (frames are {MSG_SIZE})")
    if header.type not in _BY_TYPE:
        raise ProtocolError(ErrorCode.PROTOCOL, f"unknown message type {header.type}")
    return header


def decode(frame: bytes, allowed: frozenset[MsgType] | None = None) -> tuple[int, Message]:
    """Unpack one whole frame into (seq, message)."""
    if len(frame) != MSG_SIZE:
        raise ProtocolError(ErrorCode.PROTOCOL, f"frame of {len(frame)} bytes (frames are {MSG_SIZE})")
    header = decode_header(frame[:HEADER_SIZE])
    mtype = MsgType(header.type)
    if allowed is not None and mtype not in allowed:
        raise ProtocolError(ErrorCode.PROTOCOL, f"message {mtype.name} is not valid in this direction")
    cls: Any = _BY_TYPE[mtype]
    if cls.PAYLOAD is None:
        return header.seq, cls()
    msg = ffi.cast("struct gem_msg *", ffi.from_buffer(frame))
    payload = getattr(msg.u, cls.PAYLOAD)
    values = {}
    for f in fields(cls):
        raw = getattr(payload, f.name)
        values[f.name] = _c_string(raw) if f.type in ("str", str) else int(raw)
    return header.seq, cls(**values)


def error_frame(code: ErrorCode, message: str, seq: int = 0) -> bytes:
    """An ERROR frame, with the text cut to fit."""
    data = message.encode("utf-8")[: ERRMSG_LEN - 1]
    return encode(Error(code=int(code), message=data.decode("utf-8", errors="ignore")), seq)
