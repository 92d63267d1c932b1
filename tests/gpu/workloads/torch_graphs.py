"""PyTorch CUDA graphs: capture a training-free forward pass and replay it; checks the result."""
import json
import sys

import torch

replays = int(sys.argv[1]) if len(sys.argv) > 1 else 20

dev = torch.device("cuda")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).to(dev)
static_in = torch.randn(64, 512, device=dev)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s), torch.no_grad():
    for _ in range(3):  # warm up on a side stream, as the docs require
        model(static_in)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g), torch.no_grad():
    static_out = model(static_in)
ok = True
for _ in range(replays):
    data = torch.randn(64, 512, device=dev)
    static_in.copy_(data)
    g.replay()
    with torch.no_grad():
        ref = model(data)
    ok &= bool(torch.allclose(static_out, ref, atol=1e-4))
torch.cuda.synchronize()
print(json.dumps({"ok": ok, "replays": replays}))
