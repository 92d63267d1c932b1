#!/usr/bin/env python3
"""Probes of driver semantics through ctypes, printing one JSON object.

Run in a child process with libcuda.so.1 on the library path (the simulator,
or a real driver where that makes sense), so the test process never loads a
driver itself:

    simprobe.py info                 version, devices, attributes, errors before cuInit
    simprobe.py procaddr QUERIES     cuGetProcAddress(_v2) answers, and dlsym of names
    simprobe.py table                every row of the simulator's table, checked
    simprobe.py capture              capture-mode scenarios across threads, graphs
    simprobe.py handles              bad handles and NULL out-pointers
    simprobe.py memory               every allocation kind: charge, release, attributes
    simprobe.py prefetch             managed memory: both cuMemPrefetchAsync ABIs, residency, bandwidth
    simprobe.py events               event times while another process's long kernels hold the device

QUERIES is a JSON list of [symbol, cudaVersion, flags, exact name or null].
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading

c_void_p, c_int, c_uint = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
c_size_t, c_u64 = ctypes.c_size_t, ctypes.c_uint64
CUdeviceptr = ctypes.c_ulonglong
byref = ctypes.byref

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2
PER_THREAD_DEFAULT_STREAM = 2

lib = ctypes.CDLL("libcuda.so.1")


def addr(name: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, name), c_void_p).value
    except AttributeError:
        return None


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"simprobe: {what} failed: {rc}")


def setup() -> tuple[c_int, c_void_p]:
    check(lib.cuInit(0), "cuInit")
    dev = c_int()
    check(lib.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ctx = c_void_p()
    check(lib.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx


# ---------------------------------------------------------------------------- info


def cmd_info(_args: list[str]) -> dict:
    out: dict = {}
    n, v = c_int(), c_int()
    out["before_init"] = {
        "cuDeviceGetCount": lib.cuDeviceGetCount(byref(n)),
        "cuMemAlloc_v2": lib.cuMemAlloc_v2(byref(CUdeviceptr()), c_size_t(1)),
        "cuCtxSynchronize": lib.cuCtxSynchronize(),
        "cuDriverGetVersion": lib.cuDriverGetVersion(byref(v)),
    }
    out["simulated"] = bool(getattr(lib, "simcuda_is_simulated", None) and lib.simcuda_is_simulated())
    out["driver_version"] = v.value
    out["cuInit_bad_flags"] = lib.cuInit(1)
    check(lib.cuInit(0), "cuInit")
    check(lib.cuDeviceGetCount(byref(n)), "cuDeviceGetCount")
    out["devices"] = n.value
    devs = []
    for i in range(n.value):
        d = c_int()
        check(lib.cuDeviceGet(byref(d), i), "cuDeviceGet")
        name = ctypes.create_string_buffer(128)
        check(lib.cuDeviceGetName(name, 128, d), "cuDeviceGetName")
        u1, u2 = ctypes.create_string_buffer(16), ctypes.create_string_buffer(16)
        check(lib.cuDeviceGetUuid(u1, d), "cuDeviceGetUuid")
        check(lib.cuDeviceGetUuid_v2(u2, d), "cuDeviceGetUuid_v2")
        total = c_size_t()
        check(lib.cuDeviceTotalMem_v2(byref(total), d), "cuDeviceTotalMem_v2")
        attrs = {}
        for a in (16, 75, 76, 115, 102, 1, 10):
            x = c_int()
            check(lib.cuDeviceGetAttribute(byref(x), a, d), "cuDeviceGetAttribute")
            attrs[a] = x.value
        devs.append({"name": name.value.decode(), "uuid": u1.raw.hex(), "uuid_v2": u2.raw.hex(),
                     "total": total.value, "attrs": attrs})
    out["device_list"] = devs
    bad = c_int()
    out["cuDeviceGet_out_of_range"] = lib.cuDeviceGet(byref(bad), n.value)
    out["cuDeviceGetAttribute_bad"] = lib.cuDeviceGetAttribute(byref(bad), 100000, 0)
    s = ctypes.c_char_p()
    out["error_names"] = {}
    for code in (0, 1, 2, 3, 201, 400, 900, 901):
        check(lib.cuGetErrorName(code, byref(s)), "cuGetErrorName")
        out["error_names"][code] = s.value.decode()
    out["cuGetErrorName_unknown"] = lib.cuGetErrorName(123456, byref(s))
    return out


# ---------------------------------------------------------------------------- cuGetProcAddress


def cmd_procaddr(args: list[str]) -> dict:
    queries = json.loads(args[0])
    gpa2 = lib.cuGetProcAddress_v2
    gpa2.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, ctypes.c_uint64, ctypes.POINTER(c_int)]
    gpa1 = lib.cuGetProcAddress
    gpa1.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, ctypes.c_uint64]
    results = []
    for sym, ver, flags, exact in queries:
        p2, st, p1 = c_void_p(), c_int(-1), c_void_p()
        rc2 = gpa2(sym.encode(), byref(p2), ver, flags, byref(st))
        rc1 = gpa1(sym.encode(), byref(p1), ver, flags)
        results.append({"symbol": sym, "version": ver, "flags": flags, "rc_v2": rc2, "status": st.value,
                        "ptr_v2": p2.value, "rc_v1": rc1, "ptr_v1": p1.value,
                        "exact": exact, "dlsym": addr(exact) if exact else None})
    return {"results": results}


def cmd_table(_args: list[str]) -> dict:
    """Every row of the simulator's own table: the pointer equals dlsym of its name."""
    entry = lib.simcuda_procaddr_entry
    cp = ctypes.c_char_p
    entry.argtypes = [c_int, ctypes.POINTER(cp), ctypes.POINTER(c_int), ctypes.POINTER(cp),
                      ctypes.POINTER(c_int), ctypes.POINTER(cp)]
    gpa2 = lib.cuGetProcAddress_v2
    gpa2.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, ctypes.c_uint64, ctypes.POINTER(c_int)]
    rows, bad = 0, []
    i = 0
    while True:
        base, sym, ptsym = cp(), cp(), cp()
        ver, ptver = c_int(), c_int()
        if not entry(i, byref(base), byref(ver), byref(sym), byref(ptver), byref(ptsym)):
            break
        i += 1
        rows += 1
        checks = [(sym.value.decode(), ver.value, 0)]
        if ptsym.value:
            checks.append((ptsym.value.decode(), max(ver.value, ptver.value), PER_THREAD_DEFAULT_STREAM))
        for name, v, flags in checks:
            # Asked at its own version, a row answers with its own function.
            p, st = c_void_p(), c_int(-1)
            rc = gpa2(base.value, byref(p), v, flags, byref(st))
            if rc != 0 or st.value != 0 or p.value is None:
                bad.append([base.value.decode(), v, flags, "lookup", rc, st.value])
                continue
            if p.value != addr(name):
                bad.append([base.value.decode(), v, flags, name, "pointer differs from dlsym"])
    return {"rows": rows, "bad": bad}


# ---------------------------------------------------------------------------- capture


class Spin:
    """gem_spin launches and their result slots."""

    def __init__(self, nslots: int = 16):
        self.mod, self.fn = c_void_p(), c_void_p()
        from pyclient import GEM_SPIN_PTX  # same directory
        check(lib.cuModuleLoadData(byref(self.mod), GEM_SPIN_PTX.encode() + b"\0"), "cuModuleLoadData")
        check(lib.cuModuleGetFunction(byref(self.fn), self.mod, b"gem_spin"), "cuModuleGetFunction")
        self.buf = CUdeviceptr()
        self.n = nslots
        check(lib.cuMemAlloc_v2(byref(self.buf), c_size_t(nslots * 24)), "cuMemAlloc_v2")
        check(lib.cuMemsetD8_v2(self.buf, 0, c_size_t(nslots * 24)), "cuMemsetD8_v2")

    def launch(self, stream, slot: int, dur_ns: int) -> int:
        out = CUdeviceptr(self.buf.value + 24 * slot)
        dur = c_u64(dur_ns)
        params = (c_void_p * 2)(ctypes.cast(byref(out), c_void_p), ctypes.cast(byref(dur), c_void_p))
        return lib.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, stream, params, None)

    def read(self) -> list[list[int]]:
        host = (c_u64 * (3 * self.n))()
        check(lib.cuMemcpyDtoH_v2(host, self.buf, c_size_t(24 * self.n)), "cuMemcpyDtoH_v2")
        return [[host[3 * i], host[3 * i + 1], host[3 * i + 2]] for i in range(self.n)]


def in_thread(ctx: c_void_p, fn):
    """Run fn in a new thread with ctx current; return its result."""
    box: dict = {}

    def body():
        check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        box["r"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return box["r"]


def exchange_mode(mode: int) -> int:
    m = c_int(mode)
    check(lib.cuThreadExchangeStreamCaptureMode(byref(m)), "cuThreadExchangeStreamCaptureMode")
    return m.value


def capture_with(ctx, spin: Spin, capture_mode: int, interloper, slot0: int = 0, flags: int = 1) -> dict:
    """Begin a capture on a new stream (flags 1: non-blocking), record two launches,
    let `interloper` run, end the capture."""
    s = c_void_p()
    check(lib.cuStreamCreate(byref(s), flags), "cuStreamCreate")
    r: dict = {"begin": lib.cuStreamBeginCapture_v2(s, capture_mode)}
    st = c_int(-1)
    lib.cuStreamIsCapturing(s, byref(st))
    r["status_during"] = st.value
    r["launch1"] = spin.launch(s, slot0, 1000)
    r["interloper"] = interloper(s)
    r["launch2"] = spin.launch(s, slot0 + 1, 1000)
    g = c_void_p()
    r["end"] = lib.cuStreamEndCapture(s, byref(g))
    r["graph_null"] = g.value is None
    lib.cuStreamIsCapturing(s, byref(st))
    r["status_after"] = st.value
    if r["end"] == 0:
        ex = c_void_p()
        r["instantiate"] = lib.cuGraphInstantiateWithFlags(byref(ex), g, ctypes.c_ulonglong(0))
        r["graph_launch"] = lib.cuGraphLaunch(ex, s)
        r["sync"] = lib.cuStreamSynchronize(s)
        lib.cuGraphExecDestroy(ex)
        lib.cuGraphDestroy(g)
    check(lib.cuStreamDestroy_v2(s), "cuStreamDestroy_v2")
    return r


def alloc_free() -> list[int]:
    p = CUdeviceptr()
    rc = lib.cuMemAlloc_v2(byref(p), c_size_t(4096))
    rf = lib.cuMemFree_v2(p) if rc == 0 else None
    return [rc, rf]


def cmd_capture(_args: list[str]) -> dict:
    _dev, ctx = setup()
    spin = Spin(64)
    out: dict = {}

    # Another GLOBAL-mode thread allocates during a GLOBAL capture: refused, capture invalidated.
    out["global_other_global"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, alloc_free))

    # The same from a thread that switched itself to RELAXED: allowed, capture intact.
    def relaxed_alloc():
        old = exchange_mode(RELAXED)
        r = alloc_free()
        exchange_mode(old)
        return r + [old]
    out["global_other_relaxed"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, relaxed_alloc), 2)

    # A THREAD_LOCAL capture does not restrict other threads.
    out["thread_local_other_global"] = capture_with(ctx, spin, THREAD_LOCAL, lambda s: in_thread(ctx, alloc_free), 4)

    # A THREAD_LOCAL-mode thread ignores another thread's GLOBAL capture.
    def thread_local_alloc():
        old = exchange_mode(THREAD_LOCAL)
        r = alloc_free()
        exchange_mode(old)
        return r
    out["global_other_thread_local"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, thread_local_alloc), 6)

    # The capturing thread itself may not allocate (GLOBAL capture).
    out["global_same_thread"] = capture_with(ctx, spin, GLOBAL, lambda s: alloc_free(), 8)

    # A RELAXED capture restricts nobody.
    out["relaxed_capture_same_thread"] = capture_with(ctx, spin, RELAXED, lambda s: alloc_free(), 10)

    # cuCtxSynchronize while a stream of the context captures fails even from a RELAXED thread.
    def relaxed_ctx_sync():
        old = exchange_mode(RELAXED)
        r = lib.cuCtxSynchronize()
        exchange_mode(old)
        return r
    out["ctx_sync_relaxed"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, relaxed_ctx_sync), 12)

    # Synchronising / querying the capturing stream itself.
    out["sync_capturing_stream"] = capture_with(ctx, spin, GLOBAL, lambda s: lib.cuStreamSynchronize(s), 14)
    out["query_capturing_stream"] = capture_with(ctx, spin, RELAXED, lambda s: lib.cuStreamQuery(s), 16)

    # Legacy stream: capture refused.
    out["begin_on_legacy"] = lib.cuStreamBeginCapture_v2(None, GLOBAL)

    def sync_copy():
        host = (c_u64 * 3)()
        return lib.cuMemcpyDtoH_v2(host, spin.buf, c_size_t(24))

    def relaxed(fn):
        def body():
            old = exchange_mode(RELAXED)
            r = fn()
            exchange_mode(old)
            return r
        return body

    def record_and_query():
        e = c_void_p()
        check(lib.cuEventCreate(byref(e), 0), "cuEventCreate")
        r = [lib.cuEventRecord(e, None), lib.cuEventQuery(e)]
        lib.cuEventDestroy_v2(e)
        return r

    # With only a non-blocking stream capturing: synchronous copies and legacy launches are fine,
    # sync of the legacy stream and cuEventQuery are unsafe calls.
    out["nonblocking_other_global_memcpy"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, sync_copy), 18)
    out["nonblocking_same_launch_legacy"] = capture_with(ctx, spin, GLOBAL, lambda s: spin.launch(None, 40, 1000), 20)
    out["nonblocking_other_global_sync_legacy"] = capture_with(
        ctx, spin, GLOBAL, lambda s: in_thread(ctx, lambda: lib.cuStreamSynchronize(None)), 22)
    out["nonblocking_other_relaxed_sync_legacy"] = capture_with(
        ctx, spin, GLOBAL, lambda s: in_thread(ctx, relaxed(lambda: lib.cuStreamSynchronize(None))), 24)
    out["other_global_event_query"] = capture_with(ctx, spin, GLOBAL, lambda s: in_thread(ctx, record_and_query), 26)
    out["other_relaxed_event_query"] = capture_with(
        ctx, spin, GLOBAL, lambda s: in_thread(ctx, relaxed(record_and_query)), 28)
    # A blocking stream capturing: any use of the legacy stream is an implicit dependency, in every mode.
    out["blocking_other_relaxed_memcpy"] = capture_with(
        ctx, spin, GLOBAL, lambda s: in_thread(ctx, relaxed(sync_copy)), 18, flags=0)
    out["blocking_same_launch_legacy"] = capture_with(ctx, spin, GLOBAL, lambda s: spin.launch(None, 40, 1000), 20,
                                                      flags=0)
    out["blocking_thread_local_other_sync_legacy"] = capture_with(
        ctx, spin, THREAD_LOCAL, lambda s: in_thread(ctx, lambda: lib.cuStreamSynchronize(None)), 22, flags=0)

    # The thread's mode: default GLOBAL, exchange returns the previous one; any value is taken.
    out["mode_default"] = in_thread(ctx, lambda: exchange_mode(GLOBAL))
    out["mode_odd"] = in_thread(ctx, lambda: [lib.cuThreadExchangeStreamCaptureMode(byref(c_int(7))),
                                              exchange_mode(GLOBAL)])

    # Graph replay: three kernels captured once, the graph launched twice.
    s = c_void_p()
    check(lib.cuStreamCreate(byref(s), 0), "cuStreamCreate")
    check(spin.launch(s, 50, 2_000_000), "pre-launch")  # runs now (not captured)
    check(lib.cuStreamSynchronize(s), "sync")
    check(lib.cuStreamBeginCapture(s), "cuStreamBeginCapture")  # v1: GLOBAL
    for k in range(3):
        check(spin.launch(s, 51 + k, 1_000_000 * (k + 1)), "captured launch")
    cid, info_st, gout = c_u64(), c_int(-1), c_void_p()
    deps, ndeps = c_void_p(), c_size_t(99)
    out["capture_info_v2"] = lib.cuStreamGetCaptureInfo_v2(s, byref(info_st), byref(cid), byref(gout), byref(deps),
                                                           byref(ndeps))
    out["capture_info_status"] = info_st.value
    out["capture_info_id_nonzero"] = cid.value != 0
    g = c_void_p()
    check(lib.cuStreamEndCapture(s, byref(g)), "cuStreamEndCapture")
    before = spin.read()
    out["captured_ran_before_launch"] = any(before[51 + k][2] for k in range(3))
    ex = c_void_p()
    check(lib.cuGraphInstantiate(byref(ex), g, None, None, c_size_t(0)), "cuGraphInstantiate")
    check(lib.cuGraphLaunch(ex, s), "cuGraphLaunch")
    check(lib.cuStreamSynchronize(s), "sync")
    first = spin.read()
    check(lib.cuGraphLaunch(ex, s), "cuGraphLaunch")
    check(lib.cuStreamSynchronize(s), "sync")
    second = spin.read()
    out["graph_results"] = [first[51 + k] for k in range(3)]
    out["graph_second_later"] = all(second[51 + k][1] > first[51 + k][2] for k in range(3))
    out["pre_launch"] = first[50]
    check(lib.cuGraphExecDestroy(ex), "cuGraphExecDestroy")
    check(lib.cuGraphDestroy(g), "cuGraphDestroy")
    check(lib.cuStreamDestroy_v2(s), "cuStreamDestroy_v2")
    return out


# ---------------------------------------------------------------------------- handles


def cmd_handles(_args: list[str]) -> dict:
    _dev, ctx = setup()
    bogus = c_void_p(0xdead0000)
    out = {
        "stream_sync_bogus": lib.cuStreamSynchronize(bogus),
        "event_query_bogus": lib.cuEventQuery(bogus),
        "ctx_destroy_bogus": lib.cuCtxDestroy_v2(bogus),
        "launch_bogus_fn": lib.cuLaunchKernel(bogus, 1, 1, 1, 1, 1, 1, 0, None, None, None),
        "free_bogus": lib.cuMemFree_v2(CUdeviceptr(0xdead0000)),
        "alloc_null_out": lib.cuMemAlloc_v2(None, c_size_t(16)),
        "meminfo_null_out": lib.cuMemGetInfo_v2(None, None),
        "memcpy_bad_dst": lib.cuMemcpyHtoD_v2(CUdeviceptr(0xdead0000), ctypes.create_string_buffer(8),
                                              c_size_t(8)),
        "graph_launch_bogus": lib.cuGraphLaunch(bogus, None),
        "module_get_bogus": lib.cuModuleGetFunction(byref(c_void_p()), bogus, b"x"),
    }
    # Stale handles: destroyed stream and event.
    s, e = c_void_p(), c_void_p()
    check(lib.cuStreamCreate(byref(s), 0), "cuStreamCreate")
    check(lib.cuStreamDestroy_v2(s), "cuStreamDestroy_v2")
    out["stream_sync_destroyed"] = lib.cuStreamSynchronize(s)
    check(lib.cuEventCreate(byref(e), 0), "cuEventCreate")
    check(lib.cuEventDestroy_v2(e), "cuEventDestroy_v2")
    out["event_sync_destroyed"] = lib.cuEventSynchronize(e)
    # Events time a kernel.
    spin = Spin(1)
    a, b = c_void_p(), c_void_p()
    check(lib.cuEventCreate(byref(a), 0), "cuEventCreate")
    check(lib.cuEventCreate(byref(b), 0), "cuEventCreate")
    check(lib.cuEventRecord(a, None), "cuEventRecord")
    check(spin.launch(None, 0, 20_000_000), "launch")
    check(lib.cuEventRecord(b, None), "cuEventRecord")
    out["event_query_pending"] = lib.cuEventQuery(b)
    check(lib.cuEventSynchronize(b), "cuEventSynchronize")
    ms = ctypes.c_float()
    check(lib.cuEventElapsedTime(byref(ms), a, b), "cuEventElapsedTime")
    out["elapsed_ms"] = ms.value
    # No current context.
    def no_ctx():
        p = CUdeviceptr()
        return [lib.cuMemAlloc_v2(byref(p), c_size_t(16)), lib.cuCtxSynchronize()]
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", no_ctx()))
    t.start()
    t.join()
    out["no_context"] = box["r"]
    # Context stack.
    c2, popped, cur = c_void_p(), c_void_p(), c_void_p()
    check(lib.cuCtxCreate_v2(byref(c2), 0, 0), "cuCtxCreate_v2")
    check(lib.cuCtxGetCurrent(byref(cur)), "cuCtxGetCurrent")
    out["created_is_current"] = cur.value == c2.value
    check(lib.cuCtxPopCurrent_v2(byref(popped)), "cuCtxPopCurrent_v2")
    check(lib.cuCtxGetCurrent(byref(cur)), "cuCtxGetCurrent")
    out["pop_returns_created"] = popped.value == c2.value
    out["after_pop_is_primary"] = cur.value == ctx.value
    check(lib.cuCtxPushCurrent_v2(c2), "cuCtxPushCurrent_v2")
    check(lib.cuCtxDestroy_v2(c2), "cuCtxDestroy_v2")
    check(lib.cuCtxGetCurrent(byref(cur)), "cuCtxGetCurrent")
    out["after_destroy_is_primary"] = cur.value == ctx.value
    flags, active = c_uint(), c_int()
    check(lib.cuDevicePrimaryCtxGetState(0, byref(flags), byref(active)), "cuDevicePrimaryCtxGetState")
    out["primary_active"] = active.value
    # A fork child of an initialised process cannot use CUDA (and must not hang).
    check(spin.launch(None, 0, 50_000_000), "launch")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        res = [lib.cuInit(0), lib.cuCtxSynchronize(), lib.cuStreamSynchronize(None)]
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    out["fork_child"] = json.loads(os.read(r, 1000))
    os.waitpid(pid, 0)
    out["parent_after_fork"] = lib.cuCtxSynchronize()
    return out


# ---------------------------------------------------------------------------- memory


class PoolProps(ctypes.Structure):
    _fields_ = [("allocType", c_int), ("handleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("maxSize", c_size_t), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 54)]


class AllocProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("locType", c_int), ("locId", c_int),
                ("win32", c_void_p), ("flags", ctypes.c_ubyte * 8)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("locType", c_int), ("locId", c_int), ("flags", c_int)]


class ArrayDesc(ctypes.Structure):
    _fields_ = [("Width", c_size_t), ("Height", c_size_t), ("Format", c_int), ("NumChannels", c_uint)]


class Array3DDesc(ctypes.Structure):
    _fields_ = [("Width", c_size_t), ("Height", c_size_t), ("Depth", c_size_t), ("Format", c_int),
                ("NumChannels", c_uint), ("Flags", c_uint)]


class ArrayReq(ctypes.Structure):
    _fields_ = [("size", c_size_t), ("alignment", c_size_t), ("reserved", c_uint * 4)]


MiB = 1 << 20


def cmd_memory(_args: list[str]) -> dict:
    dev, _ctx = setup()

    def free() -> int:
        f, t = c_size_t(), c_size_t()
        check(lib.cuMemGetInfo_v2(byref(f), byref(t)), "cuMemGetInfo_v2")
        return f.value

    def attr(a: int, ptr: int, ctype=c_u64):
        v = ctype()
        rc = lib.cuPointerGetAttribute(byref(v), a, CUdeviceptr(ptr))
        return v.value if rc == 0 else f"rc={rc}"

    out: dict = {"base": free()}
    t = c_size_t()
    check(lib.cuDeviceTotalMem_v2(byref(t), dev), "cuDeviceTotalMem_v2")
    out["total"] = t.value
    p = CUdeviceptr()

    # plain, managed, pitch, host
    b = free()
    check(lib.cuMemAlloc_v2(byref(p), c_size_t(64 * MiB)), "cuMemAlloc_v2")
    out["device"] = {"charged": b - free(), "type": attr(2, p.value, c_uint),
                     "range_start_ok": attr(11, p.value + 4096) == p.value, "range_size": attr(12, p.value + 1),
                     "ordinal": attr(9, p.value, c_int), "is_managed": attr(8, p.value, ctypes.c_ubyte)}
    check(lib.cuMemsetD32_v2(p, 0x01020304, c_size_t(16)), "cuMemsetD32_v2")
    host = (ctypes.c_uint32 * 4)()
    check(lib.cuMemcpyDtoH_v2(host, p, c_size_t(16)), "cuMemcpyDtoH_v2")
    out["device"]["memset32"] = list(host)
    out["device"]["memsetd32_unaligned"] = lib.cuMemsetD32_v2(CUdeviceptr(p.value + 1), 0, c_size_t(1))
    check(lib.cuMemFree_v2(p), "cuMemFree_v2")
    out["device"]["released"] = free() == b
    out["device"]["double_free"] = lib.cuMemFree_v2(p)
    check(lib.cuMemAllocManaged(byref(p), c_size_t(32 * MiB), 1), "cuMemAllocManaged")
    out["managed"] = {"charged": b - free(), "is_managed": attr(8, p.value, ctypes.c_ubyte)}
    check(lib.cuMemFree_v2(p), "cuMemFree_v2")
    out["managed"]["released"] = free() == b
    pitch = c_size_t()
    check(lib.cuMemAllocPitch_v2(byref(p), byref(pitch), c_size_t(1000), c_size_t(4096), 4), "cuMemAllocPitch_v2")
    out["pitch"] = {"pitch": pitch.value, "charged": b - free(),
                    "bad_elem": lib.cuMemAllocPitch_v2(byref(p), byref(pitch), c_size_t(1000), c_size_t(4), 3)}
    check(lib.cuMemFree_v2(p), "cuMemFree_v2")
    out["pitch"]["released"] = free() == b
    hp = c_void_p()
    check(lib.cuMemAllocHost_v2(byref(hp), c_size_t(8 * MiB)), "cuMemAllocHost_v2")
    out["host"] = {"charged": b - free(), "type": attr(2, hp.value, c_uint)}
    check(lib.cuMemFreeHost(hp), "cuMemFreeHost")
    out["oversize"] = lib.cuMemAlloc_v2(byref(p), c_size_t(out["total"] + 1))
    out["zero"] = lib.cuMemAlloc_v2(byref(p), c_size_t(0))
    out["free_null"] = lib.cuMemFree_v2(CUdeviceptr(0))

    # stream-ordered: default pool (release threshold 0), then a threshold, trim, a created pool
    s = c_void_p()
    check(lib.cuStreamCreate(byref(s), 1), "cuStreamCreate")
    pool = c_void_p()
    check(lib.cuDeviceGetDefaultMemPool(byref(pool), dev), "cuDeviceGetDefaultMemPool")

    def pool_attr(pl, a):
        v = c_u64()
        check(lib.cuMemPoolGetAttribute(pl, a, byref(v)), "cuMemPoolGetAttribute")
        return v.value

    check(lib.cuMemAllocAsync(byref(p), c_size_t(16 * MiB), s), "cuMemAllocAsync")
    a = {"charged": b - free(), "used": pool_attr(pool, 7), "reserved": pool_attr(pool, 5),
         "pool_attr": attr(17, p.value, c_void_p) == pool.value}
    check(lib.cuMemFreeAsync(p, s), "cuMemFreeAsync")
    check(lib.cuStreamSynchronize(s), "cuStreamSynchronize")
    a.update(used_after=pool_attr(pool, 7), reserved_after=pool_attr(pool, 5), released=free() == b)
    thr = c_u64(1 << 30)
    check(lib.cuMemPoolSetAttribute(pool, 4, byref(thr)), "cuMemPoolSetAttribute")
    check(lib.cuMemAllocAsync_ptsz(byref(p), c_size_t(16 * MiB), s), "cuMemAllocAsync_ptsz")
    check(lib.cuMemFreeAsync_ptsz(p, s), "cuMemFreeAsync_ptsz")
    check(lib.cuStreamSynchronize(s), "cuStreamSynchronize")
    a.update(kept_reserved=pool_attr(pool, 5), kept_charged=b - free(), used_high=pool_attr(pool, 8))
    check(lib.cuMemPoolTrimTo(pool, c_size_t(0)), "cuMemPoolTrimTo")
    a.update(trimmed_reserved=pool_attr(pool, 5), trimmed_released=free() == b)
    thr = c_u64(0)
    check(lib.cuMemPoolSetAttribute(pool, 4, byref(thr)), "cuMemPoolSetAttribute")
    out["async"] = a
    props = PoolProps(allocType=1, locType=1, locId=dev.value)
    mine = c_void_p()
    check(lib.cuMemPoolCreate(byref(mine), byref(props)), "cuMemPoolCreate")
    check(lib.cuMemAllocFromPoolAsync(byref(p), c_size_t(8 * MiB), mine, s), "cuMemAllocFromPoolAsync")
    out["pool"] = {"charged": b - free(), "used": pool_attr(mine, 7)}
    check(lib.cuMemFreeAsync(p, s), "cuMemFreeAsync")
    check(lib.cuStreamSynchronize(s), "cuStreamSynchronize")
    check(lib.cuMemPoolDestroy(mine), "cuMemPoolDestroy")
    out["pool"]["released"] = free() == b
    out["pool"]["destroy_default"] = lib.cuMemPoolDestroy(pool)
    check(lib.cuStreamDestroy_v2(s), "cuStreamDestroy_v2")

    # VMM
    prop = AllocProp(type=1, locType=1, locId=dev.value)
    gran = c_size_t()
    check(lib.cuMemGetAllocationGranularity(byref(gran), byref(prop), 0), "cuMemGetAllocationGranularity")
    h = ctypes.c_ulonglong()
    v = {"granularity": gran.value,
         "create_unaligned": lib.cuMemCreate(byref(h), c_size_t(gran.value + 1), byref(prop), ctypes.c_ulonglong(0))}
    size = 16 * gran.value
    check(lib.cuMemCreate(byref(h), c_size_t(size), byref(prop), ctypes.c_ulonglong(0)), "cuMemCreate")
    v["charged"] = b - free()
    va = CUdeviceptr()
    check(lib.cuMemAddressReserve(byref(va), c_size_t(size), c_size_t(0), CUdeviceptr(0), ctypes.c_ulonglong(0)),
          "cuMemAddressReserve")
    v["reserve_charges"] = b - free() - v["charged"]
    check(lib.cuMemMap(va, c_size_t(size), c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
    v["memset_before_access"] = lib.cuMemsetD8_v2(va, 7, c_size_t(16))
    acc = AccessDesc(locType=1, locId=dev.value, flags=3)
    check(lib.cuMemSetAccess(va, c_size_t(size), byref(acc), c_size_t(1)), "cuMemSetAccess")
    check(lib.cuMemsetD8_v2(va, 7, c_size_t(16)), "cuMemsetD8_v2")
    hb = (ctypes.c_ubyte * 16)()
    check(lib.cuMemcpyDtoH_v2(hb, va, c_size_t(16)), "cuMemcpyDtoH_v2")
    v["readback"] = list(hb)[:4]
    v["attr_type"] = attr(2, va.value + 100, c_uint)
    check(lib.cuMemRelease(h), "cuMemRelease")
    v["charged_while_mapped"] = b - free()
    check(lib.cuMemUnmap(va, c_size_t(size)), "cuMemUnmap")
    check(lib.cuMemAddressFree(va, c_size_t(size)), "cuMemAddressFree")
    v["released"] = free() == b
    out["vmm"] = v

    # arrays
    arr = c_void_p()
    d2 = ArrayDesc(Width=1024, Height=1024, Format=0x20, NumChannels=4)  # float4: 16 MiB
    check(lib.cuArrayCreate_v2(byref(arr), byref(d2)), "cuArrayCreate_v2")
    req = ArrayReq()
    ar = {"charged": b - free(), "req_plain": lib.cuArrayGetMemoryRequirements(byref(req), arr, dev)}
    check(lib.cuArrayDestroy(arr), "cuArrayDestroy")
    ar["released"] = free() == b
    d3 = Array3DDesc(Width=1024, Height=1024, Depth=0, Format=0x20, NumChannels=4, Flags=0x80)  # deferred mapping
    check(lib.cuArray3DCreate_v2(byref(arr), byref(d3)), "cuArray3DCreate_v2")
    check(lib.cuArrayGetMemoryRequirements(byref(req), arr, dev), "cuArrayGetMemoryRequirements")
    ar.update(deferred_charged=b - free(), req_size=req.size, req_align=req.alignment)
    check(lib.cuArrayDestroy(arr), "cuArrayDestroy")
    d3 = Array3DDesc(Width=256, Height=256, Depth=64, Format=0x01, NumChannels=1)  # 4 MiB
    check(lib.cuArray3DCreate_v2(byref(arr), byref(d3)), "cuArray3DCreate_v2")
    ar["charged_3d"] = b - free()
    check(lib.cuArrayDestroy(arr), "cuArrayDestroy")
    mm = c_void_p()
    dm = Array3DDesc(Width=1024, Height=1024, Depth=0, Format=0x20, NumChannels=1)  # 4 MiB + 1 MiB + 256 KiB
    check(lib.cuMipmappedArrayCreate(byref(mm), byref(dm), 3), "cuMipmappedArrayCreate")
    ar["mipmap_charged"] = b - free()
    ar["mipmap_req_plain"] = lib.cuMipmappedArrayGetMemoryRequirements(byref(req), mm, dev)
    check(lib.cuMipmappedArrayDestroy(mm), "cuMipmappedArrayDestroy")
    dm.Flags = 0x80
    check(lib.cuMipmappedArrayCreate(byref(mm), byref(dm), 3), "cuMipmappedArrayCreate")
    check(lib.cuMipmappedArrayGetMemoryRequirements(byref(req), mm, dev), "cuMipmappedArrayGetMemoryRequirements")
    ar.update(mipmap_deferred_charged=b - free(), mipmap_req=req.size)
    check(lib.cuMipmappedArrayDestroy(mm), "cuMipmappedArrayDestroy")
    ar["bad_format"] = lib.cuArrayCreate_v2(byref(arr), byref(ArrayDesc(Width=4, Height=4, Format=0x77,
                                                                              NumChannels=1)))
    ar["released_all"] = free() == b
    out["array"] = ar
    return out


class MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


def cmd_prefetch(_args: list[str]) -> dict:
    """Managed memory moved with both ABIs of cuMemPrefetchAsync: residency, charges, time, errors."""
    import time
    dev, _ctx = setup()
    out: dict = {}
    v = c_int()
    check(lib.cuDeviceGetAttribute(byref(v), 89, dev), "cuDeviceGetAttribute")
    out["concurrent_managed"] = v.value
    lib.simcuda_resident_bytes.restype = c_u64
    lib.simcuda_resident_bytes.argtypes = [CUdeviceptr]
    free_b, total = c_size_t(), c_size_t()

    def free() -> int:
        check(lib.cuMemGetInfo_v2(byref(free_b), byref(total)), "cuMemGetInfo_v2")
        return free_b.value

    def sync() -> None:
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")

    n = 64 << 20
    p = CUdeviceptr()
    check(lib.cuMemAllocManaged(byref(p), c_size_t(n), 1), "cuMemAllocManaged")
    base = free()
    out["fresh_resident"] = lib.simcuda_resident_bytes(p)
    old = lib.cuMemPrefetchAsync
    old.argtypes = [CUdeviceptr, c_size_t, c_int, c_void_p]
    v2 = lib.cuMemPrefetchAsync_v2
    v2.argtypes = [CUdeviceptr, c_size_t, MemLocation, c_uint, c_void_p]
    t0 = time.monotonic()
    out["old_to_device"] = old(p, n, dev.value, None)
    sync()
    out["old_to_device_s"] = time.monotonic() - t0
    out["resident_after_old"] = lib.simcuda_resident_bytes(p)
    out["charged_after_old"] = base - free()
    t0 = time.monotonic()
    out["v2_to_host"] = v2(p, n, MemLocation(2, 0), 0, None)
    sync()
    out["v2_to_host_s"] = time.monotonic() - t0
    out["resident_after_v2_host"] = lib.simcuda_resident_bytes(p)
    out["charged_after_v2_host"] = base - free()
    out["v2_half_to_device"] = v2(p, n // 2, MemLocation(1, dev.value), 0, None)
    sync()
    out["resident_half"] = lib.simcuda_resident_bytes(p)
    out["old_to_cpu"] = old(p, n, -1, None)
    sync()
    out["resident_after_old_cpu"] = lib.simcuda_resident_bytes(p)
    out["v2_flags"] = v2(p, n, MemLocation(1, dev.value), 1, None)
    out["v2_bad_type"] = v2(p, n, MemLocation(0, 0), 0, None)
    d = CUdeviceptr()
    check(lib.cuMemAlloc_v2(byref(d), c_size_t(n)), "cuMemAlloc_v2")
    out["device_memory"] = old(d, n, dev.value, None)
    check(lib.cuMemFree_v2(d), "cuMemFree_v2")
    check(v2(p, n, MemLocation(1, dev.value), 0, None), "cuMemPrefetchAsync_v2")
    sync()
    check(lib.cuMemFree_v2(p), "cuMemFree_v2")
    out["released"] = free() == base
    return out


# ---------------------------------------------------------------------------- events


def cmd_events(_args: list[str]) -> dict:
    """Another process keeps the device busy with long kernels (started by the test). An event pair around a
    5 ms kernel of ours, and an event recorded alone while the other process's kernel runs: their spans in
    ms, and the kernel's own on-chip span."""
    _dev, _ctx = setup()
    spin = Spin(2)
    e0, e1, e2 = c_void_p(), c_void_p(), c_void_p()
    for e in (e0, e1, e2):
        check(lib.cuEventCreate(byref(e), 0), "cuEventCreate")
    check(lib.cuEventRecord(e0, None), "cuEventRecord")
    check(spin.launch(None, 0, 5_000_000), "cuLaunchKernel")
    check(lib.cuEventRecord(e1, None), "cuEventRecord")
    check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
    import time
    time.sleep(0.002)              # the other process's next kernel runs now
    check(lib.cuEventRecord(e2, None), "cuEventRecord")
    check(lib.cuEventSynchronize(e2), "cuEventSynchronize")
    ms01, ms12 = ctypes.c_float(), ctypes.c_float()
    check(lib.cuEventElapsedTime(byref(ms01), e0, e1), "cuEventElapsedTime")
    check(lib.cuEventElapsedTime(byref(ms12), e1, e2), "cuEventElapsedTime")
    onchip, start, end = spin.read()[0]
    return {"around_kernel_ms": ms01.value, "alone_after_ms": ms12.value, "kernel_ms": (end - start) / 1e6}


def main() -> int:
    cmds = {"info": cmd_info, "procaddr": cmd_procaddr, "table": cmd_table, "capture": cmd_capture,
            "handles": cmd_handles, "memory": cmd_memory, "prefetch": cmd_prefetch, "events": cmd_events}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(cmds[sys.argv[1]](sys.argv[2:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
