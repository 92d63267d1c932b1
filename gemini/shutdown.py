"""How a gemini daemon ends once its main has returned (a stop, or an error it reported): at once, without the
interpreter's teardown.

After gem-schd, gem-pmgr or launch-backend has closed its sockets, unlinked its files and logged its last line,
Python's finalisation (freeing every module's objects) still took 60-90 ms of CPU per process, measured from
gem-schd's "stopping" line to its exit. A backend's stop waits on that for each of its daemons, and then for its own;
so does every restart of a pod manager. Nothing of gemini's runs at exit (no atexit handlers; the daemons' stop()
closes what they opened, also after a start that failed part-way), so the only work left is flushing what is
buffered, done here before os._exit. (Tools that save their data at exit, such as coverage, see nothing of the
daemons for the same reason.)
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the log handlers and the standard streams, then end the process with `code` (no teardown)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # closed, a broken pipe, or None (started without the
            pass                                         # descriptor): nothing more can be said anyway
    os._exit(code)
