/*
 * gate.h -- launch gating: the token of each device, kernel bursts, the drain
 * at a slot's end, and the watcher thread.
 */
#ifndef GEMINI_GATE_H
#define GEMINI_GATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "cuda_types.h"
#include "device.h"
#include "flare.h"
#include "inflight.h"
#include "kcost.h"
#include "stats.h"
#include "util.h"

enum gem_token_state { GEM_TOKEN_NONE = 0, GEM_TOKEN_HELD, GEM_TOKEN_REQUESTING, GEM_TOKEN_DRAINING };

/* How many of a latency process's idle gaps decide whether it gives a claim back at once. */
#define GEM_RECENT_GAPS 16

/* The token of one device (gem_gates[i] belongs to gem_devices[i]). */
struct gem_gate {
    /* Read on every launch: on its own cache line, written only at token changes. */
    _Alignas(64) atomic_llong deadline_ns;
    atomic_int in_burst;
    /* The word a batch holder checks for claims: the board's claim_until_ns, or a zero that never
     * pauses (a latency group's own hooks, no board). */
    const int64_t *_Atomic claim_word;
    /* A marker is due when (the thread's launch count & mask) == 0: launches per marker - 1 while the
     * grant asks for a short queue (GEM_GRANT_BOUND), else all ones (never). */
    atomic_ullong marker_mask;
    char pad_hot[64 - 2 * sizeof(atomic_llong) - sizeof(atomic_int) - sizeof(void *)];

    struct gem_device *dev;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;                  /* enum gem_token_state */
    int waiters;                /* threads blocked for a grant */
    uint64_t token_seq;
    int from_board;             /* the token is a continuation taken up from the board (not a pod manager's grant) */
    int64_t granted_ns;
    int64_t slot_deadline_ns;   /* the deadline of the token held, kept when deadline_ns is cleared */
    atomic_llong burst_start_ns;
    atomic_llong last_sync_ns;
    int bursts_in_slot;
    atomic_llong predicted_burst_ns;
    int64_t predicted_at_ns;    /* when the prediction was last refreshed */
    struct gemhook_burst_est est;
    int64_t pending_overuse_ns; /* measured at the last expiry, not yet reported */
    CUcontext ctx;              /* the context launches were made in, drained at expiry */
    CUevent ev_start, ev_end;   /* measure the GPU time a slot really had (in ev_ctx) */
    CUcontext ev_ctx;
    int slot_measured;          /* ev_start was recorded before the slot's first kernel */
    int slot_unmarked;          /* a fresh grant whose first kernel has not been marked yet */
    int64_t pending_used_ns;    /* measured at the last expiry, not yet reported */
    /* The host's idle gaps inside the measured part of the slot: from a synchronisation's return to the
     * next launch, the GPU had nothing of this process to run. Taken off the measured use, so that a
     * group is charged the GPU time it used, not its own think time (issue 14: a tenant that synchronises
     * after every 1 ms kernel sat 3% under its cap). */
    atomic_llong slot_mark_ns;  /* when the slot's first kernel was marked (0: not measured) */
    atomic_llong slot_idle_ns;
    atomic_llong ctx_idle_since_ns; /* a context-wide synchronisation returned then, no launch since (0: none);
                                     * a stream's or an event's says nothing of the process's other streams */
    /* The GPU's side of those gaps (under mu): an event before each context-wide synchronisation (gap_end)
     * and one before the next burst's first kernel (gap_start); their distance includes what the host cannot
     * see -- the synchronisation's return and the next launch's way to the GPU (25 us per 1 ms kernel on an
     * H100). Counted at most GEM_GAP_SLACK_NS above the host's own measure of the same gap. */
    CUevent gap_end[2], gap_start;
    int gap_events;             /* created, in ev_ctx */
    int gap_cur;                /* gap_end[gap_cur] was recorded at the last context-wide synchronisation */
    int gap_end_ok;             /* ... and no burst began since */
    int gap_pending;            /* gap_end[gap_pend] .. gap_start recorded, to be measured after a sync */
    int gap_pend;
    int64_t gap_host_ns;        /* the host's measure of the pending gap */
    unsigned gap_count;         /* gaps since the gate began: one in GEM_GAP_SAMPLE is timed on the GPU */
    unsigned gap_offsets;       /* gaps timed on the GPU so far */
    int64_t gap_offset_ns;      /* how much longer the GPU saw those gaps than the host did, on average (EWMA) */
    /* From the pod manager's handshake and grants. */
    const struct gem_board *board;  /* the GPU's board page, NULL if none */
    int board_slot;             /* the group's line on it */
    int latency;                /* the group is latency class: its tokens are claims */
    /* Atomics: a grant sets them, and so may a continuation (the watcher's) while launchers read them. */
    atomic_int bound;           /* the current grant asked for the queue to end with the slot */
    atomic_int tight;           /* ... and to stay GEMINI_INFLIGHT_MS short whatever the time left */
    int pass_turn;              /* the burst ended while others wait (GEM_PASS_*): give the token back soon */
    /* A latency process: how long it sat idle (from a synchronisation to the next burst's first launch)
     * before each of its last GEM_RECENT_GAPS bursts. Holding a claim GEMINI_CLAIM_IDLE_MS after a burst
     * only helps a burst that follows within that time; requests that arrive apart (a server's, 20 ms)
     * give the claim back at once, and every batch process resumes that much sooner. */
    atomic_llong recent_gaps[GEM_RECENT_GAPS];
    atomic_uint gaps_seen;
    atomic_int synced_idle;     /* a synchronisation ended the last burst (not a slot's expiry or a renewal) */
    /* A latency process whose last token was a claim launches its next burst at once and asks for the claim
     * meanwhile (the claimer thread), instead of waiting for the pod manager's answer (g->mu). */
    int claim_ready;            /* the last grant was a claim: the group may claim, as far as this hook knows */
    int early_pending;          /* a claim asked for ahead of its answer, for the claimer thread to send */
    int early_rc;               /* the claimer's request failed (GEM_CALL_*) while a launch waited for it */
    int64_t early_since_ns;     /* when that burst's first launch went ahead */
    struct gem_flare *flare;    /* ... and the group's flare page it raised then (flare.h), until its answer */
    int64_t flare_until_ns;
    struct gem_inflight inflight;
};

/* Why a holder gives its token back once its burst is over (pass_turn): processes of its own `turns`
 * group wait for the turn (the pod manager's count on the board), or gem-schd says another group could be
 * granted now (the board's groups_waiting). */
enum { GEM_PASS_NONE = 0, GEM_PASS_TURN = 1, GEM_PASS_GROUP = 2 };
/* How often an idle batch holder's watcher reads the board's groups_waiting during its idle release. */
#define GEM_BOARD_POLL_NS (1 * GEM_NS_PER_MS)

extern struct gem_gate gem_gates[GEM_MAX_DEVICES];

/* The gate of the calling thread's device. */
static inline struct gem_gate *gem_current_gate(void) {
    if (GEM_LIKELY(atomic_load_explicit(&gem_device_count, memory_order_relaxed) <= 1))
        return &gem_gates[0];
    return &gem_gates[gem_current_device_multi()->ordinal];
}

CUresult gem_gate_slow(struct gem_gate *g, CUstream stream, int ptsz, int64_t now);
CUresult gem_burst_begin(struct gem_gate *g, CUstream stream, int ptsz, int64_t now);
CUresult gem_gate_marker(struct gem_gate *g, CUstream stream, int ptsz);
/* Beside a latency group: a marker before this launch (`key`, predicted `cost_ns`; 0: a graph), measuring the
 * kernel alone if `isolate` (kcost.h). */
CUresult gem_gate_cost_marker(struct gem_gate *g, CUstream stream, int ptsz, uint64_t key, int64_t cost_ns,
                              int isolate);

/* The coarse clock (a kernel variable updated every tick, read without rdtsc) never runs ahead
 * of CLOCK_MONOTONIC and trails it by at most a tick. So "coarse + margin < deadline" proves the
 * token valid; only in the last `margin` of a slot does the launch read the precise clock. The
 * margin is two ticks (clock_getres), set by gem_gate_measure_clock; 0 disables the shortcut. */
extern int64_t gem_coarse_margin_ns;
void gem_gate_measure_clock(void);

/* The launch path, while a token is held and nobody claims: loads (the hot line, the claim word, the
 * thread's counter), one clock read and compares. The burst flag only changes at the first launch after
 * a synchronisation, the claim word when a latency group's claim starts or ends, the mask with a grant.
 * `graph`: a graph launch, one unit of queued work (a marker after each while bounded). `fn`, `blocks`: the
 * kernel's function and grid size (NULL, 0 for a graph). Beside a latency group (`tight`) the markers follow the
 * kernels' predicted GPU time instead of their count (kcost.h): a hash, the table's four loads and an add to the
 * thread's own sum. */
static inline CUresult gem_gate_launch(CUstream stream, int ptsz, int graph, const void *fn, uint64_t blocks) {
    struct gem_gate *g = gem_current_gate();
    uint64_t n = gem_count_launch();
    int64_t deadline = atomic_load_explicit(&g->deadline_ns, memory_order_relaxed);
    int64_t claim = __atomic_load_n(atomic_load_explicit(&g->claim_word, memory_order_relaxed), __ATOMIC_RELAXED);
    int64_t c = gem_coarse_ns();
    /* coarse <= now, so coarse >= claim proves that no claim is running. Within a tick after a claim's end the
     * coarse clock may still be short of it (a claim that ran its length stays on the board until its pod manager
     * takes it off), so the precise clock decides, as for the deadline: the slow path lets a launch through without
     * the marker logic below, and every launch of that tick went there. A trainer that never synchronises queued
     * a thousand kernels of 1 ms in that tick, none with a marker or a gate's wait, so the requests of the next
     * second ran interleaved with them (tests/test_e2e_latency.py, test_a_claim_holds_a_deep_batch_queue_on_the_gpu,
     * beside CPU hogs: its requests outlasted their 20 ms claims). */
    if (GEM_LIKELY((c + gem_coarse_margin_ns < deadline || gem_now_ns() < deadline) &&
                   (c >= claim || gem_now_ns() >= claim))) {
        if (GEM_LIKELY(atomic_load_explicit(&g->in_burst, memory_order_relaxed))) {
            if (GEM_LIKELY(!atomic_load_explicit(&g->tight, memory_order_relaxed) || !gem_cfg.kernel_costs)) {
                if (GEM_LIKELY((n & atomic_load_explicit(&g->marker_mask, memory_order_relaxed)) != 0 && !graph))
                    return CUDA_SUCCESS;
                return gem_gate_marker(g, stream, ptsz);
            }
            struct gem_thread_counter *t = gem_tls_counter;
            uint64_t key = graph ? 0 : gem_kcost_key(fn, blocks);
            int64_t cost = graph ? 0 : gem_kcost_get(key);
            /* (a graph's key is 0, as a remeasure_key of none: it gets a marker of its own anyway) */
            int relearn = gem_kcost_relearn(n) || t->verifying > 0 || key == t->remeasure_key;
            if (GEM_LIKELY(cost != 0 && !t->isolating && !relearn)) {
                int64_t sum = t->pending_ns + cost;
                if (GEM_LIKELY(sum <= gem_kcost_target_ns())) {
                    t->pending_ns = sum;
                    return CUDA_SUCCESS;
                }
            }
            /* a kernel predicted past the target alone has a marker before it and one after (the sum is past the
             * target again at the next launch): measured alone at no extra marker, a cost too long is corrected at
             * once rather than at one launch in GEM_KCOST_RELEARN (a kernel's shapes changed, a noisy measure) */
            return gem_gate_cost_marker(g, stream, ptsz, key, cost,
                                        !graph && (cost == 0 || relearn || cost > gem_kcost_target_ns()));
        }
        return gem_burst_begin(g, stream, ptsz, gem_now_ns());
    }
    return gem_gate_slow(g, stream, ptsz, gem_now_ns());
}

/* After a synchronising call of the program: the burst, if any, is over on the device of `ctx` (NULL: of the
 * calling thread's context). A context-wide one that succeeded, begun at `began_ns` (0: failed), emptied the
 * context's queues: their marker chains restart (inflight.h). */
void gem_gate_on_sync(CUcontext ctx, int whole_context, int64_t began_ns);
/* After the program's successful synchronisation of `stream` (NULL + ptsz: the thread's stream), begun at
 * `began_ns`: that stream's marker chain restarts. */
void gem_gate_on_stream_sync(CUstream stream, int ptsz, int64_t began_ns);
/* Before the program synchronises its whole context, or `stream` (NULL + ptsz: the thread's own): a kernel of the
 * calling thread being measured alone on it ends there (inflight.h, gem_inflight_end_unit). */
void gem_gate_end_unit_before_sync(int whole, CUstream stream, int ptsz);
/* Before a context-wide synchronisation of the program: mark where the GPU's queue ends. */
void gem_gate_before_sync(CUcontext ctx);
/* A context was destroyed or reset: forget the events and the context the gate measured and drained with. */
void gem_gate_context_gone(CUcontext ctx);

/* A unified group's process recorded managed memory: its pod manager may ask it to evict before the process
 * was ever granted the token (a job still starting), so the watcher, which answers those requests, must run
 * now rather than from the first grant. */
void gem_gate_watch_residency(void);
void gem_gate_after_fork(void);          /* the child holds no token and has no watcher */
void gem_gate_shutdown(void);            /* at exit: stop the watcher */

#endif /* GEMINI_GATE_H */
