/*
 * nvml.c -- NVML inside a group: nvidia-smi and pynvml see the group's limit.
 *
 * A process may use NVML without CUDA (nvidia-smi, a monitoring thread), so the device is found by
 * UUID: the process's own CUDA device if it has one, else a connection of its own to the pod manager
 * for that UUID (GEMINI_POD_MANAGERS, or the default one). If no pod manager answers for the device,
 * NVML's own numbers are returned untouched, as they are (with a warning, once) for devices beyond the
 * table of connections.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "client.h"
#include "device.h"
#include "hook_exports.h"
#include "nvml.h"
#include "real.h"
#include "settings.h"

/* One connection per GPU, as many as the hook manages CUDA devices. */
#define MAX_NVML_CONNS GEM_MAX_DEVICES
static pthread_mutex_t nvml_conn_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    char uuid[GEM_UUID_LEN];
    struct gem_conn conn;
} nvml_conns[MAX_NVML_CONNS];
static int n_nvml_conns;

static struct gem_conn *conn_for_nvml_device(struct nvmlDevice_st *device) {
    char uuid[GEM_UUID_LEN] = "";
    if (gem_resolve_nvml() != 0 || !HAVE_REAL(nvmlDeviceGetUUID) ||
        REAL(nvmlDeviceGetUUID)(device, uuid, sizeof uuid) != GEM_NVML_SUCCESS || !uuid[0])
        return NULL;
    int count = atomic_load(&gem_device_count);
    for (int i = 0; i < count; i++)
        if (gem_devices[i].initialised && strcmp(gem_devices[i].conn.device_uuid, uuid) == 0)
            return &gem_devices[i].conn;
    struct gem_conn *c = NULL;
    pthread_mutex_lock(&nvml_conn_mu);
    for (int i = 0; i < n_nvml_conns && !c; i++)
        if (strcmp(nvml_conns[i].uuid, uuid) == 0)
            c = &nvml_conns[i].conn;
    if (!c && n_nvml_conns < MAX_NVML_CONNS) {
        struct gem_endpoint ep;
        gem_endpoint_for(uuid, &ep);
        snprintf(nvml_conns[n_nvml_conns].uuid, GEM_UUID_LEN, "%s", uuid);
        c = &nvml_conns[n_nvml_conns++].conn;
        gem_conn_init(c, &ep, -1, uuid, NULL);
    }
    pthread_mutex_unlock(&nvml_conn_mu);
    if (!c) {
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            GEM_LOG(GEM_LOG_WARN, "NVML: more than %d GPUs queried; %s and any further GPU show NVML's own "
                    "memory numbers, not their group's limit", MAX_NVML_CONNS, uuid);
    }
    return c;
}

/* total = min(limit, physical), used = the group's use, reserved and free fitted under the total. */
static void nvml_clamp(struct nvmlDevice_st *device, unsigned long long *total, unsigned long long *free_bytes,
                       unsigned long long *used, unsigned long long *reserved) {
    if (gem_cfg.disabled || gem_fail_open_active())
        return;
    struct gem_conn *c = conn_for_nvml_device(device);
    struct gem_msg req, reply;
    gemhook_msg_init(&req, GEM_MSG_MEM_INFO, 0);
    if (!c || gem_conn_call(c, &req, &reply, 5 * GEM_NS_PER_S) != GEM_CALL_OK || reply.hdr.type != GEM_MSG_MEM_REPLY ||
        reply.u.mem_reply.limit == 0)
        return;
    unsigned long long limit = reply.u.mem_reply.limit, group_used = reply.u.mem_reply.used;
    if (*total > limit)
        *total = limit;
    *used = group_used < *total ? group_used : *total;
    unsigned long long room = *total - *used;
    if (reserved) {
        if (*reserved > room)
            *reserved = room;
        room -= *reserved;
    }
    if (*free_bytes > room)
        *free_bytes = room;
}

GEM_EXPORT int nvmlDeviceGetMemoryInfo(struct nvmlDevice_st *device, struct gem_nvml_memory *memory) {
    if (gem_resolve_nvml() != 0 || !HAVE_REAL(nvmlDeviceGetMemoryInfo))
        return GEM_NVML_ERROR_FUNCTION_NOT_FOUND;
    int rc = REAL(nvmlDeviceGetMemoryInfo)(device, memory);
    if (rc == GEM_NVML_SUCCESS && memory)
        nvml_clamp(device, &memory->total, &memory->free, &memory->used, NULL);
    return rc;
}

GEM_EXPORT int nvmlDeviceGetMemoryInfo_v2(struct nvmlDevice_st *device, struct gem_nvml_memory_v2 *memory) {
    if (gem_resolve_nvml() != 0 || !HAVE_REAL(nvmlDeviceGetMemoryInfo_v2))
        return GEM_NVML_ERROR_FUNCTION_NOT_FOUND;
    int rc = REAL(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    if (rc == GEM_NVML_SUCCESS && memory)
        nvml_clamp(device, &memory->total, &memory->free, &memory->used, &memory->reserved);
    return rc;
}

void gem_nvml_after_fork(void) {
    /* The parent's connections are the parent's (a thread of the parent may be reading one right now):
     * the child keeps the table's UUIDs and endpoints but opens connections of its own. */
    pthread_mutex_init(&nvml_conn_mu, NULL);
    for (int i = 0; i < n_nvml_conns; i++)
        gem_conn_reset_after_fork(&nvml_conns[i].conn);
}
