"""tools/launch-command.py and tools/launch-backend.py, run as a user runs them (subprocesses, real sockets)."""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gemini.launch import command
from bench.harness import children_of, cmdline, free_port_base
from pmgr_helpers import REPO_ROOT, BackgroundPmgr, BlockingHook, free_port
from gemini.wire import hook as hp

LAUNCH_COMMAND = str(REPO_ROOT / "tools" / "launch-command.py")
LAUNCH_BACKEND = str(REPO_ROOT / "tools" / "launch-backend.py")
GROUP = "g"

# The child: dumps its argv, environment, pid and process group as JSON to $DUMP_TO.
DUMP = textwrap.dedent("""
    import json, os, sys
    with open(os.environ["DUMP_TO"], "w") as f:
        json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid(),
                   "pgid": os.getpgrp(), "ppid": os.getppid()}, f)
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
""")

NASTY_ARGS = ["a b", "it's", '"quoted"', "$HOME", "${PATH}", "`id`", "$(id)", "line\nbreak", "", "  ",
              "--", "--name", "*", "\\", "tab\there", "ünïcødé", ";", "|", "&&", "-"]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "POD_NAME", "POD_MANAGER_IP", "POD_MANAGER_PORT")
           and not k.startswith("GEMINI_")}
    env.update(extra)
    return env


@pytest.fixture
def fake_hook(tmp_path) -> Path:
    # Any file serves as the hook here: the loader warns that it cannot preload it and goes on.
    path = tmp_path / "libgemhook.so.1"
    path.write_bytes(b"not really a library")
    return path


@pytest.fixture
def pmgr():
    bg = BackgroundPmgr(GROUP, {GROUP: 12345})
    yield bg
    bg.close()


@pytest.fixture
def dump_script(tmp_path) -> Path:
    path = tmp_path / "dump.py"
    path.write_text(DUMP)
    return path


def launch(args: list[str], env: dict, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LAUNCH_COMMAND, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


# --- launch-command ------------------------------------------------------------------------------

def test_arguments_arrive_intact_and_the_environment_is_set(pmgr, fake_hook, dump_script, tmp_path):
    out = tmp_path / "dump.json"
    env = clean_env(GEMINI_HOOK_LIB=str(fake_hook), DUMP_TO=str(out), LD_PRELOAD="/opt/other.so")
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", sys.executable, str(dump_script),
                  *NASTY_ARGS], env)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["argv"] == NASTY_ARGS
    child_env = got["env"]
    assert child_env["LD_PRELOAD"] == f"{fake_hook}:/opt/other.so"
    for var in ("POD_NAME", "GEMINI_POD_NAME"):
        assert child_env[var] == GROUP
    for var in ("POD_MANAGER_IP", "GEMINI_POD_MANAGER_IP"):
        assert child_env[var] == "127.0.0.1"
    for var in ("POD_MANAGER_PORT", "GEMINI_POD_MANAGER_PORT"):
        assert child_env[var] == str(pmgr.port)
    # its own process group, started by launch-command itself
    assert got["pgid"] == got["pid"]


def test_ld_preload_is_just_the_hook_when_there_was_none(pmgr, fake_hook, dump_script, tmp_path):
    out = tmp_path / "dump.json"
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", sys.executable, str(dump_script)],
                 clean_env(GEMINI_HOOK_LIB=str(fake_hook), DUMP_TO=str(out)))
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["env"]["LD_PRELOAD"] == str(fake_hook)


def test_env_vars_give_name_and_port(pmgr, fake_hook, dump_script, tmp_path):
    out = tmp_path / "dump.json"
    env = clean_env(GEMINI_HOOK_LIB=str(fake_hook), DUMP_TO=str(out), POD_NAME=GROUP,
                    POD_MANAGER_PORT=str(pmgr.port))
    res = launch(["--", sys.executable, str(dump_script), "x"], env)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["argv"] == ["x"]


@pytest.mark.parametrize("var,value", [("POD_MANAGER_PORT", "abc"), ("GEMINI_POD_MANAGER_PORT", "70000"),
                                       ("POD_MANAGER_PORT", "0")])
def test_a_bad_port_variable_is_named_not_replaced(fake_hook, var, value):
    res = launch(["--name", GROUP, "--", "true"], clean_env(GEMINI_HOOK_LIB=str(fake_hook), **{var: value}))
    assert res.returncode == 2
    assert f"{var}={value!r} is not usable" in res.stderr and "not a port number" in res.stderr, res.stderr


def test_shell_mode_runs_through_sh(pmgr, fake_hook, dump_script, tmp_path):
    out = tmp_path / "dump.json"
    env = clean_env(GEMINI_HOOK_LIB=str(fake_hook), DUMP_TO=str(out))
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--shell", "--",
                  f"'{sys.executable}' '{dump_script}'", '"$POD_NAME"', "a|b", "|| true"], env)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["argv"] == [GROUP, "a"]


@pytest.mark.parametrize("code", [0, 3, 255])
def test_exit_code_is_propagated(pmgr, fake_hook, dump_script, tmp_path, code):
    env = clean_env(GEMINI_HOOK_LIB=str(fake_hook), DUMP_TO=str(tmp_path / "d.json"), EXIT_WITH=str(code))
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", sys.executable, str(dump_script)], env)
    assert res.returncode == code


def test_death_by_signal_is_128_plus_the_signal(pmgr, fake_hook):
    env = clean_env(GEMINI_HOOK_LIB=str(fake_hook))
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", sys.executable, "-c",
                  "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], env)
    assert res.returncode == 128 + signal.SIGKILL


def test_missing_program_is_127(pmgr, fake_hook):
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", "/no/such/program"],
                 clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
    assert res.returncode == 127 and "/no/such/program" in res.stderr


def test_no_pod_manager_is_a_clear_error(fake_hook):
    port = free_port()
    res = launch(["--name", GROUP, "--port", str(port), "--", "true"], clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
    assert res.returncode == 2
    assert f"no pod manager listening on 127.0.0.1:{port} (is launch-backend running?)" in res.stderr


def test_wrong_group_names_the_group_the_port_serves(pmgr, fake_hook, tmp_path):
    marker = tmp_path / "ran"
    res = launch(["--name", "other", "--port", str(pmgr.port), "--", "touch", str(marker)],
                 clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
    assert res.returncode == 2
    assert "serves group 'g'" in res.stderr and "'other'" in res.stderr
    assert not marker.exists()


def test_group_unknown_to_the_scheduler_is_a_clear_error(fake_hook, tmp_path):
    bg = BackgroundPmgr("ghost", {"real": 1})
    try:
        marker = tmp_path / "ran"
        res = launch(["--name", "ghost", "--port", str(bg.port), "--", "touch", str(marker)],
                     clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
        assert res.returncode == 2
        assert "gem-schd does not know group 'ghost'" in res.stderr and "resource-config.txt" in res.stderr
        assert not marker.exists()
    finally:
        bg.close()


def test_silent_listener_times_out(fake_hook):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        start = time.monotonic()
        res = launch(["--name", GROUP, "--port", str(port), "--handshake-timeout", "1", "--", "true"],
                     clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
    assert res.returncode == 2 and "no answer from" in res.stderr
    assert time.monotonic() - start < 10


def test_missing_hook_is_a_clear_error(pmgr, tmp_path):
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--", "true"],
                 clean_env(GEMINI_HOOK_LIB=str(tmp_path / "nope.so")))
    assert res.returncode == 2 and "GEMINI_HOOK_LIB" in res.stderr


def test_usage_errors():
    res = launch(["--name", GROUP, "--port", "1"], clean_env())
    assert res.returncode == 2 and "no command" in res.stderr
    res = launch(["--port", "1", "--", "true"], clean_env())
    assert res.returncode == 2 and "--name" in res.stderr


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie that nobody reaped yet is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


FAMILY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if len(sys.argv) > 2 and sys.argv[2] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kid = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if "stubborn" in sys.argv else "")
                            + "time.sleep(120)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {kid.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)
""")


@pytest.mark.parametrize("stubborn", [False, True], ids=["polite", "ignores-sigterm"])
def test_timeout_ends_the_whole_process_group(pmgr, fake_hook, tmp_path, stubborn):
    pids_file = tmp_path / "pids"
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    start = time.monotonic()
    res = launch(["--name", GROUP, "--port", str(pmgr.port), "--timeout", "1.5", "--kill-grace", "1", "--",
                  sys.executable, str(script), str(pids_file)] + (["stubborn"] if stubborn else []),
                 clean_env(GEMINI_HOOK_LIB=str(fake_hook)))
    elapsed = time.monotonic() - start
    assert res.returncode == 124, res.stderr
    assert elapsed < 15
    pids = [int(p) for p in pids_file.read_text().split()]
    deadline = time.monotonic() + 5
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_alive(p) for p in pids)


def test_signals_are_forwarded(pmgr, fake_hook, tmp_path):
    ready = tmp_path / "ready"
    script = tmp_path / "trap.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, time, pathlib
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
        pathlib.Path({str(ready)!r}).write_text("x")
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, LAUNCH_COMMAND, "--name", GROUP, "--port", str(pmgr.port), "--",
                             sys.executable, str(script)], env=clean_env(GEMINI_HOOK_LIB=str(fake_hook)),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 42
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ignored_signals(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")


def _program_of(pid: int, deadline: float) -> int:
    """The pid of launch-command's program (its only child), once it runs."""
    while time.monotonic() < deadline:
        kids = children_of(pid)
        if kids and cmdline(kids[0])[:1] == ["sleep"]:
            return kids[0]
        time.sleep(0.02)
    raise AssertionError("the program did not start")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigint_reaches_the_program_of_a_background_job(pmgr, fake_hook, tmp_path):
    # `launch-command ... &` in a script: the shell starts it with SIGINT (and SIGQUIT) ignored. A SIGINT sent to
    # launch-command must still end the program, which must not have inherited the ignore.
    pidfile, rcfile = tmp_path / "pid", tmp_path / "rc"
    script = f'"$@" & echo $! > {pidfile}; wait $!; echo $? > {rcfile}'
    sh = subprocess.Popen(["sh", "-c", script, "sh", sys.executable, LAUNCH_COMMAND, "--name", GROUP, "--port",
                           str(pmgr.port), "--", "sleep", "60"], env=clean_env(GEMINI_HOOK_LIB=str(fake_hook)),
                          stderr=subprocess.PIPE, text=True)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert sh.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        launcher = int(pidfile.read_text())
        started.append(launcher)
        program = _program_of(launcher, deadline)
        started.append(program)
        assert signal.SIGINT not in _ignored_signals(program)
        os.kill(launcher, signal.SIGINT)
        assert sh.wait(15) == 0
        assert rcfile.read_text().strip() == "130"          # the program died of the SIGINT
    finally:
        for pid in reversed(started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if sh.poll() is None:
            sh.kill()
            sh.wait()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_nohup_stays_nohup(pmgr, fake_hook):
    # SIGHUP ignored at start (nohup) is not forwarded, and the program keeps ignoring it.
    proc = subprocess.Popen(["sh", "-c", 'trap "" HUP; exec "$@"', "sh", sys.executable, LAUNCH_COMMAND, "--name",
                             GROUP, "--port", str(pmgr.port), "--", "sleep", "60"],
                            env=clean_env(GEMINI_HOOK_LIB=str(fake_hook)), stderr=subprocess.PIPE, text=True)
    try:
        program = _program_of(proc.pid, time.monotonic() + 20)
        assert signal.SIGHUP in _ignored_signals(program) and signal.SIGINT not in _ignored_signals(program)
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_child_env_and_exit_code_units():
    env = command.child_env("grp", "10.0.0.1", 7, "/h.so", base={"LD_PRELOAD": "/a.so /b.so", "X": "1"})
    assert env["LD_PRELOAD"] == "/h.so:/a.so /b.so" and env["X"] == "1"
    assert env["GEMINI_POD_MANAGER_PORT"] == env["POD_MANAGER_PORT"] == "7"
    assert command.exit_code(-signal.SIGTERM) == 143 and command.exit_code(5) == 5
    ns = command.parse_args(["--name", "g", "--port", "9", "--", "prog", "--", "--port"])
    assert ns.command == ["prog", "--", "--port"] and ns.port == 9
    # CMD without a leading "--": the program's own "--" stays its argument (it took the program's place before:
    # `python train.py -- --lr 1` ran `--lr 1`)
    ns = command.parse_args(["--name", "g", "--port", "9", "python", "train.py", "--", "--lr", "1"])
    assert ns.command == ["python", "train.py", "--", "--lr", "1"] and ns.port == 9


# --- launch-backend ------------------------------------------------------------------------------

def _scheduler_available() -> bool:
    return bool(os.environ.get("GEMINI_TEST_SCHD_PATH")) or importlib.util.find_spec("gemini.scheduler.cli") \
        is not None


needs_scheduler = pytest.mark.skipif(not _scheduler_available(),
                                     reason="gem-schd (gemini.scheduler.cli) is not available in this tree")


def _schd_args() -> list[str]:
    path = os.environ.get("GEMINI_TEST_SCHD_PATH")     # another gem-schd build to test against
    return ["--schd-path", path] if path else []


CONFIG = textwrap.dedent("""
    [alpha]
    MinUtil = 0.2
    MaxUtil = 0.5
    MemoryLimit = 1MiB

    [beta]
    MaxUtil = 1
    MemoryLimit = 2MiB
""")


def _base_port(span: int = 8) -> int:
    """A port P with P..P+span free (best effort: checked, not reserved), below the kernel's ephemeral ports and in
    this xdist worker's share (bench/harness.py). An ephemeral one (the kernel's pick for port 0) was taken by an
    outgoing connection between the check and the pod manager's bind: in a full local run the added group's pod
    manager found its port in use for the test's 10 s."""
    return free_port_base(span)


class Backend:
    """launch-backend as a subprocess, with its stdout read line by line."""

    def __init__(self, tmp_path: Path, config: str = CONFIG, extra: list[str] | None = None):
        self.dir = tmp_path
        self.config = tmp_path / "resource-config.txt"
        self.config.write_text(config)
        self.ports_file = tmp_path / "ports.json"
        self.port = _base_port()
        self.proc = subprocess.Popen(
            [sys.executable, LAUNCH_BACKEND, "--port", str(self.port), "--config", str(self.config),
             "--ports-file", str(self.ports_file), "--log-dir", str(tmp_path / "logs"), "--kill-grace", "2",
             *_schd_args(), *(extra or [])],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def read_until(self, predicate, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"launch-backend printed {self.lines}; stderr: {self.stderr_now()}")

    def stderr_now(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()

    def children(self) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _hello(port: int, group: str) -> hp.Message:
    h = BlockingHook(port)
    try:
        return h.call(hp.Hello(pid=os.getpid(), pod_name=group))
    finally:
        h.close()


@pytest.fixture
def backend(tmp_path):
    """launch-backend started with CONFIG and ready; stopped (and checked to stop cleanly) afterwards."""
    b = Backend(tmp_path)
    try:
        b.read_until(lambda line: line == "ready")
        yield b
    finally:
        assert b.stop(signal.SIGTERM) == 0


def test_backend_busy_port_is_refused_before_starting_anything(tmp_path):
    (tmp_path / "c.txt").write_text(CONFIG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        # the busy port is the second group's
        res = subprocess.run([sys.executable, LAUNCH_BACKEND, "--port", str(busy - 2), "--config",
                              str(tmp_path / "c.txt")], env=clean_env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert str(busy) in res.stderr and "'beta'" in res.stderr and "in use" in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("content", [None, "[alpha]\nMaxUtil = 2\n"], ids=["missing", "bad"])
def test_backend_missing_or_bad_config_is_a_clear_error(tmp_path, content):
    path = tmp_path / "resource-config.txt"
    if content is not None:
        path.write_text(content)
    res = subprocess.run([sys.executable, LAUNCH_BACKEND, "--port", str(_base_port()), "--config", str(path)],
                         env=clean_env(), capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert str(path) in res.stderr
    if content is not None:
        assert f"{path}:2:" in res.stderr


@needs_scheduler
def test_backend_starts_everything_prints_the_table_and_stops_without_orphans(tmp_path):
    b = Backend(tmp_path)
    try:
        b.read_until(lambda line: line == "ready")
        rows = [line.split() for line in b.lines if line.split()[:1] in (["alpha"], ["beta"])]
        assert rows == [["alpha", str(b.port + 1)], ["beta", str(b.port + 2)]]
        assert json.loads(b.ports_file.read_text()) == {"alpha": b.port + 1, "beta": b.port + 2}
        ack = _hello(b.port + 1, "alpha")
        assert isinstance(ack, hp.HelloAck) and ack.mem_limit == 1 << 20
        ack = _hello(b.port + 2, "beta")
        assert isinstance(ack, hp.HelloAck) and ack.mem_limit == 2 << 20
        kids = b.children()
        assert len(kids) == 3
    finally:
        code = b.stop(signal.SIGINT)
    assert code == 0
    time.sleep(0.2)
    assert not any(_pid_alive(p) for p in kids)
    for port in (b.port, b.port + 1, b.port + 2):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


@needs_scheduler
def test_backend_follows_config_edits(backend):
    b = backend
    # add a group (write to a temp file, then rename over: an editor's save)
    tmp = b.dir / "new.txt"
    tmp.write_text(CONFIG + "\n[gamma]\nMemoryLimit = 3MiB\n")
    os.replace(tmp, b.config)
    line = b.read_until(lambda text: text.startswith("added "))
    assert line == f"added gamma {b.port + 3}"
    deadline = time.monotonic() + 10
    while True:     # gem-schd reloads the file by itself; the pod manager registers once it has
        # "added" follows the pod manager's first listen or its failure to listen (supervision restarts it): a
        # refusal is retried too
        try:
            ack = _hello(b.port + 3, "gamma")
        except OSError as exc:
            ack = exc
        if isinstance(ack, hp.HelloAck) and ack.mem_limit:
            break
        assert time.monotonic() < deadline, ack
        time.sleep(0.2)
    assert ack.mem_limit == 3 << 20
    assert json.loads(b.ports_file.read_text())["gamma"] == b.port + 3
    # a bad edit changes nothing
    b.config.write_text(CONFIG + "\n[gamma]\nMaxUtil = 7\n")
    time.sleep(0.6)
    assert isinstance(_hello(b.port + 3, "gamma"), hp.HelloAck)
    # remove a group: its pod manager stops
    b.config.write_text("[beta]\nMemoryLimit = 2MiB\n[gamma]\n")
    assert b.read_until(lambda text: text.startswith("removed ")) == f"removed alpha {b.port + 1}"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", b.port + 1), timeout=1).close()
    assert json.loads(b.ports_file.read_text()) == {"beta": b.port + 2, "gamma": b.port + 3}


@needs_scheduler
def test_a_removed_groups_processes_are_told_why_its_pod_manager_stops(backend):
    b = backend
    hook = BlockingHook(b.port + 1, timeout=20)
    try:
        assert isinstance(hook.call(hp.Hello(pid=1, pod_name="alpha")), hp.HelloAck)
        b.config.write_text("[beta]\nMemoryLimit = 2MiB\n")
        seen = []
        with pytest.raises(ConnectionError):
            while True:
                seen.append(hook.recv())
    finally:
        hook.close()
    # the last word before the connection closed (gem-schd's own refusal may come first: it is about the same)
    seq, last = seen[-1]
    assert seq == 0 and isinstance(last, hp.Error) and last.code == hp.ErrorCode.UNKNOWN_GROUP, seen
    assert last.message == "group 'alpha' was removed from the config: its pod manager has stopped"


@needs_scheduler
def test_backend_restarts_a_pod_manager_that_dies(backend):
    b = backend
    before = set(b.children())
    victim = next(p for p in before
                  if "alpha" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while True:
        try:
            if isinstance(_hello(b.port + 1, "alpha"), hp.HelloAck) and victim not in b.children():
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "alpha's pod manager did not come back"
        time.sleep(0.1)
    assert len(b.children()) == 3


@needs_scheduler
def test_backend_end_to_end_token_and_memory_through_the_real_scheduler(backend):
    b = backend
    one, two = BlockingHook(b.port + 1), BlockingHook(b.port + 1)
    try:
        assert isinstance(one.call(hp.Hello(pid=1, pod_name="alpha")), hp.HelloAck)
        assert isinstance(two.call(hp.Hello(pid=2, pod_name="alpha")), hp.HelloAck)
        g1 = one.call(hp.TokenRequest())
        assert isinstance(g1, hp.TokenGrant) and g1.quota_ns > 0, g1
        g2 = two.call(hp.TokenRequest())        # the group's token is shared: same seq, less time
        assert isinstance(g2, hp.TokenGrant) and g2.token_seq == g1.token_seq and g2.quota_ns <= g1.quota_ns
        assert isinstance(one.call(hp.TokenRelease(token_seq=g1.token_seq)), hp.Ack)
        assert isinstance(two.call(hp.TokenRelease(token_seq=g1.token_seq)), hp.Ack)
        g3 = one.call(hp.TokenRequest())        # released early: a new slot comes at once
        assert isinstance(g3, hp.TokenGrant) and g3.token_seq != g1.token_seq
        assert one.call(hp.MemAlloc(bytes=1 << 20)).verdict == hp.MemVerdict.OK
        assert two.call(hp.MemAlloc(bytes=1)).verdict == hp.MemVerdict.DENIED
    finally:
        one.close()
        two.close()


@needs_scheduler
def test_backend_restarts_the_scheduler_and_pod_managers_carry_on(backend):
    b = backend
    hook = BlockingHook(b.port + 2, timeout=20)
    try:
        assert isinstance(hook.call(hp.Hello(pid=1, pod_name="beta")), hp.HelloAck)
        assert hook.call(hp.MemAlloc(bytes=1000)).verdict == hp.MemVerdict.OK
        schd = next(p for p in b.children()
                    if b"gemini.scheduler" in Path(f"/proc/{p}/cmdline").read_bytes()
                    or b"gem-schd" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(schd, signal.SIGKILL)
        time.sleep(0.2)
        start = time.monotonic()
        grant = hook.call(hp.TokenRequest())     # waits for the restarted scheduler, then goes through
        assert isinstance(grant, hp.TokenGrant), grant
        assert time.monotonic() - start < 15
        assert hook.call(hp.MemInfo()).used == 1000  # the group's accounting survived
    finally:
        hook.close()
