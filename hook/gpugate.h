/*
 * gpugate.h -- holding a batch process's queued work back on the GPU itself while a latency group claims it.
 *
 * Stopping a batch process's launches during a claim leaves its queued work to run, time-sliced with the
 * claimer's request: a claim took effect only after that queue, so the queue had to stay one millisecond
 * short (GEMINI_INFLIGHT_MS), and an eager trainer's host pauses then idled the GPU. Instead, each batch
 * process owns one pinned word per GPU, mapped into the device, and puts a cuStreamWaitValue32(word == 0)
 * on a stream before each of its in-flight markers (inflight.c). A mirror thread of the process sleeps on
 * the board's claim sequence (a shared futex the pod managers wake at every claim and unclaim) and keeps the
 * word at 1 while the board shows a claim, 0 otherwise: the GPU stops the batch stream at its next wait,
 * one marker interval (normally an eighth to a quarter of GEMINI_INFLIGHT_MS of work) after the claim began,
 * whatever the queue's depth; the queue may then be as deep as a capped slot's (half the time left in it).
 *
 * The word is the process's own and only its mirror writes it: no other process can stop its work. The
 * mirror lowers the word when the claim's end (claim_until_ns) passes even if the board never says so, so
 * a claimer that died or hangs holds a batch stream no longer than the claim it was given, and any one claim
 * at most 2 s. Bad or missing
 * driver support (no stream memory operations, no host registration) turns the gate off for the process and
 * the queue stays short as before.
 */
#ifndef GEMINI_GPUGATE_H
#define GEMINI_GPUGATE_H

#include <stdatomic.h>
#include <stdint.h>

#include "cuda_types.h"
#include "gemini_proto.h"

enum { GEM_GPUGATE_UNSET = 0, GEM_GPUGATE_READY = 1, GEM_GPUGATE_FAILED = -1 };

struct gem_gpugate {
    atomic_int state;                       /* GEM_GPUGATE_*; FAILED: never tried again in this process */
    volatile uint32_t *word;                /* pinned, device-mapped; 1 holds the streams at their next wait */
    CUdeviceptr word_dev;
    CUcontext ctx;                          /* the context it was registered in (its teardown unregisters) */
    const struct gem_board *_Atomic board;  /* the claims mirrored (NULL: none, the word stays 0) */
    atomic_uint epoch;                      /* raised at every change of the word: odd while it is 1 */
    atomic_llong changed_ns;                /* when the word last changed */
    atomic_llong held_total_ns;             /* how long the word was up, the current claim not included */
};

/* The gate of GPU `ordinal`'s batch streams. */
struct gem_gpugate *gem_gpugate_of(int ordinal);

/* Mirror `board`'s claims (NULL: none: the word drops to 0). Called when a grant says whether the group is
 * batch class next to a latency group. Cheap when nothing changes. */
void gem_gpugate_follow(struct gem_gpugate *gg, const struct gem_board *board);

/* Whether markers may count on the gate: registered, and following a board. */
static inline int gem_gpugate_active(struct gem_gpugate *gg) {
    return atomic_load_explicit(&gg->state, memory_order_relaxed) == GEM_GPUGATE_READY &&
           atomic_load_explicit(&gg->board, memory_order_relaxed) != NULL;
}

/* Whether the word held the streams at any time since `since_ns` (up now, or changed since). */
static inline int gem_gpugate_held_since(struct gem_gpugate *gg, int64_t since_ns) {
    return (atomic_load(&gg->epoch) & 1) || atomic_load(&gg->changed_ns) >= since_ns;
}

/* How long the word has been up in all, until `now`: what a drain's time past its deadline owes to claims. */
static inline int64_t gem_gpugate_held_ns(struct gem_gpugate *gg, int64_t now) {
    for (;;) {   /* one writer (the mirror), which changes the epoch last: read again if it moved */
        unsigned e = atomic_load(&gg->epoch);
        int64_t total = atomic_load(&gg->held_total_ns), since = atomic_load(&gg->changed_ns);
        if (atomic_load(&gg->epoch) != e)
            continue;
        if ((e & 1u) && now > since)
            total += now - since;
        return total;
    }
}

/* Put a wait for the word on `s` (the caller's current context; no capture may be active). Registers the
 * word first if needed. Returns 1 if the wait is queued; 0 if the gate is off for the process (it says why
 * once). */
int gem_gpugate_wait(struct gem_gpugate *gg, CUstream s);

void gem_gpugate_context_gone(CUcontext ctx);   /* registrations made in ctx went with it */
void gem_gpugate_after_fork(void);              /* the child has no mirror thread and no registration */

#endif /* GEMINI_GPUGATE_H */
