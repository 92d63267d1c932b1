/*
 * libgemhook.c -- the library's entry: settings, logging, statistics, fork
 * handling.
 *
 * The constructor only reads environment variables. It makes no CUDA call,
 * opens no connection and starts no thread, so a process that never touches
 * CUDA (a shell, Python starting up) is not affected by the preload. All
 * real work starts lazily, on the first intercepted CUDA call.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "gemhook.h"

struct gem_settings gem_cfg = {
    .log_level = GEM_LOG_WARN,
    .pmgr_ip = "127.0.0.1",
    .pmgr_port = 50052,
    /* 5 ms: 2.5x the 2 ms burst-merge gap, so a pause that long has ended the
     * burst by Gemini's own definition; holding the token longer only idles
     * the GPU, and giving it back costs one round trip (~0.1 ms) when nobody
     * else wants it. */
    .idle_release_ns = 5 * GEM_NS_PER_MS,
    .connect_timeout_ns = 10 * GEM_NS_PER_S,
    .token_timeout_ns = 300 * GEM_NS_PER_S,
    .burst_merge_ns = 2 * GEM_NS_PER_MS,
    .burst_window_ns = 3 * GEM_NS_PER_S,
};

struct gem_stats gem_stats;
/* Until the constructor measures the tick, the shortcut is off (never true before a real deadline). */
int64_t gem_coarse_margin_ns = INT64_MAX / 2;

/* ---- logging ------------------------------------------------------------------------------ */

static const char *const level_names[] = {"error", "warn", "info", "debug"};

void gem_log(int level, const char *fmt, ...) {
    char line[768];
    int n = snprintf(line, sizeof line, "[gemini %d] %s: ", (int)getpid(),
                     level_names[level < 0 ? 0 : level > 3 ? 3 : level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    /* one write(2): lines from several processes do not interleave */
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

/* ---- settings ------------------------------------------------------------------------------- */

static const char *env_first(const char *a, const char *b) {
    const char *v = getenv(a);
    if (v && *v)
        return v;
    v = b ? getenv(b) : NULL;
    return (v && *v) ? v : NULL;
}

static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 && strcasecmp(v, "no") != 0;
}

static void env_ms(const char *name, int64_t *out_ns) {
    const char *v = getenv(name);
    if (!v || !*v)
        return;
    char *end = NULL;
    double ms = strtod(v, &end);
    if (end == v || *end != '\0' || ms < 0 || ms > 1e12) {
        gem_log(GEM_LOG_WARN, "ignoring %s=%s: expected a number of milliseconds", name, v);
        return;
    }
    *out_ns = (int64_t)(ms * (double)GEM_NS_PER_MS);
}

static void load_settings(void) {
    const char *v = getenv("GEMINI_LOG_LEVEL");
    if (v && *v) {
        int found = 0;
        for (int i = 0; i < 4; i++)
            if (strcasecmp(v, level_names[i]) == 0) {
                gem_cfg.log_level = i;
                found = 1;
            }
        if (!found && strcasecmp(v, "warning") == 0) {
            gem_cfg.log_level = GEM_LOG_WARN;
            found = 1;
        }
        if (!found)
            gem_log(GEM_LOG_WARN, "ignoring GEMINI_LOG_LEVEL=%s (use error, warn, info or debug)", v);
    }
    gem_cfg.disabled = env_flag("GEMINI_DISABLE");
    gem_cfg.fail_open = env_flag("GEMINI_FAIL_OPEN");
    if ((v = env_first("GEMINI_POD_NAME", "POD_NAME"))) {
        if (strlen(v) >= sizeof gem_cfg.pod_name)
            gem_log(GEM_LOG_WARN, "POD_NAME is longer than %zu characters; it will not match any group",
                    sizeof gem_cfg.pod_name - 1);
        snprintf(gem_cfg.pod_name, sizeof gem_cfg.pod_name, "%s", v);
    }
    if ((v = env_first("GEMINI_POD_MANAGER_IP", "POD_MANAGER_IP")))
        snprintf(gem_cfg.pmgr_ip, sizeof gem_cfg.pmgr_ip, "%s", v);
    if ((v = env_first("GEMINI_POD_MANAGER_PORT", "POD_MANAGER_PORT"))) {
        char *end = NULL;
        long port = strtol(v, &end, 10);
        if (end == v || *end != '\0' || port <= 0 || port > 65535)
            gem_log(GEM_LOG_ERROR, "POD_MANAGER_PORT=%s is not a port number; using %d", v, gem_cfg.pmgr_port);
        else
            gem_cfg.pmgr_port = (int)port;
    }
    if ((v = getenv("GEMINI_POD_MANAGERS")))
        snprintf(gem_cfg.pmgr_map, sizeof gem_cfg.pmgr_map, "%s", v);
    env_ms("GEMINI_IDLE_RELEASE_MS", &gem_cfg.idle_release_ns);
    env_ms("GEMINI_CONNECT_TIMEOUT_MS", &gem_cfg.connect_timeout_ns);
    env_ms("GEMINI_TOKEN_TIMEOUT_MS", &gem_cfg.token_timeout_ns);
}

/* ---- statistics ------------------------------------------------------------------------------ */

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
             "mem_errors=%llu dlsym_routed=%llu procaddr_routed=%llu reconnects=%llu slots_measured=%llu "
             "used_ms=%.3f",
             (unsigned long long)gem_total_launches(), LOAD(grants), LOAD(token_requests), LOAD(waits),
             (double)LOAD(wait_ns) / 1e6, LOAD(expiries), LOAD(early_releases), (double)LOAD(overuse_ns) / 1e6,
             LOAD(drains), LOAD(burst_renewals), LOAD(capture_passthrough), LOAD(gate_errors), LOAD(mem_allocs),
             LOAD(mem_frees), LOAD(mem_denied), LOAD(mem_rollbacks), LOAD(mem_errors), LOAD(dlsym_routed),
             LOAD(procaddr_routed), LOAD(reconnects), LOAD(slots_measured), (double)LOAD(used_ns) / 1e6);
}

/* Exported so tests and tools can read the counters from inside a process. */
GEM_EXPORT int gemhook_stats(char *buf, size_t len) {
    if (!buf || !len)
        return -1;
    format_stats(buf, len);
    return 0;
}

static void report_stats(void) {
    const char *file = getenv("GEMINI_STATS_FILE");
    int touched = atomic_load(&gem_real_ready) || gem_total_launches() > 0;
    if (!touched)
        return; /* never a CUDA program: stay silent */
    char buf[1024];
    format_stats(buf, sizeof buf);
    if (file && *file) {
        int fd = open(file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (fd >= 0) {
            char line[1200];
            int n = snprintf(line, sizeof line, "pid=%d %s\n", (int)getpid(), buf);
            ssize_t w = write(fd, line, (size_t)n);
            (void)w;
            close(fd);
        }
    }
    GEM_LOG(GEM_LOG_INFO, "stats: %s", buf);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

static void after_fork_child(void) {
    /* The child holds no token, no connection and no memory of its own. */
    memset(&gem_stats, 0, sizeof gem_stats);
    for (struct gem_thread_counter *c = atomic_load(&counter_list); c; c = c->next)
        c->launches = 0;
    gem_gate_reset_after_fork();
    gem_memory_reset_after_fork();
}

static void measure_coarse_clock(void) {
    struct timespec res;
    /* Only trust a tick of at most 10 ms; otherwise every launch reads the precise clock. */
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0 && res.tv_nsec > 0 &&
        res.tv_nsec <= 10 * GEM_NS_PER_MS)
        gem_coarse_margin_ns = 2 * (int64_t)res.tv_nsec;
    else
        gem_coarse_margin_ns = INT64_MAX / 2; /* the shortcut never succeeds */
}

__attribute__((constructor)) static void gemhook_constructor(void) {
    load_settings();
    measure_coarse_clock();
    pthread_atfork(NULL, NULL, after_fork_child);
}

__attribute__((destructor)) static void gemhook_destructor(void) {
    gem_gate_shutdown();
    report_stats();
}
