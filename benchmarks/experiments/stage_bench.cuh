// What the stage microbenchmarks share (prefill_stage.cu, wide_stage_loads.cu, wgmma_rate.cu): the load cases, the
// ring's set-up and its producer (the kernel's TMA weight boxes and token-row gather), the inputs and their 2-D tensor
// maps, and the best-of-5 event timing of every case. Each file keeps its own consumers (the stage's math is what
// differs) and its table.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "flashmoe/hopper.cuh"

namespace stage_bench {

// Where a stage's weights come from, and how its token rows are loaded (the files' headers say what each does).
// kWeightsHbmShared4: distinct weight tiles as "hbm", each read by four neighbouring blocks at once (a prefill call's
// token tiles of one expert: the first read from HBM, the other three mostly from L2 while it is in flight).
enum Weights { kWeightsHbm, kWeightsL2, kWeightsHbmShared4 };
enum Tokens { kTokensGather, kTokensTma, kTokensNone };
inline const char* const kWeightNames[] = {"hbm", "l2", "hbm-x4"};
inline const char* const kTokenNames[] = {"gather", "tma", "none"};

struct Config {
  int weights, tokens, math;
  int tiles_per_block;
};

// A ring position: the slot and the parity its barriers' next phase completes with.
template <int kRing>
struct RingPosition {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kRing) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// A consumer warp's release of a stage it has read (the ring's empty barrier counts every consumer warp once).
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) flashmoe::mbar_arrive(empty);
}

// Keeps the sums' math alive: their total is stored only if it equals a value these inputs never give.
template <int R>
__device__ __forceinline__ void sink_sums(const float (&acc)[R], float* sink) {
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) total += acc[i];
  if (total == 12345.f) sink[threadIdx.x] = total;
}

// The weight tile tile `tile` reads (of `weight_tiles`).
__device__ __forceinline__ int weight_tile_of(int tile, int weight_tiles, const Config& c) {
  return (c.weights == kWeightsHbmShared4 ? tile / 4 : tile) % weight_tiles;
}

// One 2-D box of `map` at (c0, c1) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(flashmoe::smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(flashmoe::smem_addr(bar)), "r"(c0),
      "r"(c1)
      : "memory");
}

// A well-mixed 32-bit hash: gathered token rows at random.
__device__ __forceinline__ uint32_t hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  return x ^ (x >> 16);
}

typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                             const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, through the runtime (no -lcuda).
inline EncodeFn encode_fn() {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
  return reinterpret_cast<EncodeFn>(f);
}

// `rows` rows of `row_bytes` bytes as a 2-D map whose box is 128 rows x `box_bytes` (128 or 64) B, swizzled at that
// width (a stage's box).
inline bool encode_rows(EncodeFn enc, CUtensorMap* map, void* data, int64_t rows, int64_t row_bytes, int box_bytes) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes), 128}, unit[2] = {1, 1};
  const CUtensorMapSwizzle swizzle = box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, data, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Every thread of the block, at the start: the ring's barriers (a stage lands on its TMA bytes and, gathered,
// the 128 producer threads' cp.async; it is released by the 8 consumer warps) and, with no token rows loaded, the
// ring filled once with `fill` (finite values for the wgmmas).
template <int kRing>
__device__ __forceinline__ void setup_ring(char* base, uint64_t (&full)[kRing], uint64_t (&empty)[kRing],
                                           const Config& c, int ring_bytes, uint32_t fill) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      flashmoe::mbar_init(&full[s], 1 + (c.tokens == kTokensGather ? 128 : 0));
      flashmoe::mbar_init(&empty[s], 8);  // every consumer warp
    }
    flashmoe::mbar_init_fence();
  }
  if (c.tokens == kTokensNone) {  // finite token rows, once
    for (int i = threadIdx.x; i < ring_bytes / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(base)[i] = fill;
    flashmoe::fence_proxy_async();
  }
  __syncthreads();
}

// The producer warpgroup: fills the ring, tile after tile (tile i of block b is b + i x blocks), with kBoxes TMA
// boxes of 128 weight rows x kStepBytes per stage (weight tile t's rows 128 kBoxes t on) and then the tile's 128
// token rows, K step after K step of kStepBytes (128 or 64, the maps' box width and swizzle): gathered (cp.async of
// 16 B, kStepBytes / 16 per thread, from rows picked by `hash`, in the stage's swizzle: a row's 16-byte chunk index
// XOR its address bits 7 on), one TMA box of contiguous rows, or none.
template <int kBoxes, int kRing, int kStageBytes, int kStepBytes = 128>
__device__ __forceinline__ void produce_ring(char* base, uint64_t (&full)[kRing], uint64_t (&empty)[kRing],
                                             const CUtensorMap* weights_map, const CUtensorMap* tokens_map,
                                             const uint8_t* tokens, int64_t row_bytes, int token_rows, int weight_tiles,
                                             const Config& c) {
  static_assert(kStepBytes == 128 || kStepBytes == 64, "a stage's K step: 128 or 64 bytes of each row");
  constexpr int kBox = 128 * kStepBytes;
  constexpr int kChunks = kStepBytes / 16;     // 16-byte chunks of a row's K step
  constexpr int kRowsPerPass = 128 / kChunks;  // rows the 128 threads fill at once
  const int tid = threadIdx.x, chunk = tid % kChunks;
  const int k_steps = static_cast<int>(row_bytes / kStepBytes);
  RingPosition<kRing> at;
  for (int i = 0; i < c.tiles_per_block; ++i) {
    const int tile = blockIdx.x + i * gridDim.x;
    const int weight_tile = weight_tile_of(tile, weight_tiles, c);
    const uint8_t* row[kChunks];
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int r = tid / kChunks + kRowsPerPass * j;
      row[j] = tokens + static_cast<int64_t>(hash(tile * 128 + r) % token_rows) * row_bytes;
    }
    for (int ks = 0; ks < k_steps; ++ks) {
      while (!flashmoe::mbar_try_wait(&empty[at.slot], at.phase ^ 1u)) {
      }
      char* stage = base + at.slot * kStageBytes;
      uint64_t* full_bar = &full[at.slot];
      if (tid == 0) {
        flashmoe::mbar_arrive_expect_tx(full_bar, kBox * (kBoxes + (c.tokens == kTokensTma ? 1 : 0)));
#pragma unroll
        for (int b = 0; b < kBoxes; ++b)
          tma_2d(stage + b * kBox, weights_map, full_bar, ks * kStepBytes, weight_tile * 128 * kBoxes + 128 * b);
        if (c.tokens == kTokensTma)
          tma_2d(stage + kBoxes * kBox, tokens_map, full_bar, ks * kStepBytes, (tile * 128) % token_rows);
      }
      __syncwarp();
      if (c.tokens == kTokensGather) {
        const uint32_t dst0 = flashmoe::smem_addr(stage + kBoxes * kBox);
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const int r = tid / kChunks + kRowsPerPass * j;
          const int swizzled = chunk ^ (((r * kStepBytes) >> 7) & (kChunks - 1));
          flashmoe::cp_async_16(dst0 + r * kStepBytes + (swizzled << 4), row[j] + ks * kStepBytes + chunk * 16, true);
        }
        flashmoe::mbar_arrive_on_cp_async(full_bar);
      }
      at.advance();
    }
  }
}

// Best of 5 timed `launch()`es after a warm-up one, in ms; negative (the error printed after `name`) on an error.
template <typename Launch>
float best_of_5_ms(const char* name, Launch launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();  // warm-up
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("%-44s error %s\n", name, cudaGetErrorString(err));
    return -1.f;
  }
  return best;
}

}  // namespace stage_bench

namespace stage_bench {

// The benchmarks' inputs on the device: `hbm_rows` weight rows (the "l2" case's map covers the first `l2_rows`) and
// `token_rows` token rows, all of `row_bytes` bytes set to `fill`, with their tensor maps (boxes of 128 rows x
// `box_bytes`; `encode` draws them again for another box width).
struct StageInputs {
  uint8_t* weights = nullptr;
  uint8_t* tokens = nullptr;
  float* sink = nullptr;
  int64_t hbm_rows = 0, row_bytes = 0;
  int l2_rows = 0, token_rows = 0;
  CUtensorMap weights_hbm, weights_l2, tokens_map;

  bool make(int64_t hbm_rows_, int l2_rows_, int token_rows_, int64_t row_bytes_, int fill, int box_bytes = 128) {
    hbm_rows = hbm_rows_, l2_rows = l2_rows_, token_rows = token_rows_, row_bytes = row_bytes_;
    cudaMalloc(&weights, hbm_rows * row_bytes);
    cudaMalloc(&tokens, token_rows * row_bytes);
    cudaMalloc(&sink, 1024 * sizeof(float));
    cudaMemset(weights, fill, hbm_rows * row_bytes);
    cudaMemset(tokens, fill, token_rows * row_bytes);
    return encode(box_bytes);
  }

  bool encode(int box_bytes) {
    const EncodeFn enc = encode_fn();
    if (encode_rows(enc, &weights_hbm, weights, hbm_rows, row_bytes, box_bytes) &&
        encode_rows(enc, &weights_l2, weights, l2_rows, row_bytes, box_bytes) &&
        encode_rows(enc, &tokens_map, tokens, token_rows, row_bytes, box_bytes))
      return true;
    std::printf("tensor map encode failed (box %d B)\n", box_bytes);
    return false;
  }
};

// Every case ({weights, tokens, math}) of `cases` on every SM: `tiles_per_block` tiles of `k_steps` stages per block,
// best of 5; `report(config, us per stage)` prints its line. Returns 1 on an error, else 0.
template <typename Kernel, int kCases, typename Report>
int run_cases(const char* name, Kernel kernel, int smem, const StageInputs& in, int tiles_per_block, int k_steps,
              const int (&cases)[kCases][3], Report report) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (const auto& k : cases) {
    const Config c{k[0], k[1], k[2], tiles_per_block};
    const CUtensorMap& wmap = c.weights == kWeightsL2 ? in.weights_l2 : in.weights_hbm;
    const float best =
        best_of_5_ms(name, [&] { kernel<<<sms, 384, smem>>>(wmap, in.tokens_map, in.tokens, c, in.sink); });
    if (best < 0) return 1;
    report(c, best * 1e3 / (static_cast<double>(tiles_per_block) * k_steps));
  }
  return 0;
}

}  // namespace stage_bench
