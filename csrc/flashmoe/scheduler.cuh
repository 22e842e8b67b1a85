// Static task scheduler: after the receive phase every block knows the per-expert row counts, builds the
// same prefix table in shared memory, and walks a flat task index (blockIdx.x, + gridDim.x, ...).
//
// A task is one (expert, feature tile, token tile). Each expert gets the smallest token tile that holds its
// rows (32, 64, else 128-row tiles), so decode experts with a handful of rows cost one weight pass.
// Order: expert-major, then feature tile, then token tile fastest, so the token tiles of one weight tile run
// at the same time on neighbouring blocks and the weights stream from HBM once per layer call.
#pragma once

#include "common.cuh"
#include "gemm.cuh"
#include "params.cuh"

namespace flashmoe {

struct ExpertTable {
  int count[kMaxLocalExperts];             // rows received per local expert
  int row_offset[kMaxLocalExperts + 1];    // first activation row of each expert (prefix of counts)
  int tile_offset[kMaxLocalExperts + 1];   // first token tile of each expert (prefix of its tile counts)
};

__device__ __forceinline__ int token_tiles(int rows) { return rows == 0 ? 0 : ceil_div(rows, tile_tokens_for(rows)); }

// Fill the table from the workspace counters (all blocks compute the same thing).
__device__ void build_expert_table(const Params& p, ExpertTable& t) {
  const uint32_t* counts = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
  for (int e = threadIdx.x; e < p.num_local; e += blockDim.x) t.count[e] = static_cast<int>(__ldcg(counts + e));
  __syncthreads();
  if (threadIdx.x == 0) {
    int rows = 0, tiles = 0;
    for (int e = 0; e < p.num_local; ++e) {
      t.row_offset[e] = rows;
      t.tile_offset[e] = tiles;
      rows += t.count[e];
      tiles += token_tiles(t.count[e]);
    }
    t.row_offset[p.num_local] = rows;
    t.tile_offset[p.num_local] = tiles;
  }
  __syncthreads();
}

struct Task {
  int expert;        // local expert
  int feature_tile;  // output feature tile
  int first_row;     // first row of the token tile within the expert's rows
  int rows;          // valid rows in the token tile (1..tile_tokens)
  int tile_tokens;   // 32, 64 or 128
};

__device__ __forceinline__ int total_tasks(const ExpertTable& t, int num_local, int feature_tiles) {
  return t.tile_offset[num_local] * feature_tiles;
}

// Flat task index -> task. Binary search for the last expert whose first task is <= index (experts without
// rows own no task, so the one found has tiles).
__device__ __forceinline__ Task decode_task(const ExpertTable& t, int num_local, int feature_tiles, int index) {
  int lo = 0, hi = num_local - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.tile_offset[mid] * feature_tiles <= index) lo = mid;
    else hi = mid - 1;
  }
  const int tiles = t.tile_offset[lo + 1] - t.tile_offset[lo];
  const int local = index - t.tile_offset[lo] * feature_tiles;
  Task k;
  k.expert = lo;
  k.feature_tile = local / tiles;
  k.tile_tokens = tile_tokens_for(t.count[lo]);
  k.first_row = (local % tiles) * k.tile_tokens;
  const int left = t.count[lo] - k.first_row;
  k.rows = left < k.tile_tokens ? left : k.tile_tokens;
  return k;
}

}  // namespace flashmoe
