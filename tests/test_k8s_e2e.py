"""End to end on one node: the fake kubelet, the API server double driven by the official client, the real gem-node
(device plugins, pod watch, agent), real gem-schd and pod managers on the socket transport, and "pods" whose
processes are started with exactly the env their Allocate answers gave (the mounts mapped to host paths) inside
cgroups shaped as the kubelet makes them (tests/k8s_cgroups.py: real cgroups where they can be made).

- test_pods_get_their_limits_and_only_their_own_group: a wire-level client (the hook's protocol, in Python)
  per pod: each gets its own memory limit from its pod spec; a process that names another pod's group, or is
  in no pod, is refused; a pod deleted from the API loses its pod manager, and its memory comes back.
- test_hooked_workloads_get_their_shares_and_limits: the real hook on the simulated driver, in spin workloads
  started with their Allocate env: each pod held to its cap and memory limit; a deleted pod's units and
  memory go to the next pod.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("kubernetes")
from gemini import transport  # noqa: E402
from gemini.k8s import devices as dv  # noqa: E402
from bench.harness import Group  # noqa: E402
from tests import k8s_container  # noqa: E402
from tests.e2e_fixtures import Sim, client_argv, finish, held_for_claims, start  # noqa: E402
from tests.k8s_cluster import Cluster  # noqa: E402
from tests.k8s_harness import GiB, gpus  # noqa: E402

PCT, MEM = dv.RESOURCE_PERCENT, dv.RESOURCE_MEMORY
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent

# A process of a pod that speaks the hook's protocol: HELLO on the group socket its env names, then commands.
WIRE_CLIENT = r"""
import json, os, socket, sys
sys.path.insert(0, os.environ["E2E_REPO"])
from gemini import transport
from gemini.wire import hook as hp
ipc, uuid = os.environ["GEMINI_IPC_DIR"], os.environ["NVIDIA_VISIBLE_DEVICES"]
group = os.environ.get("GEMINI_GROUP_NAME", "")
seq = 0
def call(sock, msg):
    global seq
    seq += 1
    sock.sendall(hp.encode(msg, seq))
    buf = b""
    while len(buf) < hp.MSG_SIZE:
        chunk = sock.recv(hp.MSG_SIZE - len(buf))
        if not chunk:
            return {"closed": True}
        buf += chunk
    _, reply = hp.decode(buf, hp.PMGR_TO_HOOK)
    return {"type": type(reply).__name__, **{k: v for k, v in vars(reply).items() if isinstance(v, (int, str))}}
try:
    sock = transport.connect_unix(transport.group_socket(ipc, group, uuid), 5)
except OSError as exc:
    print(json.dumps({"connect_error": str(exc)}), flush=True)
    sys.exit(0)
print(json.dumps(call(sock, hp.Hello(pid=os.getpid(), pod_name=group, device_uuid=uuid))), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "alloc":
        print(json.dumps(call(sock, hp.MemAlloc(bytes=int(cmd[1])))), flush=True)
    elif cmd[0] == "quit":
        break
"""


class PodProcess:
    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def line(self, timeout: float = 20) -> dict:
        import select
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no answer within {timeout} s; stderr: {self.proc.stderr.read() if self.proc.poll() else ''}"
        text = self.proc.stdout.readline()
        assert text, f"exited {self.proc.wait()}: {self.proc.stderr.read()[-2000:]}"
        return json.loads(text)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(params=["cgroups", "fixture-files"])
def cluster(request, tmp_path):
    """gem-node with real daemons, identity through real cgroups (where they can be made) and through fixture
    files; yields (cluster, processes)."""
    procs: list[PodProcess] = []
    with Cluster(tmp_path, gpus(1, memory=4 * GiB), force_fixture=request.param == "fixture-files") as c:
        print(f"identity through {c.cgroups.mode}")
        try:
            yield c, procs
        finally:
            for p in procs:
                p.close()
            c.dump_logs()


def start_client(c: Cluster, procs: list, opts, pod_uid: str | None, **env_changes) -> PodProcess:
    env = c.container_env(opts, {"PATH": os.environ["PATH"], "E2E_REPO": str(REPO), "PYTHONPATH": str(REPO)})
    env.pop("LD_PRELOAD", None)       # the wire client is the hook here
    env.update(env_changes)
    p = PodProcess(c.in_pod(pod_uid, [sys.executable, "-c", WIRE_CLIENT]), env)
    procs.append(p)
    return p


def test_pods_get_their_limits_and_only_their_own_group(cluster):
    c, procs = cluster
    node = c.node
    uid_a, opts_a = c.admit_pod("team-a", "train", {PCT: 30, MEM: 4}, {"gemini.io/max-util": "0.5"})   # 1 GiB
    uid_b, opts_b = c.admit_pod("team-b", "infer", {PCT: 20, MEM: 2})                                 # 512 MiB

    pa = start_client(c, procs, opts_a, uid_a)
    hello = pa.line()
    assert hello["type"] == "HelloAck" and hello["mem_limit"] == 4 * 256 * MiB, hello
    assert pa.ask(f"alloc {768 * MiB}")["verdict"] == 0
    refused = pa.ask(f"alloc {512 * MiB}")
    assert refused["verdict"] != 0 and refused["limit"] == GiB, refused              # past 1 GiB
    pb = start_client(c, procs, opts_b, uid_b)
    assert pb.line()["mem_limit"] == 2 * 256 * MiB

    # gem-schd's socket is in no directory a container gets: in the GPU's socket directory, a container's root could
    # connect to it (a read-only mount does not stop connect()) and say hello as pod A's group
    gpu = node.inventory.gpus[0].uuid
    schd_sock = transport.scheduler_socket(node.layout.scheduler_root, gpu)
    assert schd_sock.is_socket()
    for opts in (opts_a, opts_b):
        for host_path, _ro in opts.mounts.values():
            assert not schd_sock.is_relative_to(host_path), (schd_sock, host_path)
    assert not any(transport.scheduler_socket(node.layout.ipc_root, gpu).parent.glob("gem-schd*"))

    # gem-ctl status names each group's pod (from the file gem-node keeps beside the GPU's config)
    state = node.agent.gpus[gpu]
    ctl = subprocess.run([sys.executable, "-m", "gemini.ctl", "--ipc-dir", node.layout.scheduler_root,
                          "--device-uuid", gpu,
                          "status", "--pods", str(state.pods_path)], capture_output=True, text=True, timeout=30)
    assert ctl.returncode == 0, ctl.stderr
    rows = {line.split()[0]: line.split()[1] for line in ctl.stdout.splitlines()[3:] if line.strip()}
    assert rows == {opts_a.envs["GEMINI_GROUP_NAME"]: "team-a/train/main",
                    opts_b.envs["GEMINI_GROUP_NAME"]: "team-b/infer/main"}, ctl.stdout

    # pod B's process names pod A's group: refused, whatever its env says
    intruder = start_client(c, procs, opts_b, uid_b, GEMINI_GROUP_NAME=opts_a.envs["GEMINI_GROUP_NAME"])
    reply = intruder.line()
    assert reply.get("type") != "HelloAck", reply
    # a process in no pod at all
    outsider = start_client(c, procs, opts_a, None)
    assert outsider.line().get("type") != "HelloAck"

    # pod B deleted: its pod manager stops, its group leaves gem-schd's config
    pb.close()
    c.delete_pod("team-b", "infer")
    group_b = opts_b.envs["GEMINI_GROUP_NAME"]
    sock_b = transport.group_socket(node.layout.ipc_root, group_b, node.inventory.gpus[0].uuid)
    node.wait(lambda: not sock_b.exists(), timeout=15, what="pod B's socket removed")
    node.wait(lambda: group_b not in state.config_path.read_text(), what="pod B's group out of the config")
    assert [p.pod for p, _ in state.groups.values()] == ["train"]

    # pod A's memory comes back when its process ends
    pa.close()
    again = start_client(c, procs, opts_a, uid_a)
    ack = again.line()
    assert ack["type"] == "HelloAck" and ack["mem_used"] == 0, ack
    assert again.ask(f"alloc {GiB}")["verdict"] == 0


# --- the real hook on the simulated driver -----------------------------------------------------------------------

UUID_PROBE = r"""
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
u = (ctypes.c_ubyte * 16)()
assert cu.cuDeviceGetUuid(u, 0) == 0
h = bytes(u).hex()
print(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
"""


def hook_has_sockets(hook) -> bool:
    """Whether this build of the hook reaches its pod manager through GEMINI_IPC_DIR (issue 15's hook side)."""
    return b"GEMINI_IPC_DIR" in Path(hook).read_bytes()


def device_uuid(env: dict) -> str:
    """The UUID of device 0 as the driver in `env` names it (the hook finds its socket directory by it)."""
    out = subprocess.run([sys.executable, "-c", UUID_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def share(result) -> float:
    out = result.json
    return out["onchip_ns"] / out["wall_ns"]


def test_hooked_workloads_get_their_shares_and_limits(sim, hook_lib, tmp_path):
    """Two pods' spin workloads, started with exactly their Allocate env (the hook preloaded from the mounted
    path), are held to their pods' caps and memory limits; a deleted pod's units and memory go to the next."""
    assert hook_has_sockets(hook_lib), f"{hook_lib} has no socket transport (GEMINI_IPC_DIR)"
    uuid = device_uuid(sim.env())
    with Cluster(tmp_path, (dv.Gpu(0, uuid, sim.mem_bytes),), hook_source=hook_lib) as c:
        print(f"identity through {c.cgroups.mode}")
        try:
            # 1 GiB simulated: 4 memory units; two pods of 2 units (512 MiB) each
            uid_a, a = c.admit_pod("team-a", "capped", {PCT: 10, MEM: 2}, {"gemini.io/max-util": "0.3"})
            uid_b, b = c.admit_pod("team-b", "wider", {PCT: 20, MEM: 2}, {"gemini.io/max-util": "0.6"})
            assert a.envs["LD_PRELOAD"] == dv.CONTAINER_HOOK
            argv = client_argv("pyclient.py", "--seconds", 4, "--kernel-us", 1000, "--sync-every", 1, "--meminfo",
                               "--alloc", "600MiB", "--json")
            runs = [start(c.in_pod(uid, argv), c.container_env(opts, sim.env())) for uid, opts in ((uid_a, a),
                                                                                                  (uid_b, b))]
            ra, rb = (finish(p, timeout=120) for p in runs)
            assert ra.rc == 0 and rb.rc == 0, (ra, rb)
            for r in (ra, rb):
                assert r.json["mem_total"] == 512 * MiB, r                  # the pod's limit is the device's size
                assert r.json["alloc"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY", r
            sa, sb = share(ra), share(rb)
            print(f"shares: capped at 0.3 -> {sa:.3f}, capped at 0.6 -> {sb:.3f}")
            assert sa < 0.4 and sb < 0.7 and sb > sa + 0.1, (sa, sb)

            # pod B deleted: its pod manager goes, its units and memory go to a new pod
            c.delete_pod("team-b", "wider")
            group_b = b.envs["GEMINI_GROUP_NAME"]
            state = c.node.agent.gpus[uuid]
            c.node.wait(lambda: group_b not in state.config_path.read_text(), what="pod B's group gone")
            uid_n, n = c.admit_pod("team-c", "next", {PCT: 20, MEM: 2})
            assert set(n.device_ids[MEM]) == set(b.device_ids[MEM])          # nothing else was free
            rn = finish(start(c.in_pod(uid_n, client_argv("pyclient.py", "--kernels", 10, "--alloc", "500MiB",
                                                          "--meminfo", "--json")),
                              c.container_env(n, sim.env())), timeout=60)
            assert rn.rc == 0 and rn.json["alloc"]["result"] == 0 and rn.json["mem_total"] == 512 * MiB, rn
        except BaseException:
            c.dump_logs()
            raise


# --- in a container's view of the files: the board, and settings the container cannot change -------------------

needs_mount_namespace = pytest.mark.skipif(not k8s_container.available(),
                                           reason="no mount namespace can be made here (root or user namespaces)")


def trainer(seconds: float) -> list[str]:
    """Always busy: 1 ms kernels, a synchronisation every 64."""
    return client_argv("workload-linked", "--kernel-us", 1000, "--json", "--seconds", seconds, "--sync-every", 64)


def requests(seconds: float) -> list[str]:
    """A request every 20 ms: two 0.5 ms kernels, then a synchronisation."""
    return client_argv("workload-linked", "--kernel-us", 500, "--json", "--seconds", seconds, "--period-us", 20000,
                       "--sync-every", 2)


def in_container(c: Cluster, sim, pod_uid: str, opts, argv: list, **env_changes):
    env = k8s_container.container_view_env(opts, sim.env())
    env.update({k: str(v) for k, v in env_changes.items()})
    return start(c.in_pod(pod_uid, k8s_container.container_argv(opts, argv)), env)


WRITE_PROBE = r"""
import glob, json, os, sys
def err(f):
    try:
        f()
        return 0
    except OSError as exc:
        return exc.errno
boards = sorted(glob.glob("/run/gemini/board/*/board-*"))
print(json.dumps({"boards": boards, "host_path_seen": os.path.exists(sys.argv[1]),
                  "board_rdwr": err(lambda: os.close(os.open(boards[0], os.O_RDWR))),
                  "settings_append": err(lambda: open(os.environ["GEMINI_TEST_SETTINGS_FILE"], "a").close())}))
"""


@needs_mount_namespace
def test_in_a_container_the_board_gives_continuations_and_latency_claims(test_hook_lib, tmp_path):
    """The hook in a container (its own /dev/shm; the daemons' directories only through its mounts) finds
    gem-schd's board page through the board directory gem-node mounts: a lone pod's slots are continued at their
    deadlines instead of drained, and a latency pod's claims pause a batch pod's
    launches (or hold its queue on the GPU)."""
    sim = Sim(tmp_path / "sim", test_hook_lib)
    uuid = device_uuid(sim.env())
    with Cluster(tmp_path, (dv.Gpu(0, uuid, sim.mem_bytes),), hook_source=test_hook_lib) as c:
        try:
            uid_t, t = c.admit_pod("team-a", "train", {PCT: 10, MEM: 2})
            # the container sees the board only where it is mounted, and can write neither it nor its settings
            # (even as root): it cannot write claims or continuations for other pods
            board_dir = c.node.layout.board_dir(uuid)
            probe = finish(in_container(c, sim, uid_t, t, [sys.executable, "-c", WRITE_PROBE, board_dir]), 30)
            seen = json.loads(probe.out)
            assert seen["boards"] == [f"{dv.CONTAINER_BOARD_ROOT}/{uuid}/{n}" for n in os.listdir(board_dir)], seen
            assert len(seen["boards"]) == 1 and not seen["host_path_seen"], seen
            assert seen["board_rdwr"] == seen["settings_append"] == errno.EROFS, seen

            alone = finish(in_container(c, sim, uid_t, t, trainer(1.5)), timeout=60)
            assert alone.rc == 0, alone
            st = sim.stats_of(alone.json["pid"])
            # 1.5 s of 20 ms slots: continued at nearly every deadline (a late timer may miss one)
            assert st["continuations"] >= 50 and st["drains"] <= 8, st

            uid_l, lat = c.admit_pod("team-b", "serve", {PCT: 50, MEM: 1}, {"gemini.io/class": "latency"})
            train = in_container(c, sim, uid_t, t, trainer(3.0))
            time.sleep(0.5)
            serve = finish(in_container(c, sim, uid_l, lat, requests(2.0)), timeout=60)
            trained = finish(train, timeout=60)
            assert serve.rc == 0 and trained.rc == 0, (serve, trained)
            assert serve.json["requests"] >= 50, serve
            st = sim.stats_of(trained.json["pid"])
            # ~100 requests, each a claim that the trainer's hook sees on the board and pauses for, on the host or
            # at its stream's wait on the GPU (a thread blocked on a marker never sees the claim on the host)
            assert held_for_claims(st) >= 20, st
        except BaseException:
            c.dump_logs()
            raise


@needs_mount_namespace
def test_in_a_container_the_environment_cannot_switch_the_hook_off(test_hook_lib, tmp_path, backends):
    """The hook in a container takes its settings from the read-only file gem-node mounts: GEMINI_DISABLE=1, or
    GEMINI_IPC_DIR and GEMINI_GROUP_NAME naming a pod manager the container started itself, leave the process
    held to its pod's memory limit. The control: the same process with no settings file is ungated."""
    sim = Sim(tmp_path / "sim", test_hook_lib)
    uuid = device_uuid(sim.env())
    with Cluster(tmp_path, (dv.Gpu(0, uuid, sim.mem_bytes),), hook_source=test_hook_lib) as c:
        try:
            uid, opts = c.admit_pod("team-a", "train", {PCT: 10, MEM: 2})          # 512 MiB
            group = opts.envs["GEMINI_GROUP_NAME"]
            # a pod manager of the container's own, for a group of the same name with all the memory
            own = backends([Group(group, mem_limit="1GiB")], transport="ipc")
            argv = client_argv("pyclient.py", "--kernels", 2, "--alloc", "600MiB", "--meminfo", "--json")
            attempts = {"GEMINI_DISABLE": {"GEMINI_DISABLE": 1},
                        "GEMINI_FAIL_OPEN": {"GEMINI_FAIL_OPEN": 1, "GEMINI_IPC_DIR": tmp_path / "nothing"},
                        "own pod manager": {"GEMINI_IPC_DIR": own.ipc_dir, "GEMINI_GROUP_NAME": group}}
            for what, env in attempts.items():
                r = finish(in_container(c, sim, uid, opts, argv, **env), timeout=60)
                assert r.rc == 0, (what, r)
                assert r.json["mem_total"] == 512 * MiB, (what, r)                  # its pod's limit
                assert r.json["alloc"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY", (what, r)
            # the control: without the settings file the environment wins and the process is ungated
            r = finish(in_container(c, sim, uid, opts, argv, GEMINI_DISABLE=1,
                                    GEMINI_TEST_SETTINGS_FILE=tmp_path / "absent.conf"), timeout=60)
            assert r.rc == 0 and r.json["alloc"]["result"] == 0, r
        except BaseException:
            c.dump_logs()
            raise
