"""gem-pmgr: one group's pod manager (token sharing and memory accounting for its hooks).

manager.py holds the logic (pure, simulated-time testable), server.py the sockets, cli.py the command.
"""

from gemini.transport import DEFAULT_IP, DEFAULT_SCHEDULER_PORT
from gemini.transport import DEFAULT_POD_MANAGER_PORT as DEFAULT_PORT

__all__ = ["DEFAULT_IP", "DEFAULT_PORT", "DEFAULT_SCHEDULER_PORT", "ENV_POD_NAME", "ENV_POD_MANAGER_IP",
           "ENV_POD_MANAGER_PORT", "ENV_SCHEDULER_IP", "ENV_SCHEDULER_PORT"]

# Environment variables naming the group and its pod manager, in the order the hook reads them (ours, then
# Gemini's). gem-pmgr takes them as defaults for its flags; launch-command sets all of them for its program.
ENV_POD_NAME = ("GEMINI_POD_NAME", "POD_NAME")
ENV_POD_MANAGER_IP = ("GEMINI_POD_MANAGER_IP", "POD_MANAGER_IP")
ENV_POD_MANAGER_PORT = ("GEMINI_POD_MANAGER_PORT", "POD_MANAGER_PORT")
ENV_SCHEDULER_IP = ("GEMINI_SCHEDULER_IP", "SCHEDULER_IP")
ENV_SCHEDULER_PORT = ("GEMINI_SCHEDULER_PORT", "SCHEDULER_PORT")
