"""Free PyTorch's cached GPU memory before a unified group's eviction, so that it is not swapped.

In a unified group (MemoryMode = unified) the hook moves all of a process's managed memory to the host when
gem-schd evicts its group, and back at its next grant. PyTorch keeps freed blocks in its caching allocator: to the
hook they are allocated, so they would be moved both ways for nothing. `install()` registers an eviction delegate
with the hook (hook/residency.h): at each eviction the hook waits (at most 1 s, GEM_DELEGATE_WAIT_NS) while a
daemon thread here calls `release_cache()` (by default `torch.cuda.empty_cache()`), then moves only what is still
allocated. The cost: the cache is emptied at every eviction, so the job grows it again after each swap-in.

Nothing is built against PyTorch: the hook's functions are found with ctypes among the process's global symbols
(the hook is LD_PRELOADed), and torch is looked up in sys.modules when an eviction comes. Without the hook the
install does nothing (and says so at debug level); in a group that is not unified no eviction ever comes, and the
thread sleeps in the hook.

This module uses the standard library only: gemini/torch_site/sitecustomize.py loads it by file path into
programs whose Python does not have gemini installed (launch-command --torch-empty-cache-on-evict).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from typing import Any, Callable

log = logging.getLogger("gemini.unified_torch")

WAIT_NS = 100_000_000          # one wait in the hook; between two, the thread sees whether it was stopped
POLL_S = 0.002                 # a hook without gemhook_residency_wait: poll as its watcher does

_lock = threading.Lock()
_delegate: "_Delegate | None" = None


def empty_torch_cache() -> None:
    """torch.cuda.empty_cache() if torch is imported and CUDA is initialised (else there is no cache). Run in the
    delegate's thread, whose current device is the default: the device that holds the most cache is made current
    first, so that freeing does not create a context on another GPU."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return
    cached = [(cuda.memory_reserved(i) - cuda.memory_allocated(i), i) for i in range(cuda.device_count())]
    unused, device = max(cached, default=(0, 0))
    if unused <= 0:
        return
    with cuda.device(device):
        cuda.empty_cache()


class _Hook:
    """The hook's delegate functions, from the process's global symbols; None where the hook is absent."""

    def __init__(self, lib: ctypes.CDLL):
        self.delegate = lib.gemhook_residency_delegate
        self.delegate.argtypes, self.delegate.restype = [ctypes.c_int], ctypes.c_int
        self.pending = lib.gemhook_residency_pending
        self.pending.argtypes, self.pending.restype = [], ctypes.c_uint64
        self.release = lib.gemhook_residency_release
        self.release.argtypes, self.release.restype = [ctypes.c_uint64], None
        self.wait: Any = getattr(lib, "gemhook_residency_wait", None)
        if self.wait is not None:
            self.wait.argtypes, self.wait.restype = [ctypes.c_int64], ctypes.c_uint64

    @classmethod
    def find(cls) -> "_Hook | None":
        try:
            return cls(ctypes.CDLL(None))
        except (AttributeError, OSError):
            return None


class _Delegate:
    def __init__(self, hook: _Hook, release_cache: Callable[[], None]):
        self.hook = hook
        self.release_cache = release_cache
        self.stop = threading.Event()
        self.evictions = 0
        self.thread = threading.Thread(target=self._run, name="gemini-evict-delegate", daemon=True)

    def next_ticket(self) -> int:
        if self.hook.wait is not None:      # sleeps in the hook, the GIL released, until an eviction comes
            return int(self.hook.wait(WAIT_NS))
        ticket = int(self.hook.pending())
        if not ticket:
            self.stop.wait(POLL_S)
        return ticket

    def _run(self) -> None:
        while not self.stop.is_set():
            ticket = self.next_ticket()
            if not ticket or self.stop.is_set():
                continue
            try:
                self.release_cache()
            except Exception:   # noqa: BLE001 -- the program must never be disturbed: the eviction goes on
                log.exception("gemini: freeing the cache before an eviction failed")
            self.hook.release(ticket)
            self.evictions += 1


def install(release_cache: Callable[[], None] | None = None) -> bool:
    """Register the eviction delegate with the hook and start its thread (once per process). `release_cache` frees
    what the program keeps cached (default: empty_torch_cache); its exceptions are logged, never raised. Returns
    whether a delegate is registered (False without the hook)."""
    global _delegate
    with _lock:
        if _delegate is not None:
            return True
        hook = _Hook.find()
        if hook is None:
            log.debug("gemini: no gemini hook in this process (not LD_PRELOADed): no eviction delegate")
            return False
        _delegate = _Delegate(hook, release_cache or empty_torch_cache)
        hook.delegate(1)
        _delegate.thread.start()
        log.debug("gemini: eviction delegate installed")
        return True


def uninstall() -> None:
    """Unregister the delegate (a held eviction goes ahead at the hook's next poll) and stop its thread."""
    global _delegate
    with _lock:
        if _delegate is None:
            return
        _delegate.hook.delegate(0)
        _delegate.stop.set()
        _delegate = None


def _forget_in_child() -> None:
    """A fork child has neither the thread nor (the hook resets it) the registration: it may install its own."""
    global _delegate, _lock
    _delegate = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
