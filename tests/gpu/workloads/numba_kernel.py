"""numba-cuda: a @cuda.jit kernel, checked against NumPy."""
import json

import numpy as np

# numba-cuda 0.30 still registers np.row_stack, which numpy 2.x removed; a node with both fails to
# compile any kernel, with or without gemini. Restore the alias so the kernel path can be tested.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402


@cuda.jit
def saxpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


n = 1 << 20
x = np.arange(n, dtype=np.float32)
y = np.ones(n, dtype=np.float32)
dx, dy = cuda.to_device(x), cuda.to_device(y)
out = cuda.device_array(n, dtype=np.float32)
for _ in range(20):
    saxpy[(n + 255) // 256, 256](np.float32(3.0), dx, dy, out)
cuda.synchronize()
print(json.dumps({"ok": bool(np.allclose(out.copy_to_host(), 3 * x + y))}))
