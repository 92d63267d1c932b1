/*
 * real.h -- the driver's real functions: one pointer per row of hook_table.h,
 * resolved from libcuda.so.1 (CUDA rows) or libnvidia-ml.so.1 (NVML rows)
 * with the C library's own dlsym. Every real call of the hook goes through
 * these pointers, never through the hook's exports, so the hook never calls
 * itself.
 */
#ifndef GEMINI_REAL_H
#define GEMINI_REAL_H

#include <stdatomic.h>

#include "cuda_types.h"
#include "hook_table.h"
#include "util.h"

#define GEM_X_INDEX(kind, lib, ret, name, ...) GEM_IDX_##name,
enum gem_fn_index { GEM_HOOK_TABLE(GEM_X_INDEX) GEM_FN_COUNT };
#undef GEM_X_INDEX

#define GEM_X_TYPEDEF(kind, lib, ret, name, since, pt, params, ...) typedef ret gem_fn_##name##_t params;
GEM_HOOK_TABLE(GEM_X_TYPEDEF)
#undef GEM_X_TYPEDEF

enum gem_fn_lib { GEM_LIB_CUDA = 0, GEM_LIB_NVML = 1 };
enum gem_fn_kind {
    GEM_KIND_LAUNCH, GEM_KIND_GRAPH_LAUNCH, GEM_KIND_SYNC, GEM_KIND_CAPTURE_BEGIN, GEM_KIND_CAPTURE_END, GEM_KIND_ALLOC_ASYNC,
    GEM_KIND_ALLOC_FROM_POOL, GEM_KIND_CUSTOM, GEM_KIND_REAL
};

/* The table's columns, by row. */
struct gem_fn_row {
    const char *name;
    unsigned char lib;          /* enum gem_fn_lib */
    unsigned char kind;         /* enum gem_fn_kind */
    unsigned char pt;           /* a per-thread-default-stream variant */
    int since;                  /* the cudaVersion that introduced it */
};
extern const struct gem_fn_row gem_fn_rows[GEM_FN_COUNT];

/* Real entry points (NULL where the library lacks one). */
extern void *gem_real_fn[GEM_FN_COUNT];

#define REAL(name) ((gem_fn_##name##_t *)gem_real_fn[GEM_IDX_##name])
#define HAVE_REAL(name) (gem_real_fn[GEM_IDX_##name] != NULL)

/* Destroy an event the hook created (if any, and if the driver has cuEventDestroy_v2) and clear the handle. */
static inline void gem_real_event_destroy(CUevent *ev) {
    if (*ev && HAVE_REAL(cuEventDestroy_v2))
        REAL(cuEventDestroy_v2)(*ev);
    *ev = NULL;
}

/* Create the `n` events at `evs` with `flags`: 1 if all were made, else 0 with none kept (a set the driver made
 * only in part is given back: kept, the next try overwrote its handles and they leaked). */
static inline int gem_real_events_create(CUevent *const *evs, int n, unsigned int flags) {
    for (int i = 0; i < n; i++)
        *evs[i] = NULL;
    for (int i = 0; i < n; i++) {
        if (REAL(cuEventCreate)(evs[i], flags) != CUDA_SUCCESS) {
            *evs[i] = NULL;     /* (a failed call's output is not a handle) */
            for (int j = 0; j < i; j++)
                gem_real_event_destroy(evs[j]);
            return 0;
        }
    }
    return 1;
}

/* Resolve the CUDA rows (once). Returns 0, or -1 if libcuda.so.1 cannot be opened. */
int gem_resolve_real(void);
extern atomic_int gem_real_ready;
static inline int gem_ensure_real(void) {
    return GEM_LIKELY(atomic_load_explicit(&gem_real_ready, memory_order_acquire)) ? 0 : gem_resolve_real();
}
/* dlsym(libcuda.so.1, name) with the C library's dlsym: any exported driver symbol, in the table or not.
 * NULL before gem_resolve_real succeeded. */
void *gem_real_lookup(const char *name);
/* Resolve the NVML rows, once the program has loaded libnvidia-ml.so.1. Returns 0, or -1 if it has not. */
int gem_resolve_nvml(void);

void gem_real_after_fork(void);          /* the child's locks are free */

/* The C library's dlsym (the hook exports its own). NULL if it cannot be found. */
typedef void *(*gem_dlsym_fn)(void *, const char *);
gem_dlsym_fn gem_real_dlsym(void);

#endif /* GEMINI_REAL_H */
