"""Run gemini's backend and tenants for tests and benchmarks, and read what the tenants measured.

Used by tests/ (on the simulated driver), tests/gpu/ and bench/ (on a real GPU) alike:

    with Backend(tmp, [Group("a", 0.3, 0.3), Group("b", 0.6, 0.6)], quota_ms=20) as be:
        procs = [be.spawn("a", workload_argv(...)), be.spawn("b", ...)]
        ...
    shares = shares_over(traces, start, end)

A tenant is any program; the spin workload (tests/clients/workload.c) writes a trace of
(host time, cumulative on-chip ns) at every synchronisation, from which shares over any window
are exact to one kernel.
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCH_BACKEND = REPO_ROOT / "tools" / "launch-backend.py"
LAUNCH_COMMAND = REPO_ROOT / "tools" / "launch-command.py"


@dataclass(frozen=True)
class Group:
    name: str
    min_util: float = 0.0
    max_util: float = 1.0
    mem_limit: str = "8GiB"
    turns: bool = False     # ProcessSharing = turns
    sched_class: str = "batch"   # Class = latency: claims the GPU within a budget of its MinUtil
    memory_mode: str = "device"  # MemoryMode = unified: managed memory, swapped by gem-schd
    slots: str = "free"          # Slots = aligned: a capped group's slots on the host's clock grid (multi-GPU jobs)

    def ini(self) -> str:
        return (f"[{self.name}]\nMinUtil = {self.min_util}\nMaxUtil = {self.max_util}\nMemoryLimit = {self.mem_limit}\n"
                + ("ProcessSharing = turns\n" if self.turns else "")
                + (f"Class = {self.sched_class}\n" if self.sched_class != "batch" else "")
                + (f"MemoryMode = {self.memory_mode}\n" if self.memory_mode != "device" else "")
                + (f"Slots = {self.slots}\n" if self.slots != "free" else ""))


def percentile(values, q: float) -> float:
    """The nearest-rank q-quantile of a non-empty sequence (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_config(path: Path, groups: list[Group]) -> Path:
    path.write_text("".join(g.ini() for g in groups))
    return path


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_span() -> tuple[int, int]:
    """Where free_port_base looks: below the kernel's ephemeral ports (which any outgoing connection may take
    between our check and the daemon's bind: a hook then reached no pod manager, or another test's), and, under
    pytest-xdist, a share of its own for each worker, so that two workers never pick the same run."""
    lo, hi = 10000, 60000
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        if ephemeral - lo >= 4000:
            hi = ephemeral
    except (OSError, ValueError, IndexError):
        pass
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(workers) > 1:
        share = (hi - lo) // int(workers)
        lo += int(worker[2:]) * share
        hi = lo + share
    return lo, hi


def free_port_base(count: int, rng: random.Random | None = None) -> int:
    """A port with `count` free ports from it on (the scheduler, then one per group, plus room)."""
    rng = rng or random.Random()
    lo, hi = _port_span()
    for _ in range(200):
        base = rng.randrange(lo, max(lo + 1, hi - count))
        if _ports_free(base, count):
            return base
    raise RuntimeError("no run of free ports found")


TRANSPORTS = ("tcp", "ipc")


@dataclass
class Backend:
    """launch-backend.py with a config of its own, as a context manager.

    transport "tcp" (ports from `port` on) or "ipc" (Unix sockets in workdir/ipc, or `ipc_dir`). `ports` maps each
    group to where its pod manager listens: a port, or a socket path."""
    workdir: Path
    groups: list[Group] = field(default_factory=list)
    config: Path | None = None   # an existing resource-config.txt to use instead of writing one from `groups`
    quota_ms: float | None = 250        # None: gem-schd's default (the flag is not passed)
    min_quota_ms: float | None = 100
    window_ms: float | None = 10000
    env: dict | None = None
    port: int = 0
    ports: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    verbose: bool = False
    transport: str = "tcp"
    ipc_dir: Path | None = None
    device_uuid: str | None = None
    memory_limit: int | None = None     # RLIMIT_AS of launch-backend and its daemons (tests that feed them garbage)

    extra_args: list = field(default_factory=list)

    @property
    def ipc(self) -> bool:
        return self.transport == "ipc"

    @property
    def config_path(self) -> Path:
        return Path(self.config).resolve() if self.config else self.workdir / "resource-config.txt"

    def start(self, timeout: float = 30.0) -> "Backend":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.config:
            write_config(self.config_path, self.groups)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {TRANSPORTS}")
        if self.ipc:
            self.ipc_dir = Path(self.ipc_dir or self.workdir / "ipc")
            where = ["--ipc-dir", str(self.ipc_dir)]
        else:
            self.port = self.port or free_port_base(max(len(self.groups), 16) + 8)
            where = ["--port", str(self.port)]
        if self.device_uuid:
            where += ["--device-uuid", self.device_uuid]
        ports_file = self.workdir / "ports.json"
        ports_file.unlink(missing_ok=True)
        self.log_path = self.workdir / "backend.log"
        flags = [(f, v) for f, v in (("--base_quota", self.quota_ms), ("--min_quota", self.min_quota_ms),
                                     ("--window", self.window_ms)) if v is not None]
        argv = [sys.executable, str(LAUNCH_BACKEND), "--config", str(self.config_path), *where,
                *[str(x) for fv in flags for x in fv], "--ports-file", str(ports_file),
                "--log-dir", str(self.workdir / "logs")]
        if self.verbose:
            argv.append("-v")
        argv += [str(a) for a in self.extra_args]
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONPATH", str(REPO_ROOT))
        self._log = open(self.log_path, "w")
        limit = self.memory_limit

        def preexec() -> None:
            if limit is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=preexec if limit is not None else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch-backend exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            if ports_file.exists() and "ready" in self.log_path.read_text():
                self.ports = json.loads(ports_file.read_text())
                return self
            time.sleep(0.01)    # (a test starts several backends: 50 ms polls cost it 25 ms each on average)
        self.stop()
        raise RuntimeError(f"launch-backend not ready after {timeout} s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                wait_exit(self.proc, 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def daemon_pids(self) -> dict[str, int]:
        """{"gem-schd": pid, <group>: pid of its gem-pmgr}, among launch-backend's children."""
        out = {}
        for pid in children_of(self.proc.pid):
            argv = cmdline(pid)
            if "--name" in argv:
                out[argv[argv.index("--name") + 1]] = pid
            elif any("gem-schd" in a or "gemini.scheduler" in a for a in argv):
                out["gem-schd"] = pid
        return out

    def logs(self, tail: int = 3000) -> str:
        """The backend's output and each daemon's log, cut to their ends (for error messages)."""
        parts = []
        for path in [getattr(self, "log_path", None), *sorted((self.workdir / "logs").glob("*.log"))]:
            if path and Path(path).exists():
                parts.append(f"--- {Path(path).name}\n{Path(path).read_text()[-tail:]}")
        return "\n".join(parts)

    def __enter__(self) -> "Backend":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def where_args(self) -> list[str]:
        """gem-ctl's (and launch-command's) options that reach this backend."""
        if self.ipc:
            return ["--ipc-dir", str(self.ipc_dir)] + (["--device-uuid", self.device_uuid] if self.device_uuid else [])
        return ["--port", str(self.port)]

    def scheduler_endpoint(self) -> str:
        """gem-schd's zmq endpoint."""
        if self.ipc:
            from gemini import transport
            return transport.ipc_endpoint(str(transport.scheduler_socket(self.ipc_dir, self.device_uuid)))
        return f"tcp://127.0.0.1:{self.port}"

    def hook_env(self, group: str) -> dict[str, str]:
        """What launch-command tells a program's hook about its group's pod manager (besides LD_PRELOAD)."""
        if self.ipc:
            return {"GEMINI_IPC_DIR": str(self.ipc_dir), "GEMINI_GROUP_NAME": group}
        return {"GEMINI_POD_NAME": group, "GEMINI_POD_MANAGER_IP": "127.0.0.1",
                "GEMINI_POD_MANAGER_PORT": str(self.ports[group])}

    def command(self, group: str, argv: list[str], timeout: float | None = None) -> list[str]:
        """argv that runs `argv` in `group` through launch-command.py."""
        where = self.where_args() if self.ipc else ["--port", str(self.ports[group])]
        cmd = [sys.executable, str(LAUNCH_COMMAND), "--name", group, *where]
        if timeout:
            cmd += ["--timeout", str(timeout)]
        return cmd + ["--"] + [str(a) for a in argv]

    def spawn(self, group: str, argv: list[str], env: dict | None = None, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, timeout: float | None = None, stdin=None) -> subprocess.Popen:
        full_env = dict(os.environ if env is None else env)
        full_env.setdefault("PYTHONPATH", str(REPO_ROOT))
        return subprocess.Popen(self.command(group, argv, timeout), env=full_env, stdin=stdin, stdout=stdout,
                                stderr=stderr, text=True)


# --- processes ---------------------------------------------------------------------------------------

def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """proc.wait(timeout), woken by the exit itself: Popen.wait with a timeout polls with a sleep that doubles up to
    50 ms, so a backend that took 70 ms to stop was seen gone only at 114 ms (every test stops one or more). A pidfd
    becomes readable when the process exits; where there is none (Linux before 5.3), the polling wait."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.wait(timeout)
    try:
        # proc is not reaped yet, so the pidfd names it (a zombie's is readable at once); poll(), unlike select(),
        # takes a descriptor numbered 1024 or more
        if proc.poll() is None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(timeout * 1000):
                raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    return proc.wait()


def children_of(pid: int) -> list[int]:
    """Live (not zombie) children of a process, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").rstrip("\0").split("\0")


def ctl_status(be: Backend, timeout_s: float = 5.0) -> dict:
    """gem-ctl status --json (gem-ctl waits up to `timeout_s` for gem-schd's answer); CalledProcessError with
    gem-ctl's message if it did not answer."""
    out = subprocess.run([sys.executable, "-m", "gemini.ctl", *be.where_args(), "--timeout", f"{timeout_s:g}",
                          "status", "--json"], capture_output=True, text=True, timeout=timeout_s + 30,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             [str(REPO_ROOT)] +
                             ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))))
    if out.returncode != 0:
        raise subprocess.CalledProcessError(out.returncode, out.args, out.stdout, out.stderr)
    return json.loads(out.stdout)


# --- what the hook and the workloads report -----------------------------------------------------

def read_stats(path: Path) -> dict[int, dict[str, float]]:
    """GEMINI_STATS_FILE lines ("pid=N key=value ...") by pid."""
    stats: dict[int, dict[str, float]] = {}
    if not Path(path).exists():
        return stats
    for line in Path(path).read_text().splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "pid" in fields:
            stats[int(fields.pop("pid"))] = {k: float(v) for k, v in fields.items()}
    return stats


def last_json(text: str) -> dict:
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON line in output:\n{text[-2000:]}")


@dataclass
class Trace:
    """A spin workload's --trace file: at each sync, host time (ns), cumulative on-chip time (ns) and
    cumulative kernels completed."""
    host_ns: list[int]
    onchip_ns: list[int]
    kernels: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> "Trace":
        host, onchip, kernels = [], [], []
        for line in Path(path).read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2:
                host.append(int(parts[0]))
                onchip.append(int(parts[1]))
                kernels.append(int(parts[2]) if len(parts) > 2 else 0)
        return cls(host, onchip, kernels)

    def as_throughput(self, ns_per_kernel_alone: float) -> "Trace":
        """GPU time by throughput: each kernel counts the time it takes when it has the GPU to itself.
        (For compute-bound kernels under MPS, whose run time says nothing about the SMs they got.)"""
        return Trace(self.host_ns, [int(k * ns_per_kernel_alone) for k in self.kernels], self.kernels)

    def onchip_at(self, t_ns: float) -> float:
        """Cumulative on-chip time at host time t, interpolated between syncs."""
        return self._at(self.onchip_ns, t_ns)

    def kernels_at(self, t_ns: float) -> float:
        """Cumulative kernels completed at host time t, interpolated between syncs."""
        return self._at(self.kernels, t_ns)

    def _at(self, c: list[int], t_ns: float) -> float:
        h = self.host_ns
        if not h or t_ns <= h[0]:
            return float(c[0]) if c and t_ns >= h[0] else 0.0
        if t_ns >= h[-1]:
            return float(c[-1])
        lo, hi = 0, len(h) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if h[mid] <= t_ns:
                lo = mid
            else:
                hi = mid
        frac = (t_ns - h[lo]) / max(1, h[hi] - h[lo])
        return c[lo] + frac * (c[hi] - c[lo])


@dataclass
class GroupTrace:
    """Several tenants' traces counted as one (a group of processes)."""
    members: list

    @property
    def host_ns(self) -> list[int]:
        # the span the whole group ran: from the last member's first sync to the first member's last
        return [max(m.host_ns[0] for m in self.members), min(m.host_ns[-1] for m in self.members)]

    def onchip_at(self, t_ns: float) -> float:
        return sum(m.onchip_at(t_ns) for m in self.members)


def shares_over(traces: dict[str, Trace], start_ns: float, end_ns: float) -> dict[str, float]:
    """Each tenant's on-chip time in [start, end] as a fraction of the span."""
    span = end_ns - start_ns
    return {name: (t.onchip_at(end_ns) - t.onchip_at(start_ns)) / span for name, t in traces.items()}


def common_span(traces: dict[str, Trace], trim_s: float = 0.0) -> tuple[float, float]:
    """The interval every tenant was running, trimmed at both ends."""
    start = max(t.host_ns[0] for t in traces.values()) + trim_s * 1e9
    end = min(t.host_ns[-1] for t in traces.values()) - trim_s * 1e9
    if end <= start:
        raise ValueError("the tenants did not run at the same time")
    return start, end


def window_errors(traces: dict[str, Trace], targets: dict[str, float], window_s: float, start_ns: float,
                  end_ns: float) -> dict[str, float]:
    """Worst |share - target| over consecutive windows, in percentage points, per tenant."""
    worst = {name: 0.0 for name in targets}
    w = window_s * 1e9
    t = start_ns
    while t + w <= end_ns + 1:
        shares = shares_over(traces, t, t + w)
        for name, target in targets.items():
            worst[name] = max(worst[name], abs(shares[name] - target) * 100)
        t += w
    return worst
