/*
 * symbols.c -- symbol resolution.
 *
 * Programs reach the driver three ways, and each is covered:
 *   1. linked with -lcuda: the exported cu* wrappers (defined where their
 *      concern lives: gate.c, memory.c, here) interpose on libcuda's;
 *   2. dlopen + dlsym (ctypes, cffi, numba): the exported dlsym returns the
 *      wrapper for an intercepted cu* name;
 *   3. cuGetProcAddress (cudart, CUDA 11.3+): the real driver answers and the
 *      hook swaps the returned pointer for the wrapper of the same variant.
 *      Routing by the pointer rather than by name means the driver alone
 *      decides which _v2/_v3/_ptsz/_ptds variant a (symbol, cudaVersion,
 *      flags) triple means, and the wrapper always has the signature and
 *      stream semantics of what the caller asked for.
 *
 * Every real call goes through a pointer resolved from libcuda.so.1 with the
 * real dlsym, so the hook never calls itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "gemhook.h"

void *gem_real_fn[GEM_FN_COUNT];
atomic_int gem_real_ready;

#define GEM_X_NAME(name, ...) #name,
const char *const gem_fn_name[GEM_FN_COUNT] = {
    GEM_HOOK_TABLE(GEM_X_NAME, GEM_X_NAME, GEM_X_NAME, GEM_X_NAME, GEM_X_NAME, GEM_X_NAME)};
#undef GEM_X_NAME

/* Prototypes of every wrapper (they live in the file of their concern). */
#define GEM_X_PROTO(name, params, ...) GEM_EXPORT CUresult name params;
#define GEM_X_SKIP(...)
GEM_HOOK_TABLE(GEM_X_PROTO, GEM_X_PROTO, GEM_X_PROTO, GEM_X_PROTO, GEM_X_SKIP, GEM_X_PROTO)
#undef GEM_X_PROTO

#define GEM_X_HOOK(name, ...) (void *)&name,
#define GEM_X_NOHOOK(name, ...) NULL,
void *const gem_hook_fn[GEM_FN_COUNT] = {
    GEM_HOOK_TABLE(GEM_X_HOOK, GEM_X_HOOK, GEM_X_HOOK, GEM_X_HOOK, GEM_X_NOHOOK, GEM_X_HOOK)};
#undef GEM_X_HOOK
#undef GEM_X_NOHOOK

/* ---- the real dlsym -------------------------------------------------------------------- */

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) next_dlsym;

static dlsym_fn real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&next_dlsym, memory_order_acquire);
    if (GEM_LIKELY(f != NULL))
        return f;
    /* glibc 2.34 moved dlsym into libc with a new version; older ones have the 2.2.5 (x86-64)
     * or 2.17 (aarch64) version. __libc_dlsym is gone from 2.34 and is not used. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !f; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!f) {
        gem_log(GEM_LOG_ERROR, "cannot find the C library's dlsym; symbol lookups will fail");
        return NULL;
    }
    atomic_store_explicit(&next_dlsym, f, memory_order_release);
    return f;
}

/* ---- resolving the driver ------------------------------------------------------------- */

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static void *libcuda;

static void resolve(void) {
    dlsym_fn lookup = real_dlsym();
    libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!libcuda || !lookup) {
        gem_log(GEM_LOG_ERROR, "cannot open libcuda.so.1 (%s): CUDA calls fail", dlerror());
        return;
    }
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (strncmp(gem_fn_name[i], "nvml", 4) != 0)
            gem_real_fn[i] = lookup(libcuda, gem_fn_name[i]);
    atomic_store_explicit(&gem_real_ready, 1, memory_order_release);
}

/* NVML functions come from libnvidia-ml.so.1, which the program loaded before it could call one. */
static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER;

int gem_resolve_nvml(void) {
    pthread_mutex_lock(&nvml_mu);
    static void *nvml;
    if (!nvml) {
        dlsym_fn lookup = real_dlsym();
        nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (nvml && lookup)
            for (int i = 0; i < GEM_FN_COUNT; i++)
                if (strncmp(gem_fn_name[i], "nvml", 4) == 0 && !gem_real_fn[i])
                    gem_real_fn[i] = lookup(nvml, gem_fn_name[i]);
    }
    pthread_mutex_unlock(&nvml_mu);
    return nvml ? 0 : -1;
}

int gem_resolve_real(void) {
    pthread_once(&resolve_once, resolve);
    return atomic_load_explicit(&gem_real_ready, memory_order_acquire) ? 0 : -1;
}

static int hooked_index_by_name(const char *symbol) {
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && strcmp(gem_fn_name[i], symbol) == 0)
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
        if (!gem_hook_fn[i] || strncmp(gem_fn_name[i], symbol, n) != 0)
            continue;
        const char *rest = gem_fn_name[i] + n;
        if (*rest == '\0' || strncmp(rest, "_v", 2) == 0 || strncmp(rest, "_pt", 3) == 0)
            return 1;
    }
    return 0;
}

/* ---- dlsym ------------------------------------------------------------------------------ */

static inline int is_cuda_name(const char *s) {
    return s && ((s[0] == 'c' && s[1] == 'u' && s[2] >= 'A' && s[2] <= 'Z') ||
                 (s[0] == 'n' && s[1] == 'v' && s[2] == 'm' && s[3] == 'l'));
}

GEM_EXPORT void *dlsym(void *handle, const char *symbol) {
    dlsym_fn next = real_dlsym();
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
            if (!gem_real_fn[i] && strncmp(symbol, "nvml", 4) == 0)
                gem_real_fn[i] = found; /* e.g. an NVML opened RTLD_LOCAL under another name */
            atomic_fetch_add(&gem_stats.dlsym_routed, 1);
            GEM_LOG(GEM_LOG_DEBUG, "dlsym(%s) -> hook", symbol);
            return gem_hook_fn[i];
        }
    }
    /* A tail call: glibc takes the caller from the return address, so RTLD_NEXT keeps meaning
     * "after the caller", not "after libgemhook" (tests/test_hook_symbols.py checks this). */
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
