/*
 * real.c -- resolving the real driver functions of hook_table.h.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "real.h"
#include "settings.h"

void *gem_real_fn[GEM_FN_COUNT];
atomic_int gem_real_ready;

#define GEM_X_ROW(kind, lib, ret, name, since, pt, ...) {#name, GEM_LIB_##lib, GEM_KIND_##kind, pt, since},
const struct gem_fn_row gem_fn_rows[GEM_FN_COUNT] = {GEM_HOOK_TABLE(GEM_X_ROW)};
#undef GEM_X_ROW

/* ---- the real dlsym -------------------------------------------------------------------- */

static _Atomic(gem_dlsym_fn) next_dlsym;

gem_dlsym_fn gem_real_dlsym(void) {
    gem_dlsym_fn f = atomic_load_explicit(&next_dlsym, memory_order_acquire);
    if (GEM_LIKELY(f != NULL))
        return f;
    /* glibc 2.34 moved dlsym into libc with a new version; older ones have the 2.2.5 (x86-64)
     * or 2.17 (aarch64) version. __libc_dlsym is gone from 2.34 and is not used. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !f; i++)
        f = (gem_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!f) {
        gem_log(GEM_LOG_ERROR, "cannot find the C library's dlsym; symbol lookups will fail");
        return NULL;
    }
    atomic_store_explicit(&next_dlsym, f, memory_order_release);
    return f;
}

/* ---- libcuda.so.1 ---------------------------------------------------------------------- */

static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static void *libcuda;

static void resolve(void) {
    gem_dlsym_fn lookup = gem_real_dlsym();
    libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!libcuda || !lookup) {
        gem_log(GEM_LOG_ERROR, "cannot open libcuda.so.1 (%s): CUDA calls fail", dlerror());
        return;
    }
    for (int i = 0; i < GEM_FN_COUNT; i++)
        if (gem_fn_rows[i].lib == GEM_LIB_CUDA)
            gem_real_fn[i] = lookup(libcuda, gem_fn_rows[i].name);
    atomic_store_explicit(&gem_real_ready, 1, memory_order_release);
}

int gem_resolve_real(void) {
    pthread_once(&resolve_once, resolve);
    return atomic_load_explicit(&gem_real_ready, memory_order_acquire) ? 0 : -1;
}

void *gem_real_lookup(const char *name) {
    gem_dlsym_fn lookup = gem_real_dlsym();
    if (!atomic_load_explicit(&gem_real_ready, memory_order_acquire) || !lookup)
        return NULL;
    return lookup(libcuda, name);
}

/* ---- libnvidia-ml.so.1: loaded by the program before it could call an NVML function ------ */

static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER;

int gem_resolve_nvml(void) {
    pthread_mutex_lock(&nvml_mu);
    static void *nvml;
    if (!nvml) {
        gem_dlsym_fn lookup = gem_real_dlsym();
        nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (nvml && lookup)
            for (int i = 0; i < GEM_FN_COUNT; i++)
                if (gem_fn_rows[i].lib == GEM_LIB_NVML && !gem_real_fn[i])
                    gem_real_fn[i] = lookup(nvml, gem_fn_rows[i].name);
    }
    pthread_mutex_unlock(&nvml_mu);
    return nvml ? 0 : -1;
}

void gem_real_after_fork(void) {
    /* A thread of the parent may have held the lock, or been resolving libcuda, at the fork. */
    pthread_mutex_init(&nvml_mu, NULL);
    if (!atomic_load(&gem_real_ready))
        resolve_once = (pthread_once_t)PTHREAD_ONCE_INIT; /* resolving was not done: the child starts over */
}
