"""gem-node against a fake kubelet that calls its device plugins exactly as the kubelet does (Registration,
ListAndWatch, GetPreferredAllocation, Allocate, PreStartContainer, PodResources): the units advertised and
counted, what a container is given, one GPU per container, and the groups, configs and daemons that follow the
pods. The daemons are fakes here (test_k8s_e2e.py runs real ones)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("grpc")

from gemini.config import load_config  # noqa: E402
from gemini.k8s import devices as dv  # noqa: E402
from gemini.k8s.policy import PodInfo  # noqa: E402
from tests.k8s_harness import GiB, NodeHarness, gpus  # noqa: E402
from tests.k8s_kubelet import KubeletError  # noqa: E402

PCT, MEM = dv.RESOURCE_PERCENT, dv.RESOURCE_MEMORY
MiB = 1 << 20


def pod(ns: str, name: str, uid: str, **annotations: str) -> PodInfo:
    return PodInfo(ns, name, uid, "node-1", "Running", {f"gemini.io/{k.replace('_', '-')}": v
                                                          for k, v in annotations.items()})


def test_registration_and_the_units_advertised(tmp_path):
    with NodeHarness(tmp_path, gpus(2, memory=8 * GiB), reserved=1 * GiB) as node:
        regs = {r.resource_name: r for r in node.kubelet.registrations}
        assert set(regs) == {PCT, MEM}
        for r in regs.values():
            assert r.version == "v1beta1"
            assert r.options.pre_start_required and r.options.get_preferred_allocation_available
            assert (node.kubelet.plugin_dir / r.endpoint).exists()
        assert node.kubelet.capacity(PCT) == 200                  # 100 per GPU
        assert node.kubelet.capacity(MEM) == 2 * (7 * GiB // (256 * MiB))    # (8 GiB - 1 GiB reserve) / 256 MiB
        uuids = {dv.parse_unit(d).gpu_uuid for d in node.kubelet.plugins[MEM].devices}
        assert uuids == {g.uuid for g in node.inventory.gpus}


def test_allocate_gives_the_hook_the_gpu_socket_dir_and_the_group(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        opts = node.kubelet.admit("team-a", "train", "main", {PCT: 30, MEM: 16})
        gpu = node.inventory.gpus[0]
        assert opts.conflicts == []
        assert opts.envs == {"LD_PRELOAD": dv.CONTAINER_HOOK, "GEMINI_IPC_DIR": dv.CONTAINER_IPC_ROOT,
                             "NVIDIA_VISIBLE_DEVICES": gpu.uuid,
                             "GEMINI_GROUP_NAME": dv.group_name(opts.device_ids[MEM])}
        assert opts.mounts == {
            dv.CONTAINER_HOOK: (node.layout.hook, True),
            "/etc/ld.so.preload": (node.layout.preload, True),       # gated even with LD_PRELOAD cleared
            # read-only: the container can connect to the sockets but replace none
            f"{dv.CONTAINER_IPC_ROOT}/{gpu.uuid}": (node.layout.ipc_dir(gpu.uuid), True),
            # the GPU's board page (claims, continuations): read-only, so a container cannot write claims
            f"{dv.CONTAINER_BOARD_ROOT}/{gpu.uuid}": (node.layout.board_dir(gpu.uuid), True),
            # the hook's settings, at the path compiled into the hook: the container's env cannot override them
            "/etc/gemini/hook.conf": (node.layout.settings_file(opts.envs["GEMINI_GROUP_NAME"]), True),
        }
        # the same env whichever resource the kubelet allocates first
        other = node.kubelet.admit("team-a", "infer", "main", {PCT: 20, MEM: 8}, order=[MEM, PCT])
        assert other.conflicts == [] and other.envs["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
        assert other.envs["GEMINI_GROUP_NAME"] != opts.envs["GEMINI_GROUP_NAME"]


def test_the_units_are_counted_so_no_gpu_is_overcommitted(tmp_path):
    with NodeHarness(tmp_path, gpus(1, memory=4 * GiB)) as node:
        node.kubelet.admit("a", "one", "main", {PCT: 60, MEM: 8})
        node.kubelet.admit("a", "two", "main", {PCT: 40, MEM: 8})
        with pytest.raises(KubeletError, match="insufficient gemini.io/gpu-percent"):
            node.kubelet.admit("a", "three", "main", {PCT: 1, MEM: 1})
        with pytest.raises(KubeletError, match="insufficient gemini.io/gpu-memory"):
            node.kubelet.admit("a", "four", "main", {MEM: 1})         # 16 units = 4 GiB all given
        node.kubelet.remove_pod("a", "one")
        node.kubelet.admit("a", "five", "main", {PCT: 60, MEM: 8})     # freed units come back


def test_a_containers_units_stay_on_one_gpu(tmp_path):
    with NodeHarness(tmp_path, gpus(2)) as node:
        a = node.kubelet.admit("a", "one", "main", {PCT: 60, MEM: 4})
        # the percent units must go to the second GPU; the memory units fit the first one more tightly, and
        # follow the percent units there only because the plugin remembers where they went
        b = node.kubelet.admit("a", "two", "main", {PCT: 60, MEM: 4})
        for opts in (a, b):
            assert opts.conflicts == []
            for r in (PCT, MEM):
                assert len({dv.parse_unit(d).gpu_uuid for d in opts.device_ids[r]}) == 1, (r, opts.device_ids)
            assert {dv.parse_unit(d).gpu_uuid for d in opts.device_ids[PCT]} == \
                   {dv.parse_unit(d).gpu_uuid for d in opts.device_ids[MEM]}
        assert a.envs["NVIDIA_VISIBLE_DEVICES"] != b.envs["NVIDIA_VISIBLE_DEVICES"]   # 60 + 60 do not fit one GPU
        # 40 + 40 free, 50 asked: no GPU can take it, the node total can. The kubelet's own pick spans the GPUs
        # and Allocate refuses it: the pod fails instead of running on two GPUs' floors.
        with pytest.raises(KubeletError, match="span 2 GPUs"):
            node.kubelet.admit("a", "three", "main", {PCT: 50})
        assert ("gemini.io/gpu-percent", []) in node.kubelet.preferred_calls


def test_a_kubelet_that_ignores_the_preference_is_refused(tmp_path):
    with NodeHarness(tmp_path, gpus(2)) as node:
        ids = node.inventory.device_ids(PCT)
        spanning = [ids[0], ids[150]]
        with pytest.raises(KubeletError, match="span 2 GPUs"):
            node.kubelet.admit("a", "one", "main", {PCT: 2}, choose={PCT: spanning})


def served(node, group: str):
    return [d for d in node.launcher.running("pmgr") if d.placement.group == group]


def test_prestart_waits_for_the_pod_and_starts_its_group(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        opts = node.kubelet.admit("team-a", "train", "main", {PCT: 30, MEM: 16})
        group = opts.envs["GEMINI_GROUP_NAME"]
        node.reconcile()
        assert node.launcher.running() == []        # units, but the pod is not known from the API yet
        node.set_pods([pod("team-a", "train", "uid-train", max_util="0.5", process_sharing="turns")])
        node.kubelet.prestart("team-a", "train", "main")
        (pmgr,) = served(node, group)
        assert pmgr.placement.pod_uid == "uid-train" and pmgr.placement.ref == "team-a/train/main"
        (schd,) = node.launcher.running("gem-schd")
        config = load_config(schd.config_path)
        g = config.group(group)
        assert (g.min_util, g.max_util, g.mem_limit, g.turns) == (0.3, 0.5, 16 * 256 * MiB, True)
        assert "pod team-a/train container main" in schd.config_path.read_text()
        # the files the container's mounts name exist before it starts: its hook settings (container paths)
        # and the GPU's board directory
        gpu = node.inventory.gpus[0].uuid
        settings = node.layout.settings_file(group)
        lines = [x for x in open(settings).read().splitlines() if x and not x.startswith("#")]
        assert lines == [f"GEMINI_GROUP_NAME={group}", f"GEMINI_IPC_DIR={dv.CONTAINER_IPC_ROOT}",
                         f"GEMINI_BOARD_DIR={dv.CONTAINER_BOARD_ROOT}/{gpu}"]
        assert oct(os.stat(settings).st_mode & 0o777) == oct(0o644)
        assert os.path.isdir(node.layout.board_dir(gpu))
        # the pod goes: its group's settings file goes with its pod manager
        node.kubelet.remove_pod("team-a", "train")
        node.set_pods([])
        node.reconcile()
        assert served(node, group) == [] and not os.path.exists(settings)
        assert json.loads((schd.config_path.parent / "pods.json").read_text()) == {group: "team-a/train/main"}


def test_groups_follow_the_pods(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        a = node.kubelet.admit("team-a", "train", "main", {PCT: 30, MEM: 16})
        b = node.kubelet.admit("team-b", "infer", "main", {PCT: 20, MEM: 8})
        ga, gb = a.envs["GEMINI_GROUP_NAME"], b.envs["GEMINI_GROUP_NAME"]
        node.set_pods([pod("team-a", "train", "uid-a"), pod("team-b", "infer", "uid-b")])
        node.kubelet.prestart("team-a", "train", "main")
        node.kubelet.prestart("team-b", "infer", "main")
        (schd,) = node.launcher.running("gem-schd")
        assert set(load_config(schd.config_path).names) == {ga, gb}

        # an annotation edited on a running pod: the config follows (gem-schd applies it live)
        node.set_pods([pod("team-a", "train", "uid-a", max_util="40%"), pod("team-b", "infer", "uid-b")])
        node.wait(lambda: load_config(schd.config_path).group(ga).max_util == 0.4, what="the new MaxUtil")
        # a bad edit keeps the last good settings
        node.set_pods([pod("team-a", "train", "uid-a", max_util="lots"), pod("team-b", "infer", "uid-b")])
        node.reconcile()
        assert load_config(schd.config_path).group(ga).max_util == 0.4
        assert any(p.kept and "max-util" in p.reason for p in node.agent.plan.problems)

        # a pod deleted: its pod manager stops, its group leaves the config
        node.kubelet.remove_pod("team-b", "infer")
        node.set_pods([pod("team-a", "train", "uid-a", max_util="40%")])
        # (the pod manager's stop and the config's rewrite are two steps of one reconcile: wait for both)
        node.wait(lambda: not served(node, gb) and load_config(schd.config_path).names == [ga],
                  what="the deleted pod's pod manager stopped and its group out of the config")
        assert served(node, ga)
        # the last one gone: gem-schd stops too
        node.kubelet.remove_pod("team-a", "train")
        node.set_pods([])
        node.wait(lambda: not node.launcher.running("gem-schd"), what="gem-schd stopped")
        assert node.launcher.running() == []


def test_units_taken_over_by_another_pod_restart_the_pod_manager(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        a = node.kubelet.admit("ns", "old", "main", {MEM: 4})
        node.set_pods([pod("ns", "old", "uid-old")])
        node.kubelet.prestart("ns", "old", "main")
        # the old pod ends and a new one gets the very same units before gem-node saw the end
        node.kubelet.remove_pod("ns", "old")
        node.kubelet.admit("ns", "new", "main", {MEM: 4}, choose={MEM: a.device_ids[MEM]})
        node.set_pods([pod("ns", "new", "uid-new")])
        node.kubelet.prestart("ns", "new", "main")
        (pmgr,) = node.launcher.running()
        assert pmgr.placement.pod_uid == "uid-new", "the new pod's processes must not be judged as the old pod's"


def test_prestart_judges_the_container_by_a_list_made_after_it_was_asked(tmp_path):
    """The kubelet records a container's units resource by resource, and each Allocate pokes gem-node: a list of the
    pod's units made between the two Allocates has its percent units and not yet its memory units. PreStartContainer
    comes after both; had gem-node judged the container by that list (still in flight when it was asked), it would
    have refused it for asking for percent units without memory units (seen once under load in `make test`)."""
    import time

    with NodeHarness(tmp_path, gpus(1)) as node:
        node.set_pods([pod("team-a", "train", "uid-train")])
        node.kubelet.admit("team-a", "train", "main", {PCT: 30})          # the percent units first ...
        node.reconcile()
        node.kubelet.list_delay_s = 0.5
        node.loop.call_soon_threadsafe(node.agent.poke)                    # ... a list of them made now ...
        time.sleep(0.2)
        node.kubelet.list_delay_s = 0.0
        node.kubelet.admit("team-a", "train", "main", {MEM: 16})          # ... then the memory units
        node.kubelet.prestart("team-a", "train", "main")                  # while that list is still on its way
        assert node.launcher.running("pmgr")


@pytest.mark.parametrize("case", ["split", "percent-only", "bad-annotation", "max-below-min"])
def test_prestart_refuses_a_container_it_cannot_serve(tmp_path, case):
    with NodeHarness(tmp_path, gpus(2)) as node:
        pct, mem = node.inventory.device_ids(PCT), node.inventory.device_ids(MEM)
        annotations = {}
        if case == "split":      # each resource on its own GPU (a kubelet that ignored the preferences)
            opts = node.kubelet.admit("a", "p", "main", {PCT: 2, MEM: 2}, choose={PCT: pct[:2], MEM: mem[-2:]})
            assert opts.conflicts, "the kubelet keeps one of two visible devices: the container must not start"
            expected = "one GPU"
        elif case == "percent-only":
            node.kubelet.admit("a", "p", "main", {PCT: 2})
            expected = "without gemini.io/gpu-memory"
        elif case == "bad-annotation":
            node.kubelet.admit("a", "p", "main", {PCT: 2, MEM: 2})
            annotations = {"class": "urgent"}
            expected = "gemini.io/class"
        else:
            node.kubelet.admit("a", "p", "main", {PCT: 50, MEM: 2})
            annotations = {"max_util": "0.3"}
            expected = "below"
        node.set_pods([pod("a", "p", "uid-p", **annotations)])
        with pytest.raises(KubeletError, match=expected):
            node.kubelet.prestart("a", "p", "main")
        assert node.launcher.running() == []


def test_plugins_register_again_after_a_kubelet_restart(tmp_path):
    with NodeHarness(tmp_path, gpus(1)) as node:
        before = len(node.kubelet.registrations)
        node.kubelet.restart()
        node.kubelet.wait_registered(set(dv.RESOURCES))
        assert len(node.kubelet.registrations) == before + 2
        opts = node.kubelet.admit("a", "after", "main", {PCT: 10, MEM: 1})
        assert opts.envs["GEMINI_GROUP_NAME"].startswith("k8s-")


def test_a_gpu_whose_scheduler_keeps_failing_is_advertised_unhealthy(tmp_path, monkeypatch):
    import gemini.k8s.node as node_mod
    monkeypatch.setattr(node_mod, "RESTART_BACKOFF_S", (0.01, 0.02))
    monkeypatch.setattr(node_mod, "STABLE_S", 0.3)
    monkeypatch.setattr(node_mod, "RESYNC_S", 0.2)
    with NodeHarness(tmp_path, gpus(2)) as node:
        bad = node.inventory.gpus[0].uuid
        node.launcher.broken_schedulers = True
        node.kubelet.admit("a", "p", "main", {PCT: 10, MEM: 2})            # lands on the first GPU
        node.set_pods([pod("a", "p", "uid-p")])
        # (each resource's plugin tells the kubelet on its own stream: wait for both)
        node.wait(lambda: node.kubelet.capacity(PCT) == 100 and
                  node.kubelet.capacity(MEM) == node.inventory.memory_units(node.inventory.gpus[1]),
                  what="the failing GPU's units unhealthy")
        unhealthy = {d for d, h in node.kubelet.plugins[PCT].devices.items() if h == "Unhealthy"}
        assert {dv.parse_unit(d).gpu_uuid for d in unhealthy} == {bad}
        node.launcher.broken_schedulers = False                           # it runs again: healthy again
        node.wait(lambda: node.kubelet.capacity(PCT) == 200, timeout=30, what="healthy again")


def test_gem_node_names_a_bad_gpu_list_and_exits_2(tmp_path, monkeypatch):
    """A GPU listed twice in node.yaml: gem-node says so and exits 2 (before: a Python traceback, and the
    DaemonSet's pod crash-looped without saying why)."""
    from click.testing import CliRunner

    from gemini.k8s.cli import main
    hook = tmp_path / "libgemhook.so.1"
    hook.write_bytes(b"")
    monkeypatch.setenv("GEMINI_HOOK_LIB", str(hook))
    node_yaml = tmp_path / "node.yaml"
    node_yaml.write_text('gpus:\n  - {uuid: "GPU-a", memory: 8GiB}\n  - {uuid: "GPU-a", memory: 8GiB}\n')
    r = CliRunner().invoke(main, ["--node-name", "n", "--config", str(node_yaml), "--root", str(tmp_path / "root")])
    assert r.exit_code == 2, (r.output, r.exception)
    assert "gem-node:" in r.output and "listed twice" in r.output, r.output


def test_a_plugin_whose_register_failed_is_registered_again_though_the_kubelet_socket_kept_its_inode(tmp_path):
    """A restarting kubelet removes the plugins' sockets; the plugin is started again, but its Register can fail
    (the new kubelet not answering yet) and the new kubelet.sock can reuse the old one's inode number. The
    plugin's socket then exists and its server runs: only its failed Register says it is not registered."""
    import asyncio

    from gemini.k8s import deviceplugin as dpm

    class Backend:
        inventory = None
        layout = None

    class Plugin(dpm.DevicePluginServer):
        failures = 0

        async def _call_register(self) -> None:
            if self.failures:
                self.failures -= 1
                raise OSError("the kubelet is not answering yet")

    plugin_dir = tmp_path / "dp"
    plugin_dir.mkdir()
    (plugin_dir / dpm.KUBELET_SOCKET).write_text("")        # one inode throughout: as a reused inode number
    plugin = Plugin(PCT, Backend(), plugin_dir)

    async def main() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(dpm.keep_registered([plugin], stop, poll_s=0.01))

        async def until(cond, what: str) -> None:
            for _ in range(500):
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(what)

        await until(lambda: plugin.registrations == 1, "first registration")
        plugin.failures = 1
        plugin.socket_path.unlink()                            # the kubelet restarts
        try:
            await until(lambda: plugin.registrations == 2, "registered again after a failed Register")
        finally:
            stop.set()
            await task
        return plugin.registrations

    assert asyncio.run(main()) == 2
