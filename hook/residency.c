/*
 * residency.c -- unified groups: the process's managed allocations, moved to the GPU at a grant and to the
 * host when the pod manager asks.
 *
 * Why explicit moves: with managed memory alone, a job whose pages were pushed out by its neighbours would
 * fault them back one by one while it holds the GPU (nvshare's 30 s slices exist because refaulting takes
 * seconds). Here the pages move in bulk with cuMemPrefetchAsync, when gem-schd says: the group about to
 * run prefetches everything to the GPU before its first kernel; a group gem-schd chose to evict (the least
 * recently run, when the groups' memory would not fit the GPU's configured capacity) prefetches everything
 * to the host and says so (GEM_MSG_RESIDENCY), and only then does the next holder's grant go out.
 *
 * cuMemPrefetchAsync has two ABIs: (dptr, count, CUdevice, stream) until CUDA 12.x, and _v2 (dptr, count,
 * CUmemLocation, flags, stream), which the name means from CUDA 13 (cuda.h maps it; driver 580 answers
 * cuGetProcAddress("cuMemPrefetchAsync", 12080+) with _v2). The hook asks the driver which one the name
 * means for its own version and calls exactly that one: calling the old signature where the driver meant
 * _v2 would pass a CUmemLocation as a device number.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "board.h"
#include "client.h"
#include "device.h"
#include "real.h"
#include "residency.h"
#include "settings.h"
#include "util.h"

struct managed_entry {
    CUdeviceptr ptr;
    uint64_t bytes;
    uint64_t seq;       /* when it was recorded (record_seq): a move knows what was recorded while it ran */
    int16_t ordinal;
    int16_t async;      /* stands in for a stream-ordered allocation */
};

struct residency_dev {
    uint64_t managed;           /* bytes recorded on this device */
    uint64_t resident;          /* of which on the GPU (as far as the hook moved them) */
    int on_gpu;                 /* the last move was to the GPU: what is allocated from now on is first touched
                                 * there, so counted resident (else an eviction reported only what the grant's
                                 * prefetch had moved: 2.4 of 14.6 GB on an H100, and gem-schd took the host
                                 * link for 0.5 GB/s) */
    uint64_t handled_evict;     /* the last evict_seq answered */
    int armed;                  /* handled_evict starts from the board's evict_seq when the process first
                                 * allocates (older requests were not for its memory) */
    CUcontext alloc_ctx;        /* the context of the last recorded allocation: where a process that was never
                                 * granted the GPU (so has no gate context) moves its memory from */
    CUstream stream;            /* the hook's own stream for moves, in stream_ctx */
    CUcontext stream_ctx;
    int support;                /* 0 unknown, 1 concurrent managed access, -1 none */
    uint64_t hold_ticket;       /* an eviction held for the delegate (0: none); the watcher's alone */
    int64_t hold_since;
    const struct gem_board *board_seen;  /* the page handled_evict counts on (both under mu) */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct managed_entry *entries;
static size_t nentries, capentries;
static uint64_t record_seq;     /* entries recorded so far (under mu) */
static struct residency_dev devs[GEM_MAX_DEVICES];
static pthread_mutex_t move_mu = PTHREAD_MUTEX_INITIALIZER; /* one move at a time */

/* The device's board. Eviction numbers are a gem-schd's own, and a new gem-schd (a new page, which the process
 * follows: device.c) counts from 1 again: what the process answered on the old page says nothing of the new
 * one. (A request on it from before the move is then answered, perhaps needlessly: the next grant brings the
 * memory back.) */
static const struct gem_board *board_of(struct gem_device *d, int32_t *slot) { /* with mu held */
    const struct gem_board *b = gem_device_board(d, slot);
    struct residency_dev *r = &devs[d->ordinal];
    if (b && r->board_seen && b != r->board_seen)
        __atomic_store_n(&r->handled_evict, 0, __ATOMIC_RELEASE);
    if (b)
        r->board_seen = b;
    return b;
}

enum { ABI_UNKNOWN = 0, ABI_OLD = 1, ABI_V2 = 2, ABI_NONE = -1 };
static int prefetch_abi;
static void *prefetch_fn;

/* ---- which cuMemPrefetchAsync ---------------------------------------------------------------- */

/* The pointer the driver gives for "cuMemPrefetchAsync" at its own version decides the ABI: the exported
 * _v2 or old symbol by address; a pointer that is neither (an internal entry) by the version it answered
 * for, as the driver's naming does (_v2 from 12020). Called with mu held. */
static void resolve_prefetch(void) {
    if (prefetch_abi != ABI_UNKNOWN)
        return;
    int version = 0;
    if (!HAVE_REAL(cuDriverGetVersion) || REAL(cuDriverGetVersion)(&version) != CUDA_SUCCESS)
        version = 0;
    void *fn = NULL;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    if (version > 0 && HAVE_REAL(cuGetProcAddress_v2)) {
        CUdriverProcAddressQueryResult status;
        rc = REAL(cuGetProcAddress_v2)("cuMemPrefetchAsync", &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    } else if (version > 0 && HAVE_REAL(cuGetProcAddress)) {
        rc = REAL(cuGetProcAddress)("cuMemPrefetchAsync", &fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
    }
    if (rc != CUDA_SUCCESS || !fn) {
        /* No cuGetProcAddress: the exported names, newest first, as a program linked against this driver's
         * cuda.h would call them. */
        fn = version >= 12020 && HAVE_REAL(cuMemPrefetchAsync_v2) ? gem_real_fn[GEM_IDX_cuMemPrefetchAsync_v2]
                                                                    : gem_real_fn[GEM_IDX_cuMemPrefetchAsync];
    }
    if (!fn)
        prefetch_abi = ABI_NONE;
    else if (fn == gem_real_fn[GEM_IDX_cuMemPrefetchAsync_v2])
        prefetch_abi = ABI_V2;
    else if (fn == gem_real_fn[GEM_IDX_cuMemPrefetchAsync])
        prefetch_abi = ABI_OLD;
    else
        prefetch_abi = version >= 12020 ? ABI_V2 : ABI_OLD;
    prefetch_fn = fn;
    if (prefetch_abi == ABI_NONE)
        GEM_LOG(GEM_LOG_ERROR, "the driver has no cuMemPrefetchAsync: a unified group's memory cannot be moved "
                "(it stays where the driver's page faults put it)");
    else
        GEM_LOG(GEM_LOG_DEBUG, "driver %d: cuMemPrefetchAsync is the %s ABI", version,
                prefetch_abi == ABI_V2 ? "_v2 (CUmemLocation)" : "old (CUdevice)");
}

typedef CUresult prefetch_old_t(CUdeviceptr, size_t, CUdevice, CUstream);
typedef CUresult prefetch_v2_t(CUdeviceptr, size_t, CUmemLocation, unsigned int, CUstream);

/* to_device: the device ordinal `cudev`; else the host. */
static CUresult prefetch(CUdeviceptr p, size_t n, int to_device, CUdevice cudev, CUstream s) {
    if (prefetch_abi == ABI_V2) {
        CUmemLocation loc = {to_device ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST,
                             to_device ? (int)cudev : 0};
        return ((prefetch_v2_t *)prefetch_fn)(p, n, loc, 0, s);
    }
    if (prefetch_abi == ABI_OLD)
        return ((prefetch_old_t *)prefetch_fn)(p, n, to_device ? cudev : CU_DEVICE_CPU, s);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---- the mode and the device's support --------------------------------------------------------- */

int gem_residency_unified(struct gem_device *d) {
    if (!d)
        return 0;
    if (!__atomic_load_n(&d->conn.ever_connected, __ATOMIC_ACQUIRE)) {
        /* The mode comes with the handshake: make one (a MEM_INFO round trip) before the first allocation. */
        struct gem_msg req, reply;
        gemhook_msg_init(&req, GEM_MSG_MEM_INFO, 0);
        gem_conn_call(&d->conn, &req, &reply, 10 * GEM_NS_PER_S);
    }
    if (!(__atomic_load_n(&d->conn.ack_flags, __ATOMIC_ACQUIRE) & GEM_ACK_UNIFIED))
        return 0;
    /* Before the first allocation is counted (memory.c reserves after asking here): every eviction request
     * from now on may wait for this process's memory, and the watcher answers it even before a grant; the ones
     * before were made when the pod manager counted nothing of it. */
    struct residency_dev *r = &devs[d->ordinal];
    pthread_mutex_lock(&mu);
    if (!r->armed) {
        int32_t slot;
        const struct gem_board *b = board_of(d, &slot);
        uint64_t seq = b && slot >= 0 ? gemhook_board_evict_seq(b, (uint32_t)slot) : 0;
        if (seq > r->handled_evict)
            __atomic_store_n(&r->handled_evict, seq, __ATOMIC_RELEASE);
        r->armed = 1;
    }
    pthread_mutex_unlock(&mu);
    return 1;
}

/* Managed memory that can live on the GPU and be moved there needs concurrent managed access; without it
 * (Windows, WSL, pre-Pascal GPUs) the group is refused rather than run somewhere it cannot be swapped. */
static int device_supported(struct gem_device *d) {
    struct residency_dev *r = &devs[d->ordinal];
    int support = __atomic_load_n(&r->support, __ATOMIC_ACQUIRE);
    if (support != 0)
        return support > 0;
    int v = 0;
    if (!HAVE_REAL(cuDeviceGetAttribute) ||
        REAL(cuDeviceGetAttribute)(&v, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, d->cudev) != CUDA_SUCCESS)
        v = 0;
    support = v ? 1 : -1;
    if (support < 0)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d has no concurrent managed access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_"
                "ACCESS is 0): group '%s' is MemoryMode = unified, which needs it; its allocations are refused "
                "(CUDA_ERROR_NOT_SUPPORTED). Use MemoryMode = device on this GPU", d->ordinal, d->conn.group);
    __atomic_store_n(&r->support, support, __ATOMIC_RELEASE);
    return support > 0;
}

/* ---- the record ------------------------------------------------------------------------------- */

static void record(struct gem_device *d, CUdeviceptr p, uint64_t bytes, int async) {
    CUcontext ctx = NULL;
    if (HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS)
        ctx = NULL;
    pthread_mutex_lock(&mu);
    if (ctx)
        devs[d->ordinal].alloc_ctx = ctx;
    if (nentries == capentries) {
        size_t cap = capentries ? capentries * 2 : 256;
        struct managed_entry *e = realloc(entries, cap * sizeof *e);
        if (!e) {
            pthread_mutex_unlock(&mu);
            GEM_LOG(GEM_LOG_ERROR, "out of host memory for the managed-allocation record: %llu bytes will not "
                    "be moved with the group (the driver pages them on demand)", (unsigned long long)bytes);
            return;
        }
        entries = e;
        capentries = cap;
    }
    entries[nentries++] = (struct managed_entry){p, bytes, ++record_seq, (int16_t)d->ordinal, (int16_t)async};
    devs[d->ordinal].managed += bytes;
    if (devs[d->ordinal].on_gpu)
        devs[d->ordinal].resident += bytes;
    pthread_mutex_unlock(&mu);
}

void gem_residency_record(struct gem_device *d, CUdeviceptr ptr, uint64_t bytes) {
    if (d && ptr && bytes)
        record(d, ptr, bytes, 0);
}

CUresult gem_residency_alloc(struct gem_device *d, CUdeviceptr *dptr, size_t bytes, int async) {
    if (!device_supported(d))
        return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = REAL(cuMemAllocManaged)(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
    if (rc == CUDA_SUCCESS)
        record(d, *dptr, bytes, async);
    return rc;
}

int gem_residency_forget(CUdeviceptr ptr) {
    int found = 0;
    pthread_mutex_lock(&mu);
    /* newest first: frameworks free what they allocated last more often than not */
    for (size_t i = nentries; i-- > 0;) {
        if (entries[i].ptr != ptr)
            continue;
        struct residency_dev *r = &devs[entries[i].ordinal];
        r->managed -= entries[i].bytes;
        /* the resident count is an upper bound between moves; keep it within what is recorded */
        if (r->resident > r->managed)
            r->resident = r->managed;
        found = entries[i].async ? 2 : 1;
        entries[i] = entries[--nentries];
        break;
    }
    pthread_mutex_unlock(&mu);
    return found;
}

CUresult gem_residency_free_async(CUdeviceptr ptr, CUstream stream, int ptsz) {
    /* Stream-ordered semantics: the memory may still be used by work queued on the stream. */
    CUresult rc = ptsz && HAVE_REAL(cuStreamSynchronize_ptsz) ? REAL(cuStreamSynchronize_ptsz)(stream)
                                                             : REAL(cuStreamSynchronize)(stream);
    if (rc != CUDA_SUCCESS)
        return rc;
    return REAL(cuMemFree_v2)(ptr);
}

/* ---- moves ------------------------------------------------------------------------------------ */

/* The hook's stream in the calling thread's current context (made on first use, remade for a new context). */
static CUstream move_stream(struct residency_dev *r) {
    CUcontext ctx = NULL;
    if (!HAVE_REAL(cuCtxGetCurrent) || REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx)
        return NULL;
    if (r->stream && r->stream_ctx == ctx)
        return r->stream;
    CUstream s = NULL;
    if (!HAVE_REAL(cuStreamCreate) || REAL(cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        return NULL;
    r->stream = s;
    r->stream_ctx = ctx;
    return s;
}

void gem_residency_context_gone(CUcontext ctx) {
    if (!ctx)
        return;
    pthread_mutex_lock(&move_mu);   /* not while a move uses the stream */
    pthread_mutex_lock(&mu);
    for (int i = 0; i < GEM_MAX_DEVICES; i++) {
        if (devs[i].stream_ctx == ctx) { /* the stream went with the context: make a new one next time */
            devs[i].stream = NULL;
            devs[i].stream_ctx = NULL;
        }
        if (devs[i].alloc_ctx == ctx)
            devs[i].alloc_ctx = NULL;
    }
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&move_mu);
}

/* Move every recorded allocation of device d to the GPU or the host, and wait. Returns the bytes moved
 * (what the hook believes was not there already) and the time taken. Called with move_mu held. */
static uint64_t move_all(struct gem_device *d, int to_device, int64_t *took_ns) {
    struct residency_dev *r = &devs[d->ordinal];
    *took_ns = 0;
    pthread_mutex_lock(&mu);
    resolve_prefetch();
    CUstream s = move_stream(r);
    size_t n = 0;
    struct managed_entry *todo = nentries ? malloc(nentries * sizeof *todo) : NULL;
    for (size_t i = 0; todo && i < nentries; i++)
        if (entries[i].ordinal == d->ordinal)
            todo[n++] = entries[i];
    uint64_t before = r->resident, managed = r->managed, snap_seq = record_seq;
    pthread_mutex_unlock(&mu);
    if (n == 0 && managed == 0) { /* nothing recorded here (yet): nothing to move, nothing to warn about */
        free(todo);
        return 0;
    }
    if (!s || (!todo && n == 0 && managed > 0)) {
        free(todo);
        GEM_LOG(GEM_LOG_WARN, "GPU %d: cannot move the group's managed memory (no context or stream)", d->ordinal);
        return 0;
    }
    int64_t t0 = gem_now_ns();
    uint64_t ok_bytes = 0;
    size_t failed = 0;      /* todo[0 .. failed) come to hold the entries whose prefetch failed */
    for (size_t i = 0; i < n; i++) {
        CUresult rc = prefetch(todo[i].ptr, (size_t)todo[i].bytes, to_device, d->cudev, s);
        if (rc == CUDA_SUCCESS) {
            ok_bytes += todo[i].bytes;
            continue;
        }
        if (failed == 0)
            GEM_LOG(GEM_LOG_WARN, "GPU %d: cuMemPrefetchAsync of %llu bytes to the %s failed (%d)", d->ordinal,
                    (unsigned long long)todo[i].bytes, to_device ? "GPU" : "host", (int)rc);
        todo[failed++] = todo[i];
    }
    if (n > 0)
        REAL(cuStreamSynchronize)(s);
    *took_ns = gem_now_ns() - t0;
    pthread_mutex_lock(&mu);
    uint64_t moved;
    if (to_device) {
        r->resident = ok_bytes < r->managed ? ok_bytes : r->managed;
        moved = r->resident > before ? r->resident - before : 0;
        r->on_gpu = 1;
    } else {
        /* Only what was prefetched: a range whose prefetch failed and is still allocated stays where it was (the
         * driver's page faults move it later), and so does what was allocated during the move (counted resident,
         * as while on the GPU); the report says so -- its resident bytes, and less moved -- so the eviction is not
         * taken for complete (gem-schd warns) nor its speed for the bandwidth. A failed range freed meanwhile is
         * nowhere. */
        moved = ok_bytes < before ? ok_bytes : before;
        uint64_t stayed = 0;
        for (size_t i = 0; i < nentries; i++) {
            if (entries[i].ordinal != d->ordinal)
                continue;
            int kept = entries[i].seq > snap_seq && r->on_gpu;
            for (size_t k = 0; !kept && k < failed; k++)
                kept = todo[k].ptr == entries[i].ptr && todo[k].seq == entries[i].seq;
            if (kept)
                stayed += entries[i].bytes;
        }
        r->resident = stayed < r->managed ? stayed : r->managed;
        r->on_gpu = r->resident > 0;
    }
    pthread_mutex_unlock(&mu);
    free(todo);
    return moved;
}

static void report(struct gem_device *d, int direction, uint64_t evict_seq, uint64_t moved, int64_t took) {
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_RESIDENCY, 0);
    req.u.residency.evict_seq = evict_seq;
    req.u.residency.moved_bytes = moved;
    req.u.residency.moved_ns = took;
    pthread_mutex_lock(&mu);
    req.u.residency.resident_bytes = devs[d->ordinal].resident;
    req.u.residency.managed_bytes = devs[d->ordinal].managed;
    pthread_mutex_unlock(&mu);
    req.u.residency.direction = (uint32_t)direction;
    gem_conn_call(&d->conn, &req, &reply, 10 * GEM_NS_PER_S);
}

int gem_residency_wants_grant(struct gem_device *d) {
    if (!d || !(__atomic_load_n(&d->conn.ack_flags, __ATOMIC_RELAXED) & GEM_ACK_UNIFIED))
        return 0;
    pthread_mutex_lock(&mu);
    int wants = devs[d->ordinal].resident < devs[d->ordinal].managed;
    pthread_mutex_unlock(&mu);
    return wants;
}

void gem_residency_granted_in_place(struct gem_device *d) {
    if (!d || !(__atomic_load_n(&d->conn.ack_flags, __ATOMIC_RELAXED) & GEM_ACK_UNIFIED))
        return;
    pthread_mutex_lock(&mu);
    devs[d->ordinal].on_gpu = 1;
    pthread_mutex_unlock(&mu);
}

void gem_residency_on_grant(struct gem_device *d) {
    if (!d || !(__atomic_load_n(&d->conn.ack_flags, __ATOMIC_RELAXED) & GEM_ACK_UNIFIED))
        return;
    /* A grant supersedes the eviction requests before it (gem-schd asks none of a group it is granting). */
    int32_t slot;
    pthread_mutex_lock(&mu);
    const struct gem_board *b = board_of(d, &slot);
    if (b && slot >= 0) {
        uint64_t seq = gemhook_board_evict_seq(b, (uint32_t)slot);
        if (seq > __atomic_load_n(&devs[d->ordinal].handled_evict, __ATOMIC_ACQUIRE))
            __atomic_store_n(&devs[d->ordinal].handled_evict, seq, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&mu);
    if (!gem_residency_wants_grant(d))
        return;
    pthread_mutex_lock(&move_mu);
    int64_t took = 0;
    uint64_t moved = move_all(d, 1, &took);
    pthread_mutex_unlock(&move_mu);
    GEM_LOG(GEM_LOG_DEBUG, "GPU %d: %llu bytes of managed memory moved to the GPU in %.3f ms", d->ordinal,
            (unsigned long long)moved, (double)took / 1e6);
    report(d, GEM_RESIDENCY_TO_DEVICE, 0, moved, took);
}

#define POLL_NS (2 * GEM_NS_PER_MS) /* how often a unified group's watcher looks for an eviction request */

/* ---- the eviction delegate ----------------------------------------------------------------------
 * Why a wait of GEM_DELEGATE_WAIT_NS (1 s): PyTorch's empty_cache frees each cached segment with a
 * synchronising cudaFree, tens of milliseconds for a few GB; a second is ample for that, and short next to
 * what the eviction itself takes (0.5-7 s for 12.5 GB on an H100) and to the waits around it (the pod manager
 * waits 10 s + 1 s per GB for its processes' answers, gem-schd 15 s +), so a delegate that hangs or died with
 * its thread delays the next holder's grant by at most a second and never makes the eviction fail. Only the
 * watcher holds evictions (hold_ticket, hold_since); the delegate's thread only reads and raises the two
 * counters. Nothing here is on the launch path. */
static int delegate_on;
static uint64_t delegate_asked;     /* tickets handed out */
static uint64_t delegate_done;      /* the highest ticket released (or withdrawn) */
static pthread_mutex_t delegate_mu = PTHREAD_MUTEX_INITIALIZER;    /* only for gemhook_residency_wait's sleep */
static pthread_cond_t delegate_cv = PTHREAD_COND_INITIALIZER;

int gemhook_residency_delegate(int on) {
    __atomic_store_n(&delegate_on, on ? 1 : 0, __ATOMIC_RELEASE);
    GEM_LOG(GEM_LOG_DEBUG, "eviction delegate %s", on ? "registered" : "unregistered");
    return 0;
}

uint64_t gemhook_residency_pending(void) {
    uint64_t asked = __atomic_load_n(&delegate_asked, __ATOMIC_ACQUIRE);
    return asked > __atomic_load_n(&delegate_done, __ATOMIC_ACQUIRE) ? asked : 0;
}

uint64_t gemhook_residency_wait(int64_t timeout_ns) {
    uint64_t ticket = gemhook_residency_pending();
    if (ticket || timeout_ns <= 0)
        return ticket;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);    /* the condition variable's clock; a jump only ends one wait early */
    int64_t until = (int64_t)ts.tv_sec * GEM_NS_PER_S + ts.tv_nsec + timeout_ns;
    ts.tv_sec = until / GEM_NS_PER_S;
    ts.tv_nsec = until % GEM_NS_PER_S;
    pthread_mutex_lock(&delegate_mu);
    while (!(ticket = gemhook_residency_pending()))
        if (pthread_cond_timedwait(&delegate_cv, &delegate_mu, &ts) == ETIMEDOUT) {
            ticket = gemhook_residency_pending();
            break;
        }
    pthread_mutex_unlock(&delegate_mu);
    return ticket;
}

void gemhook_residency_release(uint64_t ticket) {
    uint64_t done = __atomic_load_n(&delegate_done, __ATOMIC_ACQUIRE);
    while (ticket > done &&
           !__atomic_compare_exchange_n(&delegate_done, &done, ticket, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
}

/* A new eviction to hold: a ticket, and the delegate's thread woken (under the mutex, so a waiter that just
 * found nothing pending cannot miss it). */
static uint64_t delegate_ask(void) {
    pthread_mutex_lock(&delegate_mu);
    uint64_t ticket = __atomic_add_fetch(&delegate_asked, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&delegate_cv);
    pthread_mutex_unlock(&delegate_mu);
    return ticket;
}

/* Device `ordinal` stops holding: its ticket is no longer pending (a grant superseded the request, or the
 * wait ran out), unless another GPU's eviction still waits for an earlier one, which releasing this one would
 * release too (tickets are released in order). */
static void delegate_stop_holding(int ordinal) {
    uint64_t ticket = devs[ordinal].hold_ticket;
    devs[ordinal].hold_ticket = 0;
    for (int i = 0; i < GEM_MAX_DEVICES; i++)
        if (devs[i].hold_ticket)
            return;
    gemhook_residency_release(ticket);
}

/* Hold the eviction of device `ordinal` for the delegate? Returns when to look again, or 0 to move now. */
static int64_t delegate_hold(int ordinal, int64_t now) {
    struct residency_dev *r = &devs[ordinal];
    if (!__atomic_load_n(&delegate_on, __ATOMIC_ACQUIRE)) {
        if (r->hold_ticket) /* unregistered while holding */
            delegate_stop_holding(ordinal);
        return 0;
    }
    if (!r->hold_ticket) {
        r->hold_ticket = delegate_ask();
        r->hold_since = now;
        GEM_LOG(GEM_LOG_DEBUG, "GPU %d: eviction held for the delegate (ticket %llu)", ordinal,
                (unsigned long long)r->hold_ticket);
    }
    int released = __atomic_load_n(&delegate_done, __ATOMIC_ACQUIRE) >= r->hold_ticket;
    int64_t until = r->hold_since + GEM_DELEGATE_WAIT_NS;
    if (!released && now < until)
        return now + POLL_NS < until ? now + POLL_NS : until;
    if (released)
        GEM_LOG(GEM_LOG_DEBUG, "GPU %d: the delegate released the eviction after %.3f ms", ordinal,
                (double)(now - r->hold_since) / 1e6);
    else
        GEM_LOG(GEM_LOG_WARN, "GPU %d: the eviction delegate did not answer within %lld ms: moving the memory "
                "without it", ordinal, (long long)(GEM_DELEGATE_WAIT_NS / GEM_NS_PER_MS));
    delegate_stop_holding(ordinal);
    return 0;
}

int64_t gem_residency_poll(struct gem_device *d, CUcontext ctx, int64_t now) {
    if (!d || !(__atomic_load_n(&d->conn.ack_flags, __ATOMIC_RELAXED) & GEM_ACK_UNIFIED))
        return now + 100 * GEM_NS_PER_MS;
    /* An idle process too must see eviction requests on a new gem-schd's page. (A short wait: the watcher also
     * ends slots and drains; a pod manager too busy to answer is asked again at a later poll.) */
    gem_device_follow_board(d, 0, 50 * GEM_NS_PER_MS);
    struct residency_dev *r = &devs[d->ordinal];
    int32_t slot;
    pthread_mutex_lock(&mu);
    const struct gem_board *b = board_of(d, &slot);
    pthread_mutex_unlock(&mu);
    if (!b || slot < 0)
        return now + 100 * GEM_NS_PER_MS;
    uint64_t want = gemhook_board_evict_seq(b, (uint32_t)slot);
    if (want <= __atomic_load_n(&r->handled_evict, __ATOMIC_ACQUIRE)) {
        if (r->hold_ticket) /* a grant superseded the request the delegate was asked about */
            delegate_stop_holding(d->ordinal);
        return now + POLL_NS;
    }
    int64_t later = delegate_hold(d->ordinal, now);
    if (later)
        return later;
    pthread_mutex_lock(&move_mu);
    if (!ctx) { /* never granted (still starting): the context it allocated in */
        pthread_mutex_lock(&mu);
        ctx = r->alloc_ctx;
        pthread_mutex_unlock(&mu);
    }
    int64_t took = 0;
    uint64_t moved = 0;
    int pushed = ctx && HAVE_REAL(cuCtxPushCurrent_v2) && REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
    if (pushed || !ctx) {
        moved = move_all(d, 0, &took);
        if (pushed) {
            CUcontext popped;
            REAL(cuCtxPopCurrent_v2)(&popped);
        }
    }
    pthread_mutex_lock(&mu);
    if (r->board_seen == b) /* (a grant moved the process to a new board meanwhile: this number is the old one's) */
        __atomic_store_n(&r->handled_evict, want, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&move_mu);
    GEM_LOG(GEM_LOG_DEBUG, "GPU %d: evicted (request %llu): %llu bytes of managed memory moved to the host in "
            "%.3f ms", d->ordinal, (unsigned long long)want, (unsigned long long)moved, (double)took / 1e6);
    report(d, GEM_RESIDENCY_TO_HOST, want, moved, took);
    return now + POLL_NS;
}

void gem_residency_after_fork(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_mutex_init(&move_mu, NULL);
    nentries = 0;
    memset(devs, 0, sizeof devs);
    /* the delegate's thread is the parent's: the child has none until it registers its own */
    pthread_mutex_init(&delegate_mu, NULL);
    pthread_cond_init(&delegate_cv, NULL);
    delegate_on = 0;
    delegate_asked = delegate_done = 0;
}
