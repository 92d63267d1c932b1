"""gemini on Kubernetes: gem-node (device plugin, per-pod policy, pod managers) and its helpers."""
