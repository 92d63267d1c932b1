/*
 * vmm.c -- the virtual memory management API: PyTorch's expandable segments, NCCL's buffers.
 *
 * cuMemCreate makes a physical allocation and returns a handle to it. The driver frees the physical memory
 * when the last reference to it goes: the handle counts one reference from cuMemCreate, one more for each
 * cuMemRetainAllocationHandle (which hands back the same handle value for a mapped address), minus one per
 * cuMemRelease; each cuMemMap of it holds one more until cuMemUnmap. So `create, map, release` leaves the
 * memory allocated and in use (that is how PyTorch and NCCL use it), and only the unmap frees it. The group
 * is charged from cuMemCreate until that moment, and not before: counting the release as the end would let a
 * group hold any amount of mapped memory.
 *
 * Shared handles. cuMemExportToShareableHandle changes nothing here. A handle imported from another process
 * (cuMemImportFromShareableHandle) is not charged in the importing process: the memory is counted once, in the
 * group of the process that created it, for as long as that process keeps it (its handle or a mapping of
 * it). An importer that keeps the memory mapped after its creator gave it back holds memory nobody is
 * charged for (docs/architecture.md says so). Sparse mappings (cuMemMapArrayAsync) are not followed either.
 *
 * Physical allocations belong to the process, not to a context: destroying or resetting a context does not
 * change their count.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "hook_exports.h"
#include "memory.h"
#include "real.h"
#include "settings.h"
#include "stats.h"
#include "vmm.h"

/* ---- two small hash tables: physical allocations by handle, mappings by address ---------------------------- */

struct slot_head {
    uint64_t key;
    int32_t state; /* 0 empty, 1 used, -1 deleted */
    int32_t pad;
};

struct phys {
    struct slot_head h;         /* key: the handle */
    uint64_t bytes;
    int32_t ordinal;
    int32_t refs;               /* handle references: cuMemCreate 1, +1 per retain, -1 per release */
    int64_t maps;               /* mappings of it not yet unmapped */
};

struct mapping {
    struct slot_head h;         /* key: the mapped address */
    uint64_t size;
    uint64_t handle;
};

struct table {
    char *slots;
    size_t elem, cap, used, deleted;
};

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static struct table physs = {.elem = sizeof(struct phys)};
static struct table maps = {.elem = sizeof(struct mapping)};

static struct slot_head *slot_at(struct table *t, size_t i) { return (struct slot_head *)(t->slots + i * t->elem); }

static size_t home(uint64_t key, size_t cap) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1); }

static void *find(struct table *t, uint64_t key) {
    if (!t->cap)
        return NULL;
    for (size_t i = home(key, t->cap);; i = (i + 1) & (t->cap - 1)) {
        struct slot_head *s = slot_at(t, i);
        if (s->state == 0)
            return NULL;
        if (s->state == 1 && s->key == key)
            return s;
    }
}

static int grow(struct table *t) {
    size_t cap = t->cap ? t->cap * 2 : 256;
    char *slots = calloc(cap, t->elem);
    if (!slots)
        return -1;
    for (size_t i = 0; i < t->cap; i++) {
        struct slot_head *s = slot_at(t, i);
        if (s->state != 1)
            continue;
        size_t j = home(s->key, cap);
        while (((struct slot_head *)(slots + j * t->elem))->state)
            j = (j + 1) & (cap - 1);
        memcpy(slots + j * t->elem, s, t->elem);
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    t->deleted = 0;
    return 0;
}

/* A zeroed slot for `key` (which must not be in the table); NULL if out of host memory. */
static void *insert(struct table *t, uint64_t key) {
    if ((t->used + t->deleted + 1) * 2 > t->cap && grow(t) != 0)
        return NULL;
    size_t i = home(key, t->cap);
    while (slot_at(t, i)->state == 1)
        i = (i + 1) & (t->cap - 1);
    struct slot_head *s = slot_at(t, i);
    if (s->state < 0)
        t->deleted--;
    memset(s, 0, t->elem);
    s->key = key;
    s->state = 1;
    t->used++;
    return s;
}

static void erase(struct table *t, void *slot) {
    ((struct slot_head *)slot)->state = -1;
    t->used--;
    t->deleted++;
}

static void clear(struct table *t) {
    if (t->slots)
        memset(t->slots, 0, t->cap * t->elem);
    t->used = t->deleted = 0;
}

/* ---- the physical allocation's life ------------------------------------------------------------------------ */

/* What a freed allocation gives back (filled under vmm_mu, returned to the group after it is dropped). */
struct give_back {
    int ordinal;
    uint64_t bytes;
};

/* Called with vmm_mu held: if nothing holds p any more, the driver has freed it; forget it. */
static int maybe_freed(struct phys *p, struct give_back *out) {
    if (p->refs > 0 || p->maps > 0)
        return 0;
    *out = (struct give_back){p->ordinal, p->bytes};
    erase(&physs, p);
    return 1;
}

static void give_back(const struct give_back *g) {
    struct gem_device *d = gem_device_by_ordinal(g->ordinal);
    if (d)
        gem_memory_unreserve(d, g->bytes, GEM_MEM_VMM);
}

#define NEED_REAL(name)                                                     \
    do {                                                                    \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))       \
            return CUDA_ERROR_NOT_INITIALIZED;                              \
    } while (0)

GEM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                unsigned long long flags) {
    NEED_REAL(cuMemCreate);
    if (!handle || !prop || size == 0 || !gem_memory_accounting())
        return REAL(cuMemCreate)(handle, size, prop, flags);
    struct gem_device *d = NULL;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        d = gem_device_by_ordinal(prop->location.id);
    if (!d) /* host or other locations are not GPU memory of a managed device */
        return REAL(cuMemCreate)(handle, size, prop, flags);
    CUresult rc = gem_memory_reserve(d, size, GEM_MEM_VMM);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = REAL(cuMemCreate)(handle, size, prop, flags);
    if (rc != CUDA_SUCCESS) {
        gem_memory_unreserve(d, size, GEM_MEM_VMM);
        return rc;
    }
    struct give_back stale = {0, 0};
    pthread_mutex_lock(&vmm_mu);
    struct phys *p = find(&physs, *handle);
    if (p) { /* the driver reuses a handle value only once the old allocation is gone */
        stale = (struct give_back){p->ordinal, p->bytes};
        erase(&physs, p);
    }
    p = insert(&physs, *handle);
    if (p) {
        p->bytes = size;
        p->ordinal = d->ordinal;
        p->refs = 1;
    }
    pthread_mutex_unlock(&vmm_mu);
    if (!p)
        GEM_LOG(GEM_LOG_ERROR, "out of host memory for the VMM table; %zu bytes stay counted", size);
    if (stale.bytes)
        give_back(&stale);
    return rc;
}

GEM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    NEED_REAL(cuMemRelease);
    CUresult rc = REAL(cuMemRelease)(handle);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct give_back g;
    int freed = 0;
    pthread_mutex_lock(&vmm_mu);
    struct phys *p = find(&physs, handle);
    if (p && p->refs > 0) {
        p->refs--;
        freed = maybe_freed(p, &g);
    }
    pthread_mutex_unlock(&vmm_mu);
    if (freed)
        give_back(&g);
    return rc;
}

GEM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    NEED_REAL(cuMemRetainAllocationHandle);
    CUresult rc = REAL(cuMemRetainAllocationHandle)(handle, addr);
    if (rc != CUDA_SUCCESS || !handle)
        return rc;
    pthread_mutex_lock(&vmm_mu);
    struct phys *p = find(&physs, *handle);
    if (p)
        p->refs++;
    pthread_mutex_unlock(&vmm_mu);
    return rc;
}

GEM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) {
    NEED_REAL(cuMemMap);
    CUresult rc = REAL(cuMemMap)(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&vmm_mu);
    struct phys *p = find(&physs, handle);
    if (p) {
        struct mapping *m = find(&maps, ptr);
        if (m) { /* the driver refuses overlapping maps: an entry here is stale (an unmap we did not see) */
            struct phys *old = find(&physs, m->handle);
            if (old && old->maps > 0)
                old->maps--;
            erase(&maps, m);
        }
        m = insert(&maps, ptr);
        if (m) {
            m->size = size;
            m->handle = handle;
            p->maps++;
        } else {
            GEM_LOG(GEM_LOG_ERROR, "out of host memory for the VMM table: an unmap at %#llx will not be seen",
                    (unsigned long long)ptr);
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return rc;
}

/* The mapping the hook knows at `at`, else the first one after it below `end` (a mapping the hook did not see,
 * of an imported handle's, may lie in between); NULL if none. Called with vmm_mu held. */
static struct mapping *next_mapping(CUdeviceptr at, CUdeviceptr end) {
    struct mapping *m = find(&maps, at);
    if (m || !maps.used)
        return m;
    for (size_t i = 0; i < maps.cap; i++) {
        struct mapping *c = (struct mapping *)slot_at(&maps, i);
        if (c->h.state == 1 && c->h.key > at && c->h.key < end && (!m || c->h.key < m->h.key))
            m = c;
    }
    return m;
}

/* At most this many allocations freed by one unmap are given back at once; more are given back in rounds. */
#define UNMAP_BATCH 64

GEM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_REAL(cuMemUnmap);
    CUresult rc = REAL(cuMemUnmap)(ptr, size);
    if (rc != CUDA_SUCCESS || size == 0)
        return rc;
    /* The driver unmaps a whole mapped range: its mappings lie back to back from ptr. */
    CUdeviceptr at = ptr, end = ptr + size;
    while (at < end) {
        struct give_back freed[UNMAP_BATCH];
        int n = 0;
        pthread_mutex_lock(&vmm_mu);
        while (at < end && n < UNMAP_BATCH) {
            struct mapping *m = next_mapping(at, end);
            if (!m) {
                at = end;
                break;
            }
            at = m->h.key;
            at += m->size ? m->size : end - at;
            struct phys *p = find(&physs, m->handle);
            erase(&maps, m);
            if (p && p->maps > 0) {
                p->maps--;
                n += maybe_freed(p, &freed[n]);
            }
        }
        pthread_mutex_unlock(&vmm_mu);
        for (int i = 0; i < n; i++)
            give_back(&freed[i]);
    }
    return rc;
}

void gem_vmm_after_fork(void) {
    /* the parent's physical allocations and mappings are the parent's */
    pthread_mutex_init(&vmm_mu, NULL);
    clear(&physs);
    clear(&maps);
}
