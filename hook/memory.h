/*
 * memory.h -- memory accounting and limits: every allocation is reserved with
 * the group's pod manager first (the wrappers are in memory.c).
 */
#ifndef GEMINI_MEMORY_H
#define GEMINI_MEMORY_H

#include <stdint.h>

#include "cuda_types.h"
#include "device.h"

/* After a synchronising call of the program (wrappers.c): pools may have returned memory to the device. */
void gem_memory_on_sync(void);

/* The allocation modules beside this one (vmm.c) reserve through these: gem_memory_reserve returns CUDA_SUCCESS
 * or what the allocation must return (out of memory, or the pod manager unreachable); accounting() says whether
 * this process's calls are accounted at all (not when disabled, failing open, or before CUDA is initialised). */
int gem_memory_accounting(void);
CUresult gem_memory_reserve(struct gem_device *d, uint64_t bytes, int kind);
void gem_memory_unreserve(struct gem_device *d, uint64_t bytes, int kind);

/* The driver freed what `ctx` held (context.c: cuCtxDestroy, primary context reset or last release). */
void gem_memory_context_gone(CUcontext ctx);

void gem_memory_after_fork(void);        /* the parent's allocations are not the child's */

#endif /* GEMINI_MEMORY_H */
