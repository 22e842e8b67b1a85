// Microbenchmark: a wide bf16 prefill stage (gemm.cuh: 256 weight rows x 128 tokens x 64 K, 48 KiB, token-major
// consumers) with real loads, on every SM. The kernel's stage takes ~0.74 us at Qwen3-30B T = 2048 (kernel-notes.md,
// thirty-third session) where its wgmmas alone take 0.57 (wide_stage.cu) and its loads alone ~0.54 (the
// thirty-second session's timing-only variant): this takes the kernel's pieces apart, as prefill_stage.cu does for
// the fp8 stage. A producer warpgroup fills a 4-stage ring (the kernel's wide ring) with two TMA boxes of 128 weight
// rows x 128 B and 128 token rows; two consumer warpgroups each run 4 wgmma m64n256k16 on their 64 tokens and release
// the previous stage after issuing the next (the kernel's wait_group 1).
//   weights: "hbm" streams distinct 256-row tiles of a 1 GiB tensor (read once); "l2" re-reads 8 MiB of it (a
//            prefill call's weight tiles are read by ~4-8 token tiles each, mostly from L2).
//   tokens:  "gather" is the kernel's producer: 128 threads, 8 cp.async of 16 B each per stage, rows picked at
//            random from 32 MiB, then a cp.async arrive; "tma" one 2-D box of 128 contiguous rows; "none" loads none.
//   math:    "mma" the consumers' wgmmas, "none" only wait and release.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc benchmarks/experiments/wide_stage_loads.cu \
//       -o /tmp/wide_stage_loads && /tmp/wide_stage_loads
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "flashmoe/hopper.cuh"
#include "stage_bench.cuh"

using namespace flashmoe;
using namespace stage_bench;

constexpr int kK = 4096;                  // bytes per row: Qwen3-30B's hidden size in bf16
constexpr int kKSteps = kK / 128;         // 64 bf16 of K per stage
constexpr int kBox = 128 * 128;           // 128 rows x 128 B
constexpr int kStageBytes = 3 * kBox;     // two weight boxes, then 128 token rows
constexpr int kRing = 4;
constexpr int kSmemBytes = kRing * kStageBytes + 1024;
constexpr int kTokenRows = 8192;          // 32 MiB of token rows
constexpr int64_t kHbmRows = 256 * 1024;  // 1 GiB of weight rows
constexpr int kL2Rows = 2048;             // 8 MiB of weight rows
__global__ void __launch_bounds__(384, 1) wide_stage_loads(const __grid_constant__ CUtensorMap weights_map,
                                                           const __grid_constant__ CUtensorMap tokens_map,
                                                           const uint8_t* tokens, Config c, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kRing], empty[kRing];
  setup_ring(base, full, empty, c, kRing * kStageBytes, 0x3c003c00u);  // bf16 1.0
  const int wg = threadIdx.x / 128;
  const int weight_rows = c.weights == kWeightsHbm ? static_cast<int>(kHbmRows) : kL2Rows;
  const int weight_tiles = weight_rows / 256;
  if (wg == 0) {  // producer
    produce_ring<2, kRing, kStageBytes>(base, full, empty, &weights_map, &tokens_map, tokens, kK, kTokenRows,
                                        weight_tiles, c);
  } else {  // consumers: the kernel's token-major wide mainloop
    const int consumer = wg - 1, lane = threadIdx.x & 31;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int s = 0, previous = -1;
    uint32_t phase = 0;
    for (int i = 0; i < c.tiles_per_block; ++i)
      for (int ks = 0; ks < kKSteps; ++ks) {
        while (!mbar_try_wait(&full[s], phase)) {
        }
        if (c.tokens == kTokensGather) fence_proxy_async();  // cp.async rows (generic proxy) before wgmma reads them
        if (c.math) {
          const uint32_t stage = smem_addr(base + s * kStageBytes);
          const uint64_t a = sw128_desc(stage + 2 * kBox + consumer * 64 * 128);
          const uint64_t b = sw128_desc(stage);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) Wgmma<256>::mma(acc, a + 2 * kk, b + 2 * kk, 1);
          wgmma_commit();
          wgmma_wait<1>();
          if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);
          previous = s;
        } else {
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
        }
        if (++s == kRing) {
          s = 0;
          phase ^= 1u;
        }
      }
    wgmma_wait<0>();
    fence_accumulators(acc);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) total += acc[i];
    if (total == 12345.f) sink[threadIdx.x] = total;
  }
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  StageInputs in;
  if (!in.make(kHbmRows, kL2Rows, kTokenRows, kK, 0x3c)) return 1;  // bf16 0x3c3c ~ 0.0115: finite sums
  std::printf("%-8s %-7s %-5s %9s %13s %11s\n", "weights", "tokens", "math", "us/stage", "KiB in/us/SM", "TFLOP/s");
  const int cases[][3] = {
      {kWeightsL2, kTokensGather, 1}, {kWeightsL2, kTokensTma, 1},     {kWeightsL2, kTokensNone, 1},
      {kWeightsHbm, kTokensGather, 1}, {kWeightsHbm, kTokensTma, 1},   {kWeightsHbm, kTokensNone, 1},
      {kWeightsL2, kTokensGather, 0}, {kWeightsL2, kTokensTma, 0},     {kWeightsL2, kTokensNone, 0},
      {kWeightsHbm, kTokensGather, 0}, {kWeightsHbm, kTokensTma, 0},   {kWeightsHbm, kTokensNone, 0},
  };
  const int tiles_per_block = static_cast<int>(kHbmRows / 256 / sms);  // every HBM tile once per launch
  const auto report = [&](const Config& c, double us) {
    const double kib = (c.tokens == kTokensNone ? 2 : 3) * 16.0;
    std::printf("%-8s %-7s %-5s %9.3f %13.1f %11.1f\n", kWeightNames[c.weights], kTokenNames[c.tokens],
                c.math ? "mma" : "none", us, kib / us, 2.0 * 256 * 128 * 64 * sms / us * 1e-6);
  };
  return run_cases("wide_stage_loads", wide_stage_loads, kSmemBytes, in, tiles_per_block, kKSteps, cases, report);
}
