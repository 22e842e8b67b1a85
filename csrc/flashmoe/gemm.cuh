// Tensor-core tile GEMM for the expert tasks: C[64 x 128] = A[64 x K] * B[128 x K]^T, bf16 in, fp32 accumulate.
//
// A rows are gathered (a row pointer per tile row; missing rows are zero-filled), B is a weight slab
// read in place from the engine's tensors (rows = output features, K contiguous), so no weight is copied or
// repacked at call time. mma.sync m16n8k16 with ldmatrix, 3-stage cp.async pipeline, 8 warps as 2 (M) x 4 (N),
// each warp 32 x 32. For the fused SwiGLU GEMM0 the 128 B rows are 64 gate rows then 64 up rows, and each
// warp takes 16 gate columns and the same 16 up columns, so a thread holds gate and up of the same output
// element and the activation happens in registers.
#pragma once

#include "common.cuh"

namespace flashmoe {

constexpr int kBlockM = 64;
constexpr int kBlockN = 128;
constexpr int kBlockK = 64;
constexpr int kStages = 3;
constexpr int kSmemStride = kBlockK + 8;  // +16 B per row: ldmatrix rows hit distinct banks
constexpr int kStageElems = (kBlockM + kBlockN) * kSmemStride;
constexpr int kGemmSmemBytes = kStages * kStageElems * 2;

struct Accum {
  float c[2][4][4];  // [m16 fragment][n8 fragment][element]
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill without reading
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B-tile row where n8 fragment pair `pair` (0: fragments 0-1, 1: fragments 2-3) of warp column `wn` starts.
template <bool kSwiGLU>
__device__ __forceinline__ int b_pair_row(int wn, int pair) {
  if constexpr (kSwiGLU) return pair * (kBlockN / 2) + wn * 16;  // gate cols, then the same up cols
  else return wn * 32 + pair * 16;
}

// a_rows[r]: start of tile row r (nullptr = absent, zero-filled). b: first of 128 rows, row stride ldb.
// `b_row_offset(i)` maps tile row i in [0,128) to the element offset of that B row.
template <bool kSwiGLU, typename BRowOffset>
__device__ void gemm_tile(const bf16* const* a_rows, const bf16* b, BRowOffset b_row_offset, int K, bf16* smem,
                          Accum& acc) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.c[i][j][e] = 0.f;

  const int k_tiles = K / kBlockK;
  auto load_stage = [&](int stage, int kt) {
    bf16* sa = smem + stage * kStageElems;
    bf16* sb = sa + kBlockM * kSmemStride;
    const int k0 = kt * kBlockK;
    // A: 64 rows x 8 chunks of 16 B = 512 chunks, 2 per thread.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads, row = c >> 3, col = (c & 7) * 8;
      const bf16* src = a_rows[row];
      cp_async_16(sa + row * kSmemStride + col, src ? src + k0 + col : b, src != nullptr);
    }
    // B: 128 rows x 8 chunks = 1024 chunks, 4 per thread.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * kThreads, row = c >> 3, col = (c & 7) * 8;
      cp_async_16(sb + row * kSmemStride + col, b + b_row_offset(row) + k0 + col, true);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();

    const bf16* sa = smem + (kt % kStages) * kStageElems;
    const bf16* sb = sa + kBlockM * kSmemStride;
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t a[2][4], bq[2][4];
#pragma unroll
      for (int mf = 0; mf < 2; ++mf) {
        const int row = wm * 32 + mf * 16 + (lane & 15);
        const int col = kk * 16 + (lane >> 4) * 8;
        ldmatrix_x4(a[mf], sa + row * kSmemStride + col);
      }
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const int row = b_pair_row<kSwiGLU>(wn, pair) + (lane >> 4) * 8 + (lane & 7);
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(bq[pair], sb + row * kSmemStride + col);
      }
#pragma unroll
      for (int mf = 0; mf < 2; ++mf)
#pragma unroll
        for (int nf = 0; nf < 4; ++nf) {
          const uint32_t* q = bq[nf >> 1];
          mma_bf16(acc.c[mf][nf], a[mf], q[(nf & 1) * 2], q[(nf & 1) * 2 + 1]);
        }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the caller may reuse smem for its epilogue
}

// Output coordinates of accumulator element (mf, nf, e) for this thread, in the 64 x 128 tile
// (for kSwiGLU, the column is the intermediate column within the 64-wide tile; nf 0-1 gate, 2-3 up).
template <bool kSwiGLU>
__device__ __forceinline__ void acc_coord(int mf, int nf, int e, int& row, int& col) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
  row = wm * 32 + mf * 16 + (lane >> 2) + (e >> 1) * 8;
  if constexpr (kSwiGLU) col = wn * 16 + (nf & 1) * 8 + (lane & 3) * 2 + (e & 1);
  else col = wn * 32 + nf * 8 + (lane & 3) * 2 + (e & 1);
}

}  // namespace flashmoe
