"""Every GPU test runs with GEMINI_PROCADDR_LOG: each hooked process it starts appends every cuGetProcAddress
query it made and where the hook routed it. A query the hook left unrouted (the hook's stderr then says
"returned a variant gemini does not intercept") fails the test that made it, whatever the test checks."""
from __future__ import annotations

from pathlib import Path

import pytest


def unrouted_queries(log: Path) -> list[str]:
    """The lines of a GEMINI_PROCADDR_LOG ("pid symbol version flags result name") whose result is unrouted."""
    if not log.exists():
        return []
    return [ln for ln in log.read_text().splitlines() if len(ln.split()) == 6 and ln.split()[4] == "unrouted"]


@pytest.fixture(autouse=True)
def _every_procaddr_query_is_routed(tmp_path, monkeypatch):
    log = tmp_path / "procaddr-all.log"
    monkeypatch.setenv("GEMINI_PROCADDR_LOG", str(log))
    yield
    bad = unrouted_queries(log)
    assert not bad, "cuGetProcAddress answers the hook does not intercept (pid symbol version flags result " \
                    "name):\n" + "\n".join(bad)
