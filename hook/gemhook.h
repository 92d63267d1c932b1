/*
 * gemhook.h -- declarations shared by the files of libgemhook.
 *
 *   libgemhook.c  entry: settings from the environment, logging, statistics,
 *                 lazy initialisation, fork handling (no CUDA calls in the
 *                 constructor)
 *   symbols.c     symbol resolution: real pointers, dlsym, cuGetProcAddress
 *   gate.c        launch gating: the token, bursts, stream capture, the
 *                 watcher thread that drains and releases
 *   memory.c      memory accounting and limits
 *   client.c      the connection to the pod manager
 *   util.c        pure functions (size parsing, burst estimation, frames),
 *                 exported with a gemhook_ prefix so tests can call them
 */
#ifndef GEMINI_GEMHOOK_H
#define GEMINI_GEMHOOK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cuda_types.h"
#include "gemini_proto.h"
#include "hook_table.h"

#define GEM_EXPORT __attribute__((visibility("default")))
#define GEM_LIKELY(x) __builtin_expect(!!(x), 1)
#define GEM_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define GEM_NS_PER_MS 1000000LL
#define GEM_NS_PER_S 1000000000LL
#define GEM_MAX_DEVICES 32

/* ---- the function table ---------------------------------------------------------------- */

#define GEM_X_INDEX(name, ...) GEM_IDX_##name,
enum gem_fn_index { GEM_HOOK_TABLE(GEM_X_INDEX, GEM_X_INDEX, GEM_X_INDEX, GEM_X_INDEX, GEM_X_INDEX, GEM_X_INDEX) GEM_FN_COUNT };
#undef GEM_X_INDEX

#define GEM_X_TYPEDEF(name, params, ...) typedef CUresult gem_fn_##name##_t params;
GEM_HOOK_TABLE(GEM_X_TYPEDEF, GEM_X_TYPEDEF, GEM_X_TYPEDEF, GEM_X_TYPEDEF, GEM_X_TYPEDEF, GEM_X_TYPEDEF)
#undef GEM_X_TYPEDEF

/* Real driver entry points, resolved once from libcuda.so.1 (NULL where the driver lacks one). */
extern void *gem_real_fn[GEM_FN_COUNT];
extern const char *const gem_fn_name[GEM_FN_COUNT];
/* The wrapper handed out for each intercepted function; NULL for GEM_REAL rows. */
extern void *const gem_hook_fn[GEM_FN_COUNT];

#define REAL(name) ((gem_fn_##name##_t *)gem_real_fn[GEM_IDX_##name])
#define HAVE_REAL(name) (gem_real_fn[GEM_IDX_##name] != NULL)

/* Resolve the real pointers (once). Returns 0, or -1 if libcuda.so.1 cannot be opened. */
int gem_resolve_real(void);
int gem_resolve_nvml(void);               /* NVML rows, once libnvidia-ml.so.1 is loaded */
extern atomic_int gem_real_ready;
static inline int gem_ensure_real(void) {
    return GEM_LIKELY(atomic_load_explicit(&gem_real_ready, memory_order_acquire)) ? 0 : gem_resolve_real();
}

/* ---- settings (from the environment, read in the constructor) --------------------------- */

enum gem_log_level { GEM_LOG_ERROR = 0, GEM_LOG_WARN = 1, GEM_LOG_INFO = 2, GEM_LOG_DEBUG = 3 };

struct gem_settings {
    int log_level;
    int disabled;               /* GEMINI_DISABLE=1: pass everything through, connect to nothing */
    int fail_open;              /* GEMINI_FAIL_OPEN=1: run ungated when the pod manager is unreachable */
    char pod_name[GEM_NAME_LEN];
    char pmgr_ip[64];
    int pmgr_port;
    char pmgr_map[1024];        /* GEMINI_POD_MANAGERS: "GPU-uuid=ip:port,..." for several GPUs */
    int64_t idle_release_ns;    /* GEMINI_IDLE_RELEASE_MS; 0 disables early release */
    int64_t connect_timeout_ns; /* GEMINI_CONNECT_TIMEOUT_MS */
    int64_t token_timeout_ns;   /* GEMINI_TOKEN_TIMEOUT_MS; 0 waits forever */
    int64_t burst_merge_ns;     /* bursts closer than this are one burst (Gemini: 2 ms) */
    int64_t burst_window_ns;    /* prediction looks back this far (Gemini: 3 s) */
};
extern struct gem_settings gem_cfg;

void gem_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define GEM_LOG(level, ...)                                     \
    do {                                                        \
        if (GEM_UNLIKELY((level) <= gem_cfg.log_level))         \
            gem_log((level), __VA_ARGS__);                      \
    } while (0)

static inline int64_t gem_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * GEM_NS_PER_S + ts.tv_nsec;
}

/* ---- statistics (printed at exit at log level info; GEMINI_STATS_FILE appends them) ------ */

struct gem_stats {
    atomic_ullong grants, token_requests, waits, wait_ns, expiries, early_releases, overuse_ns,
        drains, drain_skipped_capture, gate_errors, capture_passthrough, burst_renewals,
        mem_allocs, mem_frees, mem_denied, mem_rollbacks, mem_errors, dlsym_routed, procaddr_routed,
        reconnects, slots_measured, used_ns;
};
extern struct gem_stats gem_stats;
/* Launches are counted per thread so the launch path never touches a shared cache line. */
struct gem_thread_counter {
    uint64_t launches;
    struct gem_thread_counter *next;
};
/* initial-exec: a plain %fs-relative load on the launch path instead of a __tls_get_addr call */
extern __thread struct gem_thread_counter *gem_tls_counter __attribute__((tls_model("initial-exec")));
struct gem_thread_counter *gem_register_thread_counter(void);
static inline void gem_count_launch(void) {
    struct gem_thread_counter *c = gem_tls_counter;
    if (GEM_UNLIKELY(c == NULL))
        c = gem_register_thread_counter();
    c->launches++;
}
uint64_t gem_total_launches(void);

/* ---- pure helpers (util.c); exported for tests ------------------------------------------- */

#define GEMHOOK_BURST_SLOTS 256
struct gemhook_burst_est {
    int64_t start[GEMHOOK_BURST_SLOTS];
    int64_t end[GEMHOOK_BURST_SLOTS];
    int head;                   /* index of the newest burst */
    int count;
    int64_t merge_gap_ns;
    int64_t window_ns;
};
GEM_EXPORT size_t gemhook_burst_size(void); /* tests allocate the estimator without its layout */
GEM_EXPORT void gemhook_burst_init(struct gemhook_burst_est *est, int64_t merge_gap_ns, int64_t window_ns);
GEM_EXPORT void gemhook_burst_record(struct gemhook_burst_est *est, int64_t start_ns, int64_t end_ns);
GEM_EXPORT int64_t gemhook_burst_predict(const struct gemhook_burst_est *est, int64_t now_ns);
GEM_EXPORT int gemhook_parse_size(const char *text, uint64_t *out);
GEM_EXPORT void gemhook_msg_init(struct gem_msg *msg, uint16_t type, uint32_t seq);
GEM_EXPORT int gemhook_msg_check(const struct gem_msg *msg, char *why, size_t why_len);
GEM_EXPORT int gemhook_parse_endpoint(const char *text, char *ip, size_t ip_len, int *port);

/* ---- connection to the pod manager (client.c) -------------------------------------------- */

struct gem_waiter;
struct gem_conn {
    pthread_mutex_t mu;         /* guards everything below but fd writes */
    pthread_mutex_t send_mu;    /* one writer at a time */
    pthread_cond_t cv;
    int fd;                     /* -1 when not connected */
    int reader_active;          /* a thread is reading replies for everyone */
    uint32_t next_seq;
    struct gem_waiter *waiters;
    char ip[64];
    int port;
    int device_ordinal;
    char device_uuid[GEM_UUID_LEN];
    uint64_t client_id;
    uint64_t mem_limit;         /* from HELLO_ACK / LIMIT_UPDATE / MEM_REPLY */
    char group[GEM_NAME_LEN];
    int connecting;             /* a thread is connecting; others wait on cv */
    int ever_connected;         /* a later connect is a reconnect */
    int last_failure;           /* what a call gets while next_connect_ns has not come */
    int64_t next_connect_ns;    /* after a failed connect, calls fail fast until then */
    const uint64_t *mem_in_use; /* the process's bytes on this device, sent in HELLO */
};

enum gem_call_result {
    GEM_CALL_OK = 0,
    GEM_CALL_UNREACHABLE = -1,  /* no connection could be made */
    GEM_CALL_BROKEN = -2,       /* the connection died during the call */
    GEM_CALL_REFUSED = -3,      /* the pod manager answered with ERROR */
    GEM_CALL_TIMEOUT = -4
};

void gem_conn_init(struct gem_conn *c, const char *ip, int port, int ordinal, const char *uuid,
                   const uint64_t *mem_in_use);
void gem_conn_reset_after_fork(struct gem_conn *c);
/* Send `req` and wait for its reply (any type). timeout_ns 0 = wait forever (token waits). */
int gem_conn_call(struct gem_conn *c, struct gem_msg *req, struct gem_msg *reply, int64_t timeout_ns);

/* ---- devices and gating (gate.c) ---------------------------------------------------------- */

enum gem_token_state { GEM_TOKEN_NONE = 0, GEM_TOKEN_HELD, GEM_TOKEN_REQUESTING, GEM_TOKEN_DRAINING };

struct gem_device {
    /* Read on every launch: on its own cache line, written only at token changes. */
    _Alignas(64) atomic_llong deadline_ns;
    atomic_int in_burst;
    char pad_hot[64 - sizeof(atomic_llong) - sizeof(atomic_int)];

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;                  /* enum gem_token_state */
    int waiters;                /* threads blocked for a grant */
    int ordinal;
    CUdevice cudev;
    int initialised;
    uint64_t token_seq;
    int64_t granted_ns;
    int64_t quota_ns;
    int64_t slot_deadline_ns;   /* the deadline of the token held, kept when deadline_ns is cleared */
    atomic_llong burst_start_ns;
    atomic_llong last_sync_ns;
    int bursts_in_slot;
    atomic_llong predicted_burst_ns;
    int64_t predicted_at_ns;    /* when the prediction was last refreshed */
    struct gemhook_burst_est est;
    int64_t pending_overuse_ns; /* measured at the last expiry, not yet reported */
    CUcontext ctx;              /* the context launches were made in, drained at expiry */
    CUevent ev_start, ev_end;   /* measure the GPU time a slot really had (in ev_ctx) */
    CUcontext ev_ctx;
    int slot_measured;          /* ev_start was recorded before the slot's first kernel */
    int slot_unmarked;          /* a fresh grant whose first kernel has not been marked yet */
    int64_t pending_used_ns;    /* measured at the last expiry, not yet reported */
    uint64_t mem_in_use;        /* bytes this process holds on the device (memory.c) */
    struct gem_conn conn;
};

extern struct gem_device gem_devices[GEM_MAX_DEVICES];
extern atomic_int gem_device_count;      /* 0 until known */
extern atomic_int gem_active_captures;

int gem_runtime_init(void);              /* lazy: settings applied, devices counted */
struct gem_device *gem_current_device_multi(void);
/* The device of the calling thread's context. A process that sees one GPU pays nothing for this. */
static inline struct gem_device *gem_current_device(void) {
    if (GEM_LIKELY(atomic_load_explicit(&gem_device_count, memory_order_relaxed) <= 1))
        return &gem_devices[0];
    return gem_current_device_multi();
}
struct gem_device *gem_device_by_ordinal(CUdevice dev);
CUresult gem_gate_slow(struct gem_device *d, CUstream stream, int ptsz, int64_t now);
CUresult gem_burst_begin(struct gem_device *d, CUstream stream, int ptsz, int64_t now);
void gem_on_sync(void);
void gem_capture_changed(CUstream stream, int begins, int ptsz, CUresult rc);
void gem_gate_reset_after_fork(void);
void gem_gate_shutdown(void);
CUresult gem_unavailable_result(void);   /* what a call returns when gemini cannot authorise it */
void gem_enter_fail_open(void);          /* GEMINI_FAIL_OPEN and no pod manager: stop gating */
int gem_fail_open_active(void);

/* The coarse clock (a kernel variable updated every tick, read without rdtsc) never runs ahead
 * of CLOCK_MONOTONIC and trails it by at most a tick. So "coarse + margin < deadline" proves the
 * token valid; only in the last `margin` of a slot does the launch read the precise clock. The
 * margin is two ticks (clock_getres), set in the constructor; 0 disables the shortcut. */
extern int64_t gem_coarse_margin_ns;
static inline int64_t gem_coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * GEM_NS_PER_S + ts.tv_nsec;
}

/* The launch path: one clock read and one compare while a token is held (the burst flag sits
 * on the same cache line and only changes at the first launch after a synchronisation). */
static inline CUresult gem_gate_launch(CUstream stream, int ptsz) {
    struct gem_device *d = gem_current_device();
    gem_count_launch();
    int64_t deadline = atomic_load_explicit(&d->deadline_ns, memory_order_relaxed);
    if (GEM_LIKELY(gem_coarse_ns() + gem_coarse_margin_ns < deadline) ||
        gem_now_ns() < deadline) {
        if (GEM_LIKELY(atomic_load_explicit(&d->in_burst, memory_order_relaxed)))
            return CUDA_SUCCESS;
        return gem_burst_begin(d, stream, ptsz, gem_now_ns());
    }
    return gem_gate_slow(d, stream, ptsz, gem_now_ns());
}

/* ---- memory (memory.c) --------------------------------------------------------------------- */

void gem_memory_reset_after_fork(void);
void gem_memory_on_sync(void);            /* pools may have returned memory to the device */
void gem_endpoint_for(const char *uuid, char *ip, size_t ip_len, int *port);

#endif /* GEMINI_GEMHOOK_H */
