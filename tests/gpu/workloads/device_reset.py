"""cudaDeviceReset frees the process's allocations: the group must get them back (tests/gpu/test_gpu_memory.py).

    device_reset.py BYTES

Allocates BYTES with cudaMalloc (CuPy's runtime bindings), resets the device (cudaDeviceReset), allocates BYTES
again, and prints one JSON line with the group's use (total - free of cudaMemGetInfo, fitted to the group by the
hook) at each step and the result of the second allocation.
"""
import json
import sys

import cupy

nbytes = int(sys.argv[1])
rt = cupy.cuda.runtime


def used() -> int:
    free, total = rt.memGetInfo()
    return total - free


out = {"total": rt.memGetInfo()[1]}
rt.setDevice(0)
p = rt.malloc(nbytes)
out["used_holding"] = used()
rt.deviceReset()
rt.setDevice(0)
out["used_after_reset"] = used()
try:
    q = rt.malloc(nbytes)
    out["second"] = "ok"
    out["used_second"] = used()
    rt.free(q)
except cupy.cuda.runtime.CUDARuntimeError as exc:
    out["second"] = str(exc)
print(json.dumps(out), flush=True)
