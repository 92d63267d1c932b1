"""A batch-1 inference server with open-loop arrivals: the latency a serving tenant sees.

usage: serve.py MODEL ARRIVAL RATE SECONDS [--idle-gaps BUSY:IDLE]
  MODEL    resnet18 (torchvision, 3x224x224) or mlp (8 x Linear(2048, 2048) + ReLU)
  ARRIVAL  periodic (one request every 1/RATE s) or poisson (exponential gaps, mean 1/RATE s; seed 1)
  --idle-gaps BUSY:IDLE  requests arrive for BUSY s, then none for IDLE s, and so on (an idle-then-busy tenant)
-> JSON {"p50_ms", "p99_ms", "p999_ms", "mean_ms", "requests", "late"}, and with --idle-gaps "after_idle": the
   requests that arrived within the first AFTER_IDLE_S (0.5 s) of each busy phase after a gap (their p50 / p99 /
   max, and each phase's first request), the ones that find the serving group idle since the gap

A request arrives on schedule whether or not the previous one is done; its latency runs from its arrival to
its result being on the host (`.item()`), so queueing behind a slow request counts. "t0"/"t1" are the
CLOCK_MONOTONIC seconds of the measured span (for the trainer's rate over the same span).
"""
import argparse
import json
import random
import time

import torch

AFTER_IDLE_S = 0.5

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("arrival", choices=["periodic", "poisson"])
ap.add_argument("rate", type=float)
ap.add_argument("seconds", type=float)
ap.add_argument("--idle-gaps", default="", help="BUSY:IDLE seconds")
args = ap.parse_args()
model_name, arrival, rate, seconds = args.model, args.arrival, args.rate, args.seconds
busy_s = idle_s = 0.0
if args.idle_gaps:
    busy_s, idle_s = (float(v) for v in args.idle_gaps.split(":"))
    if busy_s <= 0 or idle_s <= 0:
        raise SystemExit(f"--idle-gaps {args.idle_gaps}: both BUSY and IDLE must be positive seconds")
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
after_idle, first_after_idle = [], []     # requests early in a busy phase that follows a gap
start = time.perf_counter()
t0 = time.monotonic()
arrival_t = start
phase_start = start
late = 0
with torch.no_grad():
    while arrival_t - start < seconds:
        now = time.perf_counter()
        if now < arrival_t:
            time.sleep(arrival_t - now)
        else:
            late += 1
        model(x).sum().item()
        took = time.perf_counter() - arrival_t
        lat.append(took)
        if phase_start > start and arrival_t - phase_start < AFTER_IDLE_S:
            if arrival_t == phase_start:
                first_after_idle.append(took)
            after_idle.append(took)
        arrival_t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
        if busy_s and arrival_t - phase_start >= busy_s:
            # the busy phase is over: nothing arrives for idle_s, then the next phase starts with a request
            phase_start += busy_s + idle_s
            arrival_t = phase_start
t1 = time.monotonic()


def pick(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


out = {"ok": True, "model": model_name, "arrival": arrival, "rate": rate, "requests": len(lat),
       "p50_ms": pick(lat, 0.5), "p99_ms": pick(lat, 0.99), "p999_ms": pick(lat, 0.999), "max_ms": max(lat) * 1e3,
       "mean_ms": sum(lat) / len(lat) * 1e3, "late": late, "t0": t0, "t1": t1}
if busy_s:
    out["idle_gaps"] = {"busy_s": busy_s, "idle_s": idle_s}
    out["after_idle"] = ({"phases": len(first_after_idle), "requests": len(after_idle),
                          "p50_ms": pick(after_idle, 0.5), "p99_ms": pick(after_idle, 0.99),
                          "max_ms": max(after_idle) * 1e3, "first_ms": [v * 1e3 for v in first_after_idle]}
                         if after_idle else {"phases": 0, "requests": 0})
print(json.dumps(out))
