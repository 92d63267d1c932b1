/*
 * settings.h -- the hook's settings (read once in the constructor: from the
 * read-only settings file /etc/gemini/hook.conf when it exists, else from the
 * environment) and its logging. Every layer reads them; they call nothing
 * of the hook's but util.
 */
#ifndef GEMINI_SETTINGS_H
#define GEMINI_SETTINGS_H

#include <stdint.h>

#include "gemini_proto.h"
#include "util.h"

enum gem_log_level { GEM_LOG_ERROR = 0, GEM_LOG_WARN = 1, GEM_LOG_INFO = 2, GEM_LOG_DEBUG = 3 };

struct gem_settings {
    int log_level;
    int disabled;               /* GEMINI_DISABLE=1: pass everything through, connect to nothing */
    int fail_open;              /* GEMINI_FAIL_OPEN=1: run ungated when the pod manager is unreachable */
    char pod_name[GEM_NAME_LEN];
    char pmgr_ip[64];
    int pmgr_port;              /* 0: POD_MANAGER_PORT is not a port (settings_error says so) */
    char settings_error[160];   /* a setting that leaves no pod manager to ask; CUDA calls that need one fail */
    char pmgr_map[1024];        /* GEMINI_POD_MANAGERS: "GPU-uuid=ip:port,..." for several GPUs */
    char ipc_dir[256];          /* GEMINI_IPC_DIR: the socket transport; empty: TCP */
    char board_dir[256];        /* GEMINI_BOARD_DIR: where this process sees the board pages its pod manager
                                 * names (a container sees the daemons' directory elsewhere); empty: as named */
    char settings_file[256];    /* the settings file the settings came from; empty: the environment */
    int64_t idle_release_ns;    /* GEMINI_IDLE_RELEASE_MS; 0 disables early release */
    int64_t connect_timeout_ns; /* GEMINI_CONNECT_TIMEOUT_MS */
    int64_t token_timeout_ns;   /* GEMINI_TOKEN_TIMEOUT_MS; 0 waits forever */
    int64_t burst_merge_ns;     /* bursts closer than this are one burst (Gemini: 2 ms) */
    int64_t burst_window_ns;    /* prediction looks back this far (Gemini: 3 s) */
    int64_t claim_idle_ns;      /* GEMINI_CLAIM_IDLE_MS: a latency group's claim ends this long after its burst */
    int64_t inflight_ns;        /* GEMINI_INFLIGHT_MS: GPU work kept queued per stream while bounded */
    int flare;                  /* GEMINI_FLARE=0: a latency process raises no flare (flare.h); batch work makes way for its
                                 * requests when its pod manager has written the claim on the board */
    int kernel_costs;           /* GEMINI_KERNEL_COSTS=0: beside a latency group the markers come every N launches, as
                                 * for a capped group, not by the kernels' predicted GPU time (kcost.h) */
    int marker_sampling;        /* GEMINI_MARKER_SAMPLING=0: every marker's event is a timed one, as before the
                                 * untimed markers (inflight.c: a timed record costs the GPU about 2 us) */
    int gap_events;             /* GEMINI_GAP_EVENTS=0: the gaps a capped slot is forgiven after each context-wide
                                 * synchronisation are timed on the host, not by two events on the GPU (gate.c) */
    int gpu_gate;               /* GEMINI_GPU_GATE=0: no GPU-side gate during claims (gpugate.h); the queue
                                 * then stays GEMINI_INFLIGHT_MS short next to a latency group */
    int64_t early_claim_ns;     /* GEMINI_EARLY_CLAIM_MS: a latency process launches this long before its
                                 * claim is answered; 0: it waits for the answer */
    char procaddr_log[512];     /* GEMINI_PROCADDR_LOG: append every cuGetProcAddress query and its routing */
};
extern struct gem_settings gem_cfg;

/* Read the settings file, or else the GEMINI_* variables, into gem_cfg (the constructor; no CUDA call, no
 * connection). */
void gem_settings_load(void);

/* One line on stderr in the format of every gemini program (gemini/logs.py):
 * "2026-11-22 16:25:02.789 gemini[PID] level: message", local time. */
void gem_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define GEM_LOG(level, ...)                                     \
    do {                                                        \
        if (GEM_UNLIKELY((level) <= gem_cfg.log_level))         \
            gem_log((level), __VA_ARGS__);                      \
    } while (0)

#endif /* GEMINI_SETTINGS_H */
