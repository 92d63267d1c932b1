"""JAX's default preallocation under a group limit: it should take its fraction of the limit."""
import json

import jax
import jax.numpy as jnp

x = jnp.ones((1024, 1024))
x.block_until_ready()
stats = jax.devices()[0].memory_stats() or {}
print(json.dumps({"bytes_limit": stats.get("bytes_limit"), "bytes_reserved": stats.get("bytes_reserved"),
                  "pool_bytes": stats.get("pool_bytes")}))
