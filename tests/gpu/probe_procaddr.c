/*
 * probe_procaddr.c -- does the driver's cuGetProcAddress return the same
 * pointer as dlsym() of the exact variant name? libgemhook routes by pointer,
 * so this must hold for every function it intercepts (an answer that is no
 * exported symbol is routed by name instead, and counted). Prints one line per
 * check and "mismatches=N" at the end; exit status 1 if any mismatch. The
 * checks at 13000 follow the map of driver 580 (H100) and cuda.h 13.0; what
 * cudart really asks for is checked by tests/gpu/test_gpu_hook.py through
 * GEMINI_PROCADDR_LOG.
 * Plain C against libcuda.so.1; no CUDA headers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*gpa_v2_t)(const char *, void **, int, unsigned long long, int *);

struct check { const char *base; int version; unsigned long long flags; const char *expect; };

static const struct check checks[] = {
    {"cuLaunchKernel", 12000, 0, "cuLaunchKernel"},
    {"cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz"},
    {"cuLaunchKernelEx", 12000, 0, "cuLaunchKernelEx"},
    {"cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz"},
    {"cuLaunchCooperativeKernel", 12000, 0, "cuLaunchCooperativeKernel"},
    {"cuLaunchCooperativeKernel", 12000, 2, "cuLaunchCooperativeKernel_ptsz"},
    {"cuGraphLaunch", 12000, 0, "cuGraphLaunch"},
    {"cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz"},
    {"cuCtxSynchronize", 12000, 0, "cuCtxSynchronize"},
    {"cuStreamSynchronize", 12000, 0, "cuStreamSynchronize"},
    {"cuStreamSynchronize", 12000, 2, "cuStreamSynchronize_ptsz"},
    {"cuEventSynchronize", 12000, 0, "cuEventSynchronize"},
    {"cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2"},
    {"cuMemcpyHtoD", 12000, 2, "cuMemcpyHtoD_v2_ptds"},
    {"cuMemcpyDtoH", 12000, 0, "cuMemcpyDtoH_v2"},
    {"cuMemcpyDtoH", 12000, 2, "cuMemcpyDtoH_v2_ptds"},
    {"cuMemcpy", 12000, 0, "cuMemcpy"},
    {"cuMemcpy", 12000, 2, "cuMemcpy_ptds"},
    {"cuStreamBeginCapture", 12000, 0, "cuStreamBeginCapture_v2"},
    {"cuStreamBeginCapture", 12000, 2, "cuStreamBeginCapture_v2_ptsz"},
    {"cuStreamEndCapture", 12000, 0, "cuStreamEndCapture"},
    {"cuStreamEndCapture", 12000, 2, "cuStreamEndCapture_ptsz"},
    {"cuMemAlloc", 12000, 0, "cuMemAlloc_v2"},
    {"cuMemAllocPitch", 12000, 0, "cuMemAllocPitch_v2"},
    {"cuMemAllocManaged", 12000, 0, "cuMemAllocManaged"},
    {"cuMemFree", 12000, 0, "cuMemFree_v2"},
    {"cuMemAllocAsync", 12000, 0, "cuMemAllocAsync"},
    {"cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 12000, 0, "cuMemAllocFromPoolAsync"},
    {"cuMemFreeAsync", 12000, 0, "cuMemFreeAsync"},
    {"cuMemFreeAsync", 12000, 2, "cuMemFreeAsync_ptsz"},
    {"cuMemCreate", 12000, 0, "cuMemCreate"},
    {"cuMemRelease", 12000, 0, "cuMemRelease"},
    {"cuArrayCreate", 12000, 0, "cuArrayCreate_v2"},
    {"cuArray3DCreate", 12000, 0, "cuArray3DCreate_v2"},
    {"cuArrayDestroy", 12000, 0, "cuArrayDestroy"},
    {"cuMipmappedArrayCreate", 12000, 0, "cuMipmappedArrayCreate"},
    {"cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2"},
    {"cuDeviceTotalMem", 12000, 0, "cuDeviceTotalMem_v2"},
    {"cuMemPoolTrimTo", 12000, 0, "cuMemPoolTrimTo"},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"},
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress"},
    {"cuLaunchKernel", 13000, 0, "cuLaunchKernel"},
    {"cuMemAlloc", 13000, 0, "cuMemAlloc_v2"},
    /* CUDA 13: cuCtxSynchronize is cuCtxSynchronize_v2(ctx) from 13000 (what cudaDeviceSynchronize calls) */
    {"cuCtxSynchronize", 12080, 0, "cuCtxSynchronize"},
    {"cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2"},
    {"cuCtxSynchronize", 13000, 2, "cuCtxSynchronize_v2"},
    {"cuLaunchKernel", 13000, 2, "cuLaunchKernel_ptsz"},
    {"cuLaunchKernelEx", 13000, 0, "cuLaunchKernelEx"},
    {"cuLaunchKernelEx", 13000, 2, "cuLaunchKernelEx_ptsz"},
    {"cuGraphLaunch", 13000, 0, "cuGraphLaunch"},
    {"cuGraphLaunch", 13000, 2, "cuGraphLaunch_ptsz"},
    {"cuStreamSynchronize", 13000, 0, "cuStreamSynchronize"},
    {"cuStreamSynchronize", 13000, 2, "cuStreamSynchronize_ptsz"},
    {"cuEventSynchronize", 13000, 0, "cuEventSynchronize"},
    {"cuStreamBeginCapture", 13000, 0, "cuStreamBeginCapture_v2"},
    {"cuStreamBeginCapture", 13000, 2, "cuStreamBeginCapture_v2_ptsz"},
    {"cuMemAllocAsync", 13000, 2, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 13000, 2, "cuMemAllocFromPoolAsync_ptsz"},
    /* synchronous copies: every one ends a burst */
    {"cuMemcpyDtoD", 13000, 0, "cuMemcpyDtoD_v2"},
    {"cuMemcpyDtoD", 13000, 2, "cuMemcpyDtoD_v2_ptds"},
    {"cuMemcpy2D", 13000, 0, "cuMemcpy2D_v2"},
    {"cuMemcpy2D", 13000, 2, "cuMemcpy2D_v2_ptds"},
    {"cuMemcpy2DUnaligned", 13000, 0, "cuMemcpy2DUnaligned_v2"},
    {"cuMemcpy2DUnaligned", 13000, 2, "cuMemcpy2DUnaligned_v2_ptds"},
    {"cuMemcpy3D", 13000, 0, "cuMemcpy3D_v2"},
    {"cuMemcpy3D", 13000, 2, "cuMemcpy3D_v2_ptds"},
    {"cuMemcpyPeer", 13000, 0, "cuMemcpyPeer"},
    {"cuMemcpyPeer", 13000, 2, "cuMemcpyPeer_ptds"},
    {"cuMemcpy3DPeer", 13000, 0, "cuMemcpy3DPeer"},
    {"cuMemcpy3DPeer", 13000, 2, "cuMemcpy3DPeer_ptds"},
    {"cuMemcpyAtoH", 13000, 0, "cuMemcpyAtoH_v2"},
    {"cuMemcpyAtoH", 13000, 2, "cuMemcpyAtoH_v2_ptds"},
    {"cuMemcpyHtoA", 13000, 0, "cuMemcpyHtoA_v2"},
    {"cuMemcpyHtoA", 13000, 2, "cuMemcpyHtoA_v2_ptds"},
    {"cuMemcpyAtoD", 13000, 0, "cuMemcpyAtoD_v2"},
    {"cuMemcpyAtoD", 13000, 2, "cuMemcpyAtoD_v2_ptds"},
    {"cuMemcpyDtoA", 13000, 0, "cuMemcpyDtoA_v2"},
    {"cuMemcpyDtoA", 13000, 2, "cuMemcpyDtoA_v2_ptds"},
    {"cuMemcpyAtoA", 13000, 0, "cuMemcpyAtoA_v2"},
    {"cuMemcpyAtoA", 13000, 2, "cuMemcpyAtoA_v2_ptds"},
};

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("cannot open libcuda.so.1: %s\n", dlerror()); return 2; }
    int (*cuInit)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*drv)(int *) = (int (*)(int *))dlsym(h, "cuDriverGetVersion");
    gpa_v2_t gpa = (gpa_v2_t)dlsym(h, "cuGetProcAddress_v2");
    int version = 0;
    printf("cuInit=%d driver_version=%d\n", cuInit(0), drv ? (drv(&version), version) : -1);
    int mismatches = 0;
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        const struct check *c = &checks[i];
        void *p = NULL;
        int status = -1;
        int rc = gpa(c->base, &p, c->version, c->flags, &status);
        void *e = dlsym(h, c->expect);
        int ok = rc == 0 && p && p == e;
        if (!ok) mismatches++;
        printf("%-6s %-28s v%-5d flags=%llu -> %-32s rc=%d status=%d %p vs dlsym %p\n", ok ? "ok" : "DIFF",
               c->base, c->version, c->flags, c->expect, rc, status, p, e);
    }
    printf("mismatches=%d\n", mismatches);
    return mismatches ? 1 : 0;
}
