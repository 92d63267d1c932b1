"""The cffi declarations read from the hook's headers, parsed once per header version rather than once per process.

Parsing a cdef imports pycparser and builds its lexer: about 0.1 s of CPU in every gem-schd, gem-pmgr and tool
that starts, more than any other import of theirs. So `python -m gemini.wire.cdefs` (run by `make test`, `make demo`
and `make gpu-check`, and by a wheel's build) writes each declaration set as a cffi out-of-line module, and
`ffi_for` loads that module when it was made from exactly the same text by the same cffi, else parses the text as
before. The header stays the only definition: a module made from an older header is simply not used.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

import cffi
import click
from cffi import FFI

log = logging.getLogger("gemini.wire.cdefs")

GENERATED_DIR = Path(__file__).resolve().parent / "_cdefs"


def _key(text: str) -> str:
    return hashlib.sha256(f"{cffi.__version__}\0{text}".encode()).hexdigest()[:20]


def module_path(label: str, text: str, where: Path | None = None) -> Path:
    """Where the module made from `text` lives: its name holds a hash of the text and of cffi's version."""
    return (where or GENERATED_DIR) / f"{label}_{_key(text)}.py"


def ffi_for(label: str, text: str, where: Path | None = None) -> FFI:
    """An FFI declaring `text`: the generated module's if one was made from this text, else parsed now."""
    path = module_path(label, text, where)
    if path.is_file():
        try:
            spec = importlib.util.spec_from_file_location(f"gemini.wire._cdefs.{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.ffi
        except Exception as exc:     # a damaged or foreign file is only a lost shortcut
            log.debug("not using %s: %s", path, exc)
    ffi = FFI()
    ffi.cdef(text)
    return ffi


def write_module(label: str, text: str, where: Path | None = None) -> Path:
    """Write the out-of-line module for `text` (atomically: daemons may be loading it) and return its path."""
    path = module_path(label, text, where)
    path.parent.mkdir(parents=True, exist_ok=True)
    ffi = FFI()
    ffi.cdef(text)
    ffi.set_source(f"gemini.wire._cdefs.{path.stem}", None)
    source = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):     # it says "generating <file>"
        ffi.emit_python_code(source)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source.getvalue())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def declaration_sets() -> dict[str, Callable[[], str]]:
    """Every declaration set the package parses, by label."""
    from gemini import board
    from gemini.wire import hook
    return {"proto": hook.cdef_text, "board": board.cdef_text}


@click.command(help="Write the cffi module of every declaration set the package parses.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=GENERATED_DIR, show_default=True,
              help="Directory of the modules.")
def main(out: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    keep = {write_module(label, text(), out).name for label, text in declaration_sets().items()}
    for old in out.glob("*.py"):     # modules of older headers: never loaded again
        if old.name not in keep:
            old.unlink()
    log.info("%d cffi modules in %s", len(keep), out)


if __name__ == "__main__":
    main()
