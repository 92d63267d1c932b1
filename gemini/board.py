"""The board: one shared-memory page per GPU through which the daemons reach the hooks without a round trip.

gem-schd creates it (`Board.create`) and publishes each group's current slot on the group's line, so a holder
whose slot continues keeps launching at its deadline; a latency group's pod manager writes its claims on it
(`Board.open` read-write), and batch hooks pause while a claim lasts; a pod manager in turns mode says how many
of its processes wait for the turn. Hooks map it read-only. The layout is in hook/gemini_proto.h and every write
goes through the gemhook_board_* functions of libgemhook.so.1 (hook/board.c), so the hook and the daemons
follow one protocol (a seqlock for slots, atomics for claims).

Times on the board are CLOCK_MONOTONIC nanoseconds, which every process of one machine shares.
"""
from __future__ import annotations

import functools
import glob
import mmap
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from cffi import FFI

from gemini.hookpath import hook_path
from gemini.wire import hook as hp
from gemini.wire.cdefs import ffi_for

_REGION = re.compile(r"/\* cffi-begin \*/\n(.*?)/\* cffi-end \*/", re.S)
_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def _board_header() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "hook_include" / "board.h", here.parent / "hook" / "board.h"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("board.h not found in the package or the source tree")


def cdef_text() -> str:
    """What Python declares: the wire header's region, then board.h's (the page and the gemhook_board_* calls)."""
    region = _REGION.findall(_board_header().read_text())
    return hp.cdef_text() + "\n" + _COMMENT.sub("", "".join(region)).replace("GEM_EXPORT ", "")


@functools.lru_cache(maxsize=None)
def _ffi() -> tuple[FFI, Any]:
    ffi = ffi_for("board", cdef_text())
    return ffi, ffi.dlopen(str(hook_path()))


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class BoardError(RuntimeError):
    """The board page cannot be created or opened."""


def _check_path(path: Path) -> None:
    """The page's path travels to the hooks in a fixed field (HELLO_ACK's board_path): one that does not fit could
    be created and mapped, but no hook could be told of it (every handshake failed to encode)."""
    ffi, lib = _ffi()
    limit = int(lib.GEM_BOARD_PATH_LEN)
    if len(os.fsencode(str(path))) >= limit:
        raise BoardError(f"the board page's path {str(path)!r} is {len(os.fsencode(str(path)))} bytes; hooks are "
                         f"told paths of at most {limit - 1}")


def _create_mapped(path: Path, size: int, mode: int, what: str) -> tuple[Path, mmap.mmap]:
    """A new file of `size` zero bytes beside `path` under a temporary name, with `mode` whatever the umask, mapped
    read-write: the caller initialises it and renames it over `path`, so nobody sees it half made."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise BoardError(f"cannot create the {what} {tmp}: {exc.strerror}") from None
    try:
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        return tmp, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class _MappedFile:
    """A shared-memory file mapped into this process (the board, a flare page): closed once, removed by name."""

    def __init__(self, path: Path, mm: mmap.mmap):
        self.path = path
        self._mm: mmap.mmap | None = mm
        self._ffi, self._lib = _ffi()

    def _drop_view(self) -> None:
        """Forget the cffi view of the mapping (before it is closed)."""

    def close(self) -> None:
        if self._mm is not None:
            self._drop_view()
            try:
                self._mm.close()
            except BufferError:     # a cffi view still alive somewhere: the mapping goes with the process
                pass
            self._mm = None

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# gem-schd's default board page: /dev/shm/gemini-board-<its scheduler id> (gemini/scheduler/daemon.py)
DEFAULT_BOARD_DIR = Path("/dev/shm")
DEFAULT_BOARD_NAME = re.compile(r"gemini-board-[0-9a-f]{12}")


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (kept when in doubt). Not whether it is a gem-schd: a daemon may run inside
    another program (the tests' in-process gem-schd), so a page whose pid was reused stays, the rare leak."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:     # EPERM: another user's process
        return True
    return True


def remove_stale_boards(directory: Path = DEFAULT_BOARD_DIR, name: re.Pattern = DEFAULT_BOARD_NAME) -> list[Path]:
    """Remove the board pages (and their flare pages) that gem-schd processes now gone left in `directory`.

    A gem-schd that stops unlinks its page; one that is killed cannot, and each page is 64 KiB of RAM under
    /dev/shm, so a scheduler that crashed again and again filled it. A page is removed only when it is this
    user's regular file named as gem-schd names its default page, the size and magic of a board, and the process
    its header names is gone. Another GPU's live gem-schd keeps its page. Hooks and pod managers that still map a
    removed page keep their mapping; they map the new page their next handshake names. Returns what was removed."""
    ffi, lib = _ffi()
    size = ffi.sizeof("struct gem_board")
    head_size = ffi.sizeof("struct gem_board_head")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not name.fullmatch(entry.name):
            continue
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or st.st_uid != os.geteuid() or st.st_size != size:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                raw = os.pread(fd, head_size, 0)
            finally:
                os.close(fd)
        except OSError:
            continue
        if len(raw) != head_size:
            continue
        buf = bytearray(raw)
        view = ffi.from_buffer(buf)     # (kept alive while the cast pointer is read)
        head = ffi.cast("struct gem_board_head *", view)
        magic, pid = int(head.magic), int(head.scheduler_pid)
        if magic != lib.GEM_BOARD_MAGIC or _alive(pid):
            continue
        for stale in [path, *Path(directory).glob(f"{glob.escape(entry.name)}.flare*")]:
            try:
                stale.unlink()
                removed.append(stale)
            except OSError:
                pass
    return removed


class Board(_MappedFile):
    """A mapped board page. `create` (gem-schd) makes a new one; `open` (a pod manager) maps an existing one."""

    def __init__(self, path: Path, mm: mmap.mmap):
        super().__init__(path, mm)
        self._b = self._ffi.cast("struct gem_board *", self._ffi.from_buffer(mm))

    @classmethod
    def create(cls, path: str | os.PathLike, mode: int = 0o644) -> "Board":
        """A fresh board at `path` (replacing any old one atomically), readable by hooks (`mode`)."""
        ffi, lib = _ffi()
        size = ffi.sizeof("struct gem_board")
        path = Path(path)
        _check_path(path)
        tmp, mm = _create_mapped(path, size, mode, "board page")
        board = cls(path, mm)
        lib.gemhook_board_init(board._b, os.getpid(), secrets.randbits(63))
        os.replace(tmp, path)
        return board

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Board":
        """Map an existing board read-write (a pod manager's claims and turn waiters)."""
        ffi, _ = _ffi()
        size = ffi.sizeof("struct gem_board")
        path = Path(path)
        _check_path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise BoardError(f"cannot open the board page {path}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size != size:
                raise BoardError(f"{path} is not a board page (size {os.fstat(fd).st_size}, expected {size})")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        board = cls(path, mm)
        if board._b.head.magic != board._lib.GEM_BOARD_MAGIC:
            board.close()
            raise BoardError(f"{path} is not a board page (bad magic)")
        return board

    @property
    def latency_groups(self) -> int:
        """Latency groups in gem-schd's config (a pod manager then asks its hooks for a short queue)."""
        return int(self._b.claims.latency_groups)

    @property
    def generation(self) -> int:
        return int(self._b.head.generation)

    def set_counts(self, latency_groups: int, used_slots: int, groups: int) -> None:
        """gem-schd, at every reload: the config's latency groups, the group lines in use, and its groups (a
        continued holder reads the first and the last to bound its queue as a fresh grant would)."""
        self._lib.gemhook_board_set_counts(self._b, latency_groups, used_slots, groups)

    @property
    def groups(self) -> int:
        """Groups in gem-schd's config (0: a gem-schd that does not say)."""
        return int(self._b.claims.groups)

    def set_groups_waiting(self, waiting: bool) -> None:
        """gem-schd: whether another group than the holder could be granted now (the holder's hooks then give
        the token back when their burst ends, not after the idle release)."""
        self._lib.gemhook_board_set_groups_waiting(self._b, 1 if waiting else 0)

    @property
    def groups_waiting(self) -> bool:
        return bool(self._lib.gemhook_board_groups_waiting(self._b))

    def publish(self, slot: int, token_seq: int, prev_seq: int, deadline_ns: int) -> None:
        self._lib.gemhook_board_publish(self._b, slot, token_seq, prev_seq, deadline_ns)

    def read(self, slot: int) -> tuple[int, int, int] | None:
        """(token_seq, prev_seq, deadline_ns) of a slot, as a hook reads it."""
        seq = self._ffi.new("uint64_t *")
        prev = self._ffi.new("uint64_t *")
        deadline = self._ffi.new("int64_t *")
        if not self._lib.gemhook_board_read(self._b, slot, seq, prev, deadline):
            return None
        return int(seq[0]), int(prev[0]), int(deadline[0])

    def claim(self, slot: int, until_ns: int) -> None:
        self._lib.gemhook_board_claim(self._b, slot, until_ns)

    def unclaim(self, slot: int) -> None:
        self._lib.gemhook_board_unclaim(self._b, slot)

    def claim_until(self) -> int:
        return int(self._lib.gemhook_board_claim_until(self._b))

    def claim_of(self, slot: int) -> int:
        return int(self._b.group[slot].claim_until_ns)

    def set_waiters(self, slot: int, waiters: int) -> None:
        self._lib.gemhook_board_set_waiters(self._b, slot, max(0, min(waiters, 2**32 - 1)))

    def waiters(self, slot: int) -> int:
        return int(self._lib.gemhook_board_waiters(self._b, slot))

    def request_evict(self, slot: int, evict_seq: int) -> None:
        """A unified group's pod manager asks its hooks to move their managed memory to the host."""
        self._lib.gemhook_board_request_evict(self._b, slot, evict_seq)

    def evict_seq(self, slot: int) -> int:
        return int(self._lib.gemhook_board_evict_seq(self._b, slot))

    def mark_moved(self, slot: int) -> None:
        """A pod manager leaves this page for another (gem-schd restarted): its hooks, which read the line, then
        ask it where the new page is (BOARD_QUERY)."""
        self._lib.gemhook_board_mark_moved(self._b, slot)

    def moved(self, slot: int) -> bool:
        return bool(self._lib.gemhook_board_moved(self._b, slot))

    def set_flare(self, slot: int, up: bool) -> None:
        """A latency group's pod manager: whether its hooks' flares count (its flare page is up and it may claim)."""
        self._lib.gemhook_board_set_flare(self._b, slot, 1 if up else 0)

    def flare(self, slot: int) -> bool:
        return bool(self._lib.gemhook_board_flare(self._b, slot))

    @property
    def max_groups(self) -> int:
        return int(self._lib.GEM_BOARD_GROUPS)

    def _drop_view(self) -> None:
        del self._b


def flare_path(board_path: str | os.PathLike, slot: int) -> Path:
    """Where a group's flare page lies: beside the board (hook/flare.c finds it the same way)."""
    return Path(f"{os.fspath(board_path)}.flare{slot}")


class Flare(_MappedFile):
    """A latency group's flare page (hook/gemini_proto.h): its pod manager creates it beside the board, mode 0644
    (only the daemons' user writes it); the group's hooks raise it at an early claim's first launch, and batch hooks
    hold their work on the GPU while it is up and the group's board line says `flare`."""

    def __init__(self, path: Path, mm: mmap.mmap):
        super().__init__(path, mm)
        self._f = self._ffi.cast("struct gem_flare *", self._ffi.from_buffer(mm))

    @classmethod
    def create(cls, board: "Board", slot: int) -> "Flare":
        """A fresh flare page for line `slot` of `board`, replacing this user's stale one; BoardError if the name is
        taken by someone else's file (a page another user could write must never count)."""
        ffi, lib = _ffi()
        path = flare_path(board.path, slot)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if st.st_uid != os.geteuid():
                raise BoardError(f"{path} exists and belongs to uid {st.st_uid}: no flare page for this group")
            os.unlink(path)
        tmp, mm = _create_mapped(path, int(lib.GEM_FLARE_SIZE), 0o644, "flare page")
        flare = cls(path, mm)
        lib.gemhook_flare_init(flare._f, slot, board.generation)
        os.replace(tmp, path)
        return flare

    def until_ns(self) -> int:
        """The latest end of the group's raised flares (CLOCK_MONOTONIC ns), 0 if down."""
        return int(self._lib.gemhook_flare_until(self._f))

    def raises(self) -> int:
        return int(self._lib.gemhook_flare_raises(self._f))

    def raise_until(self, until_ns: int) -> None:
        """What a hook does at an early claim's first launch (for tests and tools)."""
        self._lib.gemhook_flare_raise(self._f, until_ns)

    def changed(self) -> None:
        """The group's claims changed on the board: wake the mirrors that sleep on this page."""
        self._lib.gemhook_flare_changed(self._f)

    def _drop_view(self) -> None:
        del self._f
