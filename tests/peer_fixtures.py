"""Fixtures for tests that need a process of another uid (tests/conftest.py registers them).

The tests run as root, which passes every file permission check. Where a test needs a process that may NOT open
a socket, a child drops to uid/gid 65534 (nobody) with os.setuid in preexec_fn (or after fork), so the kernel
itself judges the permissions. Such a child needs a path it can search: `public_dir` is a 0755 directory under
/tmp (pytest's tmp_path is 0700).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops to another uid: needs root")


def as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.fixture
def public_dir():
    """A 0755 directory under /tmp (pytest's tmp_path is 0700: other uids could not even search it)."""
    path = Path(tempfile.mkdtemp(prefix="gemini-ipc-test-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _python_for_nobody() -> str | None:
    """A Python that uid 65534 can run (the venv's may live under root's 0700 home); None if there is none."""
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"):
        if not candidate or not os.path.exists(candidate):
            continue
        try:
            ok = subprocess.run([candidate, "-c", "pass"], preexec_fn=as_nobody, timeout=30,
                                capture_output=True).returncode == 0
        except OSError:
            ok = False
        if ok:
            return candidate
    return None


@pytest.fixture(scope="module")
def nobody_python() -> str:
    if os.geteuid() != 0:
        pytest.skip("drops to another uid: needs root")
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python that uid 65534 may run")
    return python




class RefuseAll:
    """A PeerAuthorizer for tests: nobody may join (gem-pmgr --authorizer tests.peer_fixtures:RefuseAll)."""

    def authorize(self, creds, hello_group: str) -> str | None:
        return f"pid {creds.pid} uid {creds.uid} may not join {hello_group!r} (test authorizer)"
