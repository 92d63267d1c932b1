/*
 * sim_api.h -- the driver entry points that the simulated libcuda.so.1 exports.
 *
 * Signatures follow cuda.h (CUDA 12.x/13.x, 64-bit Linux). Types not in
 * hook/cuda_types.h are declared here with the same layout as cuda.h; opaque
 * parameters the simulator never reads are passed as void *.
 */
#ifndef SIMCUDA_API_H
#define SIMCUDA_API_H

#include "cuda_types.h"

#define SIM_API __attribute__((visibility("default")))

/* Result codes from cuda.h that cuda_types.h does not declare. */
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE 720
#define CUDA_ERROR_STREAM_CAPTURE_UNMATCHED 903
#define CUDA_ERROR_STREAM_CAPTURE_UNJOINED 904
#define CUDA_ERROR_CAPTURED_EVENT 907
#define CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD 908

/* Types from cuda.h that cuda_types.h does not declare. */
typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags: 0 none, 1 read, 3 read-write */
} CUmemAccessDesc;

/* CUmemPoolProps of cuda.h (88 bytes); the simulator reads allocType and location. */
struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
};

typedef void (*CUhostFn)(void *userData);
typedef int CUdevice_attribute;
typedef int CUfunction_attribute;
typedef int CUpointer_attribute;
typedef int CUjit_option;
typedef int CUlibraryOption;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;

#define SIM_DECL(name, params) SIM_API CUresult name params;

/* init, version, devices, errors */
SIM_DECL(cuInit, (unsigned int flags))
SIM_DECL(cuDriverGetVersion, (int *driverVersion))
SIM_DECL(cuGetErrorName, (CUresult error, const char **pStr))
SIM_DECL(cuGetErrorString, (CUresult error, const char **pStr))
SIM_DECL(cuDeviceGet, (CUdevice *device, int ordinal))
SIM_DECL(cuDeviceGetCount, (int *count))
SIM_DECL(cuDeviceGetName, (char *name, int len, CUdevice dev))
SIM_DECL(cuDeviceGetUuid, (CUuuid *uuid, CUdevice dev))
SIM_DECL(cuDeviceGetUuid_v2, (CUuuid *uuid, CUdevice dev))
SIM_DECL(cuDeviceTotalMem_v2, (size_t *bytes, CUdevice dev))
SIM_DECL(cuDeviceGetAttribute, (int *pi, CUdevice_attribute attrib, CUdevice dev))
SIM_DECL(cuDeviceComputeCapability, (int *major, int *minor, CUdevice dev))
SIM_DECL(cuDeviceGetDefaultMemPool, (CUmemoryPool *pool, CUdevice dev))
SIM_DECL(cuDeviceGetMemPool, (CUmemoryPool *pool, CUdevice dev))
SIM_DECL(cuDeviceSetMemPool, (CUdevice dev, CUmemoryPool pool))

/* contexts */
SIM_DECL(cuCtxCreate_v2, (CUcontext *pctx, unsigned int flags, CUdevice dev))
SIM_DECL(cuCtxCreate_v3, (CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev))
SIM_DECL(cuCtxCreate_v4, (CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev))
SIM_DECL(cuCtxDestroy_v2, (CUcontext ctx))
SIM_DECL(cuCtxGetCurrent, (CUcontext *pctx))
SIM_DECL(cuCtxSetCurrent, (CUcontext ctx))
SIM_DECL(cuCtxPushCurrent_v2, (CUcontext ctx))
SIM_DECL(cuCtxPopCurrent_v2, (CUcontext *pctx))
SIM_DECL(cuCtxGetDevice, (CUdevice *device))
SIM_DECL(cuCtxGetFlags, (unsigned int *flags))
SIM_DECL(cuCtxGetApiVersion, (CUcontext ctx, unsigned int *version))
SIM_DECL(cuCtxGetStreamPriorityRange, (int *leastPriority, int *greatestPriority))
SIM_DECL(cuCtxSynchronize, (void))
SIM_DECL(cuCtxSynchronize_v2, (CUcontext ctx))
SIM_DECL(cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev))
SIM_DECL(cuDevicePrimaryCtxRelease, (CUdevice dev))
SIM_DECL(cuDevicePrimaryCtxRelease_v2, (CUdevice dev))
SIM_DECL(cuDevicePrimaryCtxReset, (CUdevice dev))
SIM_DECL(cuDevicePrimaryCtxReset_v2, (CUdevice dev))
SIM_DECL(cuDevicePrimaryCtxGetState, (CUdevice dev, unsigned int *flags, int *active))
SIM_DECL(cuDevicePrimaryCtxSetFlags, (CUdevice dev, unsigned int flags))
SIM_DECL(cuDevicePrimaryCtxSetFlags_v2, (CUdevice dev, unsigned int flags))

/* memory */
SIM_DECL(cuMemAlloc_v2, (CUdeviceptr *dptr, size_t bytesize))
SIM_DECL(cuMemAllocPitch_v2, (CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                              unsigned int ElementSizeBytes))
SIM_DECL(cuMemAllocManaged, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags))
SIM_DECL(cuMemFree_v2, (CUdeviceptr dptr))
SIM_DECL(cuMemGetInfo_v2, (size_t *free, size_t *total))
SIM_DECL(cuMemGetAddressRange_v2, (CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr))
SIM_DECL(cuMemAllocHost_v2, (void **pp, size_t bytesize))
SIM_DECL(cuMemHostAlloc, (void **pp, size_t bytesize, unsigned int Flags))
SIM_DECL(cuMemFreeHost, (void *p))
SIM_DECL(cuMemHostRegister_v2, (void *p, size_t bytesize, unsigned int Flags))
SIM_DECL(cuMemHostGetDevicePointer_v2, (CUdeviceptr *pdptr, void *p, unsigned int Flags))
SIM_DECL(cuStreamWaitValue32_v2, (CUstream stream, CUdeviceptr addr, uint32_t value, unsigned int flags))
SIM_DECL(cuStreamWaitValue32_v2_ptsz, (CUstream stream, CUdeviceptr addr, uint32_t value, unsigned int flags))
SIM_DECL(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))
SIM_DECL(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))
SIM_DECL(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream))
SIM_DECL(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream))
SIM_DECL(cuMemFreeAsync, (CUdeviceptr dptr, CUstream hStream))
SIM_DECL(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream hStream))
SIM_DECL(cuMemPoolCreate, (CUmemoryPool *pool, const CUmemPoolProps *poolProps))
SIM_DECL(cuMemPoolDestroy, (CUmemoryPool pool))
SIM_DECL(cuMemPoolTrimTo, (CUmemoryPool pool, size_t minBytesToKeep))
SIM_DECL(cuMemPoolSetAttribute, (CUmemoryPool pool, CUmemPool_attribute attr, void *value))
SIM_DECL(cuMemPoolGetAttribute, (CUmemoryPool pool, CUmemPool_attribute attr, void *value))
SIM_DECL(cuMemCreate, (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                       unsigned long long flags))
SIM_DECL(cuMemRelease, (CUmemGenericAllocationHandle handle))
SIM_DECL(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *handle, void *addr))
SIM_DECL(cuMemAddressReserve, (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                               unsigned long long flags))
SIM_DECL(cuMemAddressFree, (CUdeviceptr ptr, size_t size))
SIM_DECL(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                    unsigned long long flags))
SIM_DECL(cuMemUnmap, (CUdeviceptr ptr, size_t size))
SIM_DECL(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))
SIM_DECL(cuMemGetAllocationGranularity, (size_t *granularity, const CUmemAllocationProp *prop,
                                         CUmemAllocationGranularity_flags option))
SIM_DECL(cuArrayCreate_v2, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray))
SIM_DECL(cuArray3DCreate_v2, (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray))
SIM_DECL(cuArrayDestroy, (CUarray hArray))
SIM_DECL(cuArrayGetMemoryRequirements, (CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements, CUarray array,
                                        CUdevice device))
SIM_DECL(cuMipmappedArrayCreate, (CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                  unsigned int numMipmapLevels))
SIM_DECL(cuMipmappedArrayDestroy, (CUmipmappedArray hMipmappedArray))
SIM_DECL(cuMipmappedArrayGetMemoryRequirements, (CUDA_ARRAY_MEMORY_REQUIREMENTS *memoryRequirements,
                                                 CUmipmappedArray mipmap, CUdevice device))
SIM_DECL(cuMemPrefetchAsync, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream))
SIM_DECL(cuMemPrefetchAsync_ptsz, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream))
SIM_DECL(cuMemPrefetchAsync_v2, (CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                 CUstream hStream))
SIM_DECL(cuMemPrefetchAsync_v2_ptsz, (CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                      CUstream hStream))
SIM_DECL(cuPointerGetAttribute, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr))

/* copies and sets */
SIM_DECL(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount))
SIM_DECL(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount))
SIM_DECL(cuMemcpyHtoD_v2, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount))
SIM_DECL(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount))
SIM_DECL(cuMemcpyDtoH_v2, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount))
SIM_DECL(cuMemcpyDtoH_v2_ptds, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount))
SIM_DECL(cuMemcpyDtoD_v2, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount))
SIM_DECL(cuMemcpyDtoD_v2_ptds, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount))
SIM_DECL(cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream))
SIM_DECL(cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream))
SIM_DECL(cuMemcpyHtoDAsync_v2, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream))
SIM_DECL(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                     CUstream hStream))
SIM_DECL(cuMemcpyDtoHAsync_v2, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream))
SIM_DECL(cuMemcpyDtoHAsync_v2_ptsz, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream))
SIM_DECL(cuMemcpyDtoDAsync_v2, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                CUstream hStream))
SIM_DECL(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                     CUstream hStream))
SIM_DECL(cuMemsetD8_v2, (CUdeviceptr dstDevice, unsigned char uc, size_t N))
SIM_DECL(cuMemsetD8_v2_ptds, (CUdeviceptr dstDevice, unsigned char uc, size_t N))
SIM_DECL(cuMemsetD32_v2, (CUdeviceptr dstDevice, unsigned int ui, size_t N))
SIM_DECL(cuMemsetD32_v2_ptds, (CUdeviceptr dstDevice, unsigned int ui, size_t N))
SIM_DECL(cuMemsetD8Async, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream))
SIM_DECL(cuMemsetD8Async_ptsz, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream))
SIM_DECL(cuMemsetD32Async, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream))
SIM_DECL(cuMemsetD32Async_ptsz, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream))

/* modules, libraries, functions */
SIM_DECL(cuModuleLoadData, (CUmodule *module, const void *image))
SIM_DECL(cuModuleLoadDataEx, (CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                              void **optionValues))
SIM_DECL(cuModuleGetFunction, (CUfunction *hfunc, CUmodule hmod, const char *name))
SIM_DECL(cuModuleUnload, (CUmodule hmod))
SIM_DECL(cuLibraryLoadData, (CUlibrary *library, const void *code, CUjit_option *jitOptions,
                             void **jitOptionsValues, unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                             void **libraryOptionValues, unsigned int numLibraryOptions))
SIM_DECL(cuLibraryGetKernel, (CUkernel *pKernel, CUlibrary library, const char *name))
SIM_DECL(cuKernelGetFunction, (CUfunction *pFunc, CUkernel kernel))
SIM_DECL(cuLibraryUnload, (CUlibrary library))
SIM_DECL(cuFuncGetAttribute, (int *pi, CUfunction_attribute attrib, CUfunction hfunc))

/* launches */
#define SIM_LAUNCH_PARAMS                                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,            \
     void **kernelParams, void **extra)
#define SIM_COOP_PARAMS                                                                                      \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,            \
     void **kernelParams)
SIM_DECL(cuLaunchKernel, SIM_LAUNCH_PARAMS)
SIM_DECL(cuLaunchKernel_ptsz, SIM_LAUNCH_PARAMS)
SIM_DECL(cuLaunchKernelEx, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra))
SIM_DECL(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra))
SIM_DECL(cuLaunchCooperativeKernel, SIM_COOP_PARAMS)
SIM_DECL(cuLaunchCooperativeKernel_ptsz, SIM_COOP_PARAMS)
SIM_DECL(cuLaunchHostFunc, (CUstream hStream, CUhostFn fn, void *userData))
SIM_DECL(cuLaunchHostFunc_ptsz, (CUstream hStream, CUhostFn fn, void *userData))

/* streams */
SIM_DECL(cuStreamCreate, (CUstream *phStream, unsigned int Flags))
SIM_DECL(cuStreamCreateWithPriority, (CUstream *phStream, unsigned int flags, int priority))
SIM_DECL(cuStreamDestroy_v2, (CUstream hStream))
SIM_DECL(cuStreamGetCtx, (CUstream hStream, CUcontext *pctx))
SIM_DECL(cuStreamGetCtx_ptsz, (CUstream hStream, CUcontext *pctx))
SIM_DECL(cuStreamSynchronize, (CUstream hStream))
SIM_DECL(cuStreamSynchronize_ptsz, (CUstream hStream))
SIM_DECL(cuStreamQuery, (CUstream hStream))
SIM_DECL(cuStreamQuery_ptsz, (CUstream hStream))
SIM_DECL(cuStreamWaitEvent, (CUstream hStream, CUevent hEvent, unsigned int Flags))
SIM_DECL(cuStreamWaitEvent_ptsz, (CUstream hStream, CUevent hEvent, unsigned int Flags))

/* events */
SIM_DECL(cuEventCreate, (CUevent *phEvent, unsigned int Flags))
SIM_DECL(cuEventDestroy_v2, (CUevent hEvent))
SIM_DECL(cuEventRecord, (CUevent hEvent, CUstream hStream))
SIM_DECL(cuEventRecord_ptsz, (CUevent hEvent, CUstream hStream))
SIM_DECL(cuEventRecordWithFlags, (CUevent hEvent, CUstream hStream, unsigned int flags))
SIM_DECL(cuEventRecordWithFlags_ptsz, (CUevent hEvent, CUstream hStream, unsigned int flags))
SIM_DECL(cuEventSynchronize, (CUevent hEvent))
SIM_DECL(cuEventQuery, (CUevent hEvent))
SIM_DECL(cuEventElapsedTime, (float *pMilliseconds, CUevent hStart, CUevent hEnd))
SIM_DECL(cuEventElapsedTime_v2, (float *pMilliseconds, CUevent hStart, CUevent hEnd))

/* capture and graphs */
SIM_DECL(cuStreamBeginCapture, (CUstream hStream))
SIM_DECL(cuStreamBeginCapture_ptsz, (CUstream hStream))
SIM_DECL(cuStreamBeginCapture_v2, (CUstream hStream, CUstreamCaptureMode mode))
SIM_DECL(cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode))
SIM_DECL(cuStreamEndCapture, (CUstream hStream, CUgraph *phGraph))
SIM_DECL(cuStreamEndCapture_ptsz, (CUstream hStream, CUgraph *phGraph))
SIM_DECL(cuStreamIsCapturing, (CUstream hStream, CUstreamCaptureStatus *captureStatus))
SIM_DECL(cuStreamIsCapturing_ptsz, (CUstream hStream, CUstreamCaptureStatus *captureStatus))
SIM_DECL(cuStreamGetCaptureInfo, (CUstream hStream, CUstreamCaptureStatus *captureStatus_out, cuuint64_t *id_out))
SIM_DECL(cuStreamGetCaptureInfo_ptsz, (CUstream hStream, CUstreamCaptureStatus *captureStatus_out,
                                       cuuint64_t *id_out))
#define SIM_CAPINFO2_PARAMS                                                                                  \
    (CUstream hStream, CUstreamCaptureStatus *captureStatus_out, cuuint64_t *id_out, CUgraph *graph_out,      \
     const CUgraphNode **dependencies_out, size_t *numDependencies_out)
#define SIM_CAPINFO3_PARAMS                                                                                  \
    (CUstream hStream, CUstreamCaptureStatus *captureStatus_out, cuuint64_t *id_out, CUgraph *graph_out,      \
     const CUgraphNode **dependencies_out, const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out)
SIM_DECL(cuStreamGetCaptureInfo_v2, SIM_CAPINFO2_PARAMS)
SIM_DECL(cuStreamGetCaptureInfo_v2_ptsz, SIM_CAPINFO2_PARAMS)
SIM_DECL(cuStreamGetCaptureInfo_v3, SIM_CAPINFO3_PARAMS)
SIM_DECL(cuStreamGetCaptureInfo_v3_ptsz, SIM_CAPINFO3_PARAMS)
SIM_DECL(cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode *mode))
SIM_DECL(cuGraphCreate, (CUgraph *phGraph, unsigned int flags))
SIM_DECL(cuGraphInstantiate, (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                              size_t bufferSize))
SIM_DECL(cuGraphInstantiate_v2, (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                 char *logBuffer, size_t bufferSize))
SIM_DECL(cuGraphInstantiateWithFlags, (CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags))
SIM_DECL(cuGraphExecDestroy, (CUgraphExec hGraphExec))
SIM_DECL(cuGraphDestroy, (CUgraph hGraph))
SIM_DECL(cuGraphLaunch, (CUgraphExec hGraphExec, CUstream hStream))
SIM_DECL(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream))

/* entry points */
SIM_DECL(cuGetProcAddress, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags))
SIM_DECL(cuGetProcAddress_v2, (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                               CUdriverProcAddressQueryResult *symbolStatus))

/* Simulator-only exports (never in a real driver). */
SIM_API int simcuda_is_simulated(void);
/* Bytes of the managed allocation holding ptr that are on the device now (0 if none or not managed). */
SIM_API uint64_t simcuda_resident_bytes(CUdeviceptr ptr);
/* Events of this process created with these flags (CU_EVENT_* bits, compared whole) and not destroyed (the
 * simulator keeps a destroyed context's events counted: they were never given back). */
SIM_API int simcuda_live_events(unsigned int flags);
/* cuEventElapsedTime calls this process made (either ABI, whatever they returned). */
SIM_API unsigned long long simcuda_elapsed_calls(void);
SIM_API int simcuda_procaddr_entry(int index, const char **base, int *version, const char **sym, int *pt_version,
                                   const char **pt_sym);

/* Internal, hidden: implemented in simcuda.c, used by sim_procaddr.c. */
int sim_initialized(void);
int sim_driver_version(void);

#endif /* SIMCUDA_API_H */
