/*
 * capture.c -- tracking the process's open stream captures, and keeping the
 * hook's own synchronising calls apart from them.
 *
 * A drain (cuCtxSynchronize, an event on the legacy stream) would invalidate
 * any capture open in the context. Checking for open captures and then
 * draining is not enough: a capture could begin in another thread in
 * between. So the two exclude each other under one lock: a drain starts only
 * when no capture is open or beginning, and a capture begin waits until the
 * drains in progress are over (at most one drain's length).
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "capture.h"
#include "real.h"
#include "settings.h"

atomic_int gem_active_captures;

#define GEM_MAX_CAPTURES 256
struct capture_key {
    CUstream stream;
    pthread_t thread; /* for per-thread default streams, whose handle is the same in every thread */
};
static pthread_mutex_t capture_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t capture_cv = PTHREAD_COND_INITIALIZER;  /* a drain ended */
static int draining;            /* the hook's own synchronising calls in progress */
static int beginning;           /* capture begins in progress (counted as open for a drain) */
static struct capture_key captures[GEM_MAX_CAPTURES];
static int ncaptures;
/* Captures begun while the table was full: not known by stream, but still open as far as the hook can
 * tell, so they keep gem_active_captures up (no drain may synchronise) until as many unknown ends. */
static int untracked;

static struct capture_key capture_key_of(CUstream s, int ptsz) {
    struct capture_key k = {s, 0};
    if ((s == NULL && ptsz) || s == CU_STREAM_PER_THREAD) {
        k.stream = CU_STREAM_PER_THREAD;
        k.thread = pthread_self();
    }
    return k;
}

void gem_capture_before_begin(void) {
    pthread_mutex_lock(&capture_mu);
    while (draining > 0)
        pthread_cond_wait(&capture_cv, &capture_mu);
    beginning++;
    pthread_mutex_unlock(&capture_mu);
}

void gem_capture_changed(CUstream stream, int begins, int ptsz, CUresult rc) {
    struct capture_key k = capture_key_of(stream, ptsz);
    pthread_mutex_lock(&capture_mu);
    if (begins)
        beginning--;
    int found = -1;
    for (int i = 0; i < ncaptures; i++)
        if (captures[i].stream == k.stream && pthread_equal(captures[i].thread, k.thread))
            found = i;
    if (begins && rc == CUDA_SUCCESS && found < 0) {
        if (ncaptures < GEM_MAX_CAPTURES) {
            captures[ncaptures++] = k;
        } else {
            if (untracked++ == 0)
                GEM_LOG(GEM_LOG_WARN, "more than %d stream captures open at once: the hook cannot tell which "
                        "of the extra ones end, and stops draining (and measuring slots) until as many "
                        "unknown captures have ended", GEM_MAX_CAPTURES);
        }
        atomic_fetch_add(&gem_active_captures, 1);
    } else if (!begins && found >= 0) {
        /* the capture is over whatever the result (an invalidated capture ends too) */
        captures[found] = captures[--ncaptures];
        atomic_fetch_sub(&gem_active_captures, 1);
    } else if (!begins && untracked > 0 &&
               (rc == CUDA_SUCCESS || rc == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)) {
        /* the end of a capture the hook saw begin but could not store (an end of a stream that was not
         * capturing fails otherwise) */
        untracked--;
        atomic_fetch_sub(&gem_active_captures, 1);
    }
    pthread_mutex_unlock(&capture_mu);
}

int gem_capture_drain_enter(void) {
    pthread_mutex_lock(&capture_mu);
    int may = ncaptures == 0 && untracked == 0 && beginning == 0;
    if (may)
        draining++;
    pthread_mutex_unlock(&capture_mu);
    return may;
}

void gem_capture_drain_exit(void) {
    pthread_mutex_lock(&capture_mu);
    if (--draining == 0)
        pthread_cond_broadcast(&capture_cv);
    pthread_mutex_unlock(&capture_mu);
}

int gem_stream_is_capturing(CUstream s, int ptsz) {
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

void gem_capture_after_fork(void) {
    pthread_mutex_init(&capture_mu, NULL);
    pthread_cond_init(&capture_cv, NULL);
    ncaptures = untracked = draining = beginning = 0;
    atomic_store(&gem_active_captures, 0);
}
