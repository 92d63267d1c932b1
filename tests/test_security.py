"""Security properties of the running system (real daemons, the real hook on the simulated driver).

- every daemon listens on loopback unless told otherwise, and an explicit --ip elsewhere logs a warning;
- a client acts only for its pod manager's group: it cannot join another group, raise its limit, free another
  client's memory or end another client's slot;
- the launch tools never pass user strings through a shell (argv and group names with shell metacharacters
  arrive verbatim, nothing is executed);
- files are created with safe modes (GEMINI_STATS_FILE 0600; logs not world-writable).

There is no authentication between local processes: anyone who can reach the loopback ports can speak both
protocols (docs/reliability.md says so); these tests check what the daemons themselves enforce.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import (LAUNCH_BACKEND, LAUNCH_COMMAND, REPO_ROOT, Backend, Group, children_of, cmdline,
                           free_port_base, read_stats)
from gemini.wire import hook as hp
from gemini.hookpath import hook_path
from gemini.wire.sched import StatusReply, StatusRequest
from tests.schd_inproc import FakePodManager
import native

MiB = 1 << 20
LIMIT_A = 64 * MiB


# --- listening sockets -------------------------------------------------------------------------------------------

def _decode_addr(hexaddr: str, v6: bool) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if v6:      # four 32-bit words, each in host (little-endian) order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return str(ipaddress.IPv6Address(raw)), int(port, 16)
    return str(ipaddress.IPv4Address(raw[::-1])), int(port, 16)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:      # TCP_LISTEN
                out.append(_decode_addr(parts[1], v6))
    return out


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)




def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GEMINI_", "SIMCUDA_")) and k not in
           ("LD_PRELOAD", "POD_NAME", "POD_MANAGER_IP", "POD_MANAGER_PORT", "SCHEDULER_IP", "SCHEDULER_PORT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


def wait_until(predicate, timeout: float = 15.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(step)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    native.build_native()
    tmp = tmp_path_factory.mktemp("security")
    be = Backend(tmp / "be", [Group("a", 0.0, 1.0, f"{LIMIT_A}"), Group("b", 0.0, 1.0, "1GiB")],
                 quota_ms=500, min_quota_ms=500, window_ms=10000, env=clean_env())
    be.start()
    try:
        yield be
    finally:
        be.stop()


def test_every_daemon_listens_on_loopback_by_default(backend):
    daemons = children_of(backend.proc.pid)
    assert len(daemons) == 3
    for pid in daemons:
        sockets = listening_sockets(pid)
        assert sockets, f"{cmdline(pid)} listens on nothing?"
        assert all(is_loopback(addr) for addr, _ in sockets), (cmdline(pid), sockets)
        assert "--ip" in cmdline(pid) and cmdline(pid)[cmdline(pid).index("--ip") + 1] == "127.0.0.1"


DAEMONS = {
    "gem-schd": lambda port, extra: [sys.executable, "-m", "gemini.scheduler.cli", "-P", str(port),
                                     "--log-level", "info", *extra],
    "gem-pmgr": lambda port, extra: [sys.executable, "-m", "gemini.podmgr.cli", "--name", "a", "--port", str(port),
                                     "--scheduler-port", str(free_port_base(1)), "-v", *extra],
}


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
@pytest.mark.parametrize("ip", [None, "0.0.0.0"], ids=["default", "explicit-wildcard"])
def test_daemon_binds_loopback_unless_told_and_warns_when_told(tmp_path, daemon, ip):
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    port = free_port_base(1)
    argv = DAEMONS[daemon](port, ["--ip", ip] if ip else [])
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, cwd=tmp_path, env=clean_env())
    try:
        sockets = wait_until(lambda: [s for s in listening_sockets(proc.pid) if s[1] == port]
                             or proc.poll() is not None)
        assert proc.poll() is None, log.read_text()
        warning = "which is not a loopback address"
        if ip is None:
            assert all(is_loopback(addr) for addr, _ in listening_sockets(proc.pid)), sockets
            assert warning not in log.read_text()
        else:
            assert sockets == [(ip, port)]
            wait_until(lambda: warning in log.read_text(), 5)
    finally:
        proc.terminate()
        proc.wait(10)


def test_metrics_endpoint_listens_on_loopback_by_default(tmp_path):
    pytest.importorskip("prometheus_client")
    (tmp_path / "resource-config.txt").write_text("[a]\n")
    port = free_port_base(2)
    metrics = port + 1
    proc = subprocess.Popen([sys.executable, "-m", "gemini.scheduler.cli", "-P", str(port), "--metrics-port",
                             str(metrics)], cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(p == metrics for _, p in listening_sockets(proc.pid)) or proc.poll() is not None)
        assert proc.poll() is None
        assert all(is_loopback(addr) for addr, _ in listening_sockets(proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)


# --- a client acts only for its own group -------------------------------------------------------------------------

class Hook:
    """A protocol-speaking client (a hook without the CUDA program)."""

    def __init__(self, port: int, group: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.seq = 0
        self.ack = self.call(hp.Hello(pid=os.getpid(), pod_name=group))

    def send_raw(self, msg: hp.Message) -> None:
        self.seq += 1
        self.sock.sendall(hp.encode(msg, self.seq))

    def read(self):
        buf = b""
        while len(buf) < hp.MSG_SIZE:
            chunk = self.sock.recv(hp.MSG_SIZE - len(buf))
            if not chunk:
                return None
            buf += chunk
        return hp.decode(buf, hp.PMGR_TO_HOOK)

    def call(self, msg: hp.Message) -> hp.Message | None:
        self.send_raw(msg)
        while True:
            got = self.read()
            if got is None or got[0] == self.seq:
                return None if got is None else got[1]

    def close(self) -> None:
        self.sock.close()


def group_status(be: Backend) -> dict:
    with FakePodManager(f"tcp://127.0.0.1:{be.port}") as peer:
        reply = peer.request(StatusRequest(), 5)
    assert isinstance(reply, StatusReply)
    return {g["name"]: g for g in reply.groups}


def test_a_client_cannot_join_another_group(backend):
    wrong = socket.create_connection(("127.0.0.1", backend.ports["b"]), timeout=5)
    try:
        wrong.sendall(hp.encode(hp.Hello(pid=os.getpid(), pod_name="a"), 1))
        seq, reply = hp.decode(wrong.recv(hp.MSG_SIZE, socket.MSG_WAITALL), hp.PMGR_TO_HOOK)
        assert isinstance(reply, hp.Error) and reply.code == hp.ErrorCode.GROUP_MISMATCH, reply
        assert wrong.recv(1) == b""          # and the connection is closed
    finally:
        wrong.close()


def test_the_real_hook_is_refused_by_another_groups_pod_manager(backend, tmp_path):
    env = native.sim_env(tmp_path / "shm", extra={"LD_PRELOAD": str(hook_path()), "POD_NAME": "a",
                                                 "POD_MANAGER_PORT": str(backend.ports["b"])})
    res = subprocess.run(native.client_cmd("workload-procaddr", "--kernels", "4", "--json"), env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1, res.stderr
    assert "refused this process" in res.stderr and "serves group 'b', not 'a'" in res.stderr, res.stderr


def test_a_client_cannot_free_anothers_memory_nor_raise_its_limit(backend):
    port = backend.ports["a"]
    owner, other = Hook(port, "a"), Hook(port, "a")
    try:
        assert owner.call(hp.MemAlloc(bytes=1000)).verdict == hp.MemVerdict.OK
        for amount in (1000, 2**64 - 1):
            reply = other.call(hp.MemFree(bytes=amount))      # frees only what it holds itself: nothing
            assert isinstance(reply, hp.MemReply) and reply.used == 1000, reply
        denied = other.call(hp.MemAlloc(bytes=LIMIT_A))
        assert denied.verdict == hp.MemVerdict.DENIED and denied.used == 1000 and denied.limit == LIMIT_A
        # no message raises a limit: a MEM_REPLY (a pod manager's message) from a client is a protocol error
        other.send_raw(hp.MemReply(verdict=0, used=0, limit=2**63))
        got = other.read()
        assert got is not None and isinstance(got[1], hp.Error) and got[1].code == hp.ErrorCode.PROTOCOL, got
        assert other.read() is None
        info = owner.call(hp.MemInfo())
        assert info.limit == LIMIT_A and info.used == 1000
        assert group_status(backend)["a"]["mem_limit"] == LIMIT_A
    finally:
        owner.close()
        other.close()
    assert wait_until(lambda: (lambda h: (h.call(hp.MemInfo()).used == 0, h.close())[0])(Hook(port, "a")), 5)


def test_a_client_cannot_end_anothers_slot(backend):
    port = backend.ports["b"]
    holder, other = Hook(port, "b"), Hook(port, "b")
    try:
        grant = holder.call(hp.TokenRequest())
        assert isinstance(grant, hp.TokenGrant), grant
        # the other client "releases" the token it was never given: only its own (empty) share goes
        assert isinstance(other.call(hp.TokenRelease(token_seq=grant.token_seq)), hp.Ack)
        time.sleep(0.05)
        assert group_status(backend)["b"]["holding"], "another client's release ended the holder's slot"
        assert isinstance(holder.call(hp.TokenRelease(token_seq=grant.token_seq)), hp.Ack)
        wait_until(lambda: not group_status(backend)["b"]["holding"], 2)     # the holder's own release does
    finally:
        holder.close()
        other.close()


# --- no shell ------------------------------------------------------------------------------------------------------

SHELLY = ["$(touch pwned1)", "`touch pwned2`", "; touch pwned3", "| touch pwned4", "&& touch pwned5",
          "> pwned6", "$HOME", "'quoted'", '"dq"', "a\nb", "*", "-- --name x"]


def test_launch_command_passes_argv_verbatim(backend, tmp_path):
    out = tmp_path / "argv.json"
    script = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"
    res = subprocess.run([sys.executable, str(LAUNCH_COMMAND), "--name", "a", "--port", str(backend.ports["a"]),
                          "--", sys.executable, "-c", script, str(out), *SHELLY],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == SHELLY
    assert not list(tmp_path.glob("pwned*"))


NASTY_GROUPS = ["$(touch${IFS}pwned7)", "`touch${IFS}pwned8`", "a|touch>pwned9", "x&&touch${IFS}pwned10",
                "'\"$PATH\"'"]


def test_launch_backend_passes_group_names_verbatim(tmp_path):
    config = tmp_path / "resource-config.txt"
    config.write_text("".join(f"[{name}]\n" for name in NASTY_GROUPS))
    port = free_port_base(len(NASTY_GROUPS) + 2)
    proc = subprocess.Popen([sys.executable, str(LAUNCH_BACKEND), "--config", str(config), "--port", str(port),
                             "--log-dir", str(tmp_path / "logs")], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        while "ready" not in lines:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line.rstrip("\n"))
        table = {line.rsplit(None, 1)[0].strip(): int(line.rsplit(None, 1)[1]) for line in lines[2:-1]}
        assert table == {name: port + i for i, name in enumerate(NASTY_GROUPS, 1)}
        names = {cmdline(pid)[cmdline(pid).index("--name") + 1] for pid in children_of(proc.pid)
                 if "--name" in cmdline(pid)}
        assert names == set(NASTY_GROUPS)
        for name, gport in table.items():
            hook = Hook(gport, name)
            assert isinstance(hook.ack, hp.HelloAck) and hook.ack.group == name, hook.ack
            hook.close()
        # one log per daemon, all directly inside --log-dir whatever the names hold
        logs = sorted((tmp_path / "logs").iterdir())
        assert len(logs) == len(NASTY_GROUPS) + 1 and all(p.is_file() and p.parent == tmp_path / "logs"
                                                          for p in logs)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    assert not list(tmp_path.glob("pwned*"))


def test_launch_backend_keeps_logs_inside_the_log_dir(tmp_path):
    logs = tmp_path / "logs"
    (logs / "gem-pmgr-x").mkdir(parents=True)
    config = tmp_path / "resource-config.txt"
    config.write_text("[x/../../escaped]\n[y/z]\n")
    proc = subprocess.Popen([sys.executable, str(LAUNCH_BACKEND), "--config", str(config), "--port",
                             str(free_port_base(4)), "--log-dir", str(logs)], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while True:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]     # it must come up, not crash on the names
            if line.strip() == "ready":
                break
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert not (tmp_path / "escaped.log").exists(), "a log file was written outside --log-dir"
    assert "Traceback" not in err, err[-2000:]
    pmgr_logs = [p for p in logs.iterdir() if p.is_file() and p.name.startswith("gem-pmgr-")]
    assert len(pmgr_logs) == 2, sorted(p.name for p in logs.iterdir())


# --- file modes ------------------------------------------------------------------------------------------------------

def test_stats_file_is_private_whatever_the_umask(backend, tmp_path):
    stats = tmp_path / "stats.txt"
    env = native.sim_env(tmp_path / "shm", extra={"GEMINI_STATS_FILE": str(stats), "PYTHONPATH": str(REPO_ROOT)})
    res = subprocess.run(backend.command("b", native.client_cmd("workload-procaddr", "--kernels", "4")), env=env,
                         capture_output=True, text=True, timeout=30, preexec_fn=lambda: os.umask(0))
    assert res.returncode == 0, res.stderr
    assert read_stats(stats), "no statistics written"
    assert stats.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("umask", [
    0o022, 0o002,
    pytest.param(0o000),
], ids=["umask022", "umask002", "umask000"])
def test_logs_are_not_world_writable(tmp_path, umask):
    config = tmp_path / "resource-config.txt"
    config.write_text("[a]\n")
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(LAUNCH_BACKEND), "--config", str(config), "--port",
                             str(free_port_base(3)), "--log-dir", str(logs)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: os.umask(umask))
    try:
        while proc.stdout.readline().strip() != "ready":
            assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
    paths = [logs, *logs.iterdir()]
    assert len(paths) == 3
    loose = {str(p): oct(p.stat().st_mode & 0o777) for p in paths if p.stat().st_mode & 0o002}
    assert not loose, f"world-writable: {loose}"
