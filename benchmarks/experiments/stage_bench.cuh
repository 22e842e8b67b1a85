// What the stage microbenchmarks share (prefill_stage.cu, wide_stage_loads.cu, wgmma_rate.cu): the load cases, a 2-D
// TMA box load, the row hash that picks gathered token rows, the 2-D tensor maps over byte rows, and the best-of-5
// event timing. Each file keeps its own kernel: only these pieces are the same.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "flashmoe/hopper.cuh"

namespace stage_bench {

// Where a stage's weights come from, and how its token rows are loaded (the files' headers say what each does).
enum Weights { kWeightsHbm, kWeightsL2 };
enum Tokens { kTokensGather, kTokensTma, kTokensNone };
inline const char* const kWeightNames[] = {"hbm", "l2"};
inline const char* const kTokenNames[] = {"gather", "tma", "none"};

struct Config {
  int weights, tokens, math;
  int tiles_per_block;
};

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

// `rows` rows of `row_bytes` bytes as a 2-D map whose box is 128 rows x 128 B, 128-byte swizzled (a stage's box).
inline bool encode_rows(EncodeFn enc, CUtensorMap* map, void* data, int64_t rows, int64_t row_bytes) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {128, 128}, unit[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, data, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
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
