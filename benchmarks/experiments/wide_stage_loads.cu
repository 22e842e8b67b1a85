// Microbenchmark: a wide bf16 prefill stage (gemm.cuh: 256 weight rows x 128 tokens, token-major consumers) with
// real loads, on every SM. The kernel's stage takes ~0.74 us at Qwen3-30B T = 2048 (kernel-notes.md, thirty-third
// session) where its wgmmas alone take 0.57 (wide_stage.cu) and its loads alone ~0.54 (the thirty-second session's
// timing-only variant): this takes the kernel's pieces apart, as prefill_stage.cu does for the fp8 stage. A producer
// warpgroup fills a ring with two TMA boxes of 128 weight rows and 128 token rows per stage; two consumer warpgroups
// each run wgmma m64n256k16 on their 64 tokens and release the previous stage after issuing the next (the kernel's
// wait_group 1).
//   ring:    the kernel's 4 stages of 64 K (128 B of each row, 48 KiB, 128-byte swizzle), or deeper rings of the
//            same bytes in stages of 32 K (64 B of each row, 24 KiB, 64-byte swizzle: the boxes, the gathered rows
//            and the wgmma descriptors): with one stage held by the consumers' wait_group 1, a ring of 8 half
//            stages keeps 6/8 of its bytes in flight where 4 whole ones keep 2/4 (runbook item 1 (a)).
//   weights: "hbm" streams distinct 256-row tiles of a 1 GiB tensor (read once); "hbm-x4" the same, each tile read by
//            four neighbouring blocks at once (a prefill call's token tiles of one expert); "l2" re-reads 8 MiB of
//            it (every read an L2 hit).
//   tokens:  "gather" is the kernel's producer: 128 threads, cp.async of 16 B (8 or 4 per thread per stage), rows
//            picked at random from 32 MiB, then a cp.async arrive; "tma" one 2-D box of 128 contiguous rows; "none"
//            loads none.
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
constexpr int kTokenRows = 8192;          // 32 MiB of token rows
constexpr int64_t kHbmRows = 256 * 1024;  // 1 GiB of weight rows
constexpr int kL2Rows = 2048;             // 8 MiB of weight rows
constexpr int kRingBytes = 192 * 1024;    // the kernel's stage pool
constexpr int kSmemBytes = kRingBytes + 1024;

// A K-major wgmma operand descriptor for kSwizzle-byte (128 or 64) swizzled rows of kSwizzle bytes: 8-row groups
// kSwizzle x 8 B apart; advancing K by 16 bf16 adds 32 B (2 in descriptor units) in either.
template <int kSwizzle>
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t smem_byte_addr) {
  static_assert(kSwizzle == 128 || kSwizzle == 64, "128- or 64-byte swizzle");
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(kSwizzle * 8 >> 4) << 32) | (static_cast<uint64_t>(kSwizzle == 128 ? 1 : 2) << 62);
}

// kStepBytes of each row per stage (128: 64 K; 64: 32 K), kRing stages.
template <int kStepBytes, int kRing>
__global__ void __launch_bounds__(384, 1) wide_stage_loads(const __grid_constant__ CUtensorMap weights_map,
                                                           const __grid_constant__ CUtensorMap tokens_map,
                                                           const uint8_t* tokens, Config c, float* sink) {
  constexpr int kBox = 128 * kStepBytes;
  constexpr int kStageBytes = 3 * kBox;  // two weight boxes, then 128 token rows
  constexpr int kKSteps = kK / kStepBytes;
  static_assert(kRing * kStageBytes <= kRingBytes, "the ring fits the pool");
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kRing], empty[kRing];
  setup_ring(base, full, empty, c, kRing * kStageBytes, 0x3c003c00u);  // bf16 1.0
  const int wg = threadIdx.x / 128;
  const int weight_rows = c.weights == kWeightsL2 ? kL2Rows : static_cast<int>(kHbmRows);
  const int weight_tiles = weight_rows / 256;
  if (wg == 0) {  // producer
    produce_ring<2, kRing, kStageBytes, kStepBytes>(base, full, empty, &weights_map, &tokens_map, tokens, kK,
                                                    kTokenRows, weight_tiles, c);
  } else {  // consumers: the kernel's token-major wide mainloop
    const int consumer = wg - 1, lane = threadIdx.x & 31;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int previous = -1;
    RingPosition<kRing> at;
    for (int i = 0; i < c.tiles_per_block; ++i)
      for (int ks = 0; ks < kKSteps; ++ks) {
        const int s = at.slot;
        while (!mbar_try_wait(&full[s], at.phase)) {
        }
        if (c.tokens == kTokensGather) fence_proxy_async();  // cp.async rows (generic proxy) before wgmma reads them
        if (c.math) {
          const uint32_t stage = smem_addr(base + s * kStageBytes);
          const uint64_t a = swizzled_desc<kStepBytes>(stage + 2 * kBox + consumer * 64 * kStepBytes);
          const uint64_t b = swizzled_desc<kStepBytes>(stage);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kStepBytes / 32; ++kk) Wgmma<256>::mma(acc, a + 2 * kk, b + 2 * kk, 1);
          wgmma_commit();
          wgmma_wait<1>();
          if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);
          previous = s;
        } else {
          release_stage(&empty[s]);
        }
        at.advance();
      }
    wgmma_wait<0>();
    fence_accumulators(acc);
    sink_sums(acc, sink);
  }
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  StageInputs in;
  if (!in.make(kHbmRows, kL2Rows, kTokenRows, kK, 0x3c)) return 1;  // bf16 0x3c3c ~ 0.0115: finite sums
  std::printf("%-10s %-8s %-7s %-5s %12s %13s %11s\n", "ring", "weights", "tokens", "math", "us/64K-step",
              "KiB in/us/SM", "TFLOP/s");
  const int cases[][3] = {
      {kWeightsHbmShared4, kTokensGather, 1}, {kWeightsHbm, kTokensGather, 1}, {kWeightsL2, kTokensGather, 1},
      {kWeightsHbm, kTokensNone, 1},          {kWeightsHbmShared4, kTokensGather, 0},
      {kWeightsHbm, kTokensGather, 0},        {kWeightsL2, kTokensGather, 0},
  };
  const int tiles_per_block = static_cast<int>(kHbmRows / 256 / sms);  // every HBM tile once per launch
  // Times are per 64 K of a tile (one of the kernel's stages, two of the half ones) so the rings compare directly.
  const auto run_ring = [&](auto kernel, int step_bytes, int ring) {
    char name[16];
    std::snprintf(name, sizeof(name), "%dx%dKiB", ring, 3 * step_bytes / 8);
    const auto report = [&](const Config& c, double us_per_stage) {
      const double us = us_per_stage * 128 / step_bytes;
      const double kib = (c.tokens == kTokensNone ? 2 : 3) * 16.0;
      std::printf("%-10s %-8s %-7s %-5s %12.3f %13.1f %11.1f\n", name, kWeightNames[c.weights],
                  kTokenNames[c.tokens], c.math ? "mma" : "none", us, kib / us, 2.0 * 256 * 128 * 64 * sms / us * 1e-6);
    };
    if (!in.encode(step_bytes)) return 1;
    return run_cases("wide_stage_loads", kernel, kSmemBytes, in, tiles_per_block, kK / step_bytes, cases, report);
  };
  // The kernel's ring, one stage fewer (3 stages cost the kernel 4-5%: the depth's scale), then the half stages.
  int err = run_ring(wide_stage_loads<128, 4>, 128, 4);
  err = err ? err : run_ring(wide_stage_loads<128, 3>, 128, 3);
  err = err ? err : run_ring(wide_stage_loads<64, 8>, 64, 8);
  err = err ? err : run_ring(wide_stage_loads<64, 6>, 64, 6);
  err = err ? err : run_ring(wide_stage_loads<64, 4>, 64, 4);
  return err;
}
