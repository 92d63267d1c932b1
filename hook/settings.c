/*
 * settings.c -- settings from the environment or from the read-only settings file, and logging.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
    .gpu_gate = 1,
    .flare = 1,
    .kernel_costs = 1,
    .gap_events = 1,
    .marker_sampling = 1,
    .early_claim_ns = 2 * GEM_NS_PER_MS,
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

/* The settings file (gem-node mounts one read-only into every container it serves). Its path is a constant of
 * the build, never a setting: a process must not be able to point the hook at a file of its own. When it is
 * present, the settings below come from it alone and the environment's GEMINI_* variables are ignored, so a
 * container cannot switch the hook off (GEMINI_DISABLE) or point it at a pod manager of its own
 * (GEMINI_IPC_DIR) by changing its environment. Only the diagnostics (GEMINI_LOG_LEVEL, GEMINI_PROCADDR_LOG,
 * GEMINI_STATS_FILE) still come from the environment.
 *
 * The test build (make testhook, -DGEM_TEST_SETTINGS_FILE_ENV) also takes the path from
 * GEMINI_TEST_SETTINGS_FILE, so tests need no file under /etc; the hook gem-node installs is not that build. */
#define GEM_SETTINGS_FILE "/etc/gemini/hook.conf"
#define GEM_SETTINGS_FILE_MAX 4096

/* The keys the file may set: the same names as the variables, one KEY=VALUE a line. */
static const char *const file_keys[] = {
    "GEMINI_DISABLE", "GEMINI_FAIL_OPEN", "GEMINI_GROUP_NAME", "GEMINI_POD_MANAGER_IP", "GEMINI_POD_MANAGER_PORT",
    "GEMINI_POD_MANAGERS", "GEMINI_IPC_DIR", "GEMINI_BOARD_DIR", "GEMINI_IDLE_RELEASE_MS", "GEMINI_CLAIM_IDLE_MS",
    "GEMINI_INFLIGHT_MS", "GEMINI_EARLY_CLAIM_MS", "GEMINI_CONNECT_TIMEOUT_MS", "GEMINI_TOKEN_TIMEOUT_MS",
    "GEMINI_GPU_GATE", "GEMINI_FLARE", "GEMINI_KERNEL_COSTS", "GEMINI_GAP_EVENTS", "GEMINI_MARKER_SAMPLING",
};
#define N_FILE_KEYS (sizeof file_keys / sizeof file_keys[0])

static char file_text[GEM_SETTINGS_FILE_MAX + 1];
static const char *file_values[N_FILE_KEYS];

static const char *gem_settings_file_path(void) {
#ifdef GEM_TEST_SETTINGS_FILE_ENV
    const char *t = getenv("GEMINI_TEST_SETTINGS_FILE");
    if (t && *t)
        return t;
#endif
    return GEM_SETTINGS_FILE;
}

/* One setting: from the file when there is one (NULL if the file does not set it), else the environment. */
static const char *setting(const char *name) {
    if (gem_cfg.settings_file[0]) {
        for (size_t i = 0; i < N_FILE_KEYS; i++)
            if (strcmp(file_keys[i], name) == 0)
                return file_values[i];
        return NULL;        /* an alias (POD_NAME, ...): the file names settings by their GEMINI_ names only */
    }
    return getenv(name);
}

/* Parse the file in place: KEY=VALUE lines, '#' comments, blank lines; spaces around key and value are
 * dropped. Returns 0, or -1 with `why` filled (the file is then unusable as a whole). */
static int parse_settings_file(char *text, const char *path, char *why, size_t why_len) {
    int line_no = 0;
    for (char *line = text, *next; line && *line; line = next) {
        line_no++;
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        size_t len = strlen(line);
        while (len && (line[len - 1] == ' ' || line[len - 1] == '\t' || line[len - 1] == '\r'))
            line[--len] = '\0';
        while (*line == ' ' || *line == '\t')
            line++;
        if (!*line || *line == '#')
            continue;
        char *eq = strchr(line, '=');
        if (!eq) {
            snprintf(why, why_len, "settings file %s line %d: expected KEY=VALUE", path, line_no);
            return -1;
        }
        char *key_end = eq;
        while (key_end > line && (key_end[-1] == ' ' || key_end[-1] == '\t'))
            key_end--;
        *key_end = '\0';
        char *value = eq + 1;
        while (*value == ' ' || *value == '\t')
            value++;
        size_t i = 0;
        while (i < N_FILE_KEYS && strcmp(file_keys[i], line) != 0)
            i++;
        if (i == N_FILE_KEYS) {
            /* an unknown key is a setting this hook would silently not apply: refuse the file */
            snprintf(why, why_len, "settings file %s line %d: unknown setting '%.40s'", path, line_no, line);
            return -1;
        }
        file_values[i] = value;
    }
    return 0;
}

/* Read the settings file if it exists. A file that exists but cannot be read or parsed still puts the hook in
 * file mode, with settings_error set: CUDA calls that need the pod manager then fail (the environment is not
 * a fallback, or a container could make the file unreadable to itself and go back to its environment). */
static void load_settings_file(void) {
    const char *path = gem_settings_file_path();
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0 && (errno == ENOENT || errno == ENOTDIR))
        return;
    snprintf(gem_cfg.settings_file, sizeof gem_cfg.settings_file, "%s", path);
    char why[sizeof gem_cfg.settings_error] = "";
    if (fd < 0) {
        snprintf(why, sizeof why, "cannot read the settings file %s: %s", path, strerror(errno));
    } else {
        size_t got = 0;
        ssize_t n;
        while (got < sizeof file_text && (n = read(fd, file_text + got, sizeof file_text - got)) != 0) {
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                snprintf(why, sizeof why, "cannot read the settings file %s: %s", path, strerror(errno));
                break;
            }
            got += (size_t)n;
        }
        close(fd);
        if (!why[0] && got > GEM_SETTINGS_FILE_MAX)
            snprintf(why, sizeof why, "the settings file %s is longer than %d bytes", path, GEM_SETTINGS_FILE_MAX);
        if (!why[0]) {
            file_text[got] = '\0';
            if (memchr(file_text, '\0', got))
                snprintf(why, sizeof why, "the settings file %s is not text", path);
            else
                parse_settings_file(file_text, path, why, sizeof why);
        }
    }
    if (why[0]) {
        memset(file_values, 0, sizeof file_values);
        snprintf(gem_cfg.settings_error, sizeof gem_cfg.settings_error, "%s", why);
        gem_log(GEM_LOG_ERROR, "%s: CUDA calls that need the pod manager fail", why);
    }
}

static const char *setting_first(const char *a, const char *b) {
    const char *v = setting(a);
    if (v && *v)
        return v;
    v = b ? setting(b) : NULL;
    return (v && *v) ? v : NULL;
}

static int setting_flag(const char *name) {
    const char *v = setting(name);
    return v && *v && strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 && strcasecmp(v, "no") != 0;
}

static void setting_ms(const char *name, int64_t *out_ns) {
    const char *v = setting(name);
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

static void setting_path(const char *name, char *out, size_t len) {
    const char *v = setting_first(name, NULL);
    if (!v)
        return;
    if (strlen(v) >= len)
        gem_log(GEM_LOG_ERROR, "%s is longer than %zu characters: no socket can be found there", name, len - 1);
    else
        snprintf(out, len, "%s", v);
}

void gem_settings_load(void) {
    take_utc_offset();
    /* diagnostics: always the environment's */
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
    if ((v = getenv("GEMINI_PROCADDR_LOG")))
        snprintf(gem_cfg.procaddr_log, sizeof gem_cfg.procaddr_log, "%s", v);

    load_settings_file();
    if (gem_cfg.settings_error[0]) {
        gem_cfg.pmgr_port = 0;      /* no endpoint at all: every call that needs one fails with settings_error */
        return;
    }
    gem_cfg.disabled = setting_flag("GEMINI_DISABLE");
    gem_cfg.fail_open = setting_flag("GEMINI_FAIL_OPEN");
    /* The group: Gemini v2's GEMINI_GROUP_NAME, then ours, then Gemini v1's. */
    if ((v = setting_first("GEMINI_GROUP_NAME", NULL)) || (v = setting_first("GEMINI_POD_NAME", "POD_NAME"))) {
        if (strlen(v) >= sizeof gem_cfg.pod_name)
            gem_log(GEM_LOG_WARN, "the group name is longer than %zu characters; it will not match any group",
                    sizeof gem_cfg.pod_name - 1);
        snprintf(gem_cfg.pod_name, sizeof gem_cfg.pod_name, "%s", v);
    }
    if ((v = setting_first("GEMINI_POD_MANAGER_IP", "POD_MANAGER_IP")))
        snprintf(gem_cfg.pmgr_ip, sizeof gem_cfg.pmgr_ip, "%s", v);
    if ((v = setting_first("GEMINI_POD_MANAGER_PORT", "POD_MANAGER_PORT"))) {
        char *end = NULL;
        long port = strtol(v, &end, 10);
        if (end == v || *end != '\0' || port <= 0 || port > 65535) {
            /* Not replaced by the default port: that is some other group's pod manager, or none. */
            const char *name = setting_first("GEMINI_POD_MANAGER_PORT", NULL) ? "GEMINI_POD_MANAGER_PORT"
                                                                              : "POD_MANAGER_PORT";
            snprintf(gem_cfg.settings_error, sizeof gem_cfg.settings_error,
                     "%s='%.40s' is not a port number (1 to 65535)", name, v);
            gem_cfg.pmgr_port = 0;
        } else {
            gem_cfg.pmgr_port = (int)port;
        }
    }
    if ((v = setting("GEMINI_POD_MANAGERS")))
        snprintf(gem_cfg.pmgr_map, sizeof gem_cfg.pmgr_map, "%s", v);
    setting_path("GEMINI_IPC_DIR", gem_cfg.ipc_dir, sizeof gem_cfg.ipc_dir);
    setting_path("GEMINI_BOARD_DIR", gem_cfg.board_dir, sizeof gem_cfg.board_dir);
    setting_ms("GEMINI_IDLE_RELEASE_MS", &gem_cfg.idle_release_ns);
    setting_ms("GEMINI_CLAIM_IDLE_MS", &gem_cfg.claim_idle_ns);
    int64_t inflight_ms = -1;
    setting_ms("GEMINI_INFLIGHT_MS", &inflight_ms);
    if (inflight_ms > 0)
        gem_cfg.inflight_ns = inflight_ms;
    setting_ms("GEMINI_EARLY_CLAIM_MS", &gem_cfg.early_claim_ns);
    if ((v = setting("GEMINI_GPU_GATE")) && *v)
        gem_cfg.gpu_gate = setting_flag("GEMINI_GPU_GATE");
    if ((v = setting("GEMINI_FLARE")) && *v)
        gem_cfg.flare = setting_flag("GEMINI_FLARE");
    if ((v = setting("GEMINI_KERNEL_COSTS")) && *v)
        gem_cfg.kernel_costs = setting_flag("GEMINI_KERNEL_COSTS");
    if ((v = setting("GEMINI_GAP_EVENTS")) && *v)
        gem_cfg.gap_events = setting_flag("GEMINI_GAP_EVENTS");
    if ((v = setting("GEMINI_MARKER_SAMPLING")) && *v)
        gem_cfg.marker_sampling = setting_flag("GEMINI_MARKER_SAMPLING");
    setting_ms("GEMINI_CONNECT_TIMEOUT_MS", &gem_cfg.connect_timeout_ns);
    setting_ms("GEMINI_TOKEN_TIMEOUT_MS", &gem_cfg.token_timeout_ns);
    if (gem_cfg.settings_file[0])
        GEM_LOG(GEM_LOG_DEBUG, "settings from %s (the environment's GEMINI_* settings are ignored)",
                gem_cfg.settings_file);
}
