/*
 * sim_nvml.c -- a simulated libnvidia-ml.so.1: the NVML calls nvidia-smi and
 * pynvml make to read a GPU's memory, for the hook's NVML wrappers in CI.
 *
 * Devices have the simulated driver's UUIDs (GPU-516d4375-6461-4a40-8000-
 * 73696d6770NN for index NN), so a CUDA device and its NVML handle match.
 * SIMNVML_DEVICES (else SIMCUDA_DEVICES, else 1) sets how many there are,
 * SIMCUDA_MEM_BYTES (16 GiB) the size of each; NVML here reports the whole
 * device free (it does not read the simulator's shared state).
 *
 * Standalone: it shares no state with libcuda.so.1, and is loaded only by
 * programs that open libnvidia-ml.so.1 themselves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_API __attribute__((visibility("default")))
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define SIMNVML_MAX_DEVICES 256

typedef int nvmlReturn_t;
struct nvmlDevice_st {
    unsigned int index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

static struct nvmlDevice_st devices[SIMNVML_MAX_DEVICES];
static unsigned int ndevices;
static unsigned long long mem_bytes;
static int initialised;

static unsigned long long env_u64(const char *name, unsigned long long dflt) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}

NVML_API nvmlReturn_t nvmlInit_v2(void) {
    ndevices = (unsigned int)env_u64("SIMNVML_DEVICES", env_u64("SIMCUDA_DEVICES", 1));
    if (ndevices > SIMNVML_MAX_DEVICES)
        ndevices = SIMNVML_MAX_DEVICES;
    for (unsigned int i = 0; i < ndevices; i++)
        devices[i].index = i;
    mem_bytes = env_u64("SIMCUDA_MEM_BYTES", 16ull << 30);
    initialised = 1;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

NVML_API nvmlReturn_t nvmlShutdown(void) {
    initialised = 0;
    return NVML_SUCCESS;
}

NVML_API const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = ndevices;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= ndevices)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static int valid(nvmlDevice_t d) { return d >= devices && d < devices + ndevices; }

NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int i = device->index;
    char text[64];
    int n = snprintf(text, sizeof text, "GPU-516d4375-6461-4a%02x-8000-73696d6770%02x", 0x40 | (i >> 8 & 0x0f),
                     i & 0xff);
    if ((unsigned int)n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, text, (size_t)n + 1);
    return NVML_SUCCESS;
}

/* gem-schd finds the GPU it serves by UUID (gemini/scheduler/capacity.py). */
NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < ndevices; i++) {
        char text[64];
        if (nvmlDeviceGetUUID(&devices[i], text, sizeof text) == NVML_SUCCESS && strcmp(text, uuid) == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = mem_bytes;
    memory->free = mem_bytes;
    memory->used = 0;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid(device) || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = mem_bytes;
    memory->reserved = 0;
    memory->free = mem_bytes;
    memory->used = 0;
    return NVML_SUCCESS;
}
