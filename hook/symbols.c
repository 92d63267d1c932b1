/*
 * symbols.c -- symbol resolution.
 *
 * Programs reach the driver three ways, and each is covered:
 *   1. linked with -lcuda: the exported cu* wrappers (wrappers.c, and where
 *      their concern lives: memory.c, nvml.c, here) interpose on libcuda's;
 *   2. dlopen + dlsym (ctypes, cffi, numba, pynvml): the exported dlsym
 *      returns the wrapper for an intercepted cu* or nvml* name;
 *   3. cuGetProcAddress (cudart, CUDA 11.3+): the real driver answers and the
 *      hook swaps the returned pointer for the wrapper of the same variant.
 *      Routing by the pointer rather than by name means the driver alone
 *      decides which _v2/_v3/_ptsz/_ptds variant a (symbol, cudaVersion,
 *      flags) triple means, and the wrapper always has the signature and
 *      stream semantics of what the caller asked for.
 *
 * Every real call goes through a pointer resolved with the real dlsym
 * (real.c), so the hook never calls itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "hook_exports.h"
#include "real.h"
#include "settings.h"
#include "stats.h"
#include "symbols.h"

#define GEM_X_HOOK_1(name) (void *)&name,
#define GEM_X_HOOK_0(name) NULL,
#define GEM_X_HOOK_(wrapped, name) GEM_X_HOOK_##wrapped(name)
#define GEM_X_HOOK(wrapped, name) GEM_X_HOOK_(wrapped, name)
#define GEM_X_HOOK_ROW(kind, lib, ret, name, ...) GEM_X_HOOK(GEM_WRAPPED_##kind, name)
void *const gem_hook_fn[GEM_FN_COUNT] = {GEM_HOOK_TABLE(GEM_X_HOOK_ROW)};
#undef GEM_X_HOOK_ROW

static int hooked_index_by_name(const char *symbol) {
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && strcmp(gem_fn_rows[i].name, symbol) == 0)
            return i;
    return -1;
}

/* The wrapper for a real pointer the driver returned, or the pointer itself. */
static void *route(void *real) {
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && gem_real_fn[i] == real)
            return gem_hook_fn[i];
    return real;
}

/* Is `symbol` the base name of a function we intercept (cuLaunchKernel for cuLaunchKernel_ptsz)? */
static int is_intercepted_base(const char *symbol) {
    size_t n = strlen(symbol);
    for (int i = 0; i < GEM_FN_COUNT; i++) {
        if (!gem_hook_fn[i] || strncmp(gem_fn_rows[i].name, symbol, n) != 0)
            continue;
        const char *rest = gem_fn_rows[i].name + n;
        if (*rest == '\0' || strncmp(rest, "_v", 2) == 0 || strncmp(rest, "_pt", 3) == 0)
            return 1;
    }
    return 0;
}

/* ---- dlsym ------------------------------------------------------------------------------ */

/* A cheap filter before the table is searched: every row's name starts with cu[A-Z] or nvml
 * (tests/test_hook_layers.py checks the table). */
static inline int is_cuda_name(const char *s) {
    return s && ((s[0] == 'c' && s[1] == 'u' && s[2] >= 'A' && s[2] <= 'Z') ||
                 (s[0] == 'n' && s[1] == 'v' && s[2] == 'm' && s[3] == 'l'));
}

GEM_EXPORT void *dlsym(void *handle, const char *symbol) {
    gem_dlsym_fn next = gem_real_dlsym();
    if (GEM_UNLIKELY(!next))
        return NULL;
    if (is_cuda_name(symbol) && !gem_cfg.disabled) {
        int i = hooked_index_by_name(symbol);
        if (i >= 0) {
            /* Only where the lookup would have found the driver's function: the caller's handle
             * and RTLD_* semantics decide whether the symbol exists, the hook only swaps it. */
            void *found = next(handle, symbol);
            if (!found)
                return NULL;
            if (!gem_real_fn[i] && gem_fn_rows[i].lib == GEM_LIB_NVML)
                gem_real_fn[i] = found; /* e.g. an NVML opened RTLD_LOCAL under another name */
            atomic_fetch_add(&gem_stats.dlsym_routed, 1);
            GEM_LOG(GEM_LOG_DEBUG, "dlsym(%s) -> hook", symbol);
            return gem_hook_fn[i];
        }
    }
    /* A tail call: glibc takes the caller from the return address, so RTLD_NEXT keeps meaning
     * "after the caller", not "after libgemhook" (test_dlsym_keeps_the_callers_semantics in
     * tests/test_e2e_hook.py checks this). */
    return next(handle, symbol);
}

/* ---- cuGetProcAddress -------------------------------------------------------------------- */

static void route_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (!pfn || !*pfn || gem_cfg.disabled)
        return;
    void *hooked = route(*pfn);
    if (hooked != *pfn) {
        atomic_fetch_add(&gem_stats.procaddr_routed, 1);
        GEM_LOG(GEM_LOG_DEBUG, "cuGetProcAddress(%s, %d, 0x%llx) -> hook", symbol, cudaVersion,
                (unsigned long long)flags);
        *pfn = hooked;
    } else if (symbol && is_intercepted_base(symbol)) {
        /* The driver answered with a variant the hook does not know: it runs ungated. Loud,
         * because silent loss of interception is the failure gemini exists to avoid. */
        GEM_LOG(GEM_LOG_WARN, "cuGetProcAddress(%s, %d, 0x%llx) returned a variant gemini does not "
                "intercept; calls through it are not gated", symbol, cudaVersion, (unsigned long long)flags);
    }
}

GEM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (gem_ensure_real() != 0 || !HAVE_REAL(cuGetProcAddress))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS)
        route_proc(symbol, pfn, cudaVersion, flags);
    return rc;
}

GEM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    if (gem_ensure_real() != 0 || !HAVE_REAL(cuGetProcAddress_v2))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS)
        route_proc(symbol, pfn, cudaVersion, flags);
    return rc;
}
