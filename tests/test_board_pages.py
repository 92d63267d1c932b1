"""Board pages that killed gem-schd processes left behind (gemini/board.py, remove_stale_boards).

A gem-schd that stops unlinks its page; one that is killed cannot. Each page is 64 KiB of RAM under /dev/shm, and
this repository's own tests had left 431 of them on the development machine (the SIGKILL tests). A starting
gem-schd that uses the default place now removes the pages of schedulers that are gone, and nothing else.
"""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from gemini.board import DEFAULT_BOARD_DIR, Board, remove_stale_boards
from gemini.config import parse_config
from tests.schd_inproc import DaemonThread


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _page(path: Path, pid: int) -> Path:
    board = Board.create(path)
    board._lib.gemhook_board_init(board._b, pid, 1)    # as if that process had made it
    board.close()
    return path


def _name() -> str:
    return f"gemini-board-{secrets.token_hex(6)}"


def test_only_pages_of_schedulers_that_are_gone_are_removed(tmp_path):
    dead = _dead_pid()
    stale = _page(tmp_path / _name(), dead)
    flare = tmp_path / f"{stale.name}.flare0"
    flare.write_bytes(b"\0" * 64)
    live = _page(tmp_path / _name(), os.getpid())                 # another GPU's gem-schd, still running
    other_name = _page(tmp_path / "gemini-board-mine", dead)        # not the default page's name
    wrong_size = tmp_path / _name()
    wrong_size.write_bytes(b"\0" * 100)
    no_magic = tmp_path / _name()
    no_magic.write_bytes(b"\0" * stale.stat().st_size)
    link = tmp_path / _name()
    link.symlink_to(stale)
    removed = remove_stale_boards(tmp_path)
    assert sorted(removed) == sorted([stale, flare])
    assert not stale.exists() and not flare.exists()
    for kept in (live, other_name, wrong_size, no_magic):
        assert kept.exists(), kept
    assert link.is_symlink()


def test_a_missing_directory_removes_nothing(tmp_path):
    assert remove_stale_boards(tmp_path / "none") == []


def test_a_starting_scheduler_removes_the_default_places_stale_pages():
    """gem-schd with its default board page (in /dev/shm) first removes the pages killed schedulers left there,
    and keeps a live one's."""
    stale = _page(DEFAULT_BOARD_DIR / _name(), _dead_pid())
    live = _page(DEFAULT_BOARD_DIR / _name(), os.getpid())
    try:
        d = DaemonThread(parse_config("[a]\nMaxUtil = 1.0\n", "rc.txt")).start()
        try:
            assert not stale.exists()
            assert live.exists()
            assert d.daemon is not None and d.daemon.board is not None and d.daemon.board.path.exists()
        finally:
            d.stop()
    finally:
        for p in (stale, live):
            p.unlink(missing_ok=True)
