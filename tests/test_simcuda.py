"""The simulated CUDA driver and the test clients, without the hook.

Every driver call happens in a child process (clients, or tests/clients/simprobe.py)
with the simulator on LD_LIBRARY_PATH, so this process never loads a libcuda.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

import native

GiB, MiB = 1 << 30, 1 << 20
PROBE = "simprobe.py"


@pytest.fixture(scope="module", autouse=True)
def _built():
    native.build_native()


@pytest.fixture
def shm(tmp_path):
    return tmp_path / "simcuda.shm"


def run_json(name: str, *args, env: dict, timeout: float = 30, expect_rc: int = 0) -> dict:
    proc = subprocess.run(native.client_cmd(name, *args), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect_rc, f"{name} {args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start(name: str, *args, env: dict) -> subprocess.Popen:
    return subprocess.Popen(native.client_cmd(name, *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(p: subprocess.Popen, timeout: float = 30) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def mem_free(env: dict) -> int:
    return run_json("workload-linked", "--kernels", 0, "--meminfo", "--json", env=env)["mem_free"]


def wait_until(pred, timeout: float = 10.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("condition not reached in time")


# ----------------------------------------------------------------------------- driver basics


def test_info_devices_versions_and_not_initialized(shm):
    env = native.sim_env(shm, devices=2, extra={"SIMCUDA_DRIVER_VERSION": 12080})
    d = run_json(PROBE, "info", env=env)
    assert d["simulated"] is True
    assert d["driver_version"] == 12080
    assert set(d["before_init"].values()) == {3, 0} and d["before_init"]["cuDriverGetVersion"] == 0
    assert d["before_init"]["cuMemAlloc_v2"] == 3
    assert d["cuInit_bad_flags"] == 1
    assert d["devices"] == 2
    a, b = d["device_list"]
    assert a["uuid"] != b["uuid"] and a["uuid"] == a["uuid_v2"]
    assert a["attrs"] == {"16": 132, "75": 9, "76": 0, "115": 1, "102": 1, "1": 1024, "10": 32}
    assert a["total"] == 16 * GiB
    assert d["cuDeviceGet_out_of_range"] == 101 and d["cuDeviceGetAttribute_bad"] == 1
    assert d["error_names"]["900"] == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert d["cuGetErrorName_unknown"] == 1
    # UUIDs are a function of the device index only.
    again = run_json(PROBE, "info", env=native.sim_env(shm.with_suffix(".2"), devices=1))
    assert again["device_list"][0]["uuid"] == a["uuid"]


def test_bad_handles_and_null_pointers(shm):
    d = run_json(PROBE, "handles", env=native.sim_env(shm))
    assert d["stream_sync_bogus"] == 400 and d["event_query_bogus"] == 400
    assert d["ctx_destroy_bogus"] == 201 and d["launch_bogus_fn"] == 400
    assert d["free_bogus"] == 1 and d["alloc_null_out"] == 1 and d["meminfo_null_out"] == 1
    assert d["memcpy_bad_dst"] == 1 and d["graph_launch_bogus"] == 1 and d["module_get_bogus"] == 400
    assert d["stream_sync_destroyed"] == 400 and d["event_sync_destroyed"] == 400
    assert d["event_query_pending"] == 600
    assert 19.0 <= d["elapsed_ms"] <= 40.0
    assert d["no_context"] == [201, 201]
    assert d["created_is_current"] and d["pop_returns_created"] and d["after_pop_is_primary"]
    assert d["after_destroy_is_primary"] and d["primary_active"] == 1
    assert d["fork_child"] == [3, 3, 3] and d["parent_after_fork"] == 0


# ----------------------------------------------------------------------------- cuGetProcAddress

# symbol, cudaVersion, flags, the exact variant expected (None: no pointer), status.
# Each case was checked against the real CUDA 13.0 driver (580.x, H200).
PROCADDR_CASES = [
    ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2", 0),
    ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2", 0),
    ("cuMemAllocAsync", 11010, 0, None, 2),
    ("cuLaunchKernel", 3000, 0, None, 2),
    ("cuMemAlloc", 13000, 2, "cuMemAlloc_v2", 0),
    ("cuCtxCreate", 3020, 0, "cuCtxCreate_v2", 0),
    ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3", 0),
    ("cuCtxCreate", 12000, 0, "cuCtxCreate_v3", 0),
    ("cuCtxCreate", 12050, 0, "cuCtxCreate_v4", 0),
    ("cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2", 0),
    ("cuMemcpyHtoD", 12000, 1, "cuMemcpyHtoD_v2", 0),
    ("cuMemcpyHtoD", 12000, 2, "cuMemcpyHtoD_v2_ptds", 0),
    ("cuMemcpy", 12000, 2, "cuMemcpy_ptds", 0),
    ("cuLaunchKernel", 12000, 0, "cuLaunchKernel", 0),
    ("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz", 0),
    ("cuLaunchKernel", 6050, 2, None, 2),  # the per-thread variant starts at 7000: no fallback
    ("cuMemcpyHtoD", 6050, 2, None, 2),
    ("cuMemcpyHtoD", 6050, 1, "cuMemcpyHtoD_v2", 0),
    ("cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz", 0),
    ("cuLaunchKernelEx", 11000, 0, None, 2),
    ("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz", 0),
    ("cuStreamSynchronize", 12000, 2, "cuStreamSynchronize_ptsz", 0),
    ("cuCtxSynchronize", 12000, 2, "cuCtxSynchronize", 0),
    ("cuCtxSynchronize", 12080, 0, "cuCtxSynchronize", 0),     # these three from the H100, driver 580
    ("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2", 0),
    ("cuCtxSynchronize", 13000, 2, "cuCtxSynchronize_v2", 0),
    ("cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture", 0),
    ("cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2", 0),
    ("cuStreamBeginCapture", 12000, 2, "cuStreamBeginCapture_v2_ptsz", 0),
    ("cuStreamGetCaptureInfo", 11030, 0, "cuStreamGetCaptureInfo_v2", 0),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress", 0),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", 0),
    ("cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2", 0),
    ("cuGraphInstantiate", 12000, 0, "cuGraphInstantiate_v2", 0),
    ("cuGraphInstantiateWithFlags", 12000, 0, "cuGraphInstantiateWithFlags", 0),
    ("cuCtxCreate", 13000, 0, "cuCtxCreate_v4", 0),
    ("cuDeviceGetUuid", 11000, 0, "cuDeviceGetUuid", 0),
    ("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2", 0),
    ("cuMemFreeAsync", 12000, 2, "cuMemFreeAsync_ptsz", 0),
    ("cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2", 0),
    ("cuDevicePrimaryCtxRelease", 12000, 0, "cuDevicePrimaryCtxRelease_v2", 0),
    ("cuNoSuchFunction", 12000, 0, None, 1),
    ("cuMemAlloc_v2", 12000, 0, None, 1),  # lookups are by base name
]


def test_get_proc_address_semantics(shm):
    queries = [[s, v, f, e] for s, v, f, e, _ in PROCADDR_CASES]
    d = run_json(PROBE, "procaddr", json.dumps(queries), env=native.sim_env(shm))
    for (sym, ver, flags, exact, status), r in zip(PROCADDR_CASES, d["results"]):
        where = f"{sym} v{ver} flags={flags}"
        assert r["rc_v2"] == 0, where
        assert r["status"] == status, where
        if exact:
            assert r["ptr_v2"] is not None and r["ptr_v2"] == r["dlsym"], where
            assert r["rc_v1"] == 0 and r["ptr_v1"] == r["dlsym"], where
        else:
            assert r["ptr_v2"] is None and r["ptr_v1"] is None, where
            assert r["rc_v1"] == 500, where  # v1: CUDA_ERROR_NOT_FOUND


def test_get_proc_address_version_above_driver(shm):
    env = native.sim_env(shm, extra={"SIMCUDA_DRIVER_VERSION": 12040})
    d = run_json(PROBE, "procaddr", json.dumps([["cuMemAlloc", 12050, 0, None], ["cuMemAlloc", 12040, 0, None],
                                                ["cuMemAlloc", 12000, 7, None]]), env=env)
    above, equal, badflags = d["results"]
    assert above["rc_v2"] == 1 and above["rc_v1"] == 1 and above["ptr_v2"] is None
    assert equal["rc_v2"] == 0 and equal["status"] == 0
    assert badflags["rc_v2"] == 1


def test_every_table_row_matches_dlsym(shm):
    d = run_json(PROBE, "table", env=native.sim_env(shm))
    assert d["rows"] > 100
    assert d["bad"] == []


# ----------------------------------------------------------------------------- clients

CLIENT_CASES = [
    ("workload-procaddr", []),
    ("workload-linked", []),
    ("workload-procaddr", ["--ptsz", "--stream", "created", "--sync", "stream"]),
    ("workload-linked", ["--ptsz", "--stream", "per-thread", "--sync", "event"]),
    ("workload-procaddr", ["--launch", "graph", "--sync-every", "4", "--stream", "created"]),
    ("workload-linked", ["--launch", "graph", "--graph-size", "3", "--ptsz"]),
    ("workload-procaddr", ["--launch", "ex", "--ctx", "create"]),
    ("workload-linked", ["--launch", "cooperative", "--blocks", "8"]),
    ("pyclient.py", []),
]


@pytest.mark.parametrize("name,args", CLIENT_CASES, ids=[f"{n}{''.join(a)}" for n, a in CLIENT_CASES])
def test_client_short_workload(shm, tmp_path, name, args):
    trace = tmp_path / "kernels.trace"
    env = native.sim_env(shm, trace=trace)
    n, us = 12, 300
    extra = [] if name.endswith(".py") or "--sync-every" in args else ["--sync-every", 5]
    synctrace = tmp_path / "syncs.trace"
    if not name.endswith(".py"):
        extra += ["--trace", synctrace]
    d = run_json(name, "--kernels", n, "--kernel-us", us, *extra, *args, "--json", env=env)
    assert d["errors"] == 0 and d["first_error"] is None
    assert d["launches"] >= n and d["kernels_done"] == d["launches"]
    assert d["onchip_ns"] >= d["launches"] * us * 1000
    assert d["start_ns"] > 0 and d["end_ns"] > d["start_ns"]
    rows = native.read_trace(trace)
    assert len(rows) == d["launches"]
    assert {r[0] for r in rows} == {d["pid"]} and {r[4] for r in rows} == {"gem_spin"}
    assert all(r[3] - r[2] >= us * 1000 for r in rows)
    if not name.endswith(".py"):
        lines = synctrace.read_text().splitlines()
        assert len(lines) == d["syncs"]
        host_ns, onchip_ns, kernels = (int(x) for x in lines[-1].split())
        assert onchip_ns == d["onchip_ns"] and kernels == d["kernels_done"]


def test_pyclient_ptx_is_workload_ptx():
    src = (native.CLIENTS_SRC / "workload.c").read_text()
    body = src.split("gem_spin_ptx[] =", 1)[1].split(";\n", 1)[0]
    c_ptx = "".join(json.loads(f'"{m}"') for m in re.findall(r'^\s*"((?:[^"\\]|\\.)*)"', body, re.M))
    ns: dict = {}
    exec(compile((native.CLIENTS_SRC / "pyclient.py").read_text(), "pyclient.py", "exec"), ns)
    assert c_ptx == ns["GEM_SPIN_PTX"]
    assert c_ptx.startswith(".version 7.0\n.target sm_70\n") and "%globaltimer" in c_ptx


@pytest.mark.parametrize("args", [["--bogus"], ["--stream", "nope"], ["--kernels", "x"], ["extra"],
                                  ["--kernels", "1", "--seconds", "1"]])
def test_workload_usage_errors(shm, args):
    proc = subprocess.run(native.client_cmd("workload-linked", *args), env=native.sim_env(shm),
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 2
    assert "usage" in proc.stderr or "workload:" in proc.stderr


def test_workload_reports_failed_call(shm):
    # Past the capacity, the ring buffer allocation itself fails: cuMemAlloc is reported and exit is 1.
    env = native.sim_env(shm, mem_bytes=4096)
    proc = subprocess.run(native.client_cmd("workload-procaddr", "--kernels", 70000, "--json"), env=env,
                          capture_output=True, text=True, timeout=10)
    assert proc.returncode == 1
    assert "cuMemAlloc failed: 2 CUDA_ERROR_OUT_OF_MEMORY" in proc.stderr
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    assert d["first_error"] == {"call": "cuMemAlloc", "code": 2, "name": "CUDA_ERROR_OUT_OF_MEMORY"}


# ----------------------------------------------------------------------------- time-sharing


def test_two_processes_never_overlap_and_share_fairly(shm, tmp_path):
    trace = tmp_path / "kernels.trace"
    env = native.sim_env(shm, trace=trace)
    a = start("workload-linked", "--seconds", 1.2, "--kernel-us", 300, "--json", env=env)
    b = start("workload-procaddr", "--seconds", 1.2, "--kernel-us", 300, "--stream", "created", "--json", env=env)
    da, db = finish(a), finish(b)
    rows = native.read_trace(trace)
    assert len(rows) == da["launches"] + db["launches"]
    for x, y in zip(rows, rows[1:]):
        assert y[2] >= x[3], f"kernels overlap: {x} {y}"
    # Shares inside the window where both were busy.
    t0 = max(min(r[2] for r in rows if r[0] == p) for p in (da["pid"], db["pid"]))
    t1 = min(max(r[3] for r in rows if r[0] == p) for p in (da["pid"], db["pid"]))
    assert t1 - t0 > 0.5e9
    busy = {p: sum(max(0, min(r[3], t1) - max(r[2], t0)) for r in rows if r[0] == p) for p in (da["pid"], db["pid"])}
    shares = [busy[p] / (t1 - t0) for p in busy]
    assert all(0.35 <= s <= 0.65 for s in shares), shares
    assert sum(shares) > 0.6  # handoff gaps grow on an overloaded machine


def test_an_event_fires_when_its_context_has_the_device(shm, tmp_path):
    """A GPU processes a context's events only while it runs that context, and then runs what the context has
    queued: an event queued behind another process's kernel fires after it, and an event pair around a kernel
    of ours spans that kernel, whatever the other process queued meanwhile. (Recorded after its drain, the
    hook's end-of-slot event waited for the next holder's first kernel on an H100.) Before this model, events
    fired as soon as the worker reached them: the pair spanned the wait for the device too (up to 25 ms
    here) and the lone event fired at once (2 ms)."""
    env = native.sim_env(shm)
    other = start("workload-linked", "--seconds", 3, "--kernel-us", 20000, "--json", env=env)
    try:
        time.sleep(0.3)    # its 20 ms kernels run back to back
        d = run_json(PROBE, "events", env=env)
    finally:
        other.kill()        # nothing is read from it: do not wait for its ~20 s queue
        other.wait(timeout=10)
    assert 4.5 <= d["kernel_ms"] <= 6.5, d
    assert d["around_kernel_ms"] <= d["kernel_ms"] + 1.5, d       # not the wait for the device
    assert d["alone_after_ms"] >= 10.0, d                          # after the other's 20 ms kernel


def test_devices_are_independent(shm, tmp_path):
    trace = tmp_path / "kernels.trace"
    env = native.sim_env(shm, trace=trace, devices=2)
    a = start("workload-linked", "--kernels", 20, "--kernel-us", 10000, "--device", 0, "--json", env=env)
    b = start("workload-linked", "--kernels", 20, "--kernel-us", 10000, "--device", 1, "--json", env=env)
    finish(a), finish(b)
    rows = native.read_trace(trace)
    assert {r[1] for r in rows} == {0, 1}
    d0 = [r for r in rows if r[1] == 0]
    d1 = [r for r in rows if r[1] == 1]
    overlapping = sum(1 for x in d0 for y in d1 if x[2] < y[3] and y[2] < x[3])
    assert overlapping > 0  # two devices run at the same time


def test_sigkill_during_kernel_does_not_block_others(shm, tmp_path):
    trace = tmp_path / "kernels.trace"
    env = native.sim_env(shm, trace=trace)
    long = start("workload-linked", "--kernels", 1, "--kernel-us", 20_000_000, env=env)
    time.sleep(0.5)  # its one kernel now holds the device
    other = start("workload-procaddr", "--kernels", 3, "--kernel-us", 1000, "--json", env=env)
    time.sleep(0.3)
    assert other.poll() is None  # waiting for the device
    killed_at = time.monotonic()
    long.send_signal(signal.SIGKILL)
    long.wait()
    d = finish(other, timeout=10)
    assert d["kernels_done"] == 3
    assert time.monotonic() - killed_at < 3.0


# ----------------------------------------------------------------------------- memory


def test_memory_paths_in_one_process(shm):
    d = run_json(PROBE, "memory", env=native.sim_env(shm, mem_bytes=2 * GiB))
    assert d["base"] == d["total"] == 2 * GiB
    dev = d["device"]
    assert dev["charged"] == 64 * MiB and dev["released"] and dev["double_free"] == 1
    assert dev["type"] == 2 and dev["range_start_ok"] and dev["range_size"] == 64 * MiB and dev["is_managed"] == 0
    assert dev["memset32"] == [0x01020304] * 4 and dev["memsetd32_unaligned"] == 1
    assert d["managed"] == {"charged": 0, "is_managed": 1, "released": True}  # not resident: not counted
    assert d["pitch"] == {"pitch": 1024, "charged": 1024 * 4096, "bad_elem": 1, "released": True}
    assert d["host"] == {"charged": 0, "type": 1}
    assert d["oversize"] == 2 and d["zero"] == 1 and d["free_null"] == 0
    a = d["async"]
    assert a["charged"] == a["used"] == a["reserved"] == 16 * MiB and a["pool_attr"]
    assert a["used_after"] == a["reserved_after"] == 0 and a["released"]
    assert a["kept_reserved"] == a["kept_charged"] == 16 * MiB  # release threshold keeps it
    assert a["trimmed_reserved"] == 0 and a["trimmed_released"]
    assert d["pool"] == {"charged": 8 * MiB, "used": 8 * MiB, "released": True, "destroy_default": 1}
    v = d["vmm"]
    assert v["granularity"] == 2 * MiB and v["create_unaligned"] == 1
    assert v["charged"] == 32 * MiB and v["reserve_charges"] == 0
    assert v["memset_before_access"] == 1 and v["readback"] == [7, 7, 7, 7] and v["attr_type"] == 2
    assert v["charged_while_mapped"] == 32 * MiB and v["released"]
    ar = d["array"]
    # As the real driver: 2 MiB units; requirements only for (uncharged) deferred-mapping arrays.
    assert ar["charged"] == 16 * MiB and ar["req_plain"] == 1 and ar["released"]
    assert ar["deferred_charged"] == 0 and ar["req_size"] == 16 * MiB and ar["req_align"] == 64 * 1024
    assert ar["charged_3d"] == 4 * MiB
    assert ar["mipmap_charged"] == 6 * MiB and ar["mipmap_req_plain"] == 1
    assert ar["mipmap_deferred_charged"] == 0 and ar["mipmap_req"] == 5 * MiB + 256 * 1024
    assert ar["bad_format"] == 1 and ar["released_all"]


def test_managed_prefetch_both_abis_residency_and_bandwidth(shm):
    # 64 MiB at 1 GB/s: each full move takes about 67 ms, so a swap's time is visible
    env = native.sim_env(shm, mem_bytes=2 * GiB, extra={"SIMCUDA_MIGRATE_GBPS": "1"})
    d = run_json(PROBE, "prefetch", env=env)
    n = 64 * MiB
    assert d["concurrent_managed"] == 1
    assert d["fresh_resident"] == 0
    assert d["old_to_device"] == 0 and d["resident_after_old"] == n and d["charged_after_old"] == n
    assert d["v2_to_host"] == 0 and d["resident_after_v2_host"] == 0 and d["charged_after_v2_host"] == 0
    assert 0.06 < d["old_to_device_s"] < 2 and 0.06 < d["v2_to_host_s"] < 2
    assert d["v2_half_to_device"] == 0 and d["resident_half"] == n // 2
    assert d["old_to_cpu"] == 0 and d["resident_after_old_cpu"] == 0
    assert d["v2_flags"] == 1 and d["v2_bad_type"] == 1     # flags must be 0; INVALID location
    assert d["device_memory"] == 1                           # only managed memory can be prefetched
    assert d["released"]                                     # freeing resident managed memory uncharges it


def test_managed_prefetch_refused_without_concurrent_managed_access(shm):
    env = native.sim_env(shm, extra={"SIMCUDA_CONCURRENT_MANAGED": "0"})
    proc = subprocess.run(native.client_cmd(PROBE, "prefetch"), env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "cuMemPrefetchAsync_v2 failed: 101" in proc.stderr + proc.stdout


def test_get_proc_address_prefetch_abi_by_version(shm):
    queries = [["cuMemPrefetchAsync", 12000, 0, "cuMemPrefetchAsync"],
               ["cuMemPrefetchAsync", 12080, 0, "cuMemPrefetchAsync_v2"],
               ["cuMemPrefetchAsync", 13000, 0, "cuMemPrefetchAsync_v2"],
               ["cuMemPrefetchAsync", 13000, 2, "cuMemPrefetchAsync_v2_ptsz"],
               ["cuMemPrefetchAsync", 11000, 2, "cuMemPrefetchAsync_ptsz"]]
    d = run_json(PROBE, "procaddr", json.dumps(queries), env=native.sim_env(shm))
    for q, r in zip(queries, d["results"]):
        assert r["rc_v2"] == 0 and r["ptr_v2"] == r["dlsym"], q


@pytest.mark.parametrize("kind", ["device", "pitch", "managed", "async", "pool", "vmm", "array"])
def test_workload_alloc_kinds(shm, kind):
    d = run_json("workload-linked", "--kernels", 2, "--alloc", "256M", "--alloc-kind", kind, "--meminfo", "--json",
                 env=native.sim_env(shm, mem_bytes=GiB))
    assert d["alloc"]["result"] == 0
    used = d["mem_total"] - d["mem_free"]
    want = 0 if kind == "managed" else 256 * MiB  # managed memory is not resident on the device
    assert want <= used < want + 2 * MiB
    assert d["device_total"] == GiB
    if kind == "pitch":
        assert d["alloc"]["pitch"] % 512 == 0


def test_memory_capacity_across_processes_and_reclaim_after_sigkill(shm):
    env = native.sim_env(shm, mem_bytes=GiB)
    holder = start("workload-linked", "--seconds", 60, "--kernel-us", 2000, "--alloc", "700M", "--json", env=env)
    try:
        wait_until(lambda: mem_free(env) < GiB - 600 * MiB)
        d = run_json("workload-procaddr", "--kernels", 1, "--alloc", "500M", "--meminfo", "--json", env=env)
        assert d["alloc"]["name"] == "CUDA_ERROR_OUT_OF_MEMORY" and d["errors"] == 0
        assert d["mem_free"] < GiB - 700 * MiB
        ok = run_json("pyclient.py", "--kernels", 1, "--alloc", "200M", "--json", env=env)
        assert ok["alloc"]["result"] == 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert mem_free(env) == GiB
    d = run_json("workload-procaddr", "--kernels", 1, "--alloc", "900M", "--json", env=env)
    assert d["alloc"]["result"] == 0


# ----------------------------------------------------------------------------- capture and graphs


def test_capture_modes_and_graph_replay(shm, tmp_path):
    trace = tmp_path / "kernels.trace"
    d = run_json(PROBE, "capture", env=native.sim_env(shm, trace=trace))

    def broken(r):
        return r["launch2"] == 901 and r["end"] == 901 and r["graph_null"] and r["status_after"] == 0

    def intact(r):
        return (r["begin"] == 0 and r["status_during"] == 1 and r["launch2"] == 0 and r["end"] == 0
                and r["instantiate"] == 0 and r["graph_launch"] == 0 and r["sync"] == 0)

    # GLOBAL capture, another GLOBAL-mode thread allocates: refused, capture invalidated.
    assert d["global_other_global"]["interloper"] == [900, None] and broken(d["global_other_global"])
    # ... from a RELAXED thread: allowed (the mode it had was GLOBAL), capture intact.
    assert d["global_other_relaxed"]["interloper"] == [0, 0, 0] and intact(d["global_other_relaxed"])
    # THREAD_LOCAL capture or THREAD_LOCAL-mode thread: other threads are not restricted.
    assert d["thread_local_other_global"]["interloper"] == [0, 0] and intact(d["thread_local_other_global"])
    assert d["global_other_thread_local"]["interloper"] == [0, 0] and intact(d["global_other_thread_local"])
    # The capturing thread itself, and a RELAXED capture.
    assert d["global_same_thread"]["interloper"] == [900, None] and broken(d["global_same_thread"])
    assert d["relaxed_capture_same_thread"]["interloper"] == [0, 0] and intact(d["relaxed_capture_same_thread"])
    # Syncing a capture is refused in every mode.
    for k in ("ctx_sync_relaxed", "sync_capturing_stream", "query_capturing_stream"):
        assert d[k]["interloper"] == 900 and broken(d[k]), k
    assert d["begin_on_legacy"] == 900
    # Only a non-blocking stream captures: sync copies and legacy launches pass; legacy sync and
    # cuEventQuery are unsafe calls (refused unless RELAXED).
    assert d["nonblocking_other_global_memcpy"]["interloper"] == 0 and intact(d["nonblocking_other_global_memcpy"])
    assert d["nonblocking_same_launch_legacy"]["interloper"] == 0 and intact(d["nonblocking_same_launch_legacy"])
    r = d["nonblocking_other_global_sync_legacy"]
    assert r["interloper"] == 900 and broken(r)
    r = d["nonblocking_other_relaxed_sync_legacy"]
    assert r["interloper"] == 0 and intact(r)
    r = d["other_global_event_query"]
    assert r["interloper"] == [0, 900] and broken(r)
    r = d["other_relaxed_event_query"]
    assert r["interloper"][0] == 0 and r["interloper"][1] in (0, 600) and intact(r)
    # A blocking stream captures: any legacy-stream use is an implicit dependency, in every mode.
    for k in ("blocking_other_relaxed_memcpy", "blocking_same_launch_legacy",
              "blocking_thread_local_other_sync_legacy"):
        assert d[k]["interloper"] == 906 and broken(d[k]), k
    assert d["mode_default"] == 0 and d["mode_odd"] == [0, 7]
    assert d["capture_info_v2"] == 0 and d["capture_info_status"] == 1 and d["capture_info_id_nonzero"]
    # Graph replay: captured kernels did not run at capture, ran at each launch, in order.
    assert not d["captured_ran_before_launch"]
    for k, (onchip, t0, t1) in enumerate(d["graph_results"]):
        assert onchip >= (k + 1) * 1_000_000 and t1 > t0
    starts = [r[1] for r in d["graph_results"]]
    assert starts == sorted(starts) and d["graph_second_later"]
    assert d["pre_launch"][0] >= 2_000_000
    # Trace: the pre-launch, the legacy launch, each intact capture's replay (2 kernels), 3 + 3 graph kernels.
    rows = native.read_trace(trace)
    intact_cases = [k for k, v in d.items() if isinstance(v, dict) and v.get("graph_launch") == 0]
    assert len(intact_cases) == 8
    assert len(rows) == 1 + 1 + 2 * len(intact_cases) + 6
