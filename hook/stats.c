/*
 * stats.c -- the hook's counters.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "settings.h"
#include "stats.h"

struct gem_stats gem_stats;

__thread struct gem_thread_counter *gem_tls_counter __attribute__((tls_model("initial-exec")));
static struct gem_thread_counter *_Atomic counter_list;

struct gem_thread_counter *gem_register_thread_counter(void) {
    /* Never freed: a thread's launches still count after it exits. */
    struct gem_thread_counter *c = calloc(1, sizeof *c);
    if (!c) {
        static struct gem_thread_counter overflow; /* shared fallback; counts may race, never crash */
        gem_tls_counter = &overflow;
        return &overflow;
    }
    struct gem_thread_counter *head = atomic_load(&counter_list);
    do {
        c->next = head;
    } while (!atomic_compare_exchange_weak(&counter_list, &head, c));
    gem_tls_counter = c;
    return c;
}

uint64_t gem_total_launches(void) {
    uint64_t total = 0;
    for (struct gem_thread_counter *c = atomic_load(&counter_list); c; c = c->next)
        total += c->launches;
    return total;
}

#define LOAD(f) ((unsigned long long)atomic_load(&gem_stats.f))

static void format_stats(char *buf, size_t len) {
    snprintf(buf, len,
             "launches=%llu grants=%llu token_requests=%llu waits=%llu wait_ms=%.3f expiries=%llu "
             "early_releases=%llu overuse_ms=%.3f drains=%llu burst_renewals=%llu capture_passthrough=%llu "
             "gate_errors=%llu mem_allocs=%llu mem_frees=%llu mem_denied=%llu mem_rollbacks=%llu "
             "mem_errors=%llu mem_recounts=%llu dlsym_routed=%llu procaddr_routed=%llu procaddr_fallback=%llu "
             "procaddr_unrouted=%llu reconnects=%llu slots_measured=%llu used_ms=%.3f continuations=%llu "
             "claim_pauses=%llu claim_pause_ms=%.3f markers=%llu marker_waits=%llu marker_wait_ms=%.3f "
             "turn_passes=%llu marker_grows=%llu marker_shrinks=%llu marker_sync_shrinks=%llu marker_intervals=%llu "
             "marker_interval_ms=%.3f idle_ms=%.3f "
             "group_passes=%llu quick_claim_releases=%llu early_claims=%llu early_claim_lag_ms=%.3f flares=%llu withdrawals=%llu "
             "board_moves=%llu "
             "gpu_gate_waits=%llu gpu_gate_raises=%llu gpu_gate_failures=%llu kernels_measured=%llu "
             "kernel_costs_learnt=%llu kernel_cost_checks=%llu kernel_cost_remeasures=%llu kernel_cost_learnt_ms=%.3f "
             "marker_host_ms=%.3f markers_timed=%llu "
             "syncs=%llu sync_tail_ms=%.3f burst_begin_ms=%.3f watcher_wakes=%llu gaps_timed=%llu gaps_estimated=%llu",
             (unsigned long long)gem_total_launches(), LOAD(grants), LOAD(token_requests), LOAD(waits),
             (double)LOAD(wait_ns) / 1e6, LOAD(expiries), LOAD(early_releases), (double)LOAD(overuse_ns) / 1e6,
             LOAD(drains), LOAD(burst_renewals), LOAD(capture_passthrough), LOAD(gate_errors), LOAD(mem_allocs),
             LOAD(mem_frees), LOAD(mem_denied), LOAD(mem_rollbacks), LOAD(mem_errors), LOAD(mem_recounts),
             LOAD(dlsym_routed),
             LOAD(procaddr_routed), LOAD(procaddr_fallback), LOAD(procaddr_unrouted), LOAD(reconnects),
             LOAD(slots_measured), (double)LOAD(used_ns) / 1e6, LOAD(continuations), LOAD(claim_pauses),
             (double)LOAD(claim_pause_ns) / 1e6, LOAD(markers), LOAD(marker_waits),
             (double)LOAD(marker_wait_ns) / 1e6, LOAD(turn_passes), LOAD(marker_grows), LOAD(marker_shrinks),
             LOAD(marker_sync_shrinks),
             LOAD(marker_intervals), (double)LOAD(marker_interval_ns) / 1e6, (double)LOAD(idle_ns) / 1e6,
             LOAD(group_passes), LOAD(quick_claim_releases), LOAD(early_claims),
             (double)LOAD(early_claim_lag_ns) / 1e6, LOAD(flares), LOAD(withdrawals), LOAD(board_moves), LOAD(gpu_gate_waits),
             LOAD(gpu_gate_raises), LOAD(gpu_gate_failures), LOAD(kernels_measured), LOAD(kernel_costs_learnt),
             LOAD(kernel_cost_checks), LOAD(kernel_cost_remeasures), (double)LOAD(kernel_cost_learnt_ns) / 1e6, (double)LOAD(marker_host_ns) / 1e6,
             LOAD(markers_timed),
             LOAD(syncs), (double)LOAD(sync_tail_ns) / 1e6, (double)LOAD(burst_begin_ns) / 1e6, LOAD(watcher_wakes),
             LOAD(gaps_timed), LOAD(gaps_estimated));
}

int gemhook_stats(char *buf, size_t len) {
    if (!buf || !len)
        return -1;
    format_stats(buf, len);
    return 0;
}

void gem_stats_report(void) {
    const char *file = getenv("GEMINI_STATS_FILE");
    char buf[2048];
    format_stats(buf, sizeof buf);
    if (file && *file) {
        int fd = open(file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (fd >= 0) {
            char line[2200];
            int n = snprintf(line, sizeof line, "pid=%d %s\n", (int)getpid(), buf);
            ssize_t w = write(fd, line, (size_t)n);
            (void)w;
            close(fd);
        }
    }
    GEM_LOG(GEM_LOG_INFO, "stats: %s", buf);
}

void gem_stats_after_fork(void) {
    memset(&gem_stats, 0, sizeof gem_stats);
    for (struct gem_thread_counter *c = atomic_load(&counter_list); c; c = c->next) {
        c->launches = c->launches_at_sync = 0;
        c->pending_ns = 0;      /* no marker of the parent's is the child's last */
        c->isolating = c->verifying = c->measuring = 0;
        c->remeasure_key = 0;
    }
}
