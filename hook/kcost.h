/*
 * kcost.h -- what each kernel costs the GPU, learnt from marker intervals that held it alone (inflight.c).
 *
 * Beside a latency group a batch stream waits on the GPU-side gate before each marker, and a claim takes effect
 * at the next wait: a request waits for the batch work queued up to it. A marker every N launches bounds that
 * work only when the kernels are alike. An eager trainer's are not (ResNet-18: p50 12 us, p99 0.36 ms, 28% of
 * its busy time in kernels over 0.25 ms), so a rate grown on the short ones put milliseconds of long ones between
 * two waits: on the H100 about one MLP request in ten waited 1-2.5 ms for its first kernel, as under plain
 * time-slicing (docs/benchmarks.md, sixteenth session). So while the markers carry the gate's waits a marker
 * goes before the launch that would bring the predicted GPU time since the last one past gem_kcost_target_ns(), and
 * each (function, grid size) gets its prediction from an interval that held it alone: a marker before it, and its
 * end recorded first thing at the same thread's next marker, or before a synchronisation of its stream or context,
 * whichever comes first (inflight.c, unit_end). A kernel not in the table is measured that way at once, one launch
 * in GEM_KCOST_RELEARN of a thread measures a known kernel again (lengths change with the shapes a program runs), a
 * kernel predicted past the target on its own is measured at each launch (it has a marker on both sides anyway:
 * gate.h), and one whose cost a measure brought down, still above twice the measure, at its thread's next launch
 * of it (gem_kcost_learn, gem_kcost_remeasure).
 *
 * The table is process-wide and fixed (GEM_KCOST_SETS sets of 4 entries); an entry is one 64-bit word (a tag of
 * the key's high bits and the cost in microseconds), so the launch path reads it without a lock and never sees
 * half of an update. Learning writes it with compare-and-swap.
 */
#ifndef GEMINI_KCOST_H
#define GEMINI_KCOST_H

#include <stdatomic.h>
#include <stdint.h>

#include "settings.h"
#include "util.h"

#define GEM_KCOST_SETS 1024u
#define GEM_KCOST_WAYS 4u
#define GEM_KCOST_COST_BITS 20                  /* microseconds: up to about a second */
#define GEM_KCOST_RELEARN 1024u                 /* one launch in this many re-measures a known kernel (a power of 2) */

extern _Atomic uint64_t gem_kcost_table[GEM_KCOST_SETS * GEM_KCOST_WAYS];

/* The key of a launch: its function and grid size (the same function runs far longer on a larger grid). Never 0. */
static inline uint64_t gem_kcost_key(const void *fn, uint64_t blocks) {
    uint64_t h = (uint64_t)(uintptr_t)fn * 0x9E3779B97F4A7C15ull ^ (blocks + 1) * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 29;
    return h >> GEM_KCOST_COST_BITS ? h : h | (1ull << 63);
}

/* Whether the thread's n-th launch re-measures its kernel: one launch in GEM_KCOST_RELEARN, at positions a hash of n
 * picks (every 1024th of a loop whose length divides 1024 would measure the same kernel each time). */
static inline int gem_kcost_relearn(uint64_t n) {
    return (n * 0x9E3779B97F4A7C15ull) >> (64 - __builtin_ctz(GEM_KCOST_RELEARN)) == 0;
}

/* The predicted GPU time (ns) of a launch with this key; 0: not known yet. Four loads and compares. */
static inline int64_t gem_kcost_get(uint64_t key) {
    uint64_t tag = key >> GEM_KCOST_COST_BITS;
    const _Atomic uint64_t *set = &gem_kcost_table[(key & (GEM_KCOST_SETS - 1)) * GEM_KCOST_WAYS];
    for (unsigned i = 0; i < GEM_KCOST_WAYS; i++) {
        uint64_t e = atomic_load_explicit(&set[i], memory_order_relaxed);
        if (e >> GEM_KCOST_COST_BITS == tag)
            return (int64_t)(e & ((1ull << GEM_KCOST_COST_BITS) - 1)) * 1000;
    }
    return 0;
}

/* The predicted GPU time between two markers that a marker should not pass: half of GEMINI_INFLIGHT_MS, so a
 * claim waits for at most that much queued work and the kernel in flight. (A quarter put a marker every 3-4
 * launches of an eager ResNet-18 and cost it 7% beside an idle latency group on the H100; half is about the
 * count's marker rate: docs/benchmarks.md, sixteenth session.) */
static inline int64_t gem_kcost_target_ns(void) { return gem_cfg.inflight_ns / 2; }

/* Launches a thread measures alone, each, after its queue ran far longer than predicted (inflight.c). */
#define GEM_KCOST_VERIFY 64

/* The calling thread's queue ran far longer than its kernels' predicted costs: its next GEM_KCOST_VERIFY launches
 * are measured alone (stats.h's thread counter). */
void gem_kcost_verify_thread(void);

/* gem_kcost_learn asked for `key` to be measured again, from a unit of `thread` (its counter): if that is the
 * calling thread, its next launch of the key is measured alone (stats.h's remeasure_key). Another thread's
 * (a synchronisation learnt it) is left to the rules above: each thread's counter is its own. */
void gem_kcost_remeasure(const void *thread, uint64_t key);

/* A fork child's functions are its own: the parent's keys are forgotten. */
void gem_kcost_after_fork(void);

/* For tests (tests/test_hook_pure.py): the table's rules without a GPU. */
/* cffi-begin */
GEM_EXPORT int gemhook_kcost_learn(uint64_t key, int64_t ns, int exact);
GEM_EXPORT int64_t gemhook_kcost_get(uint64_t key);
GEM_EXPORT void gemhook_kcost_clear(void);
/* cffi-end */

/* A measurement of the key's kernel alone: `exact` when the GPU ran it back to back with the work around it, else
 * an upper bound (the interval may hold idle time). A longer exact one replaces the cost at once, a shorter one
 * moves it a quarter of the way (one short run must not bring back the long waits); an upper bound only lowers
 * a cost known. Returns 1 when an exact one brought the cost down and it is still more than twice the measure:
 * the key's next launch should be measured alone too (gem_kcost_remeasure), so a cost too long -- the kernel's
 * shapes changed, or a noisy measure -- comes down within a dozen or so launches of it, not at one launch in
 * GEM_KCOST_RELEARN (thousands at a marker each). Not GEM_KCOST_VERIFY launches: on a starved host each noisy
 * measure then cost 64 markers. Never asked for a cost the rounding holds still (a step under 1 us). */
int gem_kcost_learn(uint64_t key, int64_t ns, int exact);

#endif /* GEMINI_KCOST_H */
