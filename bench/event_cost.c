/*
 * event_cost.c -- the driver's host cost of each call an in-flight marker makes (hook/inflight.c), so a
 * marker's cost can be read off: cuEventRecord, cuEventQuery of a finished event and of one just recorded,
 * cuEventElapsedTime, two cuThreadExchangeStreamCaptureMode, and cuCtxGetCurrent with a mutex.
 * Run natively (entry points through cuGetProcAddress_v2; under the hook it would time the wrappers).
 *
 * usage: event_cost      prints one JSON line of medians over 20000 rounds, ns
 */
#include "bench_common.h"
#include <pthread.h>
static const char empty_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry gem_empty()\n{\n    ret;\n}\n";
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
#define N 20000
static double med(double *v, int n) { qsort(v, n, sizeof *v, bench_cmp_double); return v[n / 2]; }
int main(void) {
    bench_open_driver("m");
    CUresult (*init)(unsigned) = bench_get("m", "cuInit");
    CUresult (*dev_get)(CUdevice *, int) = bench_get("m", "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = bench_get("m", "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = bench_get("m", "cuCtxSetCurrent");
    CUresult (*get_current)(CUcontext *) = bench_get("m", "cuCtxGetCurrent");
    CUresult (*load)(CUmodule *, const void *) = bench_get("m", "cuModuleLoadData");
    CUresult (*get_fn)(CUfunction *, CUmodule, const char *) = bench_get("m", "cuModuleGetFunction");
    CUresult (*sync)(void) = bench_get("m", "cuCtxSynchronize");
    CUresult (*ev_create)(CUevent *, unsigned) = bench_get("m", "cuEventCreate");
    CUresult (*ev_record)(CUevent, CUstream) = bench_get("m", "cuEventRecord");
    CUresult (*ev_query)(CUevent) = bench_get("m", "cuEventQuery");
    CUresult (*ev_elapsed)(float *, CUevent, CUevent) = bench_get("m", "cuEventElapsedTime");
    CUresult (*xchg)(int *) = bench_get("m", "cuThreadExchangeStreamCaptureMode");
    launch_t launch = (launch_t)bench_get("m", "cuLaunchKernel");
    CUdevice dev; CUcontext ctx; CUmodule mod; CUfunction fn;
    init(0); dev_get(&dev, 0); retain(&ctx, dev); set_current(ctx); load(&mod, empty_ptx);
    get_fn(&fn, mod, "gem_empty");
    CUevent ev[64];
    for (int i = 0; i < 64; i++) ev_create(&ev[i], 0);
    static double t[8][N];
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < N; i++) {
        launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        int64_t a = bench_now_ns();
        launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        int64_t b = bench_now_ns();
        ev_record(ev[i % 64], NULL);
        int64_t c = bench_now_ns();
        ev_query(ev[(i + 60) % 64]);          /* old: done */
        int64_t d = bench_now_ns();
        ev_query(ev[i % 64]);                 /* just recorded: maybe not ready */
        int64_t e = bench_now_ns();
        float ms; ev_elapsed(&ms, ev[(i + 62) % 64], ev[(i + 63) % 64]);
        int64_t f = bench_now_ns();
        int mode = 2; xchg(&mode); xchg(&mode);
        int64_t g = bench_now_ns();
        CUcontext cur; get_current(&cur); pthread_mutex_lock(&mu); pthread_mutex_unlock(&mu);
        int64_t h = bench_now_ns();
        t[0][i] = b - a; t[1][i] = c - b; t[2][i] = d - c; t[3][i] = e - d; t[4][i] = f - e; t[5][i] = g - f;
        t[6][i] = h - g;
        if (i % 100 == 99) sync();
    }
    printf("{\"launch\": %.0f, \"record\": %.0f, \"query_done\": %.0f, \"query_recent\": %.0f, \"elapsed\": %.0f, "
           "\"xchg2\": %.0f, \"getcur_mutex\": %.0f}\n", med(t[0], N), med(t[1], N), med(t[2], N), med(t[3], N),
           med(t[4], N), med(t[5], N), med(t[6], N));
    return 0;
}
