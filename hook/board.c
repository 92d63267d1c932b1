/*
 * board.c -- the board page's protocol: publishing slots (seqlock), claims (atomics), turn and group waiters.
 */
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "board.h"

/* A claim began or ended: raise the sequence and wake the batch hooks' claim mirrors sleeping on it (a shared
 * futex: the page is a shared mapping in every process). A failed wake only delays a mirror to its timeout. */
static void claims_changed(struct gem_board *b) {
    __atomic_add_fetch(&b->claims.claim_seq, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &b->claims.claim_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

GEM_EXPORT void gemhook_board_init(struct gem_board *b, int32_t scheduler_pid, uint64_t generation) {
    memset(b, 0, sizeof *b);
    b->head.version = GEM_BOARD_VERSION;
    b->head.line = GEM_BOARD_LINE;
    b->head.groups = GEM_BOARD_GROUPS;
    b->head.scheduler_pid = scheduler_pid;
    b->head.generation = generation;
    b->claims.features = GEM_BOARD_FEATURE_CLAIM_SEQ;
    /* the magic last: a reader that sees it sees an initialised page */
    __atomic_store_n(&b->head.magic, (uint32_t)GEM_BOARD_MAGIC, __ATOMIC_RELEASE);
}

GEM_EXPORT void gemhook_board_set_counts(struct gem_board *b, uint32_t latency_groups, uint32_t used_slots,
                                         uint32_t groups) {
    if (used_slots > GEM_BOARD_GROUPS)
        used_slots = GEM_BOARD_GROUPS;
    __atomic_store_n(&b->claims.groups, groups, __ATOMIC_RELEASE);
    __atomic_store_n(&b->claims.latency_groups, latency_groups, __ATOMIC_RELEASE);
    __atomic_store_n(&b->claims.used_slots, used_slots, __ATOMIC_RELEASE);
}

/* One writer per slot (gem-schd): odd while writing, even when stable. */
GEM_EXPORT void gemhook_board_publish(struct gem_board *b, uint32_t slot, uint64_t token_seq, uint64_t prev_seq,
                                      int64_t deadline_ns) {
    if (slot >= GEM_BOARD_GROUPS)
        return;
    struct gem_board_group *g = &b->group[slot];
    uint32_t v = __atomic_load_n(&g->seq_lock, __ATOMIC_RELAXED);
    __atomic_store_n(&g->seq_lock, v + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&g->token_seq, token_seq, __ATOMIC_RELAXED);
    __atomic_store_n(&g->prev_seq, prev_seq, __ATOMIC_RELAXED);
    __atomic_store_n(&g->deadline_ns, deadline_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&g->seq_lock, v + 2, __ATOMIC_RELEASE);
}

/* Returns 1 with a consistent snapshot, 0 if the slot does not exist or kept changing. */
GEM_EXPORT int gemhook_board_read(const struct gem_board *b, uint32_t slot, uint64_t *token_seq,
                                  uint64_t *prev_seq, int64_t *deadline_ns) {
    if (!b || slot >= GEM_BOARD_GROUPS)
        return 0;
    const struct gem_board_group *g = &b->group[slot];
    for (int tries = 0; tries < 64; tries++) {
        uint32_t v1 = __atomic_load_n(&g->seq_lock, __ATOMIC_ACQUIRE);
        if (v1 & 1)
            continue;
        uint64_t seq = __atomic_load_n(&g->token_seq, __ATOMIC_RELAXED);
        uint64_t prev = __atomic_load_n(&g->prev_seq, __ATOMIC_RELAXED);
        int64_t deadline = __atomic_load_n(&g->deadline_ns, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&g->seq_lock, __ATOMIC_RELAXED) == v1) {
            *token_seq = seq;
            *prev_seq = prev;
            *deadline_ns = deadline;
            return 1;
        }
    }
    return 0;
}

/* A claim until `until_ns`: the slot's line, then the page-wide latest end (raised, never lowered here). */
GEM_EXPORT void gemhook_board_claim(struct gem_board *b, uint32_t slot, int64_t until_ns) {
    if (slot >= GEM_BOARD_GROUPS)
        return;
    __atomic_store_n(&b->group[slot].claim_until_ns, until_ns, __ATOMIC_SEQ_CST);
    int64_t cur = __atomic_load_n(&b->claims.claim_until_ns, __ATOMIC_SEQ_CST);
    while (cur < until_ns &&
           !__atomic_compare_exchange_n(&b->claims.claim_until_ns, &cur, until_ns, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
        ;
    claims_changed(b);
}

/* The claim of `slot` is over: clear its line and set the page-wide end to the latest remaining claim. If
 * another claim raises it meanwhile, the compare-and-swap fails and the maximum is taken again. */
GEM_EXPORT void gemhook_board_unclaim(struct gem_board *b, uint32_t slot) {
    if (slot < GEM_BOARD_GROUPS)
        __atomic_store_n(&b->group[slot].claim_until_ns, 0, __ATOMIC_SEQ_CST);
    uint32_t used = __atomic_load_n(&b->claims.used_slots, __ATOMIC_ACQUIRE);
    if (used > GEM_BOARD_GROUPS)
        used = GEM_BOARD_GROUPS;
    int64_t cur = __atomic_load_n(&b->claims.claim_until_ns, __ATOMIC_SEQ_CST);
    for (;;) {
        int64_t latest = 0;
        for (uint32_t i = 0; i < used; i++) {
            int64_t t = __atomic_load_n(&b->group[i].claim_until_ns, __ATOMIC_SEQ_CST);
            if (t > latest)
                latest = t;
        }
        if (__atomic_compare_exchange_n(&b->claims.claim_until_ns, &cur, latest, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            claims_changed(b);
            return;
        }
    }
}

GEM_EXPORT int64_t gemhook_board_claim_until(const struct gem_board *b) { return gem_board_claim_until(b); }

GEM_EXPORT void gemhook_board_set_waiters(struct gem_board *b, uint32_t slot, uint32_t waiters) {
    if (slot < GEM_BOARD_GROUPS)
        __atomic_store_n(&b->group[slot].turn_waiters, waiters, __ATOMIC_RELEASE);
}

GEM_EXPORT uint32_t gemhook_board_waiters(const struct gem_board *b, uint32_t slot) {
    return slot < GEM_BOARD_GROUPS ? __atomic_load_n(&b->group[slot].turn_waiters, __ATOMIC_ACQUIRE) : 0;
}

GEM_EXPORT void gemhook_board_set_groups_waiting(struct gem_board *b, uint32_t waiting) {
    __atomic_store_n(&b->claims.groups_waiting, waiting, __ATOMIC_RELEASE);
}

GEM_EXPORT uint32_t gemhook_board_groups_waiting(const struct gem_board *b) {
    return __atomic_load_n(&b->claims.groups_waiting, __ATOMIC_ACQUIRE);
}

GEM_EXPORT void gemhook_board_request_evict(struct gem_board *b, uint32_t slot, uint64_t evict_seq) {
    if (slot < GEM_BOARD_GROUPS)
        __atomic_store_n(&b->group[slot].evict_seq, evict_seq, __ATOMIC_RELEASE);
}

GEM_EXPORT uint64_t gemhook_board_evict_seq(const struct gem_board *b, uint32_t slot) {
    return slot < GEM_BOARD_GROUPS ? __atomic_load_n(&b->group[slot].evict_seq, __ATOMIC_ACQUIRE) : 0;
}

GEM_EXPORT void gemhook_board_mark_moved(struct gem_board *b, uint32_t slot) {
    if (slot < GEM_BOARD_GROUPS)
        __atomic_store_n(&b->group[slot].moved, 1, __ATOMIC_RELEASE);
}

GEM_EXPORT uint32_t gemhook_board_moved(const struct gem_board *b, uint32_t slot) {
    return slot < GEM_BOARD_GROUPS ? __atomic_load_n(&b->group[slot].moved, __ATOMIC_ACQUIRE) : 0;
}

/* A latency group's pod manager: its hooks' flares count (up) or not. Mirrors look for flare pages again, now. */
GEM_EXPORT void gemhook_board_set_flare(struct gem_board *b, uint32_t slot, uint32_t up) {
    if (slot >= GEM_BOARD_GROUPS)
        return;
    __atomic_store_n(&b->group[slot].flare, up ? 1u : 0u, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&b->claims.flare_gen, 1, __ATOMIC_SEQ_CST);
    claims_changed(b);
}

GEM_EXPORT uint32_t gemhook_board_flare(const struct gem_board *b, uint32_t slot) {
    return slot < GEM_BOARD_GROUPS ? __atomic_load_n(&b->group[slot].flare, __ATOMIC_ACQUIRE) : 0;
}

/* ---- a latency group's flare page (gemini_proto.h) ---- */

GEM_EXPORT void gemhook_flare_init(struct gem_flare *f, uint32_t slot, uint64_t generation) {
    memset(f, 0, sizeof *f);
    f->slot = slot;
    f->generation = generation;
    __atomic_store_n(&f->magic, (uint32_t)GEM_FLARE_MAGIC, __ATOMIC_RELEASE);
}

/* The flare's sequence is raised and its sleepers woken. Every writer of the page does this after a change, and
 * the group's pod manager after each claim and unclaim, so that a mirror sleeping on it misses nothing. */
GEM_EXPORT void gemhook_flare_changed(struct gem_flare *f) {
    __atomic_add_fetch(&f->seq, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &f->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* A hook's early burst: batch work holds until `until_ns` (the latest of the group's flares). */
GEM_EXPORT void gemhook_flare_raise(struct gem_flare *f, int64_t until_ns) {
    int64_t cur = __atomic_load_n(&f->until_ns, __ATOMIC_SEQ_CST);
    while (cur < until_ns &&
           !__atomic_compare_exchange_n(&f->until_ns, &cur, until_ns, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        ;
    __atomic_add_fetch(&f->raises, 1, __ATOMIC_SEQ_CST);
    gemhook_flare_changed(f);
}

/* The hook's early burst was answered (its claim is on the board now, or it got none): its flare comes down,
 * unless another of the group's hooks raised it further meanwhile. */
GEM_EXPORT void gemhook_flare_lower(struct gem_flare *f, int64_t until_ns) {
    int64_t cur = until_ns;
    if (__atomic_compare_exchange_n(&f->until_ns, &cur, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        gemhook_flare_changed(f);
}

GEM_EXPORT int64_t gemhook_flare_until(const struct gem_flare *f) {
    return __atomic_load_n(&f->until_ns, __ATOMIC_ACQUIRE);
}

GEM_EXPORT uint64_t gemhook_flare_raises(const struct gem_flare *f) {
    return __atomic_load_n(&f->raises, __ATOMIC_ACQUIRE);
}
