"""gemini/wire/cdefs.py: the cffi modules made from the headers declare exactly what parsing them declares, a module
made from other text is never used, and with the modules in place a daemon starts without pycparser."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemini import board
from gemini.wire import cdefs
from gemini.wire import hook as hp

REPO = Path(__file__).resolve().parent.parent
SETS = {"proto": hp.cdef_text, "board": board.cdef_text}


def _layout(ffi, text: str) -> dict:
    """Every struct's size and field offsets, and every integer constant, that `ffi` declares."""
    out: dict = {}
    for name in sorted(set(re.findall(r"\bstruct\s+(\w+)\s*\{", text))):
        ctype = ffi.typeof(f"struct {name}")
        out[name] = (ffi.sizeof(ctype), [(f, ffi.offsetof(ctype, f)) for f, _ in ctype.fields])
    lib = ffi.dlopen(None)      # (functions are looked up only when used)
    for const in re.findall(r"#define\s+(\w+)\s+(?:0x[0-9a-fA-F]+|\d+)", text):
        out[const] = int(getattr(lib, const))
    return out


@pytest.mark.parametrize("label", sorted(SETS))
def test_a_generated_module_declares_what_parsing_declares(tmp_path, label):
    text = SETS[label]()
    path = cdefs.write_module(label, text, tmp_path)
    loaded = cdefs.ffi_for(label, text, tmp_path)
    parsed = cdefs.ffi_for(label, text, tmp_path / "none")
    # the module's FFI is the backend's own (nothing parsed); the parsed one is cffi's
    assert path.is_file() and type(loaded).__module__ == "_cffi_backend" and type(parsed).__module__ == "cffi.api"
    assert _layout(loaded, text) == _layout(parsed, text)
    assert _layout(loaded, text)    # (it did compare something)


def test_a_module_made_from_other_text_is_not_used(tmp_path):
    old = "struct gem_x { int a; };\n#define GEM_X_OLD 1"
    new = "struct gem_x { int a; long b; };\n#define GEM_X_NEW 2"
    cdefs.write_module("x", old, tmp_path)
    ffi = cdefs.ffi_for("x", new, tmp_path)
    assert ffi.sizeof("struct gem_x") == 16 and int(ffi.dlopen(None).GEM_X_NEW) == 2


def test_a_damaged_module_is_only_a_lost_shortcut(tmp_path):
    text = "struct gem_y { int a; };"
    cdefs.module_path("y", text, tmp_path).parent.mkdir(parents=True, exist_ok=True)
    cdefs.module_path("y", text, tmp_path).write_text("raise ImportError('half written')\n")
    assert cdefs.ffi_for("y", text, tmp_path).sizeof("struct gem_y") == 4


def test_the_command_writes_every_set_and_drops_modules_of_older_headers(tmp_path):
    (tmp_path / "proto_0000.py").write_text("ffi = None\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "gemini.wire.cdefs", "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(
        cdefs.module_path(label, text(), tmp_path).name for label, text in SETS.items())


def test_with_the_modules_in_place_a_pod_manager_starts_without_pycparser():
    """The point of it: pycparser (0.1 s of CPU) is not imported by the daemons' code when the modules match."""
    for label, text in SETS.items():
        cdefs.write_module(label, text())
    probe = "import sys, gemini.podmgr.cli, gemini.scheduler.cli, gemini.board as b; b._ffi(); " \
            "print('pycparser' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", r.stdout
