/*
 * rejoin.c -- re-announce held memory to a restarted pod manager at once.
 *
 * The pod manager counts the group's memory; when it dies, its count dies with it, and the restarted one
 * learns what a process holds from that process's HELLO (mem_in_use). A process reconnects at its next call,
 * but an idle one (a notebook, a server between requests) may make none for hours, and meanwhile the group
 * could allocate its memory a second time. So a process that holds memory keeps a small thread that looks at
 * its connections every 100 ms (a zero-timeout poll: no message, no read), and when one was closed by its pod
 * manager, reconnects: the HELLO re-announces what the process holds. The restarted pod manager holds the
 * group's new allocations until the processes its predecessor counted have re-announced (or a grace period
 * passed: gemini/podmgr/manager.py), so the count is whole again before anything new is granted.
 *
 * It tries for REJOIN_FOR_S after the loss (each try is a connect with the usual GEMINI_CONNECT_TIMEOUT_MS
 * retries, then a pause of a second); a pod manager that does not come back within that time is left to the
 * process's next call, as before. Never started by a process that holds no memory, and never blocks the program.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <time.h>

#include "device.h"
#include "rejoin.h"
#include "settings.h"
#include "thread.h"

#define REJOIN_FOR_S 30
#define LOOK_EVERY_MS 100

static pthread_mutex_t rejoin_mu = PTHREAD_MUTEX_INITIALIZER;
static int started, stopping;

struct watch {
    int64_t lost_ns;    /* when the connection was seen gone; 0 while it stands */
    int64_t next_try_ns;
};
static struct watch watches[GEM_MAX_DEVICES];

static void look_at(struct gem_device *d, struct watch *w, int64_t now) {
    if (__atomic_load_n(&d->mem_in_use, __ATOMIC_RELAXED) == 0) {
        w->lost_ns = 0;
        return;
    }
    if (gem_conn_alive(&d->conn)) {
        w->lost_ns = 0;
        return;
    }
    if (!w->lost_ns) {
        w->lost_ns = now;
        w->next_try_ns = now;
    }
    if (now - w->lost_ns > (int64_t)REJOIN_FOR_S * GEM_NS_PER_S || now < w->next_try_ns)
        return;
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_MEM_INFO, 0);
    int rc = gem_conn_call(&d->conn, &req, &reply, 5 * GEM_NS_PER_S);  /* connecting sends HELLO */
    if (rc == GEM_CALL_OK) {
        GEM_LOG(GEM_LOG_INFO, "GPU %d: reconnected to the pod manager at %s and re-announced the %llu bytes "
                "this process holds", d->ordinal, d->conn.where,
                (unsigned long long)__atomic_load_n(&d->mem_in_use, __ATOMIC_RELAXED));
        w->lost_ns = 0;
    } else {
        w->next_try_ns = gem_now_ns() + GEM_NS_PER_S;
    }
}

static void *rejoin_main(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&rejoin_mu);
        int stop = stopping;
        pthread_mutex_unlock(&rejoin_mu);
        if (stop)
            break;
        if (!gem_ungated()) {
            int64_t now = gem_now_ns();
            int count = atomic_load(&gem_device_count);
            for (int i = 0; i < count && i < GEM_MAX_DEVICES; i++)
                if (gem_devices[i].initialised)
                    look_at(&gem_devices[i], &watches[i], now);
        }
        struct timespec ts = {0, LOOK_EVERY_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

void gem_rejoin_start(void) {
    pthread_mutex_lock(&rejoin_mu);
    if (!started && !stopping) {
        started = 1;
        if (gem_thread_start(rejoin_main, "gemhook-rejoin") != 0)
            GEM_LOG(GEM_LOG_WARN, "cannot start the rejoin thread: after a pod manager restart, this process's "
                    "memory is re-announced only at its next CUDA call");
    }
    pthread_mutex_unlock(&rejoin_mu);
}

void gem_rejoin_shutdown(void) {
    /* Exiting: the connections close with the process; do not reconnect them. Not joined (it may be connecting). */
    pthread_mutex_lock(&rejoin_mu);
    stopping = 1;
    pthread_mutex_unlock(&rejoin_mu);
}

void gem_rejoin_after_fork(void) {
    pthread_mutex_init(&rejoin_mu, NULL);
    started = 0;
    stopping = 0;
    for (int i = 0; i < GEM_MAX_DEVICES; i++)
        watches[i] = (struct watch){0, 0};
}
