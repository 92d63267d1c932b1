// spin_cudart.cu -- an nvcc-built program with static cudart (the default), for the hook's
// cudart path. Built twice: default stream, and --default-stream per-thread.
// Usage: spin_cudart KERNELS KERNEL_US ; prints a JSON line.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void spin(unsigned long long ns, unsigned long long *out) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(out, 1ull);
}

int main(int argc, char **argv) {
    int kernels = argc > 1 ? atoi(argv[1]) : 200;
    unsigned long long us = argc > 2 ? strtoull(argv[2], 0, 10) : 100;
    unsigned long long *d = nullptr, h = 0;
    cudaEvent_t a, b;  // cudaEventCreate: where the original Gemini hung
    if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) { puts("{\"ok\":false}"); return 1; }
    cudaMalloc(&d, sizeof *d);
    cudaMemset(d, 0, sizeof *d);
    cudaEventRecord(a);
    for (int i = 0; i < kernels; i++) spin<<<1, 32>>>(us * 1000ull, d);
    cudaEventRecord(b);
    cudaError_t err = cudaDeviceSynchronize();
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost);
    printf("{\"ok\": %s, \"kernels\": %llu, \"gpu_ms\": %.3f, \"error\": \"%s\"}\n",
           (err == cudaSuccess && h == (unsigned long long)kernels) ? "true" : "false", h, ms, cudaGetErrorString(err));
    cudaFree(d);
    return err == cudaSuccess ? 0 : 1;
}
