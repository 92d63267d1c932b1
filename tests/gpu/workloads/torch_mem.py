"""PyTorch against a group memory limit: what mem_get_info shows, and where allocation stops.

usage: torch_mem.py LIMIT_BYTES [HOLD_BYTES]
  without HOLD: allocate 256 MiB tensors until OutOfMemoryError (or twice the limit) and report;
  with HOLD: allocate HOLD bytes, print {"held": ...}, then wait until stdin closes.
"""
import json
import sys

import torch

limit = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
if len(sys.argv) > 2:
    try:
        t = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda")
        print(json.dumps({"held": t.numel()}), flush=True)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"held": 0, "oom": "OutOfMemoryError"}), flush=True)
        sys.exit(0)
    sys.stdin.read()
    sys.exit(0)
held, allocated, oom = [], 0, None
try:
    while allocated <= 2 * limit:
        held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        allocated += 256 << 20
except torch.cuda.OutOfMemoryError:
    oom = "OutOfMemoryError"
print(json.dumps({"total": total, "free": free, "allocated": allocated, "oom": oom,
                  "reserved": torch.cuda.memory_reserved()}))
