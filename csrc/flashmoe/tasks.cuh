// Expert tasks: what each GEMM phase reads and where its tiles go. The GEMM engine (gemm.cuh) does the math.
//   GEMM0: act = silu(x W_gate^T) * (x W_up^T); x = received rows gathered through the expert's list,
//          W = the engine's w13 read in place (gate and up rows of 32 features per consumer, one mainloop).
//   GEMM1: y = act W2^T, each bf16 row written straight into the combine buffer of the rank that owns the
//          token, at slot (token, j), so the source reduces over j in a fixed order (no atomics).
// Producer functions run on warpgroup 0, consumer functions on warpgroups 1 and 2; both walk the same
// task list, so their pipeline states stay in step.
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "gemm.cuh"
#include "params.cuh"
#include "scheduler.cuh"

namespace flashmoe {

constexpr int kGemm0TileFeatures = kInterMultiple;   // 64 intermediate features (x2 rows: gate and up)
constexpr int kGemm1TileFeatures = kHiddenMultiple;  // 128 hidden features

__device__ __forceinline__ const int* expert_list(const Params& p, int expert) {
  return ws_ptr<int>(p, p.ws_off.expert_rows) + static_cast<int64_t>(expert) * p.expert_rows_stride;
}

// ---------------------------------------------------------------- GEMM0
// The GEMM loops are separate functions without NVSHMEM calls: ptxas serialises every wgmma of a function
// that calls an external (relocatable) device function.
__device__ __noinline__ void produce_gemm0(const Params& p, const GemmSmem& g, const ExpertTable& table, PipeState& st) {
  const int feature_tiles = p.intermediate_size / kGemm0TileFeatures;
  const int total = total_tasks(table, p.num_local, feature_tiles);
  const bf16* recv = sym_ptr<bf16>(p, p.sym_off.recv_tokens);
  for (int index = blockIdx.x; index < total; index += gridDim.x) {
    const Task task = decode_task(table, p.num_local, feature_tiles, index);
    const int* list = expert_list(p, task.expert) + task.first_row;
    // w13 viewed as [2 E_l][I/8][8][H]: one box = 8 gate rows then the same 8 features' up rows.
    produce_tile(
        p, g, st, task.tile_tokens, task.rows, p.hidden_size / kTileK,
        [&](int r) { return recv + static_cast<int64_t>(ldcg(list + r) >> 4) * p.hidden_size; },
        [&](char* stage, uint64_t* full, int k0) {
#pragma unroll
          for (int q = 0; q < kGemm0TileFeatures / 8; ++q)
            tma_load_4d(stage + q * 16 * 128, &p.tmap_w13, full, k0, 0,
                        task.feature_tile * (kGemm0TileFeatures / 8) + q, 2 * task.expert);
        });
  }
}

__device__ void consume_gemm0(const Params& p, const GemmSmem& g, const ExpertTable& table, PipeState& st) {
  const int consumer = threadIdx.x / 128 - 1, tid = threadIdx.x & 127;
  const int feature_tiles = p.intermediate_size / kGemm0TileFeatures;
  const int total = total_tasks(table, p.num_local, feature_tiles);
  bf16* staging = g.staging(consumer);
  constexpr int kFeatures = kGemm0TileFeatures / kConsumers;  // 32 per consumer
  for (int index = blockIdx.x; index < total; index += gridDim.x) {
    const Task task = decode_task(table, p.num_local, feature_tiles, index);
    st = mma_tile_to_staging<true>(p, g, st, task.tile_tokens, p.hidden_size / kTileK, staging);
    consumer_sync(consumer);
    bf16* act = ws_ptr<bf16>(p, p.ws_off.act) +
                static_cast<int64_t>(table.row_offset[task.expert] + task.first_row) * p.intermediate_size +
                task.feature_tile * kGemm0TileFeatures + consumer * kFeatures;
    constexpr int kChunks = kFeatures / 8;  // 16-byte chunks per row
    for (int c = tid; c < task.rows * kChunks; c += 128) {
      const int r = c / kChunks, q = c % kChunks;
      *reinterpret_cast<uint4*>(act + static_cast<int64_t>(r) * p.intermediate_size + q * 8) =
          *reinterpret_cast<const uint4*>(staging + r * kStagingStride + q * 8);
    }
    consumer_sync(consumer);  // staging is rewritten by the next tile
  }
}

// ---------------------------------------------------------------- GEMM1
__device__ __noinline__ void produce_gemm1(const Params& p, const GemmSmem& g, const ExpertTable& table, PipeState& st) {
  const int feature_tiles = p.hidden_size / kGemm1TileFeatures;
  const int total = total_tasks(table, p.num_local, feature_tiles);
  const bf16* act = ws_ptr<bf16>(p, p.ws_off.act);
  for (int index = blockIdx.x; index < total; index += gridDim.x) {
    const Task task = decode_task(table, p.num_local, feature_tiles, index);
    const int64_t first = table.row_offset[task.expert] + task.first_row;
    // w2 viewed as [E_l H][I]: one box = the tile's 128 output-feature rows.
    produce_tile(
        p, g, st, task.tile_tokens, task.rows, p.intermediate_size / kTileK,
        [&](int r) { return act + (first + r) * p.intermediate_size; },
        [&](char* stage, uint64_t* full, int k0) {
          tma_load_2d(stage, &p.tmap_w2, full, k0, task.expert * p.hidden_size + task.feature_tile * kGemm1TileFeatures);
        });
  }
}

// Returns the bytes this thread's tiles sent to other ranks (metrics).
__device__ int64_t consume_gemm1(const Params& p, const PeerTable& peers, bool any_proxied, const GemmSmem& g,
                                 const ExpertTable& table, PipeState& st) {
  const int consumer = threadIdx.x / 128 - 1, tid = threadIdx.x & 127;
  const int feature_tiles = p.hidden_size / kGemm1TileFeatures;
  const int total = total_tasks(table, p.num_local, feature_tiles);
  const int k = p.top_k, H = p.hidden_size;
  const int* meta = sym_ptr<int>(p, p.sym_off.recv_meta);
  bf16* staging = g.staging(consumer);
  int64_t* row_dst = g.row_dst(consumer);
  int* row_rank = g.row_rank(consumer);
  // Put path: this consumer's slot of the block's registered staging tile.
  bf16* put_stage = sym_ptr<bf16>(p, p.sym_off.combine_stage) +
                    (static_cast<int64_t>(blockIdx.x) * kConsumers + consumer) * kMaxTileTokens * kConsumerRows;
  int64_t remote_bytes = 0;
  for (int index = blockIdx.x; index < total; index += gridDim.x) {
    const Task task = decode_task(table, p.num_local, feature_tiles, index);
    st = mma_tile_to_staging<false>(p, g, st, task.tile_tokens, p.intermediate_size / kTileK, staging);
    if (tid < task.rows) {  // where each row goes: (source rank, element offset in its combine buffer)
      const int entry = ldcg(expert_list(p, task.expert) + task.first_row + tid);
      const int64_t row = entry >> 4;  // source * max_tokens + slot
      const int j = entry & 15;
      const int token = ldcg(meta + row * meta_stride(k));
      row_rank[tid] = static_cast<int>(row / p.max_tokens_per_rank);
      row_dst[tid] = (static_cast<int64_t>(token) * k + j) * H + task.feature_tile * kGemm1TileFeatures +
                     consumer * kConsumerRows;
    }
    consumer_sync(consumer);
    constexpr int kChunks = kConsumerRows / 8;  // 16-byte chunks per 128-byte row
    for (int c = tid; c < task.rows * kChunks; c += 128) {
      const int r = c / kChunks, q = c % kChunks;
      const int dst = row_rank[r];
      const uint4 value = *reinterpret_cast<const uint4*>(staging + r * kStagingStride + q * 8);
      if (use_p2p(peers, dst)) {
        bf16* base = reinterpret_cast<bf16*>(peers.base[dst] + p.sym_off.combine_rows);
        *reinterpret_cast<uint4*>(base + row_dst[r] + q * 8) = value;
      } else {
        *reinterpret_cast<uint4*>(put_stage + r * kConsumerRows + q * 8) = value;
      }
      if (q == 0 && dst != p.rank) remote_bytes += kConsumerRows * 2;
    }
    if (any_proxied) {
      // Proxied rows: one put per row segment from the registered staging tile, complete before reuse.
      consumer_sync(consumer);
      if (tid < task.rows && !use_p2p(peers, row_rank[tid]))
        nvshmem_putmem_nbi(sym_ptr<bf16>(p, p.sym_off.combine_rows) + row_dst[tid], put_stage + tid * kConsumerRows,
                           kConsumerRows * 2, row_rank[tid]);
      consumer_sync(consumer);
      if (tid == 0) nvshmem_quiet();
    }
    consumer_sync(consumer);  // staging and the row table are rewritten by the next tile
  }
  return remote_bytes;
}

}  // namespace flashmoe
