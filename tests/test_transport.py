"""The socket transport and peer identity (gemini/transport.py, gemini/peercred.py, the pod manager's peer handling,
gem-schd's bounds on what it is told), in-process and with child processes of other uids.

The tests run as root, which passes every file permission check. Where a test needs a process that may NOT open a
socket, it starts a child that drops to uid/gid 65534 (nobody) with os.setuid in preexec_fn, so the kernel itself
judges the permissions. Such a child needs a path it can search: `public_dir` is a 0755 directory under /tmp.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gemini import transport
from gemini.peercred import PeerCredentials, peer_credentials
from gemini.podmgr.admission import Admission, Limits
from gemini.podmgr.server import MAX_REPORT_NS, PodManagerServer, bounded
from gemini.wire import hook as hp
from gemini.wire import sched as sm
from pmgr_helpers import AsyncHook, BlockingHook, eventually, running_pmgr
from tests.peer_fixtures import NOBODY, as_nobody, needs_root

GROUP = "g"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


CONNECT_AND_HELLO = textwrap.dedent('''
    import json, os, socket, struct, sys
    path, group = sys.argv[1], sys.argv[2]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
    except OSError as exc:
        print(json.dumps({"connected": False, "errno": exc.errno})); sys.exit(0)
    frame = bytearray(256)
    struct.pack_into("<IHHII", frame, 0, 0x314d4547, 1, 1, 256, 1)     # HELLO, seq 1
    struct.pack_into("<ii", frame, 16, os.getpid(), 0)
    frame[40:40 + len(group)] = group.encode()
    try:
        s.sendall(frame)
    except OSError:         # refused at once: the pod manager's answer may still be there to read
        pass
    reply = b""
    while len(reply) < 256:
        try:
            chunk = s.recv(256 - len(reply))
        except OSError:
            break
        if not chunk:
            break
        reply += chunk
    kind = struct.unpack_from("<H", reply, 6)[0] if len(reply) == 256 else None
    print(json.dumps({"connected": True, "reply_type": kind}), flush=True)
    if "--hold" in sys.argv:
        sys.stdin.read()
''')


def child_hello(path: Path, group: str, *, nobody: str | None = None, hold: bool = False) -> subprocess.Popen:
    """A child that connects to `path` and says HELLO for `group`; `nobody`: a Python to run it as uid 65534."""
    return subprocess.Popen([nobody or sys.executable, "-c", CONNECT_AND_HELLO, str(path), group]
                            + (["--hold"] if hold else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=as_nobody if nobody else None)


# --- layout and directories -----------------------------------------------------------------------------

def test_group_names_become_distinct_file_names_inside_the_gpu_directory(tmp_path):
    names = ["a", "a/b", "../x", "..", ".", "a%2Fb", "$(id)", "Ab-_.9", "x y"]
    paths = [transport.group_socket(tmp_path, n, "GPU-1234") for n in names]
    assert len(set(paths)) == len(names)
    for p in paths:
        assert p.parent == tmp_path / "GPU-1234" and p.name.startswith("group.") and "/" not in p.name
    assert transport.group_socket(tmp_path, "a/b").name == "group.a%2Fb.sock"
    assert transport.group_socket(tmp_path, "a%2Fb").name == "group.a%252Fb.sock"
    assert transport.scheduler_socket(tmp_path) == tmp_path / "default" / "gem-schd.sock"
    with pytest.raises(transport.TransportError):
        transport.gpu_dir(tmp_path, "../etc")


def test_ensure_socket_dir_creates_0755_and_refuses_dirs_others_could_write(public_dir):
    old = os.umask(0o002)
    try:
        made = transport.ensure_socket_dir(public_dir / "ipc", "GPU-1")
    finally:
        os.umask(old)
    assert made == public_dir / "ipc" / "GPU-1"
    for d in (public_dir / "ipc", made):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
    loose = public_dir / "loose"
    loose.mkdir()
    os.chmod(loose, 0o775)
    with pytest.raises(transport.TransportError, match="writable by its group"):
        transport.ensure_socket_dir(loose / "ipc")
    os.chmod(loose, 0o757)
    with pytest.raises(transport.TransportError, match="writable by others"):
        transport.ensure_socket_dir(loose / "ipc")
    os.chmod(loose, 0o1777)         # sticky, as /tmp: others cannot move what is ours
    transport.ensure_socket_dir(loose / "ipc")


@needs_root
def test_a_directory_owned_by_someone_else_is_refused(public_dir):
    theirs = public_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(transport.TransportError, match=f"belongs to uid {NOBODY}"):
        transport.ensure_socket_dir(theirs / "ipc")
    # a symlink planted by someone else is refused too, whatever it points at
    link = public_dir / "link"
    link.symlink_to(public_dir)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(transport.TransportError, match="belongs to uid"):
        transport.ensure_socket_dir(link / "ipc")


def test_long_socket_paths_work_through_the_directory_descriptor(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = transport.group_socket(deep, "g" * 60)
    assert len(str(path)) > transport.MAX_SUN_PATH
    transport.ensure_socket_dir(deep)
    srv = transport.bind_unix(path, transport.SocketAccess())
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        cli = transport.connect_unix(path, 2)
        conn, _ = srv.accept()
        assert peer_credentials(conn) == PeerCredentials(os.getpid(), os.geteuid(), os.getegid())
        cli.close()
        conn.close()
    finally:
        srv.close()


def test_bind_unix_sets_the_mode_replaces_a_dead_socket_and_refuses_a_live_one(tmp_path):
    d = transport.ensure_socket_dir(tmp_path)
    path = d / "group.x.sock"
    # a socket file left by a process that is gone
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    srv = transport.bind_unix(path, transport.SocketAccess(mode=0o640))
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o640
        assert not [p for p in d.iterdir() if p.name.endswith(".tmp")], "temporary socket left behind"
        with pytest.raises(transport.TransportError, match="another daemon is listening"):
            transport.bind_unix(path, transport.SocketAccess())
    finally:
        srv.close()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(transport.TransportError, match="is not a socket"):
        transport.bind_unix(path, transport.SocketAccess())


def test_socket_access_refuses_world_writable_modes_and_unknown_names():
    with pytest.raises(transport.TransportError, match="any local user"):
        transport.SocketAccess(mode=0o666).check()
    with pytest.raises(transport.TransportError, match="no such user"):
        transport.SocketAccess(owner="no-such-user-gemini").check()
    with pytest.raises(transport.TransportError, match="no such group"):
        transport.SocketAccess(group="no-such-group-gemini").check()


def test_tcp_endpoints_and_ipv6_detection():
    assert transport.tcp_endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert transport.tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    assert transport.tcp_endpoint("localhost", "*") == "tcp://localhost:*"
    assert not transport.is_ipv6("127.0.0.1") and not transport.is_ipv6("127.0.0.1:50051")
    assert transport.is_ipv6("::1") and transport.is_ipv6("[fe80::1]")


def test_the_pod_manager_sets_ipv6_on_its_scheduler_link_only_for_an_ipv6_scheduler():
    """Issue 17 item 10: the detection used to look at 'ip:port' and found the port's colon."""
    v4 = PodManagerServer(GROUP, scheduler_ip="127.0.0.1", scheduler_port=50051)
    v6 = PodManagerServer(GROUP, scheduler_ip="::1", scheduler_port=50051)
    assert v4._scheduler_ipv6 is False and v4.scheduler_endpoint == "tcp://127.0.0.1:50051"
    assert v6._scheduler_ipv6 is True and v6.scheduler_endpoint == "tcp://[::1]:50051"


# --- the pod manager on the socket transport --------------------------------------------------------------

def test_pod_manager_over_a_socket_knows_its_clients_from_the_kernel(tmp_path):
    async def body():
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path) as (srv, sched):
            assert srv.socket_path == transport.group_socket(tmp_path, GROUP)
            assert stat.S_IMODE(os.lstat(srv.socket_path).st_mode) == 0o660
            assert srv.port == 0        # no TCP port
            hook = await AsyncHook.connect(srv)
            ack = await hook.hello(GROUP, pid=12345)    # the pid it claims is not the one that counts
            assert isinstance(ack, hp.HelloAck)
            [client] = srv.manager.clients.values()
            assert client.pid == os.getpid() and client.uid == os.geteuid()
            assert srv.manager.members() == [[os.getpid(), os.geteuid()]]
            beat = await sched.expect(sm.Heartbeat, where=lambda m: m.clients == 1)
            assert beat.members == [[os.getpid(), os.geteuid()]]
            await hook.close()
        assert not srv.socket_path.exists(), "the socket was not removed at stop"
    run(body())


def test_a_process_that_may_not_open_the_socket_cannot_join_whatever_it_claims(public_dir, nobody_python):
    """Group g's socket is root's, mode 0660: a process of uid 65534 cannot connect, so it cannot act for g even
    with GEMINI_GROUP_NAME=g (it names the group only in a HELLO it never gets to send). Given the socket
    (SocketOwner = 65534), the same process joins."""
    ipc = public_dir / "ipc"

    async def attempt(access: transport.SocketAccess) -> dict:
        async with running_pmgr(GROUP, 1000, ipc_dir=ipc, socket_access=access) as (srv, _):
            child = child_hello(srv.socket_path, GROUP, nobody=nobody_python)
            out = await asyncio.get_running_loop().run_in_executor(None, child.communicate)
            assert child.returncode == 0
            return json.loads(out[0])

    refused = run(attempt(transport.SocketAccess()))
    assert refused == {"connected": False, "errno": 13}     # EACCES, from the kernel
    allowed = run(attempt(transport.SocketAccess(owner=str(NOBODY))))
    assert allowed == {"connected": True, "reply_type": int(hp.MsgType.HELLO_ACK)}


def test_a_peer_authorizer_sees_the_kernels_credentials_and_can_refuse(tmp_path):
    seen = []

    class OnlyPid:
        def __init__(self, pid):
            self.pid = pid

        def authorize(self, creds, hello_group):
            seen.append((creds, hello_group))
            return None if creds.pid == self.pid else f"pid {creds.pid} is not in this pod"

    async def body(pid):
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path, authorizer=OnlyPid(pid)) as (srv, _):
            hook = await AsyncHook.connect(srv)
            reply = await hook.hello(GROUP, pid=1)
            await hook.close()
            return reply, srv.manager.clients

    ok, _ = run(body(os.getpid()))
    assert isinstance(ok, hp.HelloAck)
    assert seen[0] == (PeerCredentials(os.getpid(), os.geteuid(), os.getegid()), GROUP)
    refused, clients = run(body(1))
    assert isinstance(refused, hp.Error) and refused.code == hp.ErrorCode.REFUSED
    assert refused.message == f"pid {os.getpid()} is not in this pod"


def test_a_connection_that_says_nothing_is_closed_after_the_hello_deadline(tmp_path):
    async def body(ipc):
        limits = Limits(hello_timeout_s=0.3)
        async with running_pmgr(GROUP, 1000, ipc_dir=ipc, limits=limits) as (srv, _):
            silent = await AsyncHook.connect(srv)
            half = await AsyncHook.connect(srv)
            half.send_raw(hp.encode(hp.Hello(pid=1, pod_name=GROUP), 1)[:100])     # and never the rest
            start = time.monotonic()
            await silent.wait_closed(3)
            await half.wait_closed(3)
            took = time.monotonic() - start
            assert 0.2 <= took < 2.0, took
            assert len(srv.admission) == 0 and srv.manager.clients == {}
            good = await AsyncHook.greeted(srv, GROUP)      # a hook that says HELLO stays
            await asyncio.sleep(0.6)
            assert isinstance(await good.call(hp.MemInfo()), hp.MemReply)
            await good.close()
    run(body(tmp_path))
    run(body(None))     # TCP as well


def test_connections_are_capped_per_process_and_in_all(tmp_path):
    async def body():
        limits = Limits(total=6, per_pid=4, per_uid=100)
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path, limits=limits) as (srv, _):
            mine = [await AsyncHook.greeted(srv, GROUP) for _ in range(4)]
            extra = await AsyncHook.connect(srv)        # this process has 4 already
            await extra.wait_closed(3)
            assert extra.pushes.get_nowait().code == hp.ErrorCode.REFUSED
            assert len(srv.admission) == 4
            # other processes still get in, up to the total
            loop = asyncio.get_running_loop()
            children = [child_hello(srv.socket_path, GROUP, hold=True) for _ in range(3)]
            lines = [json.loads(await loop.run_in_executor(None, c.stdout.readline)) for c in children]
            kinds = sorted(line["reply_type"] for line in lines)
            assert kinds == sorted([int(hp.MsgType.HELLO_ACK)] * 2 + [int(hp.MsgType.ERROR)]), lines
            for c in children:
                c.stdin.close()
                await loop.run_in_executor(None, c.wait)
            await eventually(lambda: len(srv.admission) == 4, what="children's connections released")
            for h in mine:
                await h.close()
            await eventually(lambda: len(srv.admission) == 0, what="all released")
    run(body())


def test_admission_counts_per_uid_and_releases():
    adm = Admission(Limits(total=100, per_uid=2, per_pid=10))
    alice = [PeerCredentials(100 + i, 1000, 1000) for i in range(3)]
    assert adm.admit(1, alice[0]) is None and adm.admit(2, alice[1]) is None
    assert "uid 1000 has 2 connections" in adm.admit(3, alice[2])
    assert adm.admit(4, PeerCredentials(200, 1001, 1001)) is None       # bob is not alice's victim
    adm.release(1)
    assert adm.admit(5, alice[2]) is None
    assert adm.admit(6, None) is None       # TCP: only the total counts
    assert len(adm) == 4


def test_a_process_that_is_gone_is_dropped_even_if_its_connection_lives_on(tmp_path):
    """The client connects, says HELLO holding memory, then forks a child that inherits the socket and outlives
    it. The connection stays open (the child holds it), but the pid that connected is gone: its memory is
    released at once."""
    script = textwrap.dedent('''
        import os, struct, sys, time, socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        frame = bytearray(256)
        struct.pack_into("<IHHII", frame, 0, 0x314d4547, 1, 1, 256, 1)
        struct.pack_into("<iiQ", frame, 16, os.getpid(), 0, 700)       # already holds 700 bytes
        frame[40:41] = b"g"
        s.sendall(frame)
        s.recv(256)
        if os.fork() == 0:          # the child keeps the descriptor and sleeps
            time.sleep(30)
            os._exit(0)
        print("forked", flush=True)
        sys.stdin.read()
    ''')

    async def body():
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path) as (srv, _):
            proc = subprocess.Popen([sys.executable, "-c", script, str(srv.socket_path)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            loop = asyncio.get_running_loop()
            try:
                assert (await loop.run_in_executor(None, proc.stdout.readline)).strip() == "forked"
                assert srv.manager.mem_used == 700
                proc.stdin.close()
                await loop.run_in_executor(None, proc.wait)
                took = await eventually(lambda: srv.manager.mem_used == 0, 3, "memory of the exited process")
                assert took < 1.0
            finally:
                os.killpg(proc.pid, 9)
    run(body())


# --- what clients report is bounded ----------------------------------------------------------------------

def test_hook_reports_are_clamped_before_the_manager_sees_them():
    assert bounded(hp.TokenRequest(overuse_ns=-5, burst_ns=10**13, used_ns=2**62)) == \
        hp.TokenRequest(overuse_ns=0, burst_ns=MAX_REPORT_NS, used_ns=MAX_REPORT_NS)
    assert bounded(hp.TokenRelease(token_seq=3, burst_ns=10**13)).burst_ns == MAX_REPORT_NS
    same = hp.TokenRequest(burst_ns=5_000_000)
    assert bounded(same) is same


def test_a_hello_claiming_more_than_the_limit_leaves_is_refused(tmp_path):
    async def body():
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path) as (srv, _):
            a = await AsyncHook.connect(srv)
            assert isinstance(await a.call(hp.Hello(pid=1, pod_name=GROUP, mem_in_use=600)), hp.HelloAck)
            for claim in (401, 2**62):
                b = await AsyncHook.connect(srv)
                reply = await b.call(hp.Hello(pid=2, pod_name=GROUP, mem_in_use=claim))
                assert isinstance(reply, hp.Error) and "may use only 1000 and already uses 600" in reply.message
                await b.wait_closed()
            assert srv.manager.mem_used == 600
            c = await AsyncHook.connect(srv)
            assert isinstance(await c.call(hp.Hello(pid=3, pod_name=GROUP, mem_in_use=400)), hp.HelloAck)
            assert (await c.call(hp.MemAlloc(bytes=1))).verdict == hp.MemVerdict.DENIED
            for h in (a, c):
                await h.close()
    run(body())


def test_blocking_hook_reaches_a_socket(tmp_path):
    async def body():
        async with running_pmgr(GROUP, 1000, ipc_dir=tmp_path) as (srv, _):
            loop = asyncio.get_running_loop()

            def talk():
                h = BlockingHook(srv.socket_path)
                try:
                    return h.call(hp.Hello(pid=1, pod_name=GROUP))
                finally:
                    h.close()
            assert isinstance(await loop.run_in_executor(None, talk), hp.HelloAck)
    run(body())


# --- gem-schd ------------------------------------------------------------------------------------------------

def _schd_config():
    from gemini.config import parse_config
    return parse_config("[a]\nMaxUtil = 1\n[b]\nMaxUtil = 1\n")


def test_gem_schd_on_its_socket_is_reached_by_its_user_only_and_replaces_a_dead_socket(tmp_path):
    from tests.schd_inproc import DaemonThread, FakePodManager
    path = transport.scheduler_socket(tmp_path, "GPU-7")
    transport.ensure_socket_dir(tmp_path, "GPU-7")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    with DaemonThread(_schd_config(), ipc_dir=str(tmp_path), device_uuid="GPU-7") as d:
        assert d.daemon.endpoint == f"ipc://{path}" and d.daemon.port == 0
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        with FakePodManager(d.daemon.endpoint) as p:
            welcome = p.request(sm.Hello(group="a", pid=7, clients=2, members=[[11, 1000], [12, 1001]]))
            assert isinstance(welcome, sm.Welcome)
            reply = p.request(sm.StatusRequest())
            a = next(g for g in reply.groups if g["name"] == "a")
            assert a["members"] == [[11, 1000], [12, 1001]] and a["clients"] == 2
            # ill-formed members are dropped, not shown
            assert isinstance(p.request(sm.Heartbeat(group="a", clients=1, members=[["x", 1]])), sm.HeartbeatAck)
            a = next(g for g in p.request(sm.StatusRequest()).groups if g["name"] == "a")
            assert a["members"] == []
        from gemini.scheduler.daemon import BindError, SchedulerDaemon
        second = SchedulerDaemon(_schd_config(), ipc_dir=str(tmp_path), device_uuid="GPU-7")
        with pytest.raises(BindError, match="another gem-schd is listening"):
            asyncio.run(second.start())
    assert not path.exists(), "gem-schd left its socket behind"


def test_gem_schd_bounds_what_a_pod_manager_reports():
    """Bursts to the longest slot (the base quota), times to the window, memory and counts to their ranges: what
    the policy sees, and the slots it grants."""
    from tests.schd_inproc import DaemonThread, FakePodManager
    seen = []
    with DaemonThread(_schd_config(), base_quota_ms=20, min_quota_ms=5, window_ms=1000) as d:
        real = d.daemon.policy.request

        def spy(group, overuse_ms=0.0, burst_ms=0.0, now=0.0, used_ms=0.0, **kw):
            seen.append((burst_ms, overuse_ms, used_ms))
            return real(group, overuse_ms, burst_ms, now, used_ms, **kw)
        d.call(lambda: setattr(d.daemon.policy, "request", spy))
        with FakePodManager(d.endpoint) as p:
            assert isinstance(p.request(sm.Hello(group="a", pid=1, mem_used=2**64 - 1, clients=-5)), sm.Welcome)
            a = next(g for g in p.request(sm.StatusRequest()).groups if g["name"] == "a")
            assert (a["mem_used"], a["clients"]) == (2**63 - 1, 0)
            for burst in (1e10, 1e300):
                p.send(sm.TokenRequest(group="a", burst_ms=burst, overuse_ms=1e300, used_ms=-5))
                grant = p.recv_type(sm.Grant)
                assert grant is not None and grant.quota_ms <= 20, grant
                p.send(sm.TokenRelease(group="a", token_seq=grant.token_seq))
    assert seen == [(20.0, 1000.0, 0.0)] * 2, seen


def _read_until_closed(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if s.recv(4096) == b"":
                return True
    except (socket.timeout, ConnectionError):
        return False
    return False


def test_gem_schd_closes_connections_that_say_nothing_and_those_beyond_its_cap():
    from tests.schd_inproc import DaemonThread, FakePodManager
    with DaemonThread(_schd_config(), hello_timeout_s=0.3, max_connections=8) as d:
        with FakePodManager(d.endpoint) as p:          # a pod manager that talks stays
            assert isinstance(p.request(sm.Hello(group="a", pid=1)), sm.Welcome)
            silent = socket.create_connection(("127.0.0.1", d.port))
            start = time.monotonic()
            assert _read_until_closed(silent, 4), "a silent connection was kept"
            assert time.monotonic() - start < 3
            flood = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(20)]
            closed_at_once = sum(_read_until_closed(s, 0.5) for s in flood[8:])
            assert closed_at_once >= 10, closed_at_once
            for s in flood:
                s.close()
            silent.close()
            time.sleep(1.2)
            assert isinstance(p.request(sm.Heartbeat(group="a")), sm.HeartbeatAck)
            assert d.call(lambda: d.daemon.guard.closed_silent) >= 1


def test_the_hook_names_a_groups_socket_as_the_daemons_do():
    """hook/util.c's gemhook_group_socket_name and gemini/transport.py agree on every byte a name can hold."""
    from tests.hook_ffi import hook_lib
    ffi, lib = hook_lib()
    names = ["a", "train", "a/b", "../x", ".", "$(id)", "x y", "%", "Ab-_.9", "[weird]", "g" * 63,
             "".join(chr(c) for c in range(0x21, 0x7f)), "ünï"]
    for name in names:
        out = ffi.new("char[512]")
        assert lib.gemhook_group_socket_name(name.encode(), out, 512) == 0, name
        assert ffi.string(out).decode() == transport.group_socket("/x", name).name, name
    small = ffi.new("char[16]")
    assert lib.gemhook_group_socket_name(b"a" * 20, small, 16) == -1     # does not fit: refused, not cut
