/*
 * wrappers.c -- the generated wrappers of the uniform rows of hook_table.h:
 *
 *   LAUNCH         gate (gate.h's gem_gate_launch), then the real launch
 *   GRAPH_LAUNCH   the same; a graph is one unit of queued work
 *   SYNC           the real call, then each module's sync hook: the burst is
 *                  over (gate), pools may have shrunk (memory)
 *   CAPTURE_*      the real call (a begin waits while the hook drains), then
 *                  the capture table (capture.h)
 *
 * It has no header of its own: nothing calls these but the program, and
 * hook_exports.h declares them (symbols.c hands them out).
 */
#define _GNU_SOURCE
#include "capture.h"
#include "gate.h"
#include "memory.h"
#include "real.h"
#include "hook_exports.h"

/* Each gated row's kernel and grid size (kcost.h: the markers beside a latency group follow what they cost) */
#define GEM_GRID_BLOCKS ((uint64_t)gridDimX * gridDimY * gridDimZ)
#define GEM_KERNEL_cuLaunchKernel f, GEM_GRID_BLOCKS
#define GEM_KERNEL_cuLaunchKernel_ptsz f, GEM_GRID_BLOCKS
#define GEM_KERNEL_cuLaunchCooperativeKernel f, GEM_GRID_BLOCKS
#define GEM_KERNEL_cuLaunchCooperativeKernel_ptsz f, GEM_GRID_BLOCKS
#define GEM_EX_BLOCKS (config ? (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ : 0)
#define GEM_KERNEL_cuLaunchKernelEx f, GEM_EX_BLOCKS
#define GEM_KERNEL_cuLaunchKernelEx_ptsz f, GEM_EX_BLOCKS
#define GEM_KERNEL_cuGraphLaunch NULL, 0
#define GEM_KERNEL_cuGraphLaunch_ptsz NULL, 0

#define GEM_WRAP_GATED(name, pt, params, args, stream, graph)                                   \
    GEM_EXPORT CUresult name params {                                                           \
        CUresult gate_rc = gem_gate_launch((stream), pt, graph, GEM_KERNEL_##name);             \
        if (GEM_UNLIKELY(gate_rc != CUDA_SUCCESS))                                              \
            return gate_rc;                                                                     \
        gem_fn_##name##_t *real = REAL(name);                                                   \
        return GEM_LIKELY(real != NULL) ? real args : CUDA_ERROR_NOT_SUPPORTED;                 \
    }
#define GEM_WRAP_LAUNCH(name, pt, params, args, stream) GEM_WRAP_GATED(name, pt, params, args, stream, 0)
#define GEM_WRAP_GRAPH_LAUNCH(name, pt, params, args, stream) GEM_WRAP_GATED(name, pt, params, args, stream, 1)
#define GEM_WRAP_SYNC(name, pt, params, args, scope)                                            \
    GEM_EXPORT CUresult name params {                                                           \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        /* only a context-wide synchronisation leaves the GPU with nothing of the process's */   \
        const int whole = sizeof(#name) >= 17 && __builtin_memcmp(#name, "cuCtxSynchronize", 16) == 0; \
        /* a stream's own synchronisation empties that stream's queue (its marker chain restarts) */ \
        const int one_stream = sizeof(#name) >= 20 && __builtin_memcmp(#name, "cuStreamSynchronize", 19) == 0; \
        CUcontext sync_ctx = whole ? (CUcontext)(void *)(scope) : NULL;                         \
        int64_t began = 0;                                                                      \
        if (whole || one_stream)                                                                \
            gem_gate_end_unit_before_sync(whole, (CUstream)(void *)(scope), pt);                \
        if (whole)                                                                              \
            gem_gate_before_sync(sync_ctx);                                                     \
        if (whole || one_stream)                                                                \
            began = gem_now_ns();                                                               \
        CUresult rc = REAL(name) args;                                                          \
        /* what the hook adds after the GPU is done and before the program runs on (sync_tail_ms) */ \
        int64_t returned = (whole || one_stream) ? gem_now_ns() : 0;                            \
        gem_gate_on_sync(sync_ctx, whole, rc == CUDA_SUCCESS ? began : 0);                      \
        if (one_stream && rc == CUDA_SUCCESS)                                                   \
            gem_gate_on_stream_sync((CUstream)(void *)(scope), pt, began);                      \
        gem_memory_on_sync();                                                                   \
        if (whole || one_stream)                                                                \
            gem_stats_sync_tail(returned);                                                      \
        return rc;                                                                              \
    }
#define GEM_WRAP_CAPTURE(name, pt, params, args, stream, begins)                                \
    GEM_EXPORT CUresult name params {                                                           \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        if (begins)                                                                             \
            gem_capture_before_begin(); /* not while the hook drains */                         \
        CUresult rc = REAL(name) args;                                                          \
        gem_capture_changed((stream), (begins), pt, rc);                                        \
        return rc;                                                                              \
    }
#define GEM_WRAP_CAPTURE_BEGIN(name, pt, params, args, stream) GEM_WRAP_CAPTURE(name, pt, params, args, stream, 1)
#define GEM_WRAP_CAPTURE_END(name, pt, params, args, stream) GEM_WRAP_CAPTURE(name, pt, params, args, stream, 0)
#define GEM_WRAP_NONE(...)
#define GEM_WRAP_ALLOC_ASYNC GEM_WRAP_NONE     /* memory.c */
#define GEM_WRAP_ALLOC_FROM_POOL GEM_WRAP_NONE /* memory.c */
#define GEM_WRAP_CUSTOM GEM_WRAP_NONE
#define GEM_WRAP_REAL GEM_WRAP_NONE

#define GEM_WRAP_ROW(kind, lib, ret, name, since, pt, params, args, extra) \
    GEM_WRAP_##kind(name, pt, params, args, extra)
GEM_HOOK_TABLE(GEM_WRAP_ROW)
