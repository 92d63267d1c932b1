"""CuPy's default pool or MemoryAsyncPool (stream-ordered, cuMemAllocFromPoolAsync) against a group limit.

usage: cupy_mem.py LIMIT_BYTES {default,async}
"""
import json
import sys

import cupy as cp

limit, mode = int(sys.argv[1]), sys.argv[2]
if mode == "async":
    cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
held, allocated, oom = [], 0, None
try:
    while allocated <= 2 * limit:
        held.append(cp.empty(256 << 20, dtype=cp.uint8))
        allocated += 256 << 20
    cp.cuda.Device().synchronize()
except cp.cuda.memory.OutOfMemoryError:
    oom = "OutOfMemoryError"
free, total = cp.cuda.runtime.memGetInfo()
print(json.dumps({"allocated": allocated, "oom": oom, "total": total, "free": free}))
