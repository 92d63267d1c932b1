"""Where the daemons listen and how to reach them: TCP endpoints, and the Unix-socket layout (`--ipc-dir`).

Socket transport (as in Gemini v2). Under one directory, `DIR` (default /tmp/gemini/ipc), each GPU has a
subdirectory named by its UUID, or `default` when the backend was given none:

    DIR/<GPU-uuid or default>/gem-schd.sock        gem-schd (zmq ipc://), mode 0600: the backend's user only
    DIR/<GPU-uuid or default>/group.<name>.sock    a group's pod manager (hooks), SocketOwner/Group/Mode

A group name is written into the file name byte for byte, except that every byte other than a letter, a digit,
`_`, `-` or `.` becomes `%XX` (so `a/b` is `group.a%2Fb.sock`): no name can leave the directory, two names
never share a file, and the hook computes the same name in C (hook/client.c).

Who may connect is decided by the file system: connecting needs write permission on the socket file and
search permission on the directories. So the directories must not be writable by anyone but the backend's
user (or root): otherwise another user could remove a socket and put their own in its place.
`ensure_socket_dir` checks every component of the path, and creates what is missing 0755.
`bind_unix` creates a socket under a temporary name, gives it its owner and mode, and renames it into place:
the socket is never reachable with looser permissions, and a socket left by a dead process is replaced
atomically by its restart.

Unix socket addresses are limited to 107 bytes. Longer paths are reached through `/proc/self/fd/N/name`, N an
open descriptor of the socket's directory (`short_path`), by the daemons and the hook alike.
"""
from __future__ import annotations

import errno
import grp
import ipaddress
import os
import pwd
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_IPC_DIR = "/tmp/gemini/ipc"
DEFAULT_GPU_DIR = "default"
SCHEDULER_SOCKET = "gem-schd.sock"
GROUP_SOCKET_PREFIX = "group."
GROUP_SOCKET_SUFFIX = ".sock"
DEFAULT_GROUP_SOCKET_MODE = 0o660
SCHEDULER_SOCKET_MODE = 0o600
DIR_MODE = 0o755
MAX_SUN_PATH = 107              # sizeof(sockaddr_un.sun_path) - 1 on Linux

ENV_IPC_DIR = "GEMINI_IPC_DIR"
ENV_GROUP_NAME = "GEMINI_GROUP_NAME"

_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_GPU_DIR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,79}$")


class TransportError(Exception):
    """A socket directory or socket that cannot be used safely; the text names the path and the problem."""


# --- TCP ---------------------------------------------------------------------------------------------

# On TCP, gem-schd listens on DEFAULT_SCHEDULER_PORT and launch-backend gives the groups' pod managers the ports
# above it, so the first group's is DEFAULT_POD_MANAGER_PORT, which is also where a hook looks when
# POD_MANAGER_PORT is not set (hook/settings.c has the same number: it is C and cannot import this).
DEFAULT_IP = "127.0.0.1"
DEFAULT_SCHEDULER_PORT = 50051
DEFAULT_POD_MANAGER_PORT = DEFAULT_SCHEDULER_PORT + 1


def is_ipv6(ip: str) -> bool:
    """True for an IPv6 address literal (not for a host name, nor for 'ip:port')."""
    try:
        return ipaddress.ip_address(ip.strip("[]")).version == 6
    except ValueError:
        return False


def parse_port(text: str, lowest: int = 1) -> int:
    """A TCP port number written as text (a flag, an environment variable). ValueError saying why not."""
    try:
        port = int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a port number") from None
    if not lowest <= port <= 65535:
        raise ValueError(f"{port} is not a port number ({lowest} to 65535)")
    return port


def host_port(ip: str, port: int | str) -> str:
    """ip:port as it is written in an endpoint, a URL or a message (IPv6 literals in brackets)."""
    host = f"[{ip.strip('[]')}]" if is_ipv6(ip) else ip
    return f"{host}:{port}"


def tcp_endpoint(ip: str, port: int | str) -> str:
    """zmq's tcp:// endpoint for ip:port (IPv6 literals in brackets)."""
    return f"tcp://{host_port(ip, port)}"


# --- the socket layout -----------------------------------------------------------------------------

def gpu_dir_name(device_uuid: str | None) -> str:
    """The GPU's subdirectory: its UUID, or `default`."""
    if not device_uuid:
        return DEFAULT_GPU_DIR
    if not _GPU_DIR_RE.match(device_uuid):
        raise TransportError(f"device UUID {device_uuid[:80]!r} cannot name a directory (expected e.g. GPU-1ede...)")
    return device_uuid


def encode_group(group: str) -> str:
    """A group name as a file name: bytes outside [A-Za-z0-9_.-] written as %XX."""
    return "".join(chr(b) if b in _SAFE_BYTES else f"%{b:02X}" for b in group.encode())


def gpu_dir(ipc_dir: str | os.PathLike, device_uuid: str | None = None) -> Path:
    return Path(os.path.abspath(ipc_dir)) / gpu_dir_name(device_uuid)


def scheduler_socket(ipc_dir: str | os.PathLike, device_uuid: str | None = None) -> Path:
    return gpu_dir(ipc_dir, device_uuid) / SCHEDULER_SOCKET


def group_socket(ipc_dir: str | os.PathLike, group: str, device_uuid: str | None = None) -> Path:
    return gpu_dir(ipc_dir, device_uuid) / f"{GROUP_SOCKET_PREFIX}{encode_group(group)}{GROUP_SOCKET_SUFFIX}"


class ShortPath:
    """A socket path usable in a sockaddr_un: the path itself when it fits, else /proc/self/fd/N/name with N
    an open descriptor of its directory (kept open until close())."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fd: int | None = None
        if len(os.fsencode(self.path)) <= MAX_SUN_PATH:
            self.address = self.path
            return
        directory, name = os.path.split(self.path)
        self._fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.address = f"/proc/self/fd/{self._fd}/{name}"
        if len(os.fsencode(self.address)) > MAX_SUN_PATH:
            self.close()
            raise TransportError(f"{self.path}: the socket's file name alone is too long for a Unix socket address")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ShortPath":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ipc_endpoint(address: str) -> str:
    return f"ipc://{address}"


# --- owners and modes -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SocketAccess:
    """Who may connect to a socket: its owner and group (names or numeric ids; None = this process's) and mode."""
    owner: str | None = None
    group: str | None = None
    mode: int = DEFAULT_GROUP_SOCKET_MODE

    def ids(self) -> tuple[int, int]:
        """(uid, gid) to give the socket; -1 leaves one as it is. TransportError for unknown names."""
        return _resolve(self.owner, pwd.getpwnam, "user"), _resolve(self.group, grp.getgrnam, "group")

    def check(self) -> tuple[int, int]:
        """ids(), and a TransportError now if this process will not be allowed to apply them."""
        if self.mode & 0o002:
            raise TransportError(f"socket mode {self.mode:04o} lets any local user connect")
        uid, gid = self.ids()
        euid = os.geteuid()
        if euid != 0:
            if uid not in (-1, euid):
                raise TransportError(f"only root can give a socket to user {self.owner!r} (running as uid {euid})")
            if gid not in (-1, os.getegid()) and gid not in os.getgroups():
                raise TransportError(f"cannot give a socket to group {self.group!r}: not a member "
                                     f"(running as uid {euid})")
        return uid, gid

    def describe(self) -> str:
        return f"owner {self.owner or '(backend user)'}, group {self.group or '(backend group)'}, mode {self.mode:04o}"


def _resolve(name: str | None, lookup, what: str) -> int:
    if name is None:
        return -1
    if name.isdigit():
        return int(name)
    try:
        entry = lookup(name)
    except KeyError:
        raise TransportError(f"no such {what}: {name!r}") from None
    return entry[2]


def apply_access(path: str | os.PathLike, access: SocketAccess) -> None:
    """Give an existing socket file its owner, group and mode (chown first: it may reset set-id bits)."""
    uid, gid = access.check()
    if uid != -1 or gid != -1:
        os.chown(path, uid, gid, follow_symlinks=False)
    os.chmod(path, access.mode)


# --- directories ------------------------------------------------------------------------------------

def _check_component(path: str, st: os.stat_result) -> None:
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        raise TransportError(f"{path} belongs to uid {st.st_uid}, not to root or this user (uid {euid}): whoever "
                             "owns it could replace the sockets in it; use another --ipc-dir")
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise TransportError(f"{path} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}): anyone who can write there could replace "
                             "the sockets in it; chmod go-w it or use another --ipc-dir")


def check_path_safe(path: str | os.PathLike) -> None:
    """Every existing component of `path` (as written, and after following symlinks) belongs to root or to us,
    and no directory among them is writable by others unless it is sticky (as /tmp): nobody else can move,
    remove or replace what lies below. TransportError names the first component that fails."""
    absolute = os.path.abspath(path)
    for variant in (absolute, os.path.realpath(absolute)):
        parts = Path(variant).parts
        for i in range(1, len(parts) + 1):
            prefix = os.path.join(*parts[:i])
            try:
                st = os.lstat(prefix)
            except FileNotFoundError:
                break
            except OSError as exc:
                raise TransportError(f"{prefix}: {exc.strerror or exc}") from None
            if variant == absolute and stat.S_ISLNK(st.st_mode):
                _check_component(prefix, st)
                continue        # the target is checked with the real path
            _check_component(prefix, st)


def ensure_socket_dir(ipc_dir: str | os.PathLike, device_uuid: str | None = None) -> Path:
    """DIR/<gpu>, created 0755 where missing, every component checked (check_path_safe). Returns its path."""
    target = gpu_dir(ipc_dir, device_uuid)
    check_path_safe(target)
    missing = []
    p = target
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:     # a sibling daemon made it meanwhile
            pass
        except OSError as exc:
            raise TransportError(f"cannot create {d}: {exc.strerror or exc}") from None
        else:
            os.chmod(d, DIR_MODE)   # mkdir's mode went through the umask
    if not target.is_dir():
        raise TransportError(f"{target} is not a directory")
    check_path_safe(target)         # again: nothing was swapped in while we created it
    return target


# --- sockets --------------------------------------------------------------------------------------

def socket_in_use(path: str | os.PathLike) -> bool:
    """True if something accepts connections on the Unix socket `path`; False if nothing is there, or only a
    socket file left by a process that is gone."""
    try:
        short = ShortPath(path)
    except (OSError, TransportError):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(short.address)
        return True
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK)
    finally:
        short.close()


def _refuse_live(path: str | os.PathLike, what: str) -> bool:
    """TransportError if `path` is not a socket, or a live `what` listens there. True if a dead one's file is."""
    if not os.path.lexists(path):
        return False
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise TransportError(f"{path} exists and is not a socket: remove it, or use another --ipc-dir")
    if socket_in_use(path):
        raise TransportError(f"{path}: another {what} is listening there")
    return True


def remove_stale(path: str | os.PathLike, what: str) -> None:
    """Before binding `path` in place: refuse if a live `what` listens there; remove a dead one's socket file."""
    if _refuse_live(path, what):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def bind_unix(path: str | os.PathLike, access: SocketAccess, what: str = "daemon") -> socket.socket:
    """A listening AF_UNIX stream socket at `path` with `access`. It is bound under a temporary name (mode 0600),
    given its owner and mode, and renamed into place, which replaces a dead process's socket atomically.
    TransportError if a live one listens there."""
    path = Path(path)
    access.check()
    _refuse_live(path, what)
    tmp = path.with_name(f".{secrets.token_hex(6)}.tmp")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with ShortPath(tmp) as short:
            old = os.umask(0o177)
            try:
                sock.bind(short.address)
            finally:
                os.umask(old)
        try:
            apply_access(tmp, access)
            sock.listen(512)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def unlink_if_ours(path: str | os.PathLike, inode: int | None) -> None:
    """Remove the socket file at `path` if it is still the one we created (same inode)."""
    if inode is None:
        return
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def connect_unix(path: str | os.PathLike, timeout: float | None = None) -> socket.socket:
    """A connected AF_UNIX stream socket (OSError as connect raises it)."""
    with ShortPath(path) as short:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(short.address)
        except BaseException:
            sock.close()
            raise
    return sock
