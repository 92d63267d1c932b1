/*
 * alloc_cost.c -- latency of cuMemAlloc_v2 and cuMemFree_v2 (2 MiB), through cuGetProcAddress_v2 as
 * cudart gets them. Under the hook every allocation and free is a round trip to the pod manager.
 *
 * usage: alloc_cost [N]   prints one JSON line with p50/p99 of each, in microseconds.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_types.h"

typedef CUresult (*gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static gpa_t gpa;

static void *get(const char *name) {
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    if (gpa(name, &p, 12000, 0, &st) != 0 || !p) {
        fprintf(stderr, "alloc_cost: no entry point %s\n", name);
        exit(2);
    }
    return p;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2000;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "alloc_cost: %s\n", dlerror());
        return 2;
    }
    gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    CUresult (*init)(unsigned) = get("cuInit");
    CUresult (*dev_get)(CUdevice *, int) = get("cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = get("cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = get("cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = get("cuMemAlloc");
    CUresult (*release)(CUdeviceptr) = get("cuMemFree");
    CUdevice dev;
    CUcontext ctx;
    if (init(0) || dev_get(&dev, 0) || retain(&ctx, dev) || set_current(ctx)) {
        fprintf(stderr, "alloc_cost: no device\n");
        return 1;
    }
    double *a = malloc(sizeof(double) * (size_t)n), *f = malloc(sizeof(double) * (size_t)n);
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        int64_t t0 = now_ns();
        CUresult rc = alloc(&p, 2u << 20);
        int64_t t1 = now_ns();
        if (rc) {
            fprintf(stderr, "alloc_cost: cuMemAlloc failed: %d\n", rc);
            return 1;
        }
        release(p);
        int64_t t2 = now_ns();
        a[i] = (t1 - t0) / 1e3;
        f[i] = (t2 - t1) / 1e3;
    }
    qsort(a, (size_t)n, sizeof *a, cmp);
    qsort(f, (size_t)n, sizeof *f, cmp);
    printf("{\"alloc_us_p50\": %.2f, \"alloc_us_p99\": %.2f, \"free_us_p50\": %.2f, \"free_us_p99\": %.2f, \"n\": %d}\n",
           a[n / 2], a[n * 99 / 100], f[n / 2], f[n * 99 / 100], n);
    return 0;
}
