/*
 * device.c -- the device registry, the pod manager of each device, fail-open.
 *
 * Nothing happens before the first CUDA call that needs it: then the devices
 * are counted and each one gets its UUID and its pod manager's endpoint
 * (GEMINI_POD_MANAGERS by UUID, else the default). The connection itself is
 * opened by the first message (client.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "board.h"
#include "device.h"
#include "real.h"
#include "settings.h"
#include "stats.h"

struct gem_device gem_devices[GEM_MAX_DEVICES];
atomic_int gem_device_count;

static pthread_mutex_t runtime_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int runtime_ready;
static atomic_int fail_open_active;

CUresult gem_unavailable_result(void) {
    /* "system not yet initialized": the closest driver code to "the GPU share
     * could not be authorised"; the hook has already printed why. */
    return CUDA_ERROR_SYSTEM_NOT_READY;
}

int gem_fail_open_active(void) { return atomic_load(&fail_open_active); }

int gem_ungated(void) { return gem_cfg.disabled || atomic_load(&fail_open_active); }

void gem_enter_fail_open(void) {
    if (atomic_exchange(&fail_open_active, 1) == 0)
        GEM_LOG(GEM_LOG_WARN, "GEMINI_FAIL_OPEN is set and the pod manager cannot be reached: "
                "running UNGATED, without time shares or memory limits");
}

static void format_uuid(const CUuuid *u, char *out, size_t len) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The socket transport's endpoint: the GPU's own directory if the backend made one for it, else `default`. */
static void socket_endpoint_for(const char *uuid, struct gem_endpoint *ep) {
    char name[GEM_PATH_LEN], dir[GEM_PATH_LEN];
    if (gemhook_group_socket_name(gem_cfg.pod_name, name, sizeof name) != 0)
        snprintf(name, sizeof name, "group.sock");      /* cannot happen: names are < 64 bytes */
    struct stat st;
    if (!uuid || !uuid[0] || (size_t)snprintf(dir, sizeof dir, "%s/%s", gem_cfg.ipc_dir, uuid) >= sizeof dir ||
        stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        snprintf(dir, sizeof dir, "%s/default", gem_cfg.ipc_dir);
    if ((size_t)snprintf(ep->path, sizeof ep->path, "%s/%s", dir, name) >= sizeof ep->path)
        GEM_LOG(GEM_LOG_ERROR, "GEMINI_IPC_DIR: the socket path for group '%s' is too long", gem_cfg.pod_name);
}

void gem_endpoint_for(const char *uuid, struct gem_endpoint *ep) {
    memset(ep, 0, sizeof *ep);
    if (gem_cfg.ipc_dir[0]) {
        socket_endpoint_for(uuid, ep);
        return;
    }
    char *ip = ep->ip;
    size_t ip_len = sizeof ep->ip;
    int *port = &ep->port;
    snprintf(ip, ip_len, "%s", gem_cfg.pmgr_ip);
    *port = gem_cfg.pmgr_port;
    char map[sizeof gem_cfg.pmgr_map];
    snprintf(map, sizeof map, "%s", gem_cfg.pmgr_map);
    char *save = NULL;
    for (char *item = strtok_r(map, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq)
            continue;
        *eq = '\0';
        if (strcmp(item, uuid) != 0)
            continue;
        char mip[64];
        int mport;
        if (gemhook_parse_endpoint(eq + 1, mip, sizeof mip, &mport) == 0) {
            snprintf(ip, ip_len, "%s", mip);
            *port = mport;
        } else {
            GEM_LOG(GEM_LOG_ERROR, "GEMINI_POD_MANAGERS: bad endpoint '%s' for %s", eq + 1, uuid);
        }
    }
}

static void device_setup(struct gem_device *d, int ordinal) {
    d->ordinal = ordinal;
    char uuid[GEM_UUID_LEN] = "";
    CUdevice dev = ordinal;
    CUuuid raw;
    if (HAVE_REAL(cuDeviceGet) && REAL(cuDeviceGet)(&dev, ordinal) == CUDA_SUCCESS && HAVE_REAL(cuDeviceGetUuid) &&
        REAL(cuDeviceGetUuid)(&raw, dev) == CUDA_SUCCESS)
        format_uuid(&raw, uuid, sizeof uuid);
    d->cudev = dev;
    struct gem_endpoint ep;
    gem_endpoint_for(uuid, &ep);
    gem_conn_init(&d->conn, &ep, ordinal, uuid, &d->mem_in_use);
    d->initialised = 1;
}

static pthread_mutex_t board_mu = PTHREAD_MUTEX_INITIALIZER;

static const struct gem_board *map_board(const char *path, uint64_t file[2]) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        GEM_LOG(GEM_LOG_WARN, "cannot open the board page %s (%s): no claims or continuations for this "
                "process", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == (off_t)sizeof(struct gem_board)) {
        p = mmap(NULL, sizeof(struct gem_board), PROT_READ, MAP_SHARED, fd, 0);
        file[0] = (uint64_t)st.st_dev;
        file[1] = (uint64_t)st.st_ino;
    }
    close(fd);
    if (p == MAP_FAILED) {
        GEM_LOG(GEM_LOG_WARN, "%s is not a board page: no claims or continuations for this process", path);
        return NULL;
    }
    const struct gem_board *b = p;
    if (__atomic_load_n(&b->head.magic, __ATOMIC_ACQUIRE) != GEM_BOARD_MAGIC ||
        b->head.version != GEM_BOARD_VERSION) {
        munmap(p, sizeof(struct gem_board));
        GEM_LOG(GEM_LOG_WARN, "%s is not a board page of this version", path);
        return NULL;
    }
    return b;
}

/* Where this process finds the board its pod manager named: the name as is, or with GEMINI_BOARD_DIR its file
 * name in that directory (the pod manager names the page as the daemons see it; a container sees their
 * directory mounted elsewhere). "" if the name has no file name. */
static void board_path_here(const char *named, char *out, size_t len) {
    if (!named[0] || !gem_cfg.board_dir[0]) {
        snprintf(out, len, "%s", named);
        return;
    }
    const char *base = strrchr(named, '/');
    base = base ? base + 1 : named;
    if (!base[0] || strcmp(base, ".") == 0 || strcmp(base, "..") == 0 ||
        (size_t)snprintf(out, len, "%s/%s", gem_cfg.board_dir, base) >= len)
        out[0] = '\0';
}

/* Is the file at `path` the one mapped (file: its st_dev, st_ino)? */
static int same_file(const char *path, const uint64_t file[2]) {
    struct stat st;
    return stat(path, &st) == 0 && (uint64_t)st.st_dev == file[0] && (uint64_t)st.st_ino == file[1];
}

const struct gem_board *gem_device_board(struct gem_device *d, int32_t *slot) {
    pthread_mutex_lock(&d->conn.mu);
    char path[GEM_BOARD_PATH_LEN];
    board_path_here(d->conn.board_path, path, sizeof path);
    uint64_t epoch = d->conn.board_epoch;
    if (slot)
        *slot = d->conn.board_slot;
    pthread_mutex_unlock(&d->conn.mu);
    pthread_mutex_lock(&board_mu);
    /* Named again (a new handshake, a BOARD_INFO): under the same name it may be a new gem-schd's page
     * (--board fixes the name), which replaced the old file. */
    if (strcmp(path, d->board_path) != 0 || (epoch != d->board_epoch && !(d->board && same_file(path, d->board_file)))) {
        snprintf(d->board_path, sizeof d->board_path, "%s", path);
        d->board = path[0] ? map_board(path, d->board_file) : NULL;
        if (d->board)
            GEM_LOG(GEM_LOG_DEBUG, "GPU %d: board page %s", d->ordinal, path);
    }
    d->board_epoch = epoch;
    const struct gem_board *b = d->board;
    pthread_mutex_unlock(&board_mu);
    return b;
}

int gem_device_board_file(struct gem_device *d, const struct gem_board *b, char *out, size_t len) {
    pthread_mutex_lock(&board_mu);
    int ok = b && d->board == b && d->board_path[0] && (size_t)snprintf(out, len, "%s", d->board_path) < len;
    pthread_mutex_unlock(&board_mu);
    return ok;
}

void gem_device_follow_board(struct gem_device *d, int told, int64_t timeout_ns) {
    int32_t slot;
    const struct gem_board *b = gem_device_board(d, &slot);
    if (!told) {
        if (GEM_LIKELY(!b || slot < 0 || !gemhook_board_moved(b, (uint32_t)slot) || b == atomic_load(&d->board_mark_kept)))
            return;
        int64_t now = gem_now_ns();
        int64_t after = atomic_load(&d->board_query_after_ns);
        if (now < after ||
            !atomic_compare_exchange_strong(&d->board_query_after_ns, &after, now + 100 * GEM_NS_PER_MS))
            return; /* asked lately, or another thread asks now */
    }
    int rc = gem_conn_query_board(&d->conn, timeout_ns);
    if (rc != GEM_CALL_OK) {
        GEM_LOG(GEM_LOG_DEBUG, "GPU %d: the pod manager did not say where its board is now (%d)", d->ordinal, rc);
        return;
    }
    int32_t now_slot;
    const struct gem_board *now_board = gem_device_board(d, &now_slot);
    if (now_board == b && now_slot == slot) {
        /* The same page and line again: nothing moved (a marked page named again is not asked about again:
         * the mark would stand for good). */
        if (!told)
            atomic_store(&d->board_mark_kept, b);
        return;
    }
    b = now_board;
    atomic_fetch_add(&gem_stats.board_moves, 1);
    char path[GEM_BOARD_PATH_LEN];
    pthread_mutex_lock(&board_mu);
    snprintf(path, sizeof path, "%s", b ? d->board_path : "none (no claims or continuations for this process)");
    pthread_mutex_unlock(&board_mu);
    GEM_LOG(GEM_LOG_INFO, "GPU %d: the pod manager's board is now line %d of %s", d->ordinal, (int)now_slot, path);
}

int gem_runtime_ready(void) { return atomic_load_explicit(&runtime_ready, memory_order_acquire); }

int gem_runtime_init(void) {
    if (GEM_LIKELY(atomic_load_explicit(&runtime_ready, memory_order_acquire)))
        return 0;
    pthread_mutex_lock(&runtime_mu);
    int rc = 0;
    if (atomic_load(&runtime_ready))
        goto out;
    if (gem_ensure_real() != 0) {
        rc = -1;
        goto out;
    }
    if (gem_cfg.disabled) {
        atomic_store(&gem_device_count, 1);
        GEM_LOG(GEM_LOG_INFO, "GEMINI_DISABLE is set: passing every call through ungated");
        atomic_store_explicit(&runtime_ready, 1, memory_order_release);
        goto out;
    }
    int count = 0;
    if (!HAVE_REAL(cuDeviceGetCount) || REAL(cuDeviceGetCount)(&count) != CUDA_SUCCESS || count <= 0) {
        rc = -1; /* CUDA not initialised yet: the program's own call will report it; try again later */
        goto out;
    }
    if (count > GEM_MAX_DEVICES) {
        GEM_LOG(GEM_LOG_WARN, "%d devices visible; gemini manages the first %d", count, GEM_MAX_DEVICES);
        count = GEM_MAX_DEVICES;
    }
    for (int i = 0; i < count; i++)
        device_setup(&gem_devices[i], i);
    atomic_store(&gem_device_count, count);
    atomic_store_explicit(&runtime_ready, 1, memory_order_release);
    GEM_LOG(GEM_LOG_DEBUG, "initialised: %d device(s), pod manager %s, group '%s'", count,
            gem_devices[0].conn.where, gem_cfg.pod_name);
out:
    pthread_mutex_unlock(&runtime_mu);
    return rc;
}

struct gem_device *gem_current_device_multi(void) {
    CUdevice dev = 0;
    int count = atomic_load_explicit(&gem_device_count, memory_order_relaxed);
    if (HAVE_REAL(cuCtxGetDevice) && REAL(cuCtxGetDevice)(&dev) == CUDA_SUCCESS && dev >= 0 && dev < count)
        return &gem_devices[dev];
    return &gem_devices[0];
}

struct gem_device *gem_device_by_ordinal(CUdevice dev) {
    int count = atomic_load_explicit(&gem_device_count, memory_order_relaxed);
    if (dev >= 0 && dev < count)
        return &gem_devices[dev];
    return NULL;
}

void gem_device_after_fork(void) {
    pthread_mutex_init(&runtime_mu, NULL);
    pthread_mutex_init(&board_mu, NULL);    /* the mappings themselves are inherited and stay valid */
    atomic_store(&fail_open_active, 0);
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < count; i++)
        if (gem_devices[i].initialised)
            gem_conn_reset_after_fork(&gem_devices[i].conn);
}
