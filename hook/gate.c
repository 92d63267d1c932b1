/*
 * gate.c -- launch gating.
 *
 * Each device the process uses has a token with a deadline. While the token
 * is valid the launch path is a clock read and a compare (gem_gate_launch in
 * gemhook.h). Everything else happens here, off that path:
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
 *     the hook never synchronises while a capture is open.
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
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "gemhook.h"

struct gem_device gem_devices[GEM_MAX_DEVICES];
atomic_int gem_device_count;
atomic_int gem_active_captures;

static pthread_mutex_t runtime_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int runtime_ready;

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t watch_cv;
static int watcher_started;
static int watcher_stop;

static atomic_int fail_open_active;

CUresult gem_unavailable_result(void) {
    /* "system not yet initialized": the closest driver code to "the GPU share
     * could not be authorised"; the hook has already printed why. */
    return CUDA_ERROR_SYSTEM_NOT_READY;
}

/* ---- devices ----------------------------------------------------------------------------- */

static void format_uuid(const CUuuid *u, char *out, size_t len) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The pod manager for a device: GEMINI_POD_MANAGERS "uuid=ip:port,..." if it names the device, else the default. */
void gem_endpoint_for(const char *uuid, char *ip, size_t ip_len, int *port) {
    snprintf(ip, ip_len, "%s", gem_cfg.pmgr_ip);
    *port = gem_cfg.pmgr_port;
    char map[sizeof gem_cfg.pmgr_map];
    snprintf(map, sizeof map, "%s", gem_cfg.pmgr_map);
    char *save = NULL;
    for (char *item = strtok_r(map, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq)
            continue;
        *eq = '\0';
        if (strcmp(item, uuid) != 0)
            continue;
        char mip[64];
        int mport;
        if (gemhook_parse_endpoint(eq + 1, mip, sizeof mip, &mport) == 0) {
            snprintf(ip, ip_len, "%s", mip);
            *port = mport;
        } else {
            GEM_LOG(GEM_LOG_ERROR, "GEMINI_POD_MANAGERS: bad endpoint '%s' for %s", eq + 1, uuid);
        }
    }
}

static void device_setup(struct gem_device *d, int ordinal) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, &ca);
    pthread_condattr_destroy(&ca);
    d->ordinal = ordinal;
    d->state = GEM_TOKEN_NONE;
    gemhook_burst_init(&d->est, gem_cfg.burst_merge_ns, gem_cfg.burst_window_ns);
    char uuid[GEM_UUID_LEN] = "";
    CUdevice dev = ordinal;
    CUuuid raw;
    if (HAVE_REAL(cuDeviceGet) && REAL(cuDeviceGet)(&dev, ordinal) == CUDA_SUCCESS && HAVE_REAL(cuDeviceGetUuid) &&
        REAL(cuDeviceGetUuid)(&raw, dev) == CUDA_SUCCESS)
        format_uuid(&raw, uuid, sizeof uuid);
    d->cudev = dev;
    char ip[64];
    int port;
    gem_endpoint_for(uuid, ip, sizeof ip, &port);
    gem_conn_init(&d->conn, ip, port, ordinal, uuid, &d->mem_in_use);
    d->initialised = 1;
}

static void *watcher_main(void *arg);

static void start_watcher(void) {
    pthread_mutex_lock(&watch_mu);
    if (!watcher_started) {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&watch_cv, &ca);
        pthread_condattr_destroy(&ca);
        /* The watcher must never take the program's signals. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, watcher_main, NULL) == 0) {
            watcher_started = 1;
            pthread_setname_np(t, "gemhook-watch");
        } else {
            GEM_LOG(GEM_LOG_WARN, "cannot start the watcher thread: tokens expire only at the next launch");
        }
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    pthread_mutex_unlock(&watch_mu);
}

/* A new deadline: make sure the watcher runs (it does not survive fork) and looks again. */
static void wake_watcher(void) {
    start_watcher();
    pthread_mutex_lock(&watch_mu);
    pthread_cond_signal(&watch_cv);
    pthread_mutex_unlock(&watch_mu);
}

int gem_runtime_init(void) {
    if (GEM_LIKELY(atomic_load_explicit(&runtime_ready, memory_order_acquire)))
        return 0;
    pthread_mutex_lock(&runtime_mu);
    int rc = 0;
    if (atomic_load(&runtime_ready))
        goto out;
    if (gem_ensure_real() != 0) {
        rc = -1;
        goto out;
    }
    if (gem_cfg.disabled) {
        for (int i = 0; i < GEM_MAX_DEVICES; i++)
            atomic_store(&gem_devices[i].deadline_ns, INT64_MAX);
        atomic_store(&gem_device_count, 1);
        GEM_LOG(GEM_LOG_INFO, "GEMINI_DISABLE is set: passing every call through ungated");
        atomic_store_explicit(&runtime_ready, 1, memory_order_release);
        goto out;
    }
    int count = 0;
    if (!HAVE_REAL(cuDeviceGetCount) || REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS || count <= 0) {
        rc = -1; /* CUDA not initialised yet: the program's own call will report it; try again later */
        goto out;
    }
    if (count > GEM_MAX_DEVICES) {
        GEM_LOG(GEM_LOG_WARN, "%d devices visible; gemini manages the first %d", count, GEM_MAX_DEVICES);
        count = GEM_MAX_DEVICES;
    }
    for (int i = 0; i < count; i++)
        device_setup(&gem_devices[i], i);
    atomic_store(&gem_device_count, count);
    atomic_store_explicit(&runtime_ready, 1, memory_order_release);
    GEM_LOG(GEM_LOG_DEBUG, "initialised: %d device(s), pod manager %s:%d, group '%s'", count,
            gem_devices[0].conn.ip, gem_devices[0].conn.port, gem_cfg.pod_name);
out:
    pthread_mutex_unlock(&runtime_mu);
    return rc;
}

struct gem_device *gem_current_device_multi(void) {
    CUdevice dev = 0;
    int count = atomic_load_explicit(&gem_device_count, memory_order_relaxed);
    if (HAVE_REAL(cuCtxGetDevice) && REAL(cuCtxGetDevice)(&dev) == CUDA_SUCCESS && dev >= 0 && dev < count)
        return &gem_devices[dev];
    return &gem_devices[0];
}

struct gem_device *gem_device_by_ordinal(CUdevice dev) {
    int count = atomic_load_explicit(&gem_device_count, memory_order_relaxed);
    if (dev >= 0 && dev < count)
        return &gem_devices[dev];
    return NULL;
}

/* ---- stream capture ---------------------------------------------------------------------- */

#define GEM_MAX_CAPTURES 256
struct capture_key {
    CUstream stream;
    pthread_t thread; /* for per-thread default streams, whose handle is the same in every thread */
};
static pthread_mutex_t capture_mu = PTHREAD_MUTEX_INITIALIZER;
static struct capture_key captures[GEM_MAX_CAPTURES];
static int ncaptures;

static struct capture_key capture_key_of(CUstream s, int ptsz) {
    struct capture_key k = {s, 0};
    if ((s == NULL && ptsz) || s == CU_STREAM_PER_THREAD) {
        k.stream = CU_STREAM_PER_THREAD;
        k.thread = pthread_self();
    }
    return k;
}

void gem_capture_changed(CUstream stream, int begins, int ptsz, CUresult rc) {
    struct capture_key k = capture_key_of(stream, ptsz);
    pthread_mutex_lock(&capture_mu);
    int found = -1;
    for (int i = 0; i < ncaptures; i++)
        if (captures[i].stream == k.stream && pthread_equal(captures[i].thread, k.thread))
            found = i;
    if (begins && rc == CUDA_SUCCESS && found < 0 && ncaptures < GEM_MAX_CAPTURES) {
        captures[ncaptures++] = k;
        atomic_fetch_add(&gem_active_captures, 1);
    } else if (!begins && found >= 0) {
        /* the capture is over whatever the result (an invalidated capture ends too) */
        captures[found] = captures[--ncaptures];
        atomic_fetch_sub(&gem_active_captures, 1);
    }
    pthread_mutex_unlock(&capture_mu);
}

static int stream_is_capturing(CUstream s, int ptsz) {
    /* The legacy stream cannot be captured, and querying it during another
     * thread's capture is itself an unsafe call: never ask about it. */
    if ((s == NULL && !ptsz) || s == CU_STREAM_LEGACY)
        return 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUstream q = (s == NULL) ? CU_STREAM_PER_THREAD : s;
    if (!HAVE_REAL(cuStreamIsCapturing) || REAL(cuStreamIsCapturing)(q, &status) != CUDA_SUCCESS)
        return 0;
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* ---- draining ------------------------------------------------------------------------------ */

/* The slot's first kernel is about to be launched on `stream`: mark the GPU's position with an event, so
 * that the GPU time the slot really had (from the first kernel, after the grant travelled here and the
 * GPU switched contexts, to the end of the drain) can be measured. Called with d->mu held, in the
 * launching thread, only while no stream of the process captures (never record into a capture). */
static void mark_slot_start(struct gem_device *d, CUstream stream, int ptsz) {
    d->slot_measured = 0;
    if (!HAVE_REAL(cuEventRecord) || !HAVE_REAL(cuEventCreate) || !HAVE_REAL(cuEventElapsedTime) ||
        atomic_load(&gem_active_captures) > 0)
        return;
    CUcontext ctx = NULL;
    if (!HAVE_REAL(cuCtxGetCurrent) || REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx)
        return;
    if (d->ev_ctx != ctx) { /* events belong to a context; the old ones (if any) are left to it */
        d->ev_start = d->ev_end = NULL;
        if (REAL(cuEventCreate)(&d->ev_start, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
            REAL(cuEventCreate)(&d->ev_end, CU_EVENT_DEFAULT) != CUDA_SUCCESS)
            return;
        d->ev_ctx = ctx;
    }
    CUstream s = (stream == NULL && ptsz) ? CU_STREAM_PER_THREAD : stream;
    d->slot_measured = REAL(cuEventRecord)(d->ev_start, s) == CUDA_SUCCESS;
}

/* Wait for the process's outstanding work in ctx; returns the time it was done. If the slot's start was
 * marked, *used_ns gets the GPU time from the slot's first kernel to now (0 if unknown). */
static int64_t drain(struct gem_device *d, CUcontext ctx, int64_t *used_ns) {
    *used_ns = 0;
    int measured = d->slot_measured;
    d->slot_measured = 0;
    if (atomic_load(&gem_active_captures) > 0) {
        /* A context-wide synchronise would break the capture; captured work is
         * not running anyway, and other streams' work is charged next time. */
        atomic_fetch_add(&gem_stats.drain_skipped_capture, 1);
        return gem_now_ns();
    }
    atomic_fetch_add(&gem_stats.drains, 1);
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    int exchanged = HAVE_REAL(cuThreadExchangeStreamCaptureMode) &&
                    REAL(cuThreadExchangeStreamCaptureMode)(&mode) == CUDA_SUCCESS;
    int pushed = ctx && HAVE_REAL(cuCtxPushCurrent_v2) && REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
    if (HAVE_REAL(cuCtxSynchronize))
        REAL(cuCtxSynchronize)(); /* the real one: the hook's own sync is not a burst boundary */
    if (measured && ctx == d->ev_ctx && REAL(cuEventRecord)(d->ev_end, NULL) == CUDA_SUCCESS &&
        REAL(cuEventSynchronize)(d->ev_end) == CUDA_SUCCESS) {
        float ms = 0;
        if (REAL(cuEventElapsedTime)(&ms, d->ev_start, d->ev_end) == CUDA_SUCCESS && ms > 0) {
            *used_ns = (int64_t)((double)ms * 1e6);
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
    return gem_now_ns();
}

/* End the current slot: stop launches, drain, measure overuse. Called with d->mu held and the
 * state HELD; returns with d->mu held and the state NONE. The burst in progress is cut by the
 * slot's end, so its length is unknown: it is discarded rather than recorded short. */
static void expire_locked(struct gem_device *d) {
    d->state = GEM_TOKEN_DRAINING;
    atomic_store(&d->deadline_ns, 0);
    int64_t deadline = d->slot_deadline_ns;
    CUcontext ctx = d->ctx;
    int was_in_burst = atomic_exchange(&d->in_burst, 0);
    int64_t last_sync = atomic_load(&d->last_sync_ns);
    pthread_mutex_unlock(&d->mu);
    int64_t used = 0;
    int64_t done = drain(d, ctx, &used);
    pthread_mutex_lock(&d->mu);
    d->pending_used_ns = used;
    /* Not in a burst: everything had finished by the last synchronisation. */
    int64_t finished = was_in_burst ? done : last_sync;
    int64_t overuse = finished > deadline ? finished - deadline : 0;
    d->pending_overuse_ns += overuse;
    atomic_fetch_add(&gem_stats.expiries, 1);
    atomic_fetch_add(&gem_stats.overuse_ns, (unsigned long long)overuse);
    d->state = GEM_TOKEN_NONE;
    pthread_cond_broadcast(&d->cv);
}

/* ---- talking to the pod manager ------------------------------------------------------------ */

static void report_failure(struct gem_device *d, int rc, const struct gem_msg *reply) {
    atomic_fetch_add(&gem_stats.gate_errors, 1);
    if (rc == GEM_CALL_REFUSED)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d: the pod manager refused the token request: %.*s", d->ordinal,
                GEM_ERRMSG_LEN, reply->u.error.message);
    else if (rc == GEM_CALL_TIMEOUT)
        GEM_LOG(GEM_LOG_ERROR, "GPU %d: no token from the pod manager at %s:%d after %.0f s "
                "(GEMINI_TOKEN_TIMEOUT_MS); failing this launch", d->ordinal, d->conn.ip, d->conn.port,
                (double)gem_cfg.token_timeout_ns / 1e9);
}

/* Ask for a token. Called with d->mu held and state NONE; returns with d->mu held. */
static int request_locked(struct gem_device *d) {
    d->state = GEM_TOKEN_REQUESTING;
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_TOKEN_REQUEST, 0);
    int64_t overuse = d->pending_overuse_ns;
    req.u.token_request.overuse_ns = overuse;
    req.u.token_request.burst_ns = gemhook_burst_predict(&d->est, gem_now_ns()); /* fresh, for the quota */
    int64_t used = d->pending_used_ns;
    req.u.token_request.used_ns = used;
    atomic_fetch_add(&gem_stats.token_requests, 1);
    pthread_mutex_unlock(&d->mu);
    int rc = gem_conn_call(&d->conn, &req, &reply, gem_cfg.token_timeout_ns);
    pthread_mutex_lock(&d->mu);
    if (rc == GEM_CALL_OK && reply.hdr.type == GEM_MSG_TOKEN_GRANT) {
        int64_t now = gem_now_ns();
        int64_t quota = reply.u.token_grant.quota_ns;
        if (quota < 100000)
            quota = 100000; /* never a slot too short to launch in */
        d->pending_overuse_ns -= overuse;
        if (d->pending_used_ns == used)
            d->pending_used_ns = 0;
        d->token_seq = reply.u.token_grant.token_seq;
        d->quota_ns = quota;
        d->granted_ns = now;
        d->slot_deadline_ns = now + quota;
        d->bursts_in_slot = 0;
        d->slot_unmarked = 1; /* the next launch through the slow path marks the slot's start */
        if (HAVE_REAL(cuCtxGetCurrent)) {
            CUcontext ctx = NULL;
            if (REAL(cuCtxGetCurrent)(&ctx) == CUDA_SUCCESS && ctx)
                d->ctx = ctx;
        }
        d->state = GEM_TOKEN_HELD;
        atomic_store(&d->deadline_ns, d->slot_deadline_ns);
        atomic_fetch_add(&gem_stats.grants, 1);
        GEM_LOG(GEM_LOG_DEBUG, "GPU %d: token %llu for %.3f ms", d->ordinal,
                (unsigned long long)d->token_seq, (double)quota / 1e6);
        rc = GEM_CALL_OK;
    } else {
        if (rc == GEM_CALL_OK)
            rc = GEM_CALL_REFUSED; /* a reply of the wrong type */
        d->state = GEM_TOKEN_NONE;
        report_failure(d, rc, &reply);
    }
    pthread_cond_broadcast(&d->cv);
    if (rc == GEM_CALL_OK)
        wake_watcher();
    return rc;
}

/* Give the slot back (idle, or to renew before a burst). Called without d->mu. */
static void send_release(struct gem_device *d, uint64_t token_seq, int64_t overuse, int64_t used) {
    /* (a failed release loses `used`: the slot is then charged in full, the conservative side) */
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_TOKEN_RELEASE, 0);
    req.u.token_release.token_seq = token_seq;
    req.u.token_release.overuse_ns = overuse;
    req.u.token_release.used_ns = used;
    req.u.token_release.burst_ns = atomic_load(&d->predicted_burst_ns);
    int rc = gem_conn_call(&d->conn, &req, &reply, 5 * GEM_NS_PER_S);
    if (rc != GEM_CALL_OK) {
        /* The overuse is not lost: it goes with the next request. */
        pthread_mutex_lock(&d->mu);
        d->pending_overuse_ns += overuse;
        pthread_mutex_unlock(&d->mu);
    }
}

/* Give the slot back, keeping launchers waiting until the release has gone out. Called with d->mu held;
 * returns with it released. */
static void release_slot_unlock(struct gem_device *d, uint64_t seq, int64_t overuse, int64_t used) {
    d->state = GEM_TOKEN_REQUESTING;
    pthread_mutex_unlock(&d->mu);
    send_release(d, seq, overuse, used);
    pthread_mutex_lock(&d->mu);
    d->state = GEM_TOKEN_NONE;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

int gem_fail_open_active(void) { return atomic_load(&fail_open_active); }

void gem_enter_fail_open(void) {
    if (atomic_exchange(&fail_open_active, 1) == 0)
        GEM_LOG(GEM_LOG_WARN, "GEMINI_FAIL_OPEN is set and the pod manager cannot be reached: "
                "running UNGATED, without time shares or memory limits");
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < (count > 0 ? count : 1); i++)
        atomic_store(&gem_devices[i].deadline_ns, INT64_MAX);
}

/* ---- the slow path of a launch --------------------------------------------------------------- */

CUresult gem_gate_slow(struct gem_device *d, CUstream stream, int ptsz, int64_t now) {
    if (gem_runtime_init() != 0) {
        /* No driver handle or CUDA not initialised: the real call reports the problem. */
        return gem_ensure_real() == 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
    }
    d = gem_current_device();
    if (now < atomic_load(&d->deadline_ns))
        return CUDA_SUCCESS; /* initialisation made it valid (disabled, fail-open) */
    if (atomic_load(&gem_active_captures) > 0 && stream_is_capturing(stream, ptsz)) {
        atomic_fetch_add(&gem_stats.capture_passthrough, 1);
        return CUDA_SUCCESS; /* recorded into a graph, not run: the graph launch is gated */
    }
    int waited = 0;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        int64_t t = gem_now_ns();
        if (t < atomic_load(&d->deadline_ns))
            break;
        if (d->state == GEM_TOKEN_HELD) {
            expire_locked(d);
            continue;
        }
        if (d->state == GEM_TOKEN_NONE) {
            waited = 1;
            int rc = request_locked(d);
            if (rc == GEM_CALL_OK)
                continue;
            pthread_mutex_unlock(&d->mu);
            if (gem_cfg.fail_open && (rc == GEM_CALL_UNREACHABLE || rc == GEM_CALL_BROKEN)) {
                gem_enter_fail_open();
                return CUDA_SUCCESS;
            }
            return gem_unavailable_result();
        }
        /* another thread is requesting or draining */
        waited = 1;
        d->waiters++;
        pthread_cond_wait(&d->cv, &d->mu);
        d->waiters--;
    }
    /* the launch that follows starts a burst on the fresh slot */
    int64_t t = gem_now_ns();
    if (!atomic_exchange(&d->in_burst, 1))
        atomic_store(&d->burst_start_ns, t);
    if (d->slot_unmarked)
        mark_slot_start(d, stream, ptsz);
    d->slot_unmarked = 0;
    pthread_mutex_unlock(&d->mu);
    if (waited) {
        atomic_fetch_add(&gem_stats.waits, 1);
        atomic_fetch_add(&gem_stats.wait_ns, (unsigned long long)(t - now));
    }
    return CUDA_SUCCESS;
}

/* First launch after a synchronisation, with a valid token. */
CUresult gem_burst_begin(struct gem_device *d, CUstream stream, int ptsz, int64_t now) {
    int64_t predicted = atomic_load_explicit(&d->predicted_burst_ns, memory_order_relaxed);
    int64_t left = atomic_load_explicit(&d->deadline_ns, memory_order_relaxed) - now;
    /* Within the merge gap of the last synchronisation this launch continues the same burst
     * (the estimator merges them), so it is not a new burst that might not fit. */
    int continues = now - atomic_load_explicit(&d->last_sync_ns, memory_order_relaxed) < gem_cfg.burst_merge_ns;
    if (predicted > left && !continues) {
        /* Renew: the burst would overrun this slot. Give the rest back and start the burst on a
         * fresh token, unless this slot has not run a burst yet (a fresh slot always starts). */
        pthread_mutex_lock(&d->mu);
        if (d->state == GEM_TOKEN_HELD && d->bursts_in_slot > 0 && !atomic_load(&d->in_burst)) {
            uint64_t seq = d->token_seq;
            d->slot_deadline_ns = now;
            expire_locked(d);
            int64_t overuse = d->pending_overuse_ns, used = d->pending_used_ns;
            d->pending_overuse_ns = d->pending_used_ns = 0;
            release_slot_unlock(d, seq, overuse, used);
            atomic_fetch_add(&gem_stats.burst_renewals, 1);
            return gem_gate_slow(d, stream, ptsz, gem_now_ns());
        }
        pthread_mutex_unlock(&d->mu);
    }
    int expected = 0;
    if (atomic_compare_exchange_strong(&d->in_burst, &expected, 1))
        atomic_store(&d->burst_start_ns, now);
    return CUDA_SUCCESS;
}

/* After a synchronising call of the program: the burst, if any, is over. */
void gem_on_sync(void) {
    if (!atomic_load_explicit(&runtime_ready, memory_order_acquire))
        return;
    struct gem_device *d = gem_current_device();
    int64_t now = gem_now_ns();
    atomic_store(&d->last_sync_ns, now);
    gem_memory_on_sync();
    if (!atomic_exchange(&d->in_burst, 0))
        return;
    pthread_mutex_lock(&d->mu);
    gemhook_burst_record(&d->est, atomic_load(&d->burst_start_ns), now);
    /* The p90 sorts every burst of the last 3 s; a program that synchronises every millisecond would
     * pay for that each time, so the prediction is refreshed at most every 5 ms. */
    if (now - d->predicted_at_ns >= 5 * GEM_NS_PER_MS) {
        atomic_store(&d->predicted_burst_ns, gemhook_burst_predict(&d->est, now));
        d->predicted_at_ns = now;
    }
    d->bursts_in_slot++;
    pthread_mutex_unlock(&d->mu);
}

/* ---- the watcher ------------------------------------------------------------------------------ */

/* One pass over a device; returns when the watcher should look at it again. */
static int64_t watch_device(struct gem_device *d, int64_t now) {
    int64_t next = now + 100 * GEM_NS_PER_MS;
    pthread_mutex_lock(&d->mu);
    if (d->state != GEM_TOKEN_HELD) {
        pthread_mutex_unlock(&d->mu);
        return next;
    }
    if (now >= d->slot_deadline_ns) {
        expire_locked(d);
        if (d->waiters == 0) {
            /* Nobody wants to launch: report the overuse and let the group's slot go. */
            uint64_t seq = d->token_seq;
            int64_t overuse = d->pending_overuse_ns, used = d->pending_used_ns;
            d->pending_overuse_ns = d->pending_used_ns = 0;
            pthread_mutex_unlock(&d->mu);
            send_release(d, seq, overuse, used);
            return next;
        }
        pthread_mutex_unlock(&d->mu); /* a waiting launcher asks, carrying the overuse */
        return next;
    }
    if (d->slot_deadline_ns < next)
        next = d->slot_deadline_ns;
    if (gem_cfg.idle_release_ns > 0 && atomic_load(&d->in_burst) && now + gem_cfg.idle_release_ns < next)
        next = now + gem_cfg.idle_release_ns; /* look again: the burst may end and the process go idle */
    if (gem_cfg.idle_release_ns > 0 && !atomic_load(&d->in_burst)) {
        int64_t idle_since = atomic_load(&d->last_sync_ns);
        if (idle_since < d->granted_ns)
            idle_since = d->granted_ns;
        if (now - idle_since >= gem_cfg.idle_release_ns) {
            /* Take the token from launchers first, then make sure nothing is in flight. */
            d->state = GEM_TOKEN_DRAINING;
            atomic_store(&d->deadline_ns, 0);
            CUcontext ctx = d->ctx;
            pthread_mutex_unlock(&d->mu);
            int64_t used = 0;
            drain(d, ctx, &used);
            pthread_mutex_lock(&d->mu);
            int64_t t = gem_now_ns();
            if ((atomic_load(&d->in_burst) || d->waiters > 0) && t < d->slot_deadline_ns) {
                /* a launch slipped in: the process is not idle after all */
                d->state = GEM_TOKEN_HELD;
                atomic_store(&d->deadline_ns, d->slot_deadline_ns);
                pthread_cond_broadcast(&d->cv);
                pthread_mutex_unlock(&d->mu);
                return next;
            }
            uint64_t seq = d->token_seq;
            int64_t overuse = d->pending_overuse_ns;
            d->pending_overuse_ns = 0;
            release_slot_unlock(d, seq, overuse, used);
            atomic_fetch_add(&gem_stats.early_releases, 1);
            GEM_LOG(GEM_LOG_DEBUG, "GPU %d: idle for %.1f ms, token %llu given back early", d->ordinal,
                    (double)(t - idle_since) / 1e6, (unsigned long long)seq);
            return next;
        }
        if (idle_since + gem_cfg.idle_release_ns < next)
            next = idle_since + gem_cfg.idle_release_ns;
    }
    pthread_mutex_unlock(&d->mu);
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
        pthread_mutex_unlock(&watch_mu);
        int64_t now = gem_now_ns();
        int64_t next = now + 100 * GEM_NS_PER_MS;
        int count = atomic_load(&gem_device_count);
        for (int i = 0; i < count; i++) {
            int64_t n = watch_device(&gem_devices[i], now);
            if (n < next)
                next = n;
        }
        pthread_mutex_lock(&watch_mu);
        if (watcher_stop)
            break;
        if (next > gem_now_ns()) {
            struct timespec ts = {.tv_sec = next / GEM_NS_PER_S, .tv_nsec = next % GEM_NS_PER_S};
            pthread_cond_timedwait(&watch_cv, &watch_mu, &ts);
        }
    }
    pthread_mutex_unlock(&watch_mu);
    return NULL;
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

void gem_gate_reset_after_fork(void) {
    pthread_mutex_init(&runtime_mu, NULL);
    pthread_mutex_init(&watch_mu, NULL);
    pthread_mutex_init(&capture_mu, NULL);
    watcher_started = 0;
    watcher_stop = 0;
    ncaptures = 0;
    atomic_store(&gem_active_captures, 0);
    atomic_store(&fail_open_active, 0);
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < count; i++) {
        struct gem_device *d = &gem_devices[i];
        if (!d->initialised)
            continue;
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_mutex_init(&d->mu, NULL);
        pthread_cond_init(&d->cv, &ca);
        pthread_condattr_destroy(&ca);
        d->state = GEM_TOKEN_NONE;
        d->waiters = 0;
        d->pending_overuse_ns = 0;
        d->mem_in_use = 0;
        atomic_store(&d->deadline_ns, gem_cfg.disabled ? INT64_MAX : 0);
        atomic_store(&d->in_burst, 0);
        gem_conn_reset_after_fork(&d->conn);
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
}

/* ---- the generated wrappers -------------------------------------------------------------------- */

static inline int gem_name_is_ptsz(const char *name) {
    size_t n = __builtin_strlen(name);
    return n > 5 && __builtin_memcmp(name + n - 5, "_ptsz", 5) == 0;
}

#define GEM_LAUNCH_WRAPPER(name, params, args, stream)                                          \
    GEM_EXPORT CUresult name params {                                                           \
        CUresult gate_rc = gem_gate_launch((stream), gem_name_is_ptsz(#name));                  \
        if (GEM_UNLIKELY(gate_rc != CUDA_SUCCESS))                                              \
            return gate_rc;                                                                     \
        gem_fn_##name##_t *real = REAL(name);                                                   \
        return GEM_LIKELY(real != NULL) ? real args : CUDA_ERROR_NOT_SUPPORTED;                 \
    }
#define GEM_SYNC_WRAPPER(name, params, args)                                                    \
    GEM_EXPORT CUresult name params {                                                           \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        CUresult rc = REAL(name) args;                                                          \
        gem_on_sync();                                                                          \
        return rc;                                                                              \
    }
#define GEM_CAPTURE_WRAPPER(name, params, args, stream, begins)                                 \
    GEM_EXPORT CUresult name params {                                                           \
        if (GEM_UNLIKELY(gem_ensure_real() != 0 || !HAVE_REAL(name)))                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                  \
        CUresult rc = REAL(name) args;                                                          \
        gem_capture_changed((stream), (begins), gem_name_is_ptsz(#name), rc);                   \
        return rc;                                                                              \
    }
#define GEM_NOTHING(...)

GEM_HOOK_TABLE(GEM_LAUNCH_WRAPPER, GEM_SYNC_WRAPPER, GEM_CAPTURE_WRAPPER, GEM_NOTHING, GEM_NOTHING, GEM_NOTHING)
