"""The hook's source files form layers, and the Makefile and the table agree with the files.

Each file of hook/ belongs to a layer (hook/libgemhook.c explains them). A file may include the headers of its
own layer and below, never above, and the includes between modules form no cycle, so a lower layer can
never call a higher one (a call needs a declaration, and declarations are only in headers: no `extern` in
a .c file). The Makefile's HOOK_SRC/HOOK_HDR must name every file, and hook_table.h's columns must agree
with the names they describe.
"""
from __future__ import annotations

import re

import pytest

from tests.conftest import REPO_ROOT

HOOK = REPO_ROOT / "hook"

# module -> layer; a module is a .c file and its header of the same stem (the layer-0 headers stand alone)
LAYERS = {
    "cuda_types.h": 0, "gemini_proto.h": 0, "hook_table.h": 0, "hook_exports.h": 0,
    "util": 1, "board": 1, "settings": 1, "stats": 1, "kcost": 1, "real": 1, "thread": 1,
    "client": 2,
    "device": 3, "gpugate": 3, "flare": 3,
    "capture": 4, "inflight": 4, "gate": 4, "memory": 4, "residency": 4, "rejoin": 4, "vmm": 4, "context": 4, "nvml": 4,
    "wrappers": 5,
    "symbols": 6,
    "libgemhook": 7,
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_of(filename: str) -> str:
    return filename if filename in LAYERS else filename.rsplit(".", 1)[0]


def layer_violations(files: dict[str, str], layers: dict[str, int]) -> list[str]:
    """Everything wrong with `files` (name -> text) against `layers`: unknown files, includes of a higher
    layer, cycles between modules, extern declarations in .c files."""
    problems: list[str] = []
    edges: dict[str, set[str]] = {}
    for name, text in sorted(files.items()):
        mod = module_of(name)
        if mod not in layers:
            problems.append(f"{name}: not in any layer (add it to LAYERS and to libgemhook.c's list)")
            continue
        for inc in INCLUDE.findall(text):
            target = module_of(inc)
            if inc not in files:
                problems.append(f"{name} includes {inc}, which is not a file of hook/")
                continue
            if target == mod:
                continue
            if layers[target] > layers[mod]:
                problems.append(f"{name} (layer {layers[mod]}) includes {inc} (layer {layers[target]}): "
                                f"a lower layer must not depend on a higher one")
            edges.setdefault(mod, set()).add(target)
        if name.endswith(".c") and re.search(r"^\s*extern\b", text, re.M):
            problems.append(f"{name}: declares something extern; declare it in the header of the module "
                            f"that defines it")
    # cycles (also between modules of one layer)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                problems.append("include cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return problems


def hook_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(HOOK.iterdir()) if p.suffix in (".c", ".h")}


def test_the_hook_is_layered_without_cycles():
    assert layer_violations(hook_files(), LAYERS) == []


def test_every_layer_is_a_real_module():
    names = {module_of(n) for n in hook_files()}
    assert names == set(LAYERS), f"LAYERS names modules that are gone: {set(LAYERS) - names}"


@pytest.mark.parametrize("files,needle", [
    # device.h including gate.h: a lower layer depending on a higher one
    ({"device.h": '#include "gate.h"\n', "gate.h": '#include "device.h"\n'}, "lower layer"),
    # two modules of one layer including each other
    ({"gate.c": '#include "memory.h"\n', "memory.h": "", "memory.c": '#include "gate.h"\n', "gate.h": ""},
     "include cycle: gate -> memory -> gate"),
    ({"newfile.c": ""}, "not in any layer"),
    ({"gate.c": "extern int gem_memory_thing(void);\n"}, "extern"),
])
def test_the_layer_check_finds_what_it_must(files, needle):
    problems = layer_violations(files, LAYERS)
    assert any(needle in p for p in problems), problems


def make_list(name: str) -> list[str]:
    text = (REPO_ROOT / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(rf"^{name}\s*:=(.*)$", text, re.M)
    assert m, f"Makefile has no {name}"
    return m.group(1).split()


def test_the_makefile_builds_every_hook_file():
    files = hook_files()
    assert sorted(make_list("HOOK_SRC")) == sorted(f"hook/{n}" for n in files if n.endswith(".c"))
    assert sorted(make_list("HOOK_HDR")) == sorted(f"hook/{n}" for n in files if n.endswith(".h"))


# X(kind, lib, ret, name, since, pt, ...
ROW = re.compile(r"\bX\(\s*(\w+),\s*(\w+),\s*(\w+),\s*(\w+),\s*(\d+),\s*([01]),")


def table_rows() -> list[tuple[str, str, str, str, int, int]]:
    text = (HOOK / "hook_table.h").read_text()
    return [(k, lib, ret, name, int(since), int(pt)) for k, lib, ret, name, since, pt in ROW.findall(text)]


def test_the_table_columns_agree_with_the_names():
    rows = table_rows()
    assert len(rows) > 50, "the row pattern no longer matches hook_table.h"
    names = [r[3] for r in rows]
    assert len(names) == len(set(names)), "a function is listed twice"
    for kind, lib, ret, name, since, pt in rows:
        assert pt == int(name.endswith(("_ptsz", "_ptds"))), f"{name}: pt column {pt}"
        if lib == "NVML":
            assert name.startswith("nvml") and ret == "int" and since == 0, name
        else:
            # dlsym's cheap filter (symbols.c) only looks at cu[A-Z]* and nvml* names
            assert lib == "CUDA" and re.match(r"cu[A-Z]", name) and ret == "CUresult", name
            assert 2000 <= since <= 13000, f"{name}: since {since}"
        assert kind in {"LAUNCH", "GRAPH_LAUNCH", "SYNC", "CAPTURE_BEGIN", "CAPTURE_END", "ALLOC_ASYNC",
                        "ALLOC_FROM_POOL", "CUSTOM", "REAL"}, name


def test_the_table_is_the_only_list():
    """No file re-derives a row's library or stream semantics from its name."""
    for name, text in hook_files().items():
        assert 'strncmp(name, "nvml"' not in text and '"nvml", 4)' not in text, name
        assert "_ptsz\", 5" not in text, name
