"""gem-node's agent: from what the kubelet allocated and what the pods ask for, each GPU's groups, its
config file, its gem-schd and one pod manager per group.

    units (PodResources) + pods (API watch) --policy.plan--> placements --> per GPU:
        resource-config.txt (rewritten when it changes; gem-schd follows it live)
        gem-schd              while the GPU has at least one group (an empty config is not a config)
        a pod manager a group (its socket in the GPU's directory; it admits only its pod's processes)
        a hook settings file a group (mounted read-only into its containers; the hook ignores its env then)

How daemons are started is behind `Launcher` (processes in production, fakes in tests). The agent is the
device plugins' `PluginBackend`: PreStartContainer waits here until the container's group is served, or
fails with the reason it will not be, so a container never starts ungoverned.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Protocol

from . import devices as dv
from .podresources import ContainerUnits
from .policy import Defaults, Placement, Plan, PodInfo, plan, render_config

log = logging.getLogger("gemini.k8s.node")

RESYNC_S = 5.0              # PodResources is polled this often besides every event
RESTART_BACKOFF_S = (0.5, 30.0)
HINT_TTL_S = 5.0
REGISTERED_POLL_S = 0.05
PRESTART_POLL_S = 0.1
STABLE_S = 10.0             # a daemon that ran this long before exiting is restarted with the first backoff
UNHEALTHY_AFTER = 3         # a GPU whose gem-schd failed this many times in a row is advertised Unhealthy
PODS_FILE = "pods.json"            # how long an Allocate's GPU is a hint for the same container's other resource


class Daemon(Protocol):
    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def ready(self) -> bool:
        """Listening (its socket is in place)."""
        ...

    async def stop(self) -> None: ...


class Launcher(Protocol):
    def start_scheduler(self, gpu: dv.Gpu, config_path: Path) -> Daemon: ...

    def start_pod_manager(self, gpu: dv.Gpu, placement: Placement) -> Daemon: ...

    async def registered(self, gpu: dv.Gpu, group: str) -> bool:
        """Whether the GPU's gem-schd knows the group and its pod manager is registered (only then is a hook's
        HELLO answered: before, the pod manager refuses it as an unknown group)."""
        ...


@dataclass
class _Supervised:
    daemon: Daemon
    started: float
    restarts: int = 0
    restart_at: float | None = None
    failures: int = 0           # exits in a row, each within STABLE_S of its start


@dataclass
class GpuState:
    gpu: dv.Gpu
    config_path: Path
    config_text: str = ""
    scheduler: _Supervised | None = None
    groups: dict[str, tuple[Placement, _Supervised]] = field(default_factory=dict)

    @property
    def pods_path(self) -> Path:
        """{group: "namespace/pod/container"} for gem-ctl status --pods."""
        return self.config_path.parent / PODS_FILE


def pods_json(placements: list[Placement]) -> str:
    return json.dumps({p.group: p.ref for p in sorted(placements, key=lambda p: p.group)}, indent=1) + "\n"


class NodeAgent:
    """Runs on gem-node's event loop. `reconcile()` brings the daemons in line with the pods; call it on any
    change (`poke()`), and `run()` does so on every poke and every RESYNC_S."""

    def __init__(self, inventory: dv.Inventory, layout: dv.HostLayout, state_dir: str | Path, launcher: Launcher,
                 list_units: Callable[[], Awaitable[list[ContainerUnits]]], defaults: Defaults | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.inventory = inventory
        self.layout = layout
        self.state_dir = Path(state_dir)
        self.launcher = launcher
        self.list_units = list_units
        self.defaults = defaults or Defaults()
        self.clock = clock
        self.pods: dict[tuple[str, str], PodInfo] = {}
        self.plan = Plan()
        self.gpus = {g.uuid: GpuState(g, self.state_dir / g.uuid / "resource-config.txt") for g in inventory.gpus}
        self.reconciles = 0
        self.units_error: str | None = None
        self._poke = asyncio.Event()
        self._reconciled = asyncio.Event()
        # Reconciles begun, and the number of the last one finished: a prestart waits for one that began after it
        # was asked (one in flight may have listed the kubelet's units before the container's last Allocate).
        self._reconciles_begun = 0
        self._reconcile_done = 0
        self._lock = asyncio.Lock()
        self._hints: dict[str, tuple[str, float]] = {}     # resource -> (gpu, when) of the last Allocate
        self._last_units: list[ContainerUnits] = []
        self.on_plan: list[Callable[[Plan], None]] = []    # metrics, status
        self.on_health: list[Callable[[], None]] = []      # the device plugins: send the device list again
        self._unhealthy: set[str] = set()

    # --- inputs ---------------------------------------------------------------------------------------------------

    def set_pods(self, pods: dict[tuple[str, str], PodInfo]) -> None:
        """The API watch's current set (called on the loop)."""
        self.pods = dict(pods)
        self.poke()

    def poke(self) -> None:
        self._poke.set()

    # --- PluginBackend ---------------------------------------------------------------------------------------------

    def unhealthy_gpus(self) -> set[str]:
        """GPUs whose gem-schd keeps failing: their units are advertised Unhealthy, so the kubelet places no new
        container there (running ones keep their units) until it runs again."""
        now = self.clock()
        out = set()
        for uuid, state in self.gpus.items():
            s = state.scheduler
            stable = s is not None and s.daemon.alive() and now - s.started > STABLE_S
            if s is not None and s.failures >= UNHEALTHY_AFTER and not stable:
                out.add(uuid)
        return out

    def preferred_gpu(self, resource: str) -> str | None:
        other = dv.RESOURCE_MEMORY if resource == dv.RESOURCE_PERCENT else dv.RESOURCE_PERCENT
        hint = self._hints.get(other)
        if hint is not None and self.clock() - hint[1] <= HINT_TTL_S:
            return hint[0]
        return None

    def allocated(self, resource: str, grant: dv.ContainerGrant, device_ids: list[str]) -> None:
        self._hints[resource] = (grant.gpu.uuid, self.clock())
        self._hints.pop(dv.RESOURCE_MEMORY if resource == dv.RESOURCE_PERCENT else dv.RESOURCE_PERCENT, None)
        self.poke()

    async def prestart(self, resource: str, device_ids: list[str]) -> None:
        """Return once the container holding these units is served; AllocationError if it will not be."""
        wanted = set(device_ids)
        need_reconcile = True
        while True:
            if need_reconcile:
                self.poke()
                await self._next_reconcile()
            # until the kubelet lists the units and the API server shows the pod, look again every
            # PRESTART_POLL_S (each look asks the kubelet, which limits PodResources to 100 calls a second)
            need_reconcile = True
            holder = next((u for u in self._last_units if set(u.units.get(resource, ())) == wanted), None)
            if holder is None:
                await asyncio.sleep(PRESTART_POLL_S)
                continue            # the kubelet has not listed the allocation yet
            if dv.RESOURCE_MEMORY not in holder.units:
                raise dv.AllocationError(f"pod {holder.namespace}/{holder.pod} container {holder.container}: it asks "
                                         f"for {dv.RESOURCE_PERCENT} without {dv.RESOURCE_MEMORY}: a gemini container "
                                         "needs both (its memory units name its group)")
            problem = next((p for p in self.plan.problems if (p.namespace, p.pod, p.container) ==
                            (holder.namespace, holder.pod, holder.container) and not p.kept), None)
            if problem is not None:
                raise dv.AllocationError(f"pod {problem.namespace}/{problem.pod} container {problem.container}: "
                                         f"{problem.reason}")
            placement = next((p for p in self.plan.placements if (p.namespace, p.pod, p.container) ==
                              (holder.namespace, holder.pod, holder.container)), None)
            if placement is None:
                await asyncio.sleep(PRESTART_POLL_S)
                continue            # the API server has not shown the pod yet
            state = self.gpus[placement.gpu]
            served = state.groups.get(placement.group)
            if served is not None and served[1].daemon.ready() and state.scheduler is not None \
                    and state.scheduler.daemon.ready():
                if await self.launcher.registered(state.gpu, placement.group):
                    try:
                        self.ensure_settings(placement.group, placement.gpu)
                    except OSError as exc:
                        raise dv.AllocationError(f"gem-node cannot write the hook settings of group "
                                                 f"{placement.group}: {exc}") from None
                    return
            # the daemons are starting (the agent's loop looks after them), gem-schd is reloading the config, or
            # the pod manager is retrying its hello: no need to ask the kubelet again
            need_reconcile = False
            await asyncio.sleep(REGISTERED_POLL_S)

    async def _next_reconcile(self) -> None:
        """Until a reconcile that began after this call has finished (at most 1 s). One already in flight may have
        listed the kubelet's units between a container's Allocates: its percent units and not yet its memory units,
        for which the container would be refused."""
        want = self._reconciles_begun + 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while self._reconcile_done < want:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._reconciled.clear()
            try:
                await asyncio.wait_for(self._reconciled.wait(), left)
            except asyncio.TimeoutError:
                return

    # --- the loop --------------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            # (cleared before, not after: a poke while it lists the units asks for another look, not for nothing)
            self._poke.clear()
            try:
                await self.reconcile()
            except Exception:   # a bug must not stop the node's daemons from being supervised
                log.exception("reconcile failed")
            waits = [asyncio.ensure_future(self._poke.wait()), asyncio.ensure_future(stop.wait())]
            await asyncio.wait(waits, timeout=0.1 if self._pending_restarts() else RESYNC_S,
                               return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()

    def _pending_restarts(self) -> bool:
        return any(s.scheduler is not None and not s.scheduler.daemon.alive() or
                   any(not sup.daemon.alive() for _, sup in s.groups.values()) for s in self.gpus.values())

    async def reconcile(self) -> None:
        async with self._lock:
            self._reconciles_begun += 1
            number = self._reconciles_begun
            try:
                units = await self.list_units()
                self.units_error = None
            except Exception as exc:    # the kubelet is away (restarting): keep everything as it is
                if self.units_error is None:
                    log.warning("cannot read the kubelet's PodResources: %s", exc)
                self.units_error = str(exc)
                self._finished(number)
                return
            self._last_units = units
            new_plan = plan(units, self.pods, self.inventory, self.defaults, self.plan)
            for p in new_plan.problems:
                if p not in self.plan.problems:
                    log.warning("pod %s container %s: %s", f"{p.namespace}/{p.pod}", p.container, p.reason)
            self.plan = new_plan
            for uuid, placements in new_plan.by_gpu(self.gpus).items():
                await self._apply_gpu(self.gpus[uuid], placements)
            self.reconciles += 1
            for callback in self.on_plan:
                callback(new_plan)
            unhealthy = self.unhealthy_gpus()
            if unhealthy != self._unhealthy:
                log.warning("GPUs advertised unhealthy: %s", ", ".join(sorted(unhealthy)) or "none")
                self._unhealthy = unhealthy
                for notify in self.on_health:
                    notify()
            self._finished(number)

    def _finished(self, number: int) -> None:
        self._reconcile_done = number
        self._reconciled.set()

    async def _apply_gpu(self, state: GpuState, placements: list[Placement]) -> None:
        wanted = {p.group: p for p in placements}
        # 1. pod managers of groups that are gone, or whose units now belong to another pod
        for group, (placement, sup) in list(state.groups.items()):
            if group not in wanted or wanted[group].pod_uid != placement.pod_uid:
                log.info("GPU %s: stopping the pod manager of %s (%s)", state.gpu.index, group, placement.ref)
                del state.groups[group]
                await sup.daemon.stop()
                if group not in wanted:
                    self._remove_settings(group)
        # 2. the config, then gem-schd (started when the first group comes, stopped when the last one goes)
        text = render_config(placements) if placements else ""
        if placements and text != state.config_text:
            self._write_file(state.pods_path, pods_json(placements))
            self._write_file(state.config_path, text)
            state.config_text = text
        if not placements:
            state.config_text = ""
            if state.scheduler is not None:
                log.info("GPU %s: no groups left, stopping gem-schd", state.gpu.index)
                sched, state.scheduler = state.scheduler, None
                await sched.daemon.stop()
            return
        # the board's directory must be there before a container that mounts it starts
        Path(self.layout.board_dir(state.gpu.uuid)).mkdir(mode=0o755, parents=True, exist_ok=True)

        def start_scheduler() -> Daemon:
            return self.launcher.start_scheduler(state.gpu, state.config_path)
        state.scheduler = self._supervise(state.scheduler, start_scheduler, f"gem-schd of GPU {state.gpu.index}")
        if state.scheduler is None:
            return      # it could not start: the pod managers would only wait for it; next reconcile tries again
        # 3. pod managers of new groups; new settings of a served group reach it through gem-schd's config
        for group, placement in wanted.items():
            try:
                self.ensure_settings(group, state.gpu.uuid)
            except OSError as exc:      # PreStartContainer tries again, and refuses the container if it fails
                log.error("cannot write the hook settings of group %s: %s", group, exc)
            current = state.groups.get(group)
            def start_pod_manager(p: Placement = placement) -> Daemon:
                return self.launcher.start_pod_manager(state.gpu, p)
            started = self._supervise(current[1] if current else None, start_pod_manager,
                                      f"pod manager of {placement.ref} ({group})")
            if started is not None:
                state.groups[group] = (placement, started)

    def _supervise(self, sup: _Supervised | None, start: Callable[[], Daemon], what: str) -> _Supervised | None:
        """Start a daemon that is not running, restart a dead one with backoff; None if it cannot start now."""
        now = self.clock()
        if sup is not None and sup.daemon.alive():
            return sup
        if sup is not None:
            if sup.restart_at is None:
                sup.failures = 0 if now - sup.started > STABLE_S else sup.failures + 1
                delay = min(RESTART_BACKOFF_S[0] * 2 ** max(sup.failures - 1, 0), RESTART_BACKOFF_S[1])
                sup.restart_at = now + delay
                log.warning("%s exited; restarting in %.1f s", what, delay)
            if now < sup.restart_at:
                return sup
        try:
            daemon = start()
        except Exception as exc:
            log.error("cannot start %s: %s", what, exc)
            return sup
        if sup is None:
            return _Supervised(daemon, now)
        return _Supervised(daemon, now, sup.restarts + 1, failures=sup.failures)

    @staticmethod
    def _write_file(path: Path, text: str, mode: int | None = None) -> None:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)        # gem-schd sees a whole file or the old one, never half of one

    # --- the hook settings files ------------------------------------------------------------------------------------

    def ensure_settings(self, group: str, gpu_uuid: str) -> None:
        """The group's hook settings file (Allocate mounts it read-only at /etc/gemini/hook.conf), written if it
        is missing or says something else. Containers running keep the file they mounted."""
        path = Path(self.layout.settings_file(group))
        text = dv.hook_settings(group, gpu_uuid)
        try:
            if path.read_text() == text:
                return
        except OSError:
            pass
        self._write_file(path, text, 0o644)

    def _remove_settings(self, group: str) -> None:
        try:
            Path(self.layout.settings_file(group)).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove the hook settings of group %s: %s", group, exc)

    async def shutdown(self) -> None:
        for state in self.gpus.values():
            for _, sup in list(state.groups.values()):
                await sup.daemon.stop()
            state.groups.clear()
            if state.scheduler is not None:
                await state.scheduler.daemon.stop()
                state.scheduler = None

    # --- for status and metrics ------------------------------------------------------------------------------------

    def pod_of_group(self) -> dict[str, Placement]:
        return self.plan.by_group()
