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
static void bench_open_driver(const char *prog) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h || !(bench_gpa = (bench_gpa_t)dlsym(h, "cuGetProcAddress_v2"))) {
        fprintf(stderr, "%s: %s\n", prog, h ? "no cuGetProcAddress_v2" : dlerror());
        exit(2);
    }
}

static void *bench_get(const char *prog, const char *name) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    if (bench_gpa(name, &p, 12000, 0, &st) != 0 || !p) {
        fprintf(stderr, "%s: no entry point %s\n", prog, name);
        exit(2);
    }
    return p;
}

static int64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
