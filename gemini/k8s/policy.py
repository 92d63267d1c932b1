"""Per-pod policy, resolved on the node: from the units each container holds (the kubelet's PodResources) and
its pod's annotations (the API server), the groups of each GPU and their settings. Pure: no I/O.

    gemini.io/gpu-percent: N     (resource) MinUtil = N / 100
    gemini.io/gpu-memory: M      (resource) MemoryLimit = M x 256 MiB; the container's group is named by these units
    gemini.io/max-util           annotation: MaxUtil, "0.5" or "50%" (default: the node's, 1)
    gemini.io/class              annotation: batch | latency
    gemini.io/memory-mode        annotation: device | unified
    gemini.io/process-sharing    annotation: together | turns

Annotations apply to every gemini container of the pod. A container is one group. A bad annotation on a pod
already served keeps the settings it had (and is reported); on a new pod it keeps the pod from being served,
since guessing could give a container more than its owner meant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from gemini.config import LATENCY_UNIFIED, GroupConfig, parse_config

from .devices import MEMORY_UNIT_BYTES, RESOURCE_MEMORY, RESOURCE_PERCENT, AllocationError, Inventory, group_name
from .podresources import ContainerUnits

ANNOTATION_MAX_UTIL = "gemini.io/max-util"
ANNOTATION_CLASS = "gemini.io/class"
ANNOTATION_MEMORY_MODE = "gemini.io/memory-mode"
ANNOTATION_PROCESS_SHARING = "gemini.io/process-sharing"
ANNOTATIONS = (ANNOTATION_MAX_UTIL, ANNOTATION_CLASS, ANNOTATION_MEMORY_MODE, ANNOTATION_PROCESS_SHARING)
_CHOICES = {ANNOTATION_CLASS: ("batch", "latency"), ANNOTATION_MEMORY_MODE: ("device", "unified"),
            ANNOTATION_PROCESS_SHARING: ("together", "turns")}
FINISHED_PHASES = ("Succeeded", "Failed")


class PolicyError(ValueError):
    """An annotation or request gem-node cannot turn into settings; the text names it."""


@dataclass(frozen=True)
class PodInfo:
    """What gem-node needs of a pod, from the API server."""
    namespace: str
    name: str
    uid: str
    node_name: str = ""
    phase: str = "Pending"
    annotations: Mapping[str, str] = field(default_factory=dict)
    deleting: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Defaults:
    """The node's settings for what a pod does not say (the ConfigMap's `defaults`)."""
    max_util: float = 1.0
    sched_class: str = "batch"
    memory_mode: str = "device"
    process_sharing: str = "together"


@dataclass(frozen=True)
class Placement:
    """One container's group on its GPU."""
    gpu: str
    namespace: str
    pod: str
    container: str
    pod_uid: str
    config: GroupConfig

    @property
    def group(self) -> str:
        return self.config.name

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class Problem:
    """A container that is not served (refused) or is served with its last good settings (kept)."""
    namespace: str
    pod: str
    container: str
    reason: str
    kept: bool = False

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...] = ()
    problems: tuple[Problem, ...] = ()
    waiting: tuple[ContainerUnits, ...] = ()     # pod not shown by the API server yet, or no memory units (yet)

    def by_gpu(self, gpus: Iterable[str]) -> dict[str, list[Placement]]:
        out: dict[str, list[Placement]] = {g: [] for g in gpus}
        for p in self.placements:
            out.setdefault(p.gpu, []).append(p)
        return out

    def by_group(self) -> dict[str, Placement]:
        return {p.group: p for p in self.placements}


def parse_max_util(text: str) -> float:
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        raise PolicyError(f"{ANNOTATION_MAX_UTIL}: {text[:40]!r} is not a number (use e.g. 0.5 or 50%)") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise PolicyError(f"{ANNOTATION_MAX_UTIL}: {text[:40]!r} must be between 0 and 1 (or 0% and 100%)")
    return value


def settings_from_annotations(annotations: Mapping[str, str], defaults: Defaults) -> dict:
    """GroupConfig keyword arguments from a pod's annotations. PolicyError names the first bad one."""
    out = {"max_util": defaults.max_util, "sched_class": defaults.sched_class, "memory_mode": defaults.memory_mode,
           "turns": defaults.process_sharing == "turns"}
    if ANNOTATION_MAX_UTIL in annotations:
        out["max_util"] = parse_max_util(annotations[ANNOTATION_MAX_UTIL])
    for key, attr in ((ANNOTATION_CLASS, "sched_class"), (ANNOTATION_MEMORY_MODE, "memory_mode"),
                      (ANNOTATION_PROCESS_SHARING, "turns")):
        if key not in annotations:
            continue
        value = annotations[key].strip().lower()
        if value not in _CHOICES[key]:
            raise PolicyError(f"{key}: {annotations[key][:40]!r} must be " + " or ".join(_CHOICES[key]))
        out[attr] = (value == "turns") if attr == "turns" else value
    if out["sched_class"] == "latency" and out["memory_mode"] == "unified":
        raise PolicyError(f"{ANNOTATION_CLASS} latency with {ANNOTATION_MEMORY_MODE} unified: {LATENCY_UNIFIED}")
    return out


def place_container(units: ContainerUnits, pod: PodInfo, inventory: Inventory, defaults: Defaults) -> Placement:
    """The group of one container. AllocationError / PolicyError say why it cannot be served."""
    memory_ids = units.units.get(RESOURCE_MEMORY, ())
    percent_ids = units.units.get(RESOURCE_PERCENT, ())
    if not memory_ids:
        raise PolicyError(f"it asks for {RESOURCE_PERCENT} without {RESOURCE_MEMORY}: a gemini container needs "
                          "both (its memory units name its group)")
    gpu = inventory.gpu_of(memory_ids, RESOURCE_MEMORY)
    if percent_ids:
        percent_gpu = inventory.gpu_of(percent_ids, RESOURCE_PERCENT)
        if percent_gpu.uuid != gpu.uuid:
            raise AllocationError(f"the kubelet put its {RESOURCE_PERCENT} units on {percent_gpu.uuid} and its "
                                  f"{RESOURCE_MEMORY} units on {gpu.uuid}; gemini serves a container on one GPU "
                                  "(delete the pod to place it again; see docs/kubernetes.md)")
    settings = settings_from_annotations(pod.annotations, defaults)
    min_util = len(percent_ids) / 100.0
    if settings["max_util"] + 1e-9 < min_util:
        raise PolicyError(f"{ANNOTATION_MAX_UTIL} {settings['max_util']:g} is below the container's "
                          f"{RESOURCE_PERCENT} request ({len(percent_ids)} = MinUtil {min_util:g})")
    config = GroupConfig(name=group_name(memory_ids), min_util=min_util, max_util=max(settings["max_util"], min_util),
                         mem_limit=len(memory_ids) * MEMORY_UNIT_BYTES, turns=settings["turns"],
                         sched_class=settings["sched_class"], memory_mode=settings["memory_mode"])
    return Placement(gpu.uuid, pod.namespace, pod.name, units.container, pod.uid, config)


def plan(assignments: Iterable[ContainerUnits], pods: Mapping[tuple[str, str], PodInfo], inventory: Inventory,
         defaults: Defaults, previous: Plan | None = None) -> Plan:
    """Every gemini container of the node's live pods, placed on its GPU or reported as a problem."""
    placements: list[Placement] = []
    problems: list[Problem] = []
    waiting: list[ContainerUnits] = []
    before = {(p.pod_uid, p.container, p.group): p for p in (previous.placements if previous else ())}
    for units in sorted(assignments, key=lambda u: (u.namespace, u.pod, u.container)):
        pod = pods.get(units.pod_key)
        if pod is None:
            waiting.append(units)
            continue
        if pod.phase in FINISHED_PHASES:
            continue
        if RESOURCE_MEMORY not in units.units:
            # its memory units may not be allocated yet (the kubelet allocates a container's resources one
            # after the other); PreStartContainer refuses a container that has none when it is about to start
            waiting.append(units)
            continue
        try:
            placements.append(place_container(units, pod, inventory, defaults))
        except PolicyError as exc:
            memory_ids = units.units.get(RESOURCE_MEMORY, ())
            last = before.get((pod.uid, units.container, group_name(memory_ids))) if memory_ids else None
            if last is not None:
                placements.append(last)
                problems.append(Problem(pod.namespace, pod.name, units.container,
                                        f"{exc}; keeping its last settings", kept=True))
            else:
                problems.append(Problem(pod.namespace, pod.name, units.container, str(exc)))
        except AllocationError as exc:
            problems.append(Problem(pod.namespace, pod.name, units.container, str(exc)))
    return Plan(tuple(placements), tuple(problems), tuple(waiting))


def render_config(placements: Iterable[Placement]) -> str:
    """A GPU's resource-config.txt (v2) for its placements; each group says whose it is in a comment. The text
    is parsed back before it is returned, so gem-node never writes a file gem-schd would refuse."""
    ordered = sorted(placements, key=lambda p: p.group)
    lines = ["# Written by gem-node from the pods on this GPU; edits are overwritten.", ""]
    for p in ordered:
        c = p.config
        lines += [f"# pod {p.namespace}/{p.pod} container {p.container} uid {p.pod_uid}",
                  f"[{c.name}]",
                  f"MinUtil = {c.min_util:g}",
                  f"MaxUtil = {c.max_util:g}",
                  f"MemoryLimit = {c.mem_limit}",
                  f"ProcessSharing = {'turns' if c.turns else 'together'}",
                  f"Class = {c.sched_class}",
                  f"MemoryMode = {c.memory_mode}",
                  ""]
    text = "\n".join(lines)
    if ordered:
        parse_config(text, "<gem-node>")
    return text
