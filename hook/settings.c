/*
 * settings.c -- settings from the environment, and logging.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

void gem_settings_load(void) {
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
        if (end == v || *end != '\0' || port <= 0 || port > 65535)
            gem_log(GEM_LOG_ERROR, "POD_MANAGER_PORT=%s is not a port number; using %d", v, gem_cfg.pmgr_port);
        else
            gem_cfg.pmgr_port = (int)port;
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
