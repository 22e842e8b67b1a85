// Microbenchmark: how fast can 132 blocks stream a [rows x K] bf16 weight tensor through TMA into a ring of
// S shared-memory stages (128B swizzle), as the megakernel's producer does? Consumers only wait and release.
// The ceiling the GEMM engine's weight streaming is measured against (results/2026-11-22-h200x1-tma-stream.txt).
// `tma_stream sweep`: the same streams from fewer blocks (8 .. all SMs): what one SM can pull when HBM is not
// the limit -- the rate that bounds a small-T tile (results/2026-11-22-h200x1-tma-stream-per-sm.txt).
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc benchmarks/experiments/tma_stream.cu -o /tmp/tma_stream
//   (-Icsrc since the eighteenth session: math mode uses the kernel's wgmma wrappers)
// `tma_stream tail`: the 5-D w13 stream with the kernel's evict-first hint and the fp8 geometry, 48 and all SMs.
// `tma_stream math`: that fp8 stream with the consumer doing the kernel's fp8 32-token math on each stage (8 wgmma
// m64n32k32 over the stage's 128 rows, drained; benchmarks/experiments/wgmma_rate.cu times the math alone).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "flashmoe/hopper.cuh"  // the kernel's own evict-first TMA load and wgmma wrappers, used as flashmoe::

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory"); }
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory"); }
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t b) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(b) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1) : "memory");
}

__device__ __forceinline__ void tma3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
               ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}

__device__ __forceinline__ void tma5d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
               ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}
// kbox: 64-k boxes per stage along K; rbox: 128-row boxes along rows; three_d: rows viewed as [rows/8][8];
// evict_first: the kernel's L2 hint on the 5-D load; fp8: w13 as e4m3 [rows][2048 B], 128 K per box;
// pollers: extra blocks that only poll (below); math: the consumer runs the kernel's fp8 N = 32 step on each stage
// (its token operand: 32 fixed rows after the ring).
struct Cfg { int stages, kbox, rbox, tile_rows; int five_d; int three_d; int evict_first = 0; int fp8 = 0; int pollers = 0; int math = 0; };

// The last `c.pollers` blocks do what a megakernel block waiting for GEMM1 readiness does (tasks.cuh ActReadiness):
// a warp spins on acquire loads of 32 words of one line, no back-off, until every streaming block has finished
// (done[0] reaches `done_target`). Does such polling slow the other SMs' weight streams?
__global__ void __launch_bounds__(256, 1) stream(const __grid_constant__ CUtensorMap map, int rows, int K, Cfg c, int* sink,
                                                 unsigned* done, unsigned done_target) {
  const int streamers = gridDim.x - c.pollers;
  if (static_cast<int>(blockIdx.x) >= streamers) {
    if (threadIdx.x < 32) {
      unsigned seen = 0, x = 0;
      long long t0 = clock64();
      while (seen < done_target && clock64() - t0 < 4000000000ll) {  // ~2 s: never hang if blocks are not co-resident
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(done + 32 + threadIdx.x) : "memory");
        x ^= v;
        seen = __shfl_sync(0xffffffffu, *(volatile unsigned*)done, 0);
      }
      if (x == 0x12345678u) sink[0] = x;
    }
    return;
  }
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int box_bytes = 128 * 64 * 2;
  const int stage_bytes = box_bytes * c.kbox * c.rbox;
  for (int i = threadIdx.x; c.math && i < 32 * 128 / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem + c.stages * stage_bytes)[i] = 0x30303030u;  // e4m3 0.125
  if (c.math) flashmoe::fence_proxy_async();  // those generic stores, before wgmma reads them (async proxy)
  __shared__ uint64_t full[16], empty[16];
  if (threadIdx.x == 0) { for (int s = 0; s < c.stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 4); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncthreads();
  const int tile_rows = 128 * c.rbox;
  const int tiles = rows / tile_rows / streamers * streamers;  // whole waves: no tail in the rate
  const int ksteps = K / ((c.fp8 ? 128 : 64) * c.kbox);  // a box is 128 B of K either way
  if (threadIdx.x == 0) {  // producer
    int s = 0; uint32_t ph = 0;
    const uint64_t policy = c.evict_first ? flashmoe::l2_policy_evict_first() : 0;  // once, as the kernel's producer does
    for (int t = blockIdx.x; t < tiles; t += streamers)
      for (int ks = 0; ks < ksteps; ++ks) {
        mbar_wait(&empty[s], ph ^ 1);
        mbar_expect(&full[s], stage_bytes);
        if (c.five_d) {
          const int k0 = ks * (c.fp8 ? 128 : 64), group = (t % 12) * 8, expert = t / 12;
          if (c.evict_first) flashmoe::tma_load_5d(smem + s * stage_bytes, &map, &full[s], k0, 0, 0, group, expert, policy);
          else tma5d(smem + s * stage_bytes, &map, &full[s], k0, 0, 0, group, expert);
        } else
        if (c.three_d) tma3d(smem + s * stage_bytes, &map, &full[s], ks * 64, 0, t * 16); else
        for (int r = 0; r < c.rbox; ++r)
          for (int b = 0; b < c.kbox; ++b)
            tma2d(smem + s * stage_bytes + (r * c.kbox + b) * box_bytes, &map, &full[s], (ks * c.kbox + b) * 64, t * tile_rows + r * 128);
        if (++s == c.stages) { s = 0; ph ^= 1; }
      }
  } else if (threadIdx.x >= 128 && threadIdx.x < 256) {  // consumer warpgroup: wait, touch, release
    int s = 0; uint32_t ph = 0; int acc = 0;
    float sums[2][16] = {};
    const uint64_t tokens = flashmoe::sw128_desc(smem_addr(smem + c.stages * stage_bytes));
    for (int t = blockIdx.x; t < tiles; t += streamers)
      for (int ks = 0; ks < ksteps; ++ks) {
        mbar_wait(&full[s], ph);
        if (c.math) {
          float partial[2][16];
          flashmoe::wgmma_fence();
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint64_t a = flashmoe::sw128_desc(smem_addr(smem + s * stage_bytes + h * 64 * 128));
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) flashmoe::WgmmaFp8<32>::mma(partial[h], a + 2 * kk, tokens + 2 * kk, kk > 0);
          }
          flashmoe::wgmma_commit();
          flashmoe::wgmma_wait<0>();
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            flashmoe::fence_accumulators(partial[h]);
#pragma unroll
            for (int i = 0; i < 16; ++i) sums[h][i] += partial[h][i];
          }
        } else {
          acc += smem[s * stage_bytes + (threadIdx.x - 128) * 16];
        }
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[s]);
        if (++s == c.stages) { s = 0; ph ^= 1; }
      }
    if (acc == 12345678 || sums[0][0] + sums[1][15] == 12345.f) sink[0] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) { __threadfence(); atomicAdd(done, 1u); }
}

__global__ void read_ld(const uint4* p, size_t n, int* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { uint4 v = __ldg(p + i); x ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (x == 0x12345678u) sink[0] = x;
}

typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

int main(int argc, char** argv) {
  const bool sweep = argc > 1 && std::string(argv[1]) == "sweep";
  // `tail`: the megakernel's fp8 GEMM0 tail streams at only ~30-40 GB/s per SM on 48-60 SMs (kernel_trace,
  // results/2026-11-23-h200x1-fp8-weights-stream.json) where this benchmark's 5-D box gave ~100 at 33 SMs: the same
  // 5-D stream with the kernel's evict-first hint and fp8 geometry (row stride 2048 B), on 48 and all SMs.
  const bool tail = argc > 1 && std::string(argv[1]) == "tail";
  const bool math = argc > 1 && std::string(argv[1]) == "math";
  const int E = 32, R = 1536, K = 2048;  // Qwen3-30B w13 per EP4 rank: 201 MB
  const size_t rows = (size_t)E * R, bytes = rows * K * 2;
  void* w; cudaMalloc(&w, bytes); cudaMemset(w, 1, bytes);
  int* sink; cudaMalloc(&sink, 4);
  unsigned* done; cudaMalloc(&done, 256); cudaMemset(done, 0, 256);
  unsigned finished = 0;  // done[0]: streaming blocks finished over all launches
  void* f; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
  EncodeFn enc = (EncodeFn)f;
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  // pure read reference
  for (int blocks : {sms * 2, sms * 4, sms * 8}) {
    read_ld<<<blocks, 512>>>((const uint4*)w, bytes / 16, sink);
    cudaEventRecord(a); for (int i = 0; i < 10; ++i) read_ld<<<blocks, 512>>>((const uint4*)w, bytes / 16, sink); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); printf("ld.global.nc.v4 %4d blocks x 512: %.2f TB/s\n", blocks, bytes * 10 / (ms * 1e-3) / 1e12);
  }
  struct Run { Cfg c; CUtensorMapL2promotion l2; const char* name; };
  std::vector<Run> runs = {
    {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "2D 16K x10"},
    {{10, 1, 1, 128, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D w13 x10"},
    {{10, 1, 1, 128, 1}, CU_TENSOR_MAP_L2_PROMOTION_NONE, "5D w13 x10 nopromo"},
    {{5, 1, 1, 128, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D w13 x5"},
    {{4, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x4"},
    {{6, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x6"},
    {{8, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x8"},
    {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x10"},
    {{12, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x12"},
    {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_NONE, "16K x10 no-promo"},
    {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, "16K x10 promo128"},
    {{3, 2, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "32K(2k) x3"},
    {{5, 2, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "32K(2k) x5"},
    {{6, 2, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "32K(2k) x6"},
    {{3, 4, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "64K(4k) x3"},
    {{5, 1, 2, 256}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "32K(2r) x5"},
  };
  if (sweep) {
    runs = {
        {{10, 1, 1, 128, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D w13 x10"},
        {{4, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x4"},
        {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "16K x10"},
        {{10, 1, 1, 128, 0, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "3D 8x16 16K x10"},
        {{10, 1, 1, 128, 0, 1}, CU_TENSOR_MAP_L2_PROMOTION_NONE, "3D 16K x10 nopro"},
        {{10, 1, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_NONE, "16K x10 nopromo"},
        {{6, 2, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "32K(2k) x6"},
        {{3, 4, 1, 128}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "64K(4k) x3"},
    };
  }
  if (tail) {
    runs = {
        {{8, 1, 1, 128, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D bf16 x8"},
        {{8, 1, 1, 128, 1, 0, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D bf16 x8 evict1st"},
        {{8, 1, 1, 128, 1, 0, 0, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D fp8 x8"},
        {{8, 1, 1, 128, 1, 0, 1, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D fp8 x8 evict1st"},
        // 48 streaming SMs beside 84 polling ones (the fp8 tail at T = 8: 48 SMs on GEMM0, the rest waiting).
        {{8, 1, 1, 128, 1, 0, 1, 1, 84}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "fp8 ef + 84 pollers"},
    };
  }
  if (math) {
    runs = {
        {{8, 1, 1, 128, 1, 0, 1, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "5D fp8 x8 evict1st"},
        {{8, 1, 1, 128, 1, 0, 1, 1, 0, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "fp8 ef + N32 math"},
        {{8, 1, 1, 128, 1, 0, 1, 1, 84, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "fp8 math+84 pollers"},
    };
  }
  std::vector<int> grids = sweep ? std::vector<int>{8, 33, 96, sms} : tail || math ? std::vector<int>{48, sms} : std::vector<int>{sms};
  printf("%-20s %6s %8s %8s %9s\n", "stage x count", "blocks", "TB/s", "KiB/SM", "GB/s/SM");
  for (int blocks : grids)
  for (auto& r : runs) {
    CUtensorMap map;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}; cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {64, 128}, unit[2] = {1, 1};
    cuuint64_t d5[5] = {(cuuint64_t)K, 8, 2, 768 / 8, (cuuint64_t)E}, s5[4] = {(cuuint64_t)K * 2, 768ull * K * 2, 8ull * K * 2, 1536ull * K * 2};
    cuuint32_t b5[5] = {64, 8, 2, 8, 1}, u5[5] = {1, 1, 1, 1, 1};
    cuuint64_t d3[3] = {(cuuint64_t)K, 8, (cuuint64_t)rows / 8}, s3[2] = {(cuuint64_t)K * 2, 8ull * K * 2};
    cuuint32_t b3[3] = {64, 8, 16};
    // fp8: the same rows as 2048 one-byte elements (half the tensor), boxes of 128 elements = 128 B.
    cuuint64_t d5f[5] = {(cuuint64_t)K, 8, 2, 768 / 8, (cuuint64_t)E}, s5f[4] = {(cuuint64_t)K, 768ull * K, 8ull * K, 1536ull * K};
    cuuint32_t b5f[5] = {128, 8, 2, 8, 1};
    if (r.c.three_d) { if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, w, d3, s3, b3, u5, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, r.l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) { printf("encode3 failed\n"); return 1; } } else
    if (r.c.five_d && r.c.fp8) { if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, w, d5f, s5f, b5f, u5, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, r.l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) { printf("encode5 fp8 failed\n"); return 1; } } else
    if (r.c.five_d) { if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, w, d5, s5, b5, u5, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, r.l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) { printf("encode5 failed\n"); return 1; } } else
    if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, r.l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) { printf("encode failed\n"); return 1; }
    const int smem = r.c.stages * 16384 * r.c.kbox * r.c.rbox + 1024 + (r.c.math ? 32 * 128 : 0);
    cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int streamers = blocks - r.c.pollers;
    if (streamers <= 0) continue;
    finished += streamers;
    stream<<<blocks, 256, smem>>>(map, (int)rows, K, r.c, sink, done, finished);
    cudaError_t e = cudaDeviceSynchronize(); if (e) { printf("%s: %s\n", r.name, cudaGetErrorString(e)); return 1; }
    const int reps = sweep || tail ? 3 : 10;
    cudaEventRecord(a); for (int i = 0; i < reps; ++i) { finished += streamers; stream<<<blocks, 256, smem>>>(map, (int)rows, K, r.c, sink, done, finished); } cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    const size_t tile_rows = 128 * r.c.rbox, moved = rows / tile_rows / streamers * streamers * tile_rows * K * (r.c.fp8 ? 1 : 2);
    const double tbs = moved * reps / (ms * 1e-3) / 1e12;
    printf("%-20s %6d %8.2f %8d %9.1f\n", r.name, streamers, tbs, r.c.stages * 16 * r.c.kbox * r.c.rbox, tbs * 1e3 / streamers);
  }
  return 0;
}
