"""The hook's settings file: when it exists, the hook's settings come from it alone and a process cannot switch
the hook off, or point it at a pod manager of its own, by changing its environment (docs/kubernetes.md).

The file's path is a constant of the build (/etc/gemini/hook.conf); these tests use the test build of the hook
(`make testhook`), which also takes the path from GEMINI_TEST_SETTINGS_FILE, and check that the library gem-node
installs is not that build. Each case runs twice: with the file (gated by the file's group) and, as the control
that shows the file is what gates it, with GEMINI_TEST_SETTINGS_FILE naming a file that does not exist (the
environment's settings then apply, as before).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.harness import Group
from tests.e2e_fixtures import CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_SYSTEM_NOT_READY, MiB, Sim, client_argv, run

REPO = Path(__file__).resolve().parent.parent
LIMIT = "64MiB"
ALLOC = 200 * MiB       # past the gated group's limit, within the foreign one's and the device's


@pytest.fixture
def test_hook(test_hook_lib) -> Path:
    return test_hook_lib


@pytest.fixture
def two_backends(backends):
    """The group's real pod manager (a 64 MiB limit) and a foreign one a process could start for itself, with
    a group of the same name and a limit as large as the device."""
    real = backends([Group("g", mem_limit=LIMIT)], transport="ipc")
    foreign = backends([Group("g", mem_limit="1GiB")], transport="ipc")
    return real, foreign


def settings_file(path: Path, **values: object) -> Path:
    path.write_text("# written by the test, as gem-node writes one per container\n"
                    + "".join(f"{k} = {v}\n" for k, v in values.items()))
    return path


def alloc(sim: Sim, env: dict) -> dict:
    r = run(client_argv("pyclient.py", "--kernels", 2, "--alloc", ALLOC, "--json"), env, timeout=60)
    assert r.json is not None, r
    return r.json["alloc"]


def test_the_environment_cannot_point_the_hook_at_another_pod_manager(tmp_path, test_hook, two_backends):
    real, foreign = two_backends
    sim = Sim(tmp_path / "sim", test_hook)
    conf = settings_file(tmp_path / "hook.conf", GEMINI_IPC_DIR=real.ipc_dir, GEMINI_GROUP_NAME="g")
    # the process's own environment names the foreign pod manager
    with_file = alloc(sim, sim.hooked(foreign, "g", GEMINI_TEST_SETTINGS_FILE=conf))
    assert with_file["result"] == CUDA_ERROR_OUT_OF_MEMORY, with_file        # held to the file's group: 64 MiB
    control = alloc(sim, sim.hooked(foreign, "g", GEMINI_TEST_SETTINGS_FILE=tmp_path / "absent.conf"))
    assert control["result"] == 0, control                                    # the environment's pod manager


def test_gemini_disable_in_the_environment_is_ignored_when_the_file_exists(tmp_path, test_hook, two_backends):
    real, _ = two_backends
    sim = Sim(tmp_path / "sim", test_hook)
    conf = settings_file(tmp_path / "hook.conf", GEMINI_IPC_DIR=real.ipc_dir, GEMINI_GROUP_NAME="g")
    for flag in ("GEMINI_DISABLE", "GEMINI_FAIL_OPEN"):
        env = sim.hooked(real, "g", **{flag: 1})
        gated = alloc(sim, {**env, "GEMINI_TEST_SETTINGS_FILE": str(conf), "GEMINI_IPC_DIR": str(tmp_path / "no"),
                            "GEMINI_GROUP_NAME": "nobody"})
        assert gated["result"] == CUDA_ERROR_OUT_OF_MEMORY, (flag, gated)
    control = alloc(sim, sim.hooked(real, "g", GEMINI_DISABLE=1, GEMINI_TEST_SETTINGS_FILE=tmp_path / "absent"))
    assert control["result"] == 0, control                                    # ungated, as the variable says


def test_a_settings_file_that_cannot_be_used_fails_calls_and_never_falls_back_to_the_environment(
        tmp_path, test_hook, two_backends):
    real, foreign = two_backends
    sim = Sim(tmp_path / "sim", test_hook)
    bad = {
        "unknown key": "GEMINI_GROUP_NAME=g\nGEMINI_IPC_DIRR=/x\n",
        "not KEY=VALUE": "GEMINI_GROUP_NAME g\n",
        "a directory": None,
    }
    for i, (what, text) in enumerate(bad.items()):
        conf = tmp_path / f"bad-{i}.conf"
        if text is None:
            conf.mkdir()
        else:
            conf.write_text(text)
        r = run(client_argv("pyclient.py", "--kernels", 2, "--alloc", ALLOC, "--json"),
                sim.hooked(foreign, "g", GEMINI_DISABLE=1, GEMINI_TEST_SETTINGS_FILE=conf), timeout=60)
        assert r.rc != 0 or r.json["alloc"]["result"] == CUDA_ERROR_SYSTEM_NOT_READY, (what, r)
        assert "settings file" in r.err, (what, r.err[-2000:])


def test_the_installed_hook_reads_only_the_fixed_path(hook_lib, test_hook):
    """The library gem-node installs and mounts has no way to redirect the file (no GEMINI_TEST_SETTINGS_FILE);
    the test build does."""
    installed, test_build = hook_lib.read_bytes(), test_hook.read_bytes()
    assert b"/etc/gemini/hook.conf\0" in installed
    assert b"GEMINI_TEST_SETTINGS_FILE" not in installed
    assert b"GEMINI_TEST_SETTINGS_FILE" in test_build


def test_every_setting_the_hook_reads_may_be_set_in_the_file():
    """A setting the hook reads but the file may not set cannot be changed in a pod (the environment is ignored
    there), and a file that sets it is refused whole as naming an unknown key, so every gated call fails. Every
    name settings.c reads through setting*() must be one of its file keys; only aliases read from the environment
    alone are exempt."""
    src = (REPO / "hook" / "settings.c").read_text()
    keys_block = re.search(r"file_keys\[\] = \{(.*?)\};", src, re.S)
    assert keys_block, "file_keys not found in hook/settings.c"
    file_keys = set(re.findall(r'"(GEMINI_[A-Z_]+)"', keys_block.group(1)))
    read = set(re.findall(r'\bsetting(?:_flag|_ms|_path|_first)?\("(GEMINI_[A-Z_]+)"', src))
    aliases = {"GEMINI_POD_NAME"}       # setting_first's second choice for the group's name: GEMINI_GROUP_NAME
    assert len(read) >= 10, read
    assert read - aliases <= file_keys, sorted(read - aliases - file_keys)
