// Expert tasks on a 64-row tile of one local expert.
//   GEMM0: act = silu(x W_gate^T) * (x W_up^T), x gathered from the receive buffer, W = the engine's w13.
//   GEMM1: y = act W2^T, written as bf16 straight into the combine buffer of the rank that owns the token, at
//          slot (token, j), so the source can reduce over j in a fixed order (deterministic, no atomics).
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "gemm.cuh"
#include "params.cuh"
#include "scheduler.cuh"

namespace flashmoe {

struct TileRows {
  const bf16* a[kBlockM];     // A row pointers (nullptr past the valid rows)
  int64_t dst_offset[kBlockM];  // GEMM1: element offset of the row in the owner's combine buffer
  int dst_rank[kBlockM];
};

__device__ void run_gemm0_task(const Params& p, const ExpertTable& table, const Task& task, TileRows& rows,
                               bf16* smem) {
  const int H = p.hidden, I = p.inter;
  const int* list = ws_ptr<int>(p, p.ws_off.expert_rows) + static_cast<int64_t>(task.expert) * p.expert_rows_stride;
  const bf16* recv = sym_ptr<bf16>(p, p.sym_off.recv_tokens);
  if (threadIdx.x < kBlockM) {
    const int r = threadIdx.x;
    rows.a[r] = r < task.rows ? recv + static_cast<int64_t>(ldcg(list + task.m_tile * kBlockM + r) >> 4) * H : nullptr;
  }
  __syncthreads();
  const bf16* w = p.w13 + static_cast<int64_t>(task.expert) * 2 * I * H;
  const int n0 = task.n_tile * (kBlockN / 2);
  auto b_row = [=](int i) -> int64_t {
    return static_cast<int64_t>(i < kBlockN / 2 ? n0 + i : I + n0 + i - kBlockN / 2) * H;
  };
  Accum acc;
  gemm_tile<true>(rows.a, w, b_row, H, smem, acc);

  bf16* act = ws_ptr<bf16>(p, p.ws_off.act) +
              static_cast<int64_t>(table.row_offset[task.expert] + task.m_tile * kBlockM) * I + n0;
#pragma unroll
  for (int mf = 0; mf < 2; ++mf)
#pragma unroll
    for (int nf = 0; nf < 2; ++nf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row, col;
        acc_coord<true>(mf, nf, h * 2, row, col);
        if (row < task.rows) {
          const float g0 = acc.c[mf][nf][h * 2], g1 = acc.c[mf][nf][h * 2 + 1];
          const float u0 = acc.c[mf][nf + 2][h * 2], u1 = acc.c[mf][nf + 2][h * 2 + 1];
          *reinterpret_cast<__nv_bfloat162*>(act + static_cast<int64_t>(row) * I + col) =
              __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
        }
      }
  __syncthreads();  // rows.a is rewritten by the next task
}

// Returns the bytes this task sent to other ranks (metrics).
__device__ int64_t run_gemm1_task(const Params& p, const PeerTable& peers, const ExpertTable& table, const Task& task,
                                  TileRows& rows, bf16* smem) {
  const int H = p.hidden, I = p.inter, k = p.top_k;
  const int* list = ws_ptr<int>(p, p.ws_off.expert_rows) + static_cast<int64_t>(task.expert) * p.expert_rows_stride;
  const int* meta = sym_ptr<int>(p, p.sym_off.recv_meta);
  const bf16* act = ws_ptr<bf16>(p, p.ws_off.act) +
                    static_cast<int64_t>(table.row_offset[task.expert] + task.m_tile * kBlockM) * I;
  const int n0 = task.n_tile * kBlockN;
  if (threadIdx.x < kBlockM) {
    const int r = threadIdx.x;
    rows.a[r] = r < task.rows ? act + static_cast<int64_t>(r) * I : nullptr;
    if (r < task.rows) {
      const int entry = ldcg(list + task.m_tile * kBlockM + r);
      const int64_t row = entry >> 4;  // source * max_tokens + slot
      const int j = entry & 15;
      const int src = static_cast<int>(row / p.max_tokens);
      const int token = ldcg(meta + row * meta_stride(k));
      rows.dst_rank[r] = src;
      rows.dst_offset[r] = (static_cast<int64_t>(token) * k + j) * H + n0;
    }
  }
  __syncthreads();
  const bf16* w = p.w2 + static_cast<int64_t>(task.expert) * H * I;
  auto b_row = [=](int i) -> int64_t { return static_cast<int64_t>(n0 + i) * I; };
  Accum acc;
  gemm_tile<false>(rows.a, w, b_row, I, smem, acc);

  // Stage the bf16 tile in shared memory, then move whole 256-byte row segments.
  constexpr int kOutStride = kBlockN + 8;
  bf16* tile = smem;
#pragma unroll
  for (int mf = 0; mf < 2; ++mf)
#pragma unroll
    for (int nf = 0; nf < 4; ++nf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row, col;
        acc_coord<false>(mf, nf, h * 2, row, col);
        *reinterpret_cast<__nv_bfloat162*>(tile + row * kOutStride + col) =
            __floats2bfloat162_rn(acc.c[mf][nf][h * 2], acc.c[mf][nf][h * 2 + 1]);
      }
  __syncthreads();

  constexpr int kVecPerRow = kBlockN / 8;
  int64_t remote_bytes = 0;
  bool any_put = false;
  for (int c = threadIdx.x; c < task.rows * kVecPerRow; c += blockDim.x) {
    const int r = c / kVecPerRow, v = c % kVecPerRow;
    const int dst = rows.dst_rank[r];
    const uint4 value = *reinterpret_cast<const uint4*>(tile + r * kOutStride + v * 8);
    if (use_p2p(peers, dst)) {
      bf16* base = reinterpret_cast<bf16*>(peers.base[dst] + p.sym_off.combine_rows);
      *reinterpret_cast<uint4*>(base + rows.dst_offset[r] + v * 8) = value;
    } else {
      bf16* stage = sym_ptr<bf16>(p, p.sym_off.combine_stage) + static_cast<int64_t>(blockIdx.x) * kBlockM * kBlockN;
      *reinterpret_cast<uint4*>(stage + r * kBlockN + v * 8) = value;
      any_put = true;
    }
    if (v == 0 && dst != p.rank) remote_bytes += kBlockN * 2;
  }
  if (__syncthreads_or(any_put)) {
    // Proxied rows: one put per row segment from the registered staging tile.
    bf16* stage = sym_ptr<bf16>(p, p.sym_off.combine_stage) + static_cast<int64_t>(blockIdx.x) * kBlockM * kBlockN;
    if (threadIdx.x < task.rows && !use_p2p(peers, rows.dst_rank[threadIdx.x])) {
      const int r = threadIdx.x;
      nvshmem_putmem_nbi(sym_ptr<bf16>(p, p.sym_off.combine_rows) + rows.dst_offset[r], stage + r * kBlockN,
                         kBlockN * 2, rows.dst_rank[r]);
    }
    __syncthreads();
    if (threadIdx.x == 0) nvshmem_quiet();  // the staging tile is reused by the next task
  }
  __syncthreads();
  return remote_bytes;
}

}  // namespace flashmoe
