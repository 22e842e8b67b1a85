// Static task scheduler: after the receive phase every block knows the per-expert row counts, builds the
// same prefix table in shared memory, and walks a flat task index (blockIdx.x, + gridDim.x, ...).
// Tasks are ordered expert-major, so the n-tiles of one expert run at the same time on neighbouring blocks
// and its weights are streamed from HBM once per layer, whatever the number of source ranks.
#pragma once

#include "common.cuh"
#include "gemm.cuh"
#include "params.cuh"

namespace flashmoe {

struct ExpertTable {
  int row_offset[kMaxLocalExperts + 1];   // first activation row of each expert (prefix of counts)
  int tile_offset[kMaxLocalExperts + 1];  // first m-tile of each expert (prefix of ceil(count / 64))
  int count[kMaxLocalExperts];
};

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
      tiles += ceil_div(t.count[e], kBlockM);
    }
    t.row_offset[p.num_local] = rows;
    t.tile_offset[p.num_local] = tiles;
  }
  __syncthreads();
}

struct Task {
  int expert;   // local expert
  int m_tile;   // within the expert
  int n_tile;
  int rows;     // valid rows in this m-tile (1..64)
};

// Task index -> (expert, m-tile, n-tile), n fastest. Binary search over the m-tile prefix.
__device__ __forceinline__ Task decode_task(const ExpertTable& t, int num_local, int n_tiles, int task) {
  const int m_global = task / n_tiles;
  int lo = 0, hi = num_local - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.tile_offset[mid] <= m_global) lo = mid;
    else hi = mid - 1;
  }
  Task k;
  k.expert = lo;
  k.m_tile = m_global - t.tile_offset[lo];
  k.n_tile = task % n_tiles;
  const int left = t.count[lo] - k.m_tile * kBlockM;
  k.rows = left < kBlockM ? left : kBlockM;
  return k;
}

__device__ __forceinline__ int total_m_tiles(const ExpertTable& t, int num_local) { return t.tile_offset[num_local]; }

}  // namespace flashmoe
