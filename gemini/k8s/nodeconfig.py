"""gem-node's settings: the node ConfigMap's `node.yaml`, every key optional.

    defaults:                 # for pods that do not say (annotations gemini.io/...)
      maxUtil: 1.0
      class: batch            # batch | latency
      memoryMode: device      # device | unified
      processSharing: together
    reservedMemory: 1GiB      # per GPU, kept out of gemini.io/gpu-memory (CUDA contexts, the driver)
    gpus:                     # optional; default: found with nvidia-smi
      - {uuid: GPU-..., memory: 80GiB}
    scheduler: {quotaMs: 250, minQuotaMs: 100, windowMs: 10000}
    metricsPort: 9400         # 0: no metrics

Every error is a NodeConfigError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemini.config import parse_size

from .devices import Gpu
from .policy import Defaults, PolicyError, parse_max_util, settings_from_annotations

DEFAULT_METRICS_PORT = 9400
_TOP = {"defaults", "reservedMemory", "gpus", "scheduler", "metricsPort"}
_DEFAULT_KEYS = {"maxUtil": "gemini.io/max-util", "class": "gemini.io/class", "memoryMode": "gemini.io/memory-mode",
                 "processSharing": "gemini.io/process-sharing"}
_SCHED_KEYS = {"quotaMs": "-q", "minQuotaMs": "-m", "windowMs": "-w"}


class NodeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class NodeConfig:
    defaults: Defaults = Defaults()
    reserved_memory: int = 0
    gpus: tuple[Gpu, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    metrics_port: int = DEFAULT_METRICS_PORT
    source: str = "<defaults>"
    extra: dict = field(default_factory=dict)


def _size(value: Any, key: str) -> int:
    try:
        return parse_size(str(value))
    except ValueError as exc:
        raise NodeConfigError(f"{key}: {exc}") from None


def parse_node_config(data: Any, source: str = "<string>") -> NodeConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise NodeConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - _TOP)
    if unknown:
        raise NodeConfigError(f"{source}: unknown key {unknown[0]!r} (expected {', '.join(sorted(_TOP))})")
    raw_defaults = data.get("defaults") or {}
    if not isinstance(raw_defaults, dict) or set(raw_defaults) - set(_DEFAULT_KEYS):
        raise NodeConfigError(f"{source}: defaults: expected keys among {', '.join(_DEFAULT_KEYS)}")
    try:
        annotations = {_DEFAULT_KEYS[k]: str(v) for k, v in raw_defaults.items()}
        s = settings_from_annotations(annotations, Defaults())
        if "maxUtil" in raw_defaults:
            parse_max_util(str(raw_defaults["maxUtil"]))
    except PolicyError as exc:
        raise NodeConfigError(f"{source}: defaults: {exc}") from None
    defaults = Defaults(max_util=s["max_util"], sched_class=s["sched_class"], memory_mode=s["memory_mode"],
                        process_sharing="turns" if s["turns"] else "together")
    reserved = _size(data["reservedMemory"], f"{source}: reservedMemory") if "reservedMemory" in data else 0
    gpus = []
    for i, g in enumerate(data.get("gpus") or []):
        if not isinstance(g, dict) or "uuid" not in g or "memory" not in g:
            raise NodeConfigError(f"{source}: gpus[{i}]: expected {{uuid: GPU-..., memory: 80GiB}}")
        gpus.append(Gpu(i, str(g["uuid"]), _size(g["memory"], f"{source}: gpus[{i}].memory")))
    sched = data.get("scheduler") or {}
    if not isinstance(sched, dict) or set(sched) - set(_SCHED_KEYS):
        raise NodeConfigError(f"{source}: scheduler: expected keys among {', '.join(_SCHED_KEYS)}")
    args: list[str] = []
    for key, flag in _SCHED_KEYS.items():
        if key in sched:
            try:
                value = float(sched[key])
            except (TypeError, ValueError):
                raise NodeConfigError(f"{source}: scheduler.{key}: {sched[key]!r} is not a number") from None
            if not value > 0:
                raise NodeConfigError(f"{source}: scheduler.{key} must be positive")
            args += [flag, f"{value:g}"]
    port = data.get("metricsPort", DEFAULT_METRICS_PORT)
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise NodeConfigError(f"{source}: metricsPort: {port!r} is not a port number (0 turns metrics off)")
    return NodeConfig(defaults, reserved, tuple(gpus), tuple(args), port, source)


def load_node_config(path: str | Path | None) -> NodeConfig:
    if path is None:
        return NodeConfig()
    import yaml
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise NodeConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise NodeConfigError(f"{p}: not YAML: {exc}") from None
    return parse_node_config(data, str(p))
