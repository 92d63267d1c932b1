/*
 * stats.h -- the hook's counters: printed at exit at log level info, appended
 * to GEMINI_STATS_FILE, readable inside the process through gemhook_stats.
 */
#ifndef GEMINI_STATS_H
#define GEMINI_STATS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

struct gem_stats {
    atomic_ullong grants, token_requests, waits, wait_ns, expiries, early_releases, overuse_ns,
        drains, drain_skipped_capture, gate_errors, capture_passthrough, burst_renewals,
        mem_allocs, mem_frees, mem_denied, mem_rollbacks, mem_errors, mem_recounts, dlsym_routed, procaddr_routed,
        procaddr_fallback, procaddr_unrouted, reconnects, slots_measured, used_ns, continuations, claim_pauses,
        claim_pause_ns, markers, marker_waits, marker_wait_ns, turn_passes, marker_grows, marker_shrinks,
        marker_sync_shrinks, marker_intervals, marker_interval_ns, idle_ns, group_passes, quick_claim_releases,
        early_claims, early_claim_lag_ns, flares, withdrawals, board_moves, gpu_gate_waits, gpu_gate_raises, gpu_gate_failures,
        kernels_measured, kernel_costs_learnt, kernel_cost_checks, kernel_cost_remeasures, kernel_cost_learnt_ns,
        marker_host_ns, markers_timed,
        syncs, sync_tail_ns, burst_begin_ns, watcher_wakes, gaps_timed, gaps_estimated;
};
extern struct gem_stats gem_stats;

/* Launches are counted per thread so the launch path never touches a shared cache line. */
struct gem_thread_counter {
    uint64_t launches;
    /* beside a latency group (gate.h, kcost.h): the predicted GPU time launched since this thread's last marker,
     * and whether that marker went before a kernel to be measured alone (the next launch ends its interval) */
    int64_t pending_ns;
    int isolating;
    /* a kernel (not a graph) is being measured alone, its end not recorded yet, on unit_stream (CU_STREAM_PER_THREAD
     * for the thread's own): a synchronisation of that stream or of the context records it first (gate.h) */
    int measuring;
    void *unit_stream;
    /* launches still to be measured alone, each, since a queue ran far longer than its kernels' predicted costs
     * (a kernel whose length changed under the same key): the one that did is measured again */
    int verifying;
    /* a key whose cost came down but is still more than twice its last measure: its next launch on this thread is
     * measured alone (kcost.h, gem_kcost_remeasure; 0: none) */
    uint64_t remeasure_key;
    /* `launches` at the thread's last context-wide synchronisation (inflight.c: a wait that ended launches of its own
     * judges the marker rate even with no marker among them) */
    uint64_t launches_at_sync;
    struct gem_thread_counter *next;
};
/* initial-exec: a plain %fs-relative load on the launch path instead of a __tls_get_addr call */
extern __thread struct gem_thread_counter *gem_tls_counter __attribute__((tls_model("initial-exec")));
struct gem_thread_counter *gem_register_thread_counter(void);
/* Counts a launch; returns the thread's count so far (the gate asks for a marker every N of them). */
static inline uint64_t gem_count_launch(void) {
    struct gem_thread_counter *c = gem_tls_counter;
    if (GEM_UNLIKELY(c == NULL))
        c = gem_register_thread_counter();
    return ++c->launches;
}
uint64_t gem_total_launches(void);

/* A synchronisation of the program's that returned from the driver at `returned_ns`: the hook's own time
 * after it (the gap it adds between the GPU's last kernel and the program's next launch). */
static inline void gem_stats_sync_tail(int64_t returned_ns) {
    atomic_fetch_add_explicit(&gem_stats.syncs, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&gem_stats.sync_tail_ns, (unsigned long long)(gem_now_ns() - returned_ns),
                              memory_order_relaxed);
}

/* cffi-begin */
GEM_EXPORT int gemhook_stats(char *buf, size_t len); /* the counters as "name=value ..." */
/* cffi-end */

void gem_stats_report(void);        /* at exit: GEMINI_STATS_FILE and the info log */
void gem_stats_after_fork(void);    /* the child's counters start at zero */

#endif /* GEMINI_STATS_H */
