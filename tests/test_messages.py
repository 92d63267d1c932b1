"""What a hooked program is told when its settings or its group are wrong (issue 17, "what a newcomer meets"): the
real hook on the simulated driver, against a real backend."""
from __future__ import annotations

import subprocess

from bench.harness import Group
from tests.e2e_fixtures import CUDA_ERROR_SYSTEM_NOT_READY, client_argv, run, wait_for


def workload(*args: object) -> list[str]:
    return client_argv("workload-procaddr", "--kernel-us", 1000, "--json", *args)


def test_a_bad_pod_manager_port_is_named_not_replaced(sim):
    """POD_MANAGER_PORT=abc: the CUDA calls that need the pod manager fail at once, saying which variable is
    wrong; the hook does not go looking for the default port's pod manager (some other group's, or none)."""
    env = sim.env(LD_PRELOAD=str(sim.hook), POD_NAME="a", POD_MANAGER_PORT="abc", GEMINI_CONNECT_TIMEOUT_MS=5000)
    r = run(workload("--kernels", 5), env, timeout=60)
    assert r.rc == 1 and r.json["first_error"]["code"] == CUDA_ERROR_SYSTEM_NOT_READY, r
    assert "POD_MANAGER_PORT='abc' is not a port number" in r.err, r
    assert "50052" not in r.err and "unreachable" not in r.err, r
    assert r.wall_s < 4.0, r            # no connect attempts (they would retry for GEMINI_CONNECT_TIMEOUT_MS)


def test_a_process_without_pod_name_is_told_which_group_it_joined(sim, backends):
    be = backends([Group("a", 0.0, 1.0)])
    env = sim.env(LD_PRELOAD=str(sim.hook), POD_MANAGER_PORT=be.ports["a"])      # no POD_NAME
    r = run(workload("--kernels", 5), env, timeout=60)
    assert r.rc == 0, r
    assert "POD_NAME is not set: this process joined group 'a'" in r.err, r


def test_a_process_without_a_group_name_is_told_so_on_the_socket_transport(sim, tmp_path):
    """With GEMINI_IPC_DIR and no group name there is no socket to look for: said at once, not 'unreachable'."""
    env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_IPC_DIR=tmp_path / "ipc", GEMINI_CONNECT_TIMEOUT_MS=5000)
    r = run(workload("--kernels", 5), env, timeout=60)
    assert r.rc == 1 and r.json["first_error"]["code"] == CUDA_ERROR_SYSTEM_NOT_READY, r
    assert "no pod manager to ask: no group name (set GEMINI_GROUP_NAME or POD_NAME" in r.err, r
    assert "unreachable" not in r.err and r.wall_s < 4.0, r


def test_a_removed_groups_process_hears_that_it_was_removed(sim, backends, tmp_path):
    """Its group is removed from the config while it runs: launch-backend stops the group's pod manager, which
    says why first; the hook then says that, not how to start a pod manager."""
    be = backends([Group("a", 0.0, 1.0), Group("b", 0.0, 1.0)])
    env = sim.env(LD_PRELOAD=str(sim.hook), GEMINI_POD_NAME="b", GEMINI_POD_MANAGER_PORT=be.ports["b"],
                  GEMINI_CONNECT_TIMEOUT_MS=1000)    # (b never ran once beside 3 xdist workers: 300 ms may be short)
    trace, err = sim.dir / "b.trace", tmp_path / "b.err"
    with open(err, "w") as errfile:
        p = subprocess.Popen(workload("--seconds", 120, "--sync-every", 1, "--keep-going", "--trace", trace),
                             env=env, stdout=subprocess.DEVNULL, stderr=errfile)
    try:
        try:
            wait_for(lambda: trace.exists() and trace.read_text().count("\n") >= 3, timeout=30, what="b runs kernels")
        except AssertionError as exc:   # (seen once with three xdist workers: say what the hook said)
            raise AssertionError(f"{exc}; the hook said:\n{err.read_text()[-3000:]}\n{be.logs(3000)}") from None
        be.config_path.write_text(Group("a", 0.0, 1.0).ini())
        # the hook tries again on later calls and finds nobody: then it says why
        try:
            wait_for(lambda: "is gone" in err.read_text(), timeout=60, what="the hook's message")
        except AssertionError as exc:   # (seen once beside 2 xdist workers, not reproduced: say what each said)
            raise AssertionError(f"{exc}; the hook said:\n{err.read_text()[-3000:]}\n{be.logs(3000)}") from None
    finally:
        p.kill()
        p.wait()
    text = err.read_text()
    assert "pod manager: group 'b' was removed from the config" in text, text
    assert "group 'b' was removed from the config" in text.split("is gone", 1)[1], text
    assert "launch-backend" not in text, text
