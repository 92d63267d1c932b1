/*
 * workload.c -- a CUDA driver-API client that runs `gem_spin` kernels.
 *
 * Built two ways (tests/simcuda/sim.mk):
 *   -DWORKLOAD_PROCADDR  like cudart: dlopen("libcuda.so.1"), dlsym only
 *                        cuGetProcAddress_v2, every other entry point through
 *                        it (cudaVersion 12000; --ptsz asks for the
 *                        per-thread-default-stream variants)
 *   -DWORKLOAD_LINKED    linked with -lcuda, calling the exact ABI names
 *                        (cuMemAlloc_v2 ...); --ptsz calls the _ptsz/_ptds ones
 * It runs against the simulated driver in CI and is the benchmark workload
 * on a real GPU: gem_spin spins on %globaltimer, counting only increments
 * below 20 us (larger jumps mean the context was switched out), until the
 * on-chip time reaches duration_ns; thread 0 of block 0 writes (on-chip ns,
 * start, end). Results go to a ring of 24-byte slots in device memory that is
 * read back at every sync.
 *
 * Every CUresult is checked: a failure prints the call, code and name and
 * exits 1 (with --keep-going: counted, and the run goes on). A failed
 * --alloc is reported, not fatal. Plain C, no CUDA headers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"

#if !defined(WORKLOAD_PROCADDR) && !defined(WORKLOAD_LINKED)
#error "build with -DWORKLOAD_PROCADDR or -DWORKLOAD_LINKED"
#endif

/* cuda.h layouts that cuda_types.h leaves opaque. */
struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
};
typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} wl_access_desc;

/* The kernel, JIT-compiled by a real driver (the simulator ignores the bytes). */
static const char gem_spin_ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gem_spin(\n"
    "    .param .u64 gem_spin_param_0,\n"
    "    .param .u64 gem_spin_param_1\n"
    ")\n"
    "{\n"
    "    .reg .pred %p<5>;\n"
    "    .reg .b32 %r<4>;\n"
    "    .reg .b64 %rd<10>;\n"
    "\n"
    "    ld.param.u64 %rd1, [gem_spin_param_0];\n"
    "    ld.param.u64 %rd2, [gem_spin_param_1];\n"
    "    mov.u64 %rd3, %globaltimer;\n"      /* start */
    "    mov.u64 %rd4, %rd3;\n"              /* previous reading */
    "    mov.u64 %rd5, 0;\n"                 /* on-chip ns */
    "    setp.eq.u64 %p1, %rd2, 0;\n"
    "    @%p1 bra DONE;\n"
    "LOOP:\n"
    "    mov.u64 %rd6, %globaltimer;\n"
    "    sub.u64 %rd7, %rd6, %rd4;\n"
    "    mov.u64 %rd4, %rd6;\n"
    "    setp.lt.u64 %p2, %rd7, 20000;\n"    /* a bigger jump: we were switched out */
    "    @%p2 add.u64 %rd5, %rd5, %rd7;\n"
    "    setp.lt.u64 %p3, %rd5, %rd2;\n"
    "    @%p3 bra LOOP;\n"
    "DONE:\n"
    "    mov.u32 %r1, %tid.x;\n"
    "    mov.u32 %r2, %ctaid.x;\n"
    "    or.b32 %r3, %r1, %r2;\n"
    "    setp.ne.u32 %p4, %r3, 0;\n"
    "    @%p4 bra EXIT;\n"
    "    mov.u64 %rd8, %globaltimer;\n"      /* end */
    "    cvta.to.global.u64 %rd9, %rd1;\n"
    "    st.global.u64 [%rd9], %rd5;\n"
    "    st.global.u64 [%rd9+8], %rd3;\n"
    "    st.global.u64 [%rd9+16], %rd8;\n"
    "EXIT:\n"
    "    ret;\n"
    "}\n";

/* gem_work(out, iterations): every thread runs 4 independent FMA chains for `iterations` steps, so a
 * grid much wider than the GPU is compute-bound and its throughput follows the SMs it gets (MPS
 * partitions); thread 0 of block 0 writes (its run time, start, end) like gem_spin. */
static const char gem_work_ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gem_work(\n"
    "    .param .u64 gem_work_param_0,\n"
    "    .param .u64 gem_work_param_1\n"
    ")\n"
    "{\n"
    "    .reg .pred %p<5>;\n"
    "    .reg .b32 %r<4>;\n"
    "    .reg .b64 %rd<10>;\n"
    "    .reg .f32 %f<8>;\n"
    "\n"
    "    ld.param.u64 %rd1, [gem_work_param_0];\n"
    "    ld.param.u64 %rd2, [gem_work_param_1];\n"
    "    cvta.to.global.u64 %rd9, %rd1;\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    mov.u32 %r1, %tid.x;\n"
    "    cvt.rn.f32.u32 %f1, %r1;\n"
    "    add.f32 %f2, %f1, 0f3F800000;\n"
    "    add.f32 %f3, %f1, 0f40000000;\n"
    "    add.f32 %f4, %f1, 0f40400000;\n"
    "    mov.u64 %rd4, 0;\n"
    "    setp.eq.u64 %p1, %rd2, 0;\n"
    "    @%p1 bra WDONE;\n"
    "WLOOP:\n"
    "    fma.rn.f32 %f1, %f1, 0f3F7FFFFE, 0f3A83126F;\n"
    "    fma.rn.f32 %f2, %f2, 0f3F7FFFFE, 0f3A83126F;\n"
    "    fma.rn.f32 %f3, %f3, 0f3F7FFFFE, 0f3A83126F;\n"
    "    fma.rn.f32 %f4, %f4, 0f3F7FFFFE, 0f3A83126F;\n"
    "    add.u64 %rd4, %rd4, 1;\n"
    "    setp.lt.u64 %p2, %rd4, %rd2;\n"
    "    @%p2 bra WLOOP;\n"
    "WDONE:\n"
    "    add.f32 %f5, %f1, %f2;\n"
    "    add.f32 %f6, %f3, %f4;\n"
    "    add.f32 %f7, %f5, %f6;\n"
    "    setp.eq.f32 %p4, %f7, 0fBF800000;\n"   /* never true; keeps the chains alive */
    "    @%p4 st.global.f32 [%rd9+24], %f7;\n"
    "    mov.u32 %r2, %ctaid.x;\n"
    "    or.b32 %r3, %r1, %r2;\n"
    "    setp.ne.u32 %p3, %r3, 0;\n"
    "    @%p3 bra WEXIT;\n"
    "    mov.u64 %rd8, %globaltimer;\n"
    "    sub.u64 %rd5, %rd8, %rd3;\n"
    "    st.global.u64 [%rd9], %rd5;\n"
    "    st.global.u64 [%rd9+8], %rd3;\n"
    "    st.global.u64 [%rd9+16], %rd8;\n"
    "WEXIT:\n"
    "    ret;\n"
    "}\n";

/*
 * The entry points used: X(field, base name, version (0: --cuda-version),
 * exact name, exact per-thread-stream name, parameter types).
 */
#define LAUNCH_T (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)
#define COOP_T (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **)
#define API(X)                                                                                                      \
    X(Init, "cuInit", 0, cuInit, cuInit, (unsigned int))                                                              \
    X(DriverGetVersion, "cuDriverGetVersion", 0, cuDriverGetVersion, cuDriverGetVersion, (int *))                     \
    X(GetErrorName, "cuGetErrorName", 0, cuGetErrorName, cuGetErrorName, (CUresult, const char **))                   \
    X(DeviceGet, "cuDeviceGet", 0, cuDeviceGet, cuDeviceGet, (CUdevice *, int))                                       \
    X(DeviceGetName, "cuDeviceGetName", 0, cuDeviceGetName, cuDeviceGetName, (char *, int, CUdevice))                 \
    X(DeviceTotalMem, "cuDeviceTotalMem", 0, cuDeviceTotalMem_v2, cuDeviceTotalMem_v2, (size_t *, CUdevice))          \
    X(DeviceGetAttribute, "cuDeviceGetAttribute", 0, cuDeviceGetAttribute, cuDeviceGetAttribute,                      \
      (int *, int, CUdevice))                                                                                         \
    X(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0, cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain,      \
      (CUcontext *, CUdevice))                                                                                        \
    X(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 0, cuDevicePrimaryCtxRelease_v2,                          \
      cuDevicePrimaryCtxRelease_v2, (CUdevice))                                                                       \
    X(CtxCreate, "cuCtxCreate", 3020, cuCtxCreate_v2, cuCtxCreate_v2, (CUcontext *, unsigned int, CUdevice))          \
    X(CtxDestroy, "cuCtxDestroy", 0, cuCtxDestroy_v2, cuCtxDestroy_v2, (CUcontext))                                   \
    X(CtxSetCurrent, "cuCtxSetCurrent", 0, cuCtxSetCurrent, cuCtxSetCurrent, (CUcontext))                             \
    X(CtxSynchronize, "cuCtxSynchronize", 12080, cuCtxSynchronize, cuCtxSynchronize, (void)) /* 13000: _v2(ctx) */   \
    X(ModuleLoadData, "cuModuleLoadData", 0, cuModuleLoadData, cuModuleLoadData, (CUmodule *, const void *))          \
    X(ModuleGetFunction, "cuModuleGetFunction", 0, cuModuleGetFunction, cuModuleGetFunction,                          \
      (CUfunction *, CUmodule, const char *))                                                                         \
    X(ModuleUnload, "cuModuleUnload", 0, cuModuleUnload, cuModuleUnload, (CUmodule))                                  \
    X(MemGetInfo, "cuMemGetInfo", 0, cuMemGetInfo_v2, cuMemGetInfo_v2, (size_t *, size_t *))                          \
    X(MemAlloc, "cuMemAlloc", 0, cuMemAlloc_v2, cuMemAlloc_v2, (CUdeviceptr *, size_t))                               \
    X(MemAllocPitch, "cuMemAllocPitch", 0, cuMemAllocPitch_v2, cuMemAllocPitch_v2,                                    \
      (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))                                                        \
    X(MemAllocManaged, "cuMemAllocManaged", 0, cuMemAllocManaged, cuMemAllocManaged,                                  \
      (CUdeviceptr *, size_t, unsigned int))                                                                          \
    X(MemFree, "cuMemFree", 0, cuMemFree_v2, cuMemFree_v2, (CUdeviceptr))                                             \
    X(MemAllocAsync, "cuMemAllocAsync", 0, cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr *, size_t, CUstream))  \
    X(MemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz,     \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                                                \
    X(MemFreeAsync, "cuMemFreeAsync", 0, cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr, CUstream))                \
    X(MemPoolCreate, "cuMemPoolCreate", 0, cuMemPoolCreate, cuMemPoolCreate, (CUmemoryPool *, const CUmemPoolProps *)) \
    X(MemPoolDestroy, "cuMemPoolDestroy", 0, cuMemPoolDestroy, cuMemPoolDestroy, (CUmemoryPool))                      \
    X(MemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0, cuMemGetAllocationGranularity,                 \
      cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))       \
    X(MemCreate, "cuMemCreate", 0, cuMemCreate, cuMemCreate,                                                          \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))                      \
    X(MemRelease, "cuMemRelease", 0, cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle))                      \
    X(MemAddressReserve, "cuMemAddressReserve", 0, cuMemAddressReserve, cuMemAddressReserve,                          \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                                               \
    X(MemAddressFree, "cuMemAddressFree", 0, cuMemAddressFree, cuMemAddressFree, (CUdeviceptr, size_t))               \
    X(MemMap, "cuMemMap", 0, cuMemMap, cuMemMap,                                                                      \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))                                \
    X(MemUnmap, "cuMemUnmap", 0, cuMemUnmap, cuMemUnmap, (CUdeviceptr, size_t))                                       \
    X(MemSetAccess, "cuMemSetAccess", 0, cuMemSetAccess, cuMemSetAccess,                                              \
      (CUdeviceptr, size_t, const wl_access_desc *, size_t))                                                          \
    X(ArrayCreate, "cuArrayCreate", 0, cuArrayCreate_v2, cuArrayCreate_v2, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *)) \
    X(ArrayDestroy, "cuArrayDestroy", 0, cuArrayDestroy, cuArrayDestroy, (CUarray))                                   \
    X(MemcpyDtoH, "cuMemcpyDtoH", 0, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, (void *, CUdeviceptr, size_t))            \
    X(MemsetD8, "cuMemsetD8", 0, cuMemsetD8_v2, cuMemsetD8_v2_ptds, (CUdeviceptr, unsigned char, size_t))             \
    X(LaunchKernel, "cuLaunchKernel", 0, cuLaunchKernel, cuLaunchKernel_ptsz, LAUNCH_T)                               \
    X(LaunchKernelEx, "cuLaunchKernelEx", 0, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,                                 \
      (const CUlaunchConfig *, CUfunction, void **, void **))                                                         \
    X(LaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0, cuLaunchCooperativeKernel,                             \
      cuLaunchCooperativeKernel_ptsz, COOP_T)                                                                         \
    X(StreamCreate, "cuStreamCreate", 0, cuStreamCreate, cuStreamCreate, (CUstream *, unsigned int))                  \
    X(StreamDestroy, "cuStreamDestroy", 0, cuStreamDestroy_v2, cuStreamDestroy_v2, (CUstream))                        \
    X(StreamSynchronize, "cuStreamSynchronize", 0, cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream))         \
    X(EventCreate, "cuEventCreate", 0, cuEventCreate, cuEventCreate, (CUevent *, unsigned int))                       \
    X(EventRecord, "cuEventRecord", 0, cuEventRecord, cuEventRecord_ptsz, (CUevent, CUstream))                        \
    X(EventSynchronize, "cuEventSynchronize", 0, cuEventSynchronize, cuEventSynchronize, (CUevent))                   \
    X(EventDestroy, "cuEventDestroy", 0, cuEventDestroy_v2, cuEventDestroy_v2, (CUevent))                             \
    X(StreamBeginCapture, "cuStreamBeginCapture", 0, cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz,           \
      (CUstream, CUstreamCaptureMode))                                                                                \
    X(StreamEndCapture, "cuStreamEndCapture", 0, cuStreamEndCapture, cuStreamEndCapture_ptsz, (CUstream, CUgraph *))  \
    X(GraphInstantiate, "cuGraphInstantiateWithFlags", 0, cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags,   \
      (CUgraphExec *, CUgraph, unsigned long long))                                                                   \
    X(GraphLaunch, "cuGraphLaunch", 0, cuGraphLaunch, cuGraphLaunch_ptsz, (CUgraphExec, CUstream))                    \
    X(GraphExecDestroy, "cuGraphExecDestroy", 0, cuGraphExecDestroy, cuGraphExecDestroy, (CUgraphExec))               \
    X(GraphDestroy, "cuGraphDestroy", 0, cuGraphDestroy, cuGraphDestroy, (CUgraph))

#ifdef WORKLOAD_LINKED
#define DECLARE(field, base, ver, sym, ptsym, params) extern CUresult sym params; extern CUresult ptsym params;
API(DECLARE)
#endif

#define FIELD(field, base, ver, sym, ptsym, params) CUresult (*field) params;
static struct {
    API(FIELD)
} api;

/* ------------------------------------------------------------------ options and results */

enum { ST_LEGACY, ST_PER_THREAD, ST_CREATED };
enum { LA_KERNEL, LA_EX, LA_COOP, LA_GRAPH };
enum { SY_CTX, SY_STREAM, SY_EVENT };
enum { AL_DEVICE, AL_PITCH, AL_MANAGED, AL_ASYNC, AL_POOL, AL_VMM, AL_ARRAY };

static const char *const stream_names[] = {"legacy", "per-thread", "created", NULL};
static const char *const launch_names[] = {"kernel", "ex", "cooperative", "graph", NULL};
static const char *const sync_names[] = {"ctx", "stream", "event", NULL};
static const char *const alloc_names[] = {"device", "pitch", "managed", "async", "pool", "vmm", "array", NULL};

static struct {
    uint64_t kernel_us;
    long kernels;      /* -1: use seconds */
    double seconds;
    long sync_every;
    int stream, launch, sync, alloc_kind;
    uint64_t alloc_bytes;
    int meminfo, json, ptsz, keep_going, create_ctx;
    long graph_size;
    unsigned blocks, threads;
    int device;
    int cuda_version;
    const char *trace;
    const char *kernel_log;
    unsigned long long work_iters; /* 0: gem_spin */
    uint64_t period_us;            /* requests: every period, sync_every kernels then a sync (0: run flat out) */
    uint64_t pause_us;             /* host work: sleep this long after every pause_every launches (0: none) */
    long pause_every;
    uint64_t think_us;             /* host work after each synchronisation (the GPU idles meanwhile) */
    uint64_t long_us;              /* a trainer's mix: after every short_n kernels, long_n of long_us on twice the grid */
    long short_n, long_n;
    long first_n;                  /* the first first_n launches run first_us, same function and grid (a kernel whose */
    uint64_t first_us;             /* length changes under the hook's cost-table key, as with a program's shapes) */
} opt = {1000, -1, 0, 0, ST_LEGACY, LA_KERNEL, SY_CTX, AL_DEVICE, 0, 0, 0, 0, 0, 0, 0, 1, 32, 0, 12000, NULL, NULL, 0, 0,
         0, 1, 0, 0, 0, 0, 0, 0};

/* --period-us: each request's latency, from when it was due to when its sync returned */
static uint64_t *latencies;
static long nlat, caplat;

static struct {
    long launches, kernels_done, syncs, errors;
    uint64_t onchip_ns, start_ns, end_ns, host_start, host_end;
    CUresult first_error;
    char first_error_call[64];
    int alloc_done;
    CUresult alloc_result;
    size_t alloc_pitch;
    int have_meminfo;
    size_t mem_free, mem_total, dev_total;
} res;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *err_name(CUresult rc)
{
    const char *s = NULL;
    if (!api.GetErrorName || api.GetErrorName(rc, &s) != CUDA_SUCCESS || !s) return "CUDA_ERROR_?";
    return s;
}

static void print_json(void);

static void fail_exit(void)
{
    if (opt.json) print_json();
    exit(1);
}

/* Returns 0 on success; on failure prints, records, and exits unless --keep-going. */
static int check(CUresult rc, const char *call)
{
    if (rc == CUDA_SUCCESS) return 0;
    fprintf(stderr, "workload: %s failed: %d %s\n", call, rc, err_name(rc));
    if (!res.errors++) {
        res.first_error = rc;
        snprintf(res.first_error_call, sizeof res.first_error_call, "%s", call);
    }
    if (!opt.keep_going) fail_exit();
    return -1;
}

static CUresult missing(const char *call)
{
    fprintf(stderr, "workload: %s is not available from this driver\n", call);
    return CUDA_ERROR_NOT_FOUND;
}

#define CALL(fn, ...) check(api.fn ? api.fn(__VA_ARGS__) : missing("cu" #fn), "cu" #fn)
/* The CUresult itself, for calls whose failure the caller reports. */
#define TRY(fn, ...) (api.fn ? api.fn(__VA_ARGS__) : missing("cu" #fn))

/* ------------------------------------------------------------------ entry points */

static void load_api(void)
{
#ifdef WORKLOAD_PROCADDR
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "workload: cannot load libcuda.so.1: %s\n", dlerror());
        exit(1);
    }
    typedef CUresult (*gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
    if (!gpa) {
        fprintf(stderr, "workload: libcuda.so.1 has no cuGetProcAddress_v2\n");
        exit(1);
    }
    cuuint64_t flags = opt.ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
#define RESOLVE(field, base, ver, sym, ptsym, params)                                                              \
    {                                                                                                              \
        void *p = NULL;                                                                                            \
        CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;                                  \
        int v = (ver) && (ver) < opt.cuda_version ? (ver) : opt.cuda_version;                                      \
        CUresult rc = gpa(base, &p, v, flags, &st);                                                                \
        if (rc != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS) p = NULL;                                     \
        if (!p && rc != CUDA_SUCCESS)                                                                              \
            fprintf(stderr, "workload: cuGetProcAddress_v2(%s, %d) failed: %d\n", base, v, rc);                   \
        api.field = (CUresult(*) params)p;                                                                         \
    }
    API(RESOLVE)
#else
#define ASSIGN(field, base, ver, sym, ptsym, params) api.field = opt.ptsz ? ptsym : sym;
    API(ASSIGN)
#endif
}

/* ------------------------------------------------------------------ option parsing */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: workload [options]\n"
            "  --kernel-us D        gem_spin duration in microseconds (default 1000)\n"
            "  --kernels N          launch N kernels (default 100 unless --seconds)\n"
            "  --seconds S          launch for S seconds instead\n"
            "  --sync-every K       synchronise after every K kernels (0: only at the end)\n"
            "  --sync {ctx,stream,event}  how to synchronise (default ctx: cuCtxSynchronize)\n"
            "  --stream {legacy,per-thread,created}  legacy = the NULL handle (per-thread under --ptsz)\n"
            "  --launch {kernel,ex,cooperative,graph}\n"
            "  --graph-size K       kernels per graph (default: --sync-every, or 16)\n"
            "  --blocks N, --threads T  grid and block width (default 1 x 32)\n"
            "  --alloc BYTES        allocate once at start (K/M/G suffixes), free at the end\n"
            "  --alloc-kind {device,pitch,managed,async,pool,vmm,array}\n"
            "  --meminfo            print cuMemGetInfo_v2 / cuDeviceTotalMem_v2 (after --alloc)\n"
            "  --trace FILE         one line per sync: host CLOCK_MONOTONIC ns, cumulative on-chip ns, kernels done\n"
            "  --work-iters N       run gem_work (compute-bound FMA chains, N steps per thread) instead of gem_spin\n"
            "  --kernel-log FILE    one line per kernel: start, end (device clock ns: %%globaltimer on a GPU), on-chip ns\n"
            "  --json               final line is a JSON summary\n"
            "  --period-us P        requests: every P us (open loop), --sync-every kernels then a sync; the JSON\n"
            "                       gets the latency percentiles (due -> sync returned)\n"
            "  --pause-us P         host work of a training loop: sleep P us after every --pause-every launches\n"
            "  --pause-every N      (default 1)\n"
            "  --think-us T         host work after every synchronisation: sleep T us (the GPU has nothing)\n"
            "  --long-us L --mix S:N  a trainer's mix of kernel lengths: after every S kernels of --kernel-us,\n"
            "                       N of L us on twice the grid (another kernel to the hook's cost table)\n"
            "  --first N:F          the first N launches run F us (same function and grid as --kernel-us)\n"
            "  --ptsz               per-thread default stream entry points\n"
            "  --ctx {primary,create}  context to use (default primary, as cudart does)\n"
            "  --device N, --cuda-version V (cuGetProcAddress version, default 12000)\n"
            "  --keep-going         count failed calls instead of exiting\n");
}

static int pick(const char *arg, const char *const *names, const char *what)
{
    for (int i = 0; names[i]; i++)
        if (strcmp(arg, names[i]) == 0) return i;
    fprintf(stderr, "workload: bad %s '%s'\n", what, arg);
    usage(stderr);
    exit(2);
}

static long parse_long(const char *s, const char *what)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 0);
    if (errno || end == s || *end || v < 0) {
        fprintf(stderr, "workload: bad %s '%s'\n", what, s);
        exit(2);
    }
    return v;
}

static uint64_t parse_bytes(const char *s)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    uint64_t mul = 1;
    if (*end == 'k' || *end == 'K') mul = 1ull << 10, end++;
    else if (*end == 'm' || *end == 'M') mul = 1ull << 20, end++;
    else if (*end == 'g' || *end == 'G') mul = 1ull << 30, end++;
    if (*end == 'i' || *end == 'B') end++;
    if (*end == 'B') end++;
    if (errno || end == s || *end || v < 0) {
        fprintf(stderr, "workload: bad byte count '%s'\n", s);
        exit(2);
    }
    return (uint64_t)(v * (double)mul);
}

static void parse(int argc, char **argv)
{
    enum {
        O_KUS = 256, O_KERNELS, O_SECONDS, O_SYNCEVERY, O_SYNC, O_STREAM, O_LAUNCH, O_GSIZE, O_BLOCKS, O_THREADS,
        O_ALLOC, O_AKIND, O_MEMINFO, O_TRACE, O_KERNEL_LOG, O_WORK_ITERS, O_JSON, O_PTSZ, O_CTX, O_DEVICE, O_CUDAVER, O_KEEP, O_HELP,
        O_PERIOD, O_PAUSE, O_PAUSE_EVERY, O_THINK, O_LONG_US, O_MIX, O_FIRST
    };
    static const struct option longopts[] = {
        {"kernel-us", required_argument, 0, O_KUS},   {"kernels", required_argument, 0, O_KERNELS},
        {"seconds", required_argument, 0, O_SECONDS}, {"sync-every", required_argument, 0, O_SYNCEVERY},
        {"sync", required_argument, 0, O_SYNC},       {"stream", required_argument, 0, O_STREAM},
        {"launch", required_argument, 0, O_LAUNCH},   {"graph-size", required_argument, 0, O_GSIZE},
        {"blocks", required_argument, 0, O_BLOCKS},   {"threads", required_argument, 0, O_THREADS},
        {"alloc", required_argument, 0, O_ALLOC},     {"alloc-kind", required_argument, 0, O_AKIND},
        {"meminfo", no_argument, 0, O_MEMINFO},       {"trace", required_argument, 0, O_TRACE},
        {"kernel-log", required_argument, 0, O_KERNEL_LOG},
        {"work-iters", required_argument, 0, O_WORK_ITERS},
        {"json", no_argument, 0, O_JSON},             {"ptsz", no_argument, 0, O_PTSZ},
        {"ctx", required_argument, 0, O_CTX},         {"device", required_argument, 0, O_DEVICE},
        {"cuda-version", required_argument, 0, O_CUDAVER}, {"keep-going", no_argument, 0, O_KEEP},
        {"period-us", required_argument, 0, O_PERIOD},
        {"pause-us", required_argument, 0, O_PAUSE},  {"pause-every", required_argument, 0, O_PAUSE_EVERY},
        {"think-us", required_argument, 0, O_THINK}, {"long-us", required_argument, 0, O_LONG_US},
        {"first", required_argument, 0, O_FIRST},
        {"mix", required_argument, 0, O_MIX},
        {"help", no_argument, 0, O_HELP},             {0, 0, 0, 0},
    };
    static const char *const ctx_names[] = {"primary", "create", NULL};
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case O_KUS: opt.kernel_us = (uint64_t)parse_long(optarg, "--kernel-us"); break;
        case O_KERNELS: opt.kernels = parse_long(optarg, "--kernels"); break;
        case O_SECONDS: {
            char *end;
            opt.seconds = strtod(optarg, &end);
            if (end == optarg || *end || opt.seconds <= 0) {
                fprintf(stderr, "workload: bad --seconds '%s'\n", optarg);
                exit(2);
            }
            break;
        }
        case O_SYNCEVERY: opt.sync_every = parse_long(optarg, "--sync-every"); break;
        case O_PERIOD: opt.period_us = (uint64_t)parse_long(optarg, "--period-us"); break;
        case O_PAUSE: opt.pause_us = (uint64_t)parse_long(optarg, "--pause-us"); break;
        case O_PAUSE_EVERY: opt.pause_every = parse_long(optarg, "--pause-every"); break;
        case O_THINK: opt.think_us = (uint64_t)parse_long(optarg, "--think-us"); break;
        case O_LONG_US: opt.long_us = (uint64_t)parse_long(optarg, "--long-us"); break;
        case O_MIX:
            if (sscanf(optarg, "%ld:%ld", &opt.short_n, &opt.long_n) != 2 || opt.short_n < 0 || opt.long_n < 0) {
                fprintf(stderr, "workload: bad --mix '%s' (S:N)\n", optarg);
                exit(2);
            }
            break;
        case O_FIRST: {
            char tail;
            long f = -1;
            if (sscanf(optarg, "%ld:%ld%c", &opt.first_n, &f, &tail) != 2 || opt.first_n < 0 || f < 0) {
                fprintf(stderr, "workload: bad --first '%s' (N:F)\n", optarg);
                exit(2);
            }
            opt.first_us = (uint64_t)f;
            break;
        }
        case O_SYNC: opt.sync = pick(optarg, sync_names, "--sync"); break;
        case O_STREAM: opt.stream = pick(optarg, stream_names, "--stream"); break;
        case O_LAUNCH: opt.launch = pick(optarg, launch_names, "--launch"); break;
        case O_GSIZE: opt.graph_size = parse_long(optarg, "--graph-size"); break;
        case O_BLOCKS: opt.blocks = (unsigned)parse_long(optarg, "--blocks"); break;
        case O_THREADS: opt.threads = (unsigned)parse_long(optarg, "--threads"); break;
        case O_ALLOC: opt.alloc_bytes = parse_bytes(optarg); break;
        case O_AKIND: opt.alloc_kind = pick(optarg, alloc_names, "--alloc-kind"); break;
        case O_MEMINFO: opt.meminfo = 1; break;
        case O_TRACE: opt.trace = optarg; break;
        case O_KERNEL_LOG: opt.kernel_log = optarg; break;
        case O_WORK_ITERS: opt.work_iters = strtoull(optarg, NULL, 10); break;
        case O_JSON: opt.json = 1; break;
        case O_PTSZ: opt.ptsz = 1; break;
        case O_CTX: opt.create_ctx = pick(optarg, ctx_names, "--ctx"); break;
        case O_DEVICE: opt.device = (int)parse_long(optarg, "--device"); break;
        case O_CUDAVER: opt.cuda_version = (int)parse_long(optarg, "--cuda-version"); break;
        case O_KEEP: opt.keep_going = 1; break;
        case O_HELP: usage(stdout); exit(0);
        default: usage(stderr); exit(2);
        }
    }
    if (optind < argc) {
        fprintf(stderr, "workload: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        exit(2);
    }
    if (opt.kernels < 0 && opt.seconds <= 0) opt.kernels = 100;
    if (opt.kernels >= 0 && opt.seconds > 0) {
        fprintf(stderr, "workload: --kernels and --seconds are exclusive\n");
        exit(2);
    }
    if (!opt.blocks || !opt.threads || opt.threads > 1024) {
        fprintf(stderr, "workload: bad --blocks/--threads\n");
        exit(2);
    }
    if (opt.long_n > 0 && (opt.work_iters || !opt.long_us)) {
        fprintf(stderr, "workload: --mix needs --long-us, and takes gem_spin kernels (not --work-iters)\n");
        exit(2);
    }
    if (opt.first_n > 0 && (opt.work_iters || opt.launch == LA_GRAPH)) {
        fprintf(stderr, "workload: --first takes gem_spin kernels launched one by one (not --work-iters, "
                        "not --launch graph: a graph is captured once)\n");
        exit(2);
    }
    if (!opt.graph_size) opt.graph_size = opt.sync_every ? opt.sync_every : 16;
}

/* ------------------------------------------------------------------ allocation (--alloc) */

static struct {
    CUdeviceptr ptr;
    CUmemoryPool pool;
    CUmemGenericAllocationHandle handle;
    size_t vmm_size;
    CUarray array;
} al;

static void do_alloc(CUdevice dev, CUstream stream)
{
    uint64_t n = opt.alloc_bytes;
    CUresult rc = CUDA_SUCCESS;
    switch (opt.alloc_kind) {
    case AL_DEVICE: rc = TRY(MemAlloc, &al.ptr, n); break;
    case AL_PITCH: {
        size_t height = n >= 64 * 512 ? 64 : 1;
        rc = TRY(MemAllocPitch, &al.ptr, &res.alloc_pitch, (n + height - 1) / height, height, 4);
        break;
    }
    case AL_MANAGED: rc = TRY(MemAllocManaged, &al.ptr, n, CU_MEM_ATTACH_GLOBAL); break;
    case AL_ASYNC: rc = TRY(MemAllocAsync, &al.ptr, n, stream); break;
    case AL_POOL: {
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev;
        rc = TRY(MemPoolCreate, &al.pool, &props);
        if (rc == CUDA_SUCCESS) rc = TRY(MemAllocFromPoolAsync, &al.ptr, n, al.pool, stream);
        break;
    }
    case AL_VMM: {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        size_t gran = 0;
        rc = TRY(MemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (rc) break;
        al.vmm_size = (n + gran - 1) / gran * gran;
        rc = TRY(MemCreate, &al.handle, al.vmm_size, &prop, 0);
        if (rc) break;
        rc = TRY(MemAddressReserve, &al.ptr, al.vmm_size, 0, 0, 0);
        if (rc == CUDA_SUCCESS) rc = TRY(MemMap, al.ptr, al.vmm_size, 0, al.handle, 0);
        if (rc == CUDA_SUCCESS) {
            wl_access_desc d = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, 3};
            rc = TRY(MemSetAccess, al.ptr, al.vmm_size, &d, 1);
        }
        break;
    }
    case AL_ARRAY: {
        /* float4 rows of 8192 elements: 128 KiB a row. */
        CUDA_ARRAY_DESCRIPTOR d = {8192, (n + (128u << 10) - 1) / (128u << 10), CU_AD_FORMAT_FLOAT, 4};
        if (!d.Height) d.Height = 1;
        rc = TRY(ArrayCreate, &al.array, &d);
        break;
    }
    }
    res.alloc_done = 1;
    res.alloc_result = rc;
    if (rc != CUDA_SUCCESS)
        fprintf(stderr, "workload: --alloc %" PRIu64 " (%s) failed: %d %s\n", n, alloc_names[opt.alloc_kind], rc,
                err_name(rc));
    else if (!opt.json)
        printf("alloc %s %" PRIu64 " bytes: ok\n", alloc_names[opt.alloc_kind], n);
}

static void do_free(CUstream stream)
{
    if (!res.alloc_done || res.alloc_result != CUDA_SUCCESS) {
        /* Undo what a partial VMM / pool setup made. */
        if (al.handle) CALL(MemRelease, al.handle);
        if (al.pool) CALL(MemPoolDestroy, al.pool);
        return;
    }
    switch (opt.alloc_kind) {
    case AL_DEVICE:
    case AL_PITCH:
    case AL_MANAGED: CALL(MemFree, al.ptr); break;
    case AL_ASYNC:
    case AL_POOL:
        CALL(MemFreeAsync, al.ptr, stream);
        CALL(StreamSynchronize, stream);
        if (al.pool) CALL(MemPoolDestroy, al.pool);
        break;
    case AL_VMM:
        CALL(MemUnmap, al.ptr, al.vmm_size);
        CALL(MemAddressFree, al.ptr, al.vmm_size);
        CALL(MemRelease, al.handle);
        break;
    case AL_ARRAY: CALL(ArrayDestroy, al.array); break;
    }
}

/* ------------------------------------------------------------------ the run */

#define SLOT_BYTES (3 * sizeof(uint64_t))

static struct {
    CUfunction fn;
    CUstream stream;
    CUevent event;
    CUdeviceptr out;
    uint64_t *host;
    long slots, pending; /* slots in the ring; slots launched since the last read-back */
    CUgraphExec *graphs;
    long ngraphs;
    FILE *trace;
    FILE *kernel_log;
} run;

static void launch_one(long slot)
{
    CUdeviceptr out = run.out + (CUdeviceptr)slot * SLOT_BYTES;
    uint64_t dur = opt.work_iters ? (uint64_t)opt.work_iters : opt.kernel_us * 1000ull; /* gem_work: iterations */
    unsigned blocks = opt.blocks;
    if (opt.long_n > 0 && res.launches % (opt.short_n + opt.long_n) >= opt.short_n) {
        dur = opt.long_us * 1000ull;
        blocks *= 2;
    } else if (res.launches < opt.first_n) {
        dur = opt.first_us * 1000ull;
    }
    void *params[] = {&out, &dur};
    switch (opt.launch) {
    case LA_KERNEL:
    case LA_GRAPH:
        CALL(LaunchKernel, run.fn, blocks, 1, 1, opt.threads, 1, 1, 0, run.stream, params, NULL);
        break;
    case LA_EX: {
        CUlaunchConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.gridDimX = blocks;
        cfg.gridDimY = cfg.gridDimZ = 1;
        cfg.blockDimX = opt.threads;
        cfg.blockDimY = cfg.blockDimZ = 1;
        cfg.hStream = run.stream;
        CALL(LaunchKernelEx, &cfg, run.fn, params, NULL);
        break;
    }
    case LA_COOP:
        CALL(LaunchCooperativeKernel, run.fn, blocks, 1, 1, opt.threads, 1, 1, 0, run.stream, params);
        break;
    }
}

/* One graph per group of graph_size slots, captured once on a private stream. */
static void build_graphs(void)
{
    CUstream cap;
    CALL(StreamCreate, &cap, CU_STREAM_NON_BLOCKING);
    run.ngraphs = run.slots / opt.graph_size;
    run.graphs = calloc((size_t)run.ngraphs, sizeof *run.graphs);
    CUstream saved = run.stream;
    run.stream = cap;
    for (long g = 0; g < run.ngraphs; g++) {
        CUgraph graph = NULL;
        CALL(StreamBeginCapture, cap, CU_STREAM_CAPTURE_MODE_GLOBAL);
        for (long k = 0; k < opt.graph_size; k++) launch_one(g * opt.graph_size + k);
        CALL(StreamEndCapture, cap, &graph);
        CALL(GraphInstantiate, &run.graphs[g], graph, 0);
        CALL(GraphDestroy, graph);
    }
    run.stream = saved;
    CALL(StreamDestroy, cap);
}

static void sync_now(void)
{
    switch (opt.sync) {
    case SY_CTX: CALL(CtxSynchronize); break;
    case SY_STREAM: CALL(StreamSynchronize, run.stream); break;
    case SY_EVENT:
        CALL(EventRecord, run.event, run.stream);
        CALL(EventSynchronize, run.event);
        break;
    }
}

/* Synchronise, read the pending slots back and account them. */
static void sync_and_read(void)
{
    sync_now();
    res.syncs++;
    if (run.pending) {
        CALL(MemcpyDtoH, run.host, run.out, (size_t)run.pending * SLOT_BYTES);
        for (long i = 0; i < run.pending; i++) {
            uint64_t *s = &run.host[3 * i];
            if (!s[2]) continue;
            res.kernels_done++;
            res.onchip_ns += s[0];
            if (run.kernel_log)
                fprintf(run.kernel_log, "%" PRIu64 " %" PRIu64 " %" PRIu64 "\n", s[1], s[2], s[0]);
            if (!res.start_ns || s[1] < res.start_ns) res.start_ns = s[1];
            if (s[2] > res.end_ns) res.end_ns = s[2];
        }
        run.pending = 0;
    }
    if (run.trace)
        fprintf(run.trace, "%" PRIu64 " %" PRIu64 " %ld\n", now_ns(), res.onchip_ns, res.kernels_done);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void print_json(void)
{
    printf("{\"pid\": %d, \"client\": \"%s\", \"launch\": \"%s\", \"stream\": \"%s\", \"ptsz\": %s, "
           "\"launches\": %ld, \"kernels_done\": %ld, \"onchip_ns\": %" PRIu64 ", \"wall_ns\": %" PRIu64 ", "
           "\"start_ns\": %" PRIu64 ", \"end_ns\": %" PRIu64 ", \"host_start_ns\": %" PRIu64
           ", \"host_end_ns\": %" PRIu64 ", \"syncs\": %ld, \"errors\": %ld, ",
           (int)getpid(),
#ifdef WORKLOAD_PROCADDR
           "procaddr",
#else
           "linked",
#endif
           launch_names[opt.launch], stream_names[opt.stream], opt.ptsz ? "true" : "false", res.launches,
           res.kernels_done, res.onchip_ns, res.host_end > res.host_start ? res.host_end - res.host_start : 0,
           res.start_ns, res.end_ns, res.host_start, res.host_end, res.syncs, res.errors);
    if (res.errors)
        printf("\"first_error\": {\"call\": \"%s\", \"code\": %d, \"name\": \"%s\"}, ", res.first_error_call,
               res.first_error, err_name(res.first_error));
    else
        printf("\"first_error\": null, ");
    if (res.alloc_done)
        printf("\"alloc\": {\"kind\": \"%s\", \"bytes\": %" PRIu64 ", \"result\": %d, \"name\": \"%s\", "
               "\"pitch\": %zu}, ",
               alloc_names[opt.alloc_kind], opt.alloc_bytes, res.alloc_result, err_name(res.alloc_result),
               res.alloc_pitch);
    else
        printf("\"alloc\": null, ");
    if (res.have_meminfo)
        printf("\"mem_free\": %zu, \"mem_total\": %zu, \"device_total\": %zu", res.mem_free, res.mem_total,
               res.dev_total);
    else
        printf("\"mem_free\": null, \"mem_total\": null, \"device_total\": null");
    if (nlat) {
        qsort(latencies, (size_t)nlat, sizeof *latencies, cmp_u64);
#define PCT(q) (latencies[(long)((q) * (double)(nlat - 1))] / 1e3)
        printf(", \"requests\": %ld, \"latency_us\": {\"p50\": %.1f, \"p99\": %.1f, \"p999\": %.1f, \"max\": %.1f}",
               nlat, PCT(0.5), PCT(0.99), PCT(0.999), latencies[nlat - 1] / 1e3);
#undef PCT
    }
    /* The simulated driver's count of this process's untimed events (CU_EVENT_DISABLE_TIMING) created and never
     * destroyed: the hook's markers make them, and --sync event one that it destroys. For tests of what the hook
     * creates and gives back; absent on a real driver (as is the count below). */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    int (*live)(unsigned int) = drv ? (int (*)(unsigned int))dlsym(drv, "simcuda_live_events") : NULL;
    if (live)
        printf(", \"live_untimed_events\": %d", live(0x2));
    /* and its count of cuEventElapsedTime calls (the hook's markers time some of their intervals) */
    unsigned long long (*elapsed_calls)(void) =
        drv ? (unsigned long long (*)(void))dlsym(drv, "simcuda_elapsed_calls") : NULL;
    if (elapsed_calls)
        printf(", \"elapsed_calls\": %llu", elapsed_calls());
    printf("}\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    parse(argc, argv);
    load_api();
    if (opt.kernel_log && !(run.kernel_log = fopen(opt.kernel_log, "w"))) {
        fprintf(stderr, "workload: cannot write %s: %s\n", opt.kernel_log, strerror(errno));
        return 2;
    }
    if (opt.trace) {
        run.trace = fopen(opt.trace, "w");
        if (!run.trace) {
            fprintf(stderr, "workload: cannot write %s: %s\n", opt.trace, strerror(errno));
            return 1;
        }
        setvbuf(run.trace, NULL, _IOLBF, 0);
    }

    CUdevice dev;
    CUcontext ctx;
    CALL(Init, 0);
    CALL(DeviceGet, &dev, opt.device);
    if (opt.create_ctx) {
        CALL(CtxCreate, &ctx, 0, dev);
    } else {
        CALL(DevicePrimaryCtxRetain, &ctx, dev);
        CALL(CtxSetCurrent, ctx);
    }
    CUmodule mod;
    CALL(ModuleLoadData, &mod, opt.work_iters ? gem_work_ptx : gem_spin_ptx);
    CALL(ModuleGetFunction, &run.fn, mod, opt.work_iters ? "gem_work" : "gem_spin");

    switch (opt.stream) {
    case ST_LEGACY: run.stream = NULL; break;
    case ST_PER_THREAD: run.stream = CU_STREAM_PER_THREAD; break;
    case ST_CREATED: CALL(StreamCreate, &run.stream, CU_STREAM_NON_BLOCKING); break;
    }
    if (opt.sync == SY_EVENT) CALL(EventCreate, &run.event, CU_EVENT_DISABLE_TIMING);

    if (opt.alloc_bytes) do_alloc(dev, run.stream);
    if (opt.meminfo) {
        CALL(MemGetInfo, &res.mem_free, &res.mem_total);
        CALL(DeviceTotalMem, &res.dev_total, dev);
        res.have_meminfo = 1;
        if (!opt.json) printf("meminfo free=%zu total=%zu device_total=%zu\n", res.mem_free, res.mem_total, res.dev_total);
    }

    /* The slot ring: one period between syncs, or up to 64 Ki slots. */
    long unit = opt.launch == LA_GRAPH ? opt.graph_size : 1;
    long want = opt.sync_every ? opt.sync_every : opt.kernels >= 0 ? opt.kernels : 65536;
    if (want > 65536) want = 65536;
    if (want < unit) want = unit;
    run.slots = (want + unit - 1) / unit * unit;
    run.host = calloc((size_t)run.slots, SLOT_BYTES);
    CALL(MemAlloc, &run.out, (size_t)run.slots * SLOT_BYTES);
    CALL(MemsetD8, run.out, 0, (size_t)run.slots * SLOT_BYTES);
    if (opt.launch == LA_GRAPH) build_graphs();

    res.host_start = now_ns();
    uint64_t deadline = opt.seconds > 0 ? res.host_start + (uint64_t)(opt.seconds * 1e9) : 0;
    long since_sync = 0;
    uint64_t due = res.host_start;
    for (;;) {
        if (opt.kernels >= 0 ? res.launches >= opt.kernels : now_ns() >= deadline) break;
        if (opt.period_us && since_sync == 0) {
            /* a request: wait until it is due (open loop: a late one is not moved) */
            uint64_t t = now_ns();
            if (t < due) {
                struct timespec ts = {(time_t)((due - t) / 1000000000ull), (long)((due - t) % 1000000000ull)};
                nanosleep(&ts, NULL);
            }
        }
        if (run.pending + unit > run.slots) {
            sync_and_read();
            since_sync = 0;
        }
        if (opt.launch == LA_GRAPH) {
            CALL(GraphLaunch, run.graphs[run.pending / unit], run.stream);
        } else {
            launch_one(run.pending);
        }
        run.pending += unit;
        res.launches += unit;
        since_sync += unit;
        if (opt.pause_us && opt.pause_every > 0 && res.launches % opt.pause_every == 0) {
            struct timespec ts = {(time_t)(opt.pause_us / 1000000ull), (long)(opt.pause_us % 1000000ull) * 1000};
            nanosleep(&ts, NULL);
        }
        if (opt.sync_every && since_sync >= opt.sync_every) {
            sync_and_read();
            since_sync = 0;
            if (opt.think_us) {
                struct timespec ts = {(time_t)(opt.think_us / 1000000ull), (long)(opt.think_us % 1000000ull) * 1000};
                nanosleep(&ts, NULL);
            }
            if (opt.period_us) {
                if (nlat == caplat) {
                    caplat = caplat ? 2 * caplat : 4096;
                    latencies = realloc(latencies, (size_t)caplat * sizeof *latencies);
                }
                latencies[nlat++] = now_ns() - due;
                due += opt.period_us * 1000ull;
            }
        }
    }
    if (run.pending || !res.syncs) sync_and_read();
    res.host_end = now_ns();

    for (long g = 0; g < run.ngraphs; g++) CALL(GraphExecDestroy, run.graphs[g]);
    do_free(run.stream);
    CALL(MemFree, run.out);
    CALL(ModuleUnload, mod);
    if (run.event) CALL(EventDestroy, run.event);
    if (opt.stream == ST_CREATED) CALL(StreamDestroy, run.stream);
    if (opt.create_ctx)
        CALL(CtxDestroy, ctx);
    else
        CALL(DevicePrimaryCtxRelease, dev);
    if (run.trace) fclose(run.trace);
    if (run.kernel_log) fclose(run.kernel_log);

    if (opt.json) {
        print_json();
    } else {
        printf("launches=%ld kernels_done=%ld onchip_ns=%" PRIu64 " wall_ns=%" PRIu64 " syncs=%ld errors=%ld\n",
               res.launches, res.kernels_done, res.onchip_ns, res.host_end - res.host_start, res.syncs, res.errors);
    }
    return res.errors && !opt.keep_going ? 1 : 0;
}
