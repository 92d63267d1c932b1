"""cffi bindings to the pure functions libgemhook exports (gemhook_*), for tests."""
from __future__ import annotations

import functools
import subprocess

from cffi import FFI

from tests.conftest import REPO_ROOT

HOOK_LIB = REPO_ROOT / "gemini" / "lib" / "libgemhook.so.1"

CDEF = """
size_t gemhook_burst_size(void);
void gemhook_burst_init(void *est, int64_t merge_gap_ns, int64_t window_ns);
void gemhook_burst_record(void *est, int64_t start_ns, int64_t end_ns);
int64_t gemhook_burst_predict(const void *est, int64_t now_ns);
int gemhook_parse_size(const char *text, uint64_t *out);
void gemhook_msg_init(void *msg, uint16_t type, uint32_t seq);
int gemhook_msg_check(const void *msg, char *why, size_t why_len);
int gemhook_parse_endpoint(const char *text, char *ip, size_t ip_len, int *port);
int gemhook_stats(char *buf, size_t len);
"""


def build_hook() -> None:
    subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "hook"], check=True, capture_output=True)


@functools.lru_cache(maxsize=None)
def hook_lib():
    build_hook()
    ffi = FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(str(HOOK_LIB))
