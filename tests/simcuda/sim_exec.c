/*
 * sim_exec.c -- the per-context worker and its FIFO, kernel execution,
 * modules / libraries / functions, and the launch entry points.
 *
 * Each active context has one worker thread that runs its items in order.
 * Items are numbered 1, 2, ... (seq); done_seq is the last one finished, so
 * "has item n finished" is done_seq >= n. A kernel takes the device's
 * cross-process execution lock (sim_state.c), sleeps its duration and
 * releases it: kernels of all processes on one device run one at a time.
 */
#include "sim_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

/* ------------------------------------------------------------------ worker */

/* A turn on the device (its cross-process lock) normally lasts one kernel. An event shares the turn of the
 * kernel next to it in the context's queue: a GPU timestamps an event when it processes it, and it processes
 * a context's work only while that context has the GPU, but once it has, it runs what the context's channel
 * holds. So an event queued behind another process's kernel fires after it (on an H100 an event recorded
 * just after a slot's drain fired after the next holder's first 1 ms kernel), an event right behind this
 * context's running kernel fires when that kernel ends, and a kernel right behind an event that had to wait
 * for the device runs at once. `*held` says which kind of item a turn was kept for (0: none). */
enum { HELD_NONE, HELD_FOR_KERNEL, HELD_FOR_EVENT };

/* The kind of the item queued after item `seq` (-1: none yet). */
static int next_kind(struct sim_ctx *c, uint64_t seq)
{
    pthread_mutex_lock(&c->qlock);
    int kind = c->enq_seq > seq ? c->ring[(seq + 1) % SIM_QUEUE_LEN].op.kind : -1;
    pthread_mutex_unlock(&c->qlock);
    return kind;
}

static void exec_op(struct sim_ctx *c, struct sim_op *op, int *held, uint64_t seq)
{
    if (*held && op->kind != (*held == HELD_FOR_KERNEL ? OP_KERNEL : OP_EVENT)) { /* discarded meanwhile */
        sim_dev_release_counted(c->dev, *held == HELD_FOR_EVENT);
        *held = HELD_NONE;
    }
    switch (op->kind) {
    case OP_KERNEL: {
        uint64_t dur = op->u.k.spin ? op->u.k.dur_ns : sim_cfg.kernel_ns;
        if (*held == HELD_NONE) sim_dev_acquire(c->dev);
        uint64_t t0 = sim_now_ns();
        if (dur) sim_sleep_until(t0 + dur);
        uint64_t t1 = sim_now_ns();
        *held = next_kind(c, seq) == OP_EVENT ? HELD_FOR_EVENT : HELD_NONE; /* queued while it ran */
        if (*held == HELD_NONE) sim_dev_release(c->dev);
        if (op->u.k.spin && op->u.k.out && sim_mem_valid(op->u.k.out, 3 * sizeof(uint64_t))) {
            op->u.k.out[0] = t1 - t0; /* on-chip ns: the device was ours throughout */
            op->u.k.out[1] = t0;
            op->u.k.out[2] = t1;
        }
        sim_trace_kernel(c->dev, t0, t1, op->u.k.name);
        break;
    }
    case OP_MEMCPY:
        memmove(op->u.cp.dst, op->u.cp.staged ? op->u.cp.staged : op->u.cp.src, op->u.cp.n);
        free(op->u.cp.staged);
        break;
    case OP_MEMSET:
        if (op->u.ms.width == 1) {
            memset(op->u.ms.dst, (int)(op->u.ms.val & 0xff), op->u.ms.n);
        } else {
            uint32_t *p = op->u.ms.dst;
            for (size_t i = 0; i < op->u.ms.n; i++) p[i] = op->u.ms.val;
        }
        break;
    case OP_HOSTFN:
        op->u.host.fn(op->u.host.data);
        break;
    case OP_EVENT: {
        int after_kernel = *held == HELD_FOR_EVENT;
        if (*held == HELD_NONE) sim_dev_acquire(c->dev);
        sim_event_fired(op->u.ev.ev, sim_now_ns());
        /* a turn taken for this event goes on to the kernel behind it; a kernel's turn ends here */
        *held = !after_kernel && next_kind(c, seq) == OP_KERNEL ? HELD_FOR_KERNEL : HELD_NONE;
        if (*held == HELD_NONE) sim_dev_release_counted(c->dev, after_kernel);
        sim_event_unref(op->u.ev.ev);
        break;
    }
    case OP_WAIT:
        sim_wait_seq(op->u.wait.ctx, op->u.wait.seq);
        break;
    case OP_FREE:
        sim_mem_free_now(op->u.fr.ptr);
        break;
    case OP_PREFETCH:
        sim_mem_prefetch_now(op->u.pf.ptr, op->u.pf.n, op->u.pf.dev, op->u.pf.v2);
        break;
    case OP_WAIT_VALUE: {
        /* The stream stops here until the word equals the value, the device free for everyone else meanwhile
         * (a real GPU switches away from a channel that waits on a semaphore). A stopping context ends it. */
        struct timespec ts = {0, 20 * 1000};
        while (*op->u.wv.addr != op->u.wv.value && !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE))
            nanosleep(&ts, NULL);
        if (sim_cfg.wait_value_gpu_ns) { /* what the satisfied wait costs the device (a model, for the benchmark) */
            sim_dev_acquire(c->dev);
            sim_sleep_until(sim_now_ns() + sim_cfg.wait_value_gpu_ns);
            sim_dev_release(c->dev);
        }
        break;
    }
    default:
        break;
    }
}

void sim_op_discard(struct sim_op *op)
{
    if (op->kind == OP_MEMCPY) {
        free(op->u.cp.staged);
        op->u.cp.staged = NULL;
    } else if (op->kind == OP_EVENT) {
        sim_event_unref(op->u.ev.ev);
    }
    op->kind = OP_NOP;
}

static void *worker_main(void *arg)
{
    struct sim_ctx *c = arg;
    prctl(PR_SET_TIMERSLACK, 1UL); /* kernel durations to a few us, not the default 50 us slack */
    prctl(PR_SET_NAME, "simcuda-worker");
    int held = HELD_NONE; /* the device's turn, kept for the next item (exec_op) */
    pthread_mutex_lock(&c->qlock);
    for (;;) {
        while (c->done_seq == c->enq_seq && !c->stop) pthread_cond_wait(&c->nonempty, &c->qlock);
        if (c->done_seq == c->enq_seq) break; /* stopping and drained */
        uint64_t seq = c->done_seq + 1;
        struct sim_item it = c->ring[seq % SIM_QUEUE_LEN];
        pthread_mutex_unlock(&c->qlock);
        exec_op(c, &it.op, &held, seq);
        pthread_mutex_lock(&c->qlock);
        c->done_seq = seq;
        pthread_cond_broadcast(&c->done);
        pthread_cond_broadcast(&c->nonfull);
    }
    pthread_mutex_unlock(&c->qlock);
    if (held != HELD_NONE) sim_dev_release_counted(c->dev, held == HELD_FOR_EVENT);
    return NULL;
}

int sim_ctx_start(struct sim_ctx *c)
{
    pthread_mutex_lock(&c->qlock);
    int rc = 0;
    if (!c->ring) c->ring = calloc(SIM_QUEUE_LEN, sizeof *c->ring);
    if (!c->ring) {
        rc = -1;
    } else if (!c->worker_started) {
        c->stop = 0;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setstacksize(&a, 256 * 1024);
        rc = pthread_create(&c->worker, &a, worker_main, c);
        pthread_attr_destroy(&a);
        if (rc == 0) c->worker_started = 1;
    }
    pthread_mutex_unlock(&c->qlock);
    return rc;
}

void sim_ctx_stop(struct sim_ctx *c)
{
    pthread_mutex_lock(&c->qlock);
    if (!c->worker_started) {
        pthread_mutex_unlock(&c->qlock);
        return;
    }
    c->stop = 1;
    pthread_cond_broadcast(&c->nonempty);
    pthread_t w = c->worker;
    pthread_mutex_unlock(&c->qlock);
    pthread_join(w, NULL);
    pthread_mutex_lock(&c->qlock);
    c->worker_started = 0;
    c->stop = 0;
    pthread_cond_broadcast(&c->done);
    pthread_cond_broadcast(&c->nonfull); /* a launch blocked on a full queue fails now */
    pthread_mutex_unlock(&c->qlock);
}

uint64_t sim_enqueue(struct sim_stream *s, const struct sim_op *op)
{
    struct sim_ctx *c = s->ctx;
    pthread_mutex_lock(&c->qlock);
    while (c->enq_seq - c->done_seq >= SIM_QUEUE_LEN && c->worker_started)
        pthread_cond_wait(&c->nonfull, &c->qlock);
    if (!c->worker_started) {
        /* The context went away under us: the item is dropped, as a real
         * driver would fail it. */
        pthread_mutex_unlock(&c->qlock);
        struct sim_op tmp = *op;
        sim_op_discard(&tmp);
        return 0;
    }
    uint64_t seq = ++c->enq_seq;
    c->ring[seq % SIM_QUEUE_LEN].op = *op;
    c->ring[seq % SIM_QUEUE_LEN].seq = seq;
    s->last_seq = seq;
    pthread_cond_signal(&c->nonempty);
    pthread_mutex_unlock(&c->qlock);
    return seq;
}

CUresult sim_submit(struct sim_stream *s, const struct sim_op *op, uint64_t *seq_out)
{
    CUresult rc = sim_capture_legacy_use(s);
    if (rc) {
        struct sim_op tmp = *op;
        sim_op_discard(&tmp);
        return rc;
    }
    if (sim_capture_record(s, op, &rc)) return rc; /* consumed op */
    if (!__atomic_load_n(&s->ctx->active, __ATOMIC_ACQUIRE)) {
        struct sim_op tmp = *op;
        sim_op_discard(&tmp);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    uint64_t seq = sim_enqueue(s, op);
    if (seq_out) *seq_out = seq;
    return CUDA_SUCCESS;
}

void sim_wait_seq(struct sim_ctx *c, uint64_t seq)
{
    pthread_mutex_lock(&c->qlock);
    while (c->done_seq < seq && c->worker_started) pthread_cond_wait(&c->done, &c->qlock);
    pthread_mutex_unlock(&c->qlock);
}

int sim_seq_done(struct sim_ctx *c, uint64_t seq)
{
    pthread_mutex_lock(&c->qlock);
    int done = c->done_seq >= seq || !c->worker_started;
    pthread_mutex_unlock(&c->qlock);
    return done;
}

void sim_ctx_drain(struct sim_ctx *c)
{
    pthread_mutex_lock(&c->qlock);
    uint64_t target = c->enq_seq;
    while (c->done_seq < target && c->worker_started) pthread_cond_wait(&c->done, &c->qlock);
    pthread_mutex_unlock(&c->qlock);
}

/* ------------------------------------------------------------------ modules, libraries, functions */

struct sim_func {
    struct sim_module *mod;
    char *name;
    int work; /* gem_work: like gem_spin, dur_ns = iterations x 33 ns */
    int spin;
    struct sim_func *next;
};

struct sim_kern {
    struct sim_module *lib;
    char *name;
    struct sim_func *func; /* made by cuKernelGetFunction */
    struct sim_kern *next;
};

struct sim_module {
    int is_library;
    pthread_mutex_t lock;
    struct sim_func *funcs;
    struct sim_kern *kerns;
};

static struct sim_func *func_new(struct sim_module *m, const char *name)
{
    struct sim_func *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->name = strdup(name);
    if (!f->name) {
        free(f);
        return NULL;
    }
    f->mod = m;
    f->spin = strcmp(name, "gem_spin") == 0;
    f->work = strcmp(name, "gem_work") == 0; /* gem_work(out, iterations): runs like gem_spin, 33 ns each */
    f->next = m->funcs;
    m->funcs = f;
    sim_handle_add(f, H_FUNC);
    return f;
}

static CUresult module_new(CUmodule *out, const void *image, int is_library)
{
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    struct sim_module *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->is_library = is_library;
    pthread_mutex_init(&m->lock, NULL);
    sim_handle_add(m, is_library ? H_LIBRARY : H_MODULE);
    *out = (CUmodule)m;
    return CUDA_SUCCESS;
}

static void module_free(struct sim_module *m)
{
    sim_handle_del(m);
    pthread_mutex_lock(&m->lock);
    for (struct sim_func *f = m->funcs, *n; f; f = n) {
        n = f->next;
        sim_handle_del(f);
        free(f->name);
        free(f);
    }
    for (struct sim_kern *k = m->kerns, *n; k; k = n) {
        n = k->next;
        sim_handle_del(k);
        free(k->name);
        free(k);
    }
    pthread_mutex_unlock(&m->lock);
    free(m);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    return module_new(module, image, 0);
}

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                            void **optionValues)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (numOptions && (!options || !optionValues)) return CUDA_ERROR_INVALID_VALUE;
    return module_new(module, image, 0);
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    SIM_CHECK_INIT();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(hmod, H_MODULE)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_module *m = (struct sim_module *)hmod;
    pthread_mutex_lock(&m->lock);
    struct sim_func *f = m->funcs;
    while (f && strcmp(f->name, name) != 0) f = f->next;
    if (!f) f = func_new(m, name);
    pthread_mutex_unlock(&m->lock);
    if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule hmod)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(hmod, H_MODULE)) return CUDA_ERROR_INVALID_HANDLE;
    module_free((struct sim_module *)hmod);
    return CUDA_SUCCESS;
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                           unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                           void **libraryOptionValues, unsigned int numLibraryOptions)
{
    SIM_CHECK_INIT();
    return module_new((CUmodule *)library, code, 1);
}

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    SIM_CHECK_INIT();
    if (!pKernel || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(library, H_LIBRARY)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_module *m = (struct sim_module *)library;
    pthread_mutex_lock(&m->lock);
    struct sim_kern *k = m->kerns;
    while (k && strcmp(k->name, name) != 0) k = k->next;
    if (!k && (k = calloc(1, sizeof *k)) != NULL) {
        k->lib = m;
        k->name = strdup(name);
        k->func = k->name ? func_new(m, name) : NULL;
        if (!k->func) {
            free(k->name);
            free(k);
            k = NULL;
        } else {
            k->next = m->kerns;
            m->kerns = k;
            sim_handle_add(k, H_KERNEL);
        }
    }
    pthread_mutex_unlock(&m->lock);
    if (!k) return CUDA_ERROR_OUT_OF_MEMORY;
    *pKernel = (CUkernel)k;
    return CUDA_SUCCESS;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(kernel, H_KERNEL)) return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = (CUfunction)((struct sim_kern *)kernel)->func;
    return CUDA_SUCCESS;
}

CUresult cuLibraryUnload(CUlibrary library)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(library, H_LIBRARY)) return CUDA_ERROR_INVALID_HANDLE;
    module_free((struct sim_module *)library);
    return CUDA_SUCCESS;
}

/* A CUfunction, or (as CUDA 12 allows) a CUkernel passed as one. */
static struct sim_func *func_resolve(CUfunction f)
{
    if (sim_handle_is(f, H_FUNC)) return (struct sim_func *)f;
    if (sim_handle_is(f, H_KERNEL)) return ((struct sim_kern *)f)->func;
    return NULL;
}

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    SIM_CHECK_INIT();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!func_resolve(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
    switch (attrib) {
    case 0: *pi = 1024; break; /* MAX_THREADS_PER_BLOCK */
    case 4: *pi = 32; break;   /* NUM_REGS */
    case 5: *pi = 70; break;   /* PTX_VERSION */
    case 6: *pi = 90; break;   /* BINARY_VERSION */
    case 8: *pi = 49152; break; /* MAX_DYNAMIC_SHARED_SIZE_BYTES */
    default:
        if (attrib < 0 || attrib > 20) return CUDA_ERROR_INVALID_VALUE;
        *pi = 0;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ launches */

#define LAUNCH_PARAM_END ((void *)0x00)
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

/* gem_spin(CUdeviceptr out, uint64_t duration_ns), from kernelParams or extra. */
static CUresult spin_params(void **params, void **extra, uint64_t **out, uint64_t *dur)
{
    if (params) {
        if (!params[0] || !params[1]) return CUDA_ERROR_INVALID_VALUE;
        *out = (uint64_t *)(uintptr_t)*(CUdeviceptr *)params[0];
        *dur = *(uint64_t *)params[1];
        return CUDA_SUCCESS;
    }
    const char *buf = NULL;
    size_t size = 0;
    for (int i = 0; extra && extra[i] != LAUNCH_PARAM_END && i < 16; i += 2) {
        if (extra[i] == LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
        if (extra[i] == LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1]) size = *(size_t *)extra[i + 1];
    }
    if (!buf || size < 16) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr o;
    memcpy(&o, buf, sizeof o);
    memcpy(dur, buf + 8, sizeof *dur);
    *out = (uint64_t *)(uintptr_t)o;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shmem, CUstream h, void **params, void **extra, int ptsz, int coop)
{
    SIM_CHECK_INIT();
    struct sim_func *fn = func_resolve(f);
    if (!fn) return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz) return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)bx * by * bz > 1024 || bz > 64 || gy > 65535 || gz > 65535) return CUDA_ERROR_INVALID_VALUE;
    if (shmem > 232448) return CUDA_ERROR_INVALID_VALUE;
    if (params && extra) return CUDA_ERROR_INVALID_VALUE;
    if (coop && (uint64_t)gx * gy * gz > 132ull * 32) return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    struct sim_op op;
    memset(&op, 0, sizeof op);
    op.kind = OP_KERNEL;
    snprintf(op.u.k.name, sizeof op.u.k.name, "%s", fn->name);
    if (fn->spin || fn->work) {
        op.u.k.spin = 1;
        rc = spin_params(params, extra, &op.u.k.out, &op.u.k.dur_ns);
        if (rc) return rc;
        if (fn->work) op.u.k.dur_ns *= 33;
    }
    return sim_submit(s, &op, NULL);
}

CUresult cuLaunchKernel SIM_LAUNCH_PARAMS
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, extra, 0, 0);
}

CUresult cuLaunchKernel_ptsz SIM_LAUNCH_PARAMS
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, extra, 1, 0);
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra, int ptsz)
{
    SIM_CHECK_INIT();
    if (!config) return CUDA_ERROR_INVALID_VALUE;
    if (config->numAttrs && !config->attrs) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                  config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra, ptsz, 0);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    return launch_ex(config, f, kernelParams, extra, 1);
}

CUresult cuLaunchCooperativeKernel SIM_COOP_PARAMS
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, NULL, 0, 1);
}

CUresult cuLaunchCooperativeKernel_ptsz SIM_COOP_PARAMS
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                  kernelParams, NULL, 1, 1);
}

static CUresult host_func(CUstream h, CUhostFn fn, void *data, int ptsz)
{
    SIM_CHECK_INIT();
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    struct sim_op op = {.kind = OP_HOSTFN};
    op.u.host.fn = fn;
    op.u.host.data = data;
    return sim_submit(s, &op, NULL);
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) { return host_func(hStream, fn, userData, 0); }

/* Stream memory operations: only the wait for equality, on memory the host registered or allocated. */
static CUresult wait_value32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags, int ptsz)
{
    SIM_CHECK_INIT();
    if (sim_cfg.no_stream_memops) return CUDA_ERROR_NOT_SUPPORTED;
    if (!addr || (addr & 3) || flags != CU_STREAM_WAIT_VALUE_EQ) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    sim_spend_host(sim_cfg.wait_value_ns);
    struct sim_op op = {.kind = OP_WAIT_VALUE};
    op.u.wv.addr = (const volatile uint32_t *)(uintptr_t)addr;
    op.u.wv.value = value;
    return sim_submit(s, &op, NULL);
}

CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    return wait_value32(stream, addr, value, flags, 0);
}

CUresult cuStreamWaitValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    return wait_value32(stream, addr, value, flags, 1);
}

CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    return host_func(hStream, fn, userData, 1);
}
