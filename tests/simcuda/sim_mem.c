/*
 * sim_mem.c -- device memory: allocations, pools and stream-ordered
 * allocation, copies and sets, pointer attributes.
 *
 * Device memory is host memory: each allocation is its own anonymous
 * MAP_NORESERVE mapping (free until touched), and a CUdeviceptr is its
 * address. Every byte given out is charged to this process's entry in the
 * shared file (sim_state.c), so capacity holds across processes. A table of
 * live allocations, sorted by address, answers frees, range lookups and the
 * validity checks that keep a bad pointer from crashing the simulator.
 */
#include "sim_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

enum alloc_kind { AK_DEVICE, AK_PITCH, AK_MANAGED, AK_POOL, AK_HOST };

struct sim_pool;

struct sim_alloc {
    uintptr_t base;
    size_t size;     /* what the caller may touch */
    size_t map_size; /* mmap length */
    int dev;
    int kind;
    struct sim_ctx *ctx;
    struct sim_pool *pool;
    uint64_t id;
    struct sim_alloc *next_cached; /* pool cache list */
    /* managed: which 2 MiB chunks are on the device (the rest is on the host), and their bytes (charged to
     * the device while there) */
    uint8_t *on_dev;
    uint64_t resident;
};

struct sim_pool {
    int dev;
    int is_default;
    int destroyed;
    uint64_t threshold;
    uint64_t reserved, used, reserved_high, used_high;
    int reuse[4];
    struct sim_alloc *cache; /* freed blocks kept reserved */
};

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_alloc **tab;
static size_t ntab, captab;
static uint64_t next_id = 1;
static struct sim_pool *default_pool[SIM_MAX_DEVICES];
static struct sim_pool *current_pool[SIM_MAX_DEVICES];

/* Managed memory lives on the host until a kernel touches it: like the real
 * driver, cuMemGetInfo does not count it. Pinned host memory is not device memory. */
static int charged(int kind) { return kind != AK_HOST && kind != AK_MANAGED; }

static size_t page_round(size_t n)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

/* ------------------------------------------------------------------ the table (mem_lock held) */

/* Index of the last allocation with base <= p, or -1. */
static long tab_floor(uintptr_t p)
{
    long lo = 0, hi = (long)ntab - 1, best = -1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        if (tab[mid]->base <= p) {
            best = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return best;
}

static int tab_insert(struct sim_alloc *a)
{
    if (ntab == captab) {
        size_t nc = captab ? captab * 2 : 256;
        struct sim_alloc **nt = realloc(tab, nc * sizeof *nt);
        if (!nt) return -1;
        tab = nt;
        captab = nc;
    }
    long i = tab_floor(a->base) + 1;
    memmove(&tab[i + 1], &tab[i], (ntab - (size_t)i) * sizeof *tab);
    tab[i] = a;
    ntab++;
    return 0;
}

static void tab_remove(struct sim_alloc *a)
{
    long i = tab_floor(a->base);
    if (i < 0 || tab[i] != a) return;
    memmove(&tab[i], &tab[i + 1], (ntab - (size_t)i - 1) * sizeof *tab);
    ntab--;
}

static struct sim_alloc *tab_find_range(uintptr_t p, size_t n)
{
    long i = tab_floor(p);
    if (i < 0) return NULL;
    struct sim_alloc *a = tab[i];
    if (p - a->base > a->size || n > a->size - (p - a->base)) return NULL;
    if (n == 0 && p - a->base == a->size) return NULL;
    return a;
}

static struct sim_alloc *tab_find_exact(uintptr_t p)
{
    long i = tab_floor(p);
    return i >= 0 && tab[i]->base == p ? tab[i] : NULL;
}

int sim_mem_valid(const void *p, size_t n)
{
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)p, n);
    pthread_mutex_unlock(&mem_lock);
    return a != NULL || sim_vmm_valid(p, n);
}

/* ------------------------------------------------------------------ allocate / free */

static CUresult alloc_new(struct sim_ctx *c, int dev, size_t size, int kind, struct sim_pool *pool,
                          struct sim_alloc **out)
{
    size_t map_size = page_round(size);
    if (charged(kind)) {
        CUresult rc = sim_mem_charge(dev, map_size);
        if (rc) return rc;
    }
    void *p = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct sim_alloc *a = p == MAP_FAILED ? NULL : calloc(1, sizeof *a);
    if (!a) {
        if (p != MAP_FAILED) munmap(p, map_size);
        if (charged(kind)) sim_mem_uncharge(dev, map_size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->base = (uintptr_t)p;
    a->size = size;
    a->map_size = map_size;
    a->dev = dev;
    a->kind = kind;
    a->ctx = c;
    a->pool = pool;
    pthread_mutex_lock(&mem_lock);
    a->id = next_id++;
    int bad = tab_insert(a);
    pthread_mutex_unlock(&mem_lock);
    if (bad) {
        munmap(p, map_size);
        if (charged(kind)) sim_mem_uncharge(dev, map_size);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = a;
    return CUDA_SUCCESS;
}

static void alloc_release(struct sim_alloc *a)
{
    munmap((void *)a->base, a->map_size);
    if (charged(a->kind)) sim_mem_uncharge(a->dev, a->map_size);
    if (a->resident) sim_mem_uncharge(a->dev, a->resident);
    free(a->on_dev);
    free(a);
}

/* mem_lock held; a already out of the table. Returns a if it must be released. */
static struct sim_alloc *pool_put_locked(struct sim_alloc *a)
{
    struct sim_pool *p = a->pool;
    p->used -= a->size;
    if (p->destroyed || p->reserved > p->threshold) {
        p->reserved -= a->map_size;
        return a;
    }
    a->next_cached = p->cache;
    p->cache = a;
    return NULL;
}

void sim_mem_free_now(CUdeviceptr ptr)
{
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_exact((uintptr_t)ptr);
    if (a && a->kind != AK_HOST) {
        tab_remove(a);
        if (a->pool) a = pool_put_locked(a);
    } else {
        a = NULL;
    }
    pthread_mutex_unlock(&mem_lock);
    if (a) alloc_release(a);
}

void sim_mem_ctx_gone(struct sim_ctx *c)
{
    for (;;) {
        struct sim_alloc *a = NULL;
        pthread_mutex_lock(&mem_lock);
        for (size_t i = 0; i < ntab; i++)
            if (tab[i]->ctx == c && !tab[i]->pool) {
                a = tab[i];
                break;
            }
        if (a) tab_remove(a);
        pthread_mutex_unlock(&mem_lock);
        if (!a) break;
        alloc_release(a);
    }
}

static CUresult alloc_sync(CUdeviceptr *dptr, size_t size, int kind)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (kind != AK_HOST) {
        rc = sim_capture_unsafe();
        if (rc) return rc;
    }
    struct sim_alloc *a;
    rc = alloc_new(c, c->dev, size, kind, NULL, &a);
    if (rc) return rc;
    *dptr = (CUdeviceptr)a->base;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return alloc_sync(dptr, bytesize, AK_DEVICE); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes)
{
    SIM_CHECK_INIT();
    if (!pPitch || !WidthInBytes || !Height) return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + 511) / 512 * 512;
    if (Height > SIZE_MAX / pitch) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_sync(dptr, pitch * Height, AK_PITCH);
    if (rc == CUDA_SUCCESS) *pPitch = pitch;
    return rc;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != 1 && flags != 2) { /* CU_MEM_ATTACH_GLOBAL, CU_MEM_ATTACH_HOST */
        SIM_CHECK_INIT();
        return CUDA_ERROR_INVALID_VALUE;
    }
    return alloc_sync(dptr, bytesize, AK_MANAGED);
}

/* ------------------------------------------------------------------ managed memory: residency */

/* Managed memory is tracked in 2 MiB chunks (the GPU's large page): each is on the device or on the host.
 * A fresh allocation is on the host; only prefetches move it (kernels do not fault pages in here, so a
 * test sees exactly what was prefetched). Chunks on a device are charged to it, so cuMemGetInfo shows them
 * and a killed process's resident memory comes back with its other charges. */
#define SIM_CHUNK (2ull << 20)

static uint64_t chunk_bytes(const struct sim_alloc *a, size_t i)
{
    uint64_t start = (uint64_t)i * SIM_CHUNK;
    return a->size - start < SIM_CHUNK ? a->size - start : SIM_CHUNK;
}

void sim_mem_prefetch_now(CUdeviceptr ptr, size_t n, int dev, int v2)
{
    uint64_t t0 = sim_now_ns(), moved = 0;
    int charge_dev = -1;
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)ptr, n);
    if (a && a->kind == AK_MANAGED && n > 0) {
        size_t nchunks = (a->size + SIM_CHUNK - 1) / SIM_CHUNK;
        if (!a->on_dev) a->on_dev = calloc(nchunks, 1);
        if (a->on_dev) {
            size_t first = (size_t)(((uintptr_t)ptr - a->base) / SIM_CHUNK);
            size_t last = (size_t)(((uintptr_t)ptr - a->base + n - 1) / SIM_CHUNK);
            uint8_t want = dev >= 0;
            for (size_t i = first; i <= last && i < nchunks; i++)
                if (a->on_dev[i] != want) {
                    a->on_dev[i] = want;
                    moved += chunk_bytes(a, i);
                }
            charge_dev = a->dev;
            if (want) a->resident += moved;
            else a->resident -= moved;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    if (charge_dev < 0) return;
    if (moved) {
        if (dev >= 0) sim_mem_charge_managed(charge_dev, moved);
        else sim_mem_uncharge(charge_dev, moved);
    }
    /* The copy engine moves the pages: it takes time but not the execution lock. */
    if (sim_cfg.migrate_bytes_per_ns > 0 && moved) sim_sleep_until(t0 + (uint64_t)((double)moved / sim_cfg.migrate_bytes_per_ns));
    char name[SIM_NAME_LEN];
    snprintf(name, sizeof name, "%s:%s:%llu", v2 ? "prefetch_v2" : "prefetch", dev >= 0 ? "device" : "host",
             (unsigned long long)moved);
    sim_trace_kernel(charge_dev, t0, sim_now_ns(), name);
}

uint64_t simcuda_resident_bytes(CUdeviceptr ptr)
{
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)ptr, 0);
    uint64_t r = a ? a->resident : 0;
    pthread_mutex_unlock(&mem_lock);
    return r;
}

/* dev: a device ordinal, or -1 for the host. */
static CUresult prefetch(CUdeviceptr ptr, size_t n, int dev, CUstream h, int ptsz, int v2)
{
    SIM_CHECK_INIT();
    if (dev != -1) {
        CUresult rc = sim_check_device(dev);
        if (rc) return rc;
        if (!sim_cfg.concurrent_managed) return CUDA_ERROR_INVALID_DEVICE; /* as the real driver */
    }
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)ptr, n);
    int managed = a && a->kind == AK_MANAGED;
    pthread_mutex_unlock(&mem_lock);
    if (!managed || n == 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev == -1 && sim_cfg.host_prefetch_fails) return CUDA_ERROR_NOT_SUPPORTED;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    struct sim_op op = {.kind = OP_PREFETCH};
    op.u.pf.ptr = ptr;
    op.u.pf.n = n;
    op.u.pf.dev = dev;
    op.u.pf.v2 = v2;
    return sim_submit(s, &op, NULL);
}

/* The old ABI (CUDA 8.0 .. 12.x): a device ordinal, or CU_DEVICE_CPU (-1) for the host. */
CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    return prefetch(devPtr, count, dstDevice, hStream, 0, 0);
}

CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    return prefetch(devPtr, count, dstDevice, hStream, 1, 0);
}

/* The _v2 ABI (CUDA 12.2; what "cuMemPrefetchAsync" means from CUDA 13): a location, and flags that must be 0. */
static CUresult prefetch_v2(CUdeviceptr ptr, size_t n, CUmemLocation loc, unsigned int flags, CUstream h, int ptsz)
{
    SIM_CHECK_INIT();
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (loc.type == CU_MEM_LOCATION_TYPE_HOST) return prefetch(ptr, n, -1, h, ptsz, 1);
    if (loc.type != CU_MEM_LOCATION_TYPE_DEVICE || loc.id < 0) return CUDA_ERROR_INVALID_VALUE;
    return prefetch(ptr, n, loc.id, h, ptsz, 1);
}

CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                               CUstream hStream)
{
    return prefetch_v2(devPtr, count, location, flags, hStream, 0);
}

CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                    CUstream hStream)
{
    return prefetch_v2(devPtr, count, location, flags, hStream, 1);
}

/* ------------------------------------------------------------------ free */

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (dptr == 0) return CUDA_SUCCESS; /* as the real driver */
    rc = sim_capture_unsafe();
    if (rc) return rc;
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_exact((uintptr_t)dptr);
    int ok = a && a->kind != AK_HOST;
    pthread_mutex_unlock(&mem_lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    /* Like the real driver, a free waits for work that may still use it. */
    sim_drain_all();
    sim_mem_free_now(dptr);
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    uint64_t f, t;
    sim_mem_info(c->dev, &f, &t);
    *free_bytes = (size_t)f;
    *total_bytes = (size_t)t;
    return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    SIM_CHECK_INIT();
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)dptr, 0);
    uintptr_t base = a ? a->base : 0;
    size_t size = a ? a->size : 0;
    pthread_mutex_unlock(&mem_lock);
    if (!a) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = (CUdeviceptr)base;
    if (psize) *psize = size;
    return CUDA_SUCCESS;
}

static CUresult host_alloc(void **pp, size_t bytesize)
{
    if (!pp) {
        SIM_CHECK_INIT();
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUdeviceptr d;
    CUresult rc = alloc_sync(&d, bytesize, AK_HOST);
    if (rc == CUDA_SUCCESS) *pp = (void *)(uintptr_t)d;
    return rc;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(pp, bytesize); }
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) { return host_alloc(pp, bytesize); }

/* Registered host memory is used in place: its device address is its host address. */
CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_CHECK_INIT();
    (void)Flags;
    return p && bytesize ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    SIM_CHECK_INIT();
    if (!pdptr || !p || Flags) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p)
{
    SIM_CHECK_INIT();
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_exact((uintptr_t)p);
    if (a && a->kind == AK_HOST)
        tab_remove(a);
    else
        a = NULL;
    pthread_mutex_unlock(&mem_lock);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    sim_drain_all();
    alloc_release(a);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ pools */

/* mem_lock held. */
static struct sim_pool *pool_default_locked(int dev)
{
    if (!default_pool[dev]) {
        struct sim_pool *p = calloc(1, sizeof *p);
        if (!p) return NULL;
        p->dev = dev;
        p->is_default = 1;
        default_pool[dev] = p;
        sim_handle_add(p, H_POOL);
    }
    if (!current_pool[dev]) current_pool[dev] = default_pool[dev];
    return current_pool[dev];
}

static CUresult pool_alloc(struct sim_ctx *c, struct sim_pool *p, size_t size, CUdeviceptr *out)
{
    struct sim_alloc *a = NULL;
    pthread_mutex_lock(&mem_lock);
    for (struct sim_alloc **pp = &p->cache; *pp; pp = &(*pp)->next_cached) {
        if ((*pp)->map_size >= size && (*pp)->map_size <= 2 * page_round(size)) {
            a = *pp;
            *pp = a->next_cached;
            a->next_cached = NULL;
            a->size = size;
            a->ctx = c;
            if (tab_insert(a) != 0) {
                p->reserved -= a->map_size;
                pthread_mutex_unlock(&mem_lock);
                alloc_release(a);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            break;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    if (!a) {
        CUresult rc = alloc_new(c, p->dev, size, AK_POOL, p, &a);
        if (rc) return rc;
        pthread_mutex_lock(&mem_lock);
        p->reserved += a->map_size;
        pthread_mutex_unlock(&mem_lock);
    }
    pthread_mutex_lock(&mem_lock);
    p->used += size;
    if (p->used > p->used_high) p->used_high = p->used;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    pthread_mutex_unlock(&mem_lock);
    *out = (CUdeviceptr)a->base;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h, int ptsz)
{
    SIM_CHECK_INIT();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    /* Stream-ordered allocation inside a capture (memory nodes) is not simulated. */
    if (sim_capture_status(s, NULL) != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    struct sim_pool *p;
    if (pool) {
        if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
        p = (struct sim_pool *)pool;
    } else {
        pthread_mutex_lock(&mem_lock);
        p = pool_default_locked(s->ctx->dev);
        pthread_mutex_unlock(&mem_lock);
        if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return pool_alloc(s->ctx, p, size, dptr);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream, 0);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream, 1);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (!pool) {
        SIM_CHECK_INIT();
        return CUDA_ERROR_INVALID_VALUE;
    }
    return alloc_async(dptr, bytesize, pool, hStream, 0);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    if (!pool) {
        SIM_CHECK_INIT();
        return CUDA_ERROR_INVALID_VALUE;
    }
    return alloc_async(dptr, bytesize, pool, hStream, 1);
}

static CUresult free_async(CUdeviceptr dptr, CUstream h, int ptsz)
{
    SIM_CHECK_INIT();
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, ptsz, &s);
    if (rc) return rc;
    if (sim_capture_status(s, NULL) != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_exact((uintptr_t)dptr);
    int ok = a && a->kind != AK_HOST;
    pthread_mutex_unlock(&mem_lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    struct sim_op op = {.kind = OP_FREE};
    op.u.fr.ptr = dptr;
    return sim_submit(s, &op, NULL);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 0); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 1); }

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    SIM_CHECK_INIT();
    if (!pool || !props) return CUDA_ERROR_INVALID_VALUE;
    if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(props->location.id);
    if (rc) return rc == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : rc;
    struct sim_pool *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->dev = props->location.id;
    sim_handle_add(p, H_POOL);
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

/* mem_lock held: take cached blocks off until reserved <= keep; returns them. */
static struct sim_alloc *pool_trim_locked(struct sim_pool *p, uint64_t keep)
{
    struct sim_alloc *out = NULL;
    while (p->cache && p->reserved > keep) {
        struct sim_alloc *a = p->cache;
        p->cache = a->next_cached;
        p->reserved -= a->map_size;
        a->next_cached = out;
        out = a;
    }
    return out;
}

static void release_list(struct sim_alloc *a)
{
    while (a) {
        struct sim_alloc *n = a->next_cached;
        alloc_release(a);
        a = n;
    }
}

CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_pool *p = (struct sim_pool *)pool;
    if (p->is_default) return CUDA_ERROR_INVALID_VALUE;
    sim_handle_del(p);
    pthread_mutex_lock(&mem_lock);
    p->destroyed = 1;
    if (current_pool[p->dev] == p) current_pool[p->dev] = default_pool[p->dev];
    struct sim_alloc *rel = pool_trim_locked(p, 0);
    pthread_mutex_unlock(&mem_lock);
    release_list(rel);
    /* p stays allocated: blocks still out point at it and return through it. */
    return CUDA_SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *rel = pool_trim_locked((struct sim_pool *)pool, minBytesToKeep);
    pthread_mutex_unlock(&mem_lock);
    release_list(rel);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    struct sim_pool *p = (struct sim_pool *)pool;
    CUresult rc = CUDA_SUCCESS;
    struct sim_alloc *rel = NULL;
    pthread_mutex_lock(&mem_lock);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        p->reuse[attr] = *(int *)value;
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        p->threshold = *(cuuint64_t *)value;
        rel = pool_trim_locked(p, p->threshold);
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
        if (*(cuuint64_t *)value != 0) rc = CUDA_ERROR_INVALID_VALUE;
        else p->reserved_high = p->reserved;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (*(cuuint64_t *)value != 0) rc = CUDA_ERROR_INVALID_VALUE;
        else p->used_high = p->used;
        break;
    default:
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&mem_lock);
    release_list(rel);
    return rc;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    struct sim_pool *p = (struct sim_pool *)pool;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&mem_lock);
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        *(int *)value = p->reuse[attr];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = p->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = p->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = p->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = p->used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = p->used_high; break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&mem_lock);
    return rc;
}

static CUresult get_pool(CUmemoryPool *pool, CUdevice dev, int current)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_lock);
    struct sim_pool *p = pool_default_locked(dev);
    if (p && !current) p = default_pool[dev];
    pthread_mutex_unlock(&mem_lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) { return get_pool(pool, dev, 0); }
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) { return get_pool(pool, dev, 1); }

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CUresult rc = sim_check_device(dev);
    if (rc) return rc;
    if (!sim_handle_is(pool, H_POOL)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_pool *p = (struct sim_pool *)pool;
    if (p->dev != dev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mem_lock);
    pool_default_locked(dev);
    current_pool[dev] = p;
    pthread_mutex_unlock(&mem_lock);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ copies and sets */

/* Synchronous: ordered on the legacy (or per-thread) stream, then waited for. */
static CUresult run_sync(struct sim_op *op, int ptds)
{
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(NULL, ptds, &s);
    if (rc == CUDA_SUCCESS) rc = sim_capture_sync_copy_check(s);
    if (rc) {
        sim_op_discard(op);
        return rc;
    }
    uint64_t seq = sim_enqueue(s, op);
    sim_wait_seq(s->ctx, seq);
    return CUDA_SUCCESS;
}

#define CP_DST_DEV 1 /* dst must be device memory */
#define CP_SRC_DEV 2 /* src must be device memory */
#define CP_STAGE 4   /* src is pageable host memory: stage it when queued */

static CUresult copy(void *dst, const void *src, size_t n, int how, CUstream h, int async, int per_thread)
{
    SIM_CHECK_INIT();
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    if (((how & CP_DST_DEV) && !sim_mem_valid(dst, n)) || ((how & CP_SRC_DEV) && !sim_mem_valid(src, n)))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_op op = {.kind = OP_MEMCPY};
    op.u.cp.dst = dst;
    op.u.cp.src = src;
    op.u.cp.n = n;
    if (!async) return run_sync(&op, per_thread);
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, per_thread, &s);
    if (rc) return rc;
    if ((how & CP_STAGE) && !sim_mem_valid(src, n) &&
        sim_capture_status(s, NULL) == CU_STREAM_CAPTURE_STATUS_NONE) {
        /* Pageable host source: the real driver stages it before returning. */
        op.u.cp.staged = malloc(n);
        if (!op.u.cp.staged) return CUDA_ERROR_OUT_OF_MEMORY;
        memcpy(op.u.cp.staged, src, n);
    }
    return sim_submit(s, &op, NULL);
}

#define D(x) ((void *)(uintptr_t)(x))
#define HTOD (CP_DST_DEV | CP_STAGE)
#define DTOH CP_SRC_DEV
#define DTOD (CP_DST_DEV | CP_SRC_DEV)

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(D(dst), D(src), n, 0, NULL, 0, 0); }
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(D(dst), D(src), n, 0, NULL, 0, 1); }

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return copy(D(dst), src, n, HTOD, NULL, 0, 0); }
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    return copy(D(dst), src, n, HTOD, NULL, 0, 1);
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return copy(dst, D(src), n, DTOH, NULL, 0, 0); }
CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { return copy(dst, D(src), n, DTOH, NULL, 0, 1); }

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(D(dst), D(src), n, DTOD, NULL, 0, 0); }
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return copy(D(dst), D(src), n, DTOD, NULL, 0, 1);
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(D(dst), D(src), n, CP_STAGE, h, 1, 0);
}

CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(D(dst), D(src), n, CP_STAGE, h, 1, 1);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h)
{
    return copy(D(dst), src, n, HTOD, h, 1, 0);
}

CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream h)
{
    return copy(D(dst), src, n, HTOD, h, 1, 1);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(dst, D(src), n, DTOH, h, 1, 0);
}

CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(dst, D(src), n, DTOH, h, 1, 1);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(D(dst), D(src), n, DTOD, h, 1, 0);
}

CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy(D(dst), D(src), n, DTOD, h, 1, 1);
}

static CUresult set(CUdeviceptr dst, uint32_t val, int width, size_t n, CUstream h, int async, int per_thread)
{
    SIM_CHECK_INIT();
    if (n == 0) return CUDA_SUCCESS;
    if (width == 4 && (dst & 3)) return CUDA_ERROR_INVALID_VALUE;
    if (n > SIZE_MAX / (size_t)width || !sim_mem_valid(D(dst), n * (size_t)width)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_op op = {.kind = OP_MEMSET};
    op.u.ms.dst = D(dst);
    op.u.ms.val = val;
    op.u.ms.width = width;
    op.u.ms.n = n;
    if (!async) return run_sync(&op, per_thread);
    struct sim_stream *s;
    CUresult rc = sim_stream_resolve(h, per_thread, &s);
    if (rc) return rc;
    return sim_submit(s, &op, NULL);
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char uc, size_t N) { return set(d, uc, 1, N, NULL, 0, 0); }
CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char uc, size_t N) { return set(d, uc, 1, N, NULL, 0, 1); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int ui, size_t N) { return set(d, ui, 4, N, NULL, 0, 0); }
CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int ui, size_t N) { return set(d, ui, 4, N, NULL, 0, 1); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char uc, size_t N, CUstream h) { return set(d, uc, 1, N, h, 1, 0); }
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char uc, size_t N, CUstream h)
{
    return set(d, uc, 1, N, h, 1, 1);
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int ui, size_t N, CUstream h) { return set(d, ui, 4, N, h, 1, 0); }
CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int ui, size_t N, CUstream h)
{
    return set(d, ui, 4, N, h, 1, 1);
}

/* ------------------------------------------------------------------ pointer attributes */

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    SIM_CHECK_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mem_lock);
    struct sim_alloc *a = tab_find_range((uintptr_t)ptr, 0);
    struct sim_alloc copy_a;
    if (a) copy_a = *a;
    pthread_mutex_unlock(&mem_lock);
    if (!a) return sim_vmm_pointer_attribute(data, attribute, ptr);
    a = &copy_a;
    int host = a->kind == AK_HOST;
    switch (attribute) {
    case 1: *(CUcontext *)data = (CUcontext)a->ctx; break;                 /* CONTEXT */
    case 2: *(unsigned int *)data = host ? 1u : 2u; break;                  /* MEMORY_TYPE host/device */
    case 3: *(CUdeviceptr *)data = ptr; break;                              /* DEVICE_POINTER */
    case 4:                                                                 /* HOST_POINTER */
        if (!host && a->kind != AK_MANAGED) return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = (void *)(uintptr_t)ptr;
        break;
    case 6: *(unsigned char *)data = 1; break;                              /* SYNC_MEMOPS */
    case 7: *(unsigned long long *)data = a->id; break;                     /* BUFFER_ID */
    case 8: *(unsigned char *)data = a->kind == AK_MANAGED; break;          /* IS_MANAGED */
    case 9: *(int *)data = a->dev; break;                                   /* DEVICE_ORDINAL */
    case 10: *(unsigned char *)data = 0; break;                             /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 11: *(CUdeviceptr *)data = (CUdeviceptr)a->base; break;            /* RANGE_START_ADDR */
    case 12: *(size_t *)data = a->size; break;                              /* RANGE_SIZE */
    case 13: *(unsigned char *)data = 1; break;                             /* MAPPED */
    case 16: *(unsigned int *)data = 3; break;                              /* ACCESS_FLAGS: read-write */
    case 17: *(CUmemoryPool *)data = (CUmemoryPool)a->pool; break;          /* MEMPOOL_HANDLE */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
