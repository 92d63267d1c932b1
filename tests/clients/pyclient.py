#!/usr/bin/env python3
"""A Python CUDA driver client: ctypes.CDLL("libcuda.so.1") and attribute lookups.

This is how numba and cuda-python reach the driver: dlsym on a handle, by the
exact ABI names (cuMemAlloc_v2 ...), never cuGetProcAddress. A small subset of
workload.c: init, context, alloc/free, meminfo, module load, gem_spin
launches, synchronisation. It runs on the simulated driver and on a real one.

    pyclient.py [--kernels N | --seconds S] [--kernel-us D] [--sync-every K] [--alloc BYTES]
                [--meminfo] [--ctx primary|create] [--devices 0,1] [--json]

With several --devices, one thread per device does all of the above at once, and the JSON has a
"devices" object with each device's numbers.

Exit 0 on success; a failed call prints its name, code and error name and
exits 1; a failed --alloc is reported (JSON "alloc") and the run goes on.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

# Identical to the PTX embedded in workload.c (a test checks they match).
GEM_SPIN_PTX = (
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gem_spin(\n"
    "    .param .u64 gem_spin_param_0,\n"
    "    .param .u64 gem_spin_param_1\n"
    ")\n"
    "{\n"
    "    .reg .pred %p<5>;\n"
    "    .reg .b32 %r<4>;\n"
    "    .reg .b64 %rd<10>;\n"
    "\n"
    "    ld.param.u64 %rd1, [gem_spin_param_0];\n"
    "    ld.param.u64 %rd2, [gem_spin_param_1];\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    mov.u64 %rd4, %rd3;\n"
    "    mov.u64 %rd5, 0;\n"
    "    setp.eq.u64 %p1, %rd2, 0;\n"
    "    @%p1 bra DONE;\n"
    "LOOP:\n"
    "    mov.u64 %rd6, %globaltimer;\n"
    "    sub.u64 %rd7, %rd6, %rd4;\n"
    "    mov.u64 %rd4, %rd6;\n"
    "    setp.lt.u64 %p2, %rd7, 20000;\n"
    "    @%p2 add.u64 %rd5, %rd5, %rd7;\n"
    "    setp.lt.u64 %p3, %rd5, %rd2;\n"
    "    @%p3 bra LOOP;\n"
    "DONE:\n"
    "    mov.u32 %r1, %tid.x;\n"
    "    mov.u32 %r2, %ctaid.x;\n"
    "    or.b32 %r3, %r1, %r2;\n"
    "    setp.ne.u32 %p4, %r3, 0;\n"
    "    @%p4 bra EXIT;\n"
    "    mov.u64 %rd8, %globaltimer;\n"
    "    cvta.to.global.u64 %rd9, %rd1;\n"
    "    st.global.u64 [%rd9], %rd5;\n"
    "    st.global.u64 [%rd9+8], %rd3;\n"
    "    st.global.u64 [%rd9+16], %rd8;\n"
    "EXIT:\n"
    "    ret;\n"
    "}\n"
)

CUdeviceptr = ctypes.c_ulonglong
SLOT = 3  # uint64 per kernel: on-chip ns, start, end


class CudaError(Exception):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {code} {name}")
        self.call, self.code, self.name = call, code, name


class Driver:
    """Attribute lookups on the libcuda.so.1 handle, every result checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def name(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(s)) != 0 or not s.value:
            return "CUDA_ERROR_?"
        return s.value.decode()

    def call(self, fn: str, *args) -> int:
        return getattr(self.lib, fn)(*args)

    def __call__(self, fn: str, *args) -> None:
        rc = self.call(fn, *args)
        if rc != 0:
            raise CudaError(fn, rc, self.name(rc))


class SpinJob:
    """What a small job script (a test's stand-in for a framework) needs: device 0's primary context current,
    the spin kernel and a result ring, and `work()`: `kernels` spin kernels of `us` each, then a context-wide
    synchronisation. Every call is checked (CudaError)."""

    def __init__(self, cu: "Driver | None" = None) -> None:
        self.cu = cu or Driver()
        byref = ctypes.byref
        self.cu("cuInit", 0)
        dev = ctypes.c_int()
        self.cu("cuDeviceGet", byref(dev), 0)
        self.ctx = ctypes.c_void_p()
        self.cu("cuDevicePrimaryCtxRetain", byref(self.ctx), dev)
        self.cu("cuCtxSetCurrent", self.ctx)
        mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.cu("cuModuleLoadData", byref(mod), GEM_SPIN_PTX.encode() + b"\0")
        self.cu("cuModuleGetFunction", byref(self.fn), mod, b"gem_spin")
        self.ring = self.alloc(SLOT * 8)

    def alloc(self, nbytes: int) -> CUdeviceptr:
        ptr = CUdeviceptr(0)
        self.cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr

    def work(self, kernels: int = 5, us: int = 1000) -> None:
        out, dur = CUdeviceptr(self.ring.value), ctypes.c_uint64(us * 1000)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(out), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(dur), ctypes.c_void_p))
        for _ in range(kernels):
            self.cu("cuLaunchKernel", self.fn, 1, 1, 1, 32, 1, 1, 0, None, params, None)
        self.cu("cuCtxSynchronize")


def parse_bytes(s: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().rstrip("bB").rstrip("iI")
    if s and s[-1].lower() in mult:
        return int(float(s[:-1]) * mult[s[-1].lower()])
    return int(s)


def run_device(cu: Driver, ordinal: int, args: argparse.Namespace) -> dict:
    """Everything the client does, on one device, in the calling thread (its own current context)."""
    out: dict = {"device": ordinal, "launches": 0, "kernels_done": 0, "onchip_ns": 0, "syncs": 0, "alloc": None,
                 "mem_free": None, "mem_total": None, "device_total": None}
    dev = ctypes.c_int()
    cu("cuDeviceGet", ctypes.byref(dev), ordinal)
    ctx = ctypes.c_void_p()
    if args.ctx == "create":
        cu("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
    else:
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        cu("cuCtxSetCurrent", ctx)

    held = CUdeviceptr(0)
    if args.alloc:
        rc = cu.call("cuMemAlloc_v2", ctypes.byref(held), ctypes.c_size_t(args.alloc))
        out["alloc"] = {"kind": "device", "bytes": args.alloc, "result": rc, "name": cu.name(rc)}
        if rc != 0:
            print(f"pyclient: --alloc {args.alloc} on device {ordinal} failed: {rc} {cu.name(rc)}", file=sys.stderr)
    if args.meminfo:
        free, total, dtotal = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        cu("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        cu("cuDeviceTotalMem_v2", ctypes.byref(dtotal), dev)
        out.update(mem_free=free.value, mem_total=total.value, device_total=dtotal.value)

    mod = ctypes.c_void_p()
    fn = ctypes.c_void_p()
    ptx = GEM_SPIN_PTX.encode() + b"\0"
    cu("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(ptx))
    cu("cuModuleGetFunction", ctypes.byref(fn), mod, b"gem_spin")

    period = args.sync_every or args.kernels or 1
    nslots = max(1, min(period, 65536))
    buf = CUdeviceptr()
    cu("cuMemAlloc_v2", ctypes.byref(buf), ctypes.c_size_t(nslots * SLOT * 8))
    host = (ctypes.c_uint64 * (nslots * SLOT))()
    pending = 0
    starts, ends = [], []

    def sync_and_read() -> None:
        nonlocal pending
        cu("cuCtxSynchronize")
        out["syncs"] += 1
        if pending:
            cu("cuMemcpyDtoH_v2", host, buf, ctypes.c_size_t(pending * SLOT * 8))
            for i in range(pending):
                onchip, start, end = host[SLOT * i], host[SLOT * i + 1], host[SLOT * i + 2]
                if end:
                    out["kernels_done"] += 1
                    out["onchip_ns"] += onchip
                    starts.append(start)
                    ends.append(end)
            pending = 0

    dur = ctypes.c_uint64(args.kernel_us * 1000)
    t0 = time.monotonic_ns()
    stop_at = t0 + int(args.seconds * 1e9) if args.seconds else None
    since = 0
    launched = 0
    while (launched < args.kernels) if stop_at is None else (time.monotonic_ns() < stop_at):
        if pending == nslots:
            sync_and_read()
            since = 0
        slot = CUdeviceptr(buf.value + pending * SLOT * 8)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(slot), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(dur), ctypes.c_void_p))
        cu("cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, None, params, None)
        pending += 1
        since += 1
        launched += 1
        out["launches"] += 1
        if args.sync_every and since >= args.sync_every:
            sync_and_read()
            since = 0
    sync_and_read()
    t1 = time.monotonic_ns()

    cu("cuMemFree_v2", buf)
    if args.alloc and out["alloc"]["result"] == 0:
        cu("cuMemFree_v2", held)
    cu("cuModuleUnload", mod)
    if args.ctx == "create":
        cu("cuCtxDestroy_v2", ctx)
    else:
        cu("cuDevicePrimaryCtxRelease_v2", dev)
    out.update(wall_ns=t1 - t0, host_start_ns=t0, host_end_ns=t1,
               start_ns=min(starts) if starts else 0, end_ns=max(ends) if ends else 0)
    return out


def run(args: argparse.Namespace) -> dict:
    cu = Driver()
    cu("cuInit", 0)
    if len(args.devices) == 1:
        return {"pid": os.getpid(), "client": "pyclient", "errors": 0, "first_error": None,
                **run_device(cu, args.devices[0], args)}
    # One thread per device, all at once (ctypes lets go of the GIL inside each driver call).
    results: dict[int, dict] = {}
    failures: list[CudaError] = []

    def worker(ordinal: int) -> None:
        try:
            results[ordinal] = run_device(cu, ordinal, args)
        except CudaError as e:
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(d,)) for d in args.devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    total = {k: sum(r[k] for r in results.values()) for k in ("launches", "kernels_done", "onchip_ns", "syncs")}
    return {"pid": os.getpid(), "client": "pyclient", "errors": 0, "first_error": None, **total,
            "devices": {str(d): results[d] for d in args.devices}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=10)
    p.add_argument("--seconds", type=float, default=0, help="launch for this long instead of --kernels")
    p.add_argument("--devices", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                   help="comma-separated device ordinals, one thread each (default 0)")
    p.add_argument("--kernel-us", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=0)
    p.add_argument("--alloc", type=parse_bytes, default=0)
    p.add_argument("--meminfo", action="store_true")
    p.add_argument("--ctx", choices=["primary", "create"], default="primary")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        out = run(args)
    except CudaError as e:
        print(f"pyclient: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"pid": os.getpid(), "client": "pyclient", "errors": 1,
                              "first_error": {"call": e.call, "code": e.code, "name": e.name}}))
        return 1
    except OSError as e:
        print(f"pyclient: cannot load libcuda.so.1: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(" ".join(f"{k}={out[k]}" for k in ("launches", "kernels_done", "onchip_ns", "wall_ns", "syncs")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
