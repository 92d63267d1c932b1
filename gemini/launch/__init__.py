"""The logic of tools/launch-backend.py (backend.py) and tools/launch-command.py (command.py)."""
