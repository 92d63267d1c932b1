/*
 * marker_cost.c -- the GPU time each of an in-flight marker's stream operations adds (hook/inflight.c). Beside a
 * latency group a batch process puts, every half millisecond of its kernels, a cuStreamWaitValue32 on a word of
 * its own registered page (the GPU-side gate, hook/gpugate.c) and a timed cuEventRecord on the stream; an eager
 * trainer ran 2.5 points slower beside an idle latency group, and about 0.4 points with the markers twice as far
 * apart (docs/benchmarks.md, "Twenty-third session"). The host's side of each call is bench/event_cost.c's; this is
 * the GPU's: one stream of back-to-back spin kernels, with an operation after every --every of them, against the
 * same kernels with none, interleaved round by round.
 *
 * Variants: none; record (a timed event, as the markers'); record_nt (CU_EVENT_DISABLE_TIMING); wait (the gate's
 * wait on a registered host word that already holds the value); marker (wait, then a timed record: the hook's);
 * marker_nt (wait, then an untimed record); record_wait (a timed record, then the wait: the other order);
 * device_wait (the wait on a word of device memory instead: whether the host word's distance is the wait's cost).
 *
 * usage: marker_cost [--kernel-us 20] [--kernels 20000] [--every 10] [--rounds 5 (at most 1000)]
 * Prints one JSON line: per variant the median over rounds of the GPU time it added per operation (ns), the
 * kernels' own GPU time per kernel with none, and the rounds' spread. Run natively, never under the hook.
 */
#include "bench_common.h"
#include <getopt.h>
#include <string.h>
#include <sys/mman.h>

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);

enum { NONE, RECORD, RECORD_NT, WAIT, MARKER, MARKER_NT, RECORD_WAIT, DEVICE_WAIT, NVARIANTS };
static const char *const variant_name[NVARIANTS] = {"none", "record", "record_nt", "wait", "marker", "marker_nt",
                                                    "record_wait", "device_wait"};

static struct {
    int kernel_us, kernels, every, rounds;
} opt = {20, 20000, 10, 5};

static launch_t launch;
static CUresult (*ev_create)(CUevent *, unsigned);
static CUresult (*ev_record)(CUevent, CUstream);
static CUresult (*ev_sync)(CUevent);
static CUresult (*ev_elapsed)(float *, CUevent, CUevent);
static CUresult (*wait_value)(CUstream, CUdeviceptr, uint32_t, unsigned);
static CUdeviceptr device_word;     /* a word of device memory holding 0 (device_wait) */

static void check(CUresult rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "marker_cost: %s: error %d\n", what, (int)rc);
        exit(1);
    }
}

/* One run of the variant: the GPU time from the first kernel's start to the last's end, ms. */
static double run(int variant, CUfunction fn, CUstream s, CUevent start, CUevent end, CUevent timed, CUevent untimed,
                  CUdeviceptr word) {
    uint64_t ns = (uint64_t)opt.kernel_us * 1000;
    void *args[] = {&ns};
    check(ev_record(start, s), "cuEventRecord");
    for (int i = 1; i <= opt.kernels; i++) {
        check(launch(fn, 132, 1, 1, 128, 1, 1, 0, s, args, NULL), "cuLaunchKernel");
        if (i % opt.every || i == opt.kernels)
            continue;
        if (variant == RECORD_WAIT)
            check(ev_record(timed, s), "cuEventRecord");
        if (variant == WAIT || variant == MARKER || variant == MARKER_NT || variant == RECORD_WAIT)
            check(wait_value(s, word, 0, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32");
        if (variant == DEVICE_WAIT)
            check(wait_value(s, device_word, 0, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32");
        if (variant == RECORD || variant == MARKER)
            check(ev_record(timed, s), "cuEventRecord");
        if (variant == RECORD_NT || variant == MARKER_NT)
            check(ev_record(untimed, s), "cuEventRecord");
    }
    check(ev_record(end, s), "cuEventRecord");
    check(ev_sync(end), "cuEventSynchronize");
    float ms = 0;
    check(ev_elapsed(&ms, start, end), "cuEventElapsedTime");
    return ms;
}

/* The median of n sorted values (the mean of the middle two when n is even). */
static double median(const double *v, int n) { return (v[(n - 1) / 2] + v[n / 2]) / 2; }

static void usage(void) {
    fprintf(stderr, "usage: marker_cost [--kernel-us N] [--kernels N] [--every N] [--rounds N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    static const struct option longs[] = {{"kernel-us", 1, 0, 'k'}, {"kernels", 1, 0, 'n'}, {"every", 1, 0, 'e'},
                                          {"rounds", 1, 0, 'r'}, {0, 0, 0, 0}};
    for (int c; (c = getopt_long(argc, argv, "", longs, NULL)) != -1;) {
        char *endp;
        long v = optarg ? strtol(optarg, &endp, 10) : 0;
        if (c == '?' || !optarg || *endp || v <= 0 || v > (c == 'r' ? 1000 : 10000000))
            usage();
        *(c == 'k' ? &opt.kernel_us : c == 'n' ? &opt.kernels : c == 'e' ? &opt.every : &opt.rounds) = (int)v;
    }
    if (optind != argc || opt.every >= opt.kernels)
        usage();
    bench_open_driver("marker_cost");
    CUcontext ctx;
    CUfunction fn = bench_load_spin("marker_cost", &ctx);
    launch = (launch_t)bench_get("marker_cost", "cuLaunchKernel");
    ev_create = bench_get("marker_cost", "cuEventCreate");
    ev_record = bench_get("marker_cost", "cuEventRecord");
    ev_sync = bench_get("marker_cost", "cuEventSynchronize");
    ev_elapsed = bench_get("marker_cost", "cuEventElapsedTime");
    wait_value = bench_get("marker_cost", "cuStreamWaitValue32");
    CUresult (*stream_create)(CUstream *, unsigned) = bench_get("marker_cost", "cuStreamCreate");
    CUresult (*host_register)(void *, size_t, unsigned) = bench_get("marker_cost", "cuMemHostRegister");
    CUresult (*dev_ptr)(CUdeviceptr *, void *, unsigned) = bench_get("marker_cost", "cuMemHostGetDevicePointer");
    /* the gate's word as the hook keeps it: a page of the process's own, registered and mapped into the device */
    volatile uint32_t *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) {
        perror("marker_cost: mmap");
        return 1;
    }
    page[0] = 0;
    CUdeviceptr word = 0;
    check(host_register((void *)page, 4096, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
          "cuMemHostRegister");
    check(dev_ptr(&word, (void *)page, 0), "cuMemHostGetDevicePointer");
    CUresult (*mem_alloc)(CUdeviceptr *, size_t) = bench_get("marker_cost", "cuMemAlloc");
    CUresult (*memset_d32)(CUdeviceptr, unsigned, size_t) = bench_get("marker_cost", "cuMemsetD32");
    check(mem_alloc(&device_word, 4096), "cuMemAlloc");
    check(memset_d32(device_word, 0, 1024), "cuMemsetD32");
    CUstream s;
    check(stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUevent start, end, timed, untimed;
    check(ev_create(&start, 0), "cuEventCreate");
    check(ev_create(&end, 0), "cuEventCreate");
    check(ev_create(&timed, 0), "cuEventCreate");
    check(ev_create(&untimed, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    run(MARKER, fn, s, start, end, timed, untimed, word);      /* warm: the module, the stream, the page */
    double *ms = calloc((size_t)opt.rounds * NVARIANTS, sizeof *ms);
    double *added = calloc((size_t)opt.rounds, sizeof *added);
    double *none = calloc((size_t)opt.rounds, sizeof *none);
    if (!ms || !added || !none)
        return 1;
    for (int r = 0; r < opt.rounds; r++)
        for (int k = 0; k < NVARIANTS; k++) {
            int v = (k + r) % NVARIANTS;       /* each round starts with another variant */
            ms[r * NVARIANTS + v] = run(v, fn, s, start, end, timed, untimed, word);
        }
    int ops = (opt.kernels - 1) / opt.every;
    for (int r = 0; r < opt.rounds; r++)
        none[r] = ms[r * NVARIANTS + NONE] * 1e6 / opt.kernels;
    qsort(none, (size_t)opt.rounds, sizeof *none, bench_cmp_double);
    printf("{\"kernel_us\": %d, \"kernels\": %d, \"every\": %d, \"rounds\": %d, \"ops\": %d, "
           "\"kernel_ns_none\": %.1f", opt.kernel_us, opt.kernels, opt.every, opt.rounds, ops, median(none, opt.rounds));
    for (int v = RECORD; v < NVARIANTS; v++) {
        for (int r = 0; r < opt.rounds; r++)     /* against the same round's run with none */
            added[r] = (ms[r * NVARIANTS + v] - ms[r * NVARIANTS + NONE]) * 1e6 / ops;
        qsort(added, (size_t)opt.rounds, sizeof *added, bench_cmp_double);
        printf(", \"%s_ns\": %.1f, \"%s_ns_range\": [%.1f, %.1f]", variant_name[v], median(added, opt.rounds),
               variant_name[v], added[0], added[opt.rounds - 1]);
    }
    printf("}\n");
    free(ms);
    free(added);
    free(none);
    return 0;
}
