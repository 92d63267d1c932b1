/*
 * sim_graph.c -- stream capture and graphs.
 *
 * A graph is a list of recorded operations (kernels, copies, sets, host
 * functions) replayed in order. Work submitted to a capturing stream is
 * appended to the capture's graph instead of running; a stream joins a
 * capture by waiting on an event recorded in it.
 *
 * Capture-safety emulation, as measured on the real CUDA 13.0 driver:
 *  - A thread whose capture interaction mode (cuThreadExchangeStreamCaptureMode,
 *    default GLOBAL) is not RELAXED may not make a potentially unsafe call
 *    (cuMemAlloc/Free and friends, cuEventQuery/Synchronize, sync/query of the
 *    legacy stream) while it has a capture of its own not begun in RELAXED
 *    mode, or (its mode being GLOBAL) another thread has a capture begun in
 *    GLOBAL mode: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and those captures
 *    are invalidated (cuStreamEndCapture then fails with _INVALIDATED).
 *  - Any use of the legacy stream (work, synchronous copies and sets, sync,
 *    query, event record) while a blocking stream of the same context
 *    captures would make the legacy stream depend on the capture:
 *    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT in every mode, capture invalidated.
 *    (With only non-blocking streams capturing, synchronous copies are fine.)
 *  - Synchronising or querying a capturing stream, or cuCtxSynchronize while
 *    a stream of the context captures, fails and invalidates in every mode.
 */
#include "sim_internal.h"

#include <stdlib.h>
#include <string.h>

struct sim_graph {
    struct sim_op *nodes;
    int n, cap;
};

struct sim_gexec {
    struct sim_op *nodes;
    int n;
};

struct sim_capture {
    uint64_t id;
    int mode;
    pid_t tid;
    CUstreamCaptureStatus status;
    struct sim_graph *graph;
    struct sim_stream *origin;
    struct sim_stream **streams; /* origin first, then joined streams */
    int nstreams, capstreams;
    struct sim_capture *next;
};

static pthread_mutex_t cap_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_capture *caps;
static uint64_t next_cap_id = 1;
static __thread int thread_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

/* ------------------------------------------------------------------ graphs */

static struct sim_graph *graph_new(void)
{
    struct sim_graph *g = calloc(1, sizeof *g);
    if (g) sim_handle_add(g, H_GRAPH);
    return g;
}

static void graph_free(struct sim_graph *g)
{
    sim_handle_del(g);
    for (int i = 0; i < g->n; i++) sim_op_discard(&g->nodes[i]);
    free(g->nodes);
    free(g);
}

/* Copy op for a graph or a launch: a staged source gets its own buffer. */
static int op_dup(struct sim_op *dst, const struct sim_op *src)
{
    *dst = *src;
    if (src->kind == OP_MEMCPY && src->u.cp.staged) {
        dst->u.cp.staged = malloc(src->u.cp.n);
        if (!dst->u.cp.staged) return -1;
        memcpy(dst->u.cp.staged, src->u.cp.staged, src->u.cp.n);
    }
    return 0;
}

/* Takes ownership of op's resources. */
static CUresult graph_append(struct sim_graph *g, const struct sim_op *op)
{
    if (g->n == g->cap) {
        int nc = g->cap ? g->cap * 2 : 16;
        struct sim_op *nn = realloc(g->nodes, (size_t)nc * sizeof *nn);
        if (!nn) {
            struct sim_op tmp = *op;
            sim_op_discard(&tmp);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = nn;
        g->cap = nc;
    }
    g->nodes[g->n++] = *op;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ capture bookkeeping (cap_lock held) */

static void cap_detach_all(struct sim_capture *c)
{
    for (int i = 0; i < c->nstreams; i++) c->streams[i]->cap = NULL;
    c->nstreams = 0;
}

static void cap_unlink(struct sim_capture *c)
{
    for (struct sim_capture **pp = &caps; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
}

static int cap_add_stream(struct sim_capture *c, struct sim_stream *s)
{
    if (c->nstreams == c->capstreams) {
        int nc = c->capstreams ? c->capstreams * 2 : 4;
        struct sim_stream **ns = realloc(c->streams, (size_t)nc * sizeof *ns);
        if (!ns) return -1;
        c->streams = ns;
        c->capstreams = nc;
    }
    c->streams[c->nstreams++] = s;
    s->cap = c;
    return 0;
}

static void cap_free(struct sim_capture *c)
{
    free(c->streams);
    free(c);
}

/* ------------------------------------------------------------------ hooks used by the other files */

int sim_capture_record(struct sim_stream *s, const struct sim_op *op, CUresult *rc)
{
    pthread_mutex_lock(&cap_lock);
    struct sim_capture *c = s->cap;
    if (!c) {
        pthread_mutex_unlock(&cap_lock);
        return 0;
    }
    if (c->status != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        struct sim_op tmp = *op;
        sim_op_discard(&tmp);
        *rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else if (op->kind == OP_WAIT || op->kind == OP_EVENT || op->kind == OP_FREE) {
        /* Dependencies on outside work and frees are not graph nodes here. */
        struct sim_op tmp = *op;
        sim_op_discard(&tmp);
        *rc = CUDA_SUCCESS;
    } else {
        *rc = graph_append(c->graph, op);
    }
    pthread_mutex_unlock(&cap_lock);
    return 1;
}

/* cap_lock held. Returns 1 if the calling thread may not make an unsafe call now;
 * invalidates the captures that forbid it. */
static int unsafe_locked(void)
{
    int mode = thread_mode;
    if (mode == CU_STREAM_CAPTURE_MODE_RELAXED) return 0;
    pid_t me = sim_gettid();
    int offend = 0;
    for (struct sim_capture *c = caps; c; c = c->next) {
        int mine = c->tid == me;
        if ((mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
            (!mine && mode == CU_STREAM_CAPTURE_MODE_GLOBAL && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
            c->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
            offend = 1;
        }
    }
    return offend;
}

CUresult sim_capture_unsafe(void)
{
    pthread_mutex_lock(&cap_lock);
    int offend = caps ? unsafe_locked() : 0;
    pthread_mutex_unlock(&cap_lock);
    return offend ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* Blocking streams synchronise with the legacy stream. */
static int blocking(const struct sim_stream *s)
{
    return s->kind == SK_PER_THREAD || (s->kind == SK_CREATED && !(s->flags & CU_STREAM_NON_BLOCKING));
}

/* cap_lock held: the legacy stream of ctx is used; invalidate captures of its blocking streams. */
static int implicit_locked(struct sim_ctx *ctx)
{
    int offend = 0;
    for (struct sim_capture *c = caps; c; c = c->next)
        for (int i = 0; i < c->nstreams; i++)
            if (c->streams[i]->ctx == ctx && blocking(c->streams[i])) {
                c->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
                offend = 1;
            }
    return offend;
}

CUresult sim_capture_legacy_use(struct sim_stream *s)
{
    if (s->kind != SK_LEGACY) return CUDA_SUCCESS;
    pthread_mutex_lock(&cap_lock);
    int offend = caps ? implicit_locked(s->ctx) : 0;
    pthread_mutex_unlock(&cap_lock);
    return offend ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

CUresult sim_capture_sync_copy_check(struct sim_stream *s)
{
    pthread_mutex_lock(&cap_lock);
    CUresult rc = CUDA_SUCCESS;
    if (s->cap) {
        s->cap->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (s->kind == SK_LEGACY && caps && implicit_locked(s->ctx)) {
        rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    pthread_mutex_unlock(&cap_lock);
    return rc;
}

CUresult sim_capture_stream_check(struct sim_stream *s)
{
    pthread_mutex_lock(&cap_lock);
    CUresult rc = CUDA_SUCCESS;
    if (s->cap) {
        s->cap->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (s->kind == SK_LEGACY && caps) {
        if (implicit_locked(s->ctx))
            rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        else if (unsafe_locked())
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    pthread_mutex_unlock(&cap_lock);
    return rc;
}

CUresult sim_capture_ctx_check(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&cap_lock);
    int offend = 0;
    for (struct sim_capture *c = caps; c; c = c->next)
        for (int i = 0; i < c->nstreams; i++)
            if (c->streams[i]->ctx == ctx) {
                c->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
                offend = 1;
            }
    if (!offend && caps) offend = unsafe_locked();
    pthread_mutex_unlock(&cap_lock);
    return offend ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

void sim_capture_stream_gone(struct sim_stream *s)
{
    pthread_mutex_lock(&cap_lock);
    struct sim_capture *c = s->cap;
    if (c && c->origin == s) {
        /* The capture ends with its stream: nobody can end it any more. */
        cap_detach_all(c);
        cap_unlink(c);
        graph_free(c->graph);
        cap_free(c);
    } else if (c) {
        for (int i = 0; i < c->nstreams; i++)
            if (c->streams[i] == s) {
                c->streams[i] = c->streams[--c->nstreams];
                break;
            }
        s->cap = NULL;
    }
    pthread_mutex_unlock(&cap_lock);
}

void sim_capture_event_record(struct sim_stream *s, struct sim_event *ev)
{
    pthread_mutex_lock(&cap_lock);
    if (s->cap) ev->cap_id = s->cap->id;
    pthread_mutex_unlock(&cap_lock);
}

int sim_capture_event_wait(struct sim_stream *s, struct sim_event *ev)
{
    int handled = 0;
    pthread_mutex_lock(&cap_lock);
    struct sim_capture *from = NULL;
    if (ev->cap_id)
        for (struct sim_capture *c = caps; c; c = c->next)
            if (c->id == ev->cap_id) from = c;
    if (from && !s->cap) {
        cap_add_stream(from, s); /* fork: s joins the capture */
        handled = 1;
    } else if (s->cap) {
        handled = 1; /* join, or a dependency a capture does not need here */
    }
    pthread_mutex_unlock(&cap_lock);
    return handled;
}

CUstreamCaptureStatus sim_capture_status(struct sim_stream *s, uint64_t *id)
{
    pthread_mutex_lock(&cap_lock);
    CUstreamCaptureStatus st = s->cap ? s->cap->status : CU_STREAM_CAPTURE_STATUS_NONE;
    if (id) *id = s->cap ? s->cap->id : 0;
    pthread_mutex_unlock(&cap_lock);
    return st;
}

/* ------------------------------------------------------------------ capture API */

static CUresult begin_capture(CUstream h, int mode, int ptsz)
{
    SIM_CHECK_INIT();
    if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    if (s->kind == SK_LEGACY) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct sim_capture *c = calloc(1, sizeof *c);
    struct sim_graph *g = c ? graph_new() : NULL;
    if (!g) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->mode = mode;
    c->tid = sim_gettid();
    c->status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    c->graph = g;
    c->origin = s;
    pthread_mutex_lock(&cap_lock);
    if (s->cap) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else if (cap_add_stream(c, s) != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        c->id = next_cap_id++;
        c->next = caps;
        caps = c;
    }
    pthread_mutex_unlock(&cap_lock);
    if (rc) {
        graph_free(g);
        cap_free(c);
    }
    return rc;
}

CUresult cuStreamBeginCapture(CUstream hStream) { return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 0); }

CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL, 1);
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, (int)mode, 0);
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, (int)mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptsz)
{
    SIM_CHECK_INIT();
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    pthread_mutex_lock(&cap_lock);
    struct sim_capture *c = s->cap;
    if (!c) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else if (c->origin != s) {
        rc = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
    } else if (c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && c->tid != sim_gettid()) {
        rc = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    } else {
        cap_detach_all(c);
        cap_unlink(c);
    }
    pthread_mutex_unlock(&cap_lock);
    if (rc) return rc;
    if (c->status != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
        graph_free(c->graph);
        *phGraph = NULL;
        rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else {
        *phGraph = (CUgraph)c->graph;
    }
    cap_free(c);
    return rc;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) { return end_capture(hStream, phGraph, 0); }
CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) { return end_capture(hStream, phGraph, 1); }

static CUresult capture_info(CUstream h, int ptsz, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cap_lock);
    struct sim_capture *c = s->cap;
    *status = c ? c->status : CU_STREAM_CAPTURE_STATUS_NONE;
    if (c) {
        if (id) *id = c->id;
        if (graph) *graph = (CUgraph)c->graph;
    }
    pthread_mutex_unlock(&cap_lock);
    /* Dependency nodes are not tracked: a captured graph is a chain. */
    if (deps) *deps = NULL;
    if (edges) *edges = NULL;
    if (ndeps) *ndeps = 0;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return capture_info(hStream, 0, captureStatus, NULL, NULL, NULL, NULL, NULL);
}

CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return capture_info(hStream, 1, captureStatus, NULL, NULL, NULL, NULL, NULL);
}

CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus *captureStatus_out, cuuint64_t *id_out)
{
    return capture_info(hStream, 0, captureStatus_out, id_out, NULL, NULL, NULL, NULL);
}

CUresult cuStreamGetCaptureInfo_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus_out, cuuint64_t *id_out)
{
    return capture_info(hStream, 1, captureStatus_out, id_out, NULL, NULL, NULL, NULL);
}

CUresult cuStreamGetCaptureInfo_v2 SIM_CAPINFO2_PARAMS
{
    return capture_info(hStream, 0, captureStatus_out, id_out, graph_out, dependencies_out, NULL,
                        numDependencies_out);
}

CUresult cuStreamGetCaptureInfo_v2_ptsz SIM_CAPINFO2_PARAMS
{
    return capture_info(hStream, 1, captureStatus_out, id_out, graph_out, dependencies_out, NULL,
                        numDependencies_out);
}

CUresult cuStreamGetCaptureInfo_v3 SIM_CAPINFO3_PARAMS
{
    return capture_info(hStream, 0, captureStatus_out, id_out, graph_out, dependencies_out, edgeData_out,
                        numDependencies_out);
}

CUresult cuStreamGetCaptureInfo_v3_ptsz SIM_CAPINFO3_PARAMS
{
    return capture_info(hStream, 1, captureStatus_out, id_out, graph_out, dependencies_out, edgeData_out,
                        numDependencies_out);
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    SIM_CHECK_INIT();
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    /* Like the real driver, any value is taken (others act as neither GLOBAL nor RELAXED). */
    int old = thread_mode;
    thread_mode = (int)*mode;
    *mode = (CUstreamCaptureMode)old;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ graph API */

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    SIM_CHECK_INIT();
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *g = graph_new();
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    *phGraph = (CUgraph)g;
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hGraph, H_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cap_lock);
    int busy = 0;
    for (struct sim_capture *c = caps; c; c = c->next)
        if (c->graph == (struct sim_graph *)hGraph) busy = 1;
    pthread_mutex_unlock(&cap_lock);
    if (busy) return CUDA_ERROR_ILLEGAL_STATE;
    graph_free((struct sim_graph *)hGraph);
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *phExec, CUgraph hGraph)
{
    SIM_CHECK_INIT();
    if (!phExec) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(hGraph, H_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_graph *g = (struct sim_graph *)hGraph;
    struct sim_gexec *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&cap_lock); /* a capture may still append to g */
    e->nodes = g->n ? calloc((size_t)g->n, sizeof *e->nodes) : NULL;
    int ok = !g->n || e->nodes;
    for (int i = 0; ok && i < g->n; i++) {
        if (op_dup(&e->nodes[i], &g->nodes[i]) != 0) ok = 0;
        else e->n = i + 1;
    }
    pthread_mutex_unlock(&cap_lock);
    if (!ok) {
        for (int i = 0; i < e->n; i++) sim_op_discard(&e->nodes[i]);
        free(e->nodes);
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_handle_add(e, H_GRAPHEXEC);
    *phExec = (CUgraphExec)e;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                            size_t bufferSize)
{
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph);
}

CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                               size_t bufferSize)
{
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph);
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    return instantiate(phGraphExec, hGraph);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hGraphExec, H_GRAPHEXEC)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_gexec *e = (struct sim_gexec *)hGraphExec;
    sim_handle_del(e);
    for (int i = 0; i < e->n; i++) sim_op_discard(&e->nodes[i]);
    free(e->nodes);
    free(e);
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraphExec hExec, CUstream h, int ptsz)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hExec, H_GRAPHEXEC)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    struct sim_gexec *e = (struct sim_gexec *)hExec;
    for (int i = 0; i < e->n; i++) {
        struct sim_op op;
        if (op_dup(&op, &e->nodes[i]) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
        /* Into a capture: the nodes are recorded there (a child graph). */
        rc = sim_submit(s, &op, NULL);
        if (rc) return rc;
    }
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) { return graph_launch(hGraphExec, hStream, 0); }
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) { return graph_launch(hGraphExec, hStream, 1); }
