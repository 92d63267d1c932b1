/*
 * kcost.c -- the kernel cost table (kcost.h).
 */
#include "kcost.h"
#include "stats.h"

_Atomic uint64_t gem_kcost_table[GEM_KCOST_SETS * GEM_KCOST_WAYS];

#define COST_MASK ((1ull << GEM_KCOST_COST_BITS) - 1)

static uint64_t entry(uint64_t tag, int64_t us) {
    if (us < 1)
        us = 1;     /* 0 means unknown */
    if ((uint64_t)us > COST_MASK)
        us = (int64_t)COST_MASK;
    return tag << GEM_KCOST_COST_BITS | (uint64_t)us;
}

int gem_kcost_learn(uint64_t key, int64_t ns, int exact) {
    if (!key || ns <= 0)
        return 0;
    uint64_t tag = key >> GEM_KCOST_COST_BITS;
    _Atomic uint64_t *set = &gem_kcost_table[(key & (GEM_KCOST_SETS - 1)) * GEM_KCOST_WAYS];
    int64_t us = (ns + 999) / 1000;
    for (int tries = 0; tries < 4; tries++) {
        _Atomic uint64_t *slot = NULL, *empty = NULL;
        for (unsigned i = 0; i < GEM_KCOST_WAYS && !slot; i++) {
            uint64_t e = atomic_load(&set[i]);
            if (e >> GEM_KCOST_COST_BITS == tag)
                slot = &set[i];
            else if (!e && !empty)
                empty = &set[i];
        }
        if (!slot) {
            /* a new key: a free way, else the way its own bits pick (a table this full is rare; the evicted key
             * is measured again when it comes back) */
            uint64_t want = entry(tag, us);
            _Atomic uint64_t *victim = empty ? empty : &set[(key >> 10) % GEM_KCOST_WAYS];
            uint64_t old = atomic_load(victim);
            if ((empty && old) || !atomic_compare_exchange_strong(victim, &old, want))
                continue;
            return 0;
        }
        uint64_t old = atomic_load(slot);
        if (old >> GEM_KCOST_COST_BITS != tag)
            continue;
        int64_t have = (int64_t)(old & COST_MASK), next;
        if (exact)
            next = us >= have ? us : have - (have - us) / 4;
        else
            next = us < have ? us : have;
        if (next == have)
            return 0;
        if (atomic_compare_exchange_strong(slot, &old, entry(tag, next)))
            return exact && 2 * us < next;  /* it came down, and is still more than twice the measure */
    }
    return 0;
}

void gem_kcost_verify_thread(void) {
    struct gem_thread_counter *t = gem_tls_counter;
    if (t && t->verifying < (int)GEM_KCOST_VERIFY) {
        t->verifying = GEM_KCOST_VERIFY;
        atomic_fetch_add_explicit(&gem_stats.kernel_cost_checks, 1, memory_order_relaxed);
    }
}

void gem_kcost_remeasure(const void *thread, uint64_t key) {
    struct gem_thread_counter *t = gem_tls_counter;
    if (t && (const void *)t == thread && t->remeasure_key != key) {
        t->remeasure_key = key;
        atomic_fetch_add_explicit(&gem_stats.kernel_cost_remeasures, 1, memory_order_relaxed);
    }
}

void gem_kcost_after_fork(void) {
    for (unsigned i = 0; i < GEM_KCOST_SETS * GEM_KCOST_WAYS; i++)
        atomic_store_explicit(&gem_kcost_table[i], 0, memory_order_relaxed);
}

int gemhook_kcost_learn(uint64_t key, int64_t ns, int exact) { return gem_kcost_learn(key, ns, exact); }
int64_t gemhook_kcost_get(uint64_t key) { return gem_kcost_get(key); }
void gemhook_kcost_clear(void) { gem_kcost_after_fork(); }
