/*
 * inflight.h -- keeping the work a process has queued on the GPU short.
 *
 * A launch returns long before its kernel runs: a training loop can queue
 * hundreds of milliseconds of kernels, and once queued they run whatever the
 * hook decides afterwards. So a slot's end (or a latency group's claim) would
 * only take effect after that queue, and a capped group could run far past
 * its cap inside one slot. When the grant says so (GEM_GRANT_BOUND: a latency
 * group is present, the group is capped below 1, or another group is configured
 * on the GPU), the gate asks for a
 * marker every N launches (gate.h): the hook records an event on the
 * launching stream, first waiting for the marker `depth` back, so at most
 * `depth` markers' worth of work stays queued on each stream. The GPU time
 * between consecutive markers is measured: N grows while an interval is
 * shorter than a quarter of GEMINI_INFLIGHT_MS (default 1 ms) and shrinks
 * while it is longer than half of it (an eighth and a quarter while the
 * markers carry the GPU-side gate's waits), and depth is the budget over the
 * interval (1 to GEM_INFLIGHT_MARKERS - 1). The budget is half the time left
 * in the slot (at least GEMINI_INFLIGHT_MS): a capped trainer keeps much of
 * a slot queued, which hides its host's pauses, yet the queue ends with the
 * slot even when a neighbour's leftover queue shares the GPU with it. An
 * interval measured across an idle moment (the marker was recorded after the
 * one before had finished) holds idle time and is not used. A context-wide
 * synchronisation empties every queue of the context (a stream's own, that
 * stream's), so each of its streams' chains starts afresh after it: no interval across it is measured (its
 * length is the host's, and judging the rate on it halved the rate at every
 * synchronisation and doubled it again within the next burst), and no marker
 * from before it is waited for or queried. How long the synchronisation
 * waited is the queue it found: more than twice the budget means the markers
 * were too far apart, and the rate halves (a program that synchronises more
 * often than every two markers has no interval measured at all). With GEM_GRANT_TIGHT (a latency group may claim the GPU)
 * it is GEMINI_INFLIGHT_MS: with millisecond kernels one or two of them stay
 * queued, with microsecond kernels a few hundred launches. A
 * graph launch is one unit (a marker after each). Nothing is
 * recorded while any stream of the process captures (a marker would become
 * a node of the user's graph).
 */
#ifndef GEMINI_INFLIGHT_H
#define GEMINI_INFLIGHT_H

#include <stdatomic.h>
#include <stdint.h>

#include "cuda_types.h"
#include "gpugate.h"

#define GEM_INFLIGHT_MARKERS 64
/* Once a chain has measured an interval (and, for markers placed every N launches, while N holds), one pair of
 * markers in this many is timed (inflight.c: a timed event costs the GPU about 2 us, an untimed one nothing
 * measurable): the queue's depth, and N, follow the kernels' lengths within this many markers plus the queue's depth
 * (an interval is judged when the host waits for its end, `depth` markers after it was recorded). */
#define GEM_INFLIGHT_TIMED_EVERY 8u

/* One device's marker rate and queue depth. */
struct gem_inflight {
    atomic_ullong launches_per_marker;  /* a power of two; the gate's mask is this minus one */
    atomic_llong interval_ns;           /* GPU time between consecutive markers, last measured */
    /* Markers placed every N launches are timed only while N finds its level (inflight.c, marker_timed): from the
     * start until an interval judged at the rate in force first leaves N where it is (`ramped`), and from a halving
     * of N until the next interval that does not halve it (`shrunk`). Only an interval that kept the GPU busy (its
     * launcher ahead of it) or was short sets `ramped`: a launcher that is never ahead of the GPU times every marker
     * (the GPU waits for it anyway). One flag per device: a stream whose interval holds N ends another's halving. */
    atomic_int ramped;
    atomic_int shrunk;
};

void gem_inflight_init(struct gem_inflight *f);

/* How a marker was placed beside a latency group (gate.h): by the kernels' predicted cost rather than every N
 * launches (`costed`), and before a kernel to be measured alone (`key`, kcost.h; 0: none). Its interval is then
 * not judged by the rate's rules, and the one holding `key` alone teaches the cost table. */
struct gem_marker_kernel {
    int costed;
    uint64_t key;
    int unit;               /* the interval this marker begins holds one unit: a kernel measured alone, or a graph */
    int ends_unit;          /* this marker ends its thread's one-unit interval (the launch after it) */
    const void *thread;     /* the launching thread (its counter): a unit is measured only between its own markers */
    int64_t predicted_ns;   /* the predicted cost of the launches since the thread's marker before this one */
    int64_t unit_cost_ns;   /* with `unit`: its kernel's predicted cost (0: not known yet, or a graph) */
};
/* Record a marker on `stream` (NULL + ptsz: the per-thread stream), first waiting until at most about
 * `budget_ns` of GPU work (measured intervals) stays queued on that stream; with `gate` (not NULL), a wait on
 * the GPU-side gate's word goes before it (gpugate.h). Never fails the launch. Returns 1 if it recorded one (not
 * while a stream captures, nor without the driver's event calls). */
int gem_inflight_marker(struct gem_inflight *f, CUstream stream, int ptsz, int64_t budget_ns,
                        struct gem_gpugate *gate, const struct gem_marker_kernel *mk);

/* Before the program synchronises `stream` (CU_STREAM_PER_THREAD: the calling thread's), or its whole context: the
 * calling thread's kernel measured alone on it, if its marker is the stream's last, ends here (its end recorded
 * now), so the synchronisation's learning takes it. Without this a program that synchronises after every second
 * launch never learnt its kernel: each second launch was measured alone again, a marker each. Returns 1 if
 * recorded. Off the launch path (the synchronisation's wrapper). */
int gem_inflight_end_unit(CUstream stream);

/* The program synchronised the whole of `ctx` (whole), or its `stream` (CU_STREAM_PER_THREAD: the calling
 * thread's), after waiting `waited_ns`: those streams' chains start afresh, and the rate halves if the wait was
 * more than twice `budget_ns` (0: the queue is not bounded now, no judgement). Returns 1 if the rate changed.
 * Off the launch path (the synchronisation's wrapper). */
int gem_inflight_synced(struct gem_inflight *f, CUcontext ctx, int whole, CUstream stream, int64_t waited_ns,
                        int64_t budget_ns);

void gem_inflight_after_fork(void);     /* the parent's events are not the child's */
/* A context was destroyed or reset: its rings' events went with it (made afresh at their next marker). */
void gem_inflight_context_gone(CUcontext ctx);

#endif /* GEMINI_INFLIGHT_H */
