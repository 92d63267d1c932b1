"""A batch-1 inference server with open-loop arrivals: the latency a serving tenant sees.

usage: serve.py MODEL ARRIVAL RATE SECONDS [--idle-gaps BUSY:IDLE] [--timeline FILE]
  MODEL    resnet18 (torchvision, 3x224x224) or mlp (8 x Linear(2048, 2048) + ReLU)
  ARRIVAL  periodic (one request every 1/RATE s) or poisson (exponential gaps, mean 1/RATE s; seed 1)
  --idle-gaps BUSY:IDLE  requests arrive for BUSY s, then none for IDLE s, and so on (an idle-then-busy tenant)
  --timeline FILE  bracket each request with two one-thread kernels that write the GPU's %globaltimer, and write
                   one line per request to FILE (bench/request_timeline.py reads and summarises them)
-> JSON {"p50_ms", "p99_ms", "p999_ms", "mean_ms", "requests", "late"}, and with --idle-gaps "after_idle": the
   requests that arrived within the first AFTER_IDLE_S (0.5 s) of each busy phase after a gap (their p50 / p99 /
   max, and each phase's first request), the ones that find the serving group idle since the gap

A request arrives on schedule whether or not the previous one is done; its latency runs from its arrival to
its result being on the host (`.item()`), so queueing behind a slow request counts. "t0"/"t1" are the
CLOCK_MONOTONIC seconds of the measured span (for the trainer's rate over the same span).
"""
import argparse
import json
import os
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
ap.add_argument("--timeline", default="", help="write each request's times to this file")
args = ap.parse_args()
model_name, arrival, rate, seconds = args.model, args.arrival, args.rate, args.seconds
busy_s = idle_s = 0.0
if args.idle_gaps:
    busy_s, idle_s = (float(v) for v in args.idle_gaps.split(":"))
    if busy_s <= 0 or idle_s <= 0:
        raise SystemExit(f"--idle-gaps {args.idle_gaps}: both BUSY and IDLE must be positive seconds")


class GpuStamps:
    """A one-thread kernel that writes %globaltimer (ns) into slot i of a device buffer, launched on torch's current
    stream through the driver API (ctypes: under gemini the hook's cuLaunchKernel, gated like torch's own). The
    PTX is JIT-compiled by the driver, so nothing but libcuda is needed."""

    PTX = (b".version 7.0\n.target sm_70\n.address_size 64\n"
           b".visible .entry stamp(.param .u64 out)\n{\n"
           b"    .reg .b64 %rd<4>;\n"
           b"    ld.param.u64 %rd1, [out];\n"
           b"    cvta.to.global.u64 %rd2, %rd1;\n"
           b"    mov.u64 %rd3, %globaltimer;\n"
           b"    st.global.u64 [%rd2], %rd3;\n"
           b"    ret;\n}\n")

    def __init__(self, slots: int):
        import ctypes
        self.ct = ctypes
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.buf = torch.zeros(slots, dtype=torch.int64, device="cuda")   # makes torch's context current here
        mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(self.PTX)), "cuModuleLoadData")
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(self.fn), mod, b"stamp"), "cuModuleGetFunction")
        self.cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.slots = slots

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise SystemExit(f"--timeline: {what} failed: CUresult {rc}")

    def stamp(self, i: int) -> None:
        ct = self.ct
        arg = ct.c_uint64(self.buf.data_ptr() + 8 * (i % self.slots))
        params = (ct.c_void_p * 1)(ct.cast(ct.pointer(arg), ct.c_void_p))
        self._check(self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0,
                                           ct.c_void_p(torch.cuda.current_stream().cuda_stream), params, None),
                    "cuLaunchKernel")

    def read(self) -> list[int]:
        return self.buf.cpu().tolist()


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
# the timeline's stamps: two per request; a run longer than the buffer writes the file in pieces
TIMELINE_SLOTS = 2 * 4096
stamps = GpuStamps(TIMELINE_SLOTS) if args.timeline else None
host_times: list[tuple[int, int, int, int, int]] = []   # arrival, issue, launched, launched_last, done (ns)
timeline_file = open(args.timeline, "w") if args.timeline else None


def flush_timeline() -> None:
    """Pair the host times kept so far with their GPU stamps and write them out."""
    if not host_times:
        return
    gpu = stamps.read()
    for k, (arrival_ns, issue_ns, launched_ns, launched_last_ns, done_ns) in enumerate(host_times):
        # the line's layout is bench/request_timeline.py's RequestTimes
        timeline_file.write(f"{arrival_ns} {issue_ns} {launched_ns} {gpu[2 * k]} {launched_last_ns} "
                            f"{gpu[2 * k + 1]} {done_ns}\n")
    host_times.clear()


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
        if stamps is not None:
            k = len(host_times)
            issue_ns = time.perf_counter_ns()
            stamps.stamp(2 * k)
            launched_ns = time.perf_counter_ns()
            y = model(x).sum()
            stamps.stamp(2 * k + 1)
            launched_last_ns = time.perf_counter_ns()
            y.item()
            host_times.append((int(arrival_t * 1e9), issue_ns, launched_ns, launched_last_ns,
                               time.perf_counter_ns()))
            if len(host_times) * 2 >= TIMELINE_SLOTS:
                flush_timeline()
        else:
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
if timeline_file is not None:
    flush_timeline()
    timeline_file.close()


def pick(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


out = {"ok": True, "model": model_name, "arrival": arrival, "rate": rate, "requests": len(lat),
       "p50_ms": pick(lat, 0.5), "p99_ms": pick(lat, 0.99), "p999_ms": pick(lat, 0.999), "max_ms": max(lat) * 1e3,
       "mean_ms": sum(lat) / len(lat) * 1e3, "late": late, "t0": t0, "t1": t1,
       "pid": os.getpid()}       # (its hook's counters, GEMINI_STATS_FILE, are by pid)
if args.timeline:
    out["timeline_file"] = args.timeline
if busy_s:
    out["idle_gaps"] = {"busy_s": busy_s, "idle_s": idle_s}
    out["after_idle"] = ({"phases": len(first_after_idle), "requests": len(after_idle),
                          "p50_ms": pick(after_idle, 0.5), "p99_ms": pick(after_idle, 0.99),
                          "max_ms": max(after_idle) * 1e3, "first_ms": [v * 1e3 for v in first_after_idle]}
                         if after_idle else {"phases": 0, "requests": 0})
print(json.dumps(out))
