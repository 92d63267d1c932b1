/*
 * alloc_cost.c -- latency of cuMemAlloc_v2 and cuMemFree_v2 (2 MiB), through cuGetProcAddress_v2 as
 * cudart gets them. Under the hook every allocation and free is a round trip to the pod manager.
 *
 * usage: alloc_cost [N]   prints one JSON line with p50/p99 of each, in microseconds.
 */
#include "bench_common.h"

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2000;
    bench_open_driver("alloc_cost");
    CUresult (*init)(unsigned) = bench_get("alloc_cost", "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = bench_get("alloc_cost", "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = bench_get("alloc_cost", "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = bench_get("alloc_cost", "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = bench_get("alloc_cost", "cuMemAlloc");
    CUresult (*release)(CUdeviceptr) = bench_get("alloc_cost", "cuMemFree");
    CUdevice dev;
    CUcontext ctx;
    if (init(0) || dev_get(&dev, 0) || retain(&ctx, dev) || set_current(ctx)) {
        fprintf(stderr, "alloc_cost: no device\n");
        return 1;
    }
    double *a = malloc(sizeof(double) * (size_t)n), *f = malloc(sizeof(double) * (size_t)n);
    for (int i = 0; i < n; i++) {
        CUdeviceptr p;
        int64_t t0 = bench_now_ns();
        CUresult rc = alloc(&p, 2u << 20);
        int64_t t1 = bench_now_ns();
        if (rc) {
            fprintf(stderr, "alloc_cost: cuMemAlloc failed: %d\n", rc);
            return 1;
        }
        release(p);
        int64_t t2 = bench_now_ns();
        a[i] = (t1 - t0) / 1e3;
        f[i] = (t2 - t1) / 1e3;
    }
    qsort(a, (size_t)n, sizeof *a, bench_cmp_double);
    qsort(f, (size_t)n, sizeof *f, bench_cmp_double);
    printf("{\"alloc_us_p50\": %.2f, \"alloc_us_p99\": %.2f, \"free_us_p50\": %.2f, \"free_us_p99\": %.2f, \"n\": %d}\n",
           a[n / 2], a[n * 99 / 100], f[n / 2], f[n * 99 / 100], n);
    return 0;
}
