"""launch-command: run a program as a member of a group, with the gemini hook preloaded.

    launch-command --name NAME [--ipc-dir DIR | --port PORT [--ip IP]] [--timeout S] [--shell]
                   [--torch-empty-cache-on-evict] -- CMD ARGS...

The group's pod manager is reached on the socket transport (the default: --ipc-dir or $GEMINI_IPC_DIR, default
/tmp/gemini/ipc; the program gets GEMINI_IPC_DIR and GEMINI_GROUP_NAME, and its hook finds each GPU's socket
there), or on TCP when --port (or $POD_MANAGER_PORT) is given, as in Gemini v1 (POD_MANAGER_IP/PORT).
Before starting anything it greets the group's pod manager (a HELLO handshake, then closes), so a wrong
port or socket, a group the scheduler does not know, a socket this user may not open, or no pod manager at
all is reported at once instead of by a hook inside the program. The program keeps its argv exactly (no
shell unless --shell) and runs in its own process group, which --timeout ends as a whole. SIGINT, SIGTERM,
SIGHUP and SIGQUIT sent to launch-command are passed on to that group -- SIGINT and SIGTERM also when
launch-command was started with them ignored, as a `launch-command ... &` of a script is (the program then
starts with them at their defaults); an ignored SIGHUP or SIGQUIT (nohup) stays ignored. The exit code is
the program's (128+N if signal N ended it; 124 on --timeout; 2 for launch-command's own errors; 126/127 when
the program cannot be run).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

from pathlib import Path

from gemini import transport
from gemini.wire import hook as hp
from gemini.hookpath import HookNotFound, hook_path
from gemini.podmgr import DEFAULT_IP, ENV_POD_MANAGER_IP, ENV_POD_MANAGER_PORT, ENV_POD_NAME

PROG = "launch-command"
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
HANDSHAKE_TIMEOUT_S = 10.0      # the pod manager may wait up to ~2 s for gem-schd before it answers
KILL_GRACE_S = 3.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Forwarded even when launch-command was started with them ignored. A `launch-command ... &` in a script starts
# with SIGINT ignored (the shell's protection of background jobs from the terminal's Ctrl-C); the program runs in
# a process group of its own, which the terminal never signals, so passing SIGINT on is launch-command's decision,
# and the program must not inherit the ignore or it would never stop on one. SIGHUP and SIGQUIT ignored at start
# (nohup) stay ignored, for launch-command and the program alike.
ALWAYS_FORWARDED = (signal.SIGINT, signal.SIGTERM)


class LaunchError(Exception):
    """Something launch-command itself cannot do; the text is for the user."""


def _env_setting(names: tuple[str, ...]) -> tuple[str, str] | None:
    """(variable, value) of the first of `names` that is set and not empty."""
    for name in names:
        if os.environ.get(name):
            return name, os.environ[name]
    return None


def _env_first(names: tuple[str, ...]) -> str | None:
    found = _env_setting(names)
    return found[1] if found else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --name NAME [--ipc-dir DIR | --port PORT [--ip IP]] [--timeout S] [--shell] -- CMD [ARG...]",
        description="Run CMD in a gemini group: LD_PRELOAD the hook and point it at the group's pod manager.")
    p.add_argument("--name", default=_env_first((transport.ENV_GROUP_NAME,) + ENV_POD_NAME),
                   help="the group (default: $GEMINI_GROUP_NAME or $POD_NAME)")
    p.add_argument("--ipc-dir", default=None, metavar="DIR",
                   help=f"socket transport (the default): the backend's socket directory (default: $GEMINI_IPC_DIR "
                        f"or {transport.DEFAULT_IPC_DIR})")
    p.add_argument("--device-uuid", default=None, metavar="GPU-...",
                   help="socket transport: greet the pod manager of this GPU (default: the 'default' one, else "
                        "the only GPU that serves the group)")
    p.add_argument("--port", type=int, default=None,
                   help="TCP transport: the group's pod manager port (default: $POD_MANAGER_PORT)")
    p.add_argument("--ip", default=None,
                   help=f"TCP transport: the pod manager's address (default: $POD_MANAGER_IP or {DEFAULT_IP})")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help=f"end the program's whole process group after S seconds and exit {EXIT_TIMEOUT}")
    p.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when ending the program (default %(default)s)")
    p.add_argument("--handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT_S, metavar="S",
                   help="give up on the pod manager after S seconds (default %(default)s)")
    p.add_argument("--torch-empty-cache-on-evict", action="store_true",
                   help="unified groups: a Python program that imports torch empties PyTorch's cache before each "
                        "eviction, so cached memory is not swapped (gemini/torch_site/sitecustomize.py)")
    p.add_argument("--shell", action="store_true",
                   help="run CMD ARGS... joined by spaces through /bin/sh -c")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments, after --")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if "--" in argv:    # everything after the first "--" belongs to the program, untouched
        cut = argv.index("--")
        ns = parser.parse_args(argv[:cut])
        # ... unless the program began before it (CMD without a leading "--"): then that "--" is the program's own
        # argument (`python train.py -- --lr 1`), which took the program's place before
        ns.command = ns.command + argv[cut:] if ns.command else argv[cut + 1:]
    else:
        ns = parser.parse_args(argv)
    if not ns.command:
        parser.error("no command given (put it after --)")
    if not ns.name:
        parser.error("--name is required (or set GEMINI_GROUP_NAME or POD_NAME)")
    if len(ns.name.encode()) >= hp.NAME_LEN:
        parser.error(f"--name must be shorter than {hp.NAME_LEN} bytes")
    problem = _choose_transport(ns)
    if problem:
        parser.error(problem)
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error("--timeout must be positive")
    return ns


def _choose_transport(ns: argparse.Namespace) -> str | None:
    """Sockets if --ipc-dir (or $GEMINI_IPC_DIR) is given, TCP if --port/--ip (or $POD_MANAGER_PORT) is; neither:
    sockets in the default directory. Sets ns.ipc_dir, or ns.ip and ns.port. The reason it cannot, or None."""
    tcp_flags = ns.port is not None or ns.ip is not None
    if tcp_flags and ns.ipc_dir is not None:
        return "--ipc-dir and --ip/--port: choose one transport"
    if not tcp_flags and ns.ipc_dir is None:
        env_dir = os.environ.get(transport.ENV_IPC_DIR)
        env_port = _env_setting(ENV_POD_MANAGER_PORT)
        if env_dir:
            ns.ipc_dir = env_dir
        elif env_port:
            try:
                ns.port = transport.parse_port(env_port[1])
            except ValueError as exc:
                return (f"{env_port[0]}={env_port[1]!r} is not usable: {exc}; set it to the group's pod manager "
                        "port or pass --port")
        else:
            ns.ipc_dir = transport.DEFAULT_IPC_DIR
    if ns.ipc_dir is not None:
        if ns.device_uuid:
            try:
                transport.gpu_dir_name(ns.device_uuid)
            except transport.TransportError as exc:
                return f"--device-uuid: {exc}"
        return None
    ns.ip = ns.ip or _env_first(ENV_POD_MANAGER_IP) or DEFAULT_IP
    if ns.port is None:
        return "--port is required with --ip (or set POD_MANAGER_PORT)"
    if not 1 <= ns.port <= 65535:
        return f"--port {ns.port} is not a TCP port"
    return None


def group_socket_for(ipc_dir: str, name: str, device_uuid: str | None) -> Path:
    """The socket to greet: the named GPU's, else the 'default' GPU's, else the one GPU directory that has the
    group's socket (the hook itself finds each GPU's by the GPU's UUID). LaunchError if there is none."""
    if device_uuid:
        return transport.group_socket(ipc_dir, name, device_uuid)
    default = transport.group_socket(ipc_dir, name)
    if os.path.lexists(default):
        return default
    filename = default.name
    try:
        found = sorted(d / filename for d in Path(ipc_dir).iterdir() if os.path.lexists(d / filename))
    except OSError:
        found = []
    if len(found) == 1:
        return found[0]
    if found:
        raise LaunchError(f"group '{name}' is served on several GPUs ({', '.join(p.parent.name for p in found)}): "
                          "name one with --device-uuid")
    raise LaunchError(f"no pod manager socket for group '{name}' in {ipc_dir} (looked for {default}; is "
                      "launch-backend running with this --ipc-dir?)")


def _recv_frame(sock: socket.socket, deadline: float, where: str) -> bytes:
    buf = b""
    while len(buf) < hp.MSG_SIZE:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout
        sock.settimeout(left)
        chunk = sock.recv(hp.MSG_SIZE - len(buf))
        if not chunk:
            raise LaunchError(f"the pod manager at {where} closed the connection during the handshake")
        buf += chunk
    return buf


def _connect(ip: str, port: int, ipc_socket: Path | None, timeout: float) -> socket.socket:
    where = str(ipc_socket) if ipc_socket is not None else f"{ip}:{port}"
    try:
        if ipc_socket is not None:
            return transport.connect_unix(ipc_socket, timeout)
        return socket.create_connection((ip, port), timeout=timeout)
    except (ConnectionRefusedError, FileNotFoundError):
        raise LaunchError(f"no pod manager listening on {where} (is launch-backend running?)") from None
    except PermissionError:
        raise LaunchError(f"this user (uid {os.geteuid()}) may not open {where}: the group's socket is not "
                          "open to it (see SocketOwner, SocketGroup, SocketMode in the config)") from None
    except socket.timeout:
        raise LaunchError(f"connecting to the pod manager at {where} timed out after {timeout:g} s") from None
    except OSError as exc:
        raise LaunchError(f"cannot reach a pod manager at {where}: {exc.strerror or exc}") from None


def handshake(ip: str, port: int, name: str, timeout: float = HANDSHAKE_TIMEOUT_S,
              ipc_socket: Path | None = None) -> hp.HelloAck:
    """Greet the pod manager (at ip:port, or on the Unix socket `ipc_socket`) as a member of `name`. Returns its
    HELLO_ACK or raises LaunchError."""
    where = str(ipc_socket) if ipc_socket is not None else f"{ip}:{port}"
    deadline = time.monotonic() + timeout
    sock = _connect(ip, port, ipc_socket, timeout)
    with sock:
        try:
            sock.sendall(hp.encode(hp.Hello(pid=os.getpid(), pod_name=name), 1))
            frame = _recv_frame(sock, deadline, where)
        except socket.timeout:
            raise LaunchError(f"no answer from {where} within {timeout:g} s (is it a gem-pmgr?)") from None
        except OSError as exc:
            raise LaunchError(f"the handshake with {where} failed: {exc.strerror or exc}") from None
    try:
        _, reply = hp.decode(frame, hp.PMGR_TO_HOOK)
    except hp.ProtocolError as exc:
        raise LaunchError(f"{where} does not speak the gemini protocol: {exc.message}") from None
    if isinstance(reply, hp.HelloAck):
        if reply.group != name:
            raise LaunchError(f"{where} serves group '{reply.group}', not '{name}'")
        return reply
    if isinstance(reply, hp.Error):
        if reply.code == hp.ErrorCode.GROUP_MISMATCH:
            raise LaunchError(f"{where} is not the pod manager of group '{name}': {reply.message}")
        if reply.code == hp.ErrorCode.UNKNOWN_GROUP:
            raise LaunchError(f"gem-schd does not know group '{name}': {reply.message}")
        if reply.code == hp.ErrorCode.REFUSED:
            raise LaunchError(f"the pod manager at {where} refused this process: {reply.message}")
        code = hp.ErrorCode(reply.code).name if reply.code in hp.ErrorCode._value2member_map_ else reply.code
        raise LaunchError(f"the pod manager at {where} refused the handshake ({code}): {reply.message}")
    raise LaunchError(f"{where} answered HELLO with {type(reply).__name__}")


TORCH_SITE_DIR = Path(__file__).resolve().parent.parent / "torch_site"
ENV_TORCH_EMPTY_CACHE = "GEMINI_TORCH_EMPTY_CACHE_ON_EVICT"


def torch_delegate_env(env: dict) -> None:
    """Load gemini's eviction delegate into the program's Python once it imports torch: its sitecustomize directory
    first on PYTHONPATH (it runs the program's own sitecustomize too) and the variable that turns it on."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(TORCH_SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(TORCH_SITE_DIR)] + rest)
    env[ENV_TORCH_EMPTY_CACHE] = "1"


def child_env(name: str, ip: str | None, port: int | None, hook: str, base: dict | None = None,
              ipc_dir: str | None = None, torch_empty_cache: bool = False) -> dict:
    """The program's environment: the hook first in LD_PRELOAD, and where its pod manager is (GEMINI_IPC_DIR and
    GEMINI_GROUP_NAME on the socket transport, POD_MANAGER_IP/PORT on TCP; the other transport's variables are
    removed, so the hook cannot be pointed elsewhere by what the caller had set); with torch_empty_cache, the
    eviction delegate's sitecustomize (torch_delegate_env)."""
    env = dict(os.environ if base is None else base)
    if torch_empty_cache:
        torch_delegate_env(env)
    existing = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{hook}:{existing}" if existing else hook
    for var in ENV_POD_NAME + (transport.ENV_GROUP_NAME,):
        env[var] = name
    if ipc_dir is not None:
        env[transport.ENV_IPC_DIR] = os.path.abspath(ipc_dir)
        for var in ENV_POD_MANAGER_IP + ENV_POD_MANAGER_PORT + ("GEMINI_POD_MANAGERS",):
            env.pop(var, None)
        return env
    env.pop(transport.ENV_IPC_DIR, None)
    for names, value in ((ENV_POD_MANAGER_IP, ip), (ENV_POD_MANAGER_PORT, str(port))):
        for var in names:
            env[var] = value
    return env


def exit_code(returncode: int) -> int:
    """A Popen returncode as a shell reports it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the program's process group, then SIGKILL whatever is left after `grace` seconds."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()     # reap the leader so that only live members keep the group
        if not _group_alive(pgid):
            return
        time.sleep(0.02)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def _foreground(pgid: int):
    """Hand the controlling terminal to the program's group while it runs (interactive programs keep
    working, Ctrl-C reaches them directly), then take it back. Does nothing without a terminal."""
    fd, ours = None, os.getpgrp()
    try:
        if os.isatty(sys.stdin.fileno()) and os.tcgetpgrp(sys.stdin.fileno()) == ours:
            fd = sys.stdin.fileno()
    except (OSError, ValueError):
        fd = None
    if fd is None:
        yield
        return
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        try:
            os.tcsetpgrp(fd, pgid)
        except OSError:
            pass
        yield
    finally:
        try:
            os.tcsetpgrp(fd, ours)
        except OSError:
            pass
        signal.signal(signal.SIGTTOU, old)


def _forwarding(sig: int) -> bool:
    return sig in ALWAYS_FORWARDED or signal.getsignal(sig) != signal.SIG_IGN


def run_program(argv: list[str], env: dict, timeout: float | None = None, grace: float = KILL_GRACE_S) -> int:
    """Run argv in its own process group; forward signals; apply the timeout. Returns the exit code."""
    child: list[subprocess.Popen] = []
    early: list[int] = []       # signals that came before the program existed

    def forward(signum, _frame):
        if not child:
            early.append(signum)
            return
        try:
            os.killpg(child[0].pid, signum)
        except ProcessLookupError:
            pass

    # Caught before the program starts: a caught signal is reset to its default by exec, so the program does
    # not inherit an ignored SIGINT (see ALWAYS_FORWARDED).
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS if _forwarding(sig)}
    try:
        if sys.version_info >= (3, 11):
            proc = subprocess.Popen(argv, env=env, process_group=0)
        else:
            proc = subprocess.Popen(argv, env=env, preexec_fn=os.setpgrp)  # noqa: PLW1509
    except OSError as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, FileNotFoundError):
            print(f"{PROG}: {argv[0]}: command not found", file=sys.stderr)
            return 127
        if isinstance(exc, PermissionError):
            print(f"{PROG}: {argv[0]}: permission denied", file=sys.stderr)
            return 126
        print(f"{PROG}: {argv[0]}: cannot run: {exc.strerror or exc}", file=sys.stderr)
        return 126
    child.append(proc)
    for signum in early:
        forward(signum, None)
    try:
        with _foreground(proc.pid):
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"{PROG}: {argv[0]} ran for more than {timeout:g} s: ending its process group",
                      file=sys.stderr)
                end_group(proc, grace)
                proc.wait()
                return EXIT_TIMEOUT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code(returncode)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        hook = str(hook_path())
        ipc_socket = group_socket_for(ns.ipc_dir, ns.name, ns.device_uuid) if ns.ipc_dir is not None else None
        handshake(ns.ip, ns.port, ns.name, ns.handshake_timeout, ipc_socket)
    except (LaunchError, HookNotFound, transport.TransportError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    program = ["/bin/sh", "-c", " ".join(ns.command)] if ns.shell else ns.command
    env = child_env(ns.name, ns.ip, ns.port, hook, ipc_dir=ns.ipc_dir,
                    torch_empty_cache=ns.torch_empty_cache_on_evict)
    return run_program(program, env, ns.timeout, ns.kill_grace)
