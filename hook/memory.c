/*
 * memory.c -- memory accounting and limits.
 *
 * The pod manager owns the group's count; the hook asks it before every
 * allocation (MEM_ALLOC reserves the bytes, so concurrent allocations from
 * any process of the group can never together pass the limit), and returns
 * the bytes on free. When the driver's real size differs from the estimate
 * (pitch, arrays) the difference is reserved or returned afterwards; if the
 * extra is refused the allocation is rolled back. Pointers the hook did not
 * see allocated go to the driver untouched.
 *
 * Allocation is not a hot path (frameworks cache), so a round trip per
 * allocation is affordable; bench/alloc_cost.c measures it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client.h"
#include "device.h"
#include "gate.h"
#include "hook_exports.h"
#include "memory.h"
#include "real.h"
#include "rejoin.h"
#include "residency.h"
#include "settings.h"
#include "stats.h"

static int npools;
static atomic_int pools_in_use;

/* ---- the allocation table: (space, key) -> bytes, device ----------------------------------- */

enum alloc_space { SPACE_PTR = 1, SPACE_VMM = 2, SPACE_ARRAY = 3, SPACE_MIPMAP = 4 };

struct alloc_entry {
    uint64_t key;
    uint64_t bytes;
    int16_t space; /* 0 = empty, -1 = deleted */
    int16_t ordinal;
    int32_t kind;
    CUcontext ctx; /* current when it was allocated: destroying or resetting that context frees it */
};

static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc_entry *table;
static size_t table_cap, table_used, table_deleted;

static size_t slot_of(uint64_t key, int space, size_t cap) {
    uint64_t h = (key ^ ((uint64_t)space << 59)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 16) & (cap - 1);
}

static int table_grow(void) {
    size_t cap = table_cap ? table_cap * 2 : 1024;
    struct alloc_entry *t = calloc(cap, sizeof *t);
    if (!t)
        return -1;
    for (size_t i = 0; i < table_cap; i++) {
        if (table[i].space <= 0)
            continue;
        size_t j = slot_of(table[i].key, table[i].space, cap);
        while (t[j].space)
            j = (j + 1) & (cap - 1);
        t[j] = table[i];
    }
    free(table);
    table = t;
    table_cap = cap;
    table_deleted = 0;
    return 0;
}

static void track_entry(const struct alloc_entry *e) {
    pthread_mutex_lock(&table_mu);
    if ((table_used + table_deleted + 1) * 2 > table_cap && table_grow() != 0) {
        pthread_mutex_unlock(&table_mu);
        GEM_LOG(GEM_LOG_ERROR, "out of host memory for the allocation table; %llu bytes stay counted",
                (unsigned long long)e->bytes);
        return;
    }
    size_t i = slot_of(e->key, e->space, table_cap);
    while (table[i].space > 0)
        i = (i + 1) & (table_cap - 1);
    if (table[i].space < 0)
        table_deleted--;
    table[i] = *e;
    table_used++;
    pthread_mutex_unlock(&table_mu);
}

/* A new allocation, owned by the calling thread's current context. */
static void track(int space, uint64_t key, uint64_t bytes, int ordinal, int kind) {
    CUcontext ctx = NULL;
    if (HAVE_REAL(cuCtxGetCurrent))
        REAL(cuCtxGetCurrent)(&ctx);
    struct alloc_entry e = {key, bytes, (int16_t)space, (int16_t)ordinal, kind, ctx};
    track_entry(&e);
}

/* Remove and return an entry; 0 if the hook never saw this allocation. */
static int untrack(int space, uint64_t key, struct alloc_entry *out) {
    int found = 0;
    pthread_mutex_lock(&table_mu);
    if (table_cap) {
        size_t i = slot_of(key, space, table_cap);
        while (table[i].space) {
            if (table[i].space == space && table[i].key == key) {
                *out = table[i];
                table[i].space = -1;
                table_used--;
                table_deleted++;
                found = 1;
                break;
            }
            i = (i + 1) & (table_cap - 1);
        }
    }
    pthread_mutex_unlock(&table_mu);
    return found;
}

/* ---- talking to the pod manager ------------------------------------------------------------- */

/* Account this process's calls? Not when disabled, failing open, or before CUDA is initialised
 * (then the driver's own answer is NOT_INITIALIZED anyway). */
static int accounting(void) {
    if (gem_ensure_real() != 0 || gem_cfg.disabled || gem_fail_open_active())
        return 0;
    return gem_runtime_init() == 0;
}

#ifdef GEM_TEST_SETTINGS_FILE_ENV
/* The test build only: GEMINI_TEST_PAUSE_BEFORE_COUNT_MS holds a granted allocation back before it is counted,
 * so a test can reconnect the process in between (tests/test_hook_client.py). */
static void test_pause_before_count(void) {
    const char *v = getenv("GEMINI_TEST_PAUSE_BEFORE_COUNT_MS");
    long ms = v ? atol(v) : 0;
    if (ms > 0) {
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}
#else
static void test_pause_before_count(void) {}
#endif

/* How often a grant may come from a pod manager that a reconnect replaced before it was counted (each time the
 * allocation is asked for again, of the new one) before the allocation fails. */
#define RESERVE_TRIES 3

static CUresult reserve(struct gem_device *d, uint64_t bytes, int kind) {
    if (bytes == 0)
        return CUDA_SUCCESS;
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_MEM_ALLOC, 0);
    req.u.mem_request.bytes = bytes;
    req.u.mem_request.kind = (uint32_t)kind;
    uint64_t session = 0;
    int rc = gem_conn_call_reserving(&d->conn, &req, &reply, 10 * GEM_NS_PER_S, &session);
    for (int tries = 1; rc == GEM_CALL_OK && reply.hdr.type == GEM_MSG_MEM_REPLY &&
                        reply.u.mem_reply.verdict == GEM_MEM_OK; tries++) {
        test_pause_before_count();
        if (gem_conn_count_reserved(&d->conn, session, bytes)) {
            atomic_fetch_add(&gem_stats.mem_allocs, 1);
            gem_rejoin_start(); /* from now on a lost pod manager is told what this process holds */
            return CUDA_SUCCESS;
        }
        /* The pod manager that granted them is gone, and its successor's count, taken at the reconnect, leaves
         * them out: ask it (counted by nobody, the group could exceed its limit by them for good). */
        atomic_fetch_add(&gem_stats.mem_recounts, 1);
        if (tries == RESERVE_TRIES) {
            GEM_LOG(GEM_LOG_ERROR, "GPU %d: an allocation of %llu bytes was granted %d times by a pod manager that "
                    "was replaced before it was counted; this allocation fails", d->ordinal,
                    (unsigned long long)bytes, tries);
            return gem_unavailable_result();
        }
        rc = gem_conn_call_reserving(&d->conn, &req, &reply, 10 * GEM_NS_PER_S, &session);
    }
    if (rc == GEM_CALL_OK && reply.hdr.type == GEM_MSG_MEM_REPLY) {
        atomic_fetch_add(&gem_stats.mem_denied, 1);
        GEM_LOG(GEM_LOG_INFO, "GPU %d: allocation of %llu bytes refused: group '%s' uses %llu of %llu bytes",
                d->ordinal, (unsigned long long)bytes, d->conn.group, (unsigned long long)reply.u.mem_reply.used,
                (unsigned long long)reply.u.mem_reply.limit);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    atomic_fetch_add(&gem_stats.mem_errors, 1);
    if (rc == GEM_CALL_OK || rc == GEM_CALL_REFUSED)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d: the pod manager refused a memory request: %.*s", d->ordinal,
                GEM_ERRMSG_LEN, reply.hdr.type == GEM_MSG_ERROR ? reply.u.error.message : "unexpected reply");
    if (gem_cfg.fail_open && (rc == GEM_CALL_UNREACHABLE || rc == GEM_CALL_BROKEN)) {
        gem_enter_fail_open();
        return CUDA_SUCCESS;
    }
    return gem_unavailable_result();
}

static void unreserve(struct gem_device *d, uint64_t bytes, int kind) {
    if (bytes == 0)
        return;
    atomic_fetch_add(&gem_stats.mem_frees, 1);
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_MEM_FREE, 0);
    req.u.mem_request.bytes = bytes;
    req.u.mem_request.kind = (uint32_t)kind;
    /* Only to the pod manager that counts these bytes (client.h). If there is none, or the call fails, the pod
     * manager already dropped the process's count, and the next connection's HELLO carries mem_in_use, which no
     * longer includes them: sending the free on that new connection too would take them off twice. */
    gem_conn_call_freeing(&d->conn, &req, &reply, 10 * GEM_NS_PER_S, bytes);
}

/* The group's (used, limit); 0 if unknown. */
static int group_memory(struct gem_device *d, uint64_t *used, uint64_t *limit) {
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_MEM_INFO, 0);
    if (gem_conn_call(&d->conn, &req, &reply, 10 * GEM_NS_PER_S) == GEM_CALL_OK &&
        reply.hdr.type == GEM_MSG_MEM_REPLY) {
        *used = reply.u.mem_reply.used;
        *limit = reply.u.mem_reply.limit;
        return 1;
    }
    return 0;
}

/* Allocate through `call` with `estimate` bytes reserved first; the real size (if the
 * allocation reports one) replaces the estimate. Returns the CUresult of the whole. */
#define RESERVE_OR_RETURN(d, bytes, kind)                    \
    do {                                                     \
        CUresult reserve_rc_ = reserve((d), (bytes), (kind)); \
        if (reserve_rc_ != CUDA_SUCCESS)                     \
            return reserve_rc_;                              \
    } while (0)

/* The real size came out larger than the reservation: reserve the rest or undo. */
static int settle(struct gem_device *d, uint64_t reserved, uint64_t actual, int kind) {
    if (actual > reserved) {
        if (reserve(d, actual - reserved, kind) != CUDA_SUCCESS)
            return -1;
    } else if (actual < reserved) {
        unreserve(d, reserved - actual, kind);
    }
    return 0;
}

/* ---- plain allocations ------------------------------------------------------------------------ */

/* A unified group's allocation of any counted kind (plain, pitch, stream-ordered, pool): managed memory,
 * counted as such. `async`: it stands in for a stream-ordered one (freed through cuMemFreeAsync). */
static CUresult alloc_unified(struct gem_device *d, CUdeviceptr *dptr, size_t bytes, int async) {
    RESERVE_OR_RETURN(d, bytes, GEM_MEM_MANAGED);
    CUresult rc = gem_residency_alloc(d, dptr, bytes, async);
    if (rc != CUDA_SUCCESS) {
        unreserve(d, bytes, GEM_MEM_MANAGED);
        return rc;
    }
    track(SPACE_PTR, *dptr, bytes, d->ordinal, GEM_MEM_MANAGED);
    gem_gate_watch_residency(); /* answer evictions from now on, granted or not */
    return rc;
}

static CUresult alloc_plain(CUresult (*call)(CUdeviceptr *, size_t, void *, void *), CUdeviceptr *dptr,
                            size_t bytes, void *a, void *b, int kind) {
    if (!dptr || bytes == 0 || !accounting())
        return call(dptr, bytes, a, b);
    struct gem_device *d = gem_current_device();
    /* A unified group: the allocation is made as managed memory (residency.c moves it with the group). */
    int unified = gem_residency_unified(d);
    if (unified && kind != GEM_MEM_MANAGED)
        return alloc_unified(d, dptr, bytes, 0);
    RESERVE_OR_RETURN(d, bytes, kind);
    CUresult rc = call(dptr, bytes, a, b);
    if (rc != CUDA_SUCCESS) {
        unreserve(d, bytes, kind);
        return rc;
    }
    track(SPACE_PTR, *dptr, bytes, d->ordinal, kind);
    if (unified) {
        gem_residency_record(d, *dptr, bytes); /* the program's own managed memory moves with the group too */
        gem_gate_watch_residency();
    }
    return rc;
}

/* Adapters giving each driver call the (dptr, bytes, a, b) shape alloc_plain takes. */
static CUresult call_alloc(CUdeviceptr *p, size_t n, void *a, void *b) {
    (void)a, (void)b;
    return REAL(cuMemAlloc_v2)(p, n);
}
static CUresult call_managed(CUdeviceptr *p, size_t n, void *flags, void *b) {
    (void)b;
    return REAL(cuMemAllocManaged)(p, n, (unsigned int)(uintptr_t)flags);
}
#define NEED_REAL(name)                                                     \
    do {                                                                    \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))       \
            return CUDA_ERROR_NOT_INITIALIZED;                              \
    } while (0)

GEM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    NEED_REAL(cuMemAlloc_v2);
    return alloc_plain(call_alloc, dptr, bytesize, NULL, NULL, GEM_MEM_DEVICE);
}

GEM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    NEED_REAL(cuMemAllocManaged);
    return alloc_plain(call_managed, dptr, bytesize, (void *)(uintptr_t)flags, NULL, GEM_MEM_MANAGED);
}

/* ---- stream-ordered allocations: counted by what the pool reserves ----------------------------
 *
 * A memory pool keeps freed blocks reserved (up to its release threshold; CuPy's MemoryAsyncPool keeps
 * everything), so the device memory a process holds is the pools' reservation, not its live
 * allocations. Each allocation reserves an estimate with the pod manager, reads how far the pool really
 * grew and settles on that; frees change nothing until the pool gives memory back (a trim, a sync point
 * with a low release threshold, destroying the pool), which the hook notices at the next allocation,
 * trim or synchronisation and returns to the group. Pooled allocations of a process are serialised so
 * that the before/after readings of a pool are its own.
 */

#define POOL_GRANULE (2ull << 20) /* pools grow by whole 2 MiB pages at least */
#define MAX_POOLS 64
struct pool_acct {
    CUmemoryPool pool;
    int ordinal;
    uint64_t counted; /* bytes of this pool's reservation the group is charged for */
};
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pool_acct pools[MAX_POOLS];

static uint64_t pool_reserved(CUmemoryPool pool, int *ok) {
    cuuint64_t v = 0;
    *ok = HAVE_REAL(cuMemPoolGetAttribute) &&
          REAL(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) == CUDA_SUCCESS;
    return v;
}

static struct pool_acct *pool_entry(CUmemoryPool pool, int ordinal, int create) {
    for (int i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            return &pools[i];
    if (!create || npools == MAX_POOLS)
        return NULL;
    pools[npools] = (struct pool_acct){pool, ordinal, 0};
    atomic_store(&pools_in_use, 1);
    return &pools[npools++];
}

/* The pool gave memory back: return it to the group. Called with pool_mu held. */
static void pool_reconcile(struct pool_acct *a) {
    int ok;
    uint64_t reserved = pool_reserved(a->pool, &ok);
    struct gem_device *d = gem_device_by_ordinal(a->ordinal);
    if (ok && reserved < a->counted && d) {
        unreserve(d, a->counted - reserved, GEM_MEM_ASYNC);
        a->counted = reserved;
    }
}

void gem_memory_on_sync(void) {
    if (!atomic_load_explicit(&pools_in_use, memory_order_relaxed))
        return;
    if (pthread_mutex_trylock(&pool_mu) != 0)
        return; /* an allocation is settling its pool right now; the next sync looks again */
    for (int i = 0; i < npools; i++)
        pool_reconcile(&pools[i]);
    pthread_mutex_unlock(&pool_mu);
}

/* A pool the table has no room for is still the caller's pool: its blocks are counted one by one, as
 * when a pool's reservation cannot be read. Said once, loudly: the group is then charged by the block,
 * not by what the pool keeps reserved. */
static void pool_table_full(CUmemoryPool pool) {
    static atomic_int said;
    if (!atomic_exchange(&said, 1))
        GEM_LOG(GEM_LOG_WARN, "the process uses more than %d memory pools: pool %p and any later one are "
                "charged block by block, not by their reservation", MAX_POOLS, (void *)pool);
}

/* A stream-ordered allocation, made as the caller asked: from `pool` (from_pool: cuMemAllocFromPoolAsync)
 * or from the device's current pool (cuMemAllocAsync; `pool` is NULL). */
static CUresult alloc_pooled(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, int from_pool, CUstream stream,
                             int ptsz) {
    struct gem_device *d = gem_current_device();
    CUmemoryPool read = pool; /* the pool whose reservation grows */
    if (!from_pool && (!HAVE_REAL(cuDeviceGetMemPool) || REAL(cuDeviceGetMemPool)(&read, d->cudev) != CUDA_SUCCESS))
        read = NULL;
    int ok = 0;
    pthread_mutex_lock(&pool_mu);
    struct pool_acct *a = read ? pool_entry(read, d->ordinal, 1) : NULL;
    if (read && !a)
        pool_table_full(read);
    uint64_t before = a ? pool_reserved(read, &ok) : 0;
    if (a && ok && before < a->counted) {
        unreserve(d, a->counted - before, GEM_MEM_ASYNC); /* given back since we last looked */
        a->counted = before;
    }
    uint64_t estimate = ((uint64_t)bytes + POOL_GRANULE - 1) / POOL_GRANULE * POOL_GRANULE;
    CUresult rc = reserve(d, estimate, GEM_MEM_ASYNC);
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&pool_mu);
        return rc;
    }
    if (from_pool)
        rc = ptsz ? REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytes, pool, stream)
                  : REAL(cuMemAllocFromPoolAsync)(dptr, bytes, pool, stream);
    else
        rc = ptsz ? REAL(cuMemAllocAsync_ptsz)(dptr, bytes, stream) : REAL(cuMemAllocAsync)(dptr, bytes, stream);
    if (rc != CUDA_SUCCESS || !a || !ok) {
        if (rc != CUDA_SUCCESS)
            unreserve(d, estimate, GEM_MEM_ASYNC);
        else
            track(SPACE_PTR, *dptr, estimate, d->ordinal, GEM_MEM_ASYNC); /* no pool to read: count the block */
        pthread_mutex_unlock(&pool_mu);
        return rc;
    }
    int ok_after;
    uint64_t after = pool_reserved(read, &ok_after);
    uint64_t growth = ok_after && after > before ? after - before : 0;
    if (settle(d, estimate, growth, GEM_MEM_ASYNC) != 0) {
        /* the pool grew past what the group may hold: undo the allocation and give the growth back */
        if (ptsz)
            REAL(cuMemFreeAsync_ptsz)(*dptr, stream);
        else
            REAL(cuMemFreeAsync)(*dptr, stream);
        if (HAVE_REAL(cuStreamSynchronize))
            REAL(cuStreamSynchronize)(stream);
        REAL(cuMemPoolTrimTo)(read, (size_t)before);
        unreserve(d, estimate, GEM_MEM_ASYNC);
        atomic_fetch_add(&gem_stats.mem_rollbacks, 1);
        *dptr = 0;
        pthread_mutex_unlock(&pool_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->counted += growth;
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}

/* The four stream-ordered allocation entry points, generated from the table's ALLOC_ASYNC rows (the
 * device's current pool) and ALLOC_FROM_POOL rows (the pool in the `extra` column). Calls the hook does
 * not account (no pointer, no bytes, not accounting, no pool given) go to the driver as they are. */
#define GEM_MEM_ALLOC_ASYNC(kind, lib, ret, name, since, pt, params, args, extra)        \
    GEM_EXPORT CUresult name params {                                                  \
        NEED_REAL(name);                                                               \
        if (!dptr || bytesize == 0 || !accounting())                                   \
            return REAL(name) args;                                                    \
        if (gem_residency_unified(gem_current_device()))                              \
            return alloc_unified(gem_current_device(), dptr, bytesize, 1);             \
        return alloc_pooled(dptr, bytesize, NULL, 0, hStream, pt);                     \
    }
#define GEM_MEM_ALLOC_FROM_POOL(kind, lib, ret, name, since, pt, params, args, pool)    \
    GEM_EXPORT CUresult name params {                                                  \
        NEED_REAL(name);                                                               \
        if (!dptr || !(pool) || bytesize == 0 || !accounting())                        \
            return REAL(name) args;                                                    \
        if (gem_residency_unified(gem_current_device()))                              \
            return alloc_unified(gem_current_device(), dptr, bytesize, 1);             \
        return alloc_pooled(dptr, bytesize, (pool), 1, hStream, pt);                   \
    }
#define GEM_MEM_NOTHING(...)
#define GEM_MEM_LAUNCH GEM_MEM_NOTHING
#define GEM_MEM_GRAPH_LAUNCH GEM_MEM_NOTHING
#define GEM_MEM_SYNC GEM_MEM_NOTHING
#define GEM_MEM_CAPTURE_BEGIN GEM_MEM_NOTHING
#define GEM_MEM_CAPTURE_END GEM_MEM_NOTHING
#define GEM_MEM_CUSTOM GEM_MEM_NOTHING
#define GEM_MEM_REAL GEM_MEM_NOTHING
#define GEM_MEM_ROW(kind, ...) GEM_MEM_##kind(kind, __VA_ARGS__)
GEM_HOOK_TABLE(GEM_MEM_ROW)

GEM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t widthInBytes, size_t height,
                                       unsigned int elementSizeBytes) {
    NEED_REAL(cuMemAllocPitch_v2);
    if (!dptr || !pPitch || widthInBytes == 0 || height == 0 || !accounting())
        return REAL(cuMemAllocPitch_v2)(dptr, pPitch, widthInBytes, height, elementSizeBytes);
    struct gem_device *d = gem_current_device();
    /* 512-byte rows: the driver's alignment at most. A size that does not fit 64 bits is no allocation: wrapped, a
     * unified group's was a small one with a pitch past its end (the driver refuses such a call). */
    uint64_t pitch, estimate;
    if (__builtin_add_overflow((uint64_t)widthInBytes, 511u, &pitch) ||
        __builtin_mul_overflow(pitch / 512 * 512, (uint64_t)height, &estimate))
        return CUDA_ERROR_INVALID_VALUE;
    pitch = pitch / 512 * 512;
    if (gem_residency_unified(d)) { /* managed memory has no pitch of its own: the driver's 512-byte rows */
        CUresult urc = alloc_unified(d, dptr, estimate, 0);
        if (urc == CUDA_SUCCESS)
            *pPitch = pitch;
        return urc;
    }
    /* Drivers align the pitch to 512 bytes or less; the real pitch settles the difference. */
    RESERVE_OR_RETURN(d, estimate, GEM_MEM_DEVICE);
    CUresult rc = REAL(cuMemAllocPitch_v2)(dptr, pPitch, widthInBytes, height, elementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        unreserve(d, estimate, GEM_MEM_DEVICE);
        return rc;
    }
    uint64_t actual = (uint64_t)*pPitch * (uint64_t)height;
    if (settle(d, estimate, actual, GEM_MEM_DEVICE) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        unreserve(d, estimate, GEM_MEM_DEVICE);
        atomic_fetch_add(&gem_stats.mem_rollbacks, 1);
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(SPACE_PTR, *dptr, actual, d->ordinal, GEM_MEM_DEVICE);
    return rc;
}

/* ---- frees ------------------------------------------------------------------------------------ */

static CUresult free_tracked(int space, uint64_t key, CUresult rc_of_real, int have_entry,
                             const struct alloc_entry *e) {
    if (!have_entry)
        return rc_of_real;
    struct gem_device *d = gem_device_by_ordinal(e->ordinal);
    if (rc_of_real == CUDA_SUCCESS) {
        if (d)
            unreserve(d, e->bytes, e->kind);
    } else {
        track_entry(e); /* still allocated */
    }
    return rc_of_real;
}

GEM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NEED_REAL(cuMemFree_v2);
    struct alloc_entry e;
    int have = dptr && untrack(SPACE_PTR, dptr, &e);
    if (have && e.kind == GEM_MEM_MANAGED)
        gem_residency_forget(dptr);
    return free_tracked(SPACE_PTR, dptr, REAL(cuMemFree_v2)(dptr), have, &e);
}

GEM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    NEED_REAL(cuMemFreeAsync);
    struct alloc_entry e;
    int have = dptr && untrack(SPACE_PTR, dptr, &e);
    if (have && e.kind == GEM_MEM_MANAGED && gem_residency_forget(dptr) == 2) /* a unified group's stand-in */
        return free_tracked(SPACE_PTR, dptr, gem_residency_free_async(dptr, hStream, 0), have, &e);
    return free_tracked(SPACE_PTR, dptr, REAL(cuMemFreeAsync)(dptr, hStream), have, &e);
}

GEM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    NEED_REAL(cuMemFreeAsync_ptsz);
    struct alloc_entry e;
    int have = dptr && untrack(SPACE_PTR, dptr, &e);
    if (have && e.kind == GEM_MEM_MANAGED && gem_residency_forget(dptr) == 2) /* a unified group's stand-in */
        return free_tracked(SPACE_PTR, dptr, gem_residency_free_async(dptr, hStream, 1), have, &e);
    return free_tracked(SPACE_PTR, dptr, REAL(cuMemFreeAsync_ptsz)(dptr, hStream), have, &e);
}

GEM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    NEED_REAL(cuMemPoolTrimTo);
    CUresult rc = REAL(cuMemPoolTrimTo)(pool, minBytesToKeep);
    if (rc == CUDA_SUCCESS && accounting()) {
        pthread_mutex_lock(&pool_mu);
        struct pool_acct *a = pool_entry(pool, 0, 0);
        if (a)
            pool_reconcile(a);
        pthread_mutex_unlock(&pool_mu);
    }
    return rc;
}

GEM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    NEED_REAL(cuMemPoolDestroy);
    CUresult rc = REAL(cuMemPoolDestroy)(pool);
    if (rc == CUDA_SUCCESS && accounting()) {
        /* Destroying a pool frees its reservation once its blocks are freed: stop counting it. */
        pthread_mutex_lock(&pool_mu);
        struct pool_acct *a = pool_entry(pool, 0, 0);
        if (a) {
            struct gem_device *d = gem_device_by_ordinal(a->ordinal);
            if (d)
                unreserve(d, a->counted, GEM_MEM_ASYNC);
            *a = pools[--npools];
        }
        pthread_mutex_unlock(&pool_mu);
    }
    return rc;
}

/* ---- arrays ----------------------------------------------------------------------------------- */

static uint64_t format_bytes(CUarray_format f) {
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    default:
        return 4; /* an estimate: the driver's memory requirements settle it */
    }
}

/* Real drivers place arrays in 2 MiB units and answer cuArrayGetMemoryRequirements only for
 * deferred-mapping arrays, so the estimate is rounded up to that unit and usually final. */
#define ARRAY_GRANULE (2ull << 20)
static uint64_t array_estimate(size_t w, size_t h, size_t depth, CUarray_format f, unsigned channels) {
    uint64_t bytes = (uint64_t)w * (h ? h : 1) * (depth ? depth : 1) * (channels ? channels : 1) * format_bytes(f);
    return (bytes + ARRAY_GRANULE - 1) / ARRAY_GRANULE * ARRAY_GRANULE;
}

/* Reserve, create, then settle on the size the driver reports. */
static CUresult array_finish(struct gem_device *d, int space, uint64_t key, uint64_t estimate, uint64_t actual,
                             CUresult (*destroy)(uint64_t)) {
    if (settle(d, estimate, actual, GEM_MEM_DEVICE) != 0) {
        destroy(key);
        unreserve(d, estimate, GEM_MEM_DEVICE);
        atomic_fetch_add(&gem_stats.mem_rollbacks, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(space, key, actual, d->ordinal, GEM_MEM_DEVICE);
    return CUDA_SUCCESS;
}

static CUresult destroy_array(uint64_t key) { return REAL(cuArrayDestroy)((CUarray)(uintptr_t)key); }
static CUresult destroy_mipmap(uint64_t key) {
    return REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)key);
}

static uint64_t array_actual(CUarray arr, struct gem_device *d, uint64_t estimate) {
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof req);
    if (HAVE_REAL(cuArrayGetMemoryRequirements) &&
        REAL(cuArrayGetMemoryRequirements)(&req, arr, d->cudev) == CUDA_SUCCESS && req.size > 0)
        return req.size;
    return estimate;
}

/* Adapters so both array kinds go through create_array. */
static CUresult create_2d(CUarray *p, const void *desc) { return REAL(cuArrayCreate_v2)(p, desc); }
static CUresult create_3d(CUarray *p, const void *desc) { return REAL(cuArray3DCreate_v2)(p, desc); }

static CUresult create_array(CUarray *pHandle, const void *desc, uint64_t estimate,
                             CUresult (*create)(CUarray *, const void *)) {
    struct gem_device *d = gem_current_device();
    RESERVE_OR_RETURN(d, estimate, GEM_MEM_DEVICE);
    CUresult rc = create(pHandle, desc);
    if (rc != CUDA_SUCCESS) {
        unreserve(d, estimate, GEM_MEM_DEVICE);
        return rc;
    }
    uint64_t key = (uint64_t)(uintptr_t)*pHandle;
    rc = array_finish(d, SPACE_ARRAY, key, estimate, array_actual(*pHandle, d, estimate), destroy_array);
    if (rc != CUDA_SUCCESS)
        *pHandle = NULL;
    return rc;
}

GEM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    NEED_REAL(cuArrayCreate_v2);
    if (!pHandle || !desc || !accounting())
        return REAL(cuArrayCreate_v2)(pHandle, desc);
    return create_array(pHandle, desc, array_estimate(desc->Width, desc->Height, 1, desc->Format,
                                                      desc->NumChannels), create_2d);
}

GEM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    NEED_REAL(cuArray3DCreate_v2);
    if (!pHandle || !desc || !accounting())
        return REAL(cuArray3DCreate_v2)(pHandle, desc);
    return create_array(pHandle, desc, array_estimate(desc->Width, desc->Height, desc->Depth, desc->Format,
                                                      desc->NumChannels), create_3d);
}

GEM_EXPORT CUresult cuArrayDestroy(CUarray hArray) {
    NEED_REAL(cuArrayDestroy);
    struct alloc_entry e;
    uint64_t key = (uint64_t)(uintptr_t)hArray;
    int have = hArray && untrack(SPACE_ARRAY, key, &e);
    return free_tracked(SPACE_ARRAY, key, REAL(cuArrayDestroy)(hArray), have, &e);
}

GEM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                           unsigned int numLevels) {
    NEED_REAL(cuMipmappedArrayCreate);
    if (!pHandle || !desc || !accounting())
        return REAL(cuMipmappedArrayCreate)(pHandle, desc, numLevels);
    struct gem_device *d = gem_current_device();
    /* every level at most halves each side: twice the base level bounds the whole chain */
    uint64_t estimate = 2 * array_estimate(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels);
    RESERVE_OR_RETURN(d, estimate, GEM_MEM_DEVICE);
    CUresult rc = REAL(cuMipmappedArrayCreate)(pHandle, desc, numLevels);
    if (rc != CUDA_SUCCESS) {
        unreserve(d, estimate, GEM_MEM_DEVICE);
        return rc;
    }
    uint64_t actual = estimate;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof req);
    if (HAVE_REAL(cuMipmappedArrayGetMemoryRequirements) &&
        REAL(cuMipmappedArrayGetMemoryRequirements)(&req, *pHandle, d->cudev) == CUDA_SUCCESS && req.size > 0)
        actual = req.size;
    uint64_t key = (uint64_t)(uintptr_t)*pHandle;
    rc = array_finish(d, SPACE_MIPMAP, key, estimate, actual, destroy_mipmap);
    if (rc != CUDA_SUCCESS)
        *pHandle = NULL;
    return rc;
}

GEM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    NEED_REAL(cuMipmappedArrayDestroy);
    struct alloc_entry e;
    uint64_t key = (uint64_t)(uintptr_t)hMipmappedArray;
    int have = hMipmappedArray && untrack(SPACE_MIPMAP, key, &e);
    return free_tracked(SPACE_MIPMAP, key, REAL(cuMipmappedArrayDestroy)(hMipmappedArray), have, &e);
}

/* ---- what the program sees: the group's limit as the size of the GPU ------------------------------ */

static void clamp_to_group(struct gem_device *d, size_t *free_bytes, size_t *total_bytes) {
    uint64_t used = 0, limit = 0;
    if (!group_memory(d, &used, &limit) || limit == 0)
        return;
    if (total_bytes && *total_bytes > limit)
        *total_bytes = (size_t)limit;
    if (free_bytes) {
        uint64_t left = limit > used ? limit - used : 0;
        if (*free_bytes > left)
            *free_bytes = (size_t)left;
    }
}

GEM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    NEED_REAL(cuMemGetInfo_v2);
    CUresult rc = REAL(cuMemGetInfo_v2)(free_bytes, total_bytes);
    if (rc == CUDA_SUCCESS && accounting())
        clamp_to_group(gem_current_device(), free_bytes, total_bytes);
    return rc;
}

GEM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    NEED_REAL(cuDeviceTotalMem_v2);
    CUresult rc = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (rc == CUDA_SUCCESS && bytes && accounting()) {
        struct gem_device *d = gem_device_by_ordinal(dev);
        if (d)
            clamp_to_group(d, NULL, bytes);
    }
    return rc;
}

/* ---- for the other allocation modules (vmm.c) and context teardown (context.c) ------------------ */

int gem_memory_accounting(void) { return accounting(); }

CUresult gem_memory_reserve(struct gem_device *d, uint64_t bytes, int kind) { return reserve(d, bytes, kind); }

void gem_memory_unreserve(struct gem_device *d, uint64_t bytes, int kind) { unreserve(d, bytes, kind); }

/* The driver freed everything `ctx` held (cuCtxDestroy, a primary context reset or its last release): its
 * allocations leave the table and go back to the group. Stream-ordered blocks are the pools' business: a
 * pool's reservation is read again (what the context's teardown gave back is returned), as at a sync. */
void gem_memory_context_gone(CUcontext ctx) {
    if (!ctx)
        return;
    uint64_t freed[GEM_MAX_DEVICES][4];
    memset(freed, 0, sizeof freed);
    size_t count = 0;
    pthread_mutex_lock(&table_mu);
    for (size_t i = 0; i < table_cap; i++) {
        struct alloc_entry *e = &table[i];
        if (e->space <= 0 || e->ctx != ctx || e->kind == GEM_MEM_ASYNC)
            continue;
        if (e->ordinal >= 0 && e->ordinal < GEM_MAX_DEVICES && e->kind >= 0 && e->kind < 4)
            freed[e->ordinal][e->kind] += e->bytes;
        if (e->kind == GEM_MEM_MANAGED && e->space == SPACE_PTR)
            gem_residency_forget((CUdeviceptr)e->key); /* its own lock, never held while taking table_mu */
        e->space = -1;
        table_used--;
        table_deleted++;
        count++;
    }
    pthread_mutex_unlock(&table_mu);
    for (int dev = 0; dev < GEM_MAX_DEVICES; dev++)
        for (int kind = 0; kind < 4; kind++) {
            struct gem_device *d = freed[dev][kind] ? gem_device_by_ordinal(dev) : NULL;
            if (d)
                unreserve(d, freed[dev][kind], kind);
        }
    if (count)
        GEM_LOG(GEM_LOG_DEBUG, "context %p is gone: %zu allocations of it given back", (void *)ctx, count);
    if (atomic_load(&pools_in_use)) {
        pthread_mutex_lock(&pool_mu);
        for (int i = 0; i < npools; i++)
            pool_reconcile(&pools[i]);
        pthread_mutex_unlock(&pool_mu);
    }
}

/* ---- fork -------------------------------------------------------------------------------------- */

void gem_memory_after_fork(void) {
    /* the parent's allocations are not the child's */
    pthread_mutex_init(&table_mu, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    npools = 0;
    atomic_store(&pools_in_use, 0);
    if (table)
        memset(table, 0, table_cap * sizeof *table);
    table_used = table_deleted = 0;
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < count; i++)
        gem_devices[i].mem_in_use = 0;
}
