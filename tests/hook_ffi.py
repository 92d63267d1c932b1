"""cffi bindings to the functions libgemhook exports for tests (gemhook_*).

The declarations come from the hook's headers: the lines between `cffi-begin` and `cffi-end` in
hook/util.h (the pure functions), hook/board.h, hook/stats.h (the counters) and hook/kcost.h (the cost
table). GEM_EXPORT is dropped, and a pointer to one of the hook's structs becomes `void *`, so tests pass
plain buffers (they never see the layouts).
"""
from __future__ import annotations

import functools
import re
import subprocess

from cffi import FFI

from tests.conftest import REPO_ROOT

HOOK_LIB = REPO_ROOT / "gemini" / "lib" / "libgemhook.so.1"
HOOK_DIR = REPO_ROOT / "hook"
# The headers whose cffi regions declare the exported test functions.
CDEF_HEADERS = ("util.h", "board.h", "stats.h", "kcost.h")

_REGION = re.compile(r"/\* cffi-begin \*/\n(.*?)/\* cffi-end \*/", re.S)
_STRUCT_PTR = re.compile(r"\bstruct\s+\w+\s*\*")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def cdef_from_headers() -> str:
    """The cffi declarations of the hook's exported test functions, read from its headers."""
    lines = []
    for name in CDEF_HEADERS:
        text = (HOOK_DIR / name).read_text()
        regions = _REGION.findall(text)
        if not regions:
            raise ValueError(f"hook/{name} has no cffi-begin/cffi-end region")
        for region in regions:
            region = _COMMENT.sub("", region)
            for line in region.splitlines():
                line = line.strip()
                if not line:
                    continue
                line = line.replace("GEM_EXPORT ", "")
                lines.append(_STRUCT_PTR.sub("void *", line))
    return "\n".join(lines) + "\n"


def build_hook() -> None:
    subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "hook"], check=True, capture_output=True)


@functools.lru_cache(maxsize=None)
def hook_lib():
    build_hook()
    ffi = FFI()
    ffi.cdef(cdef_from_headers())
    return ffi, ffi.dlopen(str(HOOK_LIB))
