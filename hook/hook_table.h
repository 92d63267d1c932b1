/*
 * hook_table.h -- the one table of driver functions libgemhook touches.
 *
 * Each row names a function once. A file that needs the list defines a row
 * macro X and expands GEM_HOOK_TABLE(X); the table becomes the real-pointer
 * slots and their typedefs (real.h), the names and libraries dlsym and
 * cuGetProcAddress route by (real.c, symbols.c), the prototypes of the
 * exported wrappers (wrappers.h) and, for the uniform kinds, the wrappers
 * themselves (wrappers.c, memory.c). Every row has the same columns:
 *
 *   X(kind, lib, ret, name, since, pt, params, args, extra)
 *
 *   kind    what the hook does with it (below)
 *   lib     CUDA (libcuda.so.1) or NVML (libnvidia-ml.so.1): where the real
 *           function is resolved from
 *   ret     its return type: CUresult, or int for NVML (nvmlReturn_t)
 *   name    the exported symbol, with its _vN and _ptsz/_ptds suffixes
 *   since   the cudaVersion that introduced this variant (cudaTypedefs.h's
 *           PFN_<base>_v<since>); 0 for NVML. With the suffixes it tells
 *           which variant a cuGetProcAddress (symbol, version, flags) means
 *   pt      1 for a per-thread-default-stream variant (_ptsz/_ptds): its
 *           NULL stream is the calling thread's stream, not the legacy one
 *   params  the parameter list, args the same names as an argument list
 *           (`_` where no generated code calls it)
 *   extra   LAUNCH, GRAPH_LAUNCH, CAPTURE_*: the expression giving the call's stream;
 *           SYNC: what it synchronises -- the context of cuCtxSynchronize*
 *           (NULL: the calling thread's), the stream of cuStreamSynchronize*,
 *           NULL for the rest;
 *           ALLOC_FROM_POOL: the pool argument; `_` otherwise
 *
 * Kinds:
 *   LAUNCH           gated launch of a kernel (wrappers.c)
 *   GRAPH_LAUNCH     gated launch of a graph: one unit of queued work, however
 *                    many kernels it holds (wrappers.c)
 *   SYNC             synchronising call: ends a burst (wrappers.c)
 *   CAPTURE_BEGIN    stream capture begins / ends on `extra` (wrappers.c)
 *   CAPTURE_END
 *   ALLOC_ASYNC      stream-ordered allocation from the device's current
 *   ALLOC_FROM_POOL  pool / from the pool in `extra` (generated in memory.c)
 *   CUSTOM           wrapper written by hand (memory.c, vmm.c, context.c, nvml.c,
 *                    symbols.c)
 *   REAL             not intercepted: resolved only for the hook's own calls
 *
 * A variant missing from the installed driver resolves to NULL; it is then
 * never handed out, because dlsym and cuGetProcAddress only return a wrapper
 * when the driver has the real function.
 */
#ifndef GEMINI_HOOK_TABLE_H
#define GEMINI_HOOK_TABLE_H

#include "cuda_types.h"

#define GEM_LAUNCH_PARAMS                                                                  \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,    \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,               \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
#define GEM_LAUNCH_ARGS                                                                    \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,     \
     hStream, kernelParams, extra)
#define GEM_COOP_PARAMS                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,    \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,               \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
#define GEM_COOP_ARGS                                                                      \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,     \
     hStream, kernelParams)
#define GEM_LAUNCH_EX_PARAMS (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
#define GEM_LAUNCH_EX_ARGS (config, f, kernelParams, extra)
#define GEM_LAUNCH_EX_STREAM (config ? config->hStream : (CUstream)0)
#define GEM_GRAPH_PARAMS (CUgraphExec hGraphExec, CUstream hStream)
#define GEM_GRAPH_ARGS (hGraphExec, hStream)

#define GEM_CAPTURE_TO_GRAPH_PARAMS                                                        \
    (CUstream hStream, CUgraph hGraph, const CUgraphNode *deps, const void *depData,        \
     size_t numDeps, CUstreamCaptureMode mode)
#define GEM_CAPTURE_TO_GRAPH_ARGS (hStream, hGraph, deps, depData, numDeps, mode)

#define GEM_COPY_DD_PARAMS (CUdeviceptr dst, CUdeviceptr src, size_t n)
#define GEM_COPY_HD_PARAMS (CUdeviceptr dst, const void *src, size_t n)
#define GEM_COPY_DH_PARAMS (void *dst, CUdeviceptr src, size_t n)
#define GEM_COPY_ARGS (dst, src, n)
#define GEM_COPY_PEER_PARAMS (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx, size_t n)
#define GEM_COPY_PEER_ARGS (dst, dstCtx, src, srcCtx, n)

/* synchronous copies from and to arrays */
#define GEM_COPY_AH_PARAMS (void *dst, CUarray src, size_t srcOffset, size_t n)
#define GEM_COPY_AH_ARGS (dst, src, srcOffset, n)
#define GEM_COPY_HA_PARAMS (CUarray dst, size_t dstOffset, const void *src, size_t n)
#define GEM_COPY_HA_ARGS (dst, dstOffset, src, n)
#define GEM_COPY_AD_PARAMS (CUdeviceptr dst, CUarray src, size_t srcOffset, size_t n)
#define GEM_COPY_AD_ARGS (dst, src, srcOffset, n)
#define GEM_COPY_DA_PARAMS (CUarray dst, size_t dstOffset, CUdeviceptr src, size_t n)
#define GEM_COPY_DA_ARGS (dst, dstOffset, src, n)
#define GEM_COPY_AA_PARAMS (CUarray dst, size_t dstOffset, CUarray src, size_t srcOffset, size_t n)
#define GEM_COPY_AA_ARGS (dst, dstOffset, src, srcOffset, n)

#define GEM_ALLOC_ASYNC_PARAMS (CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
#define GEM_ALLOC_ASYNC_ARGS (dptr, bytesize, hStream)
#define GEM_ALLOC_POOL_PARAMS (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
#define GEM_ALLOC_POOL_ARGS (dptr, bytesize, pool, hStream)

#define GEM_HOOK_TABLE(X)                                                                                           \
    /* ---- gated launches ------------------------------------------------------------------------------ */        \
    X(LAUNCH, CUDA, CUresult, cuLaunchKernel, 4000, 0, GEM_LAUNCH_PARAMS, GEM_LAUNCH_ARGS, hStream)                 \
    X(LAUNCH, CUDA, CUresult, cuLaunchKernel_ptsz, 7000, 1, GEM_LAUNCH_PARAMS, GEM_LAUNCH_ARGS, hStream)            \
    X(LAUNCH, CUDA, CUresult, cuLaunchKernelEx, 11060, 0, GEM_LAUNCH_EX_PARAMS, GEM_LAUNCH_EX_ARGS,                 \
      GEM_LAUNCH_EX_STREAM)                                                                                         \
    X(LAUNCH, CUDA, CUresult, cuLaunchKernelEx_ptsz, 11060, 1, GEM_LAUNCH_EX_PARAMS, GEM_LAUNCH_EX_ARGS,            \
      GEM_LAUNCH_EX_STREAM)                                                                                         \
    X(LAUNCH, CUDA, CUresult, cuLaunchCooperativeKernel, 9000, 0, GEM_COOP_PARAMS, GEM_COOP_ARGS, hStream)          \
    X(LAUNCH, CUDA, CUresult, cuLaunchCooperativeKernel_ptsz, 9000, 1, GEM_COOP_PARAMS, GEM_COOP_ARGS, hStream)     \
    X(GRAPH_LAUNCH, CUDA, CUresult, cuGraphLaunch, 10000, 0, GEM_GRAPH_PARAMS, GEM_GRAPH_ARGS, hStream)             \
    X(GRAPH_LAUNCH, CUDA, CUresult, cuGraphLaunch_ptsz, 10000, 1, GEM_GRAPH_PARAMS, GEM_GRAPH_ARGS, hStream)        \
    /* ---- synchronising calls: the end of a kernel burst ---------------------------------------------- */        \
    X(SYNC, CUDA, CUresult, cuCtxSynchronize, 2000, 0, (void), (), NULL)                                            \
    X(SYNC, CUDA, CUresult, cuCtxSynchronize_v2, 13000, 0, (CUcontext ctx), (ctx), ctx)                             \
    X(SYNC, CUDA, CUresult, cuStreamSynchronize, 2000, 0, (CUstream hStream), (hStream), hStream)                   \
    X(SYNC, CUDA, CUresult, cuStreamSynchronize_ptsz, 7000, 1, (CUstream hStream), (hStream), hStream)              \
    X(SYNC, CUDA, CUresult, cuEventSynchronize, 2000, 0, (CUevent hEvent), (hEvent), NULL)                          \
    X(SYNC, CUDA, CUresult, cuMemcpy, 4000, 0, GEM_COPY_DD_PARAMS, GEM_COPY_ARGS, NULL)                             \
    X(SYNC, CUDA, CUresult, cuMemcpy_ptds, 7000, 1, GEM_COPY_DD_PARAMS, GEM_COPY_ARGS, NULL)                        \
    X(SYNC, CUDA, CUresult, cuMemcpyHtoD_v2, 3020, 0, GEM_COPY_HD_PARAMS, GEM_COPY_ARGS, NULL)                      \
    X(SYNC, CUDA, CUresult, cuMemcpyHtoD_v2_ptds, 7000, 1, GEM_COPY_HD_PARAMS, GEM_COPY_ARGS, NULL)                 \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoH_v2, 3020, 0, GEM_COPY_DH_PARAMS, GEM_COPY_ARGS, NULL)                      \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoH_v2_ptds, 7000, 1, GEM_COPY_DH_PARAMS, GEM_COPY_ARGS, NULL)                 \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoD_v2, 3020, 0, GEM_COPY_DD_PARAMS, GEM_COPY_ARGS, NULL)                      \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoD_v2_ptds, 7000, 1, GEM_COPY_DD_PARAMS, GEM_COPY_ARGS, NULL)                 \
    X(SYNC, CUDA, CUresult, cuMemcpy2D_v2, 3020, 0, (const CUDA_MEMCPY2D *p), (p), NULL)                            \
    X(SYNC, CUDA, CUresult, cuMemcpy2D_v2_ptds, 7000, 1, (const CUDA_MEMCPY2D *p), (p), NULL)                       \
    X(SYNC, CUDA, CUresult, cuMemcpy3D_v2, 3020, 0, (const CUDA_MEMCPY3D *p), (p), NULL)                            \
    X(SYNC, CUDA, CUresult, cuMemcpy3D_v2_ptds, 7000, 1, (const CUDA_MEMCPY3D *p), (p), NULL)                       \
    X(SYNC, CUDA, CUresult, cuMemcpyPeer, 4000, 0, GEM_COPY_PEER_PARAMS, GEM_COPY_PEER_ARGS, NULL)                  \
    X(SYNC, CUDA, CUresult, cuMemcpyPeer_ptds, 7000, 1, GEM_COPY_PEER_PARAMS, GEM_COPY_PEER_ARGS, NULL)             \
    X(SYNC, CUDA, CUresult, cuMemcpy3DPeer, 4000, 0, (const CUDA_MEMCPY3D_PEER *p), (p), NULL)                      \
    X(SYNC, CUDA, CUresult, cuMemcpy3DPeer_ptds, 7000, 1, (const CUDA_MEMCPY3D_PEER *p), (p), NULL)                 \
    X(SYNC, CUDA, CUresult, cuMemcpy2DUnaligned_v2, 3020, 0, (const CUDA_MEMCPY2D *p), (p), NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpy2DUnaligned_v2_ptds, 7000, 1, (const CUDA_MEMCPY2D *p), (p), NULL)              \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoH_v2, 3020, 0, GEM_COPY_AH_PARAMS, GEM_COPY_AH_ARGS, NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoH_v2_ptds, 7000, 1, GEM_COPY_AH_PARAMS, GEM_COPY_AH_ARGS, NULL)              \
    X(SYNC, CUDA, CUresult, cuMemcpyHtoA_v2, 3020, 0, GEM_COPY_HA_PARAMS, GEM_COPY_HA_ARGS, NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpyHtoA_v2_ptds, 7000, 1, GEM_COPY_HA_PARAMS, GEM_COPY_HA_ARGS, NULL)              \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoD_v2, 3020, 0, GEM_COPY_AD_PARAMS, GEM_COPY_AD_ARGS, NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoD_v2_ptds, 7000, 1, GEM_COPY_AD_PARAMS, GEM_COPY_AD_ARGS, NULL)              \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoA_v2, 3020, 0, GEM_COPY_DA_PARAMS, GEM_COPY_DA_ARGS, NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpyDtoA_v2_ptds, 7000, 1, GEM_COPY_DA_PARAMS, GEM_COPY_DA_ARGS, NULL)              \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoA_v2, 3020, 0, GEM_COPY_AA_PARAMS, GEM_COPY_AA_ARGS, NULL)                   \
    X(SYNC, CUDA, CUresult, cuMemcpyAtoA_v2_ptds, 7000, 1, GEM_COPY_AA_PARAMS, GEM_COPY_AA_ARGS, NULL)              \
    /* ---- stream capture: launches into a capture are recorded, not run -------------------------------- */       \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCapture, 10000, 0, (CUstream hStream), (hStream), hStream)        \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCapture_ptsz, 10000, 1, (CUstream hStream), (hStream), hStream)   \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCapture_v2, 10010, 0,                                             \
      (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode), hStream)                                       \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCapture_v2_ptsz, 10010, 1,                                        \
      (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode), hStream)                                       \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCaptureToGraph, 12030, 0, GEM_CAPTURE_TO_GRAPH_PARAMS,            \
      GEM_CAPTURE_TO_GRAPH_ARGS, hStream)                                                                           \
    X(CAPTURE_BEGIN, CUDA, CUresult, cuStreamBeginCaptureToGraph_ptsz, 12030, 1, GEM_CAPTURE_TO_GRAPH_PARAMS,       \
      GEM_CAPTURE_TO_GRAPH_ARGS, hStream)                                                                           \
    X(CAPTURE_END, CUDA, CUresult, cuStreamEndCapture, 10000, 0, (CUstream hStream, CUgraph *phGraph),              \
      (hStream, phGraph), hStream)                                                                                  \
    X(CAPTURE_END, CUDA, CUresult, cuStreamEndCapture_ptsz, 10000, 1, (CUstream hStream, CUgraph *phGraph),         \
      (hStream, phGraph), hStream)                                                                                  \
    /* ---- memory (memory.c; VMM, cuMemCreate to cuMemUnmap: vmm.c) ------------------------------------ */        \
    X(CUSTOM, CUDA, CUresult, cuMemAlloc_v2, 3020, 0, (CUdeviceptr *dptr, size_t bytesize), _, _)                   \
    X(CUSTOM, CUDA, CUresult, cuMemAllocPitch_v2, 3020, 0, (CUdeviceptr *dptr, size_t *pPitch,                      \
      size_t widthInBytes, size_t height, unsigned int elementSizeBytes), _, _)                                     \
    X(CUSTOM, CUDA, CUresult, cuMemAllocManaged, 6000, 0, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags), \
      _, _)                                                                                                         \
    X(CUSTOM, CUDA, CUresult, cuMemFree_v2, 3020, 0, (CUdeviceptr dptr), _, _)                                      \
    X(ALLOC_ASYNC, CUDA, CUresult, cuMemAllocAsync, 11020, 0, GEM_ALLOC_ASYNC_PARAMS, GEM_ALLOC_ASYNC_ARGS, _)      \
    X(ALLOC_ASYNC, CUDA, CUresult, cuMemAllocAsync_ptsz, 11020, 1, GEM_ALLOC_ASYNC_PARAMS, GEM_ALLOC_ASYNC_ARGS, _) \
    X(ALLOC_FROM_POOL, CUDA, CUresult, cuMemAllocFromPoolAsync, 11020, 0, GEM_ALLOC_POOL_PARAMS,                    \
      GEM_ALLOC_POOL_ARGS, pool)                                                                                    \
    X(ALLOC_FROM_POOL, CUDA, CUresult, cuMemAllocFromPoolAsync_ptsz, 11020, 1, GEM_ALLOC_POOL_PARAMS,               \
      GEM_ALLOC_POOL_ARGS, pool)                                                                                    \
    X(CUSTOM, CUDA, CUresult, cuMemFreeAsync, 11020, 0, (CUdeviceptr dptr, CUstream hStream), _, _)                 \
    X(CUSTOM, CUDA, CUresult, cuMemFreeAsync_ptsz, 11020, 1, (CUdeviceptr dptr, CUstream hStream), _, _)            \
    X(CUSTOM, CUDA, CUresult, cuMemCreate, 10020, 0, (CUmemGenericAllocationHandle *handle, size_t size,            \
      const CUmemAllocationProp *prop, unsigned long long flags), _, _)                                             \
    X(CUSTOM, CUDA, CUresult, cuMemRelease, 10020, 0, (CUmemGenericAllocationHandle handle), _, _)                  \
    X(CUSTOM, CUDA, CUresult, cuMemRetainAllocationHandle, 11000, 0,                                                \
      (CUmemGenericAllocationHandle *handle, void *addr), _, _)                                                     \
    X(CUSTOM, CUDA, CUresult, cuMemMap, 10020, 0, (CUdeviceptr ptr, size_t size, size_t offset,                     \
      CUmemGenericAllocationHandle handle, unsigned long long flags), _, _)                                         \
    X(CUSTOM, CUDA, CUresult, cuMemUnmap, 10020, 0, (CUdeviceptr ptr, size_t size), _, _)                           \
    X(CUSTOM, CUDA, CUresult, cuArrayCreate_v2, 3020, 0, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc),     \
      _, _)                                                                                                         \
    X(CUSTOM, CUDA, CUresult, cuArray3DCreate_v2, 3020, 0,                                                          \
      (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc), _, _)                                                \
    X(CUSTOM, CUDA, CUresult, cuArrayDestroy, 2000, 0, (CUarray hArray), _, _)                                      \
    X(CUSTOM, CUDA, CUresult, cuMipmappedArrayCreate, 5000, 0, (CUmipmappedArray *pHandle,                          \
      const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int numLevels), _, _)                                           \
    X(CUSTOM, CUDA, CUresult, cuMipmappedArrayDestroy, 5000, 0, (CUmipmappedArray hMipmappedArray), _, _)           \
    X(CUSTOM, CUDA, CUresult, cuMemPoolTrimTo, 11020, 0, (CUmemoryPool pool, size_t minBytesToKeep), _, _)          \
    X(CUSTOM, CUDA, CUresult, cuMemPoolDestroy, 11020, 0, (CUmemoryPool pool), _, _)                                \
    X(CUSTOM, CUDA, CUresult, cuMemGetInfo_v2, 3020, 0, (size_t *free, size_t *total), _, _)                        \
    X(CUSTOM, CUDA, CUresult, cuDeviceTotalMem_v2, 3020, 0, (size_t *bytes, CUdevice dev), _, _)                    \
    /* ---- context teardown frees the context's allocations (context.c) ------------------------------- */        \
    X(CUSTOM, CUDA, CUresult, cuCtxDestroy, 2000, 0, (CUcontext ctx), _, _)                                         \
    X(CUSTOM, CUDA, CUresult, cuCtxDestroy_v2, 4000, 0, (CUcontext ctx), _, _)                                      \
    X(CUSTOM, CUDA, CUresult, cuDevicePrimaryCtxReset, 7000, 0, (CUdevice dev), _, _)                               \
    X(CUSTOM, CUDA, CUresult, cuDevicePrimaryCtxReset_v2, 11000, 0, (CUdevice dev), _, _)                           \
    X(CUSTOM, CUDA, CUresult, cuDevicePrimaryCtxRelease, 7000, 0, (CUdevice dev), _, _)                             \
    X(CUSTOM, CUDA, CUresult, cuDevicePrimaryCtxRelease_v2, 11000, 0, (CUdevice dev), _, _)                         \
    /* ---- entry points (symbols.c) -------------------------------------------------------------------- */        \
    X(CUSTOM, CUDA, CUresult, cuGetProcAddress, 11030, 0,                                                           \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags), _, _)                                    \
    X(CUSTOM, CUDA, CUresult, cuGetProcAddress_v2, 12000, 0, (const char *symbol, void **pfn, int cudaVersion,      \
      cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus), _, _)                                        \
    /* ---- the hook's own calls ------------------------------------------------------------------------- */       \
    X(REAL, CUDA, CUresult, cuInit, 2000, 0, (unsigned int flags), _, _)                                            \
    X(REAL, CUDA, CUresult, cuDeviceGetCount, 2000, 0, (int *count), _, _)                                          \
    X(REAL, CUDA, CUresult, cuDeviceGet, 2000, 0, (CUdevice *device, int ordinal), _, _)                            \
    X(REAL, CUDA, CUresult, cuDeviceGetUuid, 9020, 0, (CUuuid *uuid, CUdevice dev), _, _)                           \
    X(REAL, CUDA, CUresult, cuCtxGetCurrent, 4000, 0, (CUcontext *pctx), _, _)                                      \
    X(REAL, CUDA, CUresult, cuDevicePrimaryCtxGetState, 7000, 0, (CUdevice dev, unsigned int *flags, int *active),  \
      _, _)                                                                                                         \
    X(REAL, CUDA, CUresult, cuDevicePrimaryCtxRetain, 7000, 0, (CUcontext *pctx, CUdevice dev), _, _)               \
    X(REAL, CUDA, CUresult, cuCtxGetDevice, 2000, 0, (CUdevice *device), _, _)                                      \
    X(REAL, CUDA, CUresult, cuCtxPushCurrent_v2, 4000, 0, (CUcontext ctx), _, _)                                    \
    X(REAL, CUDA, CUresult, cuCtxPopCurrent_v2, 4000, 0, (CUcontext *pctx), _, _)                                   \
    X(REAL, CUDA, CUresult, cuStreamIsCapturing, 10000, 0, (CUstream hStream, CUstreamCaptureStatus *status),       \
      _, _)                                                                                                         \
    X(REAL, CUDA, CUresult, cuStreamIsCapturing_ptsz, 10000, 1,                                                     \
      (CUstream hStream, CUstreamCaptureStatus *status), _, _)                                                      \
    X(REAL, CUDA, CUresult, cuThreadExchangeStreamCaptureMode, 10010, 0, (CUstreamCaptureMode *mode), _, _)         \
    X(REAL, CUDA, CUresult, cuArrayGetMemoryRequirements, 11060, 0,                                                 \
      (CUDA_ARRAY_MEMORY_REQUIREMENTS *req, CUarray arr, CUdevice dev), _, _)                                       \
    X(REAL, CUDA, CUresult, cuMipmappedArrayGetMemoryRequirements, 11060, 0,                                        \
      (CUDA_ARRAY_MEMORY_REQUIREMENTS *req, CUmipmappedArray arr, CUdevice dev), _, _)                              \
    X(REAL, CUDA, CUresult, cuEventCreate, 2000, 0, (CUevent *phEvent, unsigned int flags), _, _)                   \
    X(REAL, CUDA, CUresult, cuEventRecord, 2000, 0, (CUevent hEvent, CUstream hStream), _, _)                       \
    X(REAL, CUDA, CUresult, cuEventQuery, 2000, 0, (CUevent hEvent), _, _)                                          \
    X(REAL, CUDA, CUresult, cuEventElapsedTime, 2000, 0, (float *pMilliseconds, CUevent hStart, CUevent hEnd),      \
      _, _)                                                                                                         \
    X(REAL, CUDA, CUresult, cuEventDestroy_v2, 4000, 0, (CUevent hEvent), _, _)                                     \
    X(REAL, CUDA, CUresult, cuMemPoolGetAttribute, 11020, 0,                                                        \
      (CUmemoryPool pool, CUmemPool_attribute attr, void *value), _, _)                                             \
    X(REAL, CUDA, CUresult, cuDeviceGetMemPool, 11020, 0, (CUmemoryPool *pool, CUdevice dev), _, _)                 \
    /* unified groups (residency.c): the two ABIs of cuMemPrefetchAsync, chosen by what the driver answers */      \
    X(REAL, CUDA, CUresult, cuMemPrefetchAsync, 8000, 0,                                                            \
      (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream), _, _)                               \
    X(REAL, CUDA, CUresult, cuMemPrefetchAsync_v2, 12020, 0, (CUdeviceptr devPtr, size_t count,                     \
      CUmemLocation location, unsigned int flags, CUstream hStream), _, _)                                          \
    X(REAL, CUDA, CUresult, cuDriverGetVersion, 2020, 0, (int *driverVersion), _, _)                                \
    X(REAL, CUDA, CUresult, cuDeviceGetAttribute, 2000, 0, (int *pi, int attrib, CUdevice dev), _, _)               \
    X(REAL, CUDA, CUresult, cuStreamCreate, 2000, 0, (CUstream *phStream, unsigned int flags), _, _)                \
    /* ---- the GPU-side gate (gpugate.c): a pinned word the batch streams wait on during a claim --------- */   \
    X(REAL, CUDA, CUresult, cuMemHostRegister_v2, 6050, 0, (void *p, size_t bytesize, unsigned int flags), _, _)    \
    X(REAL, CUDA, CUresult, cuMemHostGetDevicePointer_v2, 3020, 0,                                                  \
      (CUdeviceptr *pdptr, void *p, unsigned int flags), _, _)                                                      \
    X(REAL, CUDA, CUresult, cuStreamWaitValue32_v2, 11070, 0,                                                       \
      (CUstream stream, CUdeviceptr addr, uint32_t value, unsigned int flags), _, _)                                \
    /* ---- NVML: what nvidia-smi and pynvml report inside a group (nvml.c) ------------------------------ */       \
    X(CUSTOM, NVML, int, nvmlDeviceGetMemoryInfo, 0, 0,                                                             \
      (struct nvmlDevice_st *device, struct gem_nvml_memory *memory), _, _)                                         \
    X(CUSTOM, NVML, int, nvmlDeviceGetMemoryInfo_v2, 0, 0,                                                          \
      (struct nvmlDevice_st *device, struct gem_nvml_memory_v2 *memory), _, _)                                      \
    X(REAL, NVML, int, nvmlDeviceGetUUID, 0, 0, (struct nvmlDevice_st *device, char *uuid, unsigned int length),    \
      _, _)

#endif /* GEMINI_HOOK_TABLE_H */
