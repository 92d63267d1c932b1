#!/usr/bin/env python3
"""launch-backend: see gemini/launch/backend.py (this file only finds the gemini package and calls it)."""
import os
import sys

try:
    import gemini.launch.backend  # noqa: F401  (installed, or already on the path)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemini.launch.backend import program  # noqa: E402

if __name__ == "__main__":
    program()
