"""End to end: the real hook (LD_PRELOAD) on the simulated driver, against a real backend.

Each test runs unmodified driver-API programs (tests/clients) under libgemhook.so.1 and judges the hook by
what the programs, the simulated device (SIMCUDA_TRACE) and the hook's own counters (GEMINI_STATS_FILE)
report. Interception, time sharing, early release, capture, failure handling and fork.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.harness import Group, Trace, common_span, shares_over, window_errors
from tests import native
from tests.e2e_fixtures import *  # noqa: F401,F403  (fixtures and helpers)
from tests.e2e_fixtures import Sim, client_argv, finish, run, start

KERNEL_US = 1000


def workload(name: str, *args: object) -> list[str]:
    return client_argv(name, "--kernel-us", KERNEL_US, "--json", *args)


# --- interception ----------------------------------------------------------------------------------

def test_every_client_style_is_intercepted_and_every_launch_counted(sim, backends, client_script):
    """cudart-style (cuGetProcAddress, also per-thread-stream variants), linked (-lcuda) and Python (ctypes
    dlsym) clients: correct results, every launch seen by the hook, each through its own route."""
    be = backends([Group("solo", 0.0, 1.0)])
    kernels = 60
    styles = {
        "procaddr": workload("workload-procaddr", "--kernels", kernels, "--sync-every", 10),
        "procaddr-ptsz": workload("workload-procaddr", "--kernels", kernels, "--sync-every", 10, "--ptsz"),
        "linked": workload("workload-linked", "--kernels", kernels, "--sync-every", 10),
        "pyclient": client_argv("pyclient.py", "--kernels", kernels, "--kernel-us", KERNEL_US, "--sync-every", 10,
                                "--json"),
    }
    # launch-command itself starts the programs, as a user would
    procs = {name: be.spawn("solo", argv, env=sim.env()) for name, argv in styles.items()}
    for p in procs.values():
        p.started_at = time.monotonic()
    results = {name: finish(p) for name, p in procs.items()}
    stats = sim.stats()
    for name, res in results.items():
        assert res.rc == 0, res
        out = res.json
        assert out["kernels_done"] == kernels and out["launches"] == kernels, res
        assert out["onchip_ns"] >= kernels * KERNEL_US * 1000, res     # every gem_spin really ran its time
        st = stats[out["pid"]]
        assert st["launches"] == kernels, (name, st)
        assert st["grants"] >= 1 and st["gate_errors"] == 0, (name, st)
    for name in ("procaddr", "procaddr-ptsz"):
        assert stats[results[name].json["pid"]]["procaddr_routed"] > 0, name
    assert stats[results["pyclient"].json["pid"]]["dlsym_routed"] > 0


LAUNCH_KINDS = ["kernel", "ex", "cooperative", "graph"]


def test_every_launch_kind_is_gated(sim, backends):
    """Each launch kind, in a group capped at 10 %, gets about 10 % of the device and waits for tokens; alone in
    an uncapped group it gets nearly all of it."""
    be = backends([Group(f"capped-{k}", 0.0, 0.1) for k in LAUNCH_KINDS] + [Group("full", 0.0, 1.0)])
    kernels = 150
    procs = {k: start(workload("workload-procaddr", "--launch", k, "--kernels", kernels, "--sync-every", 10),
                      sim.hooked(be, f"capped-{k}")) for k in LAUNCH_KINDS}
    capped = {k: finish(p) for k, p in procs.items()}
    alone = {k: run(workload("workload-procaddr", "--launch", k, "--kernels", 100, "--sync-every", 10),
                    sim.hooked(be, "full")) for k in LAUNCH_KINDS}
    stats = sim.stats()
    for kind in LAUNCH_KINDS:
        res = capped[kind]
        assert res.rc == 0, res
        out = res.json
        assert out["kernels_done"] == kernels, res
        share = out["onchip_ns"] / out["wall_ns"]
        # ungated, four busy processes would get about a quarter each
        assert share < 0.16, f"{kind}: share {share:.3f} in a group capped at 0.1"
        st = stats[out["pid"]]
        assert st["waits"] > 0 and st["wait_ms"] > 0.5 * out["wall_ns"] / 1e6, (kind, st)
        res = alone[kind]
        assert res.rc == 0, res
        out = res.json
        share = out["onchip_ns"] / out["wall_ns"]
        assert share > 0.8, f"{kind}: share {share:.3f} alone in an uncapped group"
        assert stats[out["pid"]]["grants"] >= 1


# --- dlsym keeps the caller's semantics ------------------------------------------------------------

DLSYM_FIRST = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
int probe_value(void) { return 1; }
int cudaLaunchKernel(void) { return 11; }   /* a cuda* (not cu[A-Z]*) name: never the hook's business */
/* Not a tail call (built -O0, and the barrier): glibc must see this library as the caller. */
void *first_next_probe(void) {
    void *p = dlsym(RTLD_NEXT, "probe_value");
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}
"""
DLSYM_SECOND = r"""
int probe_value(void) { return 2; }
"""
DLSYM_MAIN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
void *first_next_probe(void);
typedef int (*int_fn)(void);

static const char *lib_of(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_fname) return "null";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}
static int call(void *p) { return p ? ((int_fn)p)() : -1; }

int main(void) {
    void *first = dlopen("libe2efirst.so", RTLD_NOW | RTLD_NOLOAD);
    void *second = dlopen("libe2esecond.so", RTLD_NOW | RTLD_NOLOAD);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    printf("next_from_library=%d\n", call(first_next_probe()));
    printf("next_from_main=%d\n", call(dlsym(RTLD_NEXT, "probe_value")));
    printf("default=%d\n", call(dlsym(RTLD_DEFAULT, "probe_value")));
    printf("handle_first=%d\n", call(dlsym(first, "probe_value")));
    printf("handle_second=%d\n", call(dlsym(second, "probe_value")));
    printf("cuda_name_in_first=%d\n", call(dlsym(first, "cudaLaunchKernel")));
    printf("cu_launch_from_cuda=%s\n", lib_of(dlsym(cuda, "cuLaunchKernel")));
    printf("cu_alloc_from_cuda=%s\n", lib_of(dlsym(cuda, "cuMemAlloc_v2")));
    printf("cu_plain_from_cuda=%s\n", lib_of(dlsym(cuda, "cuDeviceGetName")));
    printf("cu_launch_from_first=%s\n", lib_of(dlsym(first, "cuLaunchKernel")));
    printf("cu_missing=%s\n", lib_of(dlsym(cuda, "cuNoSuchFunction")));
    printf("cu_missing_error=%d\n", dlerror() != NULL);
    printf("strlen=%s\n", lib_of(dlsym(RTLD_DEFAULT, "strlen")));
    return 0;
}
"""


def test_dlsym_keeps_the_callers_semantics(sim, tmp_path):
    """RTLD_NEXT from a library finds the next definition after that library, explicit handles find their
    own symbols, intercepted cu* names from the driver's handle come from the hook, everything else is the
    C library's answer unchanged."""
    d = tmp_path / "dlsym"
    d.mkdir()
    (d / "first.c").write_text(DLSYM_FIRST)
    (d / "second.c").write_text(DLSYM_SECOND)
    (d / "main.c").write_text(DLSYM_MAIN)
    cc = os.environ.get("CC", "cc")
    for lib in ("first", "second"):
        subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(d / f"libe2e{lib}.so"), str(d / f"{lib}.c"), "-ldl"],
                       check=True)
    # the program links first, then second: RTLD_NEXT from first must land in second
    subprocess.run([cc, "-O2", "-o", str(d / "main"), str(d / "main.c"), f"-L{d}", "-Wl,--no-as-needed",
                    "-le2efirst", "-le2esecond",
                    "-ldl", f"-Wl,-rpath,{d}"], check=True)
    res = run([str(d / "main")], sim.env(LD_PRELOAD=str(sim.hook)))
    assert res.rc == 0, res
    got = dict(line.split("=", 1) for line in res.out.split())
    assert got.pop("strlen").startswith("libc.so"), res
    hook_name = sim.hook.name
    assert got == {
        "next_from_library": "2",
        "next_from_main": "1",
        "default": "1",
        "handle_first": "1",
        "handle_second": "2",
        "cuda_name_in_first": "11",
        "cu_launch_from_cuda": hook_name,
        "cu_alloc_from_cuda": hook_name,
        "cu_plain_from_cuda": "libcuda.so.1",
        "cu_launch_from_first": "null",     # the handle has no such symbol: the hook must not invent one
        "cu_missing": "null",
        "cu_missing_error": "1",
    }, res


# --- inert in programs that never use CUDA ------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["sh", "-c", "true"],
    [sys.executable, "-c", "pass"],
    # the preload really is in the process (else this test proves nothing)
    [sys.executable, "-c", "import sys; sys.exit(0 if 'libgemhook' in open('/proc/self/maps').read() else 3)"],
    ["grep", "-q", "libgemhook", "/proc/self/maps"],
], ids=["sh", "python", "python-maps", "grep-maps"])
def test_programs_without_cuda_are_untouched(sim, argv):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="g", GEMINI_POD_MANAGER_PORT=port,
                      GEMINI_LOG_LEVEL="debug")
        res = run(argv, env, timeout=30)
        assert res.rc == 0, res
        assert res.out == "" and res.err == "", res
        readable, _, _ = select.select([listener], [], [], 0.2)
        assert not readable, "the hook connected to the pod manager port"
    assert not sim.stats_file.exists(), sim.stats_file.read_text()
