/*
 * gpugate.c -- the GPU-side gate of a batch process's streams during a latency group's claim (gpugate.h):
 * the pinned word, its registration, and the mirror thread that keeps it equal to the board's claims.
 */
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "board.h"
#include "device.h"
#include "flare.h"
#include "gpugate.h"
#include "real.h"
#include "settings.h"
#include "stats.h"
#include "thread.h"
#include "util.h"

static struct gem_gpugate gates[GEM_MAX_DEVICES];
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int mirror_started;
static atomic_int said_off;
/* The mirror's, per GPU: the claim sequence whose claim held the word GEM_CLAIM_HOLD_MAX_NS (board.h), ignored
 * until the board's claims change. */
static uint32_t ignored_seq[GEM_MAX_DEVICES];
static int ignoring[GEM_MAX_DEVICES];

/* With no claim up, the mirror looks again at least this often (a board it cannot sleep on, or a woken
 * futex it missed, costs at most this much of a claim). */
#define MIRROR_IDLE_NS (20 * GEM_NS_PER_MS)
/* Several GPUs' boards: one futex at a time, the others looked at this often (a claim there takes effect up to
 * this much later). */
#define MIRROR_MULTI_NS GEM_NS_PER_MS

struct gem_gpugate *gem_gpugate_of(int ordinal) {
    if (ordinal < 0 || ordinal >= GEM_MAX_DEVICES)
        ordinal = 0;
    return &gates[ordinal];
}

static void gate_off(const char *why) {
    for (int i = 0; i < GEM_MAX_DEVICES; i++)
        atomic_store(&gates[i].state, GEM_GPUGATE_FAILED);
    atomic_fetch_add(&gem_stats.gpu_gate_failures, 1);
    if (!atomic_exchange(&said_off, 1))
        GEM_LOG(GEM_LOG_WARN, "the GPU-side gate is off (%s): next to a latency group this process keeps its "
                "queued work GEMINI_INFLIGHT_MS short instead", why);
}

/* The mirror's state is the epoch (only the mirror changes it): odd while the streams are to be held. The word
 * follows it, whatever page is registered now (a fresh page after a context's teardown starts at the epoch's
 * state). The times are written before the epoch, so a reader that sees the epoch unchanged around its reads
 * read a consistent pair (gem_gpugate_held_ns). */
static void set_word(struct gem_gpugate *gg, uint32_t up) {
    unsigned e = atomic_load(&gg->epoch);
    if ((e & 1u) != up) {
        int64_t now = gem_now_ns();
        if (!up)
            atomic_fetch_add(&gg->held_total_ns, now - atomic_load(&gg->changed_ns));
        atomic_store(&gg->changed_ns, now);
        atomic_store(&gg->epoch, e + 1);
        if (up)
            atomic_fetch_add(&gem_stats.gpu_gate_raises, 1);
    }
    volatile uint32_t *w = __atomic_load_n(&gg->word, __ATOMIC_ACQUIRE);
    if (w && *w != up) {
        *w = up;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
}

static long futex_wait(const uint32_t *word, uint32_t seen, int64_t ns) {
    struct timespec ts = {(time_t)(ns / GEM_NS_PER_S), (long)(ns % GEM_NS_PER_S)};
    return syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static void *mirror_main(void *arg) {
    (void)arg;
    for (;;) {
        int64_t now = gem_now_ns(), sleep_ns = MIRROR_IDLE_NS;
        const uint32_t *sleep_on = NULL;
        uint32_t seen = 0;
        int boards = 0;
        for (int i = 0; i < GEM_MAX_DEVICES; i++) {
            struct gem_gpugate *gg = &gates[i];
            if (!__atomic_load_n(&gg->word, __ATOMIC_ACQUIRE))
                continue;
            const struct gem_board *b = atomic_load(&gg->board);
            if (atomic_load(&gg->state) == GEM_GPUGATE_FAILED)
                b = NULL;
            /* A latency process's flare: its request launched, and its claim is not on the board yet. Looked at
             * first: the flare page's sequence, which this mirror may sleep on, is read before the board's claim
             * (its pod manager raises it after writing a claim there). */
            struct gem_flare_view flares;
            gem_flare_look(i, b, now, &flares);
            /* the sequence before the end: a claim after this read changes it, and the futex returns at once */
            uint32_t seq = b ? gem_board_claim_seq(b) : 0;
            int64_t until = b ? gem_board_claim_until(b) : 0;
            if (flares.until > until)
                until = flares.until;
            int up = until > now;
            if (ignoring[i] && seq != ignored_seq[i])
                ignoring[i] = 0;
            if (up && !ignoring[i] && (atomic_load(&gg->epoch) & 1u) &&
                now - atomic_load(&gg->changed_ns) > GEM_CLAIM_HOLD_MAX_NS) {
                ignoring[i] = 1;
                ignored_seq[i] = seq;
                GEM_LOG(GEM_LOG_WARN, "GPU %d: a claim has held this process's queued work 2 s; letting it run",
                        i);
            }
            if (ignoring[i])
                up = 0;
            set_word(gg, (uint32_t)up);
            if (up && until - now < sleep_ns)
                sleep_ns = until - now;
            if (b && boards++ == 0) {
                /* one latency group with its flare page: that page's sequence changes at its flares and at its
                 * claims (the board's changes only at claims: a flare raised while the mirror went to sleep on it
                 * would wait for the timeout) */
                sleep_on = flares.sleep_on ? flares.sleep_on : &b->claims.claim_seq;
                seen = flares.sleep_on ? flares.seen : seq;
            }
            if (flares.count > 0 && !flares.sleep_on && sleep_ns > MIRROR_MULTI_NS)
                sleep_ns = MIRROR_MULTI_NS;   /* several pages to follow: looked at this often */
        }
        if (boards > 1 && sleep_ns > MIRROR_MULTI_NS)
            sleep_ns = MIRROR_MULTI_NS;
        if (sleep_ns < 1000)
            sleep_ns = 1000;
        if (!sleep_on) {
            struct timespec ts = {0, (long)sleep_ns};
            nanosleep(&ts, NULL);
            continue;
        }
        if (futex_wait(sleep_on, seen, sleep_ns) != 0 && errno != EAGAIN && errno != ETIMEDOUT && errno != EINTR) {
            gate_off("cannot wait on the board page's claims");
            for (int i = 0; i < GEM_MAX_DEVICES; i++)
                set_word(&gates[i], 0);
            atomic_store(&mirror_started, 0);
            return NULL;
        }
    }
}

void gem_gpugate_follow(struct gem_gpugate *gg, const struct gem_board *board) {
    /* a page whose pod managers do not wake sleepers on claims (an older gem-schd's) would leave the mirror a
     * 20 ms poll, and the queue deep: no gate then */
    if (!gem_cfg.gpu_gate || (board && !(gem_board_features(board) & GEM_BOARD_FEATURE_CLAIM_SEQ)))
        board = NULL;
    atomic_store(&gg->board, board);
}

/* Register a fresh word in the current context and start the mirror (reg_mu held). */
static int prepare_locked(struct gem_gpugate *gg) {
    if (!HAVE_REAL(cuMemHostRegister_v2) || !HAVE_REAL(cuMemHostGetDevicePointer_v2) ||
        !HAVE_REAL(cuStreamWaitValue32_v2) || !HAVE_REAL(cuCtxGetCurrent)) {
        gate_off("the driver has no stream memory operations");
        return 0;
    }
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || !ctx)
        return 0;
    long page = sysconf(_SC_PAGESIZE);
    /* A page of its own, never unmapped: the mirror may still write a word whose registration a context's
     * teardown took away. Not copied into a fork child: a private page the parent then wrote would move to a
     * copy of its own, and the GPU go on reading the one it pinned (held for good if a claim was up). */
    void *p = mmap(NULL, (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || madvise(p, (size_t)page, MADV_DONTFORK) != 0) {
        if (p != MAP_FAILED)
            munmap(p, (size_t)page);
        gate_off("no memory for its word");
        return 0;
    }
    *(volatile uint32_t *)p = atomic_load(&gg->epoch) & 1u;
    CUdeviceptr dptr = 0;
    CUresult rc = REAL(cuMemHostRegister_v2)(p, (size_t)page, CU_MEMHOSTREGISTER_PORTABLE |
                                                                 CU_MEMHOSTREGISTER_DEVICEMAP);
    if (rc == CUDA_SUCCESS)
        rc = REAL(cuMemHostGetDevicePointer_v2)(&dptr, p, 0);
    if (rc != CUDA_SUCCESS) {
        munmap(p, (size_t)page);
        gate_off("the driver cannot map a host word into the device");
        return 0;
    }
    gg->word_dev = dptr;
    gg->ctx = ctx;
    __atomic_store_n(&gg->word, (volatile uint32_t *)p, __ATOMIC_RELEASE);
    if (!atomic_exchange(&mirror_started, 1) && gem_thread_start(mirror_main, "gem-claimgate") != 0) {
        atomic_store(&mirror_started, 0);
        gate_off("no thread to follow the claims");
        return 0;
    }
    /* not over a FAILED that the mirror set meanwhile (it has stopped then) */
    int unset = GEM_GPUGATE_UNSET;
    return atomic_compare_exchange_strong(&gg->state, &unset, GEM_GPUGATE_READY);
}

int gem_gpugate_wait(struct gem_gpugate *gg, CUstream s) {
    int state = atomic_load_explicit(&gg->state, memory_order_acquire);
    if (state == GEM_GPUGATE_FAILED || !atomic_load_explicit(&gg->board, memory_order_relaxed))
        return 0;
    if (state != GEM_GPUGATE_READY) {
        pthread_mutex_lock(&reg_mu);
        int ok = atomic_load(&gg->state) == GEM_GPUGATE_READY ||
                 (atomic_load(&gg->state) == GEM_GPUGATE_UNSET && prepare_locked(gg));
        pthread_mutex_unlock(&reg_mu);
        if (!ok)
            return 0;
    }
    CUresult rc = REAL(cuStreamWaitValue32_v2)(s, gg->word_dev, 0, CU_STREAM_WAIT_VALUE_EQ);
    if (rc != CUDA_SUCCESS) {
        /* the driver cannot, or not on this word: off for good; anything else (this stream, this moment) only
         * costs this marker its wait */
        if (rc == CUDA_ERROR_NOT_SUPPORTED || rc == CUDA_ERROR_INVALID_VALUE)
            gate_off("the driver refused a stream wait on its word");
        return 0;
    }
    atomic_fetch_add(&gem_stats.gpu_gate_waits, 1);
    return 1;
}

void gem_gpugate_context_gone(CUcontext ctx) {
    pthread_mutex_lock(&reg_mu);
    for (int i = 0; i < GEM_MAX_DEVICES; i++) {
        int ready = GEM_GPUGATE_READY;
        if (gates[i].ctx == ctx)
            atomic_compare_exchange_strong(&gates[i].state, &ready, GEM_GPUGATE_UNSET);
    }
    pthread_mutex_unlock(&reg_mu);
}

void gem_gpugate_after_fork(void) {
    pthread_mutex_init(&reg_mu, NULL);
    for (int i = 0; i < GEM_MAX_DEVICES; i++) {
        struct gem_gpugate *gg = &gates[i];
        if (atomic_load(&gg->state) != GEM_GPUGATE_FAILED)
            atomic_store(&gg->state, GEM_GPUGATE_UNSET);
        __atomic_store_n(&gg->word, NULL, __ATOMIC_RELEASE);
        gg->word_dev = 0;
        gg->ctx = NULL;
        atomic_store(&gg->board, NULL);
        atomic_store(&gg->epoch, 0);
        atomic_store(&gg->held_total_ns, 0);
    }
    atomic_store(&mirror_started, 0);
    memset(ignoring, 0, sizeof ignoring);
}
