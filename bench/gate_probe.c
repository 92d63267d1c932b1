/*
 * gate_probe.c -- can a batch process's queued work be held back on the GPU itself while a latency process
 * runs a request? Two processes on GPU 0, each in its own context (so the GPU time-slices between them):
 *
 *   batch:   full-width spin kernels of --batch-us each, queued up to --depth kernels deep;
 *   latency: every --period-ms a request of --req-kernels spin kernels of --req-us, then cuCtxSynchronize;
 *            with --req-gap-us G the host spins G µs after each launch but the last (an eager framework's host,
 *            slower than its small kernels, leaves the GPU idle between them).
 *
 * Modes (--mode):
 *   alone   the latency process only;
 *   native  both, no coordination (the GPU's own time-slicing);
 *   tight   the latency process raises a shared flag for its request; the batch process stops launching
 *           while it is up and keeps only --tight-depth kernels queued (what hook/inflight.c does today);
 *   gate    as tight, but the batch process keeps --depth kernels queued and puts a cuStreamWaitValue32 on a
 *           word of its own pinned, device-mapped memory before every --every kernels; a thread of the batch
 *           process mirrors the shared flag into that word, so the GPU stops the batch stream at its next wait.
 *
 * Prints one JSON line: the latency process's request times (p50/p99/max, ms), the batch process's busy
 * fraction (kernels run x --batch-us over the run), and the host cost of one cuStreamWaitValue32 (ns).
 * Run natively, never under the hook.
 */
#include "bench_common.h"
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);

struct shared {
    atomic_int claim;       /* the latency process's request is on */
    atomic_int ready;       /* processes that finished their set-up */
    atomic_int stop;
    atomic_llong batch_kernels;
    double wait_cost_ns;
    int errors;
};

static struct {
    const char *mode;
    int batch_us, depth, tight_depth, every, req_kernels, req_us, period_ms, seconds, blocks, req_gap_us;
} opt = {"gate", 200, 25, 5, 2, 5, 200, 20, 5, 132, 0};

static volatile int *gate_word;      /* the batch process's pinned word: 1 holds its stream at the next wait */
static struct shared *sh;

static void *mirror(void *arg) {
    (void)arg;
    while (!atomic_load(&sh->stop)) {
        int c = atomic_load_explicit(&sh->claim, memory_order_acquire);
        if (*gate_word != c)
            *gate_word = c;
        __builtin_ia32_pause();
    }
    *gate_word = 0;
    return NULL;
}

static void batch(void) {
    CUcontext ctx;
    CUfunction fn = bench_load_spin("gate_probe", &ctx);
    launch_t launch = (launch_t)bench_get("p", "cuLaunchKernel");
    CUresult (*ev_create)(CUevent *, unsigned) = bench_get("p", "cuEventCreate");
    CUresult (*ev_record)(CUevent, CUstream) = bench_get("p", "cuEventRecord");
    CUresult (*ev_sync)(CUevent) = bench_get("p", "cuEventSynchronize");
    CUresult (*sync)(void) = bench_get("p", "cuCtxSynchronize");
    int gate = strcmp(opt.mode, "gate") == 0, stops = gate || strcmp(opt.mode, "tight") == 0;
    CUresult (*host_alloc)(void **, size_t, unsigned) = gate ? bench_get("p", "cuMemHostAlloc") : NULL;
    CUresult (*dev_ptr)(CUdeviceptr *, void *, unsigned) = gate ? bench_get("p", "cuMemHostGetDevicePointer") : NULL;
    CUresult (*wait_value)(CUstream, CUdeviceptr, uint32_t, unsigned) =
        gate ? bench_get("p", "cuStreamWaitValue32") : NULL;
    int depth = strcmp(opt.mode, "tight") == 0 ? opt.tight_depth : opt.depth;
    CUdeviceptr word_dev = 0;
    pthread_t th;
    if (gate) {
        void *p = NULL;
        CUresult rc = host_alloc(&p, 4096, 0x01 | 0x02);      /* PORTABLE | DEVICEMAP */
        if (rc == 0)
            rc = dev_ptr(&word_dev, p, 0);
        if (rc != 0) {
            fprintf(stderr, "gate_probe: pinned word: error %d\n", rc);
            exit(2);
        }
        gate_word = p;
        *gate_word = 0;
        pthread_create(&th, NULL, mirror, NULL);
    }
    enum { RING = 256 };
    CUevent ev[RING];
    for (int i = 0; i < RING; i++)
        ev_create(&ev[i], 2);           /* CU_EVENT_DISABLE_TIMING */
    uint64_t ns = (uint64_t)opt.batch_us * 1000;
    void *args[] = {&ns};
    atomic_fetch_add(&sh->ready, 1);
    long long n = 0, waits = 0;
    double wait_ns = 0;
    while (!atomic_load(&sh->stop)) {
        if (stops)
            while (atomic_load_explicit(&sh->claim, memory_order_acquire) && !atomic_load(&sh->stop))
                __builtin_ia32_pause();
        if (n >= depth)
            ev_sync(ev[(n - depth) % RING]);
        if (gate && n % opt.every == 0) {
            int64_t t0 = bench_now_ns();
            if (wait_value(NULL, word_dev, 0, 0x1) != 0)     /* CU_STREAM_WAIT_VALUE_EQ */
                sh->errors++;
            wait_ns += (double)(bench_now_ns() - t0);
            waits++;
        }
        if (launch(fn, opt.blocks, 1, 1, 128, 1, 1, 0, NULL, args, NULL) != 0)
            sh->errors++;
        ev_record(ev[n % RING], NULL);
        n++;
        /* kernels finished so far: those whose event is behind the queue */
        if (n > depth)
            atomic_store(&sh->batch_kernels, n - depth);
    }
    sync();
    atomic_store(&sh->batch_kernels, n);
    sh->wait_cost_ns = waits ? wait_ns / (double)waits : 0;
    if (gate)
        pthread_join(th, NULL);
}

static int latency(double *times, int cap) {
    CUcontext ctx;
    CUfunction fn = bench_load_spin("gate_probe", &ctx);
    launch_t launch = (launch_t)bench_get("p", "cuLaunchKernel");
    CUresult (*sync)(void) = bench_get("p", "cuCtxSynchronize");
    uint64_t ns = (uint64_t)opt.req_us * 1000;
    void *args[] = {&ns};
    int claims = strcmp(opt.mode, "tight") == 0 || strcmp(opt.mode, "gate") == 0;
    launch(fn, opt.blocks, 1, 1, 128, 1, 1, 0, NULL, args, NULL);     /* warm */
    sync();
    atomic_fetch_add(&sh->ready, 1);
    while (atomic_load(&sh->ready) < (strcmp(opt.mode, "alone") ? 2 : 1))
        usleep(1000);
    usleep(300 * 1000);     /* the batch queue fills */
    int k = 0;
    int64_t end = bench_now_ns() + (int64_t)opt.seconds * 1000000000LL, next = bench_now_ns();
    while (bench_now_ns() < end && k < cap) {
        while (bench_now_ns() < next)
            usleep(100);
        int64_t t0 = bench_now_ns();
        if (claims)
            atomic_store_explicit(&sh->claim, 1, memory_order_release);
        for (int i = 0; i < opt.req_kernels; i++) {
            launch(fn, opt.blocks, 1, 1, 128, 1, 1, 0, NULL, args, NULL);
            if (opt.req_gap_us && i + 1 < opt.req_kernels)
                for (int64_t until = bench_now_ns() + (int64_t)opt.req_gap_us * 1000; bench_now_ns() < until;)
                    ;
        }
        sync();
        if (claims)
            atomic_store_explicit(&sh->claim, 0, memory_order_release);
        times[k++] = (double)(bench_now_ns() - t0) / 1e6;
        next += (int64_t)opt.period_ms * 1000000;
    }
    return k;
}

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--mode")) opt.mode = v;
        else if (!strcmp(k, "--batch-us")) opt.batch_us = atoi(v);
        else if (!strcmp(k, "--depth")) opt.depth = atoi(v);
        else if (!strcmp(k, "--tight-depth")) opt.tight_depth = atoi(v);
        else if (!strcmp(k, "--every")) opt.every = atoi(v);
        else if (!strcmp(k, "--req-kernels")) opt.req_kernels = atoi(v);
        else if (!strcmp(k, "--req-us")) opt.req_us = atoi(v);
        else if (!strcmp(k, "--period-ms")) opt.period_ms = atoi(v);
        else if (!strcmp(k, "--seconds")) opt.seconds = atoi(v);
        else if (!strcmp(k, "--blocks")) opt.blocks = atoi(v);
        else if (!strcmp(k, "--req-gap-us")) opt.req_gap_us = atoi(v);
        else { fprintf(stderr, "gate_probe: unknown option %s\n", k); return 2; }
    }
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED)
        return 2;
    memset(sh, 0, sizeof *sh);
    bench_open_driver("gate_probe");
    pid_t child = -1;
    if (strcmp(opt.mode, "alone") != 0) {
        child = fork();
        if (child == 0) {
            batch();
            _exit(0);
        }
    }
    static double times[100000];
    int64_t t0 = bench_now_ns();
    long long k0 = 0;
    int n = 0;
    {
        /* the batch process's kernels are counted over the latency process's measured span */
        while (child > 0 && atomic_load(&sh->ready) < 1)
            usleep(1000);
        k0 = atomic_load(&sh->batch_kernels);
        t0 = bench_now_ns();
        n = latency(times, 100000);
    }
    int64_t t1 = bench_now_ns();
    long long k1 = atomic_load(&sh->batch_kernels);
    atomic_store(&sh->stop, 1);
    if (child > 0)
        waitpid(child, NULL, 0);
    qsort(times, n, sizeof *times, bench_cmp_double);
    double busy = child > 0 ? (double)(k1 - k0) * opt.batch_us * 1e3 / (double)(t1 - t0) : 0;
    printf("{\"mode\": \"%s\", \"requests\": %d, \"p50_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f, "
           "\"batch_busy\": %.4f, \"wait_value_ns\": %.0f, \"errors\": %d}\n",
           opt.mode, n, n ? times[n / 2] : 0, n ? times[(int)(n * 0.99)] : 0, n ? times[n - 1] : 0, busy,
           sh->wait_cost_ns, sh->errors);
    return 0;
}
