"""Fixtures and helpers for the end-to-end tests of the real hook on the simulated driver.

Every CUDA program runs in a child process with `libgemhook.so.1` preloaded and the simulated
`libcuda.so.1` (tests/simcuda) on its library path, against a real backend (gem-schd + gem-pmgr
through tools/launch-backend.py, driven by bench/harness.Backend). tests/conftest.py registers the
fixtures for every test module (pytest_plugins).

    hook_lib            session: `make hook` and the simulator/clients built once; the hook's path
                        ($GEMINI_HOOK_LIB wins, so a deliberately broken build can be tested)
    test_hook_lib       session: `make testhook`, the hook whose settings file can be redirected (tests only)
    client_script       session: the path of E2E_CLIENT (ctypes scenarios workload.c cannot do)
    sim                 a fresh simulated device (its own shared file) and where its processes report
    backends            start Backend(groups) for this test; all are stopped at teardown

Environment of a child: `sim.env(...)` (no hook), `sim.hooked(backend, group, ...)` (hook preloaded
and pointed at the group's pod manager, as launch-command does), or `spawn(backend, group, argv,
sim.env())` (through tools/launch-command.py itself).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from bench.harness import Backend, Group, last_json, read_stats
from tests import native

__all__ = [
    "KiB", "MiB", "GiB", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_SYSTEM_NOT_READY", "CUDA_ERROR_NOT_INITIALIZED",
    "Sim", "Run", "Holder", "hook_lib", "test_hook_lib", "client_script", "sim", "backends", "spawn", "start",
    "finish", "run", "client_argv", "wait_for", "held_for_claims", "read_line", "clean_env", "E2E_CLIENT",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_SYSTEM_NOT_READY = 802   # what the hook returns when no pod manager can authorise a call

REPO_ROOT = Path(__file__).resolve().parent.parent
CLIENTS_DIR = REPO_ROOT / "tests" / "clients"

# Settings a child must not inherit from whoever runs the tests.
_SCRUBBED_PREFIXES = ("GEMINI_", "SIMCUDA_")
_SCRUBBED = ("LD_PRELOAD", "POD_NAME", "POD_MANAGER_IP", "POD_MANAGER_PORT")


def clean_env(base: dict | None = None) -> dict:
    """os.environ without any gemini/simulator settings or preloads."""
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key in _SCRUBBED or key.startswith(_SCRUBBED_PREFIXES):
            del env[key]
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


# --- building ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def hook_lib() -> Path:
    """The hook under test, built once per session (with the simulator and the C clients)."""
    native.build_native()
    override = os.environ.get("GEMINI_HOOK_LIB")
    if override:
        path = Path(override)
        assert path.is_file(), f"GEMINI_HOOK_LIB={override} is not a file"
        return path.resolve()
    proc = subprocess.run(["make", "--no-print-directory", "-s", "hook"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"make hook failed:\n{proc.stdout}")
    return REPO_ROOT / "gemini" / "lib" / "libgemhook.so.1"


@pytest.fixture(scope="session")
def test_hook_lib(hook_lib) -> Path:
    """The hook built with -DGEM_TEST_SETTINGS_FILE_ENV (make testhook): the same code, but the settings file's
    path (/etc/gemini/hook.conf) can be redirected with GEMINI_TEST_SETTINGS_FILE."""
    proc = subprocess.run(["make", "--no-print-directory", "-s", "testhook", f"BUILD={native.build_dir()}"],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"make testhook failed:\n{proc.stdout}")
    return native.build_dir() / "testhook" / "libgemhook.so.1"


@pytest.fixture(scope="session")
def client_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("e2e-client") / "e2e_client.py"
    path.write_text(E2E_CLIENT)
    return path


# --- a simulated device --------------------------------------------------------------------------

@dataclass
class Sim:
    """One simulated GPU (its own shared file) and the files its processes report into."""
    dir: Path
    hook: Path
    mem_bytes: int = 1 * GiB
    kernel_us: int = 100
    trace: Path | None = None
    devices: int = 1

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def shm(self) -> Path:
        return self.dir / "simcuda.shm"

    @property
    def stats_file(self) -> Path:
        return self.dir / "gemini-stats.txt"

    def env(self, **extra) -> dict:
        """A child that sees the simulator (no hook unless LD_PRELOAD is given); extra values win, None removes."""
        env = native.sim_env(self.shm, mem_bytes=self.mem_bytes, kernel_us=self.kernel_us, trace=self.trace,
                             devices=self.devices)
        for key in list(env):
            if key in _SCRUBBED or key.startswith("GEMINI_"):
                del env[key]
        env.update(PYTHONPATH=str(REPO_ROOT), E2E_CLIENTS_DIR=str(CLIENTS_DIR),
                   GEMINI_STATS_FILE=str(self.stats_file), GEMINI_HOOK_LIB=str(self.hook))
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    def hooked(self, backend: Backend, group: str, **extra) -> dict:
        """The hook preloaded and pointed at `group`'s pod manager, on the backend's transport (what
        launch-command sets up)."""
        return self.env(LD_PRELOAD=str(self.hook), **{**backend.hook_env(group), **extra})

    def stats(self) -> dict[int, dict[str, float]]:
        """The hook's counters of every process that has exited, by pid."""
        return read_stats(self.stats_file)

    def stats_of(self, pid: int) -> dict[str, float]:
        """The counters one process wrote at exit (an AssertionError if it wrote none)."""
        stats = self.stats()
        text = self.stats_file.read_text() if self.stats_file.exists() else "(no file)"
        assert pid in stats, f"pid {pid} wrote no statistics to {self.stats_file}:\n{text}"
        return stats[pid]


@pytest.fixture
def sim(tmp_path, hook_lib) -> Sim:
    return Sim(tmp_path / "sim", hook_lib)


@pytest.fixture
def backends(tmp_path) -> Iterator[Callable[..., Backend]]:
    """backends(groups, quota_ms=.., ...) starts a backend for this test; all stop at teardown."""
    with ExitStack() as stack:
        count = 0

        def make(groups: list[Group], quota_ms: float = 20, min_quota_ms: float = 5, window_ms: float = 1000,
                 **kw) -> Backend:
            nonlocal count
            count += 1
            be = Backend(tmp_path / f"backend{count}", groups, quota_ms=quota_ms, min_quota_ms=min_quota_ms,
                         window_ms=window_ms, env=clean_env(), **kw)
            stack.enter_context(be)
            return be

        yield make


def held_for_claims(st: dict) -> float:
    """How many claims held the trainer: its launches paused on the host (claim_pauses), or its queued work held
    on the GPU at a wait (gpu_gate_raises: the mirror raised the word; a thread blocked on a marker or a
    synchronisation meanwhile never sees the claim on the host)."""
    return max(st["claim_pauses"], st["gpu_gate_raises"])


# --- running children ----------------------------------------------------------------------------

@dataclass
class Run:
    """A finished child."""
    argv: list[str]
    rc: int
    out: str
    err: str
    wall_s: float

    @property
    def json(self) -> dict:
        return last_json(self.out)

    def __str__(self) -> str:
        return f"{' '.join(self.argv)}: rc={self.rc} after {self.wall_s:.2f} s\n--- stdout\n{self.out[-3000:]}" \
               f"\n--- stderr\n{self.err[-3000:]}"


def client_argv(name: str, *args: object, script: Path | None = None) -> list[str]:
    """argv of a client: a built C client, a Python client of tests/clients, or E2E_CLIENT (name 'e2e')."""
    if name == "e2e":
        assert script is not None, "pass script=client_script"
        return [sys.executable, str(script), *(str(a) for a in args)]
    return native.client_cmd(name, *args)


def spawn(backend: Backend, group: str, argv: list[str], env: dict) -> subprocess.Popen:
    """argv in `group` through tools/launch-command.py (it preloads the hook named by env's GEMINI_HOOK_LIB)."""
    p = backend.spawn(group, argv, env=env)
    p.started_at = time.monotonic()  # type: ignore[attr-defined]
    return p


def start(argv: list[str], env: dict, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    p = subprocess.Popen(argv, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.started_at = time.monotonic()  # type: ignore[attr-defined]
    return p


def finish(p: subprocess.Popen, timeout: float = 60) -> Run:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{p.args} did not finish within {timeout} s\n{out[-2000:]}\n{err[-2000:]}") from None
    return Run(list(p.args), p.returncode, out, err, time.monotonic() - p.started_at)  # type: ignore[attr-defined]


def run(argv: list[str], env: dict, timeout: float = 60) -> Run:
    return finish(start(argv, env), timeout)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, step: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(step)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line, or an AssertionError after `timeout` s."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"{proc.args}: no output within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"{proc.args}: exited {proc.wait()}: {proc.stderr.read()[-2000:]}"
    return line.strip()


class Holder:
    """E2E_CLIENT `serve`: a process that allocates, frees and asks for meminfo when told to."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = start(argv, env, stdin=subprocess.PIPE)
        self.pid = self.proc.pid
        assert self._line(30) == "ready"

    def _line(self, timeout: float) -> str:
        return read_line(self.proc, timeout)

    def ask(self, command: str, timeout: float = 20) -> list[int]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return [int(x) for x in self._line(timeout).split()]

    def alloc(self, nbytes: int) -> int:
        """cuMemAlloc_v2's result (the pointer is kept)."""
        return self.ask(f"alloc {nbytes}")[0]

    def meminfo(self) -> tuple[int, int]:
        free, total = self.ask("meminfo")
        return free, total

    def close(self, timeout: float = 20) -> Run:
        """End of input (the holder exits, freeing nothing itself: the hook and driver see it go)."""
        return finish(self.proc, timeout)   # communicate() closes stdin


# --- E2E_CLIENT: ctypes scenarios ---------------------------------------------------------------------

E2E_CLIENT = r'''
"""Driver-API scenarios through ctypes (dlsym of libcuda.so.1), for the end-to-end hook tests.

    serve                         "ready", then per stdin line: alloc N | free | meminfo | quit
    chunks BYTES BARRIER          when BARRIER exists, cuMemAlloc_v2(BYTES) until refused; print JSON; wait for EOF
    idle SECONDS KERNELS US SLEEP_MS   bursts of KERNELS kernels of US, each followed by a host sleep
    capture SECONDS               a GLOBAL capture in one thread while another launches (gated)
    capture_race CAPTURES         one thread launches short kernels all along; the main thread begins, fills and
                                  ends CAPTURES short GLOBAL captures on a stream of its own
    reset KERNELS                 KERNELS short kernels, a reset of the primary context, KERNELS more; the hook's
                                  marker count before and after the reset
    fork FORKS                    a thread launches all along while the main thread forks FORKS children
    phases K:US:EVERY ...         each phase K kernels of US on the legacy stream, a context-wide synchronisation
                                  after every EVERY; the host time of each synchronisation of the last phase (ms)
    graphmix SECONDS G:GUS E:EUS EVERY  a graph of G kernels of GUS (captured once), then E kernels of EUS, on one
                                  stream, over and over; the stream synchronised after every EVERY rounds
    threads SECONDS N US EVERY    N threads launch kernels of US on one stream they share (created by the main
                                  thread), never synchronising; every EVERY launches the first of them launches one
                                  of 4 * US (a second key); the stream is synchronised at the end
"""
import ctypes, json, os, sys, threading, time

sys.path.insert(0, os.environ["E2E_CLIENTS_DIR"])
from pyclient import GEM_SPIN_PTX  # noqa: E402

c_void_p, c_size_t, c_u64, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong
byref = ctypes.byref
cu = ctypes.CDLL("libcuda.so.1")
GLOBAL, NON_BLOCKING = 0, 1


def check(rc, what):
    if rc != 0:
        print(f"e2e_client: {what} failed: {rc}", file=sys.stderr)
        sys.exit(1)


def setup():
    check(cu.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


class Spin:
    def __init__(self, nslots):
        self.mod, self.fn, self.buf, self.n = c_void_p(), c_void_p(), CUdeviceptr(), nslots
        check(cu.cuModuleLoadData(byref(self.mod), GEM_SPIN_PTX.encode() + b"\0"), "cuModuleLoadData")
        check(cu.cuModuleGetFunction(byref(self.fn), self.mod, b"gem_spin"), "cuModuleGetFunction")
        check(cu.cuMemAlloc_v2(byref(self.buf), c_size_t(24 * nslots)), "cuMemAlloc_v2")
        check(cu.cuMemsetD8_v2(self.buf, 0, c_size_t(24 * nslots)), "cuMemsetD8_v2")

    def launch(self, stream, slot, us):
        out, dur = CUdeviceptr(self.buf.value + 24 * slot), c_u64(us * 1000)
        params = (c_void_p * 2)(ctypes.cast(byref(out), c_void_p), ctypes.cast(byref(dur), c_void_p))
        return cu.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, stream, params, None)

    def read(self):
        host = (c_u64 * (3 * self.n))()
        check(cu.cuMemcpyDtoH_v2(host, self.buf, c_size_t(24 * self.n)), "cuMemcpyDtoH_v2")
        return [[host[3 * i], host[3 * i + 1], host[3 * i + 2]] for i in range(self.n)]


def serve(_args):
    setup()
    held = []
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "alloc":
            p = CUdeviceptr()
            rc = cu.cuMemAlloc_v2(byref(p), c_size_t(int(cmd[1])))
            if rc == 0:
                held.append(p.value)
            print(rc, flush=True)
        elif cmd[0] == "free":
            print(cu.cuMemFree_v2(CUdeviceptr(held.pop())) if held else -1, flush=True)
        elif cmd[0] == "meminfo":
            free, total = c_size_t(), c_size_t()
            check(cu.cuMemGetInfo_v2(byref(free), byref(total)), "cuMemGetInfo_v2")
            print(free.value, total.value, flush=True)


def chunks(args):
    size, barrier = int(args[0]), args[1]
    setup()
    while not os.path.exists(barrier):
        time.sleep(0.002)
    held, rc = 0, 0
    while True:
        p = CUdeviceptr()
        rc = cu.cuMemAlloc_v2(byref(p), c_size_t(size))
        if rc != 0:
            break
        held += 1
    print(json.dumps({"pid": os.getpid(), "held": held, "refused_with": rc}), flush=True)
    sys.stdin.read()


def idle(args):
    seconds, kernels, us, sleep_ms = float(args[0]), int(args[1]), int(args[2]), float(args[3])
    setup()
    spin = Spin(kernels)
    t0 = time.monotonic()
    bursts = 0
    while time.monotonic() - t0 < seconds:
        for k in range(kernels):
            check(spin.launch(None, k, us), "cuLaunchKernel")
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        bursts += 1
        time.sleep(sleep_ms / 1000)
    print(json.dumps({"bursts": bursts, "launches": bursts * kernels}))


def thread_stream(ctx):
    """In a new thread: make ctx current and create a non-blocking stream of its own."""
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), NON_BLOCKING), "cuStreamCreate")
    return s


def capture(args):
    seconds = float(args[0])
    ctx = setup()
    spin = Spin(64)
    out = {"pid": os.getpid(), "gated_launches": 0, "gated_errors": []}
    started = threading.Event()

    def gated():
        # Always busy on its own non-blocking stream: its token expires (drains) while the capture is open.
        s = thread_stream(ctx)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for slot in (40, 41):
                rc = spin.launch(s, slot, 2000)
                out["gated_launches"] += 1
                if rc:
                    out["gated_errors"].append(rc)
            rc = cu.cuStreamSynchronize(s)
            if rc:
                out["gated_errors"].append(rc)
            started.set()
        cu.cuStreamDestroy_v2(s)

    # The capture begins before this process ever held a token: the first launches into it must pass
    # without one. Then the other thread starts launching (gated) while the capture stays open.
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), NON_BLOCKING), "cuStreamCreate")
    out["begin"] = cu.cuStreamBeginCapture_v2(s, GLOBAL)
    latencies, rcs = [], []

    def captured_launch(k):
        t1 = time.monotonic()
        rcs.append(spin.launch(s, k, 1000))
        latencies.append(time.monotonic() - t1)

    for k in range(4):
        captured_launch(k)
    t = threading.Thread(target=gated)
    t.start()
    started.wait(30)
    for k in range(4, 8):
        time.sleep(seconds / 8)        # the capture stays open across several slots of the other thread
        captured_launch(k)
    st = c_int(-1)
    cu.cuStreamIsCapturing(s, byref(st))
    out["status_before_end"] = st.value
    g = c_void_p()
    out["end"] = cu.cuStreamEndCapture(s, byref(g))
    out["capture_launch_rcs"] = rcs
    out["capture_launch_max_ms"] = max(latencies) * 1000
    out["ran_before_graph_launch"] = any(r[2] for r in spin.read()[:8])
    if out["end"] == 0:
        ex = c_void_p()
        out["instantiate"] = cu.cuGraphInstantiateWithFlags(byref(ex), g, ctypes.c_ulonglong(0))
        out["graph_launch"] = cu.cuGraphLaunch(ex, s)
        out["sync"] = cu.cuStreamSynchronize(s)
        out["graph_results"] = [r[0] for r in spin.read()[:8]]
    t.join()
    print(json.dumps(out))


def capture_race(args):
    captures = int(args[0])
    ctx = setup()
    spin = Spin(4)
    out = {"pid": os.getpid(), "launches": 0, "launch_errors": []}
    stop = threading.Event()

    def launcher():
        s = thread_stream(ctx)
        while not stop.is_set():
            rc = spin.launch(s, 1, 300)
            out["launches"] += 1
            if rc:
                out["launch_errors"].append(rc)
        cu.cuStreamSynchronize(s)

    t = threading.Thread(target=launcher)
    t.start()
    time.sleep(0.3)
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), NON_BLOCKING), "cuStreamCreate")
    ends = []
    for _ in range(captures):
        begin = cu.cuStreamBeginCapture_v2(s, GLOBAL)
        launched = spin.launch(s, 2, 100)
        time.sleep(0.001)
        g = c_void_p()
        ends.append((begin, launched, cu.cuStreamEndCapture(s, byref(g))))
        if g.value:
            cu.cuGraphDestroy(g)
        time.sleep(0.001)
    stop.set()
    t.join()
    out["bad"] = [e for e in ends if e != (0, 0, 0)]
    print(json.dumps(out))


def reset(args):
    kernels = int(args[0])
    stats_of_hook = ctypes.CDLL(None).gemhook_stats     # the preloaded hook's counters, in this process

    def markers():
        buf = ctypes.create_string_buffer(4096)
        stats_of_hook(buf, ctypes.c_size_t(4096))
        return int(dict(kv.split("=") for kv in buf.value.decode().split())["markers"])

    out = {"pid": os.getpid(), "launch_errors": []}
    for phase in ("before", "after"):
        setup()
        spin = Spin(2)
        start = markers()
        for _ in range(kernels):            # on the legacy stream: the same handle after the reset
            rc = spin.launch(None, 0, 100)
            if rc:
                out["launch_errors"].append(rc)
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        out[phase] = markers() - start
        if phase == "before":
            dev = c_int()
            check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
            check(cu.cuDevicePrimaryCtxReset_v2(dev), "cuDevicePrimaryCtxReset_v2")
    print(json.dumps(out))


def fork(args):
    forks = int(args[0])
    ctx = setup()
    spin = Spin(4)
    stop = threading.Event()
    parent = {"launches": 0, "errors": []}

    def busy():
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        while not stop.is_set():
            rc = spin.launch(None, 0, 1000)
            parent["launches"] += 1
            if rc:
                parent["errors"].append(rc)
            if parent["launches"] % 4 == 0:
                rc = cu.cuCtxSynchronize()
                if rc:
                    parent["errors"].append(rc)

    t = threading.Thread(target=busy)
    t.start()
    children = []
    for i in range(forks):
        time.sleep(0.05)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # A fork child of an initialised process: CUDA must fail (not hang), and exit must be clean.
            res = {"launch": spin.launch(None, 1, 1000), "sync": cu.cuCtxSynchronize()}
            os.write(w, json.dumps(res).encode())
            sys.stdout.flush()
            sys.exit(0)     # a normal exit: atexit handlers and the hook's destructor run
        os.close(w)
        t0 = time.monotonic()
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            res = json.loads(f.read() or "{}")
        res.update(pid=pid, status=status, seconds=time.monotonic() - t0)
        children.append(res)
    time.sleep(0.1)
    stop.set()
    t.join()
    after = parent["launches"]
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    ok = sum(1 for r in spin.read()[:1] if r[2])
    print(json.dumps({"pid": os.getpid(), "children": children, "parent_launches": after,
                      "parent_errors": parent["errors"], "parent_result_written": ok}))


def phases(args):
    setup()
    spin = Spin(1)
    waits = []
    for i, phase in enumerate(args):
        kernels, us, every = (int(x) for x in phase.split(":"))
        for k in range(kernels):
            check(spin.launch(None, 0, us), "cuLaunchKernel")
            if (k + 1) % every == 0:
                t0 = time.monotonic()
                check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
                if i == len(args) - 1:
                    waits.append((time.monotonic() - t0) * 1000)
    print(json.dumps({"pid": os.getpid(), "waits_ms": waits}))


def graphmix(args):
    seconds = float(args[0])
    (g, gus), (e, eus) = (tuple(int(x) for x in a.split(":")) for a in args[1:3])
    every = int(args[3])
    setup()
    spin = Spin(1)
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), NON_BLOCKING), "cuStreamCreate")
    check(cu.cuStreamBeginCapture_v2(s, GLOBAL), "cuStreamBeginCapture_v2")
    for _ in range(g):
        check(spin.launch(s, 0, gus), "cuLaunchKernel (captured)")
    graph, ex = c_void_p(), c_void_p()
    check(cu.cuStreamEndCapture(s, byref(graph)), "cuStreamEndCapture")
    check(cu.cuGraphInstantiateWithFlags(byref(ex), graph, ctypes.c_ulonglong(0)), "cuGraphInstantiateWithFlags")
    rounds, ends = 0, time.monotonic() + seconds
    while time.monotonic() < ends:
        check(cu.cuGraphLaunch(ex, s), "cuGraphLaunch")
        for _ in range(e):
            check(spin.launch(s, 0, eus), "cuLaunchKernel")
        rounds += 1
        if rounds % every == 0:
            check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
    check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
    print(json.dumps({"pid": os.getpid(), "rounds": rounds}))


def threads(args):
    seconds, n, us, every = float(args[0]), int(args[1]), int(args[2]), int(args[3])
    ctx = setup()
    spin = Spin(n)
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), NON_BLOCKING), "cuStreamCreate")
    ends = time.monotonic() + seconds
    counts, errors = [0] * n, []

    def launcher(i):
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        while time.monotonic() < ends:
            long = i == 0 and every > 0 and counts[i] % every == every - 1
            rc = spin.launch(s, i, 4 * us if long else us)
            counts[i] += 1
            if rc:
                errors.append(rc)
                return

    ts = [threading.Thread(target=launcher, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
    print(json.dumps({"pid": os.getpid(), "launches": counts, "errors": errors}))


{"serve": serve, "chunks": chunks, "idle": idle, "capture": capture, "capture_race": capture_race,
 "reset": reset, "fork": fork, "phases": phases, "graphmix": graphmix, "threads": threads}[sys.argv[1]](sys.argv[2:])
'''


def all_registered(be: Backend) -> bool:
    """Whether gem-schd answers and every group's pod manager is registered with it (after a restart, say)."""
    from gemini.wire.sched import StatusReply, StatusRequest
    from tests.schd_inproc import FakePodManager
    try:
        with FakePodManager(f"tcp://127.0.0.1:{be.port}") as peer:
            reply = peer.request(StatusRequest(), 2.0)
    except Exception:   # still starting
        return False
    return isinstance(reply, StatusReply) and all(g["connected"] for g in reply.groups)
