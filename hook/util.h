/*
 * util.h -- the bottom layer: macros, clocks and pure functions.
 *
 * Nothing here has state or does I/O. The gemhook_* functions are exported
 * so that tests/test_hook_pure.py can call them through cffi and check them
 * against the Python side; tests/hook_ffi.py reads their declarations from
 * the cffi-begin/cffi-end region below (struct pointers become void *).
 */
#ifndef GEMINI_UTIL_H
#define GEMINI_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "gemini_proto.h"

#define GEM_EXPORT __attribute__((visibility("default")))
#define GEM_LIKELY(x) __builtin_expect(!!(x), 1)
#define GEM_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define GEM_NS_PER_MS 1000000LL
#define GEM_NS_PER_S 1000000000LL

static inline int64_t gem_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * GEM_NS_PER_S + ts.tv_nsec;
}

/* The coarse clock: a kernel variable updated every tick, read without rdtsc (gate.h says how the
 * launch path uses it). */
static inline int64_t gem_coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * GEM_NS_PER_S + ts.tv_nsec;
}

static inline void gem_ns_to_timespec(int64_t t, struct timespec *ts) {
    ts->tv_sec = t / GEM_NS_PER_S;
    ts->tv_nsec = t % GEM_NS_PER_S;
}

/* ---- burst estimation ---------------------------------------------------------------------- */

#define GEMHOOK_BURST_SLOTS 256
struct gemhook_burst_est {
    int64_t start[GEMHOOK_BURST_SLOTS];
    int64_t end[GEMHOOK_BURST_SLOTS];
    int head;                   /* index of the newest burst */
    int count;
    int64_t merge_gap_ns;
    int64_t window_ns;
};

/* cffi-begin */
GEM_EXPORT size_t gemhook_burst_size(void); /* tests allocate the estimator without its layout */
GEM_EXPORT void gemhook_burst_init(struct gemhook_burst_est *est, int64_t merge_gap_ns, int64_t window_ns);
GEM_EXPORT void gemhook_burst_record(struct gemhook_burst_est *est, int64_t start_ns, int64_t end_ns);
GEM_EXPORT int64_t gemhook_burst_predict(const struct gemhook_burst_est *est, int64_t now_ns);
GEM_EXPORT void gemhook_msg_init(struct gem_msg *msg, uint16_t type, uint32_t seq);
GEM_EXPORT int gemhook_msg_check(const struct gem_msg *msg, char *why, size_t why_len);
GEM_EXPORT int gemhook_parse_endpoint(const char *text, char *ip, size_t ip_len, int *port);
/* The file name of a group's socket in the socket transport's GPU directory: "group.<name>.sock", every byte of
 * the name other than A-Z a-z 0-9 _ - . written %XX (gemini/transport.py does the same). 0, or -1 if it does
 * not fit in len. */
GEM_EXPORT int gemhook_group_socket_name(const char *group, char *out, size_t len);
/* cffi-end */

#endif /* GEMINI_UTIL_H */
