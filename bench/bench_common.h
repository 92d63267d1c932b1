/* bench_common.h -- what the native benchmarks share: entry points through cuGetProcAddress_v2 (as
 * cudart gets them, so the hook's wrappers are what is measured), a clock, and a sort for percentiles. */
#ifndef GEMINI_BENCH_COMMON_H
#define GEMINI_BENCH_COMMON_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_types.h"

typedef CUresult (*bench_gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static bench_gpa_t bench_gpa;

/* Open libcuda.so.1 and find cuGetProcAddress_v2 (through dlsym, as cudart does). Exits on failure. */
static inline void bench_open_driver(const char *prog) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h || !(bench_gpa = (bench_gpa_t)dlsym(h, "cuGetProcAddress_v2"))) {
        fprintf(stderr, "%s: %s\n", prog, h ? "no cuGetProcAddress_v2" : dlerror());
        exit(2);
    }
}

static inline void *bench_get(const char *prog, const char *name) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    if (bench_gpa(name, &p, 12000, 0, &st) != 0 || !p) {
        fprintf(stderr, "%s: no entry point %s\n", prog, name);
        exit(2);
    }
    return p;
}

static inline int64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A kernel spin(u64 ns) that spins on %globaltimer for ns (the simulated driver runs any kernel not named gem_spin
 * for SIMCUDA_KERNEL_US). */
#define BENCH_SPIN_PTX                                                                                             \
    ".version 7.0\n.target sm_70\n.address_size 64\n"                                                             \
    ".visible .entry spin(.param .u64 ns)\n{\n"                                                                    \
    "    .reg .pred %p<2>;\n    .reg .b64 %rd<6>;\n"                                                               \
    "    ld.param.u64 %rd1, [ns];\n"                                                                               \
    "    mov.u64 %rd2, %globaltimer;\n"                                                                            \
    "LOOP:\n"                                                                                                      \
    "    mov.u64 %rd3, %globaltimer;\n"                                                                            \
    "    sub.u64 %rd4, %rd3, %rd2;\n"                                                                              \
    "    setp.lt.u64 %p1, %rd4, %rd1;\n"                                                                           \
    "    @%p1 bra LOOP;\n"                                                                                         \
    "    ret;\n}\n"

/* Device 0's primary context made current, and BENCH_SPIN_PTX's kernel in it. Exits on failure. */
static inline CUfunction bench_load_spin(const char *prog, CUcontext *ctx) {
    CUresult (*init)(unsigned) = bench_get(prog, "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = bench_get(prog, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = bench_get(prog, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = bench_get(prog, "cuCtxSetCurrent");
    CUresult (*load)(CUmodule *, const void *) = bench_get(prog, "cuModuleLoadData");
    CUresult (*get_fn)(CUfunction *, CUmodule, const char *) = bench_get(prog, "cuModuleGetFunction");
    CUdevice dev;
    CUmodule mod;
    CUfunction fn;
    if (init(0) || dev_get(&dev, 0) || retain(ctx, dev) || set_current(*ctx) || load(&mod, BENCH_SPIN_PTX) ||
        get_fn(&fn, mod, "spin")) {
        fprintf(stderr, "%s: set-up failed\n", prog);
        exit(2);
    }
    return fn;
}

static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
