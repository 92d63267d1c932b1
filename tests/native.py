"""Build and locate the native test artifacts: the simulated driver and the C clients.

Plain functions (the lead wires them into fixtures):

    build_native()          run make once per session (quietly); raise with make's output on failure
    sim_lib_dir()           directory holding the simulated libcuda.so.1
    client_path(name)       path of a client: "workload-procaddr", "workload-linked", "pyclient.py", ...
    client_cmd(name, *args) argv for a client (Python clients run with this interpreter)
    sim_env(shm_path, ...)  os.environ copy that runs a child against the simulator

The simulator reads SIMCUDA_* at cuInit. The device count and capacity are
fixed by the first process that creates the shared file, so give every test
its own shm_path (e.g. under pytest's tmp_path).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CLIENTS_SRC = REPO_ROOT / "tests" / "clients"
SIM_MK = REPO_ROOT / "tests" / "simcuda" / "sim.mk"

_lock = threading.Lock()
_built = False


def build_dir() -> Path:
    """make's $(BUILD) (env BUILD, default <repo>/build)."""
    b = Path(os.environ.get("BUILD", "build"))
    return b if b.is_absolute() else REPO_ROOT / b


def build_native() -> None:
    """Build the simulator and the clients, once per process; make does nothing if they are current."""
    global _built
    with _lock:
        if _built:
            return
        cmd = ["make", "--no-print-directory", "-s", "-f", str(SIM_MK), f"BUILD={build_dir()}", "sim", "clients"]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the simulator and clients failed ({' '.join(cmd)}):\n{proc.stdout}")
        _built = True


def sim_lib_dir() -> Path:
    """Directory with the simulated libcuda.so.1 (and libcuda.so)."""
    return build_dir() / "simcuda"


def client_path(name: str) -> Path:
    """A client by name: built C clients live in $(BUILD)/clients, Python ones in tests/clients."""
    if name.endswith(".py"):
        return CLIENTS_SRC / name
    return build_dir() / "clients" / name


def client_cmd(name: str, *args: object) -> list[str]:
    """argv running a client with the given arguments."""
    path = client_path(name)
    head = [sys.executable, str(path)] if name.endswith(".py") else [str(path)]
    return head + [str(a) for a in args]


def sim_env(
    shm_path: str | os.PathLike,
    mem_bytes: int = 16 << 30,
    kernel_us: int = 100,
    trace: str | os.PathLike | None = None,
    devices: int = 1,
    extra: dict | None = None,
) -> dict:
    """A copy of os.environ in which libcuda.so.1 is the simulator, configured by these values.

    Inherited SIMCUDA_* variables are dropped first. `extra` is applied last:
    a value of None removes that variable (e.g. {"LD_PRELOAD": None}).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIMCUDA_")}
    libdir = str(sim_lib_dir())
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + old if old else "")
    env["SIMCUDA_SHM"] = str(shm_path)
    env["SIMCUDA_MEM_BYTES"] = str(int(mem_bytes))
    env["SIMCUDA_KERNEL_US"] = str(int(kernel_us))
    env["SIMCUDA_DEVICES"] = str(int(devices))
    if trace is not None:
        env["SIMCUDA_TRACE"] = str(trace)
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def read_trace(path: str | os.PathLike) -> list[tuple[int, int, int, int, str]]:
    """SIMCUDA_TRACE lines as (pid, device, start_ns, end_ns, name), sorted by start."""
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split(maxsplit=4)
            if len(parts) == 5:
                rows.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4].strip()))
    rows.sort(key=lambda r: r[2])
    return rows
