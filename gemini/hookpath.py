"""Where the installed libgemhook.so.1 is."""
from __future__ import annotations

import os
from pathlib import Path

HOOK_NAME = "libgemhook.so.1"
ENV_OVERRIDE = "GEMINI_HOOK_LIB"


class HookNotFound(FileNotFoundError):
    pass


def hook_path() -> Path:
    """The hook library: $GEMINI_HOOK_LIB if set, else the copy inside the package."""
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise HookNotFound(f"{ENV_OVERRIDE}={override} does not name a file")
        return path.resolve()
    path = Path(__file__).resolve().parent / "lib" / HOOK_NAME
    if not path.is_file():
        raise HookNotFound(f"{path} is missing: build it with 'make hook' or reinstall with 'pip install .'")
    return path
