/*
 * board.h -- how the board page is written and read (gemini_proto.h declares its layout).
 *
 * gem-schd and the pod managers write the board through these functions (loaded with cffi), the hook
 * reads it, so both sides follow one protocol. A group's slot (token_seq, prev_seq, deadline) is
 * published under a seqlock, so a reader never sees half of an update; claims are atomics. The functions
 * take the mapped page and touch nothing else.
 */
#ifndef GEMINI_BOARD_H
#define GEMINI_BOARD_H

#include <stdint.h>

#include "gemini_proto.h"
#include "util.h"

/* cffi-begin */
GEM_EXPORT void gemhook_board_init(struct gem_board *b, int32_t scheduler_pid, uint64_t generation);
GEM_EXPORT void gemhook_board_set_counts(struct gem_board *b, uint32_t latency_groups, uint32_t used_slots,
                                         uint32_t groups);
GEM_EXPORT void gemhook_board_publish(struct gem_board *b, uint32_t slot, uint64_t token_seq, uint64_t prev_seq,
                                      int64_t deadline_ns);
GEM_EXPORT int gemhook_board_read(const struct gem_board *b, uint32_t slot, uint64_t *token_seq,
                                  uint64_t *prev_seq, int64_t *deadline_ns);
GEM_EXPORT void gemhook_board_claim(struct gem_board *b, uint32_t slot, int64_t until_ns);
GEM_EXPORT void gemhook_board_unclaim(struct gem_board *b, uint32_t slot);
GEM_EXPORT int64_t gemhook_board_claim_until(const struct gem_board *b);
GEM_EXPORT void gemhook_board_set_waiters(struct gem_board *b, uint32_t slot, uint32_t waiters);
GEM_EXPORT uint32_t gemhook_board_waiters(const struct gem_board *b, uint32_t slot);
GEM_EXPORT void gemhook_board_set_groups_waiting(struct gem_board *b, uint32_t waiting);
GEM_EXPORT uint32_t gemhook_board_groups_waiting(const struct gem_board *b);
GEM_EXPORT void gemhook_board_request_evict(struct gem_board *b, uint32_t slot, uint64_t evict_seq);
GEM_EXPORT uint64_t gemhook_board_evict_seq(const struct gem_board *b, uint32_t slot);
GEM_EXPORT void gemhook_board_mark_moved(struct gem_board *b, uint32_t slot);
GEM_EXPORT uint32_t gemhook_board_moved(const struct gem_board *b, uint32_t slot);
GEM_EXPORT void gemhook_board_set_flare(struct gem_board *b, uint32_t slot, uint32_t up);
GEM_EXPORT uint32_t gemhook_board_flare(const struct gem_board *b, uint32_t slot);
GEM_EXPORT void gemhook_flare_init(struct gem_flare *f, uint32_t slot, uint64_t generation);
GEM_EXPORT void gemhook_flare_raise(struct gem_flare *f, int64_t until_ns);
GEM_EXPORT void gemhook_flare_lower(struct gem_flare *f, int64_t until_ns);
GEM_EXPORT void gemhook_flare_changed(struct gem_flare *f);
GEM_EXPORT int64_t gemhook_flare_until(const struct gem_flare *f);
GEM_EXPORT uint64_t gemhook_flare_raises(const struct gem_flare *f);
/* cffi-end */

/* The launch path's read: a relaxed load of one word on a line that changes only when a claim starts or
 * ends (so it stays in every core's cache between claims). */
static inline int64_t gem_board_claim_until(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.claim_until_ns, __ATOMIC_RELAXED);
}

/* What the page's writers keep up (GEM_BOARD_FEATURE_*), set before the magic. */
static inline uint32_t gem_board_features(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.features, __ATOMIC_RELAXED);
}

/* The longest a batch process honours one claim, whether it pauses its launches (gate.c) or holds its stream on
 * the GPU (gpugate.c): a claim whose end is wrong (a pod manager's bug, another clock) must not hold it, and
 * every synchronisation behind it, for longer. */
#define GEM_CLAIM_HOLD_MAX_NS (2 * GEM_NS_PER_S)

/* Raised at every claim and unclaim (a futex word: a claim mirror sleeps on it between changes). */
static inline uint32_t gem_board_claim_seq(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.claim_seq, __ATOMIC_ACQUIRE);
}

/* How many latency groups the config holds (gem-schd writes it at every reload): a continuation, which brings no
 * grant flags, reads it to keep a batch holder's queue as short as claims need. */
static inline uint32_t gem_board_latency_groups(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.latency_groups, __ATOMIC_ACQUIRE);
}

/* How many groups the config holds (written with the count above; 0: a gem-schd that does not say). */
static inline uint32_t gem_board_groups(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.groups, __ATOMIC_ACQUIRE);
}

/* The longest ahead a flare counts (a flare that says it lasts longer is a bug or a lie, and holds nobody): an early
 * claim's launches go at most GEMINI_EARLY_CLAIM_MS ahead of its answer, as its charge does (MAX_CLAIM_AHEAD_MS). */
#define GEM_FLARE_MAX_NS (5 * GEM_NS_PER_MS)

/* A flare's end if it holds batch work at `now`, else 0. */
static inline int64_t gem_flare_holds(const struct gem_flare *f, int64_t now) {
    int64_t until = __atomic_load_n(&f->until_ns, __ATOMIC_ACQUIRE);
    return (until > now && until - now <= GEM_FLARE_MAX_NS) ? until : 0;
}

static inline uint32_t gem_flare_seq(const struct gem_flare *f) {
    return __atomic_load_n(&f->seq, __ATOMIC_ACQUIRE);
}

/* Raised whenever a group line's flare word changes. */
static inline uint32_t gem_board_flare_gen(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.flare_gen, __ATOMIC_ACQUIRE);
}

#endif /* GEMINI_BOARD_H */
