"""A batch-1 inference server with open-loop arrivals: the latency a serving tenant sees.

usage: serve.py MODEL ARRIVAL RATE SECONDS
  MODEL    resnet18 (torchvision, 3x224x224) or mlp (8 x Linear(2048, 2048) + ReLU)
  ARRIVAL  periodic (one request every 1/RATE s) or poisson (exponential gaps, mean 1/RATE s; seed 1)
-> JSON {"p50_ms", "p99_ms", "p999_ms", "mean_ms", "requests", "late"}

A request arrives on schedule whether or not the previous one is done; its latency runs from its arrival to
its result being on the host (`.item()`), so queueing behind a slow request counts. "t0"/"t1" are the
CLOCK_MONOTONIC seconds of the measured span (for the trainer's rate over the same span).
"""
import json
import random
import sys
import time

import torch

model_name, arrival, rate, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
if model_name == "resnet18":
    import torchvision
    model = torchvision.models.resnet18().cuda().eval()
    x = torch.randn(1, 3, 224, 224, device="cuda")
elif model_name == "mlp":
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda().eval()
    x = torch.randn(1, 2048, device="cuda")
else:
    raise SystemExit(f"unknown model {model_name}")
with torch.no_grad():
    for _ in range(50):
        model(x)
torch.cuda.synchronize()
rng = random.Random(1)
lat = []
start = time.perf_counter()
t0 = time.monotonic()
arrival_t = start
late = 0
with torch.no_grad():
    while arrival_t - start < seconds:
        now = time.perf_counter()
        if now < arrival_t:
            time.sleep(arrival_t - now)
        else:
            late += 1
        model(x).sum().item()
        lat.append(time.perf_counter() - arrival_t)
        arrival_t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
t1 = time.monotonic()
lat.sort()
pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3  # noqa: E731
print(json.dumps({"ok": True, "model": model_name, "arrival": arrival, "rate": rate, "requests": len(lat),
                  "p50_ms": pick(0.5), "p99_ms": pick(0.99), "p999_ms": pick(0.999), "max_ms": lat[-1] * 1e3,
                  "mean_ms": sum(lat) / len(lat) * 1e3, "late": late, "t0": t0, "t1": t1}))
