/*
 * context.c -- context teardown gives a context's memory back to the group.
 *
 * The driver frees every allocation a context holds (cuMemAlloc, pitch, managed, arrays) when the context
 * goes: cuCtxDestroy for a context the program created; for a device's primary context (the CUDA runtime's),
 * cuDevicePrimaryCtxReset (what cudaDeviceReset calls), or the cuDevicePrimaryCtxRelease that drops its last
 * reference (the driver then resets it). memory.c records the context current at each allocation; here the
 * hook learns that a context went and hands its allocations back (gem_memory_context_gone).
 *
 * A primary context is named by its device. Its handle is read before the call (cuDevicePrimaryCtxGetState:
 * an inactive primary context holds nothing; an active one's handle comes from a retain and release of the
 * real functions, which changes nothing), and after a release the state says whether it was the last one.
 * Both the original entry points and their _v2 variants (what cuGetProcAddress returns from CUDA 11) are
 * wrapped.
 */
#define _GNU_SOURCE
#include "context.h"
#include "gate.h"
#include "hook_exports.h"
#include "memory.h"
#include "real.h"
#include "residency.h"

#define NEED_REAL(name)                                                     \
    do {                                                                    \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))       \
            return CUDA_ERROR_NOT_INITIALIZED;                              \
    } while (0)

/* Is the device's primary context active (holding a reference, so possibly memory)? */
static int primary_active(CUdevice dev) {
    unsigned int flags = 0;
    int active = 0;
    return HAVE_REAL(cuDevicePrimaryCtxGetState) && REAL(cuDevicePrimaryCtxGetState)(dev, &flags, &active) ==
           CUDA_SUCCESS && active;
}

/* The handle of the device's primary context if it is active (NULL otherwise: then it holds nothing). */
static CUcontext primary_handle(CUdevice dev) {
    if (!gem_memory_accounting() || !primary_active(dev) || !HAVE_REAL(cuDevicePrimaryCtxRetain))
        return NULL;
    CUcontext ctx = NULL;
    if (REAL(cuDevicePrimaryCtxRetain)(&ctx, dev) != CUDA_SUCCESS)
        return NULL;
    /* give the reference back; it was not the last (the context is active) */
    if (HAVE_REAL(cuDevicePrimaryCtxRelease_v2))
        REAL(cuDevicePrimaryCtxRelease_v2)(dev);
    else if (HAVE_REAL(cuDevicePrimaryCtxRelease))
        REAL(cuDevicePrimaryCtxRelease)(dev);
    return ctx;
}

static CUresult destroyed(CUresult rc, CUcontext ctx) {
    if (rc == CUDA_SUCCESS && ctx) {
        gem_gate_context_gone(ctx);         /* its measuring events and the drained context */
        gem_residency_context_gone(ctx);    /* the move stream */
        if (gem_memory_accounting())
            gem_memory_context_gone(ctx);
    }
    return rc;
}

GEM_EXPORT CUresult cuCtxDestroy(CUcontext ctx) {
    NEED_REAL(cuCtxDestroy);
    return destroyed(REAL(cuCtxDestroy)(ctx), ctx);
}

GEM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    NEED_REAL(cuCtxDestroy_v2);
    return destroyed(REAL(cuCtxDestroy_v2)(ctx), ctx);
}

GEM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    NEED_REAL(cuDevicePrimaryCtxReset);
    CUcontext ctx = primary_handle(dev);
    return destroyed(REAL(cuDevicePrimaryCtxReset)(dev), ctx);
}

GEM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    NEED_REAL(cuDevicePrimaryCtxReset_v2);
    CUcontext ctx = primary_handle(dev);
    return destroyed(REAL(cuDevicePrimaryCtxReset_v2)(dev), ctx);
}

/* A release frees the context only when it dropped the last reference: then the context is inactive. */
static CUresult released(CUresult rc, CUdevice dev, CUcontext ctx) {
    if (rc == CUDA_SUCCESS && ctx && !primary_active(dev))
        return destroyed(rc, ctx);
    return rc;
}

GEM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    NEED_REAL(cuDevicePrimaryCtxRelease);
    CUcontext ctx = primary_handle(dev);
    return released(REAL(cuDevicePrimaryCtxRelease)(dev), dev, ctx);
}

GEM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NEED_REAL(cuDevicePrimaryCtxRelease_v2);
    CUcontext ctx = primary_handle(dev);
    return released(REAL(cuDevicePrimaryCtxRelease_v2)(dev), dev, ctx);
}
