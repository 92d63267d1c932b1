"""JAX: a jitted function run repeatedly, checked against NumPy."""
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@jax.jit
def step(x, w):
    return jnp.tanh(x @ w) + 0.5 * x


x = jnp.ones((512, 512), dtype=jnp.float32) * 0.01
w = jnp.eye(512, dtype=jnp.float32)
for _ in range(50):
    x = step(x, w)
x = np.asarray(jax.block_until_ready(x))
ref = np.ones((512, 512), dtype=np.float32) * 0.01
for _ in range(50):
    ref = np.tanh(ref) + 0.5 * ref
print(json.dumps({"ok": bool(np.allclose(x, ref, rtol=1e-3)), "backend": jax.default_backend()}))
