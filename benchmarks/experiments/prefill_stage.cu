// Microbenchmark: where a token-major 128-token fp8 prefill stage (gemm.cuh, consume_tile_fp8_token_major) goes
// when its loads are real. In the kernel such a stage takes ~0.84 us (Qwen3-30B, T = 2048, kernel-notes.md); its
// consumers alone, data already in shared memory, take ~0.41 (wgmma_rate.cu). This runs the kernel's stage
// shape on every SM -- a producer warpgroup fills a 4-stage ring of 16 KiB of weight rows (TMA) and 16 KiB of
// token rows, two consumer warpgroups each compute 64 tokens x 128 weight rows x 128 K with the fp8 promotion
// -- and takes the parts away one at a time:
//   weights: "hbm" streams distinct 128-row tiles of a 256 MiB e4m3 tensor (read once, as the kernel's
//            evict-first weights mostly are); "l2" re-reads 4 MiB of it (every tile hits L2).
//   tokens:  "gather" is the kernel's GEMM0 producer: 128 threads, 8 cp.async of 16 B each per stage, rows
//            picked at random from 8 MiB of received rows, then a cp.async arrive; "tma" is one 2-D box of 128
//            contiguous rows (what GEMM1's activations would allow, contiguous per expert); "none" loads none.
//   math:    "mma" the consumers' wgmmas and promotion, "none" only wait and release.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc benchmarks/experiments/prefill_stage.cu \
//       -o /tmp/prefill_stage && /tmp/prefill_stage
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "flashmoe/hopper.cuh"
#include "stage_bench.cuh"

using namespace flashmoe;
using namespace stage_bench;

constexpr int kK = 2048;                       // bytes (= e4m3 elements) per row: Qwen3-30B's hidden size
constexpr int kKSteps = kK / 128;              // 128 B of K per stage
constexpr int kStageBytes = 2 * 128 * 128;     // weights, then token rows
constexpr int kRing = 4;                       // the kernel's fp8 128-token ring
constexpr int kSmemBytes = kRing * kStageBytes + 1024;
constexpr int kTokenRows = 4096;               // 8 MiB of token rows
constexpr int64_t kHbmRows = 128 * 1024;       // 256 MiB of weight rows
constexpr int kL2Rows = 2048;                  // 4 MiB of weight rows
__global__ void __launch_bounds__(384, 1) prefill_stage(const __grid_constant__ CUtensorMap weights_map,
                                                        const __grid_constant__ CUtensorMap tokens_map,
                                                        const uint8_t* tokens, Config c, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kRing], empty[kRing];
  setup_ring(base, full, empty, c, kRing * kStageBytes, 0x30303030u);
  const int wg = threadIdx.x / 128;
  const int weight_rows = c.weights == kWeightsL2 ? kL2Rows : static_cast<int>(kHbmRows);
  const int weight_tiles = weight_rows / 128;
  if (wg == 0) {  // producer
    produce_ring<1, kRing, kStageBytes>(base, full, empty, &weights_map, &tokens_map, tokens, kK, kTokenRows,
                                        weight_tiles, c);
  } else {  // consumers
    const int consumer = wg - 1;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    const float lo = 1.001f, hi = 0.999f;  // the promotion's scale products (their loads are not the question)
    RingPosition<kRing> at;
    for (int i = 0; i < c.tiles_per_block; ++i)
      for (int ks = 0; ks < kKSteps; ++ks) {
        const int s = at.slot;
        while (!mbar_try_wait(&full[s], at.phase)) {
        }
        if (c.tokens == kTokensGather) fence_proxy_async();  // cp.async rows (generic proxy) before wgmma reads them
        if (c.math) {
          const uint32_t stage = smem_addr(base + s * kStageBytes);
          const uint64_t a = sw128_desc(stage + 128 * 128 + consumer * 64 * 128);
          const uint64_t b = sw128_desc(stage);
          float partial[64];
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) WgmmaFp8<128>::mma(partial, a + 2 * kk, b + 2 * kk, kk > 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(partial);
          release_stage(&empty[s]);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            acc[4 * j] = fmaf(lo, partial[4 * j], acc[4 * j]);
            acc[4 * j + 1] = fmaf(lo, partial[4 * j + 1], acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(hi, partial[4 * j + 2], acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(hi, partial[4 * j + 3], acc[4 * j + 3]);
          }
        } else {
          release_stage(&empty[s]);
        }
        at.advance();
      }
    sink_sums(acc, sink);
  }
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  StageInputs in;
  if (!in.make(kHbmRows, kL2Rows, kTokenRows, kK, 0x30)) return 1;  // e4m3 0.125: finite sums
  std::printf("%-8s %-7s %-5s %9s %11s %11s\n", "weights", "tokens", "math", "us/stage", "GB/s/SM", "TFLOP/s");
  const int cases[][3] = {
      {kWeightsHbm, kTokensGather, 1}, {kWeightsL2, kTokensGather, 1}, {kWeightsHbm, kTokensTma, 1},
      {kWeightsL2, kTokensTma, 1},     {kWeightsHbm, kTokensNone, 1},  {kWeightsL2, kTokensNone, 1},
      {kWeightsHbm, kTokensGather, 0}, {kWeightsL2, kTokensGather, 0}, {kWeightsHbm, kTokensTma, 0},
      {kWeightsL2, kTokensTma, 0},     {kWeightsHbm, kTokensNone, 0},  {kWeightsL2, kTokensNone, 0},
  };
  const int tiles_per_block = static_cast<int>(kHbmRows / 128 / sms);  // every HBM tile once per launch
  const auto report = [&](const Config& c, double us) {
    const double bytes = 128 * 128 * (c.tokens == kTokensNone ? 1 : 2);
    std::printf("%-8s %-7s %-5s %9.3f %11.1f %11.1f\n", kWeightNames[c.weights], kTokenNames[c.tokens],
                c.math ? "mma" : "none", us, bytes / us * 1e-3, 2.0 * 128 * 128 * 128 * sms / us * 1e-6);
  };
  return run_cases("prefill_stage", prefill_stage, kSmemBytes, in, tiles_per_block, kKSteps, cases, report);
}
