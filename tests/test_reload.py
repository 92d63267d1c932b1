"""Live reload of resource-config.txt (real files, real time, kept short)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gemini.config import load_config
from gemini.ctl import main as ctl_main
from gemini.wire.sched import ConfigUpdate, GroupRemoved, Hello, StatusReply, StatusRequest, Welcome
from gemini.reload import ConfigReloader
from tests.schd_inproc import DaemonThread, FakePodManager


def cfg_text(max_a: float, extra: str = "") -> str:
    return f"# test config\n[a]\nMaxUtil = {max_a}\nMemoryLimit = 1GiB\n[b]\nMaxUtil = 0.5\n{extra}"


# --- save styles ----------------------------------------------------------------------------------------------------

def save_in_place(path: Path, text: str) -> None:
    with open(path, "r+") as f:      # truncate + write in the same inode, as many editors do
        f.seek(0)
        f.truncate()
        f.write(text)


def save_rename_over(path: Path, text: str) -> None:
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    os.replace(new, path)


def save_temp_then_rename(path: Path, text: str) -> None:
    # vim-like: move the original aside, write a fresh file, drop the backup; plus a swap file appearing
    swap = path.with_name("." + path.name + ".swp")
    swap.write_text("swap")
    backup = path.with_name(path.name + "~")
    os.replace(path, backup)
    path.write_text(text)
    backup.unlink()
    swap.unlink()


def save_delete_then_create(path: Path, text: str) -> None:
    path.unlink()
    time.sleep(0.01)
    path.write_text(text)


SAVE_STYLES = [save_in_place, save_rename_over, save_temp_then_rename, save_delete_then_create]


@pytest.fixture
def daemon_on_file(tmp_path):
    path = tmp_path / "resource-config.txt"
    path.write_text(cfg_text(0.3))
    d = DaemonThread(load_config(path), config_path=str(path), debounce_s=0.03).start()
    yield d, path
    d.stop()


def status_of(p: FakePodManager) -> dict:
    p.send(StatusRequest())
    st = p.recv_type(StatusReply)
    return {g["name"]: g for g in st.groups}


def wait_for(pred, timeout=3.0, step=0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return pred()


@pytest.mark.parametrize("save", SAVE_STYLES, ids=lambda f: f.__name__)
def test_each_save_style_is_picked_up(daemon_on_file, save):
    d, path = daemon_on_file
    with FakePodManager(d.endpoint) as p:
        assert isinstance(p.request(Hello("a", pid=1)), Welcome)
        assert status_of(p)["a"]["max_util"] == 0.3
        t0 = time.monotonic()
        save(path, cfg_text(0.7))
        upd = p.recv_type(ConfigUpdate, timeout=3.0)
        elapsed = time.monotonic() - t0
        assert upd == ConfigUpdate("a", 0.0, 0.7, 1 << 30, neighbours=1)
        assert status_of(p)["a"]["max_util"] == 0.7
        assert d.call(lambda: d.daemon.policy.config.group("a").max_util) == 0.7
        assert elapsed < 1.0
        # and a second save of the same style works too
        save(path, cfg_text(0.4))
        assert p.recv_type(ConfigUpdate, timeout=3.0) == ConfigUpdate("a", 0.0, 0.4, 1 << 30, neighbours=1)


def test_bad_file_keeps_the_last_good_config(daemon_on_file, caplog):
    d, path = daemon_on_file
    caplog.set_level(logging.ERROR, logger="gemini.reload")
    with FakePodManager(d.endpoint) as p:
        p.request(Hello("a", pid=1))
        save_rename_over(path, "[a]\nMaxUtil = 0.9\n[b]\nMaxUtil = banana\n")
        assert wait_for(lambda: d.daemon.reloader.errors >= 1)
        assert status_of(p)["a"]["max_util"] == 0.3
        assert p.drain() == []
        msgs = [r.getMessage() for r in caplog.records]
        assert any(f"{path}:4:" in m and "banana" in m for m in msgs), msgs
        # the same bad content saved again is not logged again
        n = len(caplog.records)
        save_in_place(path, "[a]\nMaxUtil = 0.9\n[b]\nMaxUtil = banana\n")
        assert wait_for(lambda: d.daemon.reloader.errors >= 2)
        assert len(caplog.records) == n
        # fixing it applies
        save_in_place(path, cfg_text(0.6))
        assert p.recv_type(ConfigUpdate, timeout=3.0) == ConfigUpdate("a", 0.0, 0.6, 1 << 30, neighbours=1)


def test_a_process_sharing_edit_alone_is_pushed(daemon_on_file):
    d, path = daemon_on_file
    with FakePodManager(d.endpoint) as p:
        assert p.request(Hello("a", pid=1)).turns is False
        save_rename_over(path, cfg_text(0.3).replace("[a]\n", "[a]\nProcessSharing = turns\n"))
        assert p.recv_type(ConfigUpdate, timeout=3.0) == ConfigUpdate("a", 0.0, 0.3, 1 << 30, turns=True, neighbours=1)


def test_gem_ctl_status_says_the_last_edit_was_rejected_and_why(daemon_on_file):
    d, path = daemon_on_file

    def status(*args):
        r = CliRunner().invoke(ctl_main, ["--port", str(d.port), "status", *args])
        assert r.exit_code == 0, r.output
        return r.output

    assert "REJECTED" not in status() and json.loads(status("--json"))["config_rejected"] == ""
    save_rename_over(path, "[a]\nMaxUtil = 0.9\n[b]\nMaxUtil = banana\n")
    assert wait_for(lambda: d.daemon.reloader.errors >= 1, timeout=30)
    text = status()
    assert "The last edit of the config was REJECTED" in text and f"{path}:4:" in text and "banana" in text
    assert "0.30" in _row(text, "a")                     # the config in force is still the last good one
    assert f"{path}:4:" in json.loads(status("--json"))["config_rejected"]
    path.unlink()
    assert wait_for(lambda: "was removed" in d.call(d.daemon.status_reply).config_rejected, timeout=30)
    assert "was removed" in status()
    path.write_text(cfg_text(0.6))                        # a good save clears it
    assert wait_for(lambda: d.call(d.daemon.status_reply).config_rejected == "", timeout=30)
    assert "REJECTED" not in status() and "0.60" in _row(status(), "a")


def _row(table: str, group: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(group + " "))


def test_deleted_file_keeps_config_until_recreated(daemon_on_file, caplog):
    d, path = daemon_on_file
    caplog.set_level(logging.WARNING, logger="gemini.reload")
    with FakePodManager(d.endpoint) as p:
        p.request(Hello("a", pid=1))
        path.unlink()
        assert wait_for(lambda: any("removed" in r.getMessage() for r in caplog.records))
        assert status_of(p)["a"]["max_util"] == 0.3          # still in force
        time.sleep(0.1)
        path.write_text(cfg_text(0.8))
        assert p.recv_type(ConfigUpdate, timeout=3.0) == ConfigUpdate("a", 0.0, 0.8, 1 << 30, neighbours=1)


def test_group_added_and_removed_by_a_save(daemon_on_file):
    d, path = daemon_on_file
    with FakePodManager(d.endpoint) as p:
        save_rename_over(path, cfg_text(0.3, "[c]\nMaxUtil = 0.2\n"))
        assert wait_for(lambda: "c" in status_of(p))
        assert isinstance(p.request(Hello("c", pid=3)), Welcome)
        save_rename_over(path, cfg_text(0.3))
        assert p.recv_type(GroupRemoved, timeout=3.0) == GroupRemoved("c")
        assert "c" not in status_of(p)


def test_unrelated_files_and_reads_do_not_reload(daemon_on_file):
    d, path = daemon_on_file
    (path.parent / "other.txt").write_text("x")
    (path.parent / "other.txt").write_text("y")
    for _ in range(5):
        path.read_text()
    time.sleep(0.2)
    assert d.daemon.reloader.reloads == 0 and d.daemon.reloader.errors == 0


def test_a_save_without_changes_pushes_nothing(daemon_on_file):
    d, path = daemon_on_file
    with FakePodManager(d.endpoint) as p:
        p.request(Hello("a", pid=1))
        save_in_place(path, "# a new comment\n" + cfg_text(0.3))
        time.sleep(0.25)
        assert p.drain() == []
        assert d.daemon.reloader.reloads == 0


# --- the reloader on its own ------------------------------------------------------------------------------------------

class ManualTimers:
    """Stands in for the loop a ConfigReloader is given: call_soon_threadsafe (how the watcher thread hands events
    over) goes to the real loop, but the debounce timers (call_later) run only when the test advances a simulated
    clock. So how the machine schedules the watcher thread and the loop cannot change what the debounce does."""

    class Timer:
        def __init__(self, when: float, callback, args):
            self.when, self.callback, self.args, self.cancelled = when, callback, args, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.now = 0.0
        self.timers: list[ManualTimers.Timer] = []
        self.armed = 0              # timers started so far: one per event the watcher handed over

    def is_closed(self) -> bool:
        return self.loop.is_closed()

    def call_soon_threadsafe(self, callback, *args):
        return self.loop.call_soon_threadsafe(callback, *args)

    def create_task(self, coro, **kw):            # the read itself runs for real, off the loop
        return self.loop.create_task(coro, **kw)

    def run_in_executor(self, executor, fn, *args):
        return self.loop.run_in_executor(executor, fn, *args)

    def call_later(self, delay: float, callback, *args) -> "ManualTimers.Timer":
        timer = ManualTimers.Timer(self.now + delay, callback, args)
        self.timers.append(timer)
        self.armed += 1
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = sorted((t for t in self.timers if not t.cancelled and t.when <= self.now), key=lambda t: t.when)
        self.timers = [t for t in self.timers if not t.cancelled and t.when > self.now]
        for timer in due:
            timer.callback(*timer.args)


async def read_done(r: ConfigReloader) -> None:
    """Wait for the read a fired timer started (it runs on a thread) to be applied."""
    await until(lambda: r._reading is None, what="the reload's read")


async def until(pred, timeout: float = 60.0, what: str = "") -> None:
    """Wait in real time for something only another thread can bring about (the bound only catches a hang)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.002)


def test_reloader_debounces_and_calls_back_on_the_loop(tmp_path):
    path = tmp_path / "rc.txt"
    path.write_text(cfg_text(0.1))
    calls = []

    async def main():
        loop_thread = threading.get_ident()
        timers = ManualTimers(asyncio.get_running_loop())
        # settle_s = debounce_s: even "writer done" events wait the full debounce, so the burst is coalesced
        r = ConfigReloader(path, lambda c: calls.append((c, threading.get_ident() == loop_thread)), loop=timers,
                           debounce_s=0.05, settle_s=0.05, current=load_config(path))
        r.start()
        try:
            for i in range(10):                      # a burst of saves 5 ms apart: one reload, after the last
                armed = timers.armed
                save_in_place(path, cfg_text(0.2 + i / 100))
                await until(lambda armed=armed: timers.armed > armed, what=f"the watcher reports save {i}")
                timers.advance(0.005)
            assert calls == []                       # each save pushed the reload back
            timers.advance(0.05)
            await read_done(r)
            assert len(calls) == 1
            await asyncio.sleep(0.05)                # events still on their way re-arm the timer ...
            timers.advance(1.0)                      # ... and read the same file again: nothing new to apply
            await read_done(r)
        finally:
            r.stop()

    asyncio.run(main())
    assert len(calls) == 1
    config, on_loop = calls[0]
    assert on_loop and config.group("a").max_util == pytest.approx(0.29)


def test_reloader_follows_a_symlinked_config(tmp_path):
    # Kubernetes ConfigMap layout: rc.txt -> ..data/rc.txt, ..data -> ..2024_x; an update swaps ..data by rename.
    v1 = tmp_path / "..v1"
    v1.mkdir()
    (v1 / "rc.txt").write_text(cfg_text(0.1))
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "rc.txt").symlink_to("..data/rc.txt")
    seen = []

    async def main():
        r = ConfigReloader(tmp_path / "rc.txt", seen.append, debounce_s=0.03,
                           current=load_config(tmp_path / "rc.txt"))
        r.start()
        try:
            v2 = tmp_path / "..v2"
            v2.mkdir()
            (v2 / "rc.txt").write_text(cfg_text(0.9))
            (tmp_path / "..data_tmp").symlink_to("..v2")
            os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
            await until(lambda: seen, what="the reload after the ..data switch")
        finally:
            r.stop()

    asyncio.run(main())
    assert seen and seen[0].group("a").max_util == 0.9


def test_reload_now_and_callback_errors_are_contained(tmp_path, caplog):
    path = tmp_path / "rc.txt"
    path.write_text(cfg_text(0.1))

    def boom(config):
        raise RuntimeError("callback bug")

    r = ConfigReloader(path, boom, loop=asyncio.new_event_loop(), current=load_config(path))
    assert r.reload_now() is None                    # unchanged
    path.write_text(cfg_text(0.2))
    with caplog.at_level(logging.ERROR):
        assert r.reload_now() is not None            # applied (the callback's failure is logged, not raised)
    assert any("applying the new config failed" in rec.getMessage() for rec in caplog.records)
    assert r.current.group("a").max_util == 0.2


def test_finished_saves_apply_without_waiting_for_the_debounce(tmp_path):
    # closing a written file (or renaming one into place) means the save is complete: applied after settle_s
    path = tmp_path / "rc.txt"
    path.write_text(cfg_text(0.1))
    seen = []

    async def main():
        timers = ManualTimers(asyncio.get_running_loop())
        r = ConfigReloader(path, lambda c: seen.append(c.group("a").max_util), loop=timers, debounce_s=2.0,
                           settle_s=0.005, current=load_config(path))
        r.start()
        try:
            for expected, save in ((0.2, save_rename_over), (0.3, save_in_place)):
                save(path, cfg_text(expected))
                # the event that ends the save (the rename, the close) arms the short timer
                await until(lambda: any(not t.cancelled and t.when <= timers.now + 0.005 for t in timers.timers),
                            timeout=10.0, what=f"{save.__name__}: a reload due within settle_s")
                timers.advance(0.005)
                await read_done(r)
                assert seen[-1] == expected
        finally:
            r.stop()

    asyncio.run(main())
    assert seen == [0.2, 0.3]


def test_an_edit_before_the_watch_began_is_applied(tmp_path):
    """The daemon read its config, then (a moment later, on a loaded machine) began to watch the directory: an edit
    in between makes no event. The reloader reads the file once more when its watch is up, and applies the edit;
    a file unchanged since is not applied again."""
    path = tmp_path / "rc.txt"
    path.write_text(cfg_text(0.1))
    current = load_config(path)
    save_rename_over(path, cfg_text(0.5, "[c]\n"))       # saved before the watch began
    calls = []

    async def main():
        r = ConfigReloader(path, calls.append, loop=asyncio.get_running_loop(), debounce_s=0.05, settle_s=0.005,
                           current=current)
        r.start()
        try:
            await until(lambda: calls, timeout=5.0, what="the edit made before the watch was applied")
            assert r.reloads == 1
        finally:
            r.stop()
        unchanged = ConfigReloader(path, calls.append, loop=asyncio.get_running_loop(), debounce_s=0.05,
                                   settle_s=0.005, current=load_config(path))
        unchanged.start()
        try:
            await asyncio.sleep(0.1)
        finally:
            unchanged.stop()

    asyncio.run(main())
    assert len(calls) == 1
    assert calls[0].group("a").max_util == pytest.approx(0.5) and calls[0].group("c") is not None


def test_a_file_found_empty_is_read_again_before_it_is_reported(tmp_path, caplog):
    """An editor that saves in place truncates the file before writing it: a read in between found it empty, logged
    "no groups", and forgot the last error, so the bad save that followed was logged twice. An empty file is read
    once more after the debounce; still empty, it is reported."""
    caplog.set_level(logging.ERROR, logger="gemini.reload")
    path = tmp_path / "rc.txt"
    path.write_text(cfg_text(0.1))
    calls = []

    async def main():
        r = ConfigReloader(path, calls.append, loop=asyncio.get_running_loop(), debounce_s=0.05, settle_s=0.005,
                           current=load_config(path))
        path.write_text("")                         # caught between the truncation and the write ...
        r.request_reload()
        await read_done(r)
        assert r.errors == 0 and not caplog.records
        path.write_text(cfg_text(0.4))              # ... which came: no error was ever said
        await asyncio.sleep(0.1)
        await read_done(r)
        assert r.errors == 0 and not caplog.records and len(calls) == 1
        path.write_text("")                         # emptied for good: said once, after the second look
        r.request_reload()
        await asyncio.sleep(0.1)
        await read_done(r)
        assert r.errors == 1 and len(caplog.records) == 1 and "empty" in caplog.records[0].getMessage()
        r.stop()

    asyncio.run(main())
