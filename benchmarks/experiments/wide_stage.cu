// Microbenchmark: is a wide bf16 prefill stage (gemm.cuh, 256 weight rows x 128 tokens x 64 K, 48 KiB) bound by the
// SM's shared-memory bandwidth? In the kernel such a stage takes ~0.76 us (Qwen3-30B T = 2048, kernel-notes.md,
// thirty-third session) where its loads alone take ~0.54 and its tensor work was estimated at ~0.56. The wgmmas read
// their operands from shared memory: the kernel's swap-AB form (each consumer: two halves of 64 weight rows, wgmma
// m64n128k16 against all 128 token rows) reads 96 KiB a stage (the token rows four times), a token-major form (each
// consumer: its 64 tokens against all 256 weight rows, wgmma m64n256k16) 80 KiB; the fills write 48 more, and an SM's
// shared memory moves ~128 B a cycle. Data resident (a 4-stage ring filled once); a third warpgroup optionally
// writes 48 KiB a stage into the ring as the fills would (st.shared, unsynchronised: timing only).
// One block per SM, every SM; prints ns per stage. (Thirty-third session: swap-AB 570 / 692-699 ns, token-major 570 /
// 613 on an H200; the kernel's wide tiles went token-major and gained 1-3%, not the ~12% this predicted.)
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc benchmarks/experiments/wide_stage.cu -o /tmp/ws
#include <cuda_runtime.h>

#include <cstdio>

#include "flashmoe/hopper.cuh"

using namespace flashmoe;

constexpr int kBox = 128 * 128;               // 128 weight rows x 128 B (64 bf16 of K)
constexpr int kStage = 3 * kBox;              // two weight boxes, then 128 token rows
constexpr int kRing = 4;
constexpr int kSmemBytes = kRing * kStage + 1024;

template <bool kTokenMajor, bool kFill>
__global__ void __launch_bounds__(384, 1) wide_stage(int stages, float* sink, long long* cycles) {
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // the fills' shared-memory writes, 48 KiB a stage, paced by nothing (an upper bound on their load)
    if (!kFill) return;
    const uint4 v = make_uint4(threadIdx.x, 1, 2, 3);
    for (int s = 0; s < stages; ++s) {
      char* stage = base + ((s + 2) % kRing) * kStage;
      for (int c = threadIdx.x; c < kStage / 16; c += 128)
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(stage + c * 16)), "r"(v.x), "r"(v.y),
                     "r"(v.z), "r"(v.w)
                     : "memory");
    }
    return;
  }
  const int consumer = wg - 1;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  const long long start = clock64();
  for (int s = 0; s < stages; ++s) {
    const uint32_t stage = smem_addr(base + (s % kRing) * kStage);
    wgmma_fence();
    if constexpr (kTokenMajor) {
      const uint64_t a = sw128_desc(stage + 2 * kBox + consumer * 64 * 128);  // this consumer's 64 token rows
      const uint64_t b = sw128_desc(stage);                                   // all 256 weight rows
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) Wgmma<256>::mma(acc, a + 2 * kk, b + 2 * kk, 1);
    } else {
      const uint64_t b = sw128_desc(stage + 2 * kBox);  // the 128 token rows
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint64_t a = sw128_desc(stage + (consumer * 128 + h * 64) * 128);  // 64 rows of this consumer's box
        float(&half)[64] = *reinterpret_cast<float(*)[64]>(acc + 64 * h);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<128>::mma(half, a + 2 * kk, b + 2 * kk, 1);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();  // the kernel's depth: one stage's wgmmas in flight behind the next
  }
  wgmma_wait<0>();
  const long long took = clock64() - start;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  if (sum == 12345.f) sink[threadIdx.x] = sum;
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + consumer] = took;
}

template <bool kTokenMajor, bool kFill>
void run(const char* name, int sms, float* sink, long long* cycles, int clock_khz) {
  auto kernel = wide_stage<kTokenMajor, kFill>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const int stages = 4096;
  kernel<<<sms, 384, kSmemBytes>>>(64, sink, cycles);  // warm up
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  kernel<<<sms, 384, kSmemBytes>>>(stages, sink, cycles);
  cudaEventRecord(b);
  if (cudaEventSynchronize(b) != cudaSuccess) {
    printf("%s: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  long long host[2 * 256];
  cudaMemcpy(host, cycles, sizeof(long long) * 2 * sms, cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int i = 0; i < 2 * sms; ++i) worst = host[i] > worst ? host[i] : worst;
  const double flops = 2.0 * 256 * 128 * 64 * stages * sms;
  printf("%-28s %7.1f ns/stage (events)  %7.1f ns/stage (clock64 at %d MHz)  %6.0f TFLOP/s\n", name,
         ms * 1e6 / stages, worst * 1e6 / clock_khz / stages, clock_khz / 1000, flops / (ms * 1e-3) / 1e12);
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  float* sink;
  long long* cycles;
  cudaMalloc(&sink, 4096);
  cudaMalloc(&cycles, sizeof(long long) * 2 * 256);
  run<false, false>("swap-AB (kernel)", sms, sink, cycles, clock_khz);
  run<true, false>("token-major m64n256", sms, sink, cycles, clock_khz);
  run<false, true>("swap-AB + fill writes", sms, sink, cycles, clock_khz);
  run<true, true>("token-major + fill writes", sms, sink, cycles, clock_khz);
  return 0;
}
