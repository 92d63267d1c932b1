"""One log line format for every gemini program, so that lines from all of them read alike in one stream
(launch-backend's stderr carries its daemons' lines, a hooked program's stderr carries the hook's):

    2026-11-22 16:25:01.123 gem-schd info: gem-schd 3f2a9c0d1e4b listening on tcp://127.0.0.1:50051 ...
    2026-11-22 16:25:01.456 gem-pmgr[train] warn: gem-schd at tcp://127.0.0.1:50051 has not answered for 3 s ...
    2026-11-22 16:25:02.789 gemini[4242] error: the pod manager at 127.0.0.1:50052 is unreachable ...

local time to the millisecond, the program (gem-pmgr with its group, the hook with its process id), the level
(debug, info, warn, error), the message. The hook writes the same from C (gem_log in hook/libgemhook.c).
"""
from __future__ import annotations

import logging
import sys
from typing import IO, Optional

DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVEL_WORDS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
               logging.CRITICAL: "critical"}
LEVEL_NAMES = ("debug", "info", "warning", "error")     # what --log-level accepts
_STEPS = (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)


class LineFormatter(logging.Formatter):
    """`TIME PROGRAM LEVEL: MESSAGE`, as in the module docstring."""

    def __init__(self, program: str):
        super().__init__(f"%(asctime)s.%(msecs)03d {program.replace('%', '%%')} %(level_word)s: %(message)s",
                         DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.level_word = LEVEL_WORDS.get(record.levelno, record.levelname.lower())
        return super().format(record)


def level_from_flags(verbose: int, log_level: Optional[str], default: int) -> int:
    """--log-level NAME if given; else `default`, one step more verbose per -v (debug at most)."""
    if log_level:
        return getattr(logging, log_level.upper())
    step = _STEPS.index(default) if default in _STEPS else 1
    return _STEPS[min(step + max(verbose, 0), len(_STEPS) - 1)]


def setup_logging(program: str, level: int, *, library_debug: bool = False,
                  stream: Optional[IO[str]] = None) -> None:
    """Log to stderr (or `stream`) in the one format, at `level`. watchdog's debug lines (one per file event) only
    with library_debug (-vvv): at -vv, launch-backend logging to a file beside the config it watches fed itself
    (each line an event, each event a line) and slowed gem-schd's grants by ms. Like logging.basicConfig, it does
    nothing to a root logger that has handlers already."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(LineFormatter(program))
    logging.basicConfig(level=level, handlers=[handler])
    if not library_debug:
        logging.getLogger("watchdog").setLevel(logging.WARNING)
