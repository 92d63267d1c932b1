/*
 * gate.c -- launch gating.
 *
 * Each device the process uses has a token with a deadline. While the token
 * is valid the launch path is a clock read and a compare (gem_gate_launch in
 * gate.h). Everything else happens here, off that path:
 *
 *   - the first launch after a synchronisation starts a kernel burst; if the
 *     predicted burst will not fit in what is left of a slot that already
 *     ran a burst, the slot is given back and the burst starts on a fresh one;
 *   - at expiry, launches stop, the process's outstanding work is drained
 *     (cuCtxSynchronize through the real pointer), the time it ran past the
 *     deadline is measured, and that overuse goes with the next message;
 *   - launching threads block until a new grant arrives;
 *   - a watcher thread expires tokens on time even when nobody launches, and
 *     gives an idle process's token back early (work-conserving);
 *   - launches into a capturing stream are never gated (nothing runs), and
 *     the hook never synchronises while a capture is open;
 *   - the board page (the GPU's shared page, board.h) tells a holder whose
 *     slot gem-schd continued to keep launching at its deadline, without
 *     draining or asking; tells a batch holder to pause while a latency group
 *     claims the GPU; and tells a holder in turns mode that others wait, so
 *     it passes its turn on when its burst ends;
 *   - a latency group's hooks hold claims, not slots: they give a claim back
 *     half a millisecond (GEMINI_CLAIM_IDLE_MS) after their burst ends, or
 *     as it ends when their bursts come apart; while their group may claim,
 *     a burst launches at once and the claimer thread asks for its claim
 *     meanwhile (GEMINI_EARLY_CLAIM_MS), so a request does not wait for the
 *     pod manager's answer;
 *   - while a grant asks for it, the work queued on the GPU is kept short
 *     (inflight.h), so a slot's end or a claim takes effect within about a
 *     millisecond.
 *
 * Overuse is measured with the host clock at the moment the drain returns,
 * in a thread that is already waiting for it. We chose this over CUDA events
 * because an event recorded on the legacy stream misses work on non-blocking
 * streams (JAX, CuPy, PyTorch side streams), and a context-wide drain covers
 * them all; the wake-up latency of the drain (~10 us) is far below the
 * scheduler's resolution. The watcher drains at the deadline, so the clock is
 * read when the work really ends, not when a thread next happens to launch.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "board.h"
#include "capture.h"
#include "client.h"
#include "device.h"
#include "gate.h"
#include "gpugate.h"
#include "inflight.h"
#include "real.h"
#include "residency.h"
#include "settings.h"
#include "stats.h"
#include "thread.h"

/* What a holder reads for claims when there is no board, or its own group claims: never paused. */
static const int64_t no_claim = 0;

struct gem_gate gem_gates[GEM_MAX_DEVICES] = {
    [0 ... GEM_MAX_DEVICES - 1] = {.claim_word = &no_claim, .marker_mask = ~0ull, .board_slot = -1}};
/* Until the constructor measures the tick, the shortcut is off (never true before a real deadline). */
int64_t gem_coarse_margin_ns = INT64_MAX / 2;

static pthread_mutex_t gates_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int gates_ready;

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watch_cv;
static int watcher_started;
static int watcher_stop;
static int watcher_kicked; /* a wake came since the watcher's pass began (watch_mu): it looks again at once */

void gem_gate_measure_clock(void) {
    struct timespec res;
    /* Only trust a tick of at most 10 ms; otherwise every launch reads the precise clock. */
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0 && res.tv_nsec > 0 &&
        res.tv_nsec <= 10 * GEM_NS_PER_MS)
        gem_coarse_margin_ns = 2 * (int64_t)res.tv_nsec;
    else
        gem_coarse_margin_ns = INT64_MAX / 2; /* the shortcut never succeeds */
}

/* ---- the gates ------------------------------------------------------------------------------ */

static void gate_init_sync(struct gem_gate *g) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
}

/* One gate per device the registry set up (gem_runtime_init has succeeded). */
static void ensure_gates(void) {
    if (GEM_LIKELY(atomic_load_explicit(&gates_ready, memory_order_acquire)))
        return;
    pthread_mutex_lock(&gates_mu);
    if (!atomic_load(&gates_ready)) {
        int count = atomic_load(&gem_device_count);
        for (int i = 0; i < count; i++) {
            struct gem_gate *g = &gem_gates[i];
            gate_init_sync(g);
            g->dev = &gem_devices[i];
            g->state = GEM_TOKEN_NONE;
            gemhook_burst_init(&g->est, gem_cfg.burst_merge_ns, gem_cfg.burst_window_ns);
            gem_inflight_init(&g->inflight);
        }
        atomic_store_explicit(&gates_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&gates_mu);
}

/* GEMINI_DISABLE or failing open: every launch passes, on every device. */
static void open_gates(void) {
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < (count > 0 ? count : 1); i++)
        atomic_store(&gem_gates[i].deadline_ns, INT64_MAX);
}

/* ---- the watcher thread -------------------------------------------------------------------- */

static void *watcher_main(void *arg);

static void start_watcher(void) {
    pthread_mutex_lock(&watch_mu);
    if (!watcher_started) {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&watch_cv, &ca);
        pthread_condattr_destroy(&ca);
        if (gem_thread_start(watcher_main, "gemhook-watch") == 0)
            watcher_started = 1;
        else
            GEM_LOG(GEM_LOG_WARN, "cannot start the watcher thread: tokens expire only at the next launch");
    }
    pthread_mutex_unlock(&watch_mu);
}

/* A new deadline: make sure the watcher runs (it does not survive fork) and looks again. */
static void wake_watcher(void) {
    start_watcher();
    atomic_fetch_add_explicit(&gem_stats.watcher_wakes, 1, memory_order_relaxed);
    pthread_mutex_lock(&watch_mu);
    watcher_kicked = 1;     /* not lost while the watcher is in its pass, not waiting */
    pthread_cond_signal(&watch_cv);
    pthread_mutex_unlock(&watch_mu);
}

/* ---- draining ------------------------------------------------------------------------------ */

/* The slot's first kernel is about to be launched on `stream`: mark the GPU's position with an event, so
 * that the GPU time the slot really had (from the first kernel, after the grant travelled here and the
 * GPU switched contexts, to the end of the drain) can be measured. Called with g->mu held, in the
 * launching thread, only while no stream of the process captures or begins to (never record into a
 * capture, nor on the legacy stream while one is open). */
static void mark_slot_start(struct gem_gate *g, CUstream stream, int ptsz) {
    g->slot_measured = 0;
    if (!HAVE_REAL(cuEventRecord) || !HAVE_REAL(cuEventCreate) || !HAVE_REAL(cuEventElapsedTime) ||
        atomic_load(&gem_active_captures) > 0 || !gem_capture_drain_enter())
        return;
    CUcontext ctx = NULL;
    if (HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS && ctx) {
        int have_events = g->ev_ctx == ctx;
        if (!have_events) { /* events belong to a context; the old ones (if any) are left to it */
            CUevent *slot_events[] = {&g->ev_start, &g->ev_end};
            CUevent *gap_events[] = {&g->gap_end[0], &g->gap_end[1], &g->gap_start};
            g->ev_ctx = NULL;   /* (failed, the old context's events are gone from the handles too) */
            have_events = gem_real_events_create(slot_events, 2, CU_EVENT_DEFAULT);
            if (have_events)
                g->ev_ctx = ctx;
            g->gap_events = have_events && gem_cfg.gap_events && gem_real_events_create(gap_events, 3, CU_EVENT_DEFAULT);
        }
        CUstream s = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
        g->slot_measured = have_events && REAL(cuEventRecord)(g->ev_start, s) == CUDA_SUCCESS;
    }
    g->gap_end_ok = g->gap_pending = 0;
    gem_capture_drain_exit();
}

/* The GPU's measure of the pending gap, after a context-wide synchronisation completed both of its events
 * (g->mu held): added to the slot's idle time, at most GEM_GAP_SLACK_NS above the host's own measure (the
 * legacy stream's event need not wait for a non-blocking stream's work: never trust it far beyond what the
 * host saw). */
#define GEM_GAP_SLACK_NS (50 * 1000)
#define GEM_GAP_SAMPLE 8
static void add_gap_locked(struct gem_gate *g, float ms) {
    int64_t gap = (int64_t)((double)ms * 1e6);
    if (gap > g->gap_host_ns + GEM_GAP_SLACK_NS)
        gap = g->gap_host_ns + GEM_GAP_SLACK_NS;
    if (gap < g->gap_host_ns)
        gap = g->gap_host_ns;
    atomic_fetch_add_explicit(&g->slot_idle_ns, gap, memory_order_relaxed);
    if (ms > 0) {   /* what the host cannot see of a gap: its estimate for the gaps not timed (gem_burst_begin) */
        int64_t extra = gap - g->gap_host_ns;
        g->gap_offset_ns = g->gap_offsets == 0 ? extra : g->gap_offset_ns + (extra - g->gap_offset_ns) / 8;
        g->gap_offsets++;
    }
}

/* Reads the pending gap's two events (g->mu held). `early`: before the program's next context-wide
 * synchronisation, while the host waits for the GPU anyway (the driver's ~3 us for the elapsed time are then not
 * spent between the GPU's last kernel and the program's next launch); both events went before the burst now ending,
 * so they nearly always ran, and if not the gap stays pending for the synchronisation's end. */
static void collect_gap_locked(struct gem_gate *g, int early) {
    if (!g->gap_pending)
        return;
    float ms = 0;
    CUresult rc = REAL(cuEventElapsedTime)(&ms, g->gap_end[g->gap_pend], g->gap_start);
    if (early && rc == CUDA_ERROR_NOT_READY)
        return;
    g->gap_pending = 0;
    add_gap_locked(g, rc == CUDA_SUCCESS && ms > 0 ? ms : 0);
}

/* Wait for the process's outstanding work in ctx; returns the time it was done. If the slot's start was
 * marked, *used_ns gets the GPU time from the slot's first kernel to the end of its work (0 if unknown), less
 * the idle gaps in between: those after each context-wide synchronisation (slot_idle_ns, timed on the GPU
 * where both of a gap's events were recorded, else on the host) and, when the process has been idle since
 * `idle_from` (0: it was in a burst), the tail from then to the end of the drain.
 *
 * The end is an event recorded on the legacy stream *before* the drain's synchronisation, so it fires when
 * the process's own queued work ends. Recorded after the drain, it fired only when the GPU next ran this
 * context -- on an H100, after the next holder's first kernel had run (the next group is granted at the
 * deadline, while this drain still waits): each slot was reported ~1 ms longer than its work, as long as
 * its wall time, so none of its idle gaps was forgiven and spin tenants sat 4-5% under their caps. The
 * legacy stream does not wait for non-blocking streams: what they still run after the event is timed on the
 * host, from the event's completion to the drain's. */
static int64_t drain(struct gem_gate *g, CUcontext ctx, int64_t *used_ns, int64_t idle_from) {
    *used_ns = 0;
    int measured = g->slot_measured;
    g->slot_measured = 0;
    int64_t mark = atomic_exchange(&g->slot_mark_ns, 0);
    if (!gem_capture_drain_enter()) {
        /* A context-wide synchronise would break the capture; captured work is
         * not running anyway, and other streams' work is charged next time. */
        atomic_fetch_add(&gem_stats.drain_skipped_capture, 1);
        return gem_now_ns();
    }
    /* From here until gem_capture_drain_exit no capture can begin. */
    atomic_fetch_add(&gem_stats.drains, 1);
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = HAVE_REAL(cuThreadExchangeStreamCaptureMode) &&
                    REAL(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
    int pushed = ctx && HAVE_REAL(cuCtxPushCurrent_v2) && REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
    int64_t end_seen = 0; /* when the host saw the end event fire (0: no measure) */
    if (measured && ctx == g->ev_ctx && HAVE_REAL(cuEventSynchronize) &&
        REAL(cuEventRecord)(g->ev_end, NULL) == CUDA_SUCCESS &&
        REAL(cuEventSynchronize)(g->ev_end) == CUDA_SUCCESS)
        end_seen = gem_now_ns();
    if (HAVE_REAL(cuCtxSynchronize))
        REAL(cuCtxSynchronize)(); /* the real one: the hook's own sync is not a burst boundary */
    int64_t done = gem_now_ns();
    pthread_mutex_lock(&g->mu);
    if (ctx == g->ev_ctx)
        collect_gap_locked(g, 0);
    g->gap_pending = g->gap_end_ok = 0;
    pthread_mutex_unlock(&g->mu);
    if (end_seen > 0) {
        float ms = 0;
        if (REAL(cuEventElapsedTime)(&ms, g->ev_start, g->ev_end) == CUDA_SUCCESS && ms > 0) {
            int64_t gpu = (int64_t)((double)ms * 1e6) + (done > end_seen ? done - end_seen : 0);
            int64_t idle = atomic_exchange(&g->slot_idle_ns, 0);
            if (mark > 0 && idle_from >= mark && done > idle_from)
                idle += done - idle_from;
            /* never below a tenth of the span: the gaps are partly host times and the span GPU time, and a
             * slot is never reported as unused (the scheduler bounds what it forgives anyway) */
            if (idle > gpu - gpu / 10)
                idle = gpu - gpu / 10;
            if (idle > 0)
                atomic_fetch_add(&gem_stats.idle_ns, (unsigned long long)idle);
            *used_ns = gpu - (idle > 0 ? idle : 0);
            atomic_fetch_add(&gem_stats.slots_measured, 1);
            atomic_fetch_add(&gem_stats.used_ns, (unsigned long long)*used_ns);
        }
    }
    if (pushed) {
        CUcontext popped;
        REAL(cuCtxPopCurrent_v2)(&popped);
    }
    if (exchanged)
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    gem_capture_drain_exit();
    return done;
}

/* End the current slot: stop launches, drain, measure overuse. Called with g->mu held and the
 * state HELD; returns with g->mu held and the state NONE. The burst in progress is cut by the
 * slot's end, so its length is unknown: it is discarded rather than recorded short. */
static void expire_locked(struct gem_gate *g) {
    g->state = GEM_TOKEN_DRAINING;
    atomic_store(&g->deadline_ns, 0);
    int64_t deadline = g->slot_deadline_ns;
    CUcontext ctx = g->ctx;
    int was_in_burst = atomic_exchange(&g->in_burst, 0);
    int64_t last_sync = atomic_load(&g->last_sync_ns);
    pthread_mutex_unlock(&g->mu);
    int64_t used = 0;
    struct gem_gpugate *gg = gem_gpugate_of(g->dev->ordinal);
    int64_t held = gem_gpugate_held_ns(gg, gem_now_ns());
    int64_t done = drain(g, ctx, &used, was_in_burst ? 0 : atomic_exchange(&g->ctx_idle_since_ns, 0));
    held = gem_gpugate_held_ns(gg, done) - held;
    pthread_mutex_lock(&g->mu);
    g->pending_used_ns = used;
    /* Not in a burst: everything had finished by the last synchronisation. A claim that held the queue on the
     * GPU meanwhile is the claimer's time (charged to its group), not this slot's overrun. */
    int64_t finished = was_in_burst ? done - held : last_sync;
    int64_t overuse = finished > deadline ? finished - deadline : 0;
    g->pending_overuse_ns += overuse;
    atomic_fetch_add(&gem_stats.expiries, 1);
    atomic_fetch_add(&gem_stats.overuse_ns, (unsigned long long)overuse);
    g->state = GEM_TOKEN_NONE;
    pthread_cond_broadcast(&g->cv);
}

/* ---- talking to the pod manager ------------------------------------------------------------ */

static void report_failure(struct gem_gate *g, int rc, const struct gem_msg *reply) {
    atomic_fetch_add(&gem_stats.gate_errors, 1);
    if (rc == GEM_CALL_REFUSED)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d: the pod manager refused the token request: %.*s", g->dev->ordinal,
                GEM_ERRMSG_LEN, reply->u.error.message);
    else if (rc == GEM_CALL_TIMEOUT)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d: no token from the pod manager at %s after %.3g s "
                "(GEMINI_TOKEN_TIMEOUT_MS); failing this launch", g->dev->ordinal, g->dev->conn.where,
                (double)gem_cfg.token_timeout_ns / 1e9);
}

/* A batch holder next to a latency group (tight) has its streams held on the GPU during claims (gpugate.h):
 * the gate follows the board's claims; otherwise it follows none and its word stays 0. */
static void follow_claims(struct gem_gate *g) {
    int tight = atomic_load_explicit(&g->tight, memory_order_relaxed);
    gem_gpugate_follow(gem_gpugate_of(g->dev->ordinal), (tight && g->board && !g->latency) ? g->board : NULL);
}

/* What the pod manager said in its handshake (the board, the group's class) and in this grant (keep the
 * queue short). Called with g->mu held after a grant. */
static void apply_grant_terms(struct gem_gate *g, uint32_t flags) {
    struct gem_device *d = g->dev;
    g->latency = (d->conn.ack_flags & GEM_ACK_LATENCY) != 0;
    int32_t slot;
    g->board = gem_device_board(d, &slot);
    g->board_slot = g->board ? slot : -1;
    atomic_store(&g->claim_word, (g->board && !g->latency) ? &g->board->claims.claim_until_ns : &no_claim);
    int bound = (flags & GEM_GRANT_BOUND) != 0;
    atomic_store_explicit(&g->bound, bound, memory_order_relaxed);
    atomic_store_explicit(&g->tight, bound && (flags & GEM_GRANT_TIGHT) != 0, memory_order_relaxed);
    uint64_t per_marker = atomic_load(&g->inflight.launches_per_marker);
    atomic_store(&g->marker_mask, bound ? per_marker - 1 : ~0ull);
    follow_claims(g);
}

/* The slot ran out: if gem-schd continued it (the board's line for the group names this token as the one
 * it continues, with a later deadline), keep holding it -- no drain, no request. Not in turns mode while
 * others wait for the turn: then the holder asks again and the pod manager passes it on. Called with
 * g->mu held and the state HELD; returns whether the token continues. */
static int try_continue_locked(struct gem_gate *g, int64_t now) {
    if (!g->board || g->board_slot < 0 || g->latency)
        return 0;
    if (gemhook_board_waiters(g->board, (uint32_t)g->board_slot) > 0)
        return 0;
    uint64_t seq, prev;
    int64_t deadline;
    if (!gemhook_board_read(g->board, (uint32_t)g->board_slot, &seq, &prev, &deadline) || prev != g->token_seq ||
        deadline <= now)
        return 0;
    g->token_seq = seq;
    g->from_board = 1;
    g->slot_deadline_ns = deadline;
    atomic_store(&g->deadline_ns, deadline);
    atomic_fetch_add(&gem_stats.continuations, 1);
    /* A continuation brings no grant flags, and a lone holder may be continued for hours: a latency group
     * configured since its grant (a live edit) must shorten its queue now, or every claim waits behind it, and
     * another group configured since must find the queue bounded to the slot (gem-pmgr's GRANT_BOUND), or its
     * first slot starts after the whole queue. The other way, the queue loosens to half the slot; the bound
     * itself stays (it may be the cap's). */
    int tight = gem_board_latency_groups(g->board) > 0;
    int others = gem_board_groups(g->board) > 1;
    int was_bound = atomic_load_explicit(&g->bound, memory_order_relaxed);
    if (tight != atomic_load_explicit(&g->tight, memory_order_relaxed) || (others && !was_bound)) {
        int bound = tight || others || was_bound;
        atomic_store_explicit(&g->bound, bound, memory_order_relaxed);
        atomic_store_explicit(&g->tight, tight, memory_order_relaxed);
        atomic_store(&g->marker_mask, bound ? atomic_load(&g->inflight.launches_per_marker) - 1 : ~0ull);
        follow_claims(g);
    }
    GEM_LOG(GEM_LOG_DEBUG, "GPU %d: token %llu continues until %.3f ms from now", g->dev->ordinal,
            (unsigned long long)seq, (double)(deadline - now) / 1e6);
    return 1;
}

/* gem-schd ended the continuation this process took up from the board before its deadline: the group's line
 * names the token with an earlier deadline (the daemon rewrites it when a slot is released, or when a request
 * crosses the continuation: architecture.md, "Continuations"). The pod manager's messages reach only hooks that
 * ask, and a hook that took a continuation up from the board asks nobody: before this look it launched until the
 * old deadline while another group held the GPU. The watcher looks at every pass it makes anyway (every
 * GEMINI_IDLE_RELEASE_MS in a burst, every GEM_BOARD_POLL_NS while idle); the launch path does not.
 * Only a continuation's: a grant's deadline here is its quota from the moment it reached this process, later
 * than gem-schd's by the way through the pod manager (1-2 ms on an H100 node), and cutting that off (147 times in
 * 242 slots of a spin tenant) let the GPU idle while the next group's grant travelled, where the holder's overrun
 * had filled that time and was charged to it. Called with g->mu held and the state HELD. */
#define GEM_WITHDRAW_SLACK_NS (1 * GEM_NS_PER_MS)
static void follow_withdrawal_locked(struct gem_gate *g) {
    if (!g->from_board || !g->board || g->board_slot < 0 || g->latency)
        return;
    uint64_t seq, prev;
    int64_t deadline;
    if (!gemhook_board_read(g->board, (uint32_t)g->board_slot, &seq, &prev, &deadline) || seq != g->token_seq ||
        deadline + GEM_WITHDRAW_SLACK_NS >= g->slot_deadline_ns)
        return;
    GEM_LOG(GEM_LOG_DEBUG, "GPU %d: token %llu was ended %.3f ms before its deadline", g->dev->ordinal,
            (unsigned long long)seq, (double)(g->slot_deadline_ns - deadline) / 1e6);
    g->slot_deadline_ns = deadline;
    atomic_store(&g->deadline_ns, deadline);
    atomic_fetch_add(&gem_stats.withdrawals, 1);
}

/* A latency group claims the GPU: a batch holder launches nothing until the claim ends (its queued work,
 * kept short, still runs). Called without g->mu. A claim is bounded by its pod manager and its budget;
 * the hook still never waits more than GEM_CLAIM_HOLD_MAX_NS in one pause. */
static void claim_wait(struct gem_gate *g) {
    const int64_t *word = atomic_load(&g->claim_word);
    int64_t start = gem_now_ns(), now = start, until;
    int paused = 0;
    while ((until = __atomic_load_n(word, __ATOMIC_ACQUIRE)) > now) {
        if (now - start > GEM_CLAIM_HOLD_MAX_NS) {
            GEM_LOG(GEM_LOG_WARN, "GPU %d: a claim has lasted %.0f s; launching anyway", g->dev->ordinal,
                    (double)GEM_CLAIM_HOLD_MAX_NS / GEM_NS_PER_S);
            break;
        }
        int64_t d = until - now;
        if (d > 200 * 1000)
            d = 200 * 1000;     /* look again: the claim may end early */
        struct timespec ts = {0, (long)d};
        nanosleep(&ts, NULL);
        paused = 1;
        now = gem_now_ns();
    }
    if (paused) {
        atomic_fetch_add(&gem_stats.claim_pauses, 1);
        atomic_fetch_add(&gem_stats.claim_pause_ns, (unsigned long long)(now - start));
    }
}

/* A latency process's burst begins: remember how long it was idle since the synchronisation that ended its
 * last burst. Not after a burst that a slot's expiry or a renewal cut: that span was work, not idleness. The
 * caller won the burst flag, so it is the only writer here (relaxed is enough). */
static void note_idle_gap(struct gem_gate *g, int64_t now) {
    if (!g->latency || !atomic_exchange_explicit(&g->synced_idle, 0, memory_order_relaxed))
        return;
    int64_t last = atomic_load_explicit(&g->last_sync_ns, memory_order_relaxed);
    if (last <= 0 || now <= last)
        return;
    unsigned i = atomic_load_explicit(&g->gaps_seen, memory_order_relaxed);
    atomic_store_explicit(&g->recent_gaps[i % GEM_RECENT_GAPS], now - last, memory_order_relaxed);
    atomic_store_explicit(&g->gaps_seen, i + 1, memory_order_relaxed);
}

/* How long a latency process holds its claim after a burst: GEMINI_CLAIM_IDLE_MS, unless fewer than a
 * quarter of its recent bursts came within that time of the one before (then holding would only keep
 * every batch process paused): 1 ns, at once. Too few bursts seen yet: the setting. */
static int64_t claim_idle_ns(struct gem_gate *g) {
    int64_t idle = gem_cfg.claim_idle_ns;
    unsigned n = atomic_load(&g->gaps_seen);
    if (idle <= 0 || n < GEM_RECENT_GAPS / 2)
        return idle;
    if (n > GEM_RECENT_GAPS)
        n = GEM_RECENT_GAPS;
    unsigned soon = 0;
    for (unsigned i = 0; i < n; i++)
        soon += atomic_load(&g->recent_gaps[i]) <= idle;
    return soon * 4 < n ? 1 : idle;
}

/* An early burst's first launch: batch processes hold their work on the GPU now, not when the pod manager has
 * written the claim on the board (flare.h). Only while the group's board line says its flares count. */
static void raise_flare(struct gem_gate *g, int64_t t) {
    if (!gem_cfg.flare || !g->board || g->board_slot < 0 || !gemhook_board_flare(g->board, (uint32_t)g->board_slot))
        return;
    struct gem_flare *f = gem_flare_of_group(g->dev, g->board, g->board_slot);
    if (!f)
        return;
    int64_t ahead = gem_cfg.early_claim_ns < GEM_FLARE_MAX_NS ? gem_cfg.early_claim_ns : GEM_FLARE_MAX_NS;
    g->flare = f;
    g->flare_until_ns = t + ahead;
    gemhook_flare_raise(f, g->flare_until_ns);
    atomic_fetch_add(&gem_stats.flares, 1);
}

/* The early burst's answer came (its claim is on the board, or there is none): its flare comes down. */
static void lower_flare(struct gem_gate *g) {
    if (g->flare)
        gemhook_flare_lower(g->flare, g->flare_until_ns);
    g->flare = NULL;
    g->flare_until_ns = 0;
}

/* Ask for a token. Called with g->mu held and state NONE (or REQUESTING, by the claimer for an early claim);
 * returns with g->mu held. `early`: the burst began before this request was answered, and its first launch
 * marked the slot's start. */
static int request_locked(struct gem_gate *g, int early) {
    g->state = GEM_TOKEN_REQUESTING;
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_TOKEN_REQUEST, 0);
    int64_t overuse = g->pending_overuse_ns;
    req.u.token_request.overuse_ns = overuse;
    req.u.token_request.burst_ns = gemhook_burst_predict(&g->est, gem_now_ns()); /* fresh, for the quota */
    int64_t used = g->pending_used_ns;
    req.u.token_request.used_ns = used;
    if (early) /* the pod manager charges the claim from the burst's first launch, not from the request's arrival */
        req.u.token_request.launched_ns = g->early_since_ns;
    atomic_fetch_add(&gem_stats.token_requests, 1);
    pthread_mutex_unlock(&g->mu);
    int rc = gem_conn_call(&g->dev->conn, &req, &reply, gem_cfg.token_timeout_ns);
    if (rc == GEM_CALL_OK && reply.hdr.type == GEM_MSG_TOKEN_GRANT)
        /* The pod manager's board moved (a new gem-schd, a reload that moved the group's line): the new page
         * before this grant's terms are read from it, and before its deadline is set. One load unless it did;
         * launchers wait meanwhile (the state is still REQUESTING). */
        gem_device_follow_board(g->dev, (reply.u.token_grant.flags & GEM_GRANT_BOARD) != 0, GEM_NS_PER_S);
    pthread_mutex_lock(&g->mu);
    if (early)
        lower_flare(g);
    if (rc == GEM_CALL_OK && reply.hdr.type == GEM_MSG_TOKEN_GRANT) {
        int64_t now = gem_now_ns();
        int64_t quota = reply.u.token_grant.quota_ns;
        if (quota < 100000)
            quota = 100000; /* never a slot too short to launch in */
        g->pending_overuse_ns -= overuse;
        if (g->pending_used_ns == used)
            g->pending_used_ns = 0;
        g->token_seq = reply.u.token_grant.token_seq;
        g->from_board = 0;
        g->granted_ns = now;
        g->slot_deadline_ns = now + quota;
        g->bursts_in_slot = 0;
        g->pass_turn = 0;
        int claim = (reply.u.token_grant.flags & GEM_GRANT_CLAIM) != 0;
        if (early && claim)
            /* How long the burst ran before its claim was answered (the board showed it a little before): the
             * part of a request that batch holders did not yet make way for. */
            atomic_fetch_add(&gem_stats.early_claim_lag_ns,
                             (unsigned long long)(now > g->early_since_ns ? now - g->early_since_ns : 0));
        if (!early || !claim) {
            g->slot_unmarked = 1; /* the next launch through the slow path marks the slot's start */
            if (early) {
                /* Not a claim (the right was taken away meanwhile): the early burst's mark would count the
                 * wait for this slot as use. Measure from the slot's own first launch instead. */
                g->slot_measured = 0;
                atomic_store(&g->slot_mark_ns, 0);
            }
        }
        if (gem_residency_wants_grant(g->dev)) {
            /* Unified group: its memory reaches the GPU before its first kernel (the swap is part of the slot;
             * launchers wait meanwhile: the state is still REQUESTING). */
            pthread_mutex_unlock(&g->mu);
            gem_residency_on_grant(g->dev);
            pthread_mutex_lock(&g->mu);
        } else {
            gem_residency_granted_in_place(g->dev);
        }
        if (HAVE_REAL(cuCtxGetCurrent)) {
            CUcontext ctx = NULL;
            if (REAL(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS && ctx)
                g->ctx = ctx;
        }
        apply_grant_terms(g, reply.u.token_grant.flags);
        g->claim_ready = g->latency && claim;
        g->state = GEM_TOKEN_HELD;
        atomic_store(&g->deadline_ns, g->slot_deadline_ns);
        atomic_fetch_add(&gem_stats.grants, 1);
        GEM_LOG(GEM_LOG_DEBUG, "GPU %d: token %llu for %.3f ms", g->dev->ordinal,
                (unsigned long long)g->token_seq, (double)quota / 1e6);
        rc = GEM_CALL_OK;
    } else {
        if (rc == GEM_CALL_OK)
            rc = GEM_CALL_REFUSED; /* a reply of the wrong type */
        g->state = GEM_TOKEN_NONE;
        g->claim_ready = 0;
        if (early)
            atomic_store(&g->deadline_ns, 0); /* the early burst's time is up: launchers ask themselves */
        report_failure(g, rc, &reply);
    }
    pthread_cond_broadcast(&g->cv);
    if (rc == GEM_CALL_OK)
        wake_watcher();
    return rc;
}

/* Give the slot back (idle, or to renew before a burst). Called without g->mu. */
static void send_release(struct gem_gate *g, uint64_t token_seq, int64_t overuse, int64_t used) {
    /* (a failed release loses `used`: the slot is then charged in full, the conservative side) */
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_TOKEN_RELEASE, 0);
    req.u.token_release.token_seq = token_seq;
    req.u.token_release.overuse_ns = overuse;
    req.u.token_release.used_ns = used;
    req.u.token_release.burst_ns = atomic_load(&g->predicted_burst_ns);
    int rc = gem_conn_call(&g->dev->conn, &req, &reply, 5 * GEM_NS_PER_S);
    if (rc != GEM_CALL_OK) {
        /* The overuse is not lost: it goes with the next request. */
        pthread_mutex_lock(&g->mu);
        g->pending_overuse_ns += overuse;
        pthread_mutex_unlock(&g->mu);
    }
}

/* Give the slot back, keeping launchers waiting until the release has gone out. Called with g->mu held;
 * returns with it released. */
static void release_slot_unlock(struct gem_gate *g, uint64_t seq, int64_t overuse, int64_t used) {
    g->state = GEM_TOKEN_REQUESTING;
    pthread_mutex_unlock(&g->mu);
    send_release(g, seq, overuse, used);
    pthread_mutex_lock(&g->mu);
    g->state = GEM_TOKEN_NONE;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* What a launch returns when its token request failed (called without g->mu). */
static CUresult request_failed(int rc) {
    if (gem_cfg.fail_open && (rc == GEM_CALL_UNREACHABLE || rc == GEM_CALL_BROKEN)) {
        gem_enter_fail_open();
        open_gates();
        return CUDA_SUCCESS;
    }
    return gem_unavailable_result();
}

/* ---- the claimer thread --------------------------------------------------------------------- */

/* A latency process's request waited 0.35-0.43 ms for its pod manager's answer before its first launch (H100),
 * most of what the class added to a request's p50. While its group may claim, the answer is known to be a
 * claim, so the burst launches at once and this thread asks meanwhile (one for the process: a latency
 * process on several GPUs asks for them in turn). */
static pthread_mutex_t claimer_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t claimer_cv = PTHREAD_COND_INITIALIZER;
static int claimer_started;     /* 1 running, -1 could not start (then every request waits for its answer) */
static int claimer_queued;      /* a gate has early_pending set */
static int claimer_stop;

static void *claimer_main(void *arg) {
    (void)arg;
    if (HAVE_REAL(cuThreadExchangeStreamCaptureMode)) { /* its driver calls never disturb another's capture */
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    }
    pthread_mutex_lock(&claimer_mu);
    for (;;) {
        while (!claimer_queued && !claimer_stop)
            pthread_cond_wait(&claimer_cv, &claimer_mu);
        if (claimer_stop)
            break;
        claimer_queued = 0;
        pthread_mutex_unlock(&claimer_mu);
        int count = atomic_load(&gem_device_count);
        for (int i = 0; i < count && i < GEM_MAX_DEVICES; i++) {
            struct gem_gate *g = &gem_gates[i];
            pthread_mutex_lock(&g->mu);
            if (g->early_pending) {
                g->early_pending = 0;
                /* A failure is logged and counted there. A launch waiting for this answer returns it; with
                 * none waiting, the next launch asks for itself. */
                int rc = request_locked(g, 1);
                if (rc != GEM_CALL_OK && g->waiters > 0)
                    g->early_rc = rc;
            }
            pthread_mutex_unlock(&g->mu);
        }
        pthread_mutex_lock(&claimer_mu);
    }
    pthread_mutex_unlock(&claimer_mu);
    return NULL;
}

/* Hand g's request to the claimer (g->mu held). Returns 0 if there is no claimer: the caller asks itself. */
static int queue_early_claim(struct gem_gate *g) {
    pthread_mutex_lock(&claimer_mu);
    if (!claimer_started && !claimer_stop)
        claimer_started = gem_thread_start(claimer_main, "gemhook-claim") == 0 ? 1 : -1;
    int ok = claimer_started > 0 && !claimer_stop;
    if (ok) {
        g->early_pending = 1;
        claimer_queued = 1;
        pthread_cond_signal(&claimer_cv);
    }
    pthread_mutex_unlock(&claimer_mu);
    return ok;
}

/* ---- the slow path of a launch --------------------------------------------------------------- */

CUresult gem_gate_slow(struct gem_gate *g, CUstream stream, int ptsz, int64_t now) {
    if (gem_runtime_init() != 0) {
        /* No driver handle or CUDA not initialised: the real call reports the problem. */
        return gem_ensure_real() == 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    }
    if (gem_ungated()) {
        open_gates();
        return CUDA_SUCCESS;
    }
    ensure_gates();
    g = gem_current_gate();
    claim_wait(g);
    if (gem_now_ns() < atomic_load(&g->deadline_ns))
        return CUDA_SUCCESS;
    if (atomic_load(&gem_active_captures) > 0 && gem_stream_is_capturing(stream, ptsz)) {
        atomic_fetch_add(&gem_stats.capture_passthrough, 1);
        return CUDA_SUCCESS; /* recorded into a graph, not run: the graph launch is gated */
    }
    int waited = 0;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        int64_t t = gem_now_ns();
        if (t < atomic_load(&g->deadline_ns))
            break;
        if (gem_fail_open_active()) { /* entered by another thread (or by memory.c) meanwhile */
            pthread_mutex_unlock(&g->mu);
            open_gates();
            return CUDA_SUCCESS;
        }
        if (g->state == GEM_TOKEN_HELD) {
            if (!try_continue_locked(g, t))
                expire_locked(g);
            continue;
        }
        if (g->state == GEM_TOKEN_NONE && g->early_rc != GEM_CALL_OK) {
            /* The claimer's early request failed while this launch waited for it: its failure is this
             * launch's (asking again would wait a second timeout, or retry a connection before failing open) */
            int rc = g->early_rc;
            g->early_rc = GEM_CALL_OK;
            pthread_mutex_unlock(&g->mu);
            return request_failed(rc);
        }
        if (g->state == GEM_TOKEN_NONE) {
            if (g->claim_ready && g->latency && gem_cfg.early_claim_ns > 0 &&
                !(__atomic_load_n(&g->dev->conn.ack_flags, __ATOMIC_RELAXED) & GEM_ACK_UNIFIED) &&
                queue_early_claim(g)) {
                /* Launch now: the claimer asks meanwhile. The group may claim as far as this hook knows; if
                 * the right was taken away since, the answer is a slot, and the launches of at most
                 * GEMINI_EARLY_CLAIM_MS went ahead of it (no grant needed to reach the board: batch holders pause
                 * when the pod manager writes the claim there, as before). Not a unified group's: its memory must
                 * reach the GPU at the grant, before its first kernel. */
                g->state = GEM_TOKEN_REQUESTING;
                g->slot_unmarked = 1;
                g->early_since_ns = t;
                CUcontext ctx = NULL;   /* the claimer's thread has no context: the one to drain is this one */
                if (HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS && ctx)
                    g->ctx = ctx;
                atomic_store(&g->deadline_ns, t + gem_cfg.early_claim_ns);
                atomic_fetch_add(&gem_stats.early_claims, 1);
                raise_flare(g, t);
                break;
            }
        }
        int ask = -1;   /* a request to send from here: 0 a plain one, 1 an early claim's */
        if (g->state == GEM_TOKEN_NONE) {
            ask = 0;
        } else if (g->state == GEM_TOKEN_REQUESTING && g->early_pending) {
            /* The early launches' time is up and the claimer has not sent the request yet (it is waiting for
             * another GPU's answer, or stopping): send it from here. */
            g->early_pending = 0;
            ask = 1;
        }
        if (ask >= 0) {
            waited = 1;
            int rc = request_locked(g, ask);
            if (rc == GEM_CALL_OK)
                continue;
            pthread_mutex_unlock(&g->mu);
            return request_failed(rc);
        }
        /* another thread is requesting or draining */
        waited = 1;
        g->waiters++;
        pthread_cond_wait(&g->cv, &g->mu);
        g->waiters--;
    }
    /* the launch that follows starts a burst on the fresh slot */
    int64_t t = gem_now_ns();
    if (!atomic_exchange(&g->in_burst, 1)) {
        atomic_store(&g->burst_start_ns, t);
        note_idle_gap(g, now);
    }
    if (g->slot_unmarked) {
        mark_slot_start(g, stream, ptsz);
        atomic_store(&g->slot_idle_ns, 0);
        atomic_store(&g->slot_mark_ns, g->slot_measured ? t : 0);
    }
    g->slot_unmarked = 0;
    pthread_mutex_unlock(&g->mu);
    if (waited) {
        atomic_fetch_add(&gem_stats.waits, 1);
        atomic_fetch_add(&gem_stats.wait_ns, (unsigned long long)(t - now));
    }
    return CUDA_SUCCESS;
}

/* How much GPU work may stay queued now. Queue at most half the time left in the slot: the queue then ends by
 * the deadline even when a neighbour's leftover queue shares the GPU half and half with it, so a cap's slot ends
 * on time (a continued slot's deadline moves on, and so does the budget). Only GEMINI_INFLIGHT_MS when a claim
 * may come at any moment. */
static int64_t queue_budget(struct gem_gate *g, int64_t now) {
    int64_t budget = gem_cfg.inflight_ns;
    /* Next to a latency group the queue stays GEMINI_INFLIGHT_MS short, so that a claim takes effect after that
     * much work -- unless the GPU-side gate holds the queue at its next marker's wait during a claim. */
    if (!atomic_load_explicit(&g->tight, memory_order_relaxed) || gem_gpugate_active(gem_gpugate_of(g->dev->ordinal))) {
        int64_t left = atomic_load_explicit(&g->deadline_ns, memory_order_relaxed) - now;
        left /= 2;
        if (left > budget)
            budget = left;
    }
    return budget;
}

/* A marker is due (or a graph launch) while the grant asked for a short queue. */
CUresult gem_gate_marker(struct gem_gate *g, CUstream stream, int ptsz) {
    if (!atomic_load_explicit(&g->bound, memory_order_relaxed))
        return CUDA_SUCCESS;
    struct gem_gpugate *gg = atomic_load_explicit(&g->tight, memory_order_relaxed) ? gem_gpugate_of(g->dev->ordinal)
                                                                                    : NULL;
    gem_inflight_marker(&g->inflight, stream, ptsz, queue_budget(g, gem_now_ns()), gg, NULL);
    if (atomic_load_explicit(&g->bound, memory_order_relaxed))
        atomic_store(&g->marker_mask, atomic_load(&g->inflight.launches_per_marker) - 1);
    return CUDA_SUCCESS;
}

/* Beside a latency group the markers follow the kernels' predicted GPU time (kcost.h): this launch would take the
 * thread's sum past the target, or its kernel is to be measured alone (a marker before it, and the next launch
 * puts one before itself), or the last launch was. */
CUresult gem_gate_cost_marker(struct gem_gate *g, CUstream stream, int ptsz, uint64_t key, int64_t cost_ns,
                              int isolate) {
    struct gem_thread_counter *t = gem_tls_counter;
    int graph = key == 0;       /* a graph launch: one unit of queued work, its length unknown */
    struct gem_marker_kernel mk = {.costed = 1, .key = isolate ? key : 0, .unit = isolate || graph,
                                   .ends_unit = t && t->isolating, .thread = t,
                                   .predicted_ns = t ? t->pending_ns : 0, .unit_cost_ns = isolate ? cost_ns : 0};
    int recorded = gem_inflight_marker(&g->inflight, stream, ptsz, queue_budget(g, gem_now_ns()),
                                       gem_gpugate_of(g->dev->ordinal), &mk);
    if (t) {
        /* after a unit the next launch puts a marker before itself: the unit's interval holds it alone (a graph's
         * too, so that no kernel's cost is judged with a graph's length in its interval) */
        t->isolating = recorded && (isolate || graph);
        t->measuring = recorded && isolate && !graph;
        t->unit_stream = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
        /* a kernel measured again keeps its prediction in the interval's (the synchronisation's check sums them) */
        t->pending_ns = cost_ns;
        if (recorded && isolate) {
            atomic_fetch_add_explicit(&gem_stats.kernels_measured, 1, memory_order_relaxed);
            if (key == t->remeasure_key)
                t->remeasure_key = 0;   /* learning it sets it again while the cost is still too long */
            if (t->verifying > 0)
                t->verifying--;
        }
    }
    return CUDA_SUCCESS;
}

/* First launch after a synchronisation, with a valid token. */
CUresult gem_burst_begin(struct gem_gate *g, CUstream stream, int ptsz, int64_t now) {
    int64_t predicted = atomic_load_explicit(&g->predicted_burst_ns, memory_order_relaxed);
    int64_t left = atomic_load_explicit(&g->deadline_ns, memory_order_relaxed) - now;
    /* Within the merge gap of the last synchronisation this launch continues the same burst
     * (the estimator merges them), so it is not a new burst that might not fit. */
    int continues = now - atomic_load_explicit(&g->last_sync_ns, memory_order_relaxed) < gem_cfg.burst_merge_ns;
    if (predicted > left && !continues) {
        /* Renew: the burst would overrun this slot. Give the rest back and start the burst on a
         * fresh token, unless this slot has not run a burst yet (a fresh slot always starts). */
        pthread_mutex_lock(&g->mu);
        if (g->state == GEM_TOKEN_HELD && g->bursts_in_slot > 0 && !atomic_load(&g->in_burst)) {
            uint64_t seq = g->token_seq;
            g->slot_deadline_ns = now;
            expire_locked(g);
            int64_t overuse = g->pending_overuse_ns, used = g->pending_used_ns;
            g->pending_overuse_ns = g->pending_used_ns = 0;
            release_slot_unlock(g, seq, overuse, used);
            atomic_fetch_add(&gem_stats.burst_renewals, 1);
            return gem_gate_slow(g, stream, ptsz, gem_now_ns());
        }
        pthread_mutex_unlock(&g->mu);
    }
    int expected = 0;
    if (atomic_compare_exchange_strong(&g->in_burst, &expected, 1)) {
        atomic_store(&g->burst_start_ns, now);
        note_idle_gap(g, now);
        /* the GPU had nothing of ours since a context-wide synchronisation (inside the measured slot) */
        int64_t mark = atomic_load_explicit(&g->slot_mark_ns, memory_order_relaxed);
        int64_t since = atomic_exchange_explicit(&g->ctx_idle_since_ns, 0, memory_order_relaxed);
        if (mark > 0 && since >= mark && now > since) {
            /* the GPU's side of the gap when the synchronisation marked its end: an event before this
             * burst's first kernel (read before the next context-wide synchronisation), for one gap in
             * GEM_GAP_SAMPLE; the others are the host's measure plus what the timed ones exceeded the host's by,
             * on average. The event is the program's to wait for: about 2.5 us before its next launch on an
             * H100 (burst_begin_ms) while every gap was timed. */
            int marked = 0;
            pthread_mutex_lock(&g->mu);
            int64_t offset = g->gap_offset_ns > 0 ? g->gap_offset_ns : 0;
            /* gap_end_ok: the synchronisation marked the gap's start, one in GEM_GAP_SAMPLE (before_sync) */
            if (g->gap_end_ok && !g->gap_pending && atomic_load(&gem_active_captures) == 0 &&
                gem_capture_drain_enter()) {
                CUstream st = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
                if (REAL(cuEventRecord)(g->gap_start, st) == CUDA_SUCCESS) {
                    g->gap_pending = 1;
                    g->gap_pend = g->gap_cur;
                    /* to the record's return: the GPU's excess over it (the offset the untimed gaps get) is then
                     * not the record's own host time, which they do not pay */
                    g->gap_host_ns = gem_now_ns() - since;
                    marked = 1;
                }
                gem_capture_drain_exit();
            }
            g->gap_end_ok = 0;
            pthread_mutex_unlock(&g->mu);
            if (!marked)
                atomic_fetch_add_explicit(&g->slot_idle_ns, now - since + offset, memory_order_relaxed);
            atomic_fetch_add_explicit(marked ? &gem_stats.gaps_timed : &gem_stats.gaps_estimated, 1,
                                      memory_order_relaxed);
        }
        atomic_fetch_add_explicit(&gem_stats.burst_begin_ns, (unsigned long long)(gem_now_ns() - now),
                                  memory_order_relaxed);
    }
    return CUDA_SUCCESS;
}

/* After a synchronising call of the program (wrappers.c): the burst, if any, is over. */
/* The gate of the device a context belongs to (the calling thread's for NULL). */
static struct gem_gate *gate_of_ctx(CUcontext ctx) {
    if (!ctx || atomic_load_explicit(&gem_device_count, memory_order_relaxed) <= 1)
        return gem_current_gate();
    CUdevice dev = -1;
    if (HAVE_REAL(cuCtxPushCurrent_v2) && REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS) {
        if (REAL(cuCtxGetDevice)(&dev) != CUDA_SUCCESS)
            dev = -1;
        CUcontext popped;
        REAL(cuCtxPopCurrent_v2)(&popped);
    }
    struct gem_device *d = gem_device_by_ordinal(dev);
    return d ? &gem_gates[d->ordinal] : gem_current_gate();
}

void gem_gate_end_unit_before_sync(int whole, CUstream stream, int ptsz) {
    struct gem_thread_counter *t = gem_tls_counter;
    if (GEM_LIKELY(!t || !t->measuring) || !atomic_load(&gates_ready))
        return;
    CUstream s = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
    if (!whole && s != (CUstream)t->unit_stream)
        return;     /* another stream's: the kernel may still be queued after it returns */
    /* once: the synchronisation restarts the chain. The next launch still puts a marker before itself
     * (`isolating`), which ends the unit in its stead should this synchronisation fail or be another context's. */
    t->measuring = 0;
    gem_inflight_end_unit((CUstream)t->unit_stream);
}

void gem_gate_before_sync(CUcontext ctx) {
    if (!atomic_load_explicit(&gates_ready, memory_order_acquire))
        return;
    struct gem_gate *g = gate_of_ctx(ctx);
    if (!atomic_load(&g->in_burst) || atomic_load(&g->slot_mark_ns) == 0)
        return;     /* not inside a measured slot's burst: nothing to mark */
    pthread_mutex_lock(&g->mu);
    CUcontext cur = NULL;
    if (g->slot_measured && g->gap_events && atomic_load(&gem_active_captures) == 0 &&
        HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&cur) == CUDA_SUCCESS && cur == g->ev_ctx &&
        gem_capture_drain_enter()) {
        collect_gap_locked(g, 1);
        /* Only one gap in GEM_GAP_SAMPLE (every one until one was timed) is timed on the GPU: this event comes
         * after the queue's last kernel, and the synchronisation then waits for it too. */
        int due = g->gap_offsets == 0 || ++g->gap_count % GEM_GAP_SAMPLE == 0;
        int i = g->gap_pending ? 1 - g->gap_pend : g->gap_cur; /* never the one a pending gap still needs */
        if (due && REAL(cuEventRecord)(g->gap_end[i], NULL) == CUDA_SUCCESS) {
            g->gap_cur = i;
            g->gap_end_ok = 1;
        } else {
            g->gap_end_ok = 0;
        }
        gem_capture_drain_exit();
    }
    pthread_mutex_unlock(&g->mu);
}

/* A synchronisation emptied the queues of the context (whole) or of one stream (inflight.h): their marker chains
 * restart, and a wait longer than the queue's budget says the markers were too far apart. */
static void synced_markers(struct gem_gate *g, CUcontext ctx, int whole, CUstream stream, int64_t began_ns,
                           int64_t now) {
    if (!ctx && (!HAVE_REAL(cuCtxGetCurrent) || REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx))
        return;
    int bound = atomic_load_explicit(&g->bound, memory_order_relaxed);
    /* the budget when the wait began: a deadline passed during it would shrink it to GEMINI_INFLIGHT_MS, and a
     * queue allowed half the slot would be judged on that */
    int64_t budget = bound ? queue_budget(g, began_ns) : 0;
    /* a wait that a claim held on the GPU says nothing of the markers' spacing */
    if (gem_gpugate_held_since(gem_gpugate_of(g->dev->ordinal), began_ns))
        budget = 0;
    if (gem_inflight_synced(&g->inflight, ctx, whole, stream, now - began_ns, budget) && bound)
        atomic_store(&g->marker_mask, atomic_load(&g->inflight.launches_per_marker) - 1);
}

void gem_gate_on_stream_sync(CUstream stream, int ptsz, int64_t began_ns) {
    if (!atomic_load_explicit(&gates_ready, memory_order_acquire))
        return;
    synced_markers(gem_current_gate(), NULL, 0, (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream, began_ns,
                   gem_now_ns());
}

void gem_gate_on_sync(CUcontext ctx, int whole_context, int64_t began_ns) {
    if (!atomic_load_explicit(&gates_ready, memory_order_acquire))
        return;
    struct gem_gate *g = gate_of_ctx(ctx);
    int64_t now = gem_now_ns();
    atomic_store(&g->last_sync_ns, now);
    if (whole_context) {
        if (began_ns > 0)
            synced_markers(g, ctx, 1, NULL, began_ns, now);
        atomic_store(&g->ctx_idle_since_ns, now);
        pthread_mutex_lock(&g->mu);
        if (g->gap_pending) {   /* both of its events are done: the whole context was synchronised */
            CUcontext cur = NULL;
            if (HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&cur) == CUDA_SUCCESS && cur == g->ev_ctx)
                collect_gap_locked(g, 0);
            else
                g->gap_pending = 0;
        }
        pthread_mutex_unlock(&g->mu);
    }
    if (!atomic_exchange(&g->in_burst, 0))
        return;
    atomic_store_explicit(&g->synced_idle, 1, memory_order_relaxed);
    pthread_mutex_lock(&g->mu);
    gemhook_burst_record(&g->est, atomic_load(&g->burst_start_ns), now);
    /* The p90 sorts every burst of the last 3 s; a program that synchronises every millisecond would
     * pay for that each time, so the prediction is refreshed at most every 5 ms. */
    if (now - g->predicted_at_ns >= 5 * GEM_NS_PER_MS) {
        atomic_store(&g->predicted_burst_ns, gemhook_burst_predict(&g->est, now));
        g->predicted_at_ns = now;
    }
    g->bursts_in_slot++;
    int release_soon = 0;
    if (g->state == GEM_TOKEN_HELD) {
        if (g->latency) {
            release_soon = 1;   /* a claim ends soon after its burst: the watcher must look */
        } else if (g->board && g->board_slot >= 0 && gemhook_board_waiters(g->board, (uint32_t)g->board_slot) > 0) {
            /* turns: others of the group wait, and this burst is over. The watcher is woken only when it did not
             * know yet: once it passes the turn it looks again within the merge gap at every pass (watch_device), so
             * it sees this burst's end in time unwoken. Woken at every synchronisation, it cost the program a futex
             * call and the watcher's contention for the gate before its next launch (the hook's time after a
             * synchronisation was 3-4 us with three busy groups on an H100, 0.8 us alone). */
            release_soon = g->pass_turn != GEM_PASS_TURN;
            g->pass_turn = GEM_PASS_TURN;
        } else if (gem_cfg.idle_release_ns > gem_cfg.burst_merge_ns && g->board &&
                   gemhook_board_groups_waiting(g->board)) {
            /* Another group could be granted now: keeping the token through the idle release would leave
             * the GPU idle for it (5 ms of every step of two jobs with host work between steps). Woken only
             * when the watcher did not know yet (above). */
            release_soon = g->pass_turn != GEM_PASS_GROUP;
            g->pass_turn = GEM_PASS_GROUP;
        }
    }
    pthread_mutex_unlock(&g->mu);
    if (release_soon)
        wake_watcher();
}

void gem_gate_context_gone(CUcontext ctx) {
    if (!ctx || !atomic_load_explicit(&gates_ready, memory_order_acquire))
        return;
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < count && i < GEM_MAX_DEVICES; i++) {
        struct gem_gate *g = &gem_gates[i];
        pthread_mutex_lock(&g->mu);
        if (g->ev_ctx == ctx) { /* the events went with it: never record or time them again */
            g->ev_ctx = NULL;
            g->ev_start = g->ev_end = NULL;
            g->slot_measured = 0;
            g->gap_events = g->gap_end_ok = g->gap_pending = 0;
        }
        if (g->ctx == ctx)
            g->ctx = NULL;      /* drain the thread's current context instead */
        pthread_mutex_unlock(&g->mu);
    }
    gem_inflight_context_gone(ctx);     /* the queue-bound markers' events too */
    gem_gpugate_context_gone(ctx);      /* and the GPU-side gate's registration */
}

/* ---- the watcher ------------------------------------------------------------------------------ */

/* One pass over a device; returns when the watcher should look at it again. */
static int64_t watch_device(struct gem_gate *g, int64_t now) {
    int64_t next = now + 100 * GEM_NS_PER_MS;
    pthread_mutex_lock(&g->mu);
    if (g->state != GEM_TOKEN_HELD) {
        pthread_mutex_unlock(&g->mu);
        return next;
    }
    follow_withdrawal_locked(g);
    if (now >= g->slot_deadline_ns && try_continue_locked(g, now)) {
        pthread_mutex_unlock(&g->mu);
        return now;     /* look again at once: the new deadline */
    }
    if (now >= g->slot_deadline_ns) {
        expire_locked(g);
        if (g->waiters == 0) {
            /* Nobody wants to launch: report the overuse and let the group's slot go. */
            uint64_t seq = g->token_seq;
            int64_t overuse = g->pending_overuse_ns, used = g->pending_used_ns;
            g->pending_overuse_ns = g->pending_used_ns = 0;
            pthread_mutex_unlock(&g->mu);
            send_release(g, seq, overuse, used);
            return next;
        }
        pthread_mutex_unlock(&g->mu); /* a waiting launcher asks, carrying the overuse */
        return next;
    }
    if (g->slot_deadline_ns < next)
        next = g->slot_deadline_ns;
    /* How long idle before the token goes back: a batch slot after GEMINI_IDLE_RELEASE_MS, a latency
     * group's claim after GEMINI_CLAIM_IDLE_MS, a turn or slot others wait for once the burst is over by
     * the estimator's own rule (no launch within the 2 ms merge gap), so back-to-back steps keep it. */
    if (g->pass_turn == GEM_PASS_GROUP && !gemhook_board_groups_waiting(g->board))
        g->pass_turn = GEM_PASS_NONE; /* the waiter went (cancelled, gone, or capped now): keep the slot */
    int64_t idle_ns = g->pass_turn ? gem_cfg.burst_merge_ns : g->latency ? gem_cfg.claim_idle_ns
                                                                          : gem_cfg.idle_release_ns;
    /* ... a latency process's claim may go back sooner once its burst is over (not a shorter look-again
     * while it runs: the sync that ends it wakes the watcher) */
    int64_t hold_ns = g->latency && !g->pass_turn ? claim_idle_ns(g) : idle_ns;
    /* A batch holder idle since its burst ended: when gem-schd says on the board that another group could be
     * granted now, the merge gap is enough; else it looks at the board again every GEM_BOARD_POLL_NS while
     * it sits idle, because a group that asks during the idle release would otherwise wait all of it. */
    int poll_board = 0;
    if (!g->pass_turn && !g->latency && g->board && idle_ns > gem_cfg.burst_merge_ns && /* 0: never early */
        !atomic_load(&g->in_burst)) {
        if (gemhook_board_groups_waiting(g->board)) {
            g->pass_turn = GEM_PASS_GROUP;
            idle_ns = gem_cfg.burst_merge_ns;
        } else {
            poll_board = 1;
        }
    }
    /* Look again: the burst may end and the process go idle. While a turn or group pass is due, every pass looks
     * again within the merge gap, bursting or not (a burst may begin right after this look): the synchronisation
     * that ends a burst wakes the watcher only when the pass first became due (gem_gate_on_sync). */
    int bursting = atomic_load(&g->in_burst);
    if (idle_ns > 0 && (bursting || g->pass_turn) && now + idle_ns < next)
        next = now + idle_ns;
    if (idle_ns > 0 && !bursting) {
        int64_t idle_since = atomic_load(&g->last_sync_ns);
        if (idle_since < g->granted_ns)
            idle_since = g->granted_ns;
        if (poll_board && now + GEM_BOARD_POLL_NS < next)
            next = now + GEM_BOARD_POLL_NS;
        if (now - idle_since >= hold_ns) {
            /* Take the token from launchers first, then make sure nothing is in flight. */
            g->state = GEM_TOKEN_DRAINING;
            atomic_store(&g->deadline_ns, 0);
            CUcontext ctx = g->ctx;
            pthread_mutex_unlock(&g->mu);
            int64_t used = 0;
            drain(g, ctx, &used, atomic_exchange(&g->ctx_idle_since_ns, 0));
            pthread_mutex_lock(&g->mu);
            int64_t t = gem_now_ns();
            if ((atomic_load(&g->in_burst) || g->waiters > 0) && t < g->slot_deadline_ns) {
                /* a launch slipped in: the process is not idle after all (and its burst's end is looked for
                 * within the merge gap, as above) */
                g->state = GEM_TOKEN_HELD;
                atomic_store(&g->deadline_ns, g->slot_deadline_ns);
                pthread_cond_broadcast(&g->cv);
                pthread_mutex_unlock(&g->mu);
                if (t + idle_ns < next)
                    next = t + idle_ns;
                return next;
            }
            uint64_t seq = g->token_seq;
            int64_t overuse = g->pending_overuse_ns;
            g->pending_overuse_ns = 0;
            if (g->pass_turn == GEM_PASS_TURN)
                atomic_fetch_add(&gem_stats.turn_passes, 1);
            else if (g->pass_turn == GEM_PASS_GROUP)
                atomic_fetch_add(&gem_stats.group_passes, 1);
            g->pass_turn = 0;
            if (hold_ns < idle_ns && now - idle_since < idle_ns) /* (a late watcher's would have gone anyway) */
                atomic_fetch_add(&gem_stats.quick_claim_releases, 1);
            release_slot_unlock(g, seq, overuse, used);
            atomic_fetch_add(&gem_stats.early_releases, 1);
            GEM_LOG(GEM_LOG_DEBUG, "GPU %d: idle for %.1f ms, token %llu given back early", g->dev->ordinal,
                    (double)(t - idle_since) / 1e6, (unsigned long long)seq);
            return next;
        }
        if (idle_since + hold_ns < next)
            next = idle_since + hold_ns;
    }
    pthread_mutex_unlock(&g->mu);
    return next;
}

static void *watcher_main(void *arg) {
    (void)arg;
    /* The watcher's own driver calls must never disturb another thread's capture. */
    if (HAVE_REAL(cuThreadExchangeStreamCaptureMode)) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    }
    pthread_mutex_lock(&watch_mu);
    while (!watcher_stop) {
        watcher_kicked = 0;
        pthread_mutex_unlock(&watch_mu);
        int64_t now = gem_now_ns();
        int64_t next = now + 100 * GEM_NS_PER_MS;
        int count = atomic_load(&gem_device_count);
        for (int i = 0; i < count; i++) {
            int64_t n = watch_device(&gem_gates[i], now);
            if (n < next)
                next = n;
            n = gem_residency_poll(gem_gates[i].dev, gem_gates[i].ctx, now); /* unified: eviction requests */
            if (n < next)
                next = n;
        }
        pthread_mutex_lock(&watch_mu);
        if (watcher_stop)
            break;
        if (!watcher_kicked && next > gem_now_ns()) {
            struct timespec ts = {.tv_sec = next / GEM_NS_PER_S, .tv_nsec = next % GEM_NS_PER_S};
            pthread_cond_timedwait(&watch_cv, &watch_mu, &ts);
        }
    }
    pthread_mutex_unlock(&watch_mu);
    return NULL;
}

void gem_gate_watch_residency(void) {
    ensure_gates(); /* the watcher polls the gates' devices */
    start_watcher(); /* (a running one looks at the board every 2 ms anyway) */
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

void gem_gate_after_fork(void) {
    pthread_mutex_init(&gates_mu, NULL);
    pthread_mutex_init(&watch_mu, NULL);
    pthread_mutex_init(&claimer_mu, NULL);
    pthread_cond_init(&claimer_cv, NULL);
    watcher_started = 0;
    watcher_stop = 0;
    claimer_started = claimer_queued = claimer_stop = 0;
    if (atomic_load(&gates_ready)) {
        int count = atomic_load(&gem_device_count);
        for (int i = 0; i < count; i++) {
            struct gem_gate *g = &gem_gates[i];
            gate_init_sync(g);
            g->state = GEM_TOKEN_NONE;
            g->waiters = 0;
            g->pass_turn = 0;
            g->pending_overuse_ns = 0;
            atomic_store(&g->deadline_ns, 0);
            atomic_store(&g->in_burst, 0);
            atomic_store(&g->last_sync_ns, 0);
            atomic_store(&g->gaps_seen, 0);     /* the child's own bursts decide its claims */
            g->gap_count = g->gap_offsets = 0;  /* and its own timed gaps the estimate of the others */
            g->gap_offset_ns = 0;
            atomic_store(&g->synced_idle, 0);
            g->early_pending = 0;
            g->early_rc = GEM_CALL_OK;
            g->claim_ready = 0;                 /* its first request is answered before it launches */
            g->flare = NULL;                    /* a flare in flight is the parent's to lower */
            g->flare_until_ns = 0;
        }
    }
    /* The watcher did not survive the fork; the next grant starts a new one (wake_watcher). */
}

void gem_gate_shutdown(void) {
    /* Exiting: the pod manager sees the connection close and takes the token and memory back.
     * The watcher is not joined (it may be inside a driver call); it just stops. */
    pthread_mutex_lock(&watch_mu);
    watcher_stop = 1;
    if (watcher_started)
        pthread_cond_signal(&watch_cv);
    pthread_mutex_unlock(&watch_mu);
    pthread_mutex_lock(&claimer_mu);
    claimer_stop = 1;
    pthread_cond_broadcast(&claimer_cv);
    pthread_mutex_unlock(&claimer_mu);
}
