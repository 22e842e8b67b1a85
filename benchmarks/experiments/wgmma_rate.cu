// Microbenchmark: how fast can one SM's consumer warpgroups get through the megakernel's decode stages when the
// data is already in shared memory? Each stage is what consume_tile(_fp8) does per K step (gemm.cuh): 128
// weight rows x 128 B (16 KiB) against N token rows, as wgmma m64nN with both operands from 128-byte-swizzled
// shared memory; fp8 drains each step (wait_group 0) and promotes the partial sums with their scales, bf16
// keeps one group in flight (wait_group 1). Nothing is loaded: the stages are filled once and reused, so the
// time per stage is the consumer's own cost, the rate it can keep up with. One block per SM, all SMs.
//
// The kernel's tail streams ~30-42 GB/s of weights per SM (benchmarks/kernel-notes.md, "The fp8 consumer is not
// the limit"), ~0.4-0.5 us per 16 KiB stage, where tma_stream pulls ~70-100 GB/s per SM; with the weight warp
// split from the row warps (diffs/refuted/2026-11-23-producer-roles.diff) the producer waits for free slots and the
// consumer does not wait for data, so the consumer's per-stage cost is what this measures.
// Since the twentieth session it also times the token-major 128-token fp8 stage (prefill), its two warpgroups at
// once as in the kernel or ordered (refuted/2026-11-23-ordered-token-major.diff); prefill_stage.cu adds the loads.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc benchmarks/experiments/wgmma_rate.cu -o /tmp/wgmma_rate
//   /tmp/wgmma_rate
#include <cuda_runtime.h>

#include <cstdio>

#include "flashmoe/hopper.cuh"
#include "stage_bench.cuh"

using namespace flashmoe;

constexpr int kWeightBytes = 128 * 128;               // a stage's 128 weight rows of 128 B
constexpr int kStageBytes = kWeightBytes + 64 * 128;  // + up to 64 token rows
constexpr int kRing = 8;
constexpr int kSmemBytes = kRing * kStageBytes + 1024;

// kWarpgroups consumers; kSplit: each computes its 64 rows of every stage (the kernel's split tiles), else each
// computes all 128 rows of every kWarpgroups-th stage (1: the kernel's ping-pong owner; 2: an interleave).
// kSync: the kernel's per-stage synchronisation around the math, kWaitArrive (a completed mbarrier's try_wait
// and a warp's release arrive) and kProxyFence (fence.proxy.async, which makes cp.async's token rows visible to
// wgmma); kPromote (fp8): the scale loads and the promotion FMAs.
constexpr int kWaitArrive = 1, kProxyFence = 2, kKernelSync = kWaitArrive | kProxyFence;
template <int N, bool kFp8, bool kPromote, int kSync, int kWarpgroups, bool kSplit>
__global__ void __launch_bounds__(256) stage_loop(int steps, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full, empty;
  __shared__ float scales[kRing][N + 8];
  // Small finite values in either format (e4m3 0x30 = 0.125; bf16 0x3030 ~ 6.4e-10).
  for (int i = threadIdx.x; i < kRing * kStageBytes / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(base)[i] = 0x30303030u;
  for (int i = threadIdx.x; i < kRing * (N + 8); i += blockDim.x) (&scales[0][0])[i] = 1.0f + 1e-3f * i;
  fence_proxy_async();  // the stages' generic stores, before wgmma reads them (async proxy)
  if (threadIdx.x == 0) {
    mbar_init(&full, 1);
    mbar_init(&empty, (1 << 20) - 1);  // the largest count: never completes here: the releases only cost their arrive
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) mbar_arrive(&full);  // phase 0 complete: every try_wait below succeeds at once
  __syncthreads();

  constexpr int kHalves = kSplit ? 1 : 2;
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31;
  const uint32_t first_row = kSplit ? wg * 64 : 0;
  float acc[kHalves][N / 2];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;
  const int stride = kSplit ? 1 : kWarpgroups;
  for (int ks = kSplit ? 0 : wg; ks < steps; ks += stride) {
    const int s = ks % kRing;
    if constexpr ((kSync & kWaitArrive) != 0) {
      while (!mbar_try_wait(&full, 0)) {
      }
    }
    if constexpr ((kSync & kProxyFence) != 0) fence_proxy_async();
    const uint32_t stage = smem_addr(base + s * kStageBytes);
    const uint64_t b = sw128_desc(stage + kWeightBytes);
    if constexpr (kFp8) {
      float token[N / 4];
      float weight_lo = 1.f, weight_hi = 1.f;
      if constexpr (kPromote) {
        weight_lo = scales[s][N], weight_hi = scales[s][N + 1];
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          token[2 * j] = scales[s][8 * j + 2 * (lane & 3)];
          token[2 * j + 1] = scales[s][8 * j + 2 * (lane & 3) + 1];
        }
      }
      float partial[kHalves][N / 2];
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * 64) * 128);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) WgmmaFp8<N>::mma(partial[h], a + 2 * kk, b + 2 * kk, kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[h]);
      if constexpr ((kSync & kWaitArrive) != 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty);
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          if constexpr (kPromote) {
            acc[h][4 * j] = fmaf(token[2 * j] * weight_lo, partial[h][4 * j], acc[h][4 * j]);
            acc[h][4 * j + 1] = fmaf(token[2 * j + 1] * weight_lo, partial[h][4 * j + 1], acc[h][4 * j + 1]);
            acc[h][4 * j + 2] = fmaf(token[2 * j] * weight_hi, partial[h][4 * j + 2], acc[h][4 * j + 2]);
            acc[h][4 * j + 3] = fmaf(token[2 * j + 1] * weight_hi, partial[h][4 * j + 3], acc[h][4 * j + 3]);
          } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[h][4 * j + q] += partial[h][4 * j + q];
          }
        }
    } else {
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * 64) * 128);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) Wgmma<N>::mma(acc[h], a + 2 * kk, b + 2 * kk, 1);
      }
      wgmma_commit();
      wgmma_wait<1>();
      if constexpr ((kSync & kWaitArrive) != 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty);
      }
    }
  }
  wgmma_wait<0>();
  float total = 0.f;
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    fence_accumulators(acc[h]);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) total += acc[h][i];
  }
  if (total == 12345.f) sink[threadIdx.x] = total;  // keeps the math; never true for these inputs in practice
}

// Best of 5 launches of kernel(steps, sink) after a warm-up, in ns per step; negative (and printed) on an error.
template <typename Kernel>
double ns_per_step(const char* name, Kernel kernel, int blocks, int threads, int smem, float* sink) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int steps = 8192;
  const float best = stage_bench::best_of_5_ms(name, [&] { kernel<<<blocks, threads, smem>>>(steps, sink); });
  return best < 0 ? -1.0 : best * 1e6 / steps;
}

template <int N, bool kFp8, bool kPromote, int kSync, int kWarpgroups, bool kSplit>
void run(const char* name, int blocks, float* sink) {
  const double ns = ns_per_step(name, stage_loop<N, kFp8, kPromote, kSync, kWarpgroups, kSplit>, blocks,
                                128 * kWarpgroups, kSmemBytes, sink);
  if (ns > 0) std::printf("%-44s %6d %10.1f %10.1f\n", name, blocks, ns, kWeightBytes / ns);
}

// Token-major 128-token fp8 stages (consume_tile_fp8_token_major): a stage is 128 weight rows and 128 token rows
// of 128 B; warpgroup w's A operand is token rows 64w..64w+63, B the weight rows (4 wgmma m64n128k32), then the
// 4-product promotion. kOrder: 0 both warpgroups issue at once (the kernel), 1 warpgroup 1 issues a stage's
// wgmmas only after warpgroup 0 has (named barriers 5 and 6), so the tensor core runs one warpgroup's stage
// while the other promotes.
constexpr int kTmStageBytes = 2 * 128 * 128;
constexpr int kTmRing = 4;
constexpr int kTmSmemBytes = kTmRing * kTmStageBytes + 1024;

template <int kOrder, int kSync>
__global__ void __launch_bounds__(256) token_major_loop(int steps, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full, empty;
  __shared__ float scales[kTmRing][136];
  for (int i = threadIdx.x; i < kTmRing * kTmStageBytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(base)[i] = 0x30303030u;
  for (int i = threadIdx.x; i < kTmRing * 136; i += blockDim.x) (&scales[0][0])[i] = 1.0f + 1e-3f * i;
  fence_proxy_async();
  if (threadIdx.x == 0) {
    mbar_init(&full, 1);
    mbar_init(&empty, (1 << 20) - 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) mbar_arrive(&full);
  __syncthreads();
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int row = 64 * wg + 16 * warp + (lane >> 2);
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  const auto issue = [&](int ks, float (&partial)[64]) {
    const int s = ks % kTmRing;
    if constexpr ((kSync & kWaitArrive) != 0) {
      while (!mbar_try_wait(&full, 0)) {
      }
    }
    if constexpr ((kSync & kProxyFence) != 0) fence_proxy_async();
    const uint32_t stage = smem_addr(base + s * kTmStageBytes);
    const uint64_t a = sw128_desc(stage + 128 * 128 + wg * 64 * 128);
    const uint64_t b = sw128_desc(stage);
    if constexpr (kOrder == 1) {
      if (wg == 1) asm volatile("bar.sync 5, 256;\n" ::: "memory");
      else if (ks > 0) asm volatile("bar.sync 6, 256;\n" ::: "memory");
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaFp8<128>::mma(partial, a + 2 * kk, b + 2 * kk, kk > 0);
    wgmma_commit();
    if constexpr (kOrder == 1) {
      if (wg == 0) asm volatile("bar.arrive 5, 256;\n" ::: "memory");
      else if (ks + 1 < steps) asm volatile("bar.arrive 6, 256;\n" ::: "memory");
    }
  };
  const auto promote = [&](int ks, float (&partial)[64]) {
    const int s = ks % kTmRing;
    fence_accumulators(partial);
    if constexpr ((kSync & kWaitArrive) != 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty);
    }
    const float w_lo = scales[s][128], w_hi = scales[s][129];
    const float t_lo = scales[s][row], t_hi = scales[s][row + 8];
    const float lo_lo = t_lo * w_lo, lo_hi = t_lo * w_hi, hi_lo = t_hi * w_lo, hi_hi = t_hi * w_hi;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float first = j % 2 == 0 ? lo_lo : lo_hi, second = j % 2 == 0 ? hi_lo : hi_hi;
      acc[4 * j] = fmaf(first, partial[4 * j], acc[4 * j]);
      acc[4 * j + 1] = fmaf(first, partial[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(second, partial[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(second, partial[4 * j + 3], acc[4 * j + 3]);
    }
  };
  for (int ks = 0; ks < steps; ++ks) {
    float partial[64];
    issue(ks, partial);
    wgmma_wait<0>();
    promote(ks, partial);
  }
  stage_bench::sink_sums(acc, sink);
}

template <int kOrder, int kSync>
void run_token_major(const char* name, int blocks, float* sink) {
  const double ns = ns_per_step(name, token_major_loop<kOrder, kSync>, blocks, 256, kTmSmemBytes, sink);
  // 128 tokens x 128 weight rows x 128 K per stage
  if (ns > 0)
    std::printf("%-44s %6d %10.1f %10.1f  %7.1f TFLOP/s\n", name, blocks, ns, kWeightBytes / ns,
                2.0 * 128 * 128 * 128 * blocks / ns * 1e-3);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink = nullptr;
  cudaMalloc(&sink, 1024 * sizeof(float));
  std::printf("%-44s %6s %10s %10s\n", "stage (N tokens; warpgroups)", "blocks", "ns/stage", "GB/s/SM");
  for (int blocks : {sms}) {
    run_token_major<0, kKernelSync>("fp8 N128 token-major (the kernel)", blocks, sink);
    run_token_major<0, 0>("fp8 N128 token-major: math only", blocks, sink);
    run_token_major<1, kKernelSync>("fp8 N128 token-major, ordered warpgroups", blocks, sink);
    run_token_major<1, 0>("fp8 N128 token-major, ordered: math only", blocks, sink);
  }
  for (int blocks : {sms, 48}) {
    run<32, true, true, 0, 1, false>("fp8 N32 ping-pong: math only", blocks, sink);
    run<32, true, false, 0, 1, false>("fp8 N32 ping-pong: no promotion", blocks, sink);
    run<32, true, true, kWaitArrive, 1, false>("fp8 N32 ping-pong: + wait/arrive", blocks, sink);
    run<32, true, true, kProxyFence, 1, false>("fp8 N32 ping-pong: + proxy fence", blocks, sink);
    run<32, true, true, kKernelSync, 1, false>("fp8 N32 ping-pong: + both (the kernel)", blocks, sink);
    run<32, true, true, kKernelSync, 2, false>("fp8 N32 two warpgroups, alternate stages", blocks, sink);
    run<32, true, true, kWaitArrive, 2, false>("fp8 N32 two warpgroups, no fence", blocks, sink);
    run<64, true, true, kKernelSync, 2, true>("fp8 N64 split (the kernel)", blocks, sink);
    run<32, true, true, kKernelSync, 2, true>("fp8 N32 split over two warpgroups", blocks, sink);
    run<32, false, false, kKernelSync, 1, false>("bf16 N32 ping-pong (the kernel)", blocks, sink);
    run<32, false, false, kWaitArrive, 1, false>("bf16 N32 ping-pong, no fence", blocks, sink);
    run<64, false, false, kKernelSync, 1, false>("bf16 N64 ping-pong (the kernel)", blocks, sink);
  }
  return 0;
}
