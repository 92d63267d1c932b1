/*
 * residency.h -- unified groups (MemoryMode = unified): the process's managed allocations and where they are.
 *
 * In a unified group the allocations the hook counts (plain, pitch, stream-ordered, pool) are made as
 * managed memory (memory.c calls in here). This file records them, moves them to the GPU when the group is
 * granted the GPU, before its first kernel (gate.c calls gem_residency_on_grant), and to the host when the
 * group's pod manager asks on the board (the watcher calls gem_residency_poll). Nothing here is on the
 * launch path.
 */
#ifndef GEMINI_RESIDENCY_H
#define GEMINI_RESIDENCY_H

#include <stdint.h>

#include "cuda_types.h"
#include "device.h"
#include "util.h"

/* Is the device's group unified? Connects to the pod manager first if the process has not yet. The first
 * time it says yes, the eviction requests already on the board are taken as answered (they came before any of
 * this process's memory was counted); memory.c asks before it reserves an allocation. */
int gem_residency_unified(struct gem_device *d);

/* Allocate `bytes` of managed memory for a unified group and record it. `async`: it stands in for a
 * stream-ordered allocation, so its free (cuMemFreeAsync) must wait for the stream and free it here.
 * CUDA_ERROR_NOT_SUPPORTED (and a clear log line) on a device without concurrent managed access. */
CUresult gem_residency_alloc(struct gem_device *d, CUdeviceptr *dptr, size_t bytes, int async);
/* Record managed memory the program allocated itself in a unified group. */
void gem_residency_record(struct gem_device *d, CUdeviceptr ptr, uint64_t bytes);
/* Forget an allocation about to be freed: 0 if not recorded, 1 if recorded, 2 if it stands in for a
 * stream-ordered allocation (then free it with gem_residency_free_async). */
int gem_residency_forget(CUdeviceptr ptr);
/* Free a managed stand-in for a stream-ordered allocation: after the work queued on `stream`. */
CUresult gem_residency_free_async(CUdeviceptr ptr, CUstream stream, int ptsz);

/* A grant arrived: move the device's managed allocations that are not on the GPU there, and wait for
 * them. Called by the thread that asked for the token, before its first kernel in the slot. */
void gem_residency_on_grant(struct gem_device *d);
/* Is there anything on_grant would move (cheap)? */
int gem_residency_wants_grant(struct gem_device *d);
/* A grant found nothing to move (nothing allocated yet, or everything on the GPU): what is allocated from now on
 * is first touched on the GPU, so it counts resident, as after a move there (else a process granted before its
 * first allocation reported none of what it allocated in its slot as moved when evicted). Cheap; takes only the
 * record's lock. */
void gem_residency_granted_in_place(struct gem_device *d);
/* From the watcher: if the pod manager asked (board), move the managed allocations to the host in `ctx`
 * (the context launches were made in; NULL for a process never granted the GPU: then the context of its last
 * allocation) and report it. Returns when to look again (CLOCK_MONOTONIC ns). The watcher runs from the
 * process's first managed allocation (memory.c: gem_gate_watch_residency), granted or not. */
int64_t gem_residency_poll(struct gem_device *d, CUcontext ctx, int64_t now);

/* ---- an eviction delegate (exported: called from the process itself, e.g. gemini/unified_torch.py) ----
 * A process whose framework keeps freed memory cached (PyTorch's caching allocator) can register a delegate
 * that frees that cache before an eviction, so that only memory in use is moved to the host and back. While
 * one is registered, the watcher that sees a new eviction request hands out a ticket and moves nothing until
 * the delegate releases that ticket (or a later one) or GEM_DELEGATE_WAIT_NS have passed; then it moves what
 * is still allocated, as without a delegate. Nothing changes while none is registered. The value handed out is
 * a ticket, not the board's evict_seq: evict_seqs are counted per GPU and cannot be compared across them, the
 * tickets are the process's and increase. */
#define GEM_DELEGATE_WAIT_NS (1 * GEM_NS_PER_S)
/* on = 1 registers the delegate, 0 unregisters it (a held eviction then goes ahead at the next poll). 0. */
GEM_EXPORT int gemhook_residency_delegate(int on);
/* The ticket of an eviction held for the delegate, 0 if none. */
GEM_EXPORT uint64_t gemhook_residency_pending(void);
/* Wait up to timeout_ns for a held eviction; its ticket, or 0 (so a delegate thread sleeps in here and costs
 * nothing between evictions; ctypes releases the GIL for the call). */
GEM_EXPORT uint64_t gemhook_residency_wait(int64_t timeout_ns);
/* The delegate is done with `ticket` and every earlier one: the evictions they held go ahead. */
GEM_EXPORT void gemhook_residency_release(uint64_t ticket);

/* A context was destroyed or reset: the hook's move stream in it is gone too. */
void gem_residency_context_gone(CUcontext ctx);
void gem_residency_after_fork(void);     /* the parent's allocations are not the child's */

#endif /* GEMINI_RESIDENCY_H */
