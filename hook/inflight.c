/*
 * inflight.c -- marker events that bound the work queued on each stream (inflight.h says why).
 *
 * One ring of GEM_INFLIGHT_MARKERS events per (context, stream) the process launches on while bound,
 * in a small fixed table: a stream beyond it (rare: it holds 256) is not bounded, and the hook says so
 * once. Events are created in the stream's context on first use and reused (a set the driver made only in part is
 * destroyed, and tried again GEM_INFLIGHT_CREATE_BACKOFF markers later); a ring is never freed (a
 * destroyed stream's ring is reused only if the driver hands the same handle out again, and then its
 * events are still valid in that context).
 *
 * Each slot has two events, a timed one and an untimed one (CU_EVENT_DISABLE_TIMING), and a marker records one of
 * them. A timed record makes the GPU finish the work ahead of it before the next kernel may start: 2.2 us of GPU
 * time between back-to-back 20 us kernels on the H200, as much as the gate's wait, where an untimed record added
 * nothing measurable (bench/marker_cost.c; docs/benchmarks.md, "Twenty-fourth session"). Only the markers whose
 * time something reads are timed (marker_timed): beside a latency group those that begin or end a kernel measured
 * alone and every marker of a chain until adapt has judged one of its intervals; every N launches each marker while
 * N finds its level (at first, and after a halving); and always a pair in every GEM_INFLIGHT_TIMED_EVERY, whose
 * interval keeps the queue's depth and N current. GEMINI_MARKER_SAMPLING=0 times every marker.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>

#include "capture.h"
#include "gpugate.h"
#include "inflight.h"
#include "kcost.h"
#include "real.h"
#include "settings.h"
#include "stats.h"

#define MAX_RINGS 256
#define MAX_PER_MARKER 4096ull

struct ring {
    CUcontext ctx;
    CUstream stream;            /* CU_STREAM_PER_THREAD for the per-thread stream, with its thread */
    pthread_t thread;
    pthread_mutex_t mu;         /* one launching thread at a time records on a ring */
    CUevent ev[GEM_INFLIGHT_MARKERS];     /* timed */
    CUevent evq[GEM_INFLIGHT_MARKERS];    /* untimed (CU_EVENT_DISABLE_TIMING): a quick marker's */
    /* which of the two the marker in slot i recorded: an interval is measured only between two timed ones */
    unsigned char timed[GEM_INFLIGHT_MARKERS];
    unsigned seq;               /* markers recorded on the ring (which are a sampled pair) */
    /* ev[i] was recorded while the marker before it was still pending: the GPU was busy with this stream's
     * work all the way from that marker to this one, so the interval between them is GPU work. After an idle
     * moment (the host paused and the queue ran dry) the interval also holds the idle time, which says
     * nothing of the kernels' lengths and would shrink the queue just when the host needs it deep. */
    unsigned char behind[GEM_INFLIGHT_MARKERS];
    /* The marker rate set when ev[i] was recorded (adapt runs first, and the gate's mask follows it once the marker
     * is recorded): the interval after it holds about that many launches. The interval measured is a queue's depth
     * old, and the rate may have changed since: it is scaled to the current rate, or a rate would keep growing on
     * intervals measured at a lower one. (Scaled by its end marker's rate, the estimate was off by two after each
     * change of N, and N changed again a queue's depth later: docs/benchmarks.md, "Twenty-ninth session".) */
    uint32_t per[GEM_INFLIGHT_MARKERS];
    /* The launching thread's launch count (its own counter, which N's markers follow: gate.h) when marker i was
     * placed, and whose: the launches between two markers of one thread, exactly. After N doubles the next marker
     * comes at the next multiple of the new N, one or two old N away, so `per` alone can be off by two (adapt). */
    uint64_t launches_at[GEM_INFLIGHT_MARKERS];
    const struct gem_thread_counter *counter_of[GEM_INFLIGHT_MARKERS];
    /* The GPU-side gate's epoch when ev[i] was recorded (gpugate.h: odd while a claim holds the stream). An
     * interval during which a claim held the stream at its wait holds the claim's time, not this stream's. */
    unsigned epoch[GEM_INFLIGHT_MARKERS];
    /* The kernel the interval from ev[i] to the next marker's unit_end holds alone, to be measured (kcost.h; 0:
     * none); whether that interval holds one unit (that kernel, or a graph: its length is no queue's); whether ev[i]
     * ended its thread's one-unit interval; and the thread that recorded ev[i] (another thread's marker between a
     * unit's two would cut it short, so a unit is measured only between its own thread's). */
    uint64_t key[GEM_INFLIGHT_MARKERS];
    unsigned char unit[GEM_INFLIGHT_MARKERS];
    int64_t unit_cost[GEM_INFLIGHT_MARKERS];    /* the unit's kernel's predicted cost when ev[i] was recorded */
    unsigned char ends_unit[GEM_INFLIGHT_MARKERS];
    const void *thread_of[GEM_INFLIGHT_MARKERS];
    /* What the kernels of the interval ending at ev[i] were predicted to cost (ns; costed markers). */
    int64_t predicted[GEM_INFLIGHT_MARKERS];
    /* A marker that ends its thread's one-unit interval records unit_end[i] first, before its own work (the wait
     * for an older marker, the GPU-side gate's wait, the queries): the unit is measured from ev[i - 1] to it.
     * Ended by ev[i], an interval on an idle GPU also held that work, which is host time: an empty kernel on the
     * H100 was learnt as about 10 us, so a host-bound launcher got a marker every 50 launches (docs/benchmarks.md,
     * "Seventeenth session"). unit_end_exact[i]: the marker before it was still pending after its record (the GPU
     * ran the kernel back to back with the work before it). Created when first needed (NULL: not yet). */
    CUevent unit_end[GEM_INFLIGHT_MARKERS];
    unsigned char unit_end_ok[GEM_INFLIGHT_MARKERS];
    unsigned char unit_end_exact[GEM_INFLIGHT_MARKERS];
    /* unit_end[head] recorded before a synchronisation (gem_inflight_end_unit), no marker at head yet: whose it is */
    const void *unit_end_thread;
    unsigned learn_from;        /* the oldest marker whose interval may still teach the cost table */
    struct gem_gpugate *gate;   /* the gate whose waits this ring's stream carries (NULL: none) */
    unsigned head;              /* the next event to record (the oldest once the ring is full) */
    unsigned count;             /* markers in the chain: since the first, or the last synchronisation of the
                                 * ring's context or stream */
    int measured;               /* an interval of this chain was measured (adapt) */
    int used;
    unsigned create_skip;       /* markers left to pass before creating the events again, after a failure */
};

/* After the ring's events could not all be created, the markers that pass it by before the next try: each try
 * creates up to 2 x GEM_INFLIGHT_MARKERS events and gives back what it made. */
#define GEM_INFLIGHT_CREATE_BACKOFF 256

/* The event marker i recorded: the one to query or wait for. */
static CUevent mark(const struct ring *r, unsigned i) { return r->timed[i] ? r->ev[i] : r->evq[i]; }

static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ring rings[MAX_RINGS];
static int nrings;
static int table_full_said;

/* Until an interval is measured nothing is known of the kernels' lengths: a marker after every launch and
 * two of them queued (a millisecond kernel must not queue a dozen before the first measurement). The rate
 * doubles with each short interval measured, so short kernels reach hundreds per marker within a few. */
void gem_inflight_init(struct gem_inflight *f) {
    atomic_store(&f->launches_per_marker, 1);
    atomic_store(&f->interval_ns, 0);
    atomic_store(&f->ramped, 0);
    atomic_store(&f->shrunk, 0);
}

/* How many markers may stay queued: the budget over the measured interval. */
static unsigned depth_of(const struct gem_inflight *f, int64_t budget_ns) {
    int64_t interval = atomic_load(&f->interval_ns);
    if (interval <= 0)
        return 2;
    int64_t d = budget_ns / interval;
    /* one slot of the ring stays free: the interval before the marker waited for must be a finished one */
    return d < 1 ? 1 : d > GEM_INFLIGHT_MARKERS - 1 ? GEM_INFLIGHT_MARKERS - 1 : (unsigned)d;
}

/* The ring of `s` in `ctx` (the calling thread's for the per-thread stream); a new one if `create` and none yet. */
static struct ring *ring_for(CUcontext ctx, CUstream s, int create) {
    pthread_t self = pthread_self();
    int per_thread = s == CU_STREAM_PER_THREAD;
    pthread_mutex_lock(&table_mu);
    struct ring *r = NULL;
    for (int i = 0; i < nrings && !r; i++)
        if (rings[i].ctx == ctx && rings[i].stream == s && (!per_thread || pthread_equal(rings[i].thread, self)))
            r = &rings[i];
    if (!create) {
        pthread_mutex_unlock(&table_mu);
        return r;
    }
    if (!r && nrings < MAX_RINGS) {
        r = &rings[nrings];
        __atomic_store_n(&nrings, nrings + 1, __ATOMIC_RELEASE);   /* read unlocked by gem_inflight_synced */
        memset(r, 0, sizeof *r);
        pthread_mutex_init(&r->mu, NULL);
        r->ctx = ctx;
        r->stream = s;
        r->thread = self;
    } else if (!r && !table_full_said) {
        table_full_said = 1;
        GEM_LOG(GEM_LOG_WARN, "more than %d streams launch while bounded: the work queued on the others is "
                "not kept short (a slot's end may take longer to take effect there)", MAX_RINGS);
    }
    pthread_mutex_unlock(&table_mu);
    return r;
}

/* Marker `done` is complete and so is the one before it: the GPU time between them says how many launches
 * an interval should hold and how many intervals may stay queued. An interval that spans an idle moment
 * (`behind` unset) is only an upper bound of the work in it: short, it still shows the launches are short;
 * long, it may be mostly idle -- then the rate halves anyway (a marker costs about a microsecond, a queue
 * too deep costs a slot's end), and the interval is taken as halved with it. Without that a rate grown
 * on short kernels could stay high for good once every interval spans the idle moment of a slot's start. */
static int adapt(struct gem_inflight *f, struct ring *r, unsigned back) {
    /* The marker `back` from the head, and the one before it: both of the chain, or the interval would span
     * the synchronisation that restarted it (its length the host's, not the kernels'). */
    if (back < 1 || r->count < back + 1)
        return 0;
    unsigned done = (r->head + GEM_INFLIGHT_MARKERS - back) % GEM_INFLIGHT_MARKERS;
    /* (the interval below is scaled to the current rate: see `per`) */
    unsigned prev = (done + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS;
    /* A claim up since the interval began may have held the stream at a wait inside it: the interval is then
     * only an upper bound of the work. Short, it still shows the launches are short (the rate may grow); long,
     * it says nothing, and is not used (judged, every claim would halve the rate). */
    int held = r->gate && ((r->epoch[prev] & 1) || atomic_load(&r->gate->epoch) != r->epoch[prev]);
    /* placed by the kernels' cost (kcost.h): the rate is not used; the interval, unless it held one kernel alone or
     * a claim or idle time, says how deep the queue may be. Judged only then: the driver's two calls below cost
     * the launching thread about 4.7 us (bench/event_cost.c), more than the rest of a marker, and a host-bound
     * launcher's intervals (never behind) would pay them at every marker for nothing. */
    int costed = !r->per[done];
    /* A unit predicted past the target on its own, ended by its own thread's next marker, is a full sum as well:
     * a kernel that long is measured at each launch (gate.h), and a loop of 1 ms kernels, all units, would
     * otherwise never learn its queue's depth (a capped one beside a latency group lost its queue: 0.37 of the
     * GPU where its slots allow 0.40-0.55; tests/test_e2e_latency.py) */
    int64_t target = gem_kcost_target_ns();
    int long_unit = r->unit[prev] && r->unit_cost[prev] > target && r->ends_unit[done] &&
                    r->thread_of[done] == r->thread_of[prev];
    if (costed && ((r->unit[prev] && !long_unit) || held || !r->behind[done]))
        return 1;
    /* begun by a costed marker (a latency group was there then), it held however many launches its costs gave, and
     * says nothing of N */
    if (!costed && !r->per[prev])
        return 0;
    float ms = 0;
    if (!r->timed[prev] || !r->timed[done])
        return 0;               /* a quick marker's interval: not timed (marker_timed) */
    if (REAL(cuEventQuery)(r->ev[prev]) != CUDA_SUCCESS ||
        REAL(cuEventElapsedTime)(&ms, r->ev[prev], r->ev[done]) != CUDA_SUCCESS || ms <= 0)
        return 0;
    if (costed) {
        int64_t interval = (int64_t)((double)ms * 1e6);
        /* the queue's depth from intervals that a full sum ended (one cut short by a unit after it would make the
         * depth the budget over a single short kernel; so would a long unit that ran far shorter than predicted:
         * its cost is wrong, and learn() corrects it) */
        if (r->predicted[done] >= target / 2 && (!long_unit || interval >= target / 2))
            atomic_store(&f->interval_ns, interval);
        /* far longer than its kernels' costs said (a kernel whose length changed under the same key): a kernel
         * alone longer than the target is no surprise, and an interval of the thread's own launches may hold
         * another thread's too, so only a miss by more than the target and twice the prediction (a long unit's
         * own measure replaces its cost at once: nothing more to check) */
        if (!long_unit && interval > 2 * r->predicted[done] + target)
            gem_kcost_verify_thread();
        return 1;
    }
    /* The launches in the interval: the rate set at its first marker (`per`), or fewer, as counted when one thread
     * placed both markers (after N doubles, the next marker comes at the next multiple of the new N: one old N away
     * half the time). Not more: a thread that launches on several streams places its markers on each in turn, so the
     * launches between two of one stream's markers count the other streams' too, and this stream's next markers
     * come as far apart (the queue's depth is counted in this stream's markers). */
    uint64_t held_launches = r->per[prev];
    if (r->counter_of[prev] && r->counter_of[prev] == r->counter_of[done] &&
        r->launches_at[done] > r->launches_at[prev] && r->launches_at[done] - r->launches_at[prev] < held_launches)
        held_launches = r->launches_at[done] - r->launches_at[prev];
    uint64_t n = atomic_load(&f->launches_per_marker);
    int64_t interval = (int64_t)((double)ms * 1e6 * (double)n / (double)held_launches);
    /* The interval aims at a quarter to a half of GEMINI_INFLIGHT_MS -- half that while the markers carry the
     * GPU-side gate's waits (a latency group may claim): a claim takes effect at the next wait, and a request
     * waits for the rest of the interval in flight. On the H100 beside an eager ResNet-18 trainer the halved
     * spacing took an MLP request's p50 from 1.71 to 1.55 ms in one call (1.73 to 1.21 in another), at the same
     * trainer rate; its p99 did not move (docs/benchmarks.md, "Fifteenth session"). */
    int64_t span = r->gate ? gem_cfg.inflight_ns / 2 : gem_cfg.inflight_ns;
    if (held && interval >= span / 4)
        return 0;
    int grow = interval < span / 4 && n < MAX_PER_MARKER;
    int shrink = interval > span / 2 && n > 1;
    if (interval < span / 4) {
        atomic_store(&f->interval_ns, interval);
        if (grow) {
            atomic_store(&f->launches_per_marker, n * 2);   /* grow slowly: a long kernel may come next */
            atomic_fetch_add(&gem_stats.marker_grows, 1);
        }
    } else if (r->behind[done]) {
        atomic_store(&f->interval_ns, interval);
        atomic_fetch_add(&gem_stats.marker_intervals, 1);
        atomic_fetch_add(&gem_stats.marker_interval_ns, (unsigned long long)interval);
        if (shrink) {
            atomic_store(&f->launches_per_marker, n / 2);
            atomic_fetch_add(&gem_stats.marker_shrinks, 1);
        }
    } else if (shrink) {
        int64_t known = atomic_load(&f->interval_ns);
        if (known > 1)
            atomic_store(&f->interval_ns, known / 2);
        atomic_store(&f->launches_per_marker, n / 2);
        atomic_fetch_add(&gem_stats.marker_shrinks, 1);
    } else {
        /* idle time in it, and not too long: the work in it was shorter still, so no halving is due (`shrunk` ends:
         * a launcher that keeps the GPU waiting would otherwise time every marker for good), but whether N holds
         * it cannot say (`ramped`) */
        atomic_store(&f->shrunk, 0);
        return 1;
    }
    /* Whether the next markers placed every N launches are timed (marker_timed): a halving times them until an
     * interval does not halve N again, so kernels that grew longer halve it at every marker; N's first level is
     * found with every marker timed. Only an interval judged at the rate in force (per: the rate when its two
     * markers were recorded; the launches between them followed the first's) says N holds: an older one is scaled
     * to the new rate, an estimate. */
    atomic_store(&f->shrunk, shrink);
    if (!grow && !shrink && held_launches == n && r->per[done] == n)
        atomic_store(&f->ramped, 1);
    return 1;
}

/* The intervals since `learn_from` whose kernel was measured alone teach the cost table, once both of their markers
 * are done; an interval a claim held (its wait is inside it) teaches nothing. Stops at the first one not done. */
static void learn(struct ring *r, int head_ok) {
    while (r->count > 0 && r->learn_from != r->head) {
        unsigned i = r->learn_from, j = (i + 1) % GEM_INFLIGHT_MARKERS;
        /* at the head only a unit's end recorded before a synchronisation (no marker there yet), and only once the
         * synchronisation returned (`head_ok`: it is done; a marker's own, just recorded, may well not be) */
        int at_head = j == r->head;
        if (at_head && !(head_ok && r->unit_end_ok[j] && r->key[i] && r->unit_end_thread == r->thread_of[i]))
            break;              /* its end is not recorded yet */
        /* only the unit's own thread's next marker ends it: between another thread's, the kernel may not be in
         * the interval at all, or others' launches with it */
        if (r->key[i] && (at_head || (r->ends_unit[j] && r->thread_of[j] == r->thread_of[i]))) {
            /* the unit's own end where it was recorded (above), else the marker after it */
            CUevent end = r->unit_end_ok[j] ? r->unit_end[j] : mark(r, j);
            int exact = r->unit_end_ok[j] ? r->unit_end_exact[j] : r->behind[j];
            /* both ends timed (marker_timed times a unit's: one untimed means a lapse, and nothing is learnt) */
            int timed = r->timed[i] && (r->unit_end_ok[j] || r->timed[j]);
            CUresult done = REAL(cuEventQuery)(end);
            if (done == CUDA_ERROR_NOT_READY)
                break;
            int held = r->gate && ((r->epoch[i] & 1) || atomic_load(&r->gate->epoch) != r->epoch[i]);
            float ms = 0;
            if (done == CUDA_SUCCESS && !held && timed && HAVE_REAL(cuEventElapsedTime) &&
                REAL(cuEventElapsedTime)(&ms, r->ev[i], end) == CUDA_SUCCESS && ms > 0) {
                if (gem_kcost_learn(r->key[i], (int64_t)((double)ms * 1e6), exact))
                    gem_kcost_remeasure(r->thread_of[i], r->key[i]);
                atomic_fetch_add_explicit(&gem_stats.kernel_costs_learnt, 1, memory_order_relaxed);
                atomic_fetch_add_explicit(&gem_stats.kernel_cost_learnt_ns, (unsigned long long)((double)ms * 1e6),
                                          memory_order_relaxed);
            }
        }
        r->learn_from = j;      /* learnt once: key[i] stays, for adapt (a unit is no queue's length) */
        if (at_head) {
            r->unit_end_ok[j] = 0;
            break;
        }
    }
}

/* Record the end of `thread`'s unit at `slot` (the head) on `s`, if the ring's last marker is that thread's, placed
 * before a kernel to be measured (not a graph's, nor another thread's); r->mu held. Returns 1 if recorded. */
static int record_unit_end(struct ring *r, unsigned slot, CUstream s, const void *thread) {
    unsigned last = (slot + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS;
    r->unit_end_ok[slot] = 0;
    if (!r->used || r->count == 0 || !r->key[last] || r->thread_of[last] != thread ||
        (!r->unit_end[slot] && REAL(cuEventCreate)(&r->unit_end[slot], CU_EVENT_DEFAULT) != CUDA_SUCCESS) ||
        REAL(cuEventRecord)(r->unit_end[slot], s) != CUDA_SUCCESS)
        return 0;
    r->unit_end_ok[slot] = 1;
    r->unit_end_exact[slot] = REAL(cuEventQuery)(mark(r, last)) == CUDA_ERROR_NOT_READY;
    r->unit_end_thread = thread;
    return 1;
}

/* The marker's own calls run in the program's launching thread, in its capture mode (GLOBAL unless it chose
 * otherwise): a capture another thread begins after the check below made the marker's event query or
 * synchronisation an unsafe call, and the driver invalidated that capture (10 of 300 short captures beside a
 * bounded launcher ended with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED; tests/test_e2e_hook.py). So the marker runs
 * in relaxed mode, as the drain does, and gives the thread its mode back. */
static int marker_body(struct gem_inflight *f, CUstream stream, int ptsz, int64_t budget_ns,
                       struct gem_gpugate *gate, const struct gem_marker_kernel *mk);

int gem_inflight_marker(struct gem_inflight *f, CUstream stream, int ptsz, int64_t budget_ns,
                        struct gem_gpugate *gate, const struct gem_marker_kernel *mk) {
    if (atomic_load(&gem_active_captures) > 0 || !HAVE_REAL(cuEventRecord) || !HAVE_REAL(cuEventQuery) ||
        !HAVE_REAL(cuEventSynchronize) || !HAVE_REAL(cuEventCreate) || !HAVE_REAL(cuCtxGetCurrent) ||
        !HAVE_REAL(cuEventElapsedTime))
        return 0;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = HAVE_REAL(cuThreadExchangeStreamCaptureMode) &&
                    REAL(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
    int64_t t0 = gem_now_ns();
    int recorded = marker_body(f, stream, ptsz, budget_ns, gate, mk);
    if (exchanged)
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    /* what a marker costs the launching thread (its waits included): the launch cost's share of the bound */
    atomic_fetch_add_explicit(&gem_stats.marker_host_ns, (unsigned long long)(gem_now_ns() - t0), memory_order_relaxed);
    return recorded;
}

/* Whether the marker about to be recorded in `slot` (its key, ends_unit and per set) is a timed one. A marker placed
 * every N launches (per set) is timed while N finds its level: from the start until an interval judged at the rate in
 * force first leaves N where it is (`ramped`, set by a short interval or one its launcher was ahead of: a launcher
 * never ahead of the GPU, which waits for it anyway, keeps timing them; sampled from the first measure, N grew eight
 * times slower from one launch a marker), and after a halving until a judgement does not halve it again (`shrunk`:
 * kernels that grew longer halve N at every marker, not every eighth). Otherwise it is sampled: such markers come every
 * quarter to half millisecond of GPU work, a couple of thousand a second on a busy GPU, and each timed one cost an H200
 * about 2.2 us between kernels (an uncapped trainer beside a configured but idle group, bounded for it, likely lost
 * about 3% of its rate with every one timed; docs/benchmarks.md, "Twenty-seventh session"). A new chain (after a
 * synchronisation) keeps N and its interval, but its first two markers are timed: a chain shorter than the queue's
 * depth is judged only at the synchronisation, on its newest timed pair (gem_inflight_synced), and with chains of a
 * fixed length the pair in eight could miss every chain. A costed marker (per 0: beside a latency group, where a marker
 * comes every half millisecond of predicted work and also carries the gate's wait) is timed if it begins a kernel
 * measured alone or ends one (learn; a long unit's interval is adapt's too), and while adapt has judged no interval of
 * its chain yet (`measured`: a new chain learns its depth at once, and a short one measures its last interval at the
 * synchronisation; an interval that held a kernel alone, a claim or idle time is judged without reading its time).
 * Every marker is timed as the first pair of every GEM_INFLIGHT_TIMED_EVERY (adapt: the depth, and N). r->mu held. */
static int marker_timed(const struct gem_inflight *f, const struct ring *r, unsigned slot) {
    if (!gem_cfg.marker_sampling || r->key[slot] || r->ends_unit[slot] || r->seq % GEM_INFLIGHT_TIMED_EVERY < 2)
        return 1;
    return r->per[slot] ? !atomic_load(&f->ramped) || atomic_load(&f->shrunk) || r->count < 2 : !r->measured;
}

static int marker_body(struct gem_inflight *f, CUstream stream, int ptsz, int64_t budget_ns,
                       struct gem_gpugate *gate, const struct gem_marker_kernel *mk) {
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx)
        return 0;
    CUstream s = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
    struct ring *r = ring_for(ctx, s, 1);
    if (!r)
        return 0;
    pthread_mutex_lock(&r->mu);
    if (!r->used) {
        if (r->create_skip) {
            r->create_skip--;
            pthread_mutex_unlock(&r->mu);
            return 0;
        }
        /* (a gone context's events were its own: the handles are overwritten, not destroyed) */
        CUevent *timed[GEM_INFLIGHT_MARKERS], *quick[GEM_INFLIGHT_MARKERS];
        for (int i = 0; i < GEM_INFLIGHT_MARKERS; i++) {
            timed[i] = &r->ev[i];
            quick[i] = &r->evq[i];
        }
        if (!gem_real_events_create(timed, GEM_INFLIGHT_MARKERS, CU_EVENT_DEFAULT) ||
            !gem_real_events_create(quick, GEM_INFLIGHT_MARKERS, CU_EVENT_DISABLE_TIMING)) {
            /* created in part, given back (gem_real_events_create); the next try waits a while */
            for (int i = 0; i < GEM_INFLIGHT_MARKERS; i++)
                gem_real_event_destroy(&r->ev[i]);
            r->create_skip = GEM_INFLIGHT_CREATE_BACKOFF;
            pthread_mutex_unlock(&r->mu);
            return 0;
        }
        memset(r->unit_end, 0, sizeof r->unit_end);    /* a gone context's were its own */
        r->used = 1;
    }
    unsigned slot = r->head;
    unsigned last = (slot + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS;
    /* the unit's end, before anything else this marker does (unit_end, above), where learn() will use it */
    r->unit_end_ok[slot] = 0;
    if (mk && mk->ends_unit)
        record_unit_end(r, slot, s, mk->thread);
    /* A stream's events complete in order: with the last marker done, every older one is, and neither the wait
     * below nor `behind` needs a query of its own (a finished event's query costs 1.6 us on the H100). Just asked
     * when the unit's end was recorded; pending then, it is queried again below where that matters. */
    int last_done = r->count == 0 ||
                    (r->unit_end_ok[slot] ? !r->unit_end_exact[slot]
                                          : REAL(cuEventQuery)(mark(r, last)) != CUDA_ERROR_NOT_READY);
    unsigned depth = depth_of(f, budget_ns);
    if (r->count >= depth) {
        /* Wait for the marker `depth` back: then at most `depth` intervals of work stay queued. */
        unsigned back = (slot + GEM_INFLIGHT_MARKERS - depth) % GEM_INFLIGHT_MARKERS;
        if (!last_done && REAL(cuEventQuery)(mark(r, back)) == CUDA_ERROR_NOT_READY) {
            int64_t t0 = gem_now_ns();
            REAL(cuEventSynchronize)(mark(r, back));
            atomic_fetch_add(&gem_stats.marker_waits, 1);
            atomic_fetch_add(&gem_stats.marker_wait_ns, (unsigned long long)(gem_now_ns() - t0));
        }
        if (adapt(f, r, depth))
            r->measured = 1;
    }
    /* Learnt up to here: the host waits for the marker `depth` back (at most GEM_INFLIGHT_MARKERS - 1), so every
     * interval older than that is done and learn_from never falls a whole ring behind. */
    learn(r, 0);
    if (r->count == 0)
        r->learn_from = slot;   /* a new chain: nothing before it is an interval of it */
    r->behind[slot] = !last_done && REAL(cuEventQuery)(mark(r, last)) == CUDA_ERROR_NOT_READY;
    r->per[slot] = mk && mk->costed ? 0 : (uint32_t)atomic_load(&f->launches_per_marker);
    r->counter_of[slot] = gem_tls_counter;      /* (the launching thread's: markers are placed on its launch path) */
    r->launches_at[slot] = gem_tls_counter ? gem_tls_counter->launches : 0;
    r->key[slot] = mk ? mk->key : 0;
    r->unit[slot] = mk ? (unsigned char)mk->unit : 0;
    r->unit_cost[slot] = mk && mk->unit ? mk->unit_cost_ns : 0;
    r->ends_unit[slot] = mk ? (unsigned char)mk->ends_unit : 0;
    r->thread_of[slot] = mk ? mk->thread : NULL;
    r->predicted[slot] = mk ? mk->predicted_ns : 0;
    /* The wait before the marker: during a claim the GPU stops this stream here, at most an interval after
     * the claim began, however deep the queue behind it. */
    r->gate = gate && gem_gpugate_wait(gate, s) ? gate : NULL;
    r->epoch[slot] = r->gate ? atomic_load(&gate->epoch) : 0;
    /* stored only once recorded: a failed record leaves the slot's event from a lap ago, and mark() must name it */
    int timed = marker_timed(f, r, slot);
    int recorded = REAL(cuEventRecord)(timed ? r->ev[slot] : r->evq[slot], s) == CUDA_SUCCESS;
    if (recorded) {
        r->timed[slot] = (unsigned char)timed;
        atomic_fetch_add(&gem_stats.markers, 1);
        if (timed)
            atomic_fetch_add(&gem_stats.markers_timed, 1);
        r->seq++;
        r->head = (slot + 1) % GEM_INFLIGHT_MARKERS;
        r->unit_end_ok[r->head] = 0;    /* a lap old: only a unit's end recorded at the head from now on counts */
        if (r->count < GEM_INFLIGHT_MARKERS)
            r->count++;
    }
    pthread_mutex_unlock(&r->mu);
    return recorded;
}

int gem_inflight_end_unit(CUstream stream) {
    struct gem_thread_counter *t = gem_tls_counter;
    CUcontext ctx = NULL;
    if (!t || atomic_load(&gem_active_captures) > 0 || !HAVE_REAL(cuEventRecord) || !HAVE_REAL(cuEventQuery) ||
        !HAVE_REAL(cuEventCreate) || !HAVE_REAL(cuCtxGetCurrent) || REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS ||
        !ctx)
        return 0;
    struct ring *r = ring_for(ctx, stream, 0);
    if (!r)
        return 0;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = HAVE_REAL(cuThreadExchangeStreamCaptureMode) &&
                    REAL(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
    pthread_mutex_lock(&r->mu);
    int recorded = record_unit_end(r, r->head, stream, t);
    pthread_mutex_unlock(&r->mu);
    if (exchanged)
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    return recorded;
}

/* The rings are keyed by the context's handle, and a reset primary context keeps its handle (a destroyed one's may
 * be handed out again): a ring kept its dead events, every marker's record failed, and the stream's queue was no
 * longer bounded. */
void gem_inflight_context_gone(CUcontext ctx) {
    pthread_mutex_lock(&table_mu);
    for (int i = 0; i < nrings; i++) {
        struct ring *r = &rings[i];
        if (r->ctx != ctx)
            continue;
        pthread_mutex_lock(&r->mu);
        r->used = 0;
        r->create_skip = 0;     /* a new context under the handle tries at its first marker */
        memset(r->unit_end_ok, 0, sizeof r->unit_end_ok);   /* their events went with the context */
        r->count = 0;
        r->measured = 0;
        r->head = 0;
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&table_mu);
}

int gem_inflight_synced(struct gem_inflight *f, CUcontext ctx, int whole, CUstream stream, int64_t waited_ns,
                        int64_t budget_ns) {
    /* whether this context-wide wait ended launches of the calling thread's own (below): counted from its last
     * context-wide synchronisation, whether anything was bounded then or not (a stream's synchronisation does not
     * restart the count: the context's wait after it still ends launches it did not). The count is the thread's, on
     * every device: a thread that drives two GPUs has its first device's wait judged for both. */
    struct gem_thread_counter *t = gem_tls_counter;
    int launched = t && whole && t->launches != t->launches_at_sync;
    if (t && whole)
        t->launches_at_sync = t->launches;
    if (__atomic_load_n(&nrings, __ATOMIC_ACQUIRE) == 0)
        return 0;           /* never bounded: nothing to restart, nor to judge */
    unsigned chain = 0;     /* the longest chain the synchronisation ended */
    int costed = 0;         /* one of them was placed by the kernels' costs (kcost.h) */
    int64_t predicted = 0;  /* what their chains' kernels were predicted to cost */
    int graphs = 0;         /* a chain held a graph (no prediction for it) */
    pthread_t self = pthread_self();
    CUcontext cur = NULL;
    /* The events are the context's: timed only from it, and not while a capture runs. A capture another thread
     * begins after this check would be invalidated by the timing calls in the thread's own (GLOBAL) mode, so they
     * run in relaxed mode, as the markers do. */
    int may_time = atomic_load(&gem_active_captures) == 0 && HAVE_REAL(cuEventElapsedTime) &&
                   HAVE_REAL(cuCtxGetCurrent) && REAL(cuCtxGetCurrent)(&cur) == CUDA_SUCCESS && cur == ctx;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = may_time && HAVE_REAL(cuThreadExchangeStreamCaptureMode) &&
                    REAL(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
    may_time = may_time && exchanged;
    pthread_mutex_lock(&table_mu);
    for (int i = 0; i < nrings; i++) {
        struct ring *r = &rings[i];
        if (r->ctx != ctx || !r->count ||
            (!whole && (r->stream != stream || (stream == CU_STREAM_PER_THREAD && !pthread_equal(r->thread, self)))))
            continue;
        /* Every marker recorded before the synchronisation is done. One a thread records meanwhile on another
         * stream may not be: forgetting it lets that stream queue one interval more, once. */
        pthread_mutex_lock(&r->mu);
        if (r->count > chain)
            chain = r->count;
        if (!r->per[(r->head + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS]) {
            costed = 1;
            for (unsigned k = 1; k <= r->count; k++) {
                unsigned i = (r->head + GEM_INFLIGHT_MARKERS - k) % GEM_INFLIGHT_MARKERS;
                predicted += r->predicted[i];
                graphs |= r->unit[i] && !r->key[i];
            }
        }
        /* A chain shorter than the queue's depth (a program that synchronises often) never waited for a marker,
         * so it measured nothing: the rate could not grow, nor the depth learn the kernels' length. Its newest
         * interval between two timed markers is measured now, off the launch path, its events done (a sampled
         * chain's last two may be untimed, and with chains of a fixed length the pair in eight can fall on the same
         * places in each: a chain's first two markers are timed for this, marker_timed). A chain placed by costs
         * is judged on its last interval, as before: its markers are all timed until it is measured, and an
         * older interval of it (a unit's, one that held a kernel measured alone) judged here had the thread's
         * kernels measured again for nothing (more markers beside a latency group). */
        if (may_time && !r->measured) {
            unsigned back = 1;
            if (r->per[(r->head + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS])
                for (; back < r->count; back++) {
                    unsigned done = (r->head + GEM_INFLIGHT_MARKERS - back) % GEM_INFLIGHT_MARKERS;
                    if (r->timed[done] && r->timed[(done + GEM_INFLIGHT_MARKERS - 1) % GEM_INFLIGHT_MARKERS])
                        break;
                }
            if (back == 1 || back < r->count)
                adapt(f, r, back);
        }
        if (may_time)
            learn(r, 1);           /* every marker is done: the last kernel measured alone too, if its end was recorded */
        r->count = 0;
        r->measured = 0;
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&table_mu);
    if (exchanged)
        REAL(cuThreadExchangeStreamCaptureMode)(&mode);
    /* Judged on a chain of markers it ended: a wait on a stream without one (a copy stream, another device's) or on
     * work queued while nothing was bounded says nothing of the markers' spacing. Or on a context-wide wait that
     * ended launches of the calling thread's own, marker or not: a rate grown on tiny kernels (a marker per
     * thousands of launches) put none in a burst of a few 1 ms kernels between two synchronisations, so no chain
     * ever ended and each synchronisation waited for the whole burst: tests/test_e2e_latency.py's
     * test_a_queue_too_deep_for_its_markers_is_caught_at_the_synchronisation[0], beside two busy processes on two
     * cores, waited 16-17 ms at all 20 of its synchronisations in 2 of 5 runs (its empty kernels, run in bursts by a
     * starved simulator, had grown the rate twelve times; one or two chains ended); 0 of 12 runs with this. */
    if (budget_ns <= 0 || (chain == 0 && !launched) || waited_ns <= 2 * budget_ns)
        return 0;
    /* placed by costs, and the wait far longer than the kernels queued were predicted to take (one long kernel
     * alone may be longer than the budget): some cost is wrong */
    if (costed && !graphs && waited_ns > 2 * (predicted + (t ? t->pending_ns : 0)) + gem_kcost_target_ns())
        gem_kcost_verify_thread();
    /* The queue held about `waited_ns` of work in at most `chain` intervals (and the launches after the last
     * marker): the intervals are at least that long, so the depth shrinks with the rate. */
    int64_t interval = waited_ns / (chain ? chain : 1);
    if (interval > atomic_load(&f->interval_ns))
        atomic_store(&f->interval_ns, interval);
    atomic_fetch_add(&gem_stats.marker_sync_shrinks, 1);
    uint64_t n = atomic_load(&f->launches_per_marker);
    if (n <= 1)
        return 0;
    atomic_store(&f->launches_per_marker, n / 2);
    atomic_store(&f->shrunk, 1);    /* (marker_timed: the markers after a halving are timed until N holds) */
    atomic_fetch_add(&gem_stats.marker_shrinks, 1);
    return 1;
}

void gem_inflight_after_fork(void) {
    pthread_mutex_init(&table_mu, NULL);
    nrings = 0;
    table_full_said = 0;
}
