# gemini -- build, test, demo.
#
#   make demo       install into .venv, build, run the backend and two clients in two groups
#   make test       install into .venv, build, run the test suite (no GPU needed)
#   make gpu-check  on a GPU node: build, run the tests marked gpu, run the benchmarks,
#                   write a report under $$OUT (or ./out); uses the system python3, no network
#   make hook       build gemini/lib/libgemhook.so.1 only
#   make testhook   build $(BUILD)/testhook/libgemhook.so.1: the hook that also takes its settings file's path
#                   from GEMINI_TEST_SETTINGS_FILE (tests only; never installed)

PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
CC     ?= cc
BUILD  ?= build
OUT    ?= out

# The hook's files, bottom layer first (libgemhook.c lists the layers; tests/test_hook_layers.py checks
# that these lists name every file in hook/).
HOOK_SRC := hook/util.c hook/board.c hook/settings.c hook/stats.c hook/kcost.c hook/real.c hook/thread.c hook/client.c hook/device.c hook/flare.c hook/gpugate.c hook/capture.c hook/inflight.c \
            hook/gate.c hook/memory.c hook/residency.c hook/rejoin.c hook/vmm.c hook/context.c hook/nvml.c hook/wrappers.c hook/symbols.c hook/libgemhook.c
HOOK_HDR := hook/cuda_types.h hook/gemini_proto.h hook/hook_table.h hook/hook_exports.h hook/util.h hook/board.h \
            hook/settings.h hook/stats.h hook/kcost.h hook/real.h hook/thread.h hook/client.h hook/device.h hook/flare.h hook/gpugate.h hook/capture.h hook/inflight.h hook/gate.h \
            hook/rejoin.h hook/memory.h hook/residency.h hook/vmm.h hook/context.h hook/nvml.h hook/symbols.h
HOOK_LIB := gemini/lib/libgemhook.so.1
# A plain C library: no libpython, no libcuda (opened at run time), no CUDA headers.
# WERROR=1 (make test, CI) turns every warning into an error.
WERROR ?=
HOOK_CFLAGS  := -std=gnu11 -O2 -fPIC -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter -pthread -Ihook \
                $(if $(WERROR),-Werror)
HOOK_LDFLAGS := -shared -pthread -Wl,-soname,libgemhook.so.1 -Wl,--no-undefined -Wl,-z,now

.PHONY: all hook testhook venv test lint demo gpu-check clean bench-native

all: hook

hook: $(HOOK_LIB)

$(HOOK_LIB): $(HOOK_SRC) $(HOOK_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(HOOK_CFLAGS) $(HOOK_LDFLAGS) -o $@ $(HOOK_SRC) -ldl -lm

# The same hook, but the settings file's path (a constant, /etc/gemini/hook.conf) can be redirected with
# GEMINI_TEST_SETTINGS_FILE, so that tests need not write under /etc (hook/settings.c).
TEST_HOOK_LIB := $(BUILD)/testhook/libgemhook.so.1
testhook: $(TEST_HOOK_LIB)

$(TEST_HOOK_LIB): $(HOOK_SRC) $(HOOK_HDR)
	@mkdir -p $(dir $@)
	$(CC) $(HOOK_CFLAGS) -DGEM_TEST_SETTINGS_FILE_ENV $(HOOK_LDFLAGS) -o $@ $(HOOK_SRC) -ldl -lm

-include tests/simcuda/sim.mk

# Native benchmark programs (plain C against libcuda.so.1, no toolkit).
BENCH_BIN := $(BUILD)/bench/launch_cost $(BUILD)/bench/alloc_cost $(BUILD)/bench/event_cost $(BUILD)/bench/gate_probe \
             $(BUILD)/bench/marker_cost
$(BUILD)/bench/%: bench/%.c bench/bench_common.h hook/cuda_types.h
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 -O2 -Wall -Wextra -Ihook -Ibench -o $@ $< -ldl -lpthread
bench-native: $(BENCH_BIN)

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	@# uv installs the test extras in about 5 s where pip takes 40 (CI's whole run is bounded, and this was a tenth
	@# of it); pip does it where uv cannot be had or fails. The tests' own pip (tests/test_packaging.py) is upgraded
	@# either way.
	$(VPY) -m pip install -q --upgrade pip
	{ $(VPY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(VPY) -e '.[test]'; } \
	  || $(VPY) -m pip install -q -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

# The tests bound by wall-clock time (marked `timed`: tests/conftest.py, TIMED_MODULES) run one at a time with the
# machine to themselves; the others first, on PYTEST_WORKERS pytest-xdist workers (0: in one process), one per
# core of CI's 2. (Three workers were no faster: that phase is bound by CPU.)
PYTEST_WORKERS ?= 2
test: venv
	@# The C builds and the lint are independent: on CI's 2 cores they run side by side (mypy alone takes 23 s
	@# of one core from a clean checkout, the four builds 15 s of the other).
	$(MAKE) --no-print-directory -j2 hook testhook sim clients lint WERROR=1
	@# Every test starts daemons, each a fresh Python. Each would parse the headers' cffi declarations (pycparser:
	@# 0.1 s of CPU) where a module made from them once loads at once (gemini/wire/cdefs.py).
	$(VPY) -m gemini.wire.cdefs
	@# With PYTHONDONTWRITEBYTECODE set (as on CI's machines) each of them compiled the package from source again.
	@# Compiled once here, they only read it.
	$(VPY) -m compileall -q gemini tools bench tests >/dev/null
	$(VPY) -m pytest -q -m "not timed" $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS))
	$(VPY) -m pytest -q -m timed

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m mypy

demo: venv hook
	$(VPY) -m gemini.wire.cdefs
	$(VPY) tools/demo.py $(DEMO_ARGS)

# On a GPU node: the system python3 (no venv, no network). Wheels the node lacks are installed
# first from .whl/ when present (docs/gpu-node.md).
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gemini-site .whl/*.whl; fi
	PYTHONPATH=/tmp/gemini-site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m gemini.wire.cdefs
	PYTHONPATH=/tmp/gemini-site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(BUILD) $(HOOK_LIB) .pytest_cache gemini/wire/_cdefs
