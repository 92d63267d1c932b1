/*
 * cuGetProcAddress of the simulated driver, driven by one table.
 *
 * Each row is one versioned variant of a base name: the CUDA version that
 * introduced it and the exported function, plus (for stream-ordered calls)
 * the per-thread-default-stream variant (_ptsz/_ptds) and the version that
 * introduced that. A lookup takes the newest row whose version is <= the
 * caller's cudaVersion, and its per-thread variant when the caller asked for
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM and one exists (if that
 * variant is newer than cudaVersion: VERSION_NOT_SUFFICIENT, no fallback).
 * Checked against the real CUDA 13.0 driver (580.x). Unlike it, the
 * pre-_v2 ABIs (cuMemAlloc before 3020 ...) are not provided: such versions
 * get VERSION_NOT_SUFFICIENT. Pointers are
 * the library's own definitions (built with -Bsymbolic-functions), so they
 * equal dlsym(handle, "<exact name>") even when a preloaded library exports
 * the same names -- unless SIMCUDA_PROCADDR_ALIAS=1: then the variants that
 * have an alias below are answered with it, a function that does the same
 * but is no exported symbol (as a driver may hand out an internal entry).
 */
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"

struct pa_row {
    const char *base;
    int version;
    void *fn;
    const char *sym;
    int pt_version;
    void *pt_fn;
    const char *pt_sym;
};

/* R: a row with no per-thread variant; T: a row with one. */
#define R(base, ver, sym) {base, ver, (void *)sym, #sym, 0, NULL, NULL},
#define T(base, ver, sym, ptver, ptsym) {base, ver, (void *)sym, #sym, ptver, (void *)ptsym, #ptsym},

static const struct pa_row rows[] = {
    /* init, version, devices, errors */
    R("cuGetErrorString", 6000, cuGetErrorString)
    R("cuGetErrorName", 6000, cuGetErrorName)
    R("cuInit", 2000, cuInit)
    R("cuDriverGetVersion", 2020, cuDriverGetVersion)
    R("cuDeviceGet", 2000, cuDeviceGet)
    R("cuDeviceGetCount", 2000, cuDeviceGetCount)
    R("cuDeviceGetName", 2000, cuDeviceGetName)
    R("cuDeviceGetUuid", 9020, cuDeviceGetUuid)
    R("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2)
    R("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2)
    R("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute)
    R("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability)
    R("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool)
    R("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool)
    R("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool)
    /* contexts */
    R("cuCtxCreate", 3020, cuCtxCreate_v2)
    R("cuCtxCreate", 11040, cuCtxCreate_v3)
    R("cuCtxCreate", 12050, cuCtxCreate_v4)
    R("cuCtxDestroy", 4000, cuCtxDestroy_v2)
    R("cuCtxGetCurrent", 4000, cuCtxGetCurrent)
    R("cuCtxSetCurrent", 4000, cuCtxSetCurrent)
    R("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2)
    R("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2)
    R("cuCtxGetDevice", 2000, cuCtxGetDevice)
    R("cuCtxGetFlags", 7000, cuCtxGetFlags)
    R("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion)
    R("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange)
    R("cuCtxSynchronize", 2000, cuCtxSynchronize)
    R("cuCtxSynchronize", 13000, cuCtxSynchronize_v2)
    R("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain)
    R("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease)
    R("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2)
    R("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset)
    R("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2)
    R("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState)
    R("cuDevicePrimaryCtxSetFlags", 7000, cuDevicePrimaryCtxSetFlags)
    R("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2)
    /* memory */
    R("cuMemAlloc", 3020, cuMemAlloc_v2)
    R("cuMemAllocPitch", 3020, cuMemAllocPitch_v2)
    R("cuMemAllocManaged", 6000, cuMemAllocManaged)
    /* driver 580 answers "cuMemPrefetchAsync" with the old ABI up to 12000 and with _v2 from 12080 */
    T("cuMemPrefetchAsync", 8000, cuMemPrefetchAsync, 8000, cuMemPrefetchAsync_ptsz)
    T("cuMemPrefetchAsync", 12020, cuMemPrefetchAsync_v2, 12020, cuMemPrefetchAsync_v2_ptsz)
    R("cuMemFree", 3020, cuMemFree_v2)
    R("cuMemGetInfo", 3020, cuMemGetInfo_v2)
    R("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2)
    R("cuMemAllocHost", 3020, cuMemAllocHost_v2)
    R("cuMemHostAlloc", 2020, cuMemHostAlloc)
    R("cuMemFreeHost", 2000, cuMemFreeHost)
    R("cuMemHostRegister", 6050, cuMemHostRegister_v2)
    R("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2)
    T("cuStreamWaitValue32", 11070, cuStreamWaitValue32_v2, 11070, cuStreamWaitValue32_v2_ptsz)
    T("cuMemAllocAsync", 11020, cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz)
    T("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz)
    T("cuMemFreeAsync", 11020, cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz)
    R("cuMemPoolCreate", 11020, cuMemPoolCreate)
    R("cuMemPoolDestroy", 11020, cuMemPoolDestroy)
    R("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo)
    R("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute)
    R("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute)
    R("cuMemCreate", 10020, cuMemCreate)
    R("cuMemRelease", 10020, cuMemRelease)
    R("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle)
    R("cuMemAddressReserve", 10020, cuMemAddressReserve)
    R("cuMemAddressFree", 10020, cuMemAddressFree)
    R("cuMemMap", 10020, cuMemMap)
    R("cuMemUnmap", 10020, cuMemUnmap)
    R("cuMemSetAccess", 10020, cuMemSetAccess)
    R("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity)
    R("cuArrayCreate", 3020, cuArrayCreate_v2)
    R("cuArray3DCreate", 3020, cuArray3DCreate_v2)
    R("cuArrayDestroy", 2000, cuArrayDestroy)
    R("cuArrayGetMemoryRequirements", 11060, cuArrayGetMemoryRequirements)
    R("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate)
    R("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy)
    R("cuMipmappedArrayGetMemoryRequirements", 11060, cuMipmappedArrayGetMemoryRequirements)
    R("cuPointerGetAttribute", 4000, cuPointerGetAttribute)
    T("cuMemcpy", 4000, cuMemcpy, 7000, cuMemcpy_ptds)
    T("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, 7000, cuMemcpyHtoD_v2_ptds)
    T("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, 7000, cuMemcpyDtoH_v2_ptds)
    T("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, 7000, cuMemcpyDtoD_v2_ptds)
    T("cuMemcpyAsync", 4000, cuMemcpyAsync, 7000, cuMemcpyAsync_ptsz)
    T("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, 7000, cuMemcpyHtoDAsync_v2_ptsz)
    T("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, 7000, cuMemcpyDtoHAsync_v2_ptsz)
    T("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, 7000, cuMemcpyDtoDAsync_v2_ptsz)
    T("cuMemsetD8", 3020, cuMemsetD8_v2, 7000, cuMemsetD8_v2_ptds)
    T("cuMemsetD32", 3020, cuMemsetD32_v2, 7000, cuMemsetD32_v2_ptds)
    T("cuMemsetD8Async", 3020, cuMemsetD8Async, 7000, cuMemsetD8Async_ptsz)
    T("cuMemsetD32Async", 3020, cuMemsetD32Async, 7000, cuMemsetD32Async_ptsz)
    /* modules, libraries, functions */
    R("cuModuleLoadData", 2000, cuModuleLoadData)
    R("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx)
    R("cuModuleGetFunction", 2000, cuModuleGetFunction)
    R("cuModuleUnload", 2000, cuModuleUnload)
    R("cuLibraryLoadData", 12000, cuLibraryLoadData)
    R("cuLibraryGetKernel", 12000, cuLibraryGetKernel)
    R("cuKernelGetFunction", 12000, cuKernelGetFunction)
    R("cuLibraryUnload", 12000, cuLibraryUnload)
    R("cuFuncGetAttribute", 2020, cuFuncGetAttribute)
    /* launches */
    T("cuLaunchKernel", 4000, cuLaunchKernel, 7000, cuLaunchKernel_ptsz)
    T("cuLaunchKernelEx", 11060, cuLaunchKernelEx, 11060, cuLaunchKernelEx_ptsz)
    T("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel_ptsz)
    T("cuLaunchHostFunc", 10000, cuLaunchHostFunc, 10000, cuLaunchHostFunc_ptsz)
    /* streams */
    R("cuStreamCreate", 2000, cuStreamCreate)
    R("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority)
    R("cuStreamDestroy", 4000, cuStreamDestroy_v2)
    T("cuStreamGetCtx", 9020, cuStreamGetCtx, 9020, cuStreamGetCtx_ptsz)
    T("cuStreamSynchronize", 2000, cuStreamSynchronize, 7000, cuStreamSynchronize_ptsz)
    T("cuStreamQuery", 2000, cuStreamQuery, 7000, cuStreamQuery_ptsz)
    T("cuStreamWaitEvent", 3020, cuStreamWaitEvent, 7000, cuStreamWaitEvent_ptsz)
    /* events */
    R("cuEventCreate", 2000, cuEventCreate)
    R("cuEventDestroy", 4000, cuEventDestroy_v2)
    T("cuEventRecord", 2000, cuEventRecord, 7000, cuEventRecord_ptsz)
    T("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags, 11010, cuEventRecordWithFlags_ptsz)
    R("cuEventSynchronize", 2000, cuEventSynchronize)
    R("cuEventQuery", 2000, cuEventQuery)
    R("cuEventElapsedTime", 2000, cuEventElapsedTime)
    R("cuEventElapsedTime", 12080, cuEventElapsedTime_v2)
    /* capture and graphs */
    T("cuStreamBeginCapture", 10000, cuStreamBeginCapture, 10000, cuStreamBeginCapture_ptsz)
    T("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2, 10010, cuStreamBeginCapture_v2_ptsz)
    T("cuStreamEndCapture", 10000, cuStreamEndCapture, 10000, cuStreamEndCapture_ptsz)
    T("cuStreamIsCapturing", 10000, cuStreamIsCapturing, 10000, cuStreamIsCapturing_ptsz)
    T("cuStreamGetCaptureInfo", 10010, cuStreamGetCaptureInfo, 10010, cuStreamGetCaptureInfo_ptsz)
    T("cuStreamGetCaptureInfo", 11030, cuStreamGetCaptureInfo_v2, 11030, cuStreamGetCaptureInfo_v2_ptsz)
    T("cuStreamGetCaptureInfo", 12030, cuStreamGetCaptureInfo_v3, 12030, cuStreamGetCaptureInfo_v3_ptsz)
    R("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode)
    R("cuGraphCreate", 10000, cuGraphCreate)
    R("cuGraphInstantiate", 10000, cuGraphInstantiate)
    R("cuGraphInstantiate", 11000, cuGraphInstantiate_v2) /* the real 13.0 driver: _v2 at 12000+ too */
    R("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags)
    R("cuGraphExecDestroy", 10000, cuGraphExecDestroy)
    R("cuGraphDestroy", 10000, cuGraphDestroy)
    T("cuGraphLaunch", 10000, cuGraphLaunch, 10000, cuGraphLaunch_ptsz)
    /* entry points */
    R("cuGetProcAddress", 11030, cuGetProcAddress)
    R("cuGetProcAddress", 12000, cuGetProcAddress_v2)
};

#define NROWS ((int)(sizeof rows / sizeof rows[0]))

/* ------------------------------------------------------------------ SIMCUDA_PROCADDR_ALIAS */

/* noinline and distinct bodies: each alias keeps an address of its own. */
#define ALIAS __attribute__((noinline, used))
static ALIAS CUresult alias_cuCtxSynchronize(void) { return cuCtxSynchronize(); }
static ALIAS CUresult alias_cuCtxSynchronize_v2(CUcontext ctx) { return cuCtxSynchronize_v2(ctx); }
static ALIAS CUresult alias_cuStreamSynchronize(CUstream s) { return cuStreamSynchronize(s); }
static ALIAS CUresult alias_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                           unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                                           void **extra)
{
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}

static const struct {
    void *fn, *alias;
} aliases[] = {
    {(void *)cuCtxSynchronize, (void *)alias_cuCtxSynchronize},
    {(void *)cuCtxSynchronize_v2, (void *)alias_cuCtxSynchronize_v2},
    {(void *)cuStreamSynchronize, (void *)alias_cuStreamSynchronize},
    {(void *)cuLaunchKernel, (void *)alias_cuLaunchKernel},
};

static void *maybe_alias(void *fn)
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("SIMCUDA_PROCADDR_ALIAS");
        on = v && *v && strcmp(v, "0") != 0;
    }
    if (on)
        for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
            if (aliases[i].fn == fn) return aliases[i].alias;
    return fn;
}

int simcuda_procaddr_entry(int index, const char **base, int *version, const char **sym, int *pt_version,
                           const char **pt_sym)
{
    if (index < 0 || index >= NROWS) return 0;
    const struct pa_row *r = &rows[index];
    if (base) *base = r->base;
    if (version) *version = r->version;
    if (sym) *sym = r->sym;
    if (pt_version) *pt_version = r->pt_version;
    if (pt_sym) *pt_sym = r->pt_sym;
    return 1;
}

/* Returns CUDA_SUCCESS with *status set, or CUDA_ERROR_INVALID_VALUE. */
static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *status)
{
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (flags != CU_GET_PROC_ADDRESS_DEFAULT && flags != CU_GET_PROC_ADDRESS_LEGACY_STREAM &&
        flags != CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        return CUDA_ERROR_INVALID_VALUE;
    if (cudaVersion > sim_driver_version()) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    const struct pa_row *best = NULL;
    int known = 0;
    for (int i = 0; i < NROWS; i++) {
        if (strcmp(rows[i].base, symbol) != 0) continue;
        known = 1;
        if (rows[i].version <= cudaVersion && (!best || rows[i].version > best->version)) best = &rows[i];
    }
    if (!best) {
        *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_SUCCESS;
    }
    int per_thread = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM && best->pt_fn;
    if (per_thread && best->pt_version > cudaVersion) {
        /* As the real driver does: no fallback to the legacy-stream variant. */
        *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_SUCCESS;
    }
    *pfn = maybe_alias(per_thread ? best->pt_fn : best->fn);
    *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = lookup(symbol, pfn, cudaVersion, flags, &st);
    if (symbolStatus) *symbolStatus = st;
    return rc;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = lookup(symbol, pfn, cudaVersion, flags, &st);
    if (rc == CUDA_SUCCESS && st != CU_GET_PROC_ADDRESS_SUCCESS) return CUDA_ERROR_NOT_FOUND;
    return rc;
}
