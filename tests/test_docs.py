"""The docs' reference tables agree with the code they describe: the message types and grant flags of
hook/gemini_proto.h, the JSON messages of gemini/wire/sched.py with their fields, and the hook's counters
(hook/stats.c). A message, field, flag or counter added without its row (or a row left behind) fails here."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from gemini.wire import sched

REPO = Path(__file__).resolve().parent.parent
PROTO_H = (REPO / "hook" / "gemini_proto.h").read_text()


def _doc(name: str) -> str:
    return (REPO / "docs" / name).read_text()


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with `first_header`, as lists of cells."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"^\|\s*{re.escape(first_header)}\s*\|", ln))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _c_enum(prefix: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"\b{prefix}(\w+)\s*=\s*(\d+)", PROTO_H)}


def _c_defines(prefix: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2), 0) for m in re.finditer(rf"#define\s+({prefix}\w+)\s+(0x[0-9a-fA-F]+|\d+)",
                                                                PROTO_H)}


def test_every_hook_message_type_has_its_row_with_its_number():
    types = _c_enum("GEM_MSG_")
    assert "TOKEN_GRANT" in types and len(types) >= 10, types
    rows = _table_rows(_doc("protocol.md"), "type")
    documented = {}
    for row in rows:
        m = re.fullmatch(r"`(\w+)` \((\d+)\)", row[0])
        if m:
            documented[m.group(1)] = int(m.group(2))
    assert documented == types


def test_grant_and_hello_ack_flags_are_documented_with_their_values():
    grant = _c_defines("GEM_GRANT_")
    assert set(grant) == {"GEM_GRANT_BOUND", "GEM_GRANT_CLAIM", "GEM_GRANT_TIGHT", "GEM_GRANT_BOARD"}, grant
    rows = _table_rows(_doc("protocol.md"), "flag")
    assert {row[0].strip("`"): int(row[1]) for row in rows} == grant
    ack = _c_defines("GEM_ACK_")
    protocol = _doc("protocol.md")
    for name, value in ack.items():
        assert f"`{name}` {value}" in protocol, name


def test_every_json_message_has_its_row_listing_exactly_its_fields():
    rows = {row[0].strip("`"): row for row in _table_rows(_doc("protocol.md"), "message")}
    messages = {cls.TYPE: cls for cls in sched.Message.__args__}  # type: ignore[attr-defined]
    assert set(rows) == set(messages)
    for name, cls in messages.items():
        names = [f.name for f in dataclasses.fields(cls)]
        cell = rows[name][2]
        if not names:
            assert cell == "—", (name, cell)
            continue
        # "code (`unknown_group`, ...), message": the field names, each maybe followed by a parenthesis
        listed = [re.sub(r"\s*\(.*\)$", "", part).strip() for part in re.split(r",\s*(?![^()]*\))", cell)]
        assert listed == names, (name, listed, names)


def test_the_board_layout_rows_name_real_fields():
    fields = set(re.findall(r"^\s+(?:u?int\d+_t|uint8_t)\s+(\w+)(?:\[\w+\])?;", PROTO_H.split("GEM_BOARD_MAGIC")[1],
                            re.M)) - {"pad"}
    rows = _table_rows(_doc("protocol.md"), "line")
    documented = set()
    for row in rows:
        documented.update(re.findall(r"`(\w+)`", row[1]))
    assert documented == fields, (documented ^ fields)


def test_every_hook_counter_is_explained():
    stats_c = (REPO / "hook" / "stats.c").read_text()
    body = stats_c.split("static void format_stats", 1)[1].split("\n}\n", 1)[0]   # what the summary prints
    printed = re.findall(r"(\w+)=%", body)
    assert "launches" in printed and "marker_interval_ms" in printed
    rows = _table_rows(_doc("operations.md"), "counter")
    documented = [name for row in rows for name in re.findall(r"`(\w+)`", row[0])]
    assert sorted(documented) == sorted(set(printed)), set(documented) ^ set(printed)


def test_the_timed_modules_are_test_modules():
    """conftest.TIMED_MODULES keeps the wall-clock-bound tests out of make test's parallel phase: a renamed module
    would silently leave it and race the other tests."""
    from tests.conftest import TIMED_MODULES
    present = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    assert TIMED_MODULES <= present, TIMED_MODULES - present
