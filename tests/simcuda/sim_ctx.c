/*
 * sim_ctx.c -- contexts (per-thread current stack, primary contexts),
 * streams and events.
 *
 * Context objects are never freed (a destroyed one is only marked inactive),
 * so a stale CUcontext, or an event or stream that points at one, stays safe
 * to look at. All streams of a context share its one FIFO (sim_exec.c): a
 * stream remembers the seq of its last item, and waiting for a stream or an
 * event is waiting for the context's done_seq to reach that seq.
 */
#include "sim_internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SIM_STACK_MAX 128
#define SIM_PT_MAX 16

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_ctx *all_ctx;
static struct sim_ctx *primary[SIM_MAX_DEVICES];

static __thread struct sim_ctx *stack[SIM_STACK_MAX];
static __thread int depth;

static pthread_mutex_t ev_lock = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ contexts */

static struct sim_ctx *ctx_new(int dev, unsigned flags, int is_primary)
{
    struct sim_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->dev = dev;
    c->flags = flags;
    c->primary = is_primary;
    c->api_version = 3020;
    pthread_mutex_init(&c->qlock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->nonempty, &ca);
    pthread_cond_init(&c->nonfull, &ca);
    pthread_cond_init(&c->done, &ca);
    pthread_condattr_destroy(&ca);
    c->legacy.ctx = c;
    c->legacy.kind = SK_LEGACY;
    pthread_mutex_lock(&ctx_lock);
    c->next_all = all_ctx;
    all_ctx = c;
    pthread_mutex_unlock(&ctx_lock);
    return c;
}

static CUresult ctx_activate(struct sim_ctx *c)
{
    if (sim_ctx_start(c) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    __atomic_add_fetch(&c->life, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&c->active, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

static void ctx_deactivate(struct sim_ctx *c)
{
    __atomic_store_n(&c->active, 0, __ATOMIC_RELEASE);
    sim_ctx_stop(c);
    sim_mem_ctx_gone(c);
    sim_vmm_ctx_gone(c);
}

struct sim_ctx *sim_ctx_current(void) { return depth ? stack[depth - 1] : NULL; }

CUresult sim_ctx_get(struct sim_ctx **out)
{
    SIM_CHECK_INIT();
    struct sim_ctx *c = sim_ctx_current();
    if (!c || !__atomic_load_n(&c->active, __ATOMIC_ACQUIRE)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

void sim_drain_all(void)
{
    pthread_mutex_lock(&ctx_lock);
    for (struct sim_ctx *c = all_ctx; c; c = c->next_all)
        if (c->worker_started) sim_ctx_drain(c);
    pthread_mutex_unlock(&ctx_lock);
}

static CUresult create_ctx(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (depth >= SIM_STACK_MAX) return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *c = ctx_new(dev, flags, 0);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    rc = ctx_activate(c);
    if (rc) return rc;
    sim_handle_add(c, H_CTX);
    stack[depth++] = c;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) { return create_ctx(pctx, flags, dev); }

CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev)
{
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    return create_ctx(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    return create_ctx(pctx, flags, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    SIM_CHECK_INIT();
    struct sim_ctx *c = (struct sim_ctx *)ctx;
    if (!sim_handle_is(c, H_CTX) || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    sim_handle_del(c);
    int j = 0;
    for (int i = 0; i < depth; i++)
        if (stack[i] != c) stack[j++] = stack[i];
    depth = j;
    ctx_deactivate(c);
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    SIM_CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)sim_ctx_current();
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    SIM_CHECK_INIT();
    if (!ctx) {
        if (depth) depth--;
        return CUDA_SUCCESS;
    }
    if (!sim_handle_is(ctx, H_CTX)) return CUDA_ERROR_INVALID_CONTEXT;
    if (depth)
        stack[depth - 1] = (struct sim_ctx *)ctx;
    else
        stack[depth++] = (struct sim_ctx *)ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    SIM_CHECK_INIT();
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(ctx, H_CTX)) return CUDA_ERROR_INVALID_CONTEXT;
    if (depth >= SIM_STACK_MAX) return CUDA_ERROR_INVALID_VALUE;
    stack[depth++] = (struct sim_ctx *)ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    SIM_CHECK_INIT();
    if (!depth) return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ctx *c = stack[--depth];
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = c->dev;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetFlags(unsigned int *flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    SIM_CHECK_INIT();
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *c = ctx ? (struct sim_ctx *)ctx : sim_ctx_current();
    if (!c || !sim_handle_is(c, H_CTX)) return CUDA_ERROR_INVALID_CONTEXT;
    *version = (unsigned)c->api_version;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    SIM_CHECK_INIT();
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

/* SIMCUDA_CTX_SYNC_DELAY_US: cuCtxSynchronize sleeps this long before it looks at the captures of the
 * context, widening the window in which another thread can begin one (tests of the hook's drain). */
static void ctx_sync_delay(void)
{
    static long delay_us = -1;
    if (delay_us < 0) {
        const char *v = getenv("SIMCUDA_CTX_SYNC_DELAY_US");
        delay_us = v && *v ? strtol(v, NULL, 10) : 0;
    }
    if (delay_us > 0) usleep((useconds_t)delay_us);
}

CUresult cuCtxSynchronize(void)
{
    ctx_sync_delay();
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    rc = sim_capture_ctx_check(c);
    if (rc) return rc;
    sim_ctx_drain(c);
    return CUDA_SUCCESS;
}

/* CUDA 13.0: synchronise a given context (NULL: the current one). cuGetProcAddress gives it for
 * "cuCtxSynchronize" from cudaVersion 13000, as the real 580 driver does. */
CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!ctx) return cuCtxSynchronize();
    CUresult rc = cuCtxPushCurrent_v2(ctx);
    if (rc) return rc;
    rc = cuCtxSynchronize();
    CUcontext popped;
    cuCtxPopCurrent_v2(&popped);
    return rc;
}

/* ------------------------------------------------------------------ primary contexts */

/* ctx_lock held. */
static struct sim_ctx *primary_get(CUdevice dev)
{
    if (!primary[dev]) {
        pthread_mutex_unlock(&ctx_lock);
        struct sim_ctx *c = ctx_new(dev, 0, 1);
        pthread_mutex_lock(&ctx_lock);
        if (!c) return NULL;
        if (primary[dev]) return primary[dev]; /* lost a race: c stays unused */
        primary[dev] = c;
        sim_handle_add(c, H_CTX);
    }
    return primary[dev];
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    struct sim_ctx *c = primary_get(dev);
    if (!c) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (c->refcount == 0) rc = ctx_activate(c);
    if (rc == CUDA_SUCCESS) {
        c->refcount++;
        *pctx = (CUcontext)c;
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

static CUresult primary_release(CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    pthread_mutex_lock(&ctx_lock);
    struct sim_ctx *c = primary[dev];
    if (!c || c->refcount == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--c->refcount == 0) {
        ctx_deactivate(c);
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release(dev); }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release(dev); }

/* Drop all state and allocations; retained users get a fresh, empty context. */
static CUresult primary_reset(CUdevice dev)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    pthread_mutex_lock(&ctx_lock);
    struct sim_ctx *c = primary[dev];
    if (c && c->active) {
        ctx_deactivate(c);
        rc = ctx_activate(c);
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_reset(dev); }
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return primary_reset(dev); }

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_lock);
    struct sim_ctx *c = primary[dev];
    *flags = c ? c->flags : 0;
    *active = c && c->refcount > 0;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

static CUresult primary_set_flags(CUdevice dev, unsigned int flags)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    pthread_mutex_lock(&ctx_lock);
    struct sim_ctx *c = primary_get(dev);
    if (c) c->flags = flags;
    pthread_mutex_unlock(&ctx_lock);
    return c ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) { return primary_set_flags(dev, flags); }
CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) { return primary_set_flags(dev, flags); }

/* ------------------------------------------------------------------ streams */

static __thread struct {
    struct sim_ctx *ctx;
    struct sim_stream *s;
} pt_streams[SIM_PT_MAX];

static struct sim_stream *per_thread_stream(struct sim_ctx *c)
{
    int free_i = -1;
    for (int i = 0; i < SIM_PT_MAX; i++) {
        if (pt_streams[i].ctx == c) return pt_streams[i].s;
        if (!pt_streams[i].ctx && free_i < 0) free_i = i;
    }
    struct sim_stream *s = calloc(1, sizeof *s);
    if (!s) return &c->legacy;
    s->ctx = c;
    s->kind = SK_PER_THREAD;
    if (free_i < 0) free_i = 0; /* more contexts than slots: forget the oldest (leaked) */
    pt_streams[free_i].ctx = c;
    pt_streams[free_i].s = s;
    return s;
}

CUresult sim_stream_resolve(CUstream h, int ptsz, struct sim_stream **out)
{
    SIM_CHECK_INIT();
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct sim_ctx *c;
        CUresult rc = sim_ctx_get(&c);
        if (rc) return rc;
        if (h == CU_STREAM_PER_THREAD || (h == NULL && ptsz))
            *out = per_thread_stream(c);
        else
            *out = &c->legacy;
        return CUDA_SUCCESS;
    }
    if (!sim_handle_is(h, H_STREAM)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_stream *s = (struct sim_stream *)h;
    if (!__atomic_load_n(&s->ctx->active, __ATOMIC_ACQUIRE)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = s;
    return CUDA_SUCCESS;
}

static CUresult stream_create(CUstream *phStream, unsigned int flags, int priority)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->ctx = c;
    s->kind = SK_CREATED;
    s->flags = flags;
    s->priority = priority > 0 ? 0 : priority < -5 ? -5 : priority;
    sim_handle_add(s, H_STREAM);
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) { return stream_create(phStream, Flags, 0); }

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    return stream_create(phStream, flags, priority);
}

CUresult cuStreamDestroy_v2(CUstream hStream)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hStream, H_STREAM)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_stream *s = (struct sim_stream *)hStream;
    sim_handle_del(s);
    sim_capture_stream_gone(s);
    /* Queued items do not point at the stream: its work still completes. */
    free(s);
    return CUDA_SUCCESS;
}

static CUresult stream_get_ctx(CUstream h, CUcontext *pctx, int ptsz)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)s->ctx;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) { return stream_get_ctx(hStream, pctx, 0); }
CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx) { return stream_get_ctx(hStream, pctx, 1); }

static uint64_t stream_last(struct sim_stream *s)
{
    pthread_mutex_lock(&s->ctx->qlock);
    uint64_t seq = s->last_seq;
    pthread_mutex_unlock(&s->ctx->qlock);
    return seq;
}

static CUresult stream_sync(CUstream h, int ptsz)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    rc = sim_capture_stream_check(s);
    if (rc) return rc;
    sim_wait_seq(s->ctx, stream_last(s));
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptsz)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    rc = sim_capture_stream_check(s);
    if (rc) return rc;
    return sim_seq_done(s->ctx, stream_last(s)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, 0); }
CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, 1); }

static CUresult stream_wait_event(CUstream h, CUevent hEvent, unsigned int flags, int ptsz)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    if (!sim_handle_is(hEvent, H_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
    struct sim_event *ev = (struct sim_event *)hEvent;
    if (sim_capture_event_wait(s, ev)) return CUDA_SUCCESS;
    pthread_mutex_lock(&ev_lock);
    struct sim_ctx *ectx = ev->ctx;
    uint64_t seq = ev->seq;
    pthread_mutex_unlock(&ev_lock);
    /* Same context: one FIFO already orders it. Another context: wait in ours. */
    if (!ectx || ectx == s->ctx || sim_seq_done(ectx, seq)) return CUDA_SUCCESS;
    struct sim_op op = {.kind = OP_WAIT};
    op.u.wait.ctx = ectx;
    op.u.wait.seq = seq;
    return sim_submit(s, &op, NULL);
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(hStream, hEvent, Flags, 0);
}

CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

/* ------------------------------------------------------------------ events */

/* Live events by their flags (the low three bits: CU_EVENT_BLOCKING_SYNC, _DISABLE_TIMING, _INTERPROCESS). */
static atomic_int live_events[8];
static atomic_ullong untimed_creates;

int simcuda_live_events(unsigned int flags)
{
    return flags < 8 ? atomic_load(&live_events[flags]) : 0;
}

/* cuEventElapsedTime calls the process made (either ABI, whatever they returned): what a test of the hook's
 * markers counts instead of the host time the calls took, which a loaded machine stretches. */
static atomic_ullong elapsed_calls;

unsigned long long simcuda_elapsed_calls(void)
{
    return atomic_load(&elapsed_calls);
}

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!phEvent || (Flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_DISABLE_TIMING) && sim_cfg.untimed_event_fail_at &&
        atomic_fetch_add(&untimed_creates, 1) + 1 == sim_cfg.untimed_event_fail_at)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_event *ev = calloc(1, sizeof *ev);
    if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
    ev->flags = Flags;
    ev->owner = c;
    ev->owner_life = __atomic_load_n(&c->life, __ATOMIC_ACQUIRE);
    atomic_init(&ev->refs, 1);
    sim_handle_add(ev, H_EVENT);
    atomic_fetch_add(&live_events[Flags], 1);
    *phEvent = (CUevent)ev;
    return CUDA_SUCCESS;
}

/* The event's context was reset or destroyed since it was made: the event went with it. */
static int event_dead(const struct sim_event *ev)
{
    const struct sim_ctx *c = ev->owner;
    return c && (!__atomic_load_n(&c->active, __ATOMIC_ACQUIRE) ||
                 __atomic_load_n(&c->life, __ATOMIC_ACQUIRE) != ev->owner_life);
}

void sim_event_unref(struct sim_event *ev)
{
    if (atomic_fetch_sub(&ev->refs, 1) == 1) free(ev);
}

/* The worker ran a record of ev. */
void sim_event_fired(struct sim_event *ev, uint64_t t)
{
    pthread_mutex_lock(&ev_lock);
    ev->time_ns = t;
    pthread_mutex_unlock(&ev_lock);
}

CUresult cuEventDestroy_v2(CUevent hEvent)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hEvent, H_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    sim_handle_del(hEvent);
    atomic_fetch_sub(&live_events[((struct sim_event *)hEvent)->flags & 7u], 1);
    sim_event_unref((struct sim_event *)hEvent);
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent hEvent, CUstream h, int ptsz)
{
    SIM_CHECK_INIT();
    sim_spend_host(sim_cfg.record_ns);
    if (!sim_handle_is(hEvent, H_EVENT) || event_dead((struct sim_event *)hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    struct sim_event *ev = (struct sim_event *)hEvent;
    rc = sim_capture_legacy_use(s);
    if (rc) return rc;
    if (sim_capture_status(s, NULL) != CU_STREAM_CAPTURE_STATUS_NONE) {
        sim_capture_event_record(s, ev);
        return CUDA_SUCCESS;
    }
    atomic_fetch_add(&ev->refs, 1);
    struct sim_op op = {.kind = OP_EVENT};
    op.u.ev.ev = ev;
    /* Not under ev_lock: the enqueue may block on a full queue whose worker
     * needs ev_lock to fire an earlier record. */
    uint64_t seq = sim_enqueue(s, &op);
    pthread_mutex_lock(&ev_lock);
    ev->ctx = s->ctx;
    ev->seq = seq;
    ev->cap_id = 0;
    pthread_mutex_unlock(&ev_lock);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0); }
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 1); }

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return event_record(hEvent, hStream, 0);
}

CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    return event_record(hEvent, hStream, 1);
}

static void event_state(struct sim_event *ev, struct sim_ctx **ctx, uint64_t *seq, uint64_t *t)
{
    pthread_mutex_lock(&ev_lock);
    *ctx = ev->ctx;
    *seq = ev->seq;
    if (t) *t = ev->time_ns;
    pthread_mutex_unlock(&ev_lock);
}

CUresult cuEventSynchronize(CUevent hEvent)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hEvent, H_EVENT) || event_dead((struct sim_event *)hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = sim_capture_unsafe(); /* potentially unsafe during a capture */
    if (rc) return rc;
    struct sim_ctx *c;
    uint64_t seq;
    event_state((struct sim_event *)hEvent, &c, &seq, NULL);
    if (c) sim_wait_seq(c, seq);
    return CUDA_SUCCESS;
}

CUresult cuEventQuery(CUevent hEvent)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hEvent, H_EVENT) || event_dead((struct sim_event *)hEvent)) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = sim_capture_unsafe(); /* potentially unsafe during a capture */
    if (rc) return rc;
    struct sim_ctx *c;
    uint64_t seq;
    event_state((struct sim_event *)hEvent, &c, &seq, NULL);
    return !c || sim_seq_done(c, seq) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

static CUresult elapsed(float *ms, CUevent hStart, CUevent hEnd)
{
    SIM_CHECK_INIT();
    atomic_fetch_add(&elapsed_calls, 1);
    sim_spend_host(sim_cfg.elapsed_ns);
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(hStart, H_EVENT) || !sim_handle_is(hEnd, H_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (event_dead((struct sim_event *)hStart) || event_dead((struct sim_event *)hEnd)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_event *a = (struct sim_event *)hStart, *b = (struct sim_event *)hEnd;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_ctx *ca, *cb;
    uint64_t sa, sb, ta, tb;
    event_state(a, &ca, &sa, &ta);
    event_state(b, &cb, &sb, &tb);
    if (!ca || !cb) return CUDA_ERROR_INVALID_HANDLE;
    if (!sim_seq_done(ca, sa) || !sim_seq_done(cb, sb)) return CUDA_ERROR_NOT_READY;
    event_state(a, &ca, &sa, &ta);
    event_state(b, &cb, &sb, &tb);
    *ms = (float)((double)((int64_t)(tb - ta)) / 1e6);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return elapsed(pMilliseconds, hStart, hEnd);
}

CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    return elapsed(pMilliseconds, hStart, hEnd);
}
