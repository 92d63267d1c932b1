"""Who may join a group: the pod manager's plug-in point for judging a hook by its kernel credentials.

On the socket transport the file system already decides who can connect (the group socket's owner, group and
mode). A PeerAuthorizer can refuse more: the Kubernetes node agent checks that the client's cgroup belongs to
the pod the group stands for. It is asked once per connection, when the HELLO arrives, with the credentials
the kernel gave (SO_PEERCRED) and the group the HELLO names (may be empty). On TCP there are no credentials
and it is not asked.
"""
from __future__ import annotations

from typing import Protocol

from gemini.peercred import PeerCredentials


class PeerAuthorizer(Protocol):
    def authorize(self, creds: PeerCredentials, hello_group: str) -> str | None:
        """None to let the process in; else the reason it is refused (sent to the hook, which prints it)."""
        ...


class AllowAll:
    """The default: whoever could open the group's socket may join."""

    def authorize(self, creds: PeerCredentials, hello_group: str) -> str | None:
        return None
