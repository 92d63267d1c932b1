"""resource-config.txt: the groups, their time shares and their memory limits.

Two formats, detected from the first significant line:

v1 (Gemini's original)::

    2
    podA 0.3 0.5 1073741824
    podB 0.2 1.0 2147483648

  a count N, then N lines ``ID REQUEST LIMIT GPU_MEM`` (MinUtil, MaxUtil, bytes).

v2 (INI)::

    [podA]
    MinUtil = 0.3        # default 0
    MaxUtil = 0.5        # default 1
    MemoryLimit = 1GiB   # default 1GiB; K/M/G/T = 10^3.., Ki/Mi/Gi/Ti = 2^10..
    ProcessSharing = together   # or turns; default together (v1 cannot say)
    Class = batch        # or latency: claims the GPU at once, within a budget of its MinUtil
    MemoryMode = device  # or unified: allocations are managed memory, swapped by gem-schd
    Slots = free         # or aligned: a capped group's slots on a host-wide time grid (one job on several GPUs)
    SocketOwner = alice  # the group's Unix socket (launch-backend --ipc-dir): owner, group, mode
    SocketGroup = ml     #   (defaults: the backend's user and group, mode 0660)
    SocketMode = 0660

Every error is a ConfigError whose text starts with ``file:line:``.
"""
from __future__ import annotations

import functools
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

MAX_NAME_LEN = 63
MAX_CONFIG_BYTES = 4 << 20      # a config is a few lines per group; more than this is not a config
DEFAULT_MEMORY_LIMIT = 1 << 30
MAX_MEMORY = (1 << 63) - 1

_UNITS = {
    "": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT][iI]?)?[bB]?\s*$")


class ConfigError(ValueError):
    """A config that cannot be used. str() is 'file:line: what is wrong', or 'file: what is wrong' when the
    problem is the file itself (line 0: missing, unreadable, not a file)."""

    def __init__(self, path: str, line: int, message: str):
        self.path, self.line, self.message = path, line, message
        super().__init__(f"{path}:{line}: {message}" if line > 0 else f"{path}: {message}")


@dataclass(frozen=True)
class GroupConfig:
    name: str
    min_util: float = 0.0
    max_util: float = 1.0
    mem_limit: int = DEFAULT_MEMORY_LIMIT
    # together: the group's processes share its token at once, as in Gemini; turns: one at a time
    turns: bool = False
    # batch: waits for its slot like Gemini's groups; latency: claims the GPU at once (budget: MinUtil)
    sched_class: str = "batch"
    # device: plain device memory; unified: allocations become managed memory that gem-schd swaps
    memory_mode: str = "device"
    # free: slots whenever the policy grants them; aligned: a capped group's slots start on a grid of the host's
    # monotonic clock, so that the same job's groups on several GPUs (NCCL ranks) run at the same time
    slots: str = "free"
    # the group's Unix socket (--ipc-dir): None = the backend's own user / group, mode 0660
    socket_owner: str | None = None
    socket_group: str | None = None
    socket_mode: int | None = None
    line: int = 0  # where the group is defined, for messages

    # cached: gem-schd's policy reads these for every group at every decision (the config is frozen)
    @functools.cached_property
    def latency(self) -> bool:
        return self.sched_class == "latency"

    @functools.cached_property
    def unified(self) -> bool:
        return self.memory_mode == "unified"

    @functools.cached_property
    def aligned(self) -> bool:
        return self.slots == "aligned"


@dataclass(frozen=True)
class Config:
    groups: tuple[GroupConfig, ...]
    path: str = "<string>"
    format: str = "v2"
    warnings: tuple[str, ...] = field(default=())

    def group(self, name: str) -> GroupConfig | None:
        for g in self.groups:
            if g.name == name:
                return g
        return None

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.groups]


def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824, '1.5G' -> 1500000000, '4096' -> 4096. Raises ValueError."""
    m = _SIZE_RE.match(text) if len(text) <= 64 else None
    if not m:
        raise ValueError(f"bad size {_shown(text)} (use e.g. 4096, 512MiB, 2G, 1.5GiB)")
    number, unit = m.group(1), (m.group(2) or "").upper()
    value = float(number) * _UNITS[unit] if "." in number else int(number) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_MEMORY:
        raise ValueError(f"size {_shown(text)} is too large")
    return int(value)


def _parse_util(text: str, what: str, path: str, line: int) -> float:
    try:
        value = float(text) if len(text) <= 64 else math.nan
    except ValueError:
        raise ConfigError(path, line, f"{what} {_shown(text)} is not a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(path, line, f"{what} {_shown(text)} must be a number between 0 and 1")
    return value


def _parse_mem(text: str, path: str, line: int) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise ConfigError(path, line, f"MemoryLimit: {exc}") from None
    if value <= 0:
        raise ConfigError(path, line, f"MemoryLimit {text!r} must be greater than 0")
    return value


def _check_name(name: str, path: str, line: int) -> None:
    if not name:
        raise ConfigError(path, line, "empty group name")
    if len(name) > MAX_NAME_LEN:
        raise ConfigError(path, line, f"group name {_shown(name, 20)} is longer than {MAX_NAME_LEN} characters")
    if any(c.isspace() for c in name):
        raise ConfigError(path, line, f"group name {_shown(name)} may not contain spaces (use - or _ instead)")
    bad = [c for c in name if not (0x21 <= ord(c) <= 0x7E)]
    if bad:
        raise ConfigError(path, line, f"group name {_shown(name)} has a character that is not printable "
                                      f"ASCII: {bad[0]!r}")
    bad = [c for c in name if c in _NAME_FORBIDDEN]
    if bad:
        raise ConfigError(path, line, f"group name {_shown(name)} may not contain {bad[0]!r}")


_COMMENT_RE = re.compile(r"[#;]")
_NAME_FORBIDDEN = set("[]=#;")


def _shown(text: str, limit: int = 40) -> str:
    """A value quoted for a message, cut so a hostile file cannot flood the log."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _strip_comment(line: str) -> str:
    return _COMMENT_RE.split(line, 1)[0].strip()


def _significant(lines: list[str]):
    for number, raw in enumerate(lines, 1):
        text = _strip_comment(raw)
        if text:
            yield number, text


def _parse_v1(lines: list[str], path: str) -> list[GroupConfig]:
    rows = list(_significant(lines))
    count_line, count_text = rows[0]
    try:
        count = int(count_text)
    except ValueError:
        raise ConfigError(path, count_line,
                          f"first line must be the number of groups, got {_shown(count_text)}") from None
    if count < 0:
        raise ConfigError(path, count_line, f"number of groups {count} is negative")
    body = rows[1:]
    if len(body) != count:
        where = body[-1][0] if body else count_line
        raise ConfigError(path, where, f"the first line says {count} group(s) but {len(body)} follow")
    groups = []
    for number, text in body:
        parts = text.split()
        if len(parts) != 4:
            raise ConfigError(path, number, f"expected 'ID REQUEST LIMIT GPU_MEM', got {len(parts)} field(s)")
        name, request, limit, mem = parts
        _check_name(name, path, number)
        groups.append(GroupConfig(name, _parse_util(request, "REQUEST", path, number),
                                  _parse_util(limit, "LIMIT", path, number), _parse_mem(mem, path, number),
                                  line=number))
    return groups


# A claim is answered by the group's pod manager alone, so gem-schd cannot make room for a claimer's memory, and the
# hooks' prefetch at a claim would put it on the GPU uncounted (past --device-memory); and a swap on a request's path
# is no latency class anyway.
LATENCY_UNIFIED = "Class = latency cannot be combined with MemoryMode = unified (a claim cannot wait for evictions)"

_SECTION_RE = re.compile(r"^\[([^\]]*)\]$")
_KEYS = {"minutil": "min_util", "maxutil": "max_util", "memorylimit": "mem_limit", "processsharing": "turns",
         "class": "sched_class", "memorymode": "memory_mode", "slots": "slots", "socketowner": "socket_owner",
         "socketgroup": "socket_group", "socketmode": "socket_mode"}
_KEY_NAMES = ("MinUtil, MaxUtil, MemoryLimit, ProcessSharing, Class, MemoryMode, Slots, SocketOwner, SocketGroup or "
              "SocketMode")
_SHARING = {"together": False, "turns": True}
_CHOICES = {"sched_class": ("Class", ("batch", "latency")), "memory_mode": ("MemoryMode", ("device", "unified")),
            "slots": ("Slots", ("free", "aligned"))}
# A user or group name as useradd accepts it, or a numeric id.
_ACCOUNT_RE = re.compile(r"^(?:[a-z_][a-z0-9_.-]{0,31}\$?|\d{1,10})$", re.IGNORECASE)


def _parse_choice(attr: str, value: str, path: str, line: int) -> str:
    key, allowed = _CHOICES[attr]
    if value.lower() not in allowed:
        raise ConfigError(path, line, f"{key} {_shown(value)} must be " + " or ".join(repr(a) for a in allowed))
    return value.lower()


def _parse_account(key: str, value: str, path: str, line: int) -> str:
    if not _ACCOUNT_RE.match(value):
        raise ConfigError(path, line, f"{key} {_shown(value)} is not a user or group name or a numeric id")
    return value


def _parse_mode(value: str, path: str, line: int) -> int:
    if not re.fullmatch(r"0?[0-7]{3}", value):
        raise ConfigError(path, line, f"SocketMode {_shown(value)} must be an octal mode such as 0660")
    mode = int(value, 8)
    if mode & 0o002:
        raise ConfigError(path, line, f"SocketMode {value} lets any local user write to the socket "
                                      "(act for the group); use 0660 and SocketGroup")
    return mode


def _parse_v2(lines: list[str], path: str) -> list[GroupConfig]:
    groups: list[GroupConfig] = []
    current: dict | None = None
    seen_keys: set[str] = set()

    def finish() -> None:
        if current is not None:
            groups.append(GroupConfig(**current))

    for number, text in _significant(lines):
        section = _SECTION_RE.match(text)
        if section:
            finish()
            name = section.group(1).strip()
            _check_name(name, path, number)
            current, seen_keys = {"name": name, "line": number}, set()
            continue
        if current is None:
            raise ConfigError(path, number, f"{_shown(text)} is outside any [group] section")
        key, sep, value = text.partition("=")
        if not sep:
            key, sep, value = text.partition(":")
        if not sep:
            raise ConfigError(path, number, f"expected 'Key = value', got {_shown(text)}")
        key, value = key.strip(), value.strip()
        attr = _KEYS.get(key.lower())
        if attr is None:
            raise ConfigError(path, number, f"unknown key {_shown(key)} (expected {_KEY_NAMES})")
        if attr in seen_keys:
            raise ConfigError(path, number, f"{key} given twice in [{current['name']}]")
        seen_keys.add(attr)
        if attr == "mem_limit":
            current[attr] = _parse_mem(value, path, number)
        elif attr == "turns":
            if value.lower() not in _SHARING:
                raise ConfigError(path, number, f"ProcessSharing {_shown(value)} must be 'together' or 'turns'")
            current[attr] = _SHARING[value.lower()]
        elif attr in _CHOICES:
            current[attr] = _parse_choice(attr, value, path, number)
        elif attr in ("socket_owner", "socket_group"):
            current[attr] = _parse_account(key, value, path, number)
        elif attr == "socket_mode":
            current[attr] = _parse_mode(value, path, number)
        else:
            current[attr] = _parse_util(value, key, path, number)
    finish()
    return groups


def parse_config(text: str, path: str = "<string>") -> Config:
    """Parse either format. Raises ConfigError naming file:line."""
    if "\0" in text:
        line = text[: text.index("\0")].count("\n") + 1
        raise ConfigError(path, line, "file contains a NUL byte")
    # Only newlines end lines: str.splitlines() would also split at form feeds and U+2028,
    # and the line numbers in messages would no longer match an editor's.
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    if text.endswith("\n"):
        lines.pop()
    first = next(_significant(lines), None)
    if first is None:
        raise ConfigError(path, max(len(lines), 1), "no groups defined (the file is empty)")
    if first[1].startswith("["):
        fmt, groups = "v2", _parse_v2(lines, path)
    elif re.fullmatch(r"[+-]?\d+", first[1]):
        fmt, groups = "v1", _parse_v1(lines, path)
    else:
        raise ConfigError(path, first[0], f"cannot tell the format: {first[1][:40]!r} is neither a group "
                                          "count (v1) nor a [group] section (v2)")
    if not groups:
        raise ConfigError(path, first[0], "no groups defined")
    seen: dict[str, int] = {}
    for g in groups:
        if g.name in seen:
            raise ConfigError(path, g.line, f"group {g.name!r} is defined twice (first at line {seen[g.name]})")
        seen[g.name] = g.line
        if g.min_util > g.max_util:
            raise ConfigError(path, g.line, f"group {g.name!r}: MinUtil {g.min_util} is above MaxUtil {g.max_util}")
        if g.latency and g.unified:
            raise ConfigError(path, g.line, f"group {g.name!r}: {LATENCY_UNIFIED}")
    warnings = []
    total_min = sum(g.min_util for g in groups)
    if total_min > 1.0 + 1e-9:
        warnings.append(f"{path}: the MinUtil values add up to {total_min:.3g}, more than 1: "
                        "not every guarantee can be met under overload")
    return Config(tuple(groups), path, fmt, tuple(warnings))


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def read_config_bytes(path: str | Path, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a config file, read without ever blocking on what is not a file: it is opened non-blocking
    (a FIFO without a writer opens at once), must be a regular file (not a FIFO, a device such as /dev/zero, a
    socket or a directory, whatever symlink leads there), and may hold at most `max_bytes`. ConfigError else."""
    p = str(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(p))
        raise ConfigError(p, 0, "no such file" if os.path.isdir(parent) else
                          f"no such file (there is no directory {parent})") from None
    except PermissionError:
        raise ConfigError(p, 0, "permission denied: cannot read it") from None
    except OSError as exc:
        raise ConfigError(p, 0, f"cannot read it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
            raise ConfigError(p, 0, f"is {kind}, not a regular file: a config must be a plain file")
        if st.st_size > max_bytes:
            raise ConfigError(p, 0, f"is {st.st_size} bytes, more than a config can be ({max_bytes})")
        chunks, total = [], 0
        while total <= max_bytes:       # the file may grow while we read: stop one byte past the limit
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ConfigError(p, 0, f"grew past {max_bytes} bytes while it was read: not a config")
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(p, 0, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def load_config(path: str | Path) -> Config:
    """Read (read_config_bytes) and parse a config file. A missing, unreadable or special file is a ConfigError
    too."""
    p = Path(path)
    data = read_config_bytes(p)
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Notepad writes one) is not content
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(str(p), line, "file is not valid UTF-8") from None
    return parse_config(text, str(p))
