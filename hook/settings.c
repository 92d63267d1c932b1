/*
 * settings.c -- settings from the environment, and logging.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "settings.h"

struct gem_settings gem_cfg = {
    .log_level = GEM_LOG_WARN,
    .pmgr_ip = "127.0.0.1",
    .pmgr_port = 50052,
    /* 5 ms: 2.5x the 2 ms burst-merge gap, so a pause that long has ended the
     * burst by Gemini's own definition; holding the token longer only idles
     * the GPU, and giving it back costs one round trip (~0.1 ms) when nobody
     * else wants it. */
    .idle_release_ns = 5 * GEM_NS_PER_MS,
    /* A latency group's claim pauses every batch holder: it ends half a millisecond after the burst (a
     * request's kernels, then its copy back), not after the 5 ms a batch holder keeps an idle token. */
    .claim_idle_ns = GEM_NS_PER_MS / 2,
    .inflight_ns = GEM_NS_PER_MS,
    .connect_timeout_ns = 10 * GEM_NS_PER_S,
    .token_timeout_ns = 300 * GEM_NS_PER_S,
    .burst_merge_ns = 2 * GEM_NS_PER_MS,
    .burst_window_ns = 3 * GEM_NS_PER_S,
};

/* ---- logging ------------------------------------------------------------------------------ */

static const char *const level_names[] = {"error", "warn", "info", "debug"};

/* Seconds east of UTC, taken once in the constructor: localtime_r takes glibc's time-zone lock, which a fork
 * child could inherit held, so the log lines compute the local time themselves. (A daylight-saving change while
 * the process runs is not followed.) */
static long utc_offset_s;

static void take_utc_offset(void) {
    time_t now = time(NULL);
    struct tm tm;
    if (localtime_r(&now, &tm))
        utc_offset_s = tm.tm_gmtoff;
}

/* "YYYY-MM-DD HH:MM:SS.mmm" of the local time (days to a civil date: H. Hinnant's algorithm). */
static int format_now(char *out, size_t len) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t s = (int64_t)ts.tv_sec + utc_offset_s;
    int64_t days = s >= 0 ? s / 86400 : (s - 86399) / 86400;
    int64_t secs = s - days * 86400;
    int64_t z = days + 719468, era = (z >= 0 ? z : z - 146096) / 146097;
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    int64_t day = doy - (153 * mp + 2) / 5 + 1, month = mp < 10 ? mp + 3 : mp - 9;
    int64_t year = yoe + era * 400 + (month <= 2);
    return snprintf(out, len, "%04lld-%02lld-%02lld %02lld:%02lld:%02lld.%03ld", (long long)year, (long long)month,
                    (long long)day, (long long)(secs / 3600), (long long)(secs / 60 % 60), (long long)(secs % 60),
                    ts.tv_nsec / 1000000);
}

void gem_log(int level, const char *fmt, ...) {
    char line[800];
    int n = format_now(line, sizeof line);
    n += snprintf(line + n, sizeof line - (size_t)n, " gemini[%d] %s: ", (int)getpid(),
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

void gem_settings_load(void) {
    take_utc_offset();
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
    /* The group: Gemini v2's GEMINI_GROUP_NAME, then ours, then Gemini v1's. */
    if ((v = env_first("GEMINI_GROUP_NAME", NULL)) || (v = env_first("GEMINI_POD_NAME", "POD_NAME"))) {
        if (strlen(v) >= sizeof gem_cfg.pod_name)
            gem_log(GEM_LOG_WARN, "the group name is longer than %zu characters; it will not match any group",
                    sizeof gem_cfg.pod_name - 1);
        snprintf(gem_cfg.pod_name, sizeof gem_cfg.pod_name, "%s", v);
    }
    if ((v = env_first("GEMINI_POD_MANAGER_IP", "POD_MANAGER_IP")))
        snprintf(gem_cfg.pmgr_ip, sizeof gem_cfg.pmgr_ip, "%s", v);
    if ((v = env_first("GEMINI_POD_MANAGER_PORT", "POD_MANAGER_PORT"))) {
        char *end = NULL;
        long port = strtol(v, &end, 10);
        if (end == v || *end != '\0' || port <= 0 || port > 65535) {
            /* Not replaced by the default port: that is some other group's pod manager, or none. */
            const char *name = getenv("GEMINI_POD_MANAGER_PORT") && *getenv("GEMINI_POD_MANAGER_PORT")
                                   ? "GEMINI_POD_MANAGER_PORT" : "POD_MANAGER_PORT";
            snprintf(gem_cfg.settings_error, sizeof gem_cfg.settings_error,
                     "%s='%.40s' is not a port number (1 to 65535)", name, v);
            gem_cfg.pmgr_port = 0;
        } else {
            gem_cfg.pmgr_port = (int)port;
        }
    }
    if ((v = getenv("GEMINI_POD_MANAGERS")))
        snprintf(gem_cfg.pmgr_map, sizeof gem_cfg.pmgr_map, "%s", v);
    if ((v = env_first("GEMINI_IPC_DIR", NULL))) {
        if (strlen(v) >= sizeof gem_cfg.ipc_dir)
            gem_log(GEM_LOG_ERROR, "GEMINI_IPC_DIR is longer than %zu characters: no socket can be found there",
                    sizeof gem_cfg.ipc_dir - 1);
        else
            snprintf(gem_cfg.ipc_dir, sizeof gem_cfg.ipc_dir, "%s", v);
    }
    if ((v = getenv("GEMINI_PROCADDR_LOG")))
        snprintf(gem_cfg.procaddr_log, sizeof gem_cfg.procaddr_log, "%s", v);
    env_ms("GEMINI_IDLE_RELEASE_MS", &gem_cfg.idle_release_ns);
    env_ms("GEMINI_CLAIM_IDLE_MS", &gem_cfg.claim_idle_ns);
    int64_t inflight_ms = -1;
    env_ms("GEMINI_INFLIGHT_MS", &inflight_ms);
    if (inflight_ms > 0)
        gem_cfg.inflight_ns = inflight_ms;
    env_ms("GEMINI_CONNECT_TIMEOUT_MS", &gem_cfg.connect_timeout_ns);
    env_ms("GEMINI_TOKEN_TIMEOUT_MS", &gem_cfg.token_timeout_ns);
}
