"""gemini: share one NVIDIA GPU between unmodified CUDA programs.

Groups of processes get a guaranteed minimum share of GPU time, a capped
maximum share and a hard GPU-memory limit. See README.md and docs/.
"""
__version__ = "0.1.0"
