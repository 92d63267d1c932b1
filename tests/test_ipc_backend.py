"""launch-backend on the socket transport, run as a user runs it: no TCP port, sockets with the config's owners and
modes, gem-ctl and launch-command through --ipc-dir, and a dead pod manager's socket that only its restart can
take back.

Processes that must be refused run as uid 65534 (see tests/test_transport.py); the backend lives in a 0755
directory under /tmp so that they can reach it at all.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.harness import LAUNCH_COMMAND, REPO_ROOT, Backend
from gemini import transport
from gemini.wire import hook as hp
from pmgr_helpers import BlockingHook
from test_security import clean_env, listening_sockets
from tests.peer_fixtures import NOBODY, as_nobody, needs_root

CONFIG = textwrap.dedent(f"""
    [a]
    MaxUtil = 1
    MemoryLimit = 64MiB
    SocketMode = 0640

    [b]
    MemoryLimit = 32MiB
    SocketOwner = {NOBODY}
    SocketGroup = {NOBODY}
""")


@pytest.fixture
def ipc_backend(public_dir):
    config = public_dir / "resource-config.txt"
    config.write_text(CONFIG)
    be = Backend(public_dir / "be", config=config, quota_ms=20, min_quota_ms=5, window_ms=1000, env=clean_env(),
                 transport="ipc", ipc_dir=public_dir / "ipc")
    be.start()
    try:
        yield be
    finally:
        be.stop()


def mode_owner(path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_the_socket_transport_opens_no_port_and_gives_each_socket_its_owner_and_mode(ipc_backend, tmp_path):
    be = ipc_backend
    daemons = be.daemon_pids()
    assert set(daemons) == {"gem-schd", "a", "b"}
    for pid in daemons.values():
        assert listening_sockets(pid) == [], f"pid {pid} listens on TCP"
    d = transport.gpu_dir(be.ipc_dir)
    assert be.ports == {"a": str(d / "group.a.sock"), "b": str(d / "group.b.sock")}
    assert mode_owner(d / "gem-schd.sock") == (0o600, os.geteuid(), os.getegid())
    assert mode_owner(d / "group.a.sock") == (0o640, os.geteuid(), os.getegid())
    assert mode_owner(d / "group.b.sock") == (0o660, NOBODY, NOBODY)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755 and stat.S_IMODE(be.ipc_dir.stat().st_mode) == 0o755
    # gem-ctl finds gem-schd there
    res = subprocess.run([sys.executable, "-m", "gemini.ctl", *be.where_args(), "status", "--json"],
                         env=clean_env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert [g["name"] for g in json.loads(res.stdout)["groups"]] == ["a", "b"]
    # launch-command greets the group's pod manager there, and tells the program's hook where it is
    dump = tmp_path / "env.json"
    fake_hook = tmp_path / "libgemhook.so.1"
    fake_hook.write_bytes(b"not a library")
    script = f"import json, os; json.dump(dict(os.environ), open({str(dump)!r}, 'w'))"
    res = subprocess.run([sys.executable, str(LAUNCH_COMMAND), "--name", "a", "--ipc-dir", str(be.ipc_dir), "--",
                          sys.executable, "-c", script],
                         env=clean_env(GEMINI_HOOK_LIB=str(fake_hook), POD_MANAGER_PORT="1"),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    env = json.loads(dump.read_text())
    assert env["GEMINI_IPC_DIR"] == str(be.ipc_dir) and env["GEMINI_GROUP_NAME"] == "a" and env["POD_NAME"] == "a"
    assert "POD_MANAGER_PORT" not in env and "GEMINI_POD_MANAGER_PORT" not in env


def in_child_as_nobody(fn):
    """fn() in a forked child that has dropped to uid/gid 65534; its result (JSON-able) or its error text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:    # the child: no pytest, no threads of ours, only fn
        try:
            os.close(r)
            as_nobody()
            try:
                out = {"ok": fn()}
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@needs_root
def test_launch_command_says_why_a_socket_is_refused(ipc_backend):
    """uid 65534 may open b's socket, not a's: launch-command's handshake tells it so before running anything."""
    from gemini.launch import command
    be = ipc_backend

    def greet(group):
        return lambda: command.handshake("", 0, group, 5, command.group_socket_for(str(be.ipc_dir), group, None)).group

    assert in_child_as_nobody(greet("b")) == {"ok": "b"}
    refused = in_child_as_nobody(greet("a"))["error"]
    assert f"this user (uid {NOBODY}) may not open" in refused and "group.a.sock" in refused, refused


TAKE_OVER = textwrap.dedent('''
    import json, os, socket, sys
    path = sys.argv[1]
    out = {}
    try:
        os.unlink(path)
        out["unlink"] = "ok"
    except OSError as exc:
        out["unlink"] = exc.errno
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path + ".mine")
        out["bind"] = "ok"
    except OSError as exc:
        out["bind"] = exc.errno
    try:
        os.rename(path + ".mine", path)
        out["rename"] = "ok"
    except OSError as exc:
        out["rename"] = exc.errno
    print(json.dumps(out))
''')


def test_a_dead_pod_managers_socket_is_reclaimed_by_its_restart_and_nobody_else_can_take_it(
        ipc_backend, nobody_python):
    be = ipc_backend
    path = Path(be.ports["b"])
    before = os.lstat(path)
    pid = be.daemon_pids()["b"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while transport.socket_in_use(path):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # the dead pod manager's socket is still there, and uid 65534 (who may even connect to it) cannot replace it
    assert os.path.lexists(path)
    res = subprocess.run([nobody_python, "-c", TAKE_OVER, str(path)], capture_output=True, text=True, timeout=30,
                         preexec_fn=as_nobody, cwd="/")
    assert json.loads(res.stdout) == {"unlink": 13, "bind": 13, "rename": 2}, res.stderr   # EACCES, EACCES, ENOENT
    # launch-backend restarts it: a new socket, with the same owner and mode
    deadline = time.monotonic() + 15
    while not (transport.socket_in_use(path) and be.daemon_pids().get("b") not in (None, pid)):
        assert time.monotonic() < deadline, be.logs()
        time.sleep(0.05)
    after = os.lstat(path)
    assert after.st_ino != before.st_ino
    assert mode_owner(path) == (0o660, NOBODY, NOBODY)
    hook = BlockingHook(path)
    try:
        ack = hook.call(hp.Hello(pid=os.getpid(), pod_name="b"))
        assert isinstance(ack, hp.HelloAck) and ack.mem_limit == 32 << 20, ack
        assert isinstance(hook.call(hp.TokenRequest()), hp.TokenGrant)
    finally:
        hook.close()


def test_a_socket_mode_edit_applies_at_once_and_survives_a_restart(ipc_backend):
    be = ipc_backend
    path = Path(be.ports["a"])
    assert mode_owner(path)[0] == 0o640
    new = be.config_path.with_name("new")
    new.write_text(CONFIG.replace("SocketMode = 0640", "SocketMode = 0600"))
    os.replace(new, be.config_path)
    deadline = time.monotonic() + 10
    while mode_owner(path)[0] != 0o600:
        assert time.monotonic() < deadline, be.logs()
        time.sleep(0.05)
    pid = be.daemon_pids()["a"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while not (transport.socket_in_use(path) and be.daemon_pids().get("a") not in (None, pid)):
        assert time.monotonic() < deadline, be.logs()
        time.sleep(0.05)
    assert mode_owner(path)[0] == 0o600


def test_a_group_added_by_an_edit_gets_its_socket_and_a_removed_one_loses_it(ipc_backend):
    be = ipc_backend
    d = transport.gpu_dir(be.ipc_dir)
    new = be.config_path.with_name("new")
    new.write_text(CONFIG.replace("[b]", "[c/d]\nSocketMode = 0600\n[b]").replace(
        "[a]\nMaxUtil = 1\nMemoryLimit = 64MiB\nSocketMode = 0640\n", ""))
    os.replace(new, be.config_path)
    added = d / "group.c%2Fd.sock"
    deadline = time.monotonic() + 15
    while not transport.socket_in_use(added) or os.path.lexists(d / "group.a.sock"):
        assert time.monotonic() < deadline, be.logs()
        time.sleep(0.05)
    assert mode_owner(added)[0] == 0o600
    hook = BlockingHook(added)
    try:
        assert isinstance(hook.call(hp.Hello(pid=os.getpid(), pod_name="c/d")), hp.HelloAck)
    finally:
        hook.close()


def test_two_backends_on_two_gpus_share_one_directory(public_dir):
    """One backend per GPU, each in its GPU's subdirectory of the same --ipc-dir; a third for a GPU already served
    is refused with a clear message."""
    config = public_dir / "rc.txt"
    config.write_text("[g]\nMemoryLimit = 1MiB\n")
    ipc = public_dir / "ipc"
    kw = dict(config=config, quota_ms=20, min_quota_ms=5, window_ms=1000, env=clean_env(), transport="ipc",
              ipc_dir=ipc)
    with Backend(public_dir / "be0", device_uuid="GPU-0000", **kw) as be0, \
            Backend(public_dir / "be1", device_uuid="GPU-1111", **kw) as be1:
        assert be0.ports["g"] == str(ipc / "GPU-0000" / "group.g.sock")
        assert be1.ports["g"] == str(ipc / "GPU-1111" / "group.g.sock")
        for be, uuid in ((be0, "GPU-0000"), (be1, "GPU-1111")):
            hook = BlockingHook(be.ports["g"])
            try:
                wrong = hook.call(hp.Hello(pid=1, pod_name="g", device_uuid="GPU-9999"))
                assert isinstance(wrong, hp.Error) and wrong.code == hp.ErrorCode.DEVICE_MISMATCH
            finally:
                hook.close()
            hook = BlockingHook(be.ports["g"])
            try:
                assert isinstance(hook.call(hp.Hello(pid=1, pod_name="g", device_uuid=uuid)), hp.HelloAck)
            finally:
                hook.close()
        third = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "launch-backend.py"), "--config",
                                str(config), "--ipc-dir", str(ipc), "--device-uuid", "GPU-1111"], env=clean_env(),
                               capture_output=True, text=True, timeout=60)
        assert third.returncode == 2 and "a gem-schd already listens on" in third.stderr, third.stderr


def test_launch_backend_refuses_an_ipc_dir_others_could_write(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    config = tmp_path / "rc.txt"
    config.write_text("[g]\n")
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "launch-backend.py"), "--config", str(config),
                          "--ipc-dir", str(loose / "ipc")], env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and f"{loose} is writable by others" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "launch-backend.py"), "--config", str(config),
                          "--ipc-dir", str(tmp_path), "--port", "5000"], env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "choose one transport" in res.stderr


def test_a_hook_protocol_client_gets_tokens_through_both_daemons_over_sockets(ipc_backend):
    be = ipc_backend
    hook = BlockingHook(be.ports["a"])
    try:
        assert isinstance(hook.call(hp.Hello(pid=os.getpid(), pod_name="a")), hp.HelloAck)
        for _ in range(5):
            grant = hook.call(hp.TokenRequest())
            assert isinstance(grant, hp.TokenGrant), grant
            assert isinstance(hook.call(hp.TokenRelease(token_seq=grant.token_seq)), hp.Ack)
        assert hook.call(hp.MemAlloc(bytes=1 << 20)).verdict == hp.MemVerdict.OK
    finally:
        hook.close()


def test_an_authorizer_given_on_the_command_line_judges_every_process(tmp_path):
    config = tmp_path / "rc.txt"
    config.write_text("[g]\n")
    with Backend(tmp_path / "be", config=config, quota_ms=20, min_quota_ms=5, env=clean_env(), transport="ipc",
                 extra_args=["--pmgr-arg=--authorizer=tests.peer_fixtures:RefuseAll"]) as be:
        hook = BlockingHook(be.ports["g"])
        try:
            reply = hook.call(hp.Hello(pid=1, pod_name="g"))
        finally:
            hook.close()
        assert isinstance(reply, hp.Error) and reply.code == hp.ErrorCode.REFUSED, reply
        assert reply.message == f"pid {os.getpid()} uid {os.geteuid()} may not join 'g' (test authorizer)"
    res = subprocess.run([sys.executable, "-m", "gemini.podmgr.cli", "--name", "g", "--ipc-dir", str(tmp_path / "x"),
                          "--authorizer", "tests.peer_fixtures:NoSuchThing"], env=clean_env(), capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and "--authorizer 'tests.peer_fixtures:NoSuchThing': AttributeError" in res.stderr


def test_the_real_hook_of_a_user_without_the_socket_cannot_join_whatever_it_claims(ipc_backend, public_dir):
    """A CUDA program run as uid 65534 with GEMINI_GROUP_NAME=a: its hook cannot open a's socket (root's, 0640),
    so its CUDA calls fail with the reason, and it never runs on a's time. With GEMINI_GROUP_NAME=b (whose socket
    is 65534's) the same program runs."""
    from gemini.hookpath import hook_path
    import native
    native.build_native()
    be = ipc_backend
    shm_dir = public_dir / "sim"
    shm_dir.mkdir(mode=0o777)
    os.chmod(shm_dir, 0o777)
    out = {}
    for group in ("a", "b"):
        env = native.sim_env(shm_dir / f"shm-{group}", extra={
            "LD_PRELOAD": str(hook_path()), "GEMINI_IPC_DIR": str(be.ipc_dir), "GEMINI_GROUP_NAME": group,
            "GEMINI_CONNECT_TIMEOUT_MS": "500"})
        out[group] = subprocess.run(native.client_cmd("workload-procaddr", "--kernels", "4", "--json"), env=env,
                                    capture_output=True, text=True, timeout=60, preexec_fn=as_nobody, cwd="/")
    assert out["b"].returncode == 0, out["b"].stderr
    assert out["a"].returncode == 1, out["a"].stderr
    assert f"permission denied: this user (uid {NOBODY}) may not open the group's socket" in out["a"].stderr
    assert "group.a.sock" in out["a"].stderr
