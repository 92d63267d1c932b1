"""pynvml inside a group: nvmlDeviceGetMemoryInfo (v1 and v2) should show the group's limit."""
import json

import pynvml

pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
out = {"v1": {"total": m1.total, "used": m1.used, "free": m1.free}}
try:
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    out["v2"] = {"total": m2.total, "used": m2.used, "free": m2.free, "reserved": m2.reserved}
except Exception as exc:  # noqa: BLE001 -- older bindings have no v2
    out["v2"] = repr(exc)
print(json.dumps(out))
