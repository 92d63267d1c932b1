#!/usr/bin/env python3
"""A process that holds device memory as it is told, through ctypes against libcuda.so.1 (the hook preloaded or
not), for the memory-accounting tests of VMM and context teardown (tests/test_e2e_memory_holes.py).

Prints "ready", then answers each stdin line with one line of integers (the CUresults, then any values):

    alloc N              cuMemAlloc_v2 in the current context (the pointer is kept)       -> rc
    array N              cuArrayCreate_v2 of N bytes (8-bit, N/4096 x 4096)                -> rc
    vmm N                cuMemCreate N bytes, reserve, map, set access, then cuMemRelease the handle: the memory
                         stays mapped (PyTorch's and NCCL's pattern); mapping i is the i-th vmm   -> rc of each
    vmmkeep N            the same without the release (the handle is kept as mapping i's)  -> rc of each
    retain I             cuMemRetainAllocationHandle on mapping I (the handle is kept)     -> rc
    release I            cuMemRelease of mapping I's kept handle                           -> rc
    unmap I              cuMemUnmap of mapping I                                           -> rc
    ctx_create           cuCtxCreate_v2 on device 0 (becomes current)                      -> rc
    ctx_destroy          cuCtxDestroy_v2 of the last created context (the primary one is current again) -> rc
    reset                cuDevicePrimaryCtxReset_v2 (what cudaDeviceReset calls)           -> rc
    reset_procaddr       cuDevicePrimaryCtxReset as cuGetProcAddress_v2 hands it out at 12000 -> rc
    release_primary      cuDevicePrimaryCtxRelease (v1): the process's only reference      -> rc
    retain_primary       cuDevicePrimaryCtxRetain + cuCtxSetCurrent                        -> rc
    meminfo              cuMemGetInfo_v2                                                   -> rc free total
    quit
"""
import ctypes
import sys

c_void_p, c_size_t, c_int, c_uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
c_u64 = ctypes.c_uint64
CUdeviceptr = ctypes.c_ulonglong
byref = ctypes.byref
cu = ctypes.CDLL("libcuda.so.1")


class Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Location),
                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", c_int)]


class ArrayDesc(ctypes.Structure):
    _fields_ = [("Width", c_size_t), ("Height", c_size_t), ("Format", c_int), ("NumChannels", c_uint)]


PINNED, LOC_DEVICE, RW, U8 = 1, 1, 3, 0x01


def check(rc: int, what: str) -> None:
    if rc != 0:
        print(f"memholder: {what} failed: {rc}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    check(cu.cuInit(0), "cuInit")
    dev, primary = c_int(), c_void_p()
    check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(byref(primary), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    kept: list = []        # pointers and arrays: never freed by the program itself
    maps: list = []        # [va, size, handle or None]
    created: list = []     # contexts from ctx_create
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        op, args = cmd[0], [int(a) for a in cmd[1:]]
        out: list[int] = []
        if op == "alloc":
            p = CUdeviceptr()
            out.append(cu.cuMemAlloc_v2(byref(p), c_size_t(args[0])))
            kept.append(p)
        elif op == "array":
            arr, desc = c_void_p(), ArrayDesc(4096, args[0] // 4096, U8, 1)
            out.append(cu.cuArrayCreate_v2(byref(arr), byref(desc)))
            kept.append(arr)
        elif op in ("vmm", "vmmkeep"):
            size = args[0]
            prop = AllocProp(type=PINNED, location=Location(LOC_DEVICE, 0))
            handle, va = c_u64(), CUdeviceptr()
            out.append(cu.cuMemCreate(byref(handle), c_size_t(size), byref(prop), ctypes.c_ulonglong(0)))
            out.append(cu.cuMemAddressReserve(byref(va), c_size_t(size), c_size_t(0), CUdeviceptr(0),
                                              ctypes.c_ulonglong(0)))
            out.append(cu.cuMemMap(va, c_size_t(size), c_size_t(0), handle, ctypes.c_ulonglong(0)))
            access = AccessDesc(Location(LOC_DEVICE, 0), RW)
            out.append(cu.cuMemSetAccess(va, c_size_t(size), byref(access), c_size_t(1)))
            if op == "vmm":
                out.append(cu.cuMemRelease(handle))
                maps.append([va.value, size, None])
            else:
                maps.append([va.value, size, handle.value])
        elif op == "retain":
            handle = c_u64()
            out.append(cu.cuMemRetainAllocationHandle(byref(handle), c_void_p(maps[args[0]][0])))
            maps[args[0]][2] = handle.value
        elif op == "release":
            out.append(cu.cuMemRelease(c_u64(maps[args[0]][2])))
        elif op == "unmap":
            va, size, _ = maps[args[0]]
            out.append(cu.cuMemUnmap(CUdeviceptr(va), c_size_t(size)))
        elif op == "ctx_create":
            ctx = c_void_p()
            out.append(cu.cuCtxCreate_v2(byref(ctx), c_uint(0), dev))
            created.append(ctx)
        elif op == "ctx_destroy":
            out.append(cu.cuCtxDestroy_v2(created.pop()))
            cu.cuCtxSetCurrent(primary)
        elif op == "reset":
            out.append(cu.cuDevicePrimaryCtxReset_v2(dev))
        elif op == "reset_procaddr":
            fn, status = c_void_p(), c_int()
            rc = cu.cuGetProcAddress_v2(b"cuDevicePrimaryCtxReset", byref(fn), c_int(12000), c_u64(0),
                                        byref(status))
            out.append(rc)
            if rc == 0:
                out.append(ctypes.CFUNCTYPE(c_int, c_int)(fn.value)(dev))
        elif op == "release_primary":
            out.append(cu.cuDevicePrimaryCtxRelease(dev))
        elif op == "retain_primary":
            out.append(cu.cuDevicePrimaryCtxRetain(byref(primary), dev))
            out.append(cu.cuCtxSetCurrent(primary))
        elif op == "meminfo":
            free, total = c_size_t(), c_size_t()
            out += [cu.cuMemGetInfo_v2(byref(free), byref(total)), free.value, total.value]
        else:
            out.append(-1)
        print(" ".join(str(x) for x in out), flush=True)


if __name__ == "__main__":
    main()
