"""PyTorch bursts separated by torch.cuda.synchronize() and idle host time, as a serving tenant does.

usage: torch_sync_bursts.py [BURSTS] [IDLE_MS]  -> JSON {"ok", "bursts", "cuda_runtime"}
Each burst is a few matrix products; torch.cuda.synchronize() (cudaDeviceSynchronize: cuCtxSynchronize,
cuCtxSynchronize_v2 on a CUDA 13 runtime) ends it, and nothing else synchronises inside the loop, so only
that call can tell the hook that the process has gone idle.
"""
import json
import sys
import time

import torch

bursts = int(sys.argv[1]) if len(sys.argv) > 1 else 40
idle_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
a = torch.randn(2048, 2048, device="cuda") / 64
b = torch.randn(2048, 2048, device="cuda") / 64
torch.cuda.synchronize()
c = a
for _ in range(bursts):
    c = a
    for _ in range(8):
        c = torch.tanh(c @ b)
    torch.cuda.synchronize()
    time.sleep(idle_ms / 1000)
ok = bool(torch.isfinite(c).all().item())
print(json.dumps({"ok": ok, "bursts": bursts, "cuda_runtime": torch.version.cuda}))
