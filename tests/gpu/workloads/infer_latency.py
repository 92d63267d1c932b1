"""Batch-1 ResNet-18 inference with open-loop arrivals: the latency a serving tenant sees.

usage: infer_latency.py SECONDS PERIOD_MS  -> JSON {"p50_ms", "p99_ms", "mean_ms", "requests"}
A request arrives every PERIOD_MS whether or not the previous one is done; its latency runs from
its arrival to its result being on the host, so queueing behind a slow request counts.
"""
import json
import sys
import time

import torch
import torchvision

seconds, period = float(sys.argv[1]), float(sys.argv[2]) / 1000.0
model = torchvision.models.resnet18().cuda().eval()
x = torch.randn(1, 3, 224, 224, device="cuda")
with torch.no_grad():
    for _ in range(30):
        model(x)
torch.cuda.synchronize()
lat = []
start = time.perf_counter()
arrival = start
with torch.no_grad():
    while arrival - start < seconds:
        now = time.perf_counter()
        if now < arrival:
            time.sleep(arrival - now)
        model(x).sum().item()
        lat.append(time.perf_counter() - arrival)
        arrival += period
lat.sort()
print(json.dumps({"ok": True, "requests": len(lat), "p50_ms": lat[len(lat) // 2] * 1e3,
                  "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "mean_ms": sum(lat) / len(lat) * 1e3}))
