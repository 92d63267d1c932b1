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
 *      stream semantics of what the caller asked for. A pointer that is no
 *      exported symbol is routed by name, version and flags instead (the
 *      table's `since` and `pt` columns); an exported variant the table lacks
 *      is reported and counted (procaddr_unrouted), never silently passed.
 *
 * Every real call goes through a pointer resolved with the real dlsym
 * (real.c), so the hook never calls itself.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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

/* The row whose real function is `real` and that has a wrapper; -1 if none. */
static int row_of_real(void *real) {
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && gem_real_fn[i] == real)
            return i;
    return -1;
}

/* The length of a row's base name: the name without its _ptsz/_ptds and _vN suffixes
 * (cuMemcpyHtoD_v2_ptds -> cuMemcpyHtoD), the name cuGetProcAddress is asked for. */
static size_t base_len(const char *name) {
    size_t n = strlen(name);
    if (n > 5 && (strcmp(name + n - 5, "_ptsz") == 0 || strcmp(name + n - 5, "_ptds") == 0))
        n -= 5;
    size_t i = n;
    while (i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9')
        i--;
    if (i < n && i >= 2 && name[i - 1] == 'v' && name[i - 2] == '_')
        n = i - 2;
    return n;
}

static int row_has_base(int i, const char *symbol) {
    size_t n = base_len(gem_fn_rows[i].name);
    return strlen(symbol) == n && strncmp(gem_fn_rows[i].name, symbol, n) == 0;
}

/* Is `symbol` the base name of a function we intercept (cuLaunchKernel for cuLaunchKernel_ptsz)? */
static int is_intercepted_base(const char *symbol) {
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && row_has_base(i, symbol))
            return 1;
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

/* The exported libcuda.so.1 variant of `symbol` (base, _v2.._v5, each also _ptsz/_ptds) whose address is
 * `fn`, written to `out`; 0 if `fn` is none of them. */
static int exported_variant(const char *symbol, void *fn, char *out, size_t len) {
    static const char *const versions[] = {"", "_v2", "_v3", "_v4", "_v5"};
    static const char *const streams[] = {"", "_ptsz", "_ptds"};
    for (size_t v = 0; v < sizeof versions / sizeof *versions; v++)
        for (size_t t = 0; t < sizeof streams / sizeof *streams; t++) {
            snprintf(out, len, "%s%s%s", symbol, versions[v], streams[t]);
            if (gem_real_lookup(out) == fn)
                return 1;
        }
    return 0;
}

/* The row the driver's naming rules give for (symbol, cudaVersion, flags), among the table's wrapped rows
 * whose real function exists: the newest variant of the base introduced at or before cudaVersion, its
 * per-thread one (_ptsz/_ptds) when the per-thread flag is given and the base has one. -1 if none. */
static int row_by_name(const char *symbol, int cudaVersion, cuuint64_t flags) {
    int has_pt = 0;
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_hook_fn[i] && gem_fn_rows[i].pt && row_has_base(i, symbol))
            has_pt = 1;
    int want_pt = has_pt && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
    int best = -1;
    for (int i = 0; i < GEM_FN_COUNT; i++) {
        if (!gem_hook_fn[i] || !row_has_base(i, symbol) || gem_fn_rows[i].pt != want_pt ||
            gem_fn_rows[i].since > cudaVersion)
            continue;
        if (best < 0 || gem_fn_rows[i].since > gem_fn_rows[best].since)
            best = i;
    }
    return best >= 0 && gem_real_fn[best] ? best : -1;
}

/* GEMINI_PROCADDR_LOG: one line per query, "pid symbol version flags result name", where result is hook
 * (routed by pointer to the row `name`), fallback (routed by name to `name`), unrouted (an intercepted
 * base answered with `name`, a variant the hook does not wrap, "?" if no exported one), real (not
 * intercepted) or none (no pointer). */
static void log_query(const char *symbol, int version, cuuint64_t flags, const char *result, const char *name) {
    static atomic_int log_fd = -2; /* -2: not opened yet, -1: no log */
    int fd = atomic_load(&log_fd);
    if (fd == -1 || (fd == -2 && !gem_cfg.procaddr_log[0]))
        return;
    if (fd == -2) {
        int mine = open(gem_cfg.procaddr_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (mine < 0)
            GEM_LOG(GEM_LOG_ERROR, "GEMINI_PROCADDR_LOG=%s: %s", gem_cfg.procaddr_log, strerror(errno));
        int expected = -2;
        if (atomic_compare_exchange_strong(&log_fd, &expected, mine < 0 ? -1 : mine))
            fd = mine;
        else {
            if (mine >= 0)
                close(mine);
            fd = expected;
        }
        if (fd < 0)
            return;
    }
    char line[384];
    int n = snprintf(line, sizeof line, "%d %s %d 0x%llx %s %s\n", (int)getpid(),
                     !symbol ? "(null)" : !symbol[0] ? "(empty)" : symbol, version, (unsigned long long)flags, result,
                     name && name[0] ? name : "-");
    if (n > 0) {
        ssize_t w = write(fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)w;
    }
}

/* The driver answered (symbol, cudaVersion, flags) with *pfn: hand out the wrapper of the same variant.
 * By pointer first: the driver alone decides which variant the triple means. A pointer that is no
 * exported symbol at all (an internal entry a driver may hand out) is routed by name, version and flags
 * instead; an exported variant the table lacks is left alone, loudly, and counted: handing out the wrapper
 * of another variant would call it with the wrong signature. */
static void route_proc(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (!pfn || !*pfn) {
        log_query(symbol, cudaVersion, flags, "none", "-");
        return;
    }
    if (gem_cfg.disabled)
        return;
    int i = row_of_real(*pfn);
    if (i >= 0) {
        atomic_fetch_add(&gem_stats.procaddr_routed, 1);
        GEM_LOG(GEM_LOG_DEBUG, "cuGetProcAddress(%s, %d, 0x%llx) -> hook", symbol, cudaVersion,
                (unsigned long long)flags);
        *pfn = gem_hook_fn[i];
        log_query(symbol, cudaVersion, flags, "hook", gem_fn_rows[i].name);
        return;
    }
    if (!symbol || !is_intercepted_base(symbol)) {
        log_query(symbol, cudaVersion, flags, "real", "-");
        return;
    }
    char exported[160];
    if (!exported_variant(symbol, *pfn, exported, sizeof exported)) {
        int f = row_by_name(symbol, cudaVersion, flags);
        if (f >= 0) {
            atomic_fetch_add(&gem_stats.procaddr_fallback, 1);
            GEM_LOG(GEM_LOG_INFO, "cuGetProcAddress(%s, %d, 0x%llx) returned %p, no exported symbol of "
                    "libcuda.so.1; routed by name to %s", symbol, cudaVersion, (unsigned long long)flags, *pfn,
                    gem_fn_rows[f].name);
            *pfn = gem_hook_fn[f];
            log_query(symbol, cudaVersion, flags, "fallback", gem_fn_rows[f].name);
            return;
        }
        snprintf(exported, sizeof exported, "?");
    }
    /* The driver answered with a variant the hook does not know: it runs ungated. Loud, because silent
     * loss of interception is the failure gemini exists to avoid. */
    atomic_fetch_add(&gem_stats.procaddr_unrouted, 1);
    GEM_LOG(GEM_LOG_WARN, "cuGetProcAddress(%s, %d, 0x%llx) returned a variant gemini does not intercept (%s); "
            "calls through it are not gated", symbol, cudaVersion, (unsigned long long)flags, exported);
    log_query(symbol, cudaVersion, flags, "unrouted", exported);
}

GEM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (gem_ensure_real() != 0 || !HAVE_REAL(cuGetProcAddress))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS)
        route_proc(symbol, pfn, cudaVersion, flags);
    else
        log_query(symbol, cudaVersion, flags, "none", "-");
    return rc;
}

GEM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    if (gem_ensure_real() != 0 || !HAVE_REAL(cuGetProcAddress_v2))
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS)
        route_proc(symbol, pfn, cudaVersion, flags);
    else
        log_query(symbol, cudaVersion, flags, "none", "-");
    return rc;
}
