"""gem-schd, the token scheduler: policy.py (pure scheduling logic), daemon.py (zmq I/O), connections.py (a guard on
its connections), cli.py (the `gem-schd` command). The config watcher it shares with launch-backend is
gemini/reload.py."""
from gemini.scheduler.policy import ConfigDiff, Decision, GrantDecision, Policy, RefuseDecision, diff_configs

__all__ = ["Policy", "Decision", "GrantDecision", "RefuseDecision", "ConfigDiff", "diff_configs"]
