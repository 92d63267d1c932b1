"""The hook's pure functions, called through cffi and checked against the Python side."""
from __future__ import annotations

import subprocess

import pytest

from gemini.wire import hook as protocol
from tests.hook_ffi import HOOK_LIB, hook_lib

MS = 1_000_000


@pytest.fixture(scope="module")
def lib():
    return hook_lib()


class Burst:
    def __init__(self, lib, merge_ms=2, window_ms=3000):
        self.ffi, self.c = lib
        self.buf = self.ffi.new("char[]", self.c.gemhook_burst_size())
        self.c.gemhook_burst_init(self.buf, merge_ms * MS, window_ms * MS)

    def record(self, start_ms, end_ms):
        self.c.gemhook_burst_record(self.buf, int(start_ms * MS), int(end_ms * MS))

    def predict(self, now_ms):
        return self.c.gemhook_burst_predict(self.buf, int(now_ms * MS)) / MS


def test_burst_empty_predicts_zero(lib):
    assert Burst(lib).predict(100) == 0


def test_bursts_closer_than_merge_gap_are_one(lib):
    b = Burst(lib)
    b.record(0, 10)
    b.record(11.5, 20)   # 1.5 ms apart: the same burst
    assert b.predict(21) == 20
    b.record(30, 35)     # 10 ms apart: a new burst
    assert b.predict(36) == 20  # p90 of {20, 5} by nearest rank is the larger


def test_burst_p90_nearest_rank(lib):
    b = Burst(lib)
    for i in range(10):           # lengths 1..10 ms, 100 ms apart
        b.record(i * 100, i * 100 + i + 1)
    assert b.predict(1000) == 9   # ceil(0.9 * 10) = 9th smallest


def test_burst_window_forgets_old_bursts(lib):
    b = Burst(lib)
    b.record(0, 50)
    b.record(4000, 4001)
    assert b.predict(4002) == 1   # the 50 ms burst ended more than 3 s ago
    assert b.predict(8000) == 0


def test_burst_ring_keeps_newest(lib):
    b = Burst(lib, window_ms=10**6)
    for i in range(300):          # more than the 256 slots
        b.record(i * 10, i * 10 + (100 if i < 100 else 1))
    assert b.predict(3000) == 1   # the long early bursts fell out of the ring


def test_c_frame_header_decodes_in_python(lib):
    ffi, c = lib
    buf = ffi.new("char[]", protocol.MSG_SIZE)
    c.gemhook_msg_init(buf, int(protocol.MsgType.MEM_INFO), 77)
    seq, msg = protocol.decode(bytes(ffi.buffer(buf)))
    assert seq == 77 and isinstance(msg, protocol.MemInfo)


@pytest.mark.parametrize("msg", [
    protocol.Hello(pid=1, pod_name="a"), protocol.TokenGrant(quota_ns=5, token_seq=9),
    protocol.Error(code=1, message="x"), protocol.Ack(),
])
def test_python_frames_pass_c_check(lib, msg):
    ffi, c = lib
    why = ffi.new("char[]", 128)
    assert c.gemhook_msg_check(ffi.from_buffer(protocol.encode(msg, 3)), why, 128) == 0


@pytest.mark.parametrize("offset,value,needle", [
    (0, b"\0\0\0\0", b"magic"), (4, b"\x07\x00", b"version"), (8, b"\x00\x10\x00\x00", b"size"),
    (6, b"\x63\x00", b"type"),
])
def test_c_check_rejects_bad_headers(lib, offset, value, needle):
    ffi, c = lib
    frame = bytearray(protocol.encode(protocol.Ack(), 1))
    frame[offset:offset + len(value)] = value
    why = ffi.new("char[]", 128)
    assert c.gemhook_msg_check(ffi.from_buffer(frame), why, 128) != 0
    assert needle in ffi.string(why)


@pytest.mark.parametrize("text,ok", [("127.0.0.1:50052", True), ("host:1", True), (":5", False),
                                     ("a:0", False), ("a:65536", False), ("a:5x", False), ("a", False)])
def test_parse_endpoint(lib, text, ok):
    ffi, c = lib
    ip, port = ffi.new("char[]", 64), ffi.new("int *")
    assert (c.gemhook_parse_endpoint(text.encode(), ip, 64, port) == 0) == ok


def test_library_links_neither_cuda_nor_python():
    hook_lib()
    dynamic = subprocess.run(["readelf", "-d", str(HOOK_LIB)], capture_output=True, text=True, check=True).stdout
    needed = [ln for ln in dynamic.splitlines() if "NEEDED" in ln]
    assert needed, dynamic
    assert not any("libcuda" in ln or "libpython" in ln for ln in needed), needed


KEY = 0x9E3779B97F4A7C15    # a key with high bits set (gem_kcost_key never gives 0)


@pytest.fixture
def kcost(lib):
    ffi, c = lib
    c.gemhook_kcost_clear()
    yield c
    c.gemhook_kcost_clear()


def test_a_cost_learnt_too_long_asks_for_measures_until_within_twice_of_them(kcost):
    """A kernel learnt at 2 ms then measured exactly at 20 us: each measure moves the cost a quarter of the way
    down and asks for another (its next launch measured alone), until the cost is within twice the measure."""
    kcost.gemhook_kcost_learn(KEY, 2_000_000, 1)
    assert kcost.gemhook_kcost_get(KEY) == 2_000_000
    asks = 0
    while kcost.gemhook_kcost_learn(KEY, 20_000, 1):
        asks += 1
        assert asks < 40
    assert 10 <= asks <= 20, asks
    assert kcost.gemhook_kcost_get(KEY) <= 40_000
    # an upper bound (idle time in its interval) lowers the cost at once, and asks for nothing
    kcost.gemhook_kcost_learn(KEY, 2_000_000, 1)
    assert kcost.gemhook_kcost_learn(KEY, 20_000, 0) == 0 and kcost.gemhook_kcost_get(KEY) == 20_000
    # longer, exact: replaces at once, asks for nothing
    assert kcost.gemhook_kcost_learn(KEY, 500_000, 1) == 0 and kcost.gemhook_kcost_get(KEY) == 500_000


@pytest.mark.parametrize("start_us,measure_us", [(10, 1), (5, 2), (7, 1)])
def test_a_tiny_kernels_cost_that_rounding_holds_still_asks_for_no_more_measures(kcost, start_us, measure_us):
    """A quarter of a few microseconds rounds to nothing: the cost stays above twice the measure (4 us for 1 us),
    and asking again at each measure would measure every second launch of a tiny kernel alone for good."""
    kcost.gemhook_kcost_learn(KEY, start_us * 1000, 1)
    asks = 0
    for _ in range(100):
        asks += kcost.gemhook_kcost_learn(KEY, measure_us * 1000, 1)
    assert asks <= 10, asks
    assert kcost.gemhook_kcost_learn(KEY, measure_us * 1000, 1) == 0
