/*
 * device.h -- the devices the process uses: the registry (one entry per
 * visible GPU, set up lazily at the first call that needs it), the pod
 * manager each one talks to, and fail-open.
 */
#ifndef GEMINI_DEVICE_H
#define GEMINI_DEVICE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "client.h"
#include "cuda_types.h"
#include "util.h"

#define GEM_MAX_DEVICES 32

struct gem_device {
    int ordinal;
    CUdevice cudev;
    int initialised;
    uint64_t mem_in_use;        /* bytes this process holds on the device (memory.c counts, HELLO reports) */
    struct gem_conn conn;
    /* The GPU's board page, mapped read-only (NULL if the pod manager named none, or it could not be
     * mapped), and the path it was mapped from. A board is never unmapped: a thread may still read one
     * it loaded a moment ago; a new gem-schd makes a new board, and the old 64 KiB stay mapped. */
    const struct gem_board *board;
    char board_path[GEM_BOARD_PATH_LEN];
    uint64_t board_epoch;       /* the conn's board_epoch when it was mapped */
    uint64_t board_file[2];     /* its file's (st_dev, st_ino): a page renamed over it is a new board */
    _Atomic int64_t board_query_after_ns;  /* a marked line is asked about at most this often */
    const struct gem_board *_Atomic board_mark_kept;  /* a marked page the pod manager named again: not asked again */
};

extern struct gem_device gem_devices[GEM_MAX_DEVICES];
extern atomic_int gem_device_count;      /* 0 until known */

/* Lazy: the devices counted and set up. 0, or -1 while CUDA is not initialised (try again later). */
int gem_runtime_init(void);
int gem_runtime_ready(void);

struct gem_device *gem_current_device_multi(void);
/* The device of the calling thread's context. A process that sees one GPU pays nothing for this. */
static inline struct gem_device *gem_current_device(void) {
    if (GEM_LIKELY(atomic_load_explicit(&gem_device_count, memory_order_relaxed) <= 1))
        return &gem_devices[0];
    return gem_current_device_multi();
}
struct gem_device *gem_device_by_ordinal(CUdevice dev);

/* The pod manager for a device. Socket transport (GEMINI_IPC_DIR): DIR/<uuid>/group.<name>.sock if the directory
 * DIR/<uuid> exists, else DIR/default/group.<name>.sock. TCP: GEMINI_POD_MANAGERS "uuid=ip:port,..." if it names
 * the device, else POD_MANAGER_IP:POD_MANAGER_PORT. */
void gem_endpoint_for(const char *uuid, struct gem_endpoint *ep);

CUresult gem_unavailable_result(void);   /* what a call returns when gemini cannot authorise it */
void gem_enter_fail_open(void);          /* GEMINI_FAIL_OPEN and no pod manager: stop gating */
int gem_fail_open_active(void);
/* Nothing to gate or count: GEMINI_DISABLE, or failing open. */
int gem_ungated(void);

/* The board the device's pod manager named last (HELLO_ACK, BOARD_INFO), mapped on first use (NULL if none), and
 * the group's line on it (`slot`, may be NULL), read together. Cheap when nothing changed. */
const struct gem_board *gem_device_board(struct gem_device *d, int32_t *slot);

/* The path `b` was mapped from, if it is d's board now (copied into out; 1), else 0: the flare pages lie beside it. */
int gem_device_board_file(struct gem_device *d, const struct gem_board *b, char *out, size_t len);

/* Ask the pod manager where its board is now (BOARD_QUERY, waiting at most timeout_ns) and map it, when `told` (a
 * grant's GEM_GRANT_BOARD) or when the group's line on the page in use is marked `moved` (a new gem-schd: then at
 * most every 100 ms). Cheap otherwise: one load. Called at grants and by the watcher, never on the launch path. */
void gem_device_follow_board(struct gem_device *d, int told, int64_t timeout_ns);

void gem_device_after_fork(void);        /* the child has no connection and holds no memory yet */

#endif /* GEMINI_DEVICE_H */
