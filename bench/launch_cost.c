/*
 * launch_cost.c -- host cost of one cuLaunchKernel of an empty kernel.
 *
 * Entry points come through cuGetProcAddress_v2, as cudart (and so PyTorch)
 * gets them, so under LD_PRELOAD=libgemhook.so.1 this measures the hook's
 * launch path. Launches go in batches small enough never to fill the
 * driver's queue (a full queue would measure the GPU, not the host); the
 * context is synchronised between batches, outside the timed region.
 *
 * usage: launch_cost [BATCHES [BATCH]]   prints one JSON line:
 *   {"ns_per_launch_median": ..., "ns_per_launch_p10": ..., "ns_per_launch_p90": ..., ...}
 */
#include "bench_common.h"
static const char empty_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry gem_empty()\n{\n    ret;\n}\n";

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);

#define CHECK(call)                                                   \
    do {                                                              \
        CUresult rc_ = (call);                                        \
        if (rc_ != 0) {                                               \
            fprintf(stderr, "launch_cost: %s failed: %d\n", #call, rc_); \
            return 1;                                                 \
        }                                                             \
    } while (0)

int main(int argc, char **argv) {
    int batches = argc > 1 ? atoi(argv[1]) : 2000;
    int batch = argc > 2 ? atoi(argv[2]) : 128;
    bench_open_driver("launch_cost");
    CUresult (*init)(unsigned) = bench_get("launch_cost", "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = bench_get("launch_cost", "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = bench_get("launch_cost", "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = bench_get("launch_cost", "cuCtxSetCurrent");
    CUresult (*load)(CUmodule *, const void *) = bench_get("launch_cost", "cuModuleLoadData");
    CUresult (*get_fn)(CUfunction *, CUmodule, const char *) = bench_get("launch_cost", "cuModuleGetFunction");
    CUresult (*sync)(void) = bench_get("launch_cost", "cuCtxSynchronize");
    launch_t launch = (launch_t)bench_get("launch_cost", "cuLaunchKernel");
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CHECK(init(0));
    CHECK(dev_get(&dev, 0));
    CHECK(retain(&ctx, dev));
    CHECK(set_current(ctx));
    CHECK(load(&mod, empty_ptx));
    CHECK(get_fn(&fn, mod, "gem_empty"));
    for (int i = 0; i < 200; i++) /* warm up: JIT, first token */
        CHECK(launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK(sync());
    double *per = malloc(sizeof(double) * (size_t)batches);
    for (int b = 0; b < batches; b++) {
        int64_t t0 = bench_now_ns();
        for (int i = 0; i < batch; i++)
            CHECK(launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
        int64_t t1 = bench_now_ns();
        CHECK(sync());
        per[b] = (double)(t1 - t0) / batch;
    }
    qsort(per, (size_t)batches, sizeof *per, bench_cmp_double);
    /* What the hook's clock reads cost on this machine, for the record. */
    struct timespec ts, res;
    int64_t c0 = bench_now_ns();
    for (int i = 0; i < 1000000; i++)
        clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t c1 = bench_now_ns();
    for (int i = 0; i < 1000000; i++)
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    int64_t c2 = bench_now_ns();
    clock_getres(CLOCK_MONOTONIC_COARSE, &res);
    printf("{\"ns_per_launch_median\": %.1f, \"ns_per_launch_p10\": %.1f, \"ns_per_launch_p90\": %.1f, "
           "\"batches\": %d, \"batch\": %d, \"clock_monotonic_ns\": %.1f, \"clock_coarse_ns\": %.1f, "
           "\"coarse_resolution_ns\": %ld}\n",
           per[batches / 2], per[batches / 10], per[batches * 9 / 10], batches, batch, (c1 - c0) / 1e6,
           (c2 - c1) / 1e6, res.tv_nsec);
    return 0;
}
