"""gem-schd, the token scheduler: policy.py (pure scheduling logic), daemon.py (zmq I/O), reload.py (live config
reload), cli.py (the `gem-schd` command), testing.py (in-process helpers for tests and benchmarks)."""
from gemini.scheduler.policy import ConfigDiff, Decision, GrantDecision, Policy, RefuseDecision, diff_configs

__all__ = ["Policy", "Decision", "GrantDecision", "RefuseDecision", "ConfigDiff", "diff_configs"]
