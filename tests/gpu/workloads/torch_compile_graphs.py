"""torch.compile(mode="reduce-overhead"): CUDA graphs made by the compiler; checks the result."""
import json

import torch

model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda()
compiled = torch.compile(model, mode="reduce-overhead")
ok = True
with torch.no_grad():
    for _ in range(10):
        x = torch.randn(32, 256, device="cuda")
        ok &= bool(torch.allclose(compiled(x), model(x), atol=1e-3))
torch.cuda.synchronize()
print(json.dumps({"ok": ok}))
