/*
 * launch_cost.c -- host cost of one cuLaunchKernel of an empty kernel.
 *
 * Entry points come through cuGetProcAddress_v2, as cudart (and so PyTorch)
 * gets them, so under LD_PRELOAD=libgemhook.so.1 this measures the hook's
 * launch path. Launches go in batches small enough never to fill the
 * driver's queue (a full queue would measure the GPU, not the host); the
 * context is synchronised between batches, outside the timed region.
 *
 * usage: launch_cost [BATCHES [BATCH [ctx|stream]]]   prints one JSON line (the last argument: how the batches
 * are synchronised, cuCtxSynchronize by default or cuStreamSynchronize of the legacy stream):
 *   {"ns_per_launch_median": ..., "ns_per_launch_p10": ..., "ns_per_launch_p90": ..., ...}
 *
 * In the same run it also times, in alternate batches, cuLaunchKernel as the driver itself exports it, found
 * in libcuda's own dynamic symbol table (the hook intercepts dlsym and cuGetProcAddress, not that table).
 * Under the hook, the median of each pair of batches' difference is the hook's added cost per launch, measured
 * on one driver state in one process: separate processes differ from each other by up to 1 us per launch
 * (where the driver's queues land, the CPU's state), ten times what we want to resolve. Natively both are
 * the same function, so the same figure is the measurement's own noise ("paired_*" fields).
 */
#include "bench_common.h" /* first: it defines _GNU_SOURCE, which link.h needs for dl_iterate_phdr */

#include <elf.h>
#include <link.h>
#include <string.h>
static const char empty_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry gem_empty()\n{\n    ret;\n}\n";

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);

/* ---- the driver's own cuLaunchKernel, from libcuda's dynamic symbol table (GNU hash) ---------------- */

struct sym_query {
    const char *name;
    void *addr;
};

static uintptr_t dyn_ptr(const struct dl_phdr_info *info, ElfW(Addr) v) {
    /* ld.so relocates these entries in place on most targets; where it does not, they are offsets */
    return v < info->dlpi_addr ? info->dlpi_addr + v : v;
}

static int find_in_libcuda(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct sym_query *q = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcuda.so"))
        return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!dyn)
        return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB)
            symtab = (const ElfW(Sym) *)dyn_ptr(info, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_STRTAB)
            strtab = (const char *)dyn_ptr(info, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_GNU_HASH)
            gnu = (const uint32_t *)dyn_ptr(info, dyn->d_un.d_ptr);
    }
    if (!symtab || !strtab || !gnu)
        return 0;
    uint32_t h = 5381;
    for (const unsigned char *c = (const unsigned char *)q->name; *c; c++)
        h = h * 33 + *c;
    uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom_size = gnu[2];
    const ElfW(Addr) *bloom = (const ElfW(Addr) *)&gnu[4];
    const uint32_t *buckets = (const uint32_t *)&bloom[bloom_size];
    const uint32_t *chain = &buckets[nbuckets];
    uint32_t i = buckets[h % nbuckets];
    if (i < symoffset)
        return 0;
    for (;; i++) {
        uint32_t h2 = chain[i - symoffset];
        if ((h | 1) == (h2 | 1) && strcmp(strtab + symtab[i].st_name, q->name) == 0 && symtab[i].st_value) {
            q->addr = (void *)(info->dlpi_addr + symtab[i].st_value);
            return 1;
        }
        if (h2 & 1)
            return 0;
    }
}

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
    CUresult (*ctx_sync)(void) = bench_get("launch_cost", "cuCtxSynchronize");
    CUresult (*stream_sync)(CUstream) = bench_get("launch_cost", "cuStreamSynchronize");
    int by_stream = argc > 3 && strcmp(argv[3], "stream") == 0;
#define sync() (by_stream ? stream_sync(NULL) : ctx_sync())
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
    /* Paired: alternate batches through the pointer above and the driver's own, same process, same state. */
    struct sym_query q = {"cuLaunchKernel", NULL};
    dl_iterate_phdr(find_in_libcuda, &q);
    launch_t own = (launch_t)q.addr;
    int pairs = batches / 2;
    double *diff = malloc(sizeof(double) * (size_t)(pairs > 0 ? pairs : 1));
    double *via = malloc(sizeof(double) * (size_t)(pairs > 0 ? pairs : 1));
    double *direct = malloc(sizeof(double) * (size_t)(pairs > 0 ? pairs : 1));
    for (int p = 0; own && p < pairs; p++) {
        double t[2];
        for (int k = 0; k < 2; k++) {
            /* which goes first alternates, so a drift within the pair does not favour one */
            launch_t f = ((p + k) & 1) ? own : launch;
            int64_t t0 = bench_now_ns();
            for (int i = 0; i < batch; i++)
                CHECK(f(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
            int64_t t1 = bench_now_ns();
            CHECK(sync());
            t[((p + k) & 1)] = (double)(t1 - t0) / batch;
        }
        via[p] = t[0];
        direct[p] = t[1];
        diff[p] = t[0] - t[1];
    }
    if (own && pairs > 0) {
        qsort(diff, (size_t)pairs, sizeof *diff, bench_cmp_double);
        qsort(via, (size_t)pairs, sizeof *via, bench_cmp_double);
        qsort(direct, (size_t)pairs, sizeof *direct, bench_cmp_double);
    }
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
           "\"coarse_resolution_ns\": %ld, \"paired_found\": %s, \"paired_same_function\": %s, "
           "\"paired_pairs\": %d, \"paired_via_median\": %.1f, \"paired_driver_median\": %.1f, "
           "\"paired_added_median\": %.1f, \"paired_added_p25\": %.1f, \"paired_added_p75\": %.1f}\n",
           per[batches / 2], per[batches / 10], per[batches * 9 / 10], batches, batch, (c1 - c0) / 1e6,
           (c2 - c1) / 1e6, res.tv_nsec, own ? "true" : "false", own == launch ? "true" : "false",
           own ? pairs : 0, own && pairs ? via[pairs / 2] : 0.0, own && pairs ? direct[pairs / 2] : 0.0,
           own && pairs ? diff[pairs / 2] : 0.0, own && pairs ? diff[pairs / 4] : 0.0,
           own && pairs ? diff[pairs * 3 / 4] : 0.0);
    return 0;
}
