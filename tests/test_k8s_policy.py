"""The pure parts of gem-node: unit ids, one-GPU preference, the group name, per-pod settings from annotations,
the rendered config, the node config, nvidia-smi's list."""
from __future__ import annotations

import pytest

from gemini.config import parse_config
from gemini.k8s import devices as dv
from gemini.k8s.nodeconfig import NodeConfigError, parse_node_config
from gemini.k8s.podresources import ContainerUnits
from gemini.k8s.policy import Defaults, PodInfo, PolicyError, parse_max_util, plan, render_config
from gemini.k8s.service import DiscoveryError, parse_nvidia_smi

GiB, MiB = 1 << 30, 1 << 20
PCT, MEM = dv.RESOURCE_PERCENT, dv.RESOURCE_MEMORY
G0, G1 = "GPU-00000000-0000-4000-8000-000000000000", "GPU-00000001-0000-4000-8000-000000000001"
INV = dv.Inventory((dv.Gpu(0, G0, 4 * GiB), dv.Gpu(1, G1, 4 * GiB)), reserved_memory_bytes=1 * GiB)


def test_units_name_their_gpu_and_are_counted_per_gpu():
    assert INV.memory_units(INV.gpus[0]) == 12                        # (4 - 1) GiB / 256 MiB
    ids = INV.device_ids(MEM)
    assert len(ids) == 24 and ids[0] == f"{G0}-mem-00000" and ids[-1] == f"{G1}-mem-00011"
    assert dv.parse_unit(f"{G1}-pct-099") == dv.Unit(G1, PCT, 99)
    with pytest.raises(dv.AllocationError, match="not a gemini unit"):
        dv.parse_unit("nvidia0")
    with pytest.raises(dv.AllocationError, match="does not exist"):
        INV.gpu_of([f"{G0}-mem-00012"], MEM)                         # past the GPU's units
    with pytest.raises(dv.AllocationError, match="not a gemini.io/gpu-memory unit"):
        INV.gpu_of([f"{G0}-pct-001"], MEM)
    with pytest.raises(dv.AllocationError, match="not on this node"):
        INV.gpu_of(["GPU-ffffffff-0000-4000-8000-000000000000-pct-001"], PCT)
    with pytest.raises(ValueError, match="twice"):
        dv.Inventory((dv.Gpu(0, G0, GiB), dv.Gpu(1, G0, GiB)))


def test_preferred_allocation_keeps_one_gpu_and_fits_tightly():
    ids = INV.device_ids(PCT)
    free = ids[30:100] + ids[100:200]                                # GPU0 has 70 free, GPU1 100
    got = dv.preferred_allocation(INV, PCT, free, [], 50)
    assert got == ids[30:80]                                         # the tighter GPU, lowest units
    assert dv.preferred_allocation(INV, PCT, free, [], 80) == ids[100:180]
    assert dv.preferred_allocation(INV, PCT, free, [], 50, hint_gpu=G1) == ids[100:150]
    assert dv.preferred_allocation(INV, PCT, free, [], 101) == []     # fits no GPU
    must = [ids[150]]
    got = dv.preferred_allocation(INV, PCT, free, must, 3)
    assert got[0] == ids[150] and all(dv.parse_unit(d).gpu_uuid == G1 for d in got) and len(got) == 3


def test_group_name_depends_only_on_the_units():
    a = [f"{G0}-mem-00003", f"{G0}-mem-00001"]
    assert dv.group_name(a) == dv.group_name(list(reversed(a)))
    assert dv.group_name(a) != dv.group_name(a[:1])
    name = dv.group_name(a)
    assert len(name) <= 63 and name.isascii() and name.isprintable() and " " not in name


def units(ns, pod, pct=(), mem=(), container="main") -> ContainerUnits:
    u = {}
    if pct:
        u[PCT] = tuple(pct)
    if mem:
        u[MEM] = tuple(mem)
    return ContainerUnits(ns, pod, container, u)


def test_plan_reads_requests_and_annotations():
    pct, mem = INV.device_ids(PCT), INV.device_ids(MEM)
    pods = {("a", "p"): PodInfo("a", "p", "uid-p", annotations={"gemini.io/max-util": "75%",
                                                                "gemini.io/class": "Latency"}),
            ("a", "q"): PodInfo("a", "q", "uid-q", annotations={"gemini.io/memory-mode": "unified"}),
            ("a", "both"): PodInfo("a", "both", "uid-b", annotations={"gemini.io/class": "latency",
                                                                      "gemini.io/memory-mode": "unified"}),
            ("a", "done"): PodInfo("a", "done", "uid-d", phase="Succeeded")}
    result = plan([units("a", "p", pct[:25], mem[:4]), units("a", "q", (), mem[12:14]),
                   units("a", "both", (), mem[14:15]),
                   units("a", "done", pct[25:30], mem[4:5]), units("a", "unknown", pct[30:31], mem[5:6])],
                  pods, INV, Defaults(max_util=0.9, process_sharing="turns"))
    by_pod = {p.pod: p for p in result.placements}
    assert set(by_pod) == {"p", "q"}                                  # finished pods hold nothing
    p = by_pod["p"].config
    assert (p.min_util, p.max_util, p.mem_limit, p.sched_class, p.memory_mode, p.turns) == \
           (0.25, 0.75, 4 * 256 * MiB, "latency", "device", True)
    q = by_pod["q"]
    assert q.gpu == G1 and (q.config.min_util, q.config.max_util) == (0.0, 0.9)   # node defaults
    assert q.config.memory_mode == "unified"
    # latency and unified together: refused with the reason (a config with it would not load at all)
    assert [str(problem) for problem in result.problems if "both" in str(problem)], result.problems
    assert any("cannot be combined with MemoryMode = unified" in str(problem) for problem in result.problems)
    assert [w.pod for w in result.waiting] == ["unknown"]            # the API has not shown it yet
    # percent units alone: not placed, not refused (its memory units may come next)
    later = plan([units("a", "q", pct[40:41])], pods, INV, Defaults())
    assert not later.placements and not later.problems and [w.pod for w in later.waiting] == ["q"]
    text = render_config(result.placements)
    assert [g.name for g in parse_config(text).groups] == sorted(x.group for x in result.placements)


@pytest.mark.parametrize("text,value", [("0.5", 0.5), ("50%", 0.5), (" 1 ", 1.0), ("0", 0.0)])
def test_max_util_forms(text, value):
    assert parse_max_util(text) == value


@pytest.mark.parametrize("text", ["", "half", "1.5", "-0.1", "150%", "nan", "inf"])
def test_max_util_rejects(text):
    with pytest.raises(PolicyError, match="gemini.io/max-util"):
        parse_max_util(text)


def test_node_config():
    cfg = parse_node_config({"defaults": {"maxUtil": "80%", "class": "latency"}, "reservedMemory": "1GiB",
                             "gpus": [{"uuid": G0, "memory": "80GiB"}], "scheduler": {"quotaMs": 50},
                             "metricsPort": 0})
    assert (cfg.defaults.max_util, cfg.defaults.sched_class, cfg.reserved_memory) == (0.8, "latency", GiB)
    assert cfg.gpus == (dv.Gpu(0, G0, 80 * GiB),) and cfg.scheduler_args == ("-q", "50") and cfg.metrics_port == 0
    assert parse_node_config(None).metrics_port == 9400
    for bad, words in [({"defualts": {}}, "unknown key 'defualts'"), ({"defaults": {"class": "x"}}, "gemini.io/class"),
                       ({"reservedMemory": "lots"}, "reservedMemory"), ({"gpus": [{"uuid": G0}]}, "gpus[0]"),
                       ({"scheduler": {"quotaMs": -1}}, "positive"), ({"metricsPort": 70000}, "metricsPort")]:
        with pytest.raises(NodeConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_node_config(bad)


def test_nvidia_smi_list():
    gpus = parse_nvidia_smi(f"0, {G0}, 81559\n1, {G1}, 143771\n")
    assert gpus == (dv.Gpu(0, G0, 81559 * MiB), dv.Gpu(1, G1, 143771 * MiB))
    with pytest.raises(DiscoveryError):
        parse_nvidia_smi("No devices were found")
