/*
 * sim_internal.h -- what the simulator's source files share (all hidden).
 *
 *   sim_state.c    configuration, the shared file (device locks, memory
 *                  accounting), handle registry, devices, errors, cuInit
 *   sim_ctx.c      contexts (current stack, primary), streams, events
 *   sim_exec.c     per-context worker queue, kernel execution, modules,
 *                  launches
 *   sim_mem.c      allocations, pools, copies and sets
 *   sim_vmm.c      virtual memory management, arrays
 *   sim_graph.c    stream capture and graphs
 *   sim_procaddr.c cuGetProcAddress
 *
 * Internal code never calls an exported cu* function (a preloaded hook would
 * see it); each file calls the helpers declared here.
 */
#ifndef SIMCUDA_INTERNAL_H
#define SIMCUDA_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "sim_api.h"

#define SIM_MAX_DEVICES 16
#define SIM_QUEUE_LEN 1024 /* work items per context before a launch blocks */
#define SIM_NAME_LEN 64

/* ---------------------------------------------------------------- sim_state.c */

struct sim_config {
    int ndev;              /* from the shared file (its creator's SIMCUDA_DEVICES) */
    uint64_t mem_bytes;    /* capacity per device, from the shared file */
    uint64_t kernel_ns;    /* SIMCUDA_KERNEL_US of this process */
    double migrate_bytes_per_ns; /* SIMCUDA_MIGRATE_GBPS: managed-memory prefetch speed (0: instant) */
    int concurrent_managed; /* SIMCUDA_CONCURRENT_MANAGED: CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS */
    int host_prefetch_fails; /* SIMCUDA_HOST_PREFETCH_FAILS: every prefetch to the host fails (tests of evictions) */
    int no_stream_memops;    /* SIMCUDA_NO_STREAM_MEMOPS: cuStreamWaitValue32 is not supported */
    uint64_t wait_value_ns;  /* SIMCUDA_WAIT_VALUE_US: what a cuStreamWaitValue32 call costs the host (H100: ~2.5 us) */
    uint64_t wait_value_gpu_ns; /* SIMCUDA_WAIT_VALUE_GPU_US: the device time a satisfied wait holds (bench/marker_cost.c) */
    uint64_t elapsed_ns;     /* SIMCUDA_ELAPSED_US: what a cuEventElapsedTime call costs the host (H100: ~3.1 us) */
    uint64_t record_ns;      /* SIMCUDA_RECORD_US: what a cuEventRecord call costs the host (H100: ~1.6 us) */
    uint64_t untimed_event_fail_at; /* SIMCUDA_UNTIMED_EVENT_FAIL_AT: the k-th CU_EVENT_DISABLE_TIMING create fails (0: none) */
    int driver_version;    /* SIMCUDA_DRIVER_VERSION of this process */
    int trace_fd;          /* SIMCUDA_TRACE, or -1 */
};
extern struct sim_config sim_cfg;

#define SIM_CHECK_INIT()                                             \
    do {                                                             \
        if (!sim_initialized()) return CUDA_ERROR_NOT_INITIALIZED;  \
    } while (0)

uint64_t sim_now_ns(void);
pid_t sim_gettid(void);
void sim_sleep_until(uint64_t t_ns);
CUresult sim_check_device(CUdevice dev);

/* Cross-process FIFO execution lock of a device. */
void sim_dev_acquire(int dev);
void sim_dev_release(int dev);
void sim_dev_release_counted(int dev, int kernel); /* kernel 0: an event held it (not counted) */

/* Cross-process memory accounting of a device (this pid's entry). */
CUresult sim_mem_charge(int dev, uint64_t bytes);
/* Managed pages moved to the device: charged like device memory, but never refused (a real driver would
 * evict other managed pages to make room; the simulator only counts). */
void sim_mem_charge_managed(int dev, uint64_t bytes);
void sim_mem_uncharge(int dev, uint64_t bytes);
void sim_mem_info(int dev, uint64_t *free_bytes, uint64_t *total_bytes);

void sim_trace_kernel(int dev, uint64_t t0, uint64_t t1, const char *name);

/* Handle registry: every handle given out is registered with its type, so a
 * stale or foreign handle is refused instead of dereferenced. */
enum sim_htype {
    H_NONE = 0,
    H_CTX,
    H_STREAM,
    H_EVENT,
    H_MODULE,
    H_LIBRARY,
    H_FUNC,
    H_KERNEL,
    H_GRAPH,
    H_GRAPHEXEC,
    H_POOL,
    H_ARRAY,
    H_MIPMAP,
    H_MEMHANDLE,
};
void sim_handle_add(const void *p, int type);
void sim_handle_del(const void *p);
int sim_handle_is(const void *p, int type);

/* ---------------------------------------------------------------- work items */

enum sim_op_kind {
    OP_NOP, OP_KERNEL, OP_MEMCPY, OP_MEMSET, OP_HOSTFN, OP_EVENT, OP_WAIT, OP_FREE, OP_PREFETCH, OP_WAIT_VALUE
};

struct sim_ctx;
struct sim_event;

struct sim_op {
    int kind;
    union {
        struct {
            char name[SIM_NAME_LEN];
            int spin;          /* gem_spin: dur_ns from the params, results to out */
            uint64_t dur_ns;
            uint64_t *out;
        } k;
        struct {
            void *dst;
            const void *src;
            size_t n;
            void *staged;      /* owned copy of src (freed after the copy), or NULL */
        } cp;
        struct {
            void *dst;
            uint32_t val;
            int width;         /* 1 or 4 bytes */
            size_t n;          /* elements */
        } ms;
        struct {
            CUhostFn fn;
            void *data;
        } host;
        struct {
            struct sim_event *ev; /* holds a reference */
        } ev;
        struct {
            struct sim_ctx *ctx;
            uint64_t seq;
        } wait;
        struct {
            CUdeviceptr ptr;
        } fr;
        struct {
            const volatile uint32_t *addr;
            uint32_t value;
        } wv;                  /* cuStreamWaitValue32 (equal only) */
        struct {
            CUdeviceptr ptr;
            size_t n;
            int dev;           /* destination device, or -1: the host */
            int v2;            /* issued through cuMemPrefetchAsync_v2 (the trace says which ABI) */
        } pf;
    } u;
};

/* ---------------------------------------------------------------- sim_ctx.c */

enum sim_stream_kind { SK_CREATED, SK_LEGACY, SK_PER_THREAD };

struct sim_capture;

struct sim_stream {
    struct sim_ctx *ctx;
    int kind;
    unsigned flags;
    int priority;
    uint64_t last_seq;         /* last item enqueued (ctx->qlock) */
    struct sim_capture *cap;   /* capture this stream belongs to (sim_graph's lock) */
};

struct sim_item {
    struct sim_op op;
    uint64_t seq;
};

struct sim_ctx {
    int dev;
    unsigned flags;
    int primary;
    int active;                /* created and not destroyed / primary retained */
    int refcount;              /* primary contexts: retains */
    int api_version;
    /* work queue: items seq done_seq+1 .. enq_seq are pending */
    pthread_mutex_t qlock;
    pthread_cond_t nonempty, nonfull, done;
    struct sim_item *ring;
    uint64_t enq_seq, done_seq;
    int stop;
    int worker_started;
    pthread_t worker;
    struct sim_stream legacy;
    struct sim_ctx *next_all;  /* list of every context ever made (never freed) */
    uint64_t life;             /* counts activations: what was made in an earlier one died with it */
};

struct sim_event {
    unsigned flags;
    atomic_int refs;
    struct sim_ctx *ctx;       /* where last recorded; NULL if never */
    uint64_t seq;              /* that record's item */
    uint64_t time_ns;          /* completion time of the latest executed record */
    uint64_t cap_id;           /* recorded into this capture (0: none) */
    struct sim_ctx *owner;     /* the context it was created in, and that context's life then: as on a real */
    uint64_t owner_life;       /* driver, an event dies with its context (a reset or destroy) */
};

struct sim_ctx *sim_ctx_current(void);
/* The current context if there is an active one, else INVALID_CONTEXT. */
CUresult sim_ctx_get(struct sim_ctx **out);
/* Resolve a stream handle; ptsz: NULL means the per-thread stream. */
CUresult sim_stream_resolve(CUstream h, int ptsz, struct sim_stream **out);
void sim_event_unref(struct sim_event *ev);
/* The worker ran a record of ev at time t. */
void sim_event_fired(struct sim_event *ev, uint64_t t);
/* Drain every context of this process (before freeing memory). Takes the
 * context list lock: never call it from a context's teardown. */
void sim_drain_all(void);

/* ---------------------------------------------------------------- sim_exec.c */

int sim_ctx_start(struct sim_ctx *ctx);
void sim_ctx_stop(struct sim_ctx *ctx);
/* Append to the context's FIFO (blocks while full); returns the item's seq. */
uint64_t sim_enqueue(struct sim_stream *s, const struct sim_op *op);
/* Submit to a stream: recorded into its capture if it captures, else queued. */
CUresult sim_submit(struct sim_stream *s, const struct sim_op *op, uint64_t *seq_out);
void sim_wait_seq(struct sim_ctx *ctx, uint64_t seq);
int sim_seq_done(struct sim_ctx *ctx, uint64_t seq);
void sim_ctx_drain(struct sim_ctx *ctx);
/* Release resources held by an op that will never run. */
void sim_op_discard(struct sim_op *op);

/* ---------------------------------------------------------------- sim_mem.c */

/* Free an allocation now (the worker runs this for cuMemFreeAsync). */
void sim_mem_free_now(CUdeviceptr ptr);
/* Is [p, p+n) inside memory the device may touch (device, managed, pinned host)? */
int sim_mem_valid(const void *p, size_t n);
/* Move [ptr, ptr+n) of a managed allocation to device `dev` (-1: the host), at the simulated bandwidth;
 * the worker runs this for cuMemPrefetchAsync. */
void sim_mem_prefetch_now(CUdeviceptr ptr, size_t n, int dev, int v2);
/* Free everything a context allocated (context destroy / primary reset). */
void sim_mem_ctx_gone(struct sim_ctx *ctx);
void sim_vmm_ctx_gone(struct sim_ctx *c);     /* frees the context's arrays */

/* ---------------------------------------------------------------- sim_vmm.c */

/* Is [p, p+n) inside a mapped, accessible VMM range? */
int sim_vmm_valid(const void *p, size_t n);
/* cuPointerGetAttribute for addresses that are not plain allocations. */
CUresult sim_vmm_pointer_attribute(void *data, int attribute, CUdeviceptr ptr);

/* ---------------------------------------------------------------- sim_graph.c */

/* If s is in a capture: record op (or refuse: INVALIDATED) and return 1. */
int sim_capture_record(struct sim_stream *s, const struct sim_op *op, CUresult *rc);
/* A potentially unsafe call is about to run: apply the capture mode rules. */
CUresult sim_capture_unsafe(void);
/* Sync/query of stream s: refused if s captures; for the legacy stream,
 * IMPLICIT if a blocking stream captures, else the unsafe-call rules. */
CUresult sim_capture_stream_check(struct sim_stream *s);
/* Work on s: if s is the legacy stream and a blocking stream of its context
 * captures, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (capture invalidated). */
CUresult sim_capture_legacy_use(struct sim_stream *s);
/* A synchronous copy/set ordered on s (legacy or per-thread stream). */
CUresult sim_capture_sync_copy_check(struct sim_stream *s);
/* cuCtxSynchronize: refused while a stream of ctx captures, then unsafe. */
CUresult sim_capture_ctx_check(struct sim_ctx *ctx);
/* A stream goes away: leave its capture. */
void sim_capture_stream_gone(struct sim_stream *s);
/* Event recorded into / waited on from a capture. */
void sim_capture_event_record(struct sim_stream *s, struct sim_event *ev);
int sim_capture_event_wait(struct sim_stream *s, struct sim_event *ev);
/* Is stream s capturing (status, id)? */
CUstreamCaptureStatus sim_capture_status(struct sim_stream *s, uint64_t *id);

/* The host time a driver call costs on a real GPU, slept (SIMCUDA_WAIT_VALUE_US, SIMCUDA_ELAPSED_US). */
void sim_spend_host(uint64_t ns);

#endif /* SIMCUDA_INTERNAL_H */
