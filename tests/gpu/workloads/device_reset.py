"""cudaDeviceReset frees the process's allocations: the group must get them back (tests/gpu/test_gpu_memory.py).

    device_reset.py BYTES

Allocates BYTES with cudaMalloc, resets the device (cudaDeviceReset), allocates BYTES again, and prints one JSON
line with the group's use (total - free of cudaMemGetInfo, fitted to the group by the hook) at each step and the
result of the second allocation. The runtime is cuda-bindings' (NVIDIA's Python bindings, a static cudart that
finds the driver's entry points through cuGetProcAddress, as nvcc-built programs do); CuPy's runtime module
has no deviceReset.
"""
import json
import sys

from cuda.bindings import runtime as rt

nbytes = int(sys.argv[1])


def check(result):
    err, *rest = result
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{err}")
    return rest[0] if len(rest) == 1 else rest


def used() -> int:
    free, total = check(rt.cudaMemGetInfo())
    return total - free


check(rt.cudaSetDevice(0))
out = {"total": check(rt.cudaMemGetInfo())[1]}
p = check(rt.cudaMalloc(nbytes))
out["used_holding"] = used()
check(rt.cudaDeviceReset())
check(rt.cudaSetDevice(0))
out["used_after_reset"] = used()
try:
    q = check(rt.cudaMalloc(nbytes))
    out["second"] = "ok"
    out["used_second"] = used()
    check(rt.cudaFree(q))
except RuntimeError as exc:
    out["second"] = str(exc)
print(json.dumps(out), flush=True)
