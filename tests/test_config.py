"""resource-config.txt parser (gemini/config.py): both formats, units, comments, errors with file:line, hostile
input."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemini.config import (DEFAULT_MEMORY_LIMIT, MAX_NAME_LEN, Config, ConfigError, load_config, parse_config,
                           parse_size)

GiB = 1 << 30


# --- v2 (INI) -------------------------------------------------------------------------------------------------------

def test_v2_full_example():
    cfg = parse_config("""\
# comment line
[train]
MinUtil = 0.3
MaxUtil = 0.6      # trailing comment
MemoryLimit = 8GiB

[infer]
  minutil=0.2
  MAXUTIL : 0.3
  memorylimit = 4G
""", "rc.txt")
    assert cfg.format == "v2" and cfg.path == "rc.txt"
    assert cfg.names == ["train", "infer"]
    t, i = cfg.groups
    assert (t.min_util, t.max_util, t.mem_limit, t.line) == (0.3, 0.6, 8 * GiB, 2)
    assert (i.min_util, i.max_util, i.mem_limit, i.line) == (0.2, 0.3, 4 * 10**9, 7)
    assert cfg.group("infer") is i and cfg.group("nope") is None
    assert cfg.warnings == ()


def test_v2_defaults():
    (g,) = parse_config("[solo]\n").groups
    assert (g.min_util, g.max_util, g.mem_limit) == (0.0, 1.0, DEFAULT_MEMORY_LIMIT)


def test_v2_process_sharing():
    cfg = parse_config("[a]\nProcessSharing = turns\n[b]\nprocesssharing = Together\n[c]\n")
    assert [g.turns for g in cfg.groups] == [True, False, False]


def test_v2_class_memory_mode_and_socket_keys():
    cfg = parse_config("[a]\nClass = Latency\nSocketOwner = alice\nSocketGroup = 1000\n"
                       "SocketMode = 0640\n[b]\nMemoryMode = unified\n")
    a, b = cfg.groups
    assert (a.sched_class, a.latency, a.memory_mode, a.unified) == ("latency", True, "device", False)
    assert (a.socket_owner, a.socket_group, a.socket_mode) == ("alice", "1000", 0o640)
    assert (b.sched_class, b.latency, b.memory_mode, b.unified) == ("batch", False, "unified", True)
    assert (b.socket_owner, b.socket_group, b.socket_mode) == (None, None, None)


def test_v2_crlf_tabs_and_blank_lines():
    cfg = parse_config("\r\n\t[a]\r\n\tMaxUtil\t=\t0.5\r\n\r\n[b]\r\n")
    assert cfg.names == ["a", "b"] and cfg.groups[0].max_util == 0.5


def test_the_shipped_example_parses():
    from pathlib import Path
    cfg = load_config(Path(__file__).resolve().parent.parent / "resource-config.txt")
    assert cfg.format == "v2" and len(cfg.groups) >= 1


# --- v1 (Gemini's original) -------------------------------------------------------------------------------------------

def test_v1_full_example():
    cfg = parse_config("""\
# Gemini v1
2
podA 0.3 0.5 1073741824
podB   0.2 1.0   2GiB   # units work here too
""", "old.txt")
    assert cfg.format == "v1"
    a, b = cfg.groups
    assert (a.name, a.min_util, a.max_util, a.mem_limit, a.line) == ("podA", 0.3, 0.5, GiB, 3)
    assert (b.name, b.min_util, b.max_util, b.mem_limit, b.line) == ("podB", 0.2, 1.0, 2 * GiB, 4)


def test_v1_with_plus_sign_count():
    assert parse_config("+1\na 0 1 1\n").names == ["a"]


# --- sizes ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1K", 1000), ("1k", 1000), ("1Ki", 1024), ("1KiB", 1024), ("1kib", 1024),
    ("512MiB", 512 << 20), ("2G", 2 * 10**9), ("2GB", 2 * 10**9), ("1.5GiB", 3 << 29), (".5Ki", 512),
    ("1T", 10**12), ("1Ti", 1 << 40), (" 3 Mi ", 3 << 20), ("7b", 7),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "1X", "1e9", "-5", "1.2.3", "0x10", "1 G i", "1KiKi", "nan", "inf",
                                  "99999999999999Ti", "1" * 30 + ".5Ti"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


# --- errors name file:line ----------------------------------------------------------------------------------------

ERROR_CASES = [
    # (text, line, fragment of the message)
    ("", 1, "empty"),
    ("# only a comment\n\n", 2, "empty"),
    ("hello\n", 1, "cannot tell the format"),
    ("MinUtil = 0.5\n", 1, "cannot tell the format"),
    ("[a]\nMinUtil = 2\n", 2, "between 0 and 1"),
    ("[a]\nMinUtil = -0.1\n", 2, "between 0 and 1"),
    ("[a]\nMaxUtil = nan\n", 2, "between 0 and 1"),
    ("[a]\nMaxUtil = inf\n", 2, "between 0 and 1"),
    ("[a]\nMaxUtil = half\n", 2, "not a number"),
    ("[a]\nMaxUtil =\n", 2, "not a number"),
    ("[a]\n\nMemoryLimit = 0\n", 3, "greater than 0"),
    ("[a]\nMemoryLimit = 0.4\n", 2, "greater than 0"),
    ("[a]\nMemoryLimit = lots\n", 2, "bad size"),
    ("[a]\nMemoryLimit = 10000000000Ti\n", 2, "too large"),
    ("[a]\nColour = red\n", 2, "unknown key"),
    ("[a]\nProcessSharing = sometimes\n", 2, "'together' or 'turns'"),
    ("[a]\nProcessSharing = turns\nProcessSharing = turns\n", 3, "twice"),
    ("[a]\nClass = fast\n", 2, "'batch' or 'latency'"),
    ("[a]\nMemoryMode = swap\n", 2, "'device' or 'unified'"),
    # a claim is answered by the pod manager alone: gem-schd could not make room for a claimer's memory
    ("[a]\nClass = latency\nMemoryMode = unified\n", 1, "cannot be combined with MemoryMode = unified"),
    ("[a]\nSocketMode = 0666\n", 2, "any local user"),
    ("[a]\nSocketMode = rw\n", 2, "octal mode"),
    ("[a]\nSocketOwner = a/b\n", 2, "not a user or group name"),
    ("[a]\nSocketGroup = -x\n", 2, "not a user or group name"),
    ("[a]\nMinUtil = 0.1\nminutil = 0.2\n", 3, "twice"),
    ("[a]\njust words\n", 2, "Key = value"),
    ("[a]\n[a]\n", 2, "defined twice"),
    ("[a]\n[]\n", 2, "empty group name"),
    ("[a b]\n", 1, "may not contain spaces"),
    ("[my\tgroup]\n", 1, "may not contain spaces"),
    ("[caf\u00e9]\n", 1, "not printable ASCII"),
    ("[" + "x" * (MAX_NAME_LEN + 1) + "]\n", 1, "characters"),
    ("[a]\nMinUtil = 0.6\nMaxUtil = 0.5\n", 1, "above MaxUtil"),
    ("[a]\nMinUtil=0.1\x00\n", 2, "NUL"),
    ("2\na 0 1 1\n", 2, "says 2 group(s) but 1"),
    ("1\na 0 1 1\nb 0 1 1\n", 3, "says 1 group(s) but 2"),
    ("1\n", 1, "says 1 group(s) but 0"),
    ("-1\n", 1, "negative"),
    ("0\n", 1, "no groups"),
    ("1\na 0 1\n", 2, "got 3 field(s)"),
    ("1\na 0 1 1 extra\n", 2, "got 5 field(s)"),
    ("1\na x 1 1\n", 2, "REQUEST"),
    ("1\na 0 1.5 1\n", 2, "LIMIT"),
    ("1\na 0 1 none\n", 2, "MemoryLimit"),
    ("2\na 0 1 1\na 0 1 1\n", 3, "defined twice"),
    ("1\na 0.9 0.1 1\n", 2, "above MaxUtil"),
]


@pytest.mark.parametrize("text,line,fragment", ERROR_CASES)
def test_every_error_names_file_and_line(text, line, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "/etc/gemini/rc.txt")
    err = info.value
    assert str(err).startswith(f"/etc/gemini/rc.txt:{line}: "), str(err)
    assert (err.path, err.line) == ("/etc/gemini/rc.txt", line)
    assert fragment in err.message, err.message


def test_min_sum_above_one_is_a_warning_not_an_error():
    cfg = parse_config("[a]\nMinUtil=0.7\n[b]\nMinUtil=0.6\n", "rc.txt")
    assert len(cfg.warnings) == 1 and "rc.txt" in cfg.warnings[0] and "1.3" in cfg.warnings[0]


def test_load_config_reads_files_and_reports_problems(tmp_path):
    good = tmp_path / "rc.txt"
    good.write_text("[a]\nMaxUtil = 0.5\n")
    cfg = load_config(good)
    assert cfg.path == str(good) and cfg.groups[0].max_util == 0.5
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.txt")
    assert str(info.value) == f"{tmp_path / 'missing.txt'}: no such file"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nodir" / "rc.txt")
    assert str(info.value) == f"{tmp_path / 'nodir' / 'rc.txt'}: no such file (there is no directory " \
                              f"{tmp_path / 'nodir'})"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)                      # a directory
    assert "is a directory, not a regular file" in str(info.value)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"[a]\nMaxUtil = 0.5\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value).startswith(f"{bad}:3: ") and "UTF-8" in str(info.value)


def test_hostile_values_are_errors_not_crashes():
    for text in ["[a]\nMinUtil=" + "9" * 5000 + "\n", "[a]\nMemoryLimit=" + "9" * 5000 + "\n",
                 "9" * 5000 + "\n", "[a]\nMaxUtil=1e999\n", "[a]\nMaxUtil=-0\n" + "[b]\n" * 0,
                 "[" * 10000 + "\n", "]\n", "[a]\n" + "=" * 1000 + "\n", "[a]\n" + "x" * 1_000_000 + "\n"]:
        try:
            parse_config(text, "h.txt")
        except ConfigError as exc:
            assert str(exc).startswith("h.txt:")


def test_many_groups():
    text = "".join(f"[g{i}]\nMinUtil = 0.0001\n" for i in range(2000))
    cfg = parse_config(text)
    assert len(cfg.groups) == 2000 and cfg.groups[-1].line == 3999


# --- line splitting and encoding ------------------------------------------------------------------------------------

def test_line_numbers_count_newlines_only():
    # a form feed or U+2028 inside a line must not shift the line numbers of later errors
    with pytest.raises(ConfigError) as info:
        parse_config("[a]\nMaxUtil = 0.5 # page\x0cbreak \u2028 here\nfoo\n", "f.txt")
    assert info.value.line == 3
    parse_config("# page\x0cbreak in a comment\n[a]\n", "f.txt")


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "rc.txt"
    p.write_bytes(b"\xef\xbb\xbf[a]\nMaxUtil = 0.5\n")
    assert load_config(p).names == ["a"]


def test_semicolon_comments_and_forbidden_name_characters():
    assert parse_config("; ini comment\n[a] ; trailing\nMaxUtil = 0.5 ; why\n").group("a").max_util == 0.5
    with pytest.raises(ConfigError, match="may not contain"):
        parse_config("[a=b]\n")
    with pytest.raises(ConfigError):
        parse_config("[a]]\n")


def test_hostile_values_are_cut_in_messages():
    with pytest.raises(ConfigError) as info:
        parse_config("[a]\nMaxUtil = " + "9" * 5000 + "\n")
    assert len(str(info.value)) < 200 and "int_max_str_digits" not in str(info.value)


# --- property: any text gives a Config or a ConfigError ---------------------------------------------------------

_line = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["[a]", "[b]", "[ a ]", "[]", "[a]]", "2", "1", "0", "-1", "# c", "", "MinUtil = 0.5",
                     "MaxUtil=1", "MemoryLimit = 1GiB", "MemoryLimit=0", "minutil: 2", "a 0.1 0.2 1024",
                     "b 0 1 1Ki", "x 1 0 5", "MaxUtil = nan", "\x00", "\ufeff", "\r", "\u2028"]),
    st.builds(lambda k, v: f"{k} = {v}", st.sampled_from(["MinUtil", "MaxUtil", "MemoryLimit", "Other"]),
              st.text(max_size=12)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_line, max_size=12).map("\n".join))
def test_structured_text_gives_config_or_config_error(text):
    _check_total(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_gives_config_or_config_error(text):
    _check_total(text)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_from_a_file(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("cfg") / "rc.txt"
    p.write_bytes(data)
    try:
        cfg = load_config(p)
    except ConfigError as exc:
        assert re.match(re.escape(str(p)) + r":\d+: ", str(exc))
    else:
        assert isinstance(cfg, Config) and cfg.groups


def _check_total(text):
    try:
        cfg = parse_config(text, "p.txt")
    except ConfigError as exc:
        assert re.match(r"p\.txt:\d+: \S", str(exc)), str(exc)
        assert exc.line >= 0
        return
    assert isinstance(cfg, Config) and cfg.groups
    names = cfg.names
    assert len(set(names)) == len(names)
    for g in cfg.groups:
        assert 0.0 <= g.min_util <= g.max_util <= 1.0
        assert g.mem_limit > 0 and 1 <= len(g.name) <= MAX_NAME_LEN
