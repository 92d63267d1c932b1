"""Who is at the other end of a Unix socket, as the kernel says (SO_PEERCRED), not as the peer claims.

The pod manager reads these for every hook connection on the socket transport (pid for its dead-client
checks and `gem-ctl status`, uid for its per-user caps), and a PeerAuthorizer (gemini/podmgr/auth.py) may
judge them; the Kubernetes node agent uses the pid to find the client's cgroup.

The pid is the one that called connect(), as seen from the reader's pid namespace: 0 when the client lives
in a namespace the reader cannot see. TCP sockets have no credentials (None).
"""
from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")    # struct ucred: pid_t pid; uid_t uid; gid_t gid (Linux)


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    """The kernel's credentials of a connected AF_UNIX stream socket's peer; None for any other socket."""
    if sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    # Unsigned ids arrive as signed ints: -1 is "no credentials" (overflow ids come as 65534).
    if uid < 0 or gid < 0:
        return None
    return PeerCredentials(pid, uid, gid)


def peer_credentials_of_fd(fd: int) -> PeerCredentials | None:
    """As peer_credentials, for a socket known only by its file descriptor (which stays open)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return peer_credentials(sock)
    finally:
        sock.detach()       # the descriptor belongs to someone else
