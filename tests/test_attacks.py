"""A local attacker against a running backend on the socket transport, with the real hook on the simulated driver.

Groups a (MaxUtil 0.3) and b (MaxUtil 0.6) each run an always-busy CUDA program; group c's socket is given to
uid 65534, the attacker, who has no other right. One attack after another, each for a couple of seconds, the
attacker (a process of uid 65534) tries:

  hello flood     say hello to gem-schd for group a, again and again (it cannot even connect), and connect,
                  say HELLO to c's pod manager and hang up, as fast as it can
  idle flood      open far more connections to c's pod manager than its caps allow, and say nothing
  huge claim      HELLO to c's pod manager claiming 2**62 bytes already held
  huge burst      ask c's pod manager for the token with a burst of 10**13 ns, and sit on the slot
and, as root (whoever can write the config): the config replaced by a FIFO, then by a symlink to /dev/zero.

Through all of it a and b keep their shares (over each attack's span: no more than 8 pp above their caps, at least
3/4 of them, and 1:2 between them), neither waits for the GPU longer than a few slots, and the daemons' memory
stays flat.
"""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from bench.harness import Backend, Trace, shares_over
from gemini import transport
from tests.e2e_fixtures import client_argv, finish, start
from tests.peer_fixtures import NOBODY, as_nobody
from test_security import clean_env

CONFIG = textwrap.dedent(f"""
    [a]
    MaxUtil = 0.3
    MemoryLimit = 64MiB
    [b]
    MaxUtil = 0.6
    MemoryLimit = 64MiB
    [c]
    MaxUtil = 1.0
    MemoryLimit = 64MiB
    SocketOwner = {NOBODY}
""")
CAPS = {"a": 0.3, "b": 0.6}
QUOTA_MS = 20             # gem-schd's base quota: the longest slot there is
PHASE_S = 2.0

ATTACKER = textwrap.dedent('''
    import json, os, socket, struct, sys, time
    mode, d, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    schd, pmgr = os.path.join(d, "gem-schd.sock"), os.path.join(d, "group.c.sock")
    MAGIC = 0x314d4547

    def frame(mtype, seq, payload=b""):
        f = bytearray(256)
        struct.pack_into("<IHHII", f, 0, MAGIC, 1, mtype, 256, seq)
        f[16:16 + len(payload)] = payload
        return bytes(f)

    def hello(mem=0, group=b"c"):
        p = bytearray(240)
        struct.pack_into("<iiQ", p, 0, os.getpid(), 0, mem)
        p[24:24 + len(group)] = group
        return frame(1, 1, bytes(p))

    def connect(path):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(path)
        return s

    def reply(s):
        got = b""
        while len(got) < 256:
            chunk = s.recv(256 - len(got))
            if not chunk:
                return None
            got += chunk
        return struct.unpack_from("<H", got, 6)[0], got

    out = {"refused": 0, "errors": {}, "done": 0}
    end = time.monotonic() + seconds
    if mode == "hello-flood":
        while time.monotonic() < end:
            try:
                connect(schd).close()
                out["schd_connected"] = out.get("schd_connected", 0) + 1
            except OSError as exc:
                out["errors"][str(exc.errno)] = out["errors"].get(str(exc.errno), 0) + 1
            try:
                s = connect(pmgr)
                s.sendall(hello())
                reply(s)
                s.close()
                out["done"] += 1
            except OSError as exc:
                out["errors"][str(exc.errno)] = out["errors"].get(str(exc.errno), 0) + 1
    elif mode == "idle-flood":
        held = []
        for _ in range(400):
            try:
                held.append(connect(pmgr))
            except OSError as exc:
                out["errors"][str(exc.errno)] = out["errors"].get(str(exc.errno), 0) + 1
        time.sleep(max(0.0, end - time.monotonic()))
        for s in held:             # which were kept open: a refused one has an ERROR and EOF waiting
            s.setblocking(False)
            try:
                data = s.recv(256)
                out["refused"] += 1 if len(data) == 256 or data == b"" else 0
            except BlockingIOError:
                out["done"] += 1
        out["opened"] = len(held)
    elif mode == "huge-claim":
        s = connect(pmgr)
        s.sendall(hello(mem=2**62))
        out["reply"] = reply(s)[0]
    elif mode == "huge-burst":
        s = connect(pmgr)
        s.sendall(hello())
        out["hello"] = reply(s)[0]
        p = struct.pack("<qqq", 0, 10**13, 0)
        s.sendall(frame(3, 2, p))
        kind, raw = reply(s)
        out["grant"] = kind
        out["quota_ns"] = struct.unpack_from("<q", raw, 16)[0]
        time.sleep(max(0.0, end - time.monotonic()))      # sit on the slot, never release it
    print(json.dumps(out), flush=True)
''')


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def longest_gap_s(trace: Trace, start_ns: float, end_ns: float) -> float:
    times = [t for t in trace.host_ns if start_ns <= t <= end_ns]
    return max((b - a for a, b in zip(times, times[1:])), default=end_ns - start_ns) / 1e9


@pytest.mark.slow
def test_a_local_attacker_changes_no_other_groups_share(public_dir, nobody_python, sim):
    config = public_dir / "resource-config.txt"
    config.write_text(CONFIG)
    be = Backend(public_dir / "be", config=config, quota_ms=QUOTA_MS, min_quota_ms=5, window_ms=1000,
                 env=clean_env(), transport="ipc", ipc_dir=public_dir / "ipc",
                 memory_limit=3 << 30)      # should a reader ever follow /dev/zero: MemoryError, not the machine's
    phases = ["warm-up", "hello-flood", "idle-flood", "huge-claim", "huge-burst", "fifo", "dev-zero"]
    seconds = PHASE_S * len(phases) + 2
    with be:
        gpu_dir = transport.gpu_dir(be.ipc_dir)
        traces = {g: sim.dir / f"{g}.trace" for g in CAPS}
        busy = {g: start(client_argv("workload-procaddr", "--kernel-us", 1000, "--json", "--seconds", seconds,
                                     "--sync-every", 4, "--trace", traces[g]), sim.hooked(be, g)) for g in CAPS}
        pids = be.daemon_pids()
        marks: dict[str, tuple[float, float]] = {}
        attacks: dict[str, dict] = {}
        try:
            time.sleep(PHASE_S)
            rss_before = {name: rss_kib(pid) for name, pid in pids.items()}
            for phase in phases[1:]:
                t0 = time.monotonic_ns()
                if phase in ("fifo", "dev-zero"):
                    tmp = config.with_name("new")
                    os.mkfifo(tmp) if phase == "fifo" else tmp.symlink_to("/dev/zero")
                    os.replace(tmp, config)
                    time.sleep(PHASE_S)
                else:
                    res = subprocess.run([nobody_python, "-c", ATTACKER, phase, str(gpu_dir), str(PHASE_S)],
                                         preexec_fn=as_nobody, cwd="/", capture_output=True, text=True,
                                         timeout=PHASE_S + 30)
                    assert res.returncode == 0, res.stderr
                    attacks[phase] = json.loads(res.stdout)
                    time.sleep(max(0.0, PHASE_S - (time.monotonic_ns() - t0) / 1e9))   # a quick attack too
                marks[phase] = (t0, time.monotonic_ns())
            rss_after = {name: rss_kib(pid) for name, pid in pids.items()}
            new = config.with_name("new")
            new.write_text(CONFIG)
            os.replace(new, config)
        finally:
            results = {g: finish(p, timeout=seconds + 60) for g, p in busy.items()}
        for r in results.values():
            assert r.rc == 0, r
        assert be.daemon_pids() == pids, "a daemon died or was restarted"
        logs = be.logs(20000)
    # what the attacker got
    assert attacks["hello-flood"]["errors"].get("13", 0) > 0 and "schd_connected" not in attacks["hello-flood"], \
        attacks["hello-flood"]       # EACCES on gem-schd.sock, every time
    assert attacks["hello-flood"]["done"] > 50, attacks["hello-flood"]
    flood = attacks["idle-flood"]
    assert flood["done"] <= 16, flood      # at most the per-process cap stays open
    assert attacks["huge-claim"]["reply"] == 12, attacks["huge-claim"]      # ERROR
    burst = attacks["huge-burst"]
    assert burst["grant"] == 4 and burst["quota_ns"] <= QUOTA_MS * 1_000_000, burst
    assert "is a FIFO, not a regular file" in logs and "is a character device, not a regular file" in logs
    # what a and b kept
    loaded = {g: Trace.read(path) for g, path in traces.items()}
    for phase, (t0, t1) in marks.items():
        shares = shares_over(loaded, t0, t1)
        # Each keeps its share: at most 8 pp above its cap, at least 3/4 of it (the simulated GPU runs on the same
        # 2 CPUs as the attacker, whose CPU use slows every client a little), and a:b stays 1:2. A group taken
        # over, a slot of seconds or a scheduler stuck on its config would each show as a long wait.
        for g, cap in CAPS.items():
            assert 0.75 * cap <= shares[g] <= cap + 0.08, f"{phase}: {g} got {shares[g]:.3f} (cap {cap}); {shares}"
            gap = longest_gap_s(loaded[g], t0, t1)
            assert gap < 0.3, f"{phase}: {g} waited {gap:.2f} s for the GPU"
        assert 1.5 <= shares["b"] / shares["a"] <= 2.7, f"{phase}: a:b is not 1:2: {shares}"
    for name in pids:
        grown = rss_after[name] - rss_before[name]
        limit = 32 * 1024 if name == "c" else 8 * 1024
        assert grown < limit, f"{name} grew by {grown} KiB during the attacks (before {rss_before}, after {rss_after})"
