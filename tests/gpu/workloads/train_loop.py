"""A training loop that says how far it has got, for rates over any span of its run.

usage: train_loop.py MODE SECONDS [BATCH]
  MODE  eager: ResNet-18 (torchvision), batch BATCH (default 64), SGD, a loss.item() every 10 steps
        graph: an MLP trainer whose model is compiled with torch.compile(mode="reduce-overhead"), so its
               forward and backward are replays of CUDA graphs
Prints {"t": CLOCK_MONOTONIC seconds, "steps": n} after warm-up at every synchronisation (every 10 steps), then a
final JSON line with the mean rate. A bench reads the progress lines to get the rate over the span another tenant
ran, interpolating between them (bench_inference.rate_between): a point every 0.25 s made a 1 s window's rate a
rate over as little as half a second.
"""
import json
import signal
import sys
import time

import torch


def make_step(mode: str, batch: int = 64):
    """The trainer's step function: one optimisation step of MODE's model (returns its loss, on the GPU)."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    if mode == "eager":
        import torchvision
        model = torchvision.models.resnet18(num_classes=100).cuda()
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        y = torch.randint(0, 100, (batch,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
    elif mode == "graph":
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(4096, 100)).cuda()
        x = torch.randn(batch * 8, 4096, device="cuda")
        y = torch.randint(0, 100, (batch * 8,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.001)

        # The documented pattern: the model compiled with CUDA graphs (forward and backward become graph replays),
        # the loss and the optimizer outside. Each step is marked as a new replay, and the loss is copied out of
        # the graphs' memory, which the next replay overwrites (the loop reads it 10 steps later).
        cmodel = torch.compile(model, mode="reduce-overhead")

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            loss = torch.nn.functional.cross_entropy(cmodel(x), y)
            loss.backward()
            opt.step()
            # None, not zeros: the gradients are outputs of the last backward replay, which the next overwrites
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone()
    else:
        raise SystemExit(f"unknown mode {mode}")
    return step


def main() -> None:
    # A bench stops the loop with SIGTERM: exit normally, so the hook's counters (GEMINI_STATS_FILE) are written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    mode, seconds = sys.argv[1], float(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    step = make_step(mode, batch)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    steps = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(10):
            loss = step()
        loss.item()
        steps += 10
        print(json.dumps({"t": time.monotonic(), "steps": steps}), flush=True)
    elapsed = time.monotonic() - start
    print(json.dumps({"ok": True, "mode": mode, "steps_per_s": steps / elapsed, "steps": steps, "seconds": elapsed}),
          flush=True)


if __name__ == "__main__":
    main()
