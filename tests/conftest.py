"""Shared pytest setup: the source tree on sys.path, and the gpu marker's skip rule."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _have_gpu() -> bool:
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    # The simulated driver answers too; it identifies itself so GPU tests never run on it.
    return not hasattr(lib, "simcuda_is_simulated")


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU driver (libcuda.so.1) on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The end-to-end fixtures (hook_lib, sim, backends, client_script) for every test module.
pytest_plugins = ["tests.e2e_fixtures", "tests.peer_fixtures"]
