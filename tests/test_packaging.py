"""Packaging: `pip install .` builds a wheel without warnings that ships libgemhook.so.1, the wire header and every
console script; the editable install that `make venv` makes is clean too.

Both build from a copy of the checkout's files (what git tracks or would track), so the build starts from a tree
without a built hook, as a fresh clone does.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"gem-schd", "gem-pmgr", "gem-ctl", "launch-backend", "launch-command"}

pytestmark = pytest.mark.slow


def checkout_copy(dst: Path) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files are the source")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        src = REPO / name.decode()
        if src.is_file():
            (dst / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name.decode())
    assert not (dst / "gemini" / "lib" / "libgemhook.so.1").exists()
    return dst


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)


def build_warnings(output: str) -> list[str]:
    """Warnings of the build backend: setuptools' `...Warning:` lines and their `!!` banners. (pip's own
    `WARNING:` lines are about this machine's index settings, not about the package.)"""
    return [line for line in output.splitlines() if re.search(r"[a-z]Warning\b|^\s*!!\s*$", line)]


def test_wheel_builds_without_warnings_and_ships_the_hook(tmp_path):
    src = checkout_copy(tmp_path / "src")
    r = pip("wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(src))
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-3000:]
    assert build_warnings(output) == [], output[-6000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl"), wheel.name   # a native library
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        hook = zf.read("gemini/lib/libgemhook.so.1")
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert hook[:4] == b"\x7fELF" and hook == (src / "gemini" / "lib" / "libgemhook.so.1").read_bytes()
    assert {"gemini/hook_include/gemini_proto.h", "gemini/hook_include/board.h"} <= names   # read by cffi
    assert "gemini/wire/hook.py" in names and "gemini/launch/command.py" in names
    declared = set(re.findall(r"^([\w-]+) = ", entry_points, re.MULTILINE))
    assert SCRIPTS <= declared, entry_points


def test_editable_install_is_clean_and_installs_every_command(tmp_path):
    src = checkout_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    r = pip("--python", str(venv / "bin" / "python"), "install", "--no-deps", "-e", str(src))
    output = r.stdout + r.stderr
    assert r.returncode == 0, output[-3000:]
    assert build_warnings(output) == [], output[-6000:]
    installed = {p.name for p in (venv / "bin").iterdir()}
    assert SCRIPTS <= installed, sorted(installed)


@pytest.mark.parametrize("script", ["launch-backend", "launch-command"])
def test_launch_scripts_run_from_the_venv_and_from_tools(script):
    beside = Path(sys.executable).parent / script
    if not beside.exists():
        pytest.skip(f"{beside} is not installed (run make venv)")
    for argv in ([str(beside), "--help"], [sys.executable, str(REPO / "tools" / f"{script}.py"), "--help"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        assert f"usage: {script}" in r.stdout
