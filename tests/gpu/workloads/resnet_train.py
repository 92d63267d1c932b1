"""ResNet-18 training step rate on synthetic data (single tenant overhead benchmark).

usage: resnet_train.py [SECONDS] [BATCH]  -> JSON {"steps_per_s": ..., "steps": ...}
Warm-up steps are excluded; the rate is measured over SECONDS of steady training.
"""
import json
import sys
import time

import torch

from train_loop import make_step    # the same eager ResNet-18 step as the benchmarks' trainer

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
step = make_step("eager", batch)

for _ in range(20):
    step()
torch.cuda.synchronize()
steps = 0
start = time.perf_counter()
while time.perf_counter() - start < seconds:
    for _ in range(10):
        loss = step()
    loss.item()  # a sync per 10 steps, as a logging loop would
    steps += 10
elapsed = time.perf_counter() - start
print(json.dumps({"ok": True, "steps_per_s": steps / elapsed, "steps": steps, "seconds": elapsed}))
