/*
 * hook_table.h -- the one table of driver functions libgemhook touches.
 *
 * Each row names a function once; the including file defines the macros it
 * needs and the table expands into the real-pointer slots, the typedefs, the
 * name list that dlsym/cuGetProcAddress route by, and (for the uniform kinds)
 * the wrappers themselves. Rows:
 *
 *   GEM_LAUNCH(name, params, args, stream)  gated launch; `stream` is the
 *                                           expression giving its stream
 *   GEM_SYNC(name, params, args)            synchronising call: ends a burst
 *   GEM_CAPTURE(name, params, args, stream, begins)
 *                                           stream-capture begin (begins=1)
 *                                           or end (begins=0)
 *   GEM_CUSTOM(name, params)                wrapper written by hand (memory.c,
 *                                           symbols.c)
 *   GEM_REAL(name, params)                  not intercepted: resolved only
 *                                           for the hook's own calls (nvml*
 *                                           names from libnvidia-ml.so.1)
 *   GEM_NVML(name, params)                  NVML function written by hand
 *                                           (memory.c); its real pointer comes
 *                                           from libnvidia-ml.so.1
 *
 * A variant missing from the installed driver resolves to NULL; it is then
 * never handed out, because dlsym and cuGetProcAddress only return a wrapper
 * when the driver has the real function.
 */

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

#define GEM_HOOK_TABLE(GEM_LAUNCH, GEM_SYNC, GEM_CAPTURE, GEM_CUSTOM, GEM_REAL, GEM_NVML)                           \
    /* ---- gated launches ------------------------------------------------------------------ */       \
    GEM_LAUNCH(cuLaunchKernel, GEM_LAUNCH_PARAMS, GEM_LAUNCH_ARGS, hStream)                               \
    GEM_LAUNCH(cuLaunchKernel_ptsz, GEM_LAUNCH_PARAMS, GEM_LAUNCH_ARGS, hStream)                          \
    GEM_LAUNCH(cuLaunchKernelEx, GEM_LAUNCH_EX_PARAMS, GEM_LAUNCH_EX_ARGS, GEM_LAUNCH_EX_STREAM)         \
    GEM_LAUNCH(cuLaunchKernelEx_ptsz, GEM_LAUNCH_EX_PARAMS, GEM_LAUNCH_EX_ARGS, GEM_LAUNCH_EX_STREAM)    \
    GEM_LAUNCH(cuLaunchCooperativeKernel, GEM_COOP_PARAMS, GEM_COOP_ARGS, hStream)                        \
    GEM_LAUNCH(cuLaunchCooperativeKernel_ptsz, GEM_COOP_PARAMS, GEM_COOP_ARGS, hStream)                   \
    GEM_LAUNCH(cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream), hStream) \
    GEM_LAUNCH(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream),     \
               hStream)                                                                                   \
    /* ---- synchronising calls: the end of a kernel burst ---------------------------------- */       \
    GEM_SYNC(cuCtxSynchronize, (void), ())                                                                \
    GEM_SYNC(cuStreamSynchronize, (CUstream hStream), (hStream))                                          \
    GEM_SYNC(cuStreamSynchronize_ptsz, (CUstream hStream), (hStream))                                     \
    GEM_SYNC(cuEventSynchronize, (CUevent hEvent), (hEvent))                                              \
    GEM_SYNC(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))                       \
    GEM_SYNC(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))                  \
    GEM_SYNC(cuMemcpyHtoD_v2, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n))                \
    GEM_SYNC(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dst, const void *src, size_t n), (dst, src, n))           \
    GEM_SYNC(cuMemcpyDtoH_v2, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))                      \
    GEM_SYNC(cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n), (dst, src, n))                 \
    GEM_SYNC(cuMemcpyDtoD_v2, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))                \
    GEM_SYNC(cuMemcpyDtoD_v2_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))           \
    GEM_SYNC(cuMemcpy2D_v2, (const CUDA_MEMCPY2D *p), (p))                                      \
    GEM_SYNC(cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *p), (p))                                 \
    GEM_SYNC(cuMemcpy3D_v2, (const CUDA_MEMCPY3D *p), (p))                                      \
    GEM_SYNC(cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *p), (p))                                 \
    GEM_SYNC(cuMemcpyPeer, (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx,         \
                            size_t n), (dst, dstCtx, src, srcCtx, n))                                     \
    GEM_SYNC(cuMemcpyPeer_ptds, (CUdeviceptr dst, CUcontext dstCtx, CUdeviceptr src, CUcontext srcCtx,    \
                                 size_t n), (dst, dstCtx, src, srcCtx, n))                                \
    /* ---- stream capture: launches into a capture are recorded, not run -------------------- */      \
    GEM_CAPTURE(cuStreamBeginCapture, (CUstream hStream), (hStream), hStream, 1)                          \
    GEM_CAPTURE(cuStreamBeginCapture_ptsz, (CUstream hStream), (hStream), hStream, 1)                     \
    GEM_CAPTURE(cuStreamBeginCapture_v2, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode),   \
                hStream, 1)                                                                               \
    GEM_CAPTURE(cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode),               \
                (hStream, mode), hStream, 1)                                                              \
    GEM_CAPTURE(cuStreamBeginCaptureToGraph, (CUstream hStream, CUgraph hGraph,                           \
                const CUgraphNode *deps, const void *depData, size_t numDeps, CUstreamCaptureMode mode),  \
                (hStream, hGraph, deps, depData, numDeps, mode), hStream, 1)                              \
    GEM_CAPTURE(cuStreamBeginCaptureToGraph_ptsz, (CUstream hStream, CUgraph hGraph,                      \
                const CUgraphNode *deps, const void *depData, size_t numDeps, CUstreamCaptureMode mode),  \
                (hStream, hGraph, deps, depData, numDeps, mode), hStream, 1)                              \
    GEM_CAPTURE(cuStreamEndCapture, (CUstream hStream, CUgraph *phGraph), (hStream, phGraph), hStream, 0) \
    GEM_CAPTURE(cuStreamEndCapture_ptsz, (CUstream hStream, CUgraph *phGraph), (hStream, phGraph),        \
                hStream, 0)                                                                               \
    /* ---- memory (memory.c) ---------------------------------------------------------------- */      \
    GEM_CUSTOM(cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytesize))                                       \
    GEM_CUSTOM(cuMemAllocPitch_v2, (CUdeviceptr *dptr, size_t *pPitch, size_t widthInBytes,               \
                                    size_t height, unsigned int elementSizeBytes))                        \
    GEM_CUSTOM(cuMemAllocManaged, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags))               \
    GEM_CUSTOM(cuMemFree_v2, (CUdeviceptr dptr))                                                          \
    GEM_CUSTOM(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))                   \
    GEM_CUSTOM(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))              \
    GEM_CUSTOM(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,           \
                                         CUstream hStream))                                               \
    GEM_CUSTOM(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,      \
                                              CUstream hStream))                                          \
    GEM_CUSTOM(cuMemFreeAsync, (CUdeviceptr dptr, CUstream hStream))                                      \
    GEM_CUSTOM(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream hStream))                                 \
    GEM_CUSTOM(cuMemCreate, (CUmemGenericAllocationHandle *handle, size_t size,                           \
                             const CUmemAllocationProp *prop, unsigned long long flags))                  \
    GEM_CUSTOM(cuMemRelease, (CUmemGenericAllocationHandle handle))                                       \
    GEM_CUSTOM(cuArrayCreate_v2, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc))                   \
    GEM_CUSTOM(cuArray3DCreate_v2, (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc))               \
    GEM_CUSTOM(cuArrayDestroy, (CUarray hArray))                                                          \
    GEM_CUSTOM(cuMipmappedArrayCreate, (CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,   \
                                        unsigned int numLevels))                                          \
    GEM_CUSTOM(cuMipmappedArrayDestroy, (CUmipmappedArray hMipmappedArray))                               \
    GEM_CUSTOM(cuMemPoolTrimTo, (CUmemoryPool pool, size_t minBytesToKeep))                               \
    GEM_CUSTOM(cuMemPoolDestroy, (CUmemoryPool pool))                                                     \
    GEM_CUSTOM(cuMemGetInfo_v2, (size_t *free, size_t *total))                                            \
    GEM_CUSTOM(cuDeviceTotalMem_v2, (size_t *bytes, CUdevice dev))                                        \
    /* ---- entry points (symbols.c) --------------------------------------------------------- */      \
    GEM_CUSTOM(cuGetProcAddress, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags))     \
    GEM_CUSTOM(cuGetProcAddress_v2, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,   \
                                     CUdriverProcAddressQueryResult *symbolStatus))                       \
    /* ---- the hook's own calls -------------------------------------------------------------- */     \
    GEM_REAL(cuInit, (unsigned int flags))                                                                \
    GEM_REAL(cuDeviceGetCount, (int *count))                                                              \
    GEM_REAL(cuDeviceGet, (CUdevice *device, int ordinal))                                                \
    GEM_REAL(cuDeviceGetUuid, (CUuuid *uuid, CUdevice dev))                                               \
    GEM_REAL(cuCtxGetCurrent, (CUcontext *pctx))                                                          \
    GEM_REAL(cuCtxGetDevice, (CUdevice *device))                                                          \
    GEM_REAL(cuCtxPushCurrent_v2, (CUcontext ctx))                                                        \
    GEM_REAL(cuCtxPopCurrent_v2, (CUcontext *pctx))                                                       \
    GEM_REAL(cuStreamIsCapturing, (CUstream hStream, CUstreamCaptureStatus *status))                      \
    GEM_REAL(cuStreamIsCapturing_ptsz, (CUstream hStream, CUstreamCaptureStatus *status))                 \
    GEM_REAL(cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode *mode))                              \
    GEM_REAL(cuArrayGetMemoryRequirements, (CUDA_ARRAY_MEMORY_REQUIREMENTS *req, CUarray arr,             \
                                            CUdevice dev))                                                \
    GEM_REAL(cuMipmappedArrayGetMemoryRequirements, (CUDA_ARRAY_MEMORY_REQUIREMENTS *req,                \
                                                     CUmipmappedArray arr, CUdevice dev))                 \
    GEM_REAL(cuEventCreate, (CUevent *phEvent, unsigned int flags))                                       \
    GEM_REAL(cuEventRecord, (CUevent hEvent, CUstream hStream))                                           \
    GEM_REAL(cuEventElapsedTime, (float *pMilliseconds, CUevent hStart, CUevent hEnd))                    \
    GEM_REAL(cuMemPoolGetAttribute, (CUmemoryPool pool, CUmemPool_attribute attr, void *value))           \
    GEM_REAL(cuDeviceGetMemPool, (CUmemoryPool *pool, CUdevice dev))                                      \
    /* ---- NVML: what nvidia-smi and pynvml report inside a group (memory.c) ------------------ */     \
    GEM_NVML(nvmlDeviceGetMemoryInfo, (struct nvmlDevice_st *device, struct gem_nvml_memory *memory))     \
    GEM_NVML(nvmlDeviceGetMemoryInfo_v2, (struct nvmlDevice_st *device, struct gem_nvml_memory_v2 *memory)) \
    GEM_REAL(nvmlDeviceGetUUID, (struct nvmlDevice_st *device, char *uuid, unsigned int length))
