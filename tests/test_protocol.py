"""The wire format read from hook/gemini_proto.h, and the scheduler message schema."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.wire import sched as messages, hook as protocol


def test_layout_comes_from_the_header():
    assert protocol.MSG_SIZE == 256 and protocol.HEADER_SIZE == 16
    text = protocol.cdef_text()
    assert "struct gem_msg" in text and "#include" not in text and "_Static_assert" not in text


@pytest.mark.parametrize("msg", [
    protocol.Hello(pid=12, device_ordinal=1, mem_in_use=5 << 30, flags=1, pod_name="train",
                   device_uuid="GPU-0123"),
    protocol.HelloAck(client_id=3, mem_limit=1 << 33, mem_used=7, group="train"),
    protocol.TokenRequest(overuse_ns=-1, burst_ns=2_000_000, used_ns=3),
    protocol.TokenGrant(quota_ns=250_000_000, token_seq=2**63),
    protocol.TokenRelease(token_seq=4, overuse_ns=5, burst_ns=6),
    protocol.Ack(), protocol.MemAlloc(bytes=2**40, kind=protocol.MemKind.VMM), protocol.MemFree(bytes=1),
    protocol.MemInfo(), protocol.MemReply(verdict=1, used=2, limit=3),
    protocol.Error(code=protocol.ErrorCode.GROUP_MISMATCH, message="wrong group"),
])
def test_round_trip(msg):
    frame = protocol.encode(msg, seq=41)
    assert len(frame) == protocol.MSG_SIZE
    assert protocol.decode(frame) == (41, msg)


def test_header_fields_are_little_endian_at_fixed_offsets():
    frame = protocol.encode(protocol.MemFree(bytes=0x0102030405060708), seq=9)
    magic, version, mtype, size, seq = struct.unpack_from("<IHHII", frame)
    assert (magic, version, mtype, size, seq) == (protocol.MAGIC, 1, protocol.MsgType.MEM_FREE, 256, 9)
    assert struct.unpack_from("<Q", frame, 16)[0] == 0x0102030405060708


def test_strings_too_long_are_refused_not_truncated():
    with pytest.raises(ValueError, match="pod_name"):
        protocol.encode(protocol.Hello(pid=1, pod_name="x" * 64))


@pytest.mark.parametrize("mutate,code,text", [
    (lambda f: b"\0\0\0\0" + f[4:], protocol.ErrorCode.PROTOCOL, "magic"),
    (lambda f: f[:4] + b"\x02\x00" + f[6:], protocol.ErrorCode.VERSION, "version 2"),
    (lambda f: f[:8] + struct.pack("<I", 1 << 20) + f[12:], protocol.ErrorCode.PROTOCOL, "oversized"),
    (lambda f: f[:8] + struct.pack("<I", 8) + f[12:], protocol.ErrorCode.PROTOCOL, "undersized"),
    (lambda f: f[:6] + b"\xff\x00" + f[8:], protocol.ErrorCode.PROTOCOL, "unknown message type"),
])
def test_bad_headers_raise_with_code(mutate, code, text):
    frame = mutate(protocol.encode(protocol.Ack(), 1))
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.decode(frame)
    assert err.value.code == code and text in err.value.message


def test_direction_is_enforced():
    frame = protocol.encode(protocol.TokenGrant(quota_ns=1, token_seq=1))
    with pytest.raises(protocol.ProtocolError, match="direction"):
        protocol.decode(frame, protocol.HOOK_TO_PMGR)


def test_error_frame_cuts_long_text():
    seq, msg = protocol.decode(protocol.error_frame(protocol.ErrorCode.INTERNAL, "é" * 500, seq=2))
    assert seq == 2 and len(msg.message.encode()) < protocol.ERRMSG_LEN


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=300))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        protocol.decode(data)
    except protocol.ProtocolError:
        pass


# ---- scheduler messages -------------------------------------------------------------------------

def test_message_round_trip():
    for msg in [messages.Hello(group="a", pid=1, mem_used=2, clients=3),
                messages.TokenRequest(group="a", overuse_ms=1.5, burst_ms=2.0),
                messages.Grant(group="a", quota_ms=250.0, token_seq=4),
                messages.StatusReply(scheduler_id="s", window_ms=1.0, holder="a", groups=[{"name": "a"}])]:
        assert messages.decode(messages.encode(msg)) == msg


def test_every_message_encodes_as_its_dataclass_does():
    """encode reads each message's fields shallowly (dataclasses.asdict's deep copy cost gem-schd 60 µs a grant):
    every type, with its list fields filled, gives the same bytes as asdict's dict would, and decodes back."""
    import dataclasses
    import json
    samples = {"str": "g", "int": 7, "float": 1.5, "bool": True, "list": [[1, 2], {"name": "a", "x": [3]}]}
    for cls in messages.Message.__args__:
        kinds = {f.name: (f.type if isinstance(f.type, str) else f.type.__name__) for f in dataclasses.fields(cls)}
        msg = cls(**{name: samples[kind] for name, kind in kinds.items()})
        expected = json.dumps({"type": cls.TYPE, **dataclasses.asdict(msg)}, separators=(",", ":")).encode()
        assert messages.encode(msg) == expected, cls
        assert messages.decode(messages.encode(msg)) == msg, cls


@pytest.mark.parametrize("frame,text", [
    (b"\xff\xfe", "not JSON"), (b"[]", "not a JSON object"), (b'{"type":"nope"}', "unknown message type"),
    (b'{"type":"hello","pid":1}', "missing field"), (b'{"type":"hello","group":"a","pid":"1"}', "bad value"),
    (b'{"type":"hello","group":"a","pid":1,"extra":1}', "unknown field"),
    (b'{"type":"grant","group":"a","quota_ms":NaN,"token_seq":1}', "bad value"),
    (b"x" * (messages.MAX_MESSAGE_BYTES + 1), "exceeds"),
])
def test_bad_messages_are_named(frame, text):
    with pytest.raises(messages.MessageError, match=text):
        messages.decode(frame)


def test_message_direction_is_enforced():
    with pytest.raises(messages.MessageError, match="not accepted"):
        messages.decode(messages.encode(messages.Grant(group="a", quota_ms=1, token_seq=1)), messages.TO_SCHEDULER)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_message_decoder(data):
    try:
        messages.decode(data)
    except messages.MessageError:
        pass
