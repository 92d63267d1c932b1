"""Live reload of resource-config.txt: the one watcher of the config, used by gem-schd and launch-backend alike.

A watchdog observer watches the config's DIRECTORY, not the file, so every way editors and tools save works:
writing in place, writing a temp file and renaming it over, deleting and re-creating, and Kubernetes ConfigMap
volumes (where the file is a symlink that is switched by renaming a `..data` link: when the config is a symlink,
any change in the directory triggers a reload).

Events arrive on watchdog's thread; they are handed to the asyncio loop with call_soon_threadsafe and debounced:
the reload runs `debounce_s` (50 ms) after the last event, so a save that produces several events is read once,
when complete -- except that an event which says the writer is done (the file closed after writing, or a file
renamed into place) shortens the wait to `settle_s` (5 ms), so the usual saves are in force within a few ms.
The reload reads and parses the file on a thread of its own, never on the loop: a config that is slow to read (a
network file system) or huge delays nothing else. What it reads is bounded (gemini.config.read_config_bytes): a
FIFO, a device such as /dev/zero, or anything but a regular file is an error naming the file, as is a file of more
than 4 MiB. A ConfigError is logged once, clearly (file:line), and the last good config stays in force; a deleted
file is logged and the last good config kept until the file is back. A good config is passed to the `apply`
callback on the loop. One read runs at a time; saves during a read are read again after it.

Two moments no event covers: the file is read once more when the watch begins (the config in force was read
before it, and an edit in between would never be applied), and a file found empty is read again `debounce_s` later
before it is reported (an editor that saves in place truncates the file before it writes).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable, Optional, Union

from watchdog.events import (FileClosedEvent, FileCreatedEvent, FileDeletedEvent, FileModifiedEvent,
                             FileMovedEvent, FileSystemEvent, FileSystemEventHandler)
from watchdog.observers import Observer

from gemini.config import Config, ConfigError, load_config

log = logging.getLogger("gemini.reload")

# Opening or reading the file (as the reload itself does) must not trigger a reload.
_EVENTS = [FileModifiedEvent, FileClosedEvent, FileCreatedEvent, FileMovedEvent, FileDeletedEvent]


class _Handler(FileSystemEventHandler):
    def __init__(self, reloader: "ConfigReloader"):
        self._reloader = reloader

    def on_any_event(self, event: FileSystemEvent) -> None:  # watchdog's thread
        self._reloader._event(event)


@dataclasses.dataclass(frozen=True)
class _EmptyFile:
    """The file was empty when read (`error` says so): maybe a save in progress."""
    error: ConfigError


class ConfigReloader:
    """Watch `path` and call `apply(config)` on `loop` whenever a new, valid config is saved.

    `current` is the last good config (the one in force). Use `start()`/`stop()`; `reload_now()` forces a read
    (e.g. on SIGHUP). Thread-safe: only `_event` runs on watchdog's thread, and it only schedules work on the loop.
    """

    def __init__(self, path: str | os.PathLike, apply: Callable[[Config], None], *,
                 loop: Optional[asyncio.AbstractEventLoop] = None, debounce_s: float = 0.05,
                 settle_s: float = 0.005, current: Optional[Config] = None):
        self.path = Path(os.path.abspath(path))
        self.apply = apply
        self.debounce_s = debounce_s
        self.settle_s = min(settle_s, debounce_s)
        self.current = current
        self._loop = loop
        self._observer: Optional[Observer] = None  # type: ignore[valid-type]
        self._timer: Optional[asyncio.TimerHandle] = None
        self._missing_logged = False
        self._last_error: Optional[str] = None
        self._watch_all = False
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._reading: Optional[asyncio.Task] = None
        self._again = False
        self._empty_seen = False    # the last read found the file empty, and it is to be read once more
        self.reloads = 0            # configs applied (for tests and status)
        self.errors = 0             # bad saves seen

    @property
    def rejected(self) -> Optional[str]:
        """Why the config file as it is now is not in force (a bad edit, or the file is gone), for gem-ctl status;
        None when the last read of the file applied or changed nothing."""
        if self._missing_logged and not self.path.exists():
            return f"{self.path} was removed; the last good config stays in force until it is back"
        return self._last_error

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        directory = self.path.parent
        self._watch_all = self.path.is_symlink()
        observer = Observer()
        observer.schedule(_Handler(self), str(directory), recursive=False, event_filter=_EVENTS)
        observer.daemon = True
        observer.start()            # the directory is watched once this returns (watchdog adds the watch here)
        self._observer = observer
        if self.current is not None:
            # The config in force was read before the watch: an edit in between made no event and would never be
            # applied (launch-backend reported a group added while gem-schd, starting under load, ran without it
            # for good). One more read now; it applies only what differs from `current`.
            self._poke(self.settle_s)
        log.info("watching %s for changes%s", self.path,
                 " (a symlink: any change in its directory triggers a reload)" if self._watch_all else "")

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)     # a read stuck in the kernel must not hold up the stop
            self._executor = None
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2.0)
            self._observer = None

    # --- events -------------------------------------------------------------------------------------------------

    def _concerns_us(self, event: FileSystemEvent) -> bool:
        if self._watch_all:
            return True
        name = self.path.name
        paths = [event.src_path, getattr(event, "dest_path", "")]
        return any(p and os.path.basename(os.fsdecode(p)) == name for p in paths)

    def _event(self, event: FileSystemEvent) -> None:
        if event.is_directory or not self._concerns_us(event):
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        done = isinstance(event, FileClosedEvent) or (
            isinstance(event, FileMovedEvent) and
            os.path.basename(os.fsdecode(event.dest_path)) == self.path.name)
        try:
            loop.call_soon_threadsafe(self._poke, self.settle_s if done else self.debounce_s)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _poke(self, delay: float) -> None:
        """On the loop: (re)start the debounce timer."""
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.request_reload()

    # --- the reload itself ----------------------------------------------------------------------------------------

    def request_reload(self) -> None:
        """On the loop: read the file on the reader thread, then apply it on the loop (SIGHUP, file events)."""
        if self._reading is not None:
            self._again = True          # read again once the read in flight is done
            return
        assert self._loop is not None
        self._reading = self._loop.create_task(self._reload_off_loop(), name="config-reload")

    async def _reload_off_loop(self) -> None:
        assert self._loop is not None
        try:
            while True:
                self._again = False
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="config-read")
                result = await self._loop.run_in_executor(self._executor, self._read)
                self._handle(result)
                if not self._again:
                    return
        finally:
            self._reading = None

    def _read(self) -> Union[Config, ConfigError, _EmptyFile]:
        """Read and parse (any thread)."""
        try:
            return load_config(self.path)
        except ConfigError as exc:
            try:
                if os.stat(self.path).st_size == 0:
                    return _EmptyFile(exc)
            except OSError:
                pass
            return exc

    def reload_now(self) -> Optional[Config]:
        """Read the file now, on the calling thread. Returns the new config if one was applied. (Asked for: an empty
        file is reported at once.)"""
        return self._handle(self._read(), look_again=False)

    def _handle(self, result: Union[Config, ConfigError, _EmptyFile], look_again: bool = True) -> Optional[Config]:
        """Apply what a read found (on the loop): a new config, or an error that keeps the last good one."""
        if isinstance(result, _EmptyFile) and look_again and not self._empty_seen:
            # An editor that saves in place truncates the file before it writes: read once more after the debounce
            # before saying the file is empty (a read between the two logged a false error, and reset the memory of
            # the last one, so a bad save was reported twice)
            self._empty_seen = True
            self._poke(self.debounce_s)
            return None
        self._empty_seen = False
        if isinstance(result, _EmptyFile):
            result = result.error
        if isinstance(result, ConfigError):
            exc = result
            if not os.path.exists(self.path):
                if not self._missing_logged:
                    log.warning("%s was removed; keeping the last good config until it is back", self.path)
                    self._missing_logged = True
                return None
            self.errors += 1
            text = str(exc)
            if text != self._last_error:
                log.error("config not reloaded, keeping the last good one: %s", text)
                self._last_error = text
            return None
        config = result
        if self._missing_logged:
            log.info("%s is back", self.path)
        self._missing_logged = False
        self._last_error = None
        if self.current is not None and _same(self.current, config):
            log.debug("%s saved without changes", self.path)
            return None
        for warning in config.warnings:
            log.warning("%s", warning)
        self.current = config
        self.reloads += 1
        log.info("config reloaded from %s: %s", self.path,
                 ", ".join(f"{g.name}(min {g.min_util:g}, max {g.max_util:g}, mem {g.mem_limit}"
                           f"{', turns' if g.turns else ''})"
                           for g in config.groups))
        try:
            self.apply(config)
        except Exception:  # never let a callback bug kill the watcher
            log.exception("applying the new config failed")
        return config


def _same(a: Config, b: Config) -> bool:
    """Same groups with the same settings, in the same order (line numbers and comments do not matter)."""
    key = lambda c: [dataclasses.replace(g, line=0) for g in c.groups]  # noqa: E731
    return key(a) == key(b)
