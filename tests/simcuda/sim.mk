# tests/simcuda/sim.mk -- the simulated CUDA driver and the C test clients.
#
# Included by the top-level Makefile; also usable alone from the repository
# root:  make -f tests/simcuda/sim.mk sim clients
#
#   sim      $(BUILD)/simcuda/libcuda.so.1 (+ libcuda.so for -lcuda), and
#            $(BUILD)/simcuda/libnvidia-ml.so.1 (the NVML memory queries)
#   clients  $(BUILD)/clients/workload-procaddr  (dlopen + cuGetProcAddress_v2)
#            $(BUILD)/clients/workload-linked    (-lcuda; no rpath, so the
#            libcuda.so.1 on the library path at run time is the one used)
#
# Plain C, no CUDA toolkit. The simulator is linked -Bsymbolic-functions so
# that its own references (the cuGetProcAddress table) bind to its own
# definitions even when a preloaded hook exports the same names.

CC    ?= cc
BUILD ?= build

SIM_DIR  := tests/simcuda
SIM_SRC  := $(addprefix $(SIM_DIR)/,sim_state.c sim_ctx.c sim_exec.c sim_mem.c sim_vmm.c sim_graph.c sim_procaddr.c)
SIM_HDR  := $(SIM_DIR)/sim_api.h $(SIM_DIR)/sim_internal.h hook/cuda_types.h
SIM_LIB  := $(BUILD)/simcuda/libcuda.so.1
SIM_LINK := $(BUILD)/simcuda/libcuda.so
SIM_NVML := $(BUILD)/simcuda/libnvidia-ml.so.1
SIM_CFLAGS  := -std=gnu11 -O2 -g -fPIC -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter -pthread -Ihook \
               $(if $(WERROR),-Werror)
SIM_LDFLAGS := -shared -pthread -Wl,-soname,libcuda.so.1 -Wl,-Bsymbolic-functions -Wl,--no-undefined

CLIENT_SRC    := tests/clients/workload.c
CLIENT_CFLAGS := -std=gnu11 -O2 -g -Wall -Wextra -pthread -Ihook $(if $(WERROR),-Werror)
CLIENTS       := $(BUILD)/clients/workload-procaddr $(BUILD)/clients/workload-linked

.PHONY: sim clients

sim: $(SIM_LIB) $(SIM_LINK) $(SIM_NVML)

$(SIM_LIB): $(SIM_SRC) $(SIM_HDR) $(SIM_DIR)/sim.mk
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) $(SIM_LDFLAGS) -o $@ $(SIM_SRC) -lrt

$(SIM_LINK): $(SIM_LIB)
	ln -sf libcuda.so.1 $@

$(SIM_NVML): $(SIM_DIR)/sim_nvml.c $(SIM_DIR)/sim.mk
	@mkdir -p $(dir $@)
	$(CC) $(SIM_CFLAGS) -shared -Wl,-soname,libnvidia-ml.so.1 -Wl,--no-undefined -o $@ $<

clients: $(CLIENTS)

$(BUILD)/clients/workload-procaddr: $(CLIENT_SRC) hook/cuda_types.h $(SIM_DIR)/sim.mk
	@mkdir -p $(dir $@)
	$(CC) $(CLIENT_CFLAGS) -DWORKLOAD_PROCADDR -o $@ $(CLIENT_SRC) -ldl -lm

$(BUILD)/clients/workload-linked: $(CLIENT_SRC) hook/cuda_types.h $(SIM_DIR)/sim.mk $(SIM_LINK)
	@mkdir -p $(dir $@)
	$(CC) $(CLIENT_CFLAGS) -DWORKLOAD_LINKED -o $@ $(CLIENT_SRC) -L$(BUILD)/simcuda -lcuda -lm
