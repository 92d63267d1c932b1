/*
 * nvml.h -- NVML inside a group: nvidia-smi and pynvml see the group's memory
 * limit as the size of the GPU (the wrappers, nvmlDeviceGetMemoryInfo and
 * _v2, are in nvml.c).
 */
#ifndef GEMINI_NVML_H
#define GEMINI_NVML_H

void gem_nvml_after_fork(void);        /* the child opens its own connections */

#endif /* GEMINI_NVML_H */
