"""One rank of a torch.distributed NCCL all-reduce (tests/gpu/test_gpu_compat.py starts two, one per GPU).

    nccl_allreduce.py RANK WORLD PORT SECONDS

Checks a 256 MiB all-reduce's result, then runs all-reduces of 256 MiB for SECONDS and prints one JSON line: the
result check, the bus bandwidth, and the memory the rank's group counts before and after NCCL set up its buffers
(total - free of cudaMemGetInfo, which the hook fits to the group) beside what PyTorch itself reserved.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

rank, world, port, seconds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
torch.cuda.set_device(rank)
dev = torch.device(f"cuda:{rank}")


def group_used() -> int:
    free, total = torch.cuda.mem_get_info(rank)
    return total - free


n = 64 << 20                                    # float32: 256 MiB
x = torch.full((n,), float(rank + 1), device=dev)
torch.cuda.synchronize()
before = {"group_used": group_used(), "torch_reserved": torch.cuda.memory_reserved(rank)}
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
dist.all_reduce(x)
torch.cuda.synchronize()
expected = world * (world + 1) / 2
correct = bool(torch.all(x == expected).item())
after = {"group_used": group_used(), "torch_reserved": torch.cuda.memory_reserved(rank)}
dist.barrier()
t0, iters = time.monotonic(), 0
while True:
    dist.all_reduce(x)
    iters += 1
    if iters % 8 == 0:
        torch.cuda.synchronize()
        if time.monotonic() - t0 >= seconds:
            break
elapsed = time.monotonic() - t0
busbw = 2 * (world - 1) / world * n * 4 * iters / elapsed / 1e9
total = torch.cuda.mem_get_info(rank)[1]
dist.destroy_process_group()
print(json.dumps({"rank": rank, "correct": correct, "iters": iters, "seconds": elapsed, "busbw_gbs": busbw,
                  "before": before, "after": after, "total": total,
                  "nccl_counted": (after["group_used"] - after["torch_reserved"])
                  - (before["group_used"] - before["torch_reserved"]),
                  "nccl_cumem": os.environ.get("NCCL_CUMEM_ENABLE", "default")}), flush=True)
