/*
 * sim_vmm.c -- virtual memory management (cuMemCreate / AddressReserve /
 * Map / SetAccess ...) and CUDA arrays.
 *
 * A physical allocation is a memfd of its size (sparse: free until touched)
 * charged to the device when created and uncharged when the last reference
 * to it goes, as the real driver frees it: the handle holds one reference
 * from cuMemCreate plus one per cuMemRetainAllocationHandle (which returns
 * the same handle value for a mapped address), each cuMemRelease drops one,
 * and every mapping holds one until cuMemUnmap. A handle with no reference
 * left is invalid (release, map and retain through its value fail), even
 * while mappings keep its memory. Export/import of shareable handles is not
 * simulated. A reservation is a PROT_NONE anonymous mapping; cuMemMap
 * maps the memfd over part of it (still PROT_NONE) and cuMemSetAccess makes
 * it readable/writable, so an access before SetAccess faults as on a GPU.
 * Arrays have no addressable memory in the simulator; they are only charged
 * (to their context: destroying or resetting it frees them),
 * as the real 13.0 driver does: in 2 MiB units, nothing for arrays made with
 * CUDA_ARRAY3D_DEFERRED_MAPPING (whose memory is mapped separately), and
 * cuArrayGetMemoryRequirements answers for deferred-mapping arrays only.
 */
#include "sim_internal.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define GRANULARITY (2ull << 20)

struct sim_phys {
    int fd;
    size_t size;
    int dev;
    int refs; /* handle references: cuMemCreate 1, +1 per retain, -1 per release */
    int maps;
};

struct sim_reserve {
    uintptr_t base;
    size_t size;
    struct sim_reserve *next;
};

struct sim_mapping {
    uintptr_t base;
    size_t size;
    struct sim_phys *phys;
    int prot; /* 0 until cuMemSetAccess */
    struct sim_mapping *next;
};

static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_reserve *reserves;
static struct sim_mapping *mappings;

static void phys_free(struct sim_phys *ph)
{
    sim_handle_del(ph);
    close(ph->fd);
    sim_mem_uncharge(ph->dev, ph->size);
    free(ph);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags)
{
    SIM_CHECK_INIT();
    if (!handle || !prop || flags) return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_check_device(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (size == 0 || size % GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_mem_charge(prop->location.id, size);
    if (rc) return rc;
    struct sim_phys *ph = calloc(1, sizeof *ph);
    int fd = memfd_create("simcuda-vmm", MFD_CLOEXEC);
    if (!ph || fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        free(ph);
        sim_mem_uncharge(prop->location.id, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ph->fd = fd;
    ph->size = size;
    ph->dev = prop->location.id;
    ph->refs = 1;
    sim_handle_add(ph, H_MEMHANDLE);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)ph;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    SIM_CHECK_INIT();
    struct sim_phys *ph = (struct sim_phys *)(uintptr_t)handle;
    pthread_mutex_lock(&vmm_lock);
    if (!sim_handle_is(ph, H_MEMHANDLE) || ph->refs == 0) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int free_now = --ph->refs == 0 && ph->maps == 0;
    pthread_mutex_unlock(&vmm_lock);
    if (free_now) phys_free(ph);
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    SIM_CHECK_INIT();
    if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    SIM_CHECK_INIT();
    if (!ptr || size == 0 || size % GRANULARITY || flags) return CUDA_ERROR_INVALID_VALUE;
    if (alignment & (alignment - 1)) return CUDA_ERROR_INVALID_VALUE;
    if (alignment < GRANULARITY) alignment = GRANULARITY;
    size_t len = size + alignment;
    void *hint = addr ? (void *)(uintptr_t)addr : NULL;
    void *p = mmap(hint, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    uintptr_t end = (uintptr_t)p + len;
    if (end > base + size) munmap((void *)(base + size), end - (base + size));
    struct sim_reserve *r = calloc(1, sizeof *r);
    if (!r) {
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = base;
    r->size = size;
    pthread_mutex_lock(&vmm_lock);
    r->next = reserves;
    reserves = r;
    pthread_mutex_unlock(&vmm_lock);
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    SIM_CHECK_INIT();
    pthread_mutex_lock(&vmm_lock);
    struct sim_reserve **pp = &reserves;
    while (*pp && !((*pp)->base == ptr && (*pp)->size == size)) pp = &(*pp)->next;
    struct sim_reserve *r = *pp;
    int busy = 0;
    for (struct sim_mapping *m = mappings; r && m; m = m->next)
        if (m->base >= r->base && m->base < r->base + r->size) busy = 1;
    if (r && !busy) *pp = r->next;
    pthread_mutex_unlock(&vmm_lock);
    if (!r || busy) return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)r->base, r->size);
    free(r);
    return CUDA_SUCCESS;
}

/* vmm_lock held. */
static int in_reserve(uintptr_t p, size_t n)
{
    for (struct sim_reserve *r = reserves; r; r = r->next)
        if (p >= r->base && n <= r->size && p - r->base <= r->size - n) return 1;
    return 0;
}

static int overlaps_mapping(uintptr_t p, size_t n)
{
    for (struct sim_mapping *m = mappings; m; m = m->next)
        if (p < m->base + m->size && m->base < p + n) return 1;
    return 0;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    SIM_CHECK_INIT();
    struct sim_phys *ph = (struct sim_phys *)(uintptr_t)handle;
    if (flags || size == 0 || ptr % GRANULARITY || size % GRANULARITY || offset % GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(ph, H_MEMHANDLE)) return CUDA_ERROR_INVALID_HANDLE;
    if (offset > ph->size || size > ph->size - offset) return CUDA_ERROR_INVALID_VALUE;
    struct sim_mapping *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&vmm_lock);
    CUresult rc = CUDA_SUCCESS;
    if (ph->refs == 0) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (!in_reserve(ptr, size) || overlaps_mapping(ptr, size)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, ph->fd, (off_t)offset) ==
               MAP_FAILED) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        m->base = ptr;
        m->size = size;
        m->phys = ph;
        m->next = mappings;
        mappings = m;
        ph->maps++;
    }
    pthread_mutex_unlock(&vmm_lock);
    if (rc) free(m);
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    SIM_CHECK_INIT();
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    struct sim_phys *to_free[64];
    int nfree = 0, found = 0;
    /* Work that may still touch the range finishes first (not under vmm_lock:
     * the workers take it to check pointers). */
    sim_drain_all();
    pthread_mutex_lock(&vmm_lock);
    /* Every mapping that overlaps the range must lie inside it. */
    for (struct sim_mapping *m = mappings; m; m = m->next)
        if (m->base < ptr + size && ptr < m->base + m->size) {
            if (m->base < ptr || m->base + m->size > ptr + size) {
                pthread_mutex_unlock(&vmm_lock);
                return CUDA_ERROR_INVALID_VALUE;
            }
            found = 1;
        }
    if (!found) {
        pthread_mutex_unlock(&vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (struct sim_mapping **pp = &mappings; *pp;) {
        struct sim_mapping *m = *pp;
        if (m->base >= ptr && m->base + m->size <= ptr + size) {
            mmap((void *)m->base, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            if (--m->phys->maps == 0 && m->phys->refs == 0 && nfree < 64) to_free[nfree++] = m->phys;
            *pp = m->next;
            free(m);
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    for (int i = 0; i < nfree; i++) phys_free(to_free[i]);
    return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    SIM_CHECK_INIT();
    if (!desc || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || sim_check_device(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags == 3) prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == 1 && prot == PROT_NONE) prot = PROT_READ;
        else if (desc[i].flags != 0 && desc[i].flags != 1 && desc[i].flags != 3) return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&vmm_lock);
    /* The whole range must be mapped. */
    size_t covered = 0;
    for (struct sim_mapping *m = mappings; m; m = m->next)
        if (m->base >= ptr && m->base + m->size <= ptr + size) covered += m->size;
    CUresult rc = CUDA_SUCCESS;
    if (covered != size) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (mprotect((void *)(uintptr_t)ptr, size, prot) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (struct sim_mapping *m = mappings; m; m = m->next)
            if (m->base >= ptr && m->base + m->size <= ptr + size) m->prot = prot;
    }
    pthread_mutex_unlock(&vmm_lock);
    return rc;
}

/* vmm_lock held. */
static struct sim_mapping *mapping_at(uintptr_t p)
{
    for (struct sim_mapping *m = mappings; m; m = m->next)
        if (p >= m->base && p < m->base + m->size) return m;
    return NULL;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_CHECK_INIT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    struct sim_mapping *m = mapping_at((uintptr_t)addr);
    if (m) {
        m->phys->refs++; /* the same handle value again, even if every earlier reference was released */
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)m->phys;
    }
    pthread_mutex_unlock(&vmm_lock);
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

int sim_vmm_valid(const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    pthread_mutex_lock(&vmm_lock);
    struct sim_mapping *m = mapping_at(a);
    int ok = m && (m->prot & PROT_WRITE) && n <= m->size - (a - m->base);
    pthread_mutex_unlock(&vmm_lock);
    return ok;
}

CUresult sim_vmm_pointer_attribute(void *data, int attribute, CUdeviceptr ptr)
{
    pthread_mutex_lock(&vmm_lock);
    struct sim_mapping *m = mapping_at((uintptr_t)ptr);
    struct sim_mapping mc;
    if (m) mc = *m;
    int dev = m ? m->phys->dev : 0;
    pthread_mutex_unlock(&vmm_lock);
    if (!m) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
    case 1: *(CUcontext *)data = NULL; break;                          /* CONTEXT */
    case 2: *(unsigned int *)data = 2; break;                          /* MEMORY_TYPE device */
    case 3: *(CUdeviceptr *)data = ptr; break;                         /* DEVICE_POINTER */
    case 8: *(unsigned char *)data = 0; break;                         /* IS_MANAGED */
    case 9: *(int *)data = dev; break;                                 /* DEVICE_ORDINAL */
    case 11: *(CUdeviceptr *)data = (CUdeviceptr)mc.base; break;       /* RANGE_START_ADDR */
    case 12: *(size_t *)data = mc.size; break;                         /* RANGE_SIZE */
    case 13: *(unsigned char *)data = 1; break;                        /* MAPPED */
    case 14: *(unsigned long long *)data = 0; break;                   /* ALLOWED_HANDLE_TYPES */
    case 16: *(unsigned int *)data = mc.prot & PROT_WRITE ? 3u : mc.prot ? 1u : 0u; break; /* ACCESS_FLAGS */
    case 17: *(CUmemoryPool *)data = NULL; break;                      /* MEMPOOL_HANDLE */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ arrays */

#define ARRAY_ALIGN (64u << 10)

struct sim_array;
static struct sim_array *arrays; /* live arrays and mipmapped arrays, under vmm_lock */
#define ARRAY3D_DEFERRED_MAPPING 0x80

struct sim_array {
    struct sim_ctx *ctx; /* destroying or resetting it frees the array, as the driver does */
    struct sim_array *next;
    int dev;
    int deferred;
    size_t bytes;   /* the memory requirement */
    size_t charged; /* charged to the device */
};

static size_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

/* Bytes of a w x h x d array (0 extents count as 1), rounded to ARRAY_ALIGN; 0 if invalid. */
static size_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    size_t e = format_bytes(f);
    if (!e || !w || (ch != 1 && ch != 2 && ch != 4)) return 0;
    if (!h) h = 1;
    if (!d) d = 1;
    if (w > (1u << 24) || h > (1u << 24) || d > (1u << 24)) return 0;
    unsigned __int128 b = (unsigned __int128)w * h * d * e * ch;
    if (b > (unsigned __int128)1 << 50) return 0;
    return ((size_t)b + ARRAY_ALIGN - 1) / ARRAY_ALIGN * ARRAY_ALIGN;
}

static CUresult array_new(void **out, size_t bytes, unsigned flags, int type)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_get(&c);
    if (rc) return rc;
    if (!out || !bytes) return CUDA_ERROR_INVALID_VALUE;
    int deferred = (flags & ARRAY3D_DEFERRED_MAPPING) != 0;
    size_t charge = deferred ? 0 : (bytes + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    if (charge) {
        rc = sim_mem_charge(c->dev, charge);
        if (rc) return rc;
    }
    struct sim_array *a = calloc(1, sizeof *a);
    if (!a) {
        if (charge) sim_mem_uncharge(c->dev, charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->ctx = c;
    a->dev = c->dev;
    a->deferred = deferred;
    a->bytes = bytes;
    a->charged = charge;
    sim_handle_add(a, type);
    pthread_mutex_lock(&vmm_lock);
    a->next = arrays;
    arrays = a;
    pthread_mutex_unlock(&vmm_lock);
    *out = a;
    return CUDA_SUCCESS;
}

/* vmm_lock held: take a out of the list of live arrays; 0 if it is not there (freed meanwhile). */
static int array_unlink(struct sim_array *a)
{
    for (struct sim_array **pp = &arrays; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            return 1;
        }
    return 0;
}

static void array_free(struct sim_array *a)
{
    sim_handle_del(a);
    if (a->charged) sim_mem_uncharge(a->dev, a->charged);
    free(a);
}

void sim_vmm_ctx_gone(struct sim_ctx *c)
{
    for (;;) {
        pthread_mutex_lock(&vmm_lock);
        struct sim_array *a = arrays;
        while (a && a->ctx != c) a = a->next;
        if (a) array_unlink(a);
        pthread_mutex_unlock(&vmm_lock);
        if (!a) break;
        array_free(a);
    }
}

static CUresult array_destroy(void *h, int type)
{
    SIM_CHECK_INIT();
    if (!sim_handle_is(h, type)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_array *a = h;
    pthread_mutex_lock(&vmm_lock);
    int mine = array_unlink(a);
    pthread_mutex_unlock(&vmm_lock);
    if (!mine) return CUDA_ERROR_INVALID_HANDLE;
    array_free(a);
    return CUDA_SUCCESS;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    SIM_CHECK_INIT();
    if (!pHandle || !d) return CUDA_ERROR_INVALID_VALUE;
    return array_new((void **)pHandle, array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels), 0, H_ARRAY);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    SIM_CHECK_INIT();
    if (!pHandle || !d) return CUDA_ERROR_INVALID_VALUE;
    return array_new((void **)pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                     d->Flags, H_ARRAY);
}

CUresult cuArrayDestroy(CUarray hArray) { return array_destroy(hArray, H_ARRAY); }

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int numMipmapLevels)
{
    SIM_CHECK_INIT();
    if (!pHandle || !d || numMipmapLevels == 0 || numMipmapLevels > 32) return CUDA_ERROR_INVALID_VALUE;
    size_t total = 0;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        size_t w = d->Width >> l, h = d->Height >> l, z = d->Depth >> l;
        size_t b = array_bytes(w ? w : 1, d->Height ? (h ? h : 1) : 0, d->Depth ? (z ? z : 1) : 0, d->Format,
                               d->NumChannels);
        if (!b) return CUDA_ERROR_INVALID_VALUE;
        total += b;
    }
    return array_new((void **)pHandle, total, d->Flags, H_MIPMAP);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) { return array_destroy(hMipmappedArray, H_MIPMAP); }

static CUresult requirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req, void *h, int type, CUdevice device)
{
    CUresult rc = sim_check_device(device);
    if (rc) return rc;
    if (!req) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_handle_is(h, type)) return CUDA_ERROR_INVALID_HANDLE;
    if (!((struct sim_array *)h)->deferred) return CUDA_ERROR_INVALID_VALUE;
    memset(req, 0, sizeof *req);
    req->size = ((struct sim_array *)h)->bytes;
    req->alignment = ARRAY_ALIGN;
    return CUDA_SUCCESS;
}

CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements, CUarray array,
                                      CUdevice device)
{
    return requirements(memoryRequirements, array, H_ARRAY, device);
}

CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements,
                                               CUmipmappedArray mipmap, CUdevice device)
{
    return requirements(memoryRequirements, mipmap, H_MIPMAP, device);
}
