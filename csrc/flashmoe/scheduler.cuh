// Task scheduler of the GEMM phases. After the receive phase every block knows the per-expert row counts and
// builds the same prefix table in shared memory. The work is one flat list of tasks:
//
//   [0, n0)        GEMM0 tasks: (expert, feature tile of 64 intermediate features (fp8, and bf16 wide calls: 128),
//                  token tile)
//   [n0, n0 + n1)  GEMM1 tasks: (expert, feature tile of 128 hidden features (bf16 wide calls: 256), token tile)
//
// each expert-major, then feature tile, then token tile fastest (the token tiles of one weight tile run at
// the same time on neighbouring blocks, so weights stream from HBM once per call). Block b's first task is
// task b; later ones come from one counter per call as blocks finish earlier ones, so GEMM0 and GEMM1 run
// without a grid barrier between them and no block idles while another still has a queue. A GEMM1 task
// streams its weights at once; the activation rows of its K step s wait for the GEMM0 tiles of (expert,
// feature tile s) (a completion counter per pair). Every GEMM0 task is taken before any GEMM1 task and a
// block issues all loads of a task before it takes the next, so the wait cannot deadlock; at small T it
// overlaps GEMM1's weight stream with GEMM0.
//
// Each expert gets the smallest token tile that holds its rows (32, 64, else 128-row tiles; 16 in a call
// where every expert fits 16, gemm.cuh call_tile_tokens), so decode experts with a handful of rows cost one
// weight pass.
//
// bf16 prefill calls run wide tiles (gemm.cuh): every tile of such a call is 128 tokens x 256 weight rows (GEMM0 128
// features, GEMM1 256), an expert with fewer rows included (its one tile's weights stream once either way), so the
// call's tasks stay a product of token tiles and feature tiles. A call is wide when some expert has more than 64
// rows and its 64-feature GEMM0 tiles would take the blocks more than once (wide_call): with fewer, the narrow tiles
// all run at once (or split), and half as many wide ones would leave blocks idle. Each GEMM is wide where its
// shape divides (wide_gemm).
//
// Small T: a call whose GEMM0 tiles leave blocks idle (a DP decode step at c = 1: 2-4 experts per rank, 24-48
// tiles of 512 KiB for 132 SMs; fp8 at T = 1 and EP4: 48 tasks) streams GEMM0, the critical path, at a few SMs'
// rate. Each GEMM0 tile's K is then split over `gemm0_splits` tasks (adjacent in the queue, K steps as even as
// whole steps allow); each keeps its fp32 partial sums, and the last of a tile to finish adds them in split order
// and runs the epilogue (gemm.cuh store_split / count_split / sum_splits).
#pragma once

#include <climits>

#include "common.cuh"
#include "gemm.cuh"
#include "params.cuh"
#include "trace.cuh"

namespace flashmoe {

struct TaskCounts {
  int gemm0, total;      // tasks (GEMM0 tasks = tiles x splits)
  int gemm0_splits;      // K splits of every GEMM0 tile this call (1..kMaxGemm0Splits)
  int split_reciprocal;  // 2^16 / gemm0_splits + 1: a task's tile is (index * this) >> 16 (split_tile_of)
  int feature_tiles[2];  // per GEMM
  int k_steps[2];        // K steps of a whole tile, per GEMM
  int split_k_first[kMaxGemm0Splits + 1];  // first K step of each split of a GEMM0 tile; [gemm0_splits] = k_steps[0]
  int gemm0_counters;    // GEMM0 completion counters per expert: one per GEMM1 K step (bf16: 64 features)
  bool wide[2];          // bf16, per GEMM: this call's tiles are wide (128 tokens x 256 weight rows)
};

struct ExpertTable {
  int count[kMaxLocalExperts];             // rows received per local expert
  int row_offset[kMaxLocalExperts + 1];    // first activation row of each expert (prefix of counts)
  int tile_offset[kMaxLocalExperts + 1];   // first token tile of each expert (prefix of its tile counts)
  int max_count;                           // the most rows of any local expert
  int min_count;                           // the fewest rows of any local expert with rows (none: INT_MAX)
  int num_local;                           // local experts (Params::num_local)
  // The call's task counts, computed once per block: the producer and consumers decode every task from them,
  // and held in each role's registers the whole-program kernel spilled them to local memory.
  TaskCounts counts;
};

template <bool kFp8>
__device__ __forceinline__ int token_tiles(int rows) {
  return rows == 0 ? 0 : ceil_div(rows, tile_tokens_for(rows));
}

struct Task {
  int gemm;          // 0 or 1
  int expert;        // local expert
  int feature_tile;  // output feature tile
  int first_row;     // first row of the token tile within the expert's rows
  int rows;          // valid rows in the token tile (1..tile_tokens)
  int tile_tokens;   // 16, 32, 64 or 128 (gemm.cuh call_tile_tokens)
  int k_first;       // first K step of this task (split GEMM0 tiles), else 0
  int k_steps;       // K steps of this task
  int split;         // which of `splits` K ranges of its tile (GEMM0), else 0 of 1
  int splits;
  int tile;          // GEMM0: the tile's index among the call's GEMM0 tiles (unsplit)
  bool wide;         // a wide bf16 tile (gemm.cuh): 128 tokens x 256 weight rows
};

constexpr int kGemm0TileFeatures = kInterMultiple;   // 64 intermediate features (x2 rows: gate and up)
constexpr int kGemm1TileFeatures = kHiddenMultiple;  // 128 hidden features
// Intermediate features of a GEMM0 task: one weight tile (bf16), or an activation group of two (fp8: the
// epilogue quantises each token's 128 features with one scale, so one task computes them all).
__host__ __device__ constexpr int gemm0_task_features(bool fp8) { return fp8 ? kTileKFp8 : kGemm0TileFeatures; }
constexpr int kWideGemm0Features = kWideBoxes * kGemm0TileFeatures;  // a wide bf16 GEMM0 task: two w13 boxes
constexpr int kWideGemm1Features = kWideBoxes * kGemm1TileFeatures;  // a wide bf16 GEMM1 task: two w2 boxes

// Whether a bf16 call is wide: some expert has a 128-token tile, and its `narrow_tiles` GEMM0 tiles of 64 features
// are more than the blocks. Decode calls never are (their experts fit 16 rows).
__host__ __device__ constexpr bool wide_call(int max_rows, int narrow_tiles, int blocks) {
  return call_tile_tokens(max_rows, max_rows) == kMaxTileTokens && narrow_tiles > blocks;
}
// Whether GEMM `gemm` of a wide call runs wide tiles: its output features are whole wide tasks; GEMM1 also needs two
// K steps (its consumers hold the last two stages, gemm.cuh).
__host__ __device__ constexpr bool wide_gemm(int gemm, int hidden_size, int intermediate_size) {
  return gemm == 0 ? intermediate_size % kWideGemm0Features == 0
                   : hidden_size % kWideGemm1Features == 0 && intermediate_size >= 2 * kTileK;
}
static_assert(wide_call(65, 384, 132) && !wide_call(64, 384, 132) && !wide_call(100, 12, 132) &&
                  !wide_call(100, 132, 132) && wide_gemm(0, 2048, 768) && !wide_gemm(0, 2048, 704) &&
                  wide_gemm(1, 2048, 768) && !wide_gemm(1, 7168 + 128, 768) && !wide_gemm(1, 2048, 64),
              "wide tile rule");

// Fewest stages of a split task: a shorter task spends more of itself filling the ring and in its epilogue. A
// bf16 GEMM0 task runs one stage per K step, an fp8 one a stage per K step of each of its passes.
constexpr int kMinSplitStages = 8;
__host__ __device__ constexpr int min_split_k_steps(bool fp8) {
  return fp8 ? kMinSplitStages / kFp8Gemm0Passes : kMinSplitStages;
}

// K splits of each GEMM0 tile: as many as still all start at once (tiles x splits <= blocks), up to `max_splits`
// and as long as each split keeps min_split_k_steps; 1 when the tiles already fill the blocks. Any count, not
// only powers of two: an fp8 Qwen3-30B EP4 rank at T = 1 has ~7 active experts, 42 tiles, which 2 splits leave on
// 84 of 132 SMs and 3 put on 126 (each SM streams at a few tens of GB/s, so the phase's rate is the streaming
// SMs'; 6-7 active experts: the GEMM0 phase 1.3-1.6 us shorter, benchmarks/kernel-notes.md). One wave, not
// more: measured at T = 1 (96 tiles for 132 blocks), two splits (192 tasks, 1.45 waves) were 2-4 us slower than
// none -- the first wave already streams at HBM rate, and the second wave's splits come after it
// (benchmarks/kernel-notes.md).
__host__ __device__ constexpr int gemm0_splits(int tiles, int blocks, int k_steps, int min_steps, int max_splits) {
  int s = tiles > 0 ? blocks / tiles : 1;
  if (s > max_splits) s = max_splits;
  if (s > k_steps / min_steps) s = k_steps / min_steps;
  return s < 1 ? 1 : s;
}
static_assert(gemm0_splits(96, 132, 32, 8, 4) == 1 && gemm0_splits(48, 132, 32, 8, 4) == 2 &&
                  gemm0_splits(24, 132, 32, 8, 4) == 4 && gemm0_splits(36, 132, 32, 8, 4) == 3 &&
                  gemm0_splits(24, 132, 32, 8, 1) == 1 && gemm0_splits(12, 132, 32, 8, 4) == 4 &&
                  gemm0_splits(42, 132, 16, 4, 4) == 3 && gemm0_splits(48, 132, 16, 4, 4) == 2 &&
                  gemm0_splits(12, 132, 16, 4, 4) == 4 && gemm0_splits(12, 132, 12, 8, 4) == 1 &&
                  gemm0_splits(48, 132, 56, 4, 4) == 2 && gemm0_splits(200, 132, 16, 4, 4) == 1,
              "GEMM0 split rule");

// First K step of split `split` of `splits` over k_steps steps: whole steps, as even as they go (16 over 3: 5, 5, 6).
__host__ __device__ constexpr int split_k_first(int split, int splits, int k_steps) { return split * k_steps / splits; }
static_assert(split_k_first(1, 3, 16) == 5 && split_k_first(2, 3, 16) == 10 && split_k_first(3, 3, 16) == 16,
              "split K ranges");

// (tile, split) of a GEMM0 task index: the tile by a multiply with TaskCounts::split_reciprocal instead of a
// division. Exact wherever the scheduler splits: index < tiles x splits <= blocks, far below 2^16 / splits.
__host__ __device__ constexpr int split_reciprocal(int splits) { return (1 << 16) / splits + 1; }
__host__ __device__ constexpr int split_tile_of(int index, int splits, int reciprocal) {
  return splits == 1 ? index : (index * reciprocal) >> 16;
}
static_assert(split_tile_of(125, 3, split_reciprocal(3)) == 41 && split_tile_of(126, 3, split_reciprocal(3)) == 42 &&
                  split_tile_of(127, 4, split_reciprocal(4)) == 31 && split_tile_of(128, 4, split_reciprocal(4)) == 32 &&
                  split_tile_of(4095, 3, split_reciprocal(3)) == 1365 && split_tile_of(100000, 1, split_reciprocal(1)) == 100000,
              "split tile of a task index");

template <bool kFp8>
__device__ __forceinline__ TaskCounts task_counts(const Params& p, const ExpertTable& t) {
  TaskCounts c;
  c.gemm0_counters = p.intermediate_size / gemm0_task_features(kFp8);
  const bool wide = !kFp8 && wide_call(t.max_count, t.tile_offset[p.num_local] * c.gemm0_counters,
                                          static_cast<int>(gridDim.x));
  for (int gemm = 0; gemm < 2; ++gemm) c.wide[gemm] = wide && wide_gemm(gemm, p.hidden_size, p.intermediate_size);
  c.feature_tiles[0] = c.wide[0] ? p.intermediate_size / kWideGemm0Features : c.gemm0_counters;
  c.feature_tiles[1] = p.hidden_size / (c.wide[1] ? kWideGemm1Features : kGemm1TileFeatures);
  c.k_steps[0] = p.hidden_size / tile_k(kFp8);
  c.k_steps[1] = p.intermediate_size / tile_k(kFp8);
  const int tiles0 = t.tile_offset[p.num_local] * c.feature_tiles[0];
  // fp8: a 128-token tile's sums do not fit a split slot, nor do a wide bf16 tile's, so a call with one is not
  // split (prefill-sized experts: such calls rarely leave blocks idle anyway).
  const bool splittable = kFp8 ? fp8_gemm0_splittable(call_tile_tokens(t.max_count, t.max_count)) : !c.wide[0];
  const int max_splits = splittable ? p.gemm0_max_splits : 1;
  c.gemm0_splits = gemm0_splits(tiles0, static_cast<int>(gridDim.x), c.k_steps[0], min_split_k_steps(kFp8), max_splits);
  c.split_reciprocal = split_reciprocal(c.gemm0_splits);
  for (int s = 0; s <= kMaxGemm0Splits; ++s)
    c.split_k_first[s] = split_k_first(s < c.gemm0_splits ? s : c.gemm0_splits, c.gemm0_splits, c.k_steps[0]);
  c.gemm0 = tiles0 * c.gemm0_splits;
  c.total = c.gemm0 + t.tile_offset[p.num_local] * c.feature_tiles[1];
  return c;
}

// Fill the table from the per-expert counts (all blocks compute the same thing): the workspace counters, or
// (`counts_in_table`: subscriber.cuh lists_per_block) the counts the block already wrote into t.count. Warp 0
// scans them 32 experts at a time.
template <bool kFp8>
__device__ void build_expert_table(const Params& p, ExpertTable& t, bool counts_in_table) {
  if (!counts_in_table) {
    const uint32_t* counts = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
    for (int e = threadIdx.x; e < p.num_local; e += blockDim.x) t.count[e] = static_cast<int>(__ldcg(counts + e));
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int rows_before = 0, tiles_before = 0, max_count = 0;
    unsigned min_count = INT_MAX;
    for (int base = 0; base < p.num_local; base += 32) {
      const int e = base + lane;
      const int count = e < p.num_local ? t.count[e] : 0;
      max_count = max(max_count, __reduce_max_sync(0xffffffffu, static_cast<unsigned>(count)));
      min_count = min(min_count, __reduce_min_sync(0xffffffffu, count > 0 ? static_cast<unsigned>(count) : INT_MAX));
      const int tiles = token_tiles<kFp8>(count);
      int rows_incl = count, tiles_incl = tiles;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int r = __shfl_up_sync(0xffffffffu, rows_incl, d);
        const int q = __shfl_up_sync(0xffffffffu, tiles_incl, d);
        if (lane >= d) {
          rows_incl += r;
          tiles_incl += q;
        }
      }
      if (e < p.num_local) {
        t.row_offset[e] = rows_before + rows_incl - count;
        t.tile_offset[e] = tiles_before + tiles_incl - tiles;
      }
      rows_before += __shfl_sync(0xffffffffu, rows_incl, 31);
      tiles_before += __shfl_sync(0xffffffffu, tiles_incl, 31);
    }
    if (lane == 0) {
      t.row_offset[p.num_local] = rows_before;
      t.tile_offset[p.num_local] = tiles_before;
      t.max_count = max_count;
      t.min_count = static_cast<int>(min_count);
      t.num_local = p.num_local;
      t.counts = task_counts<kFp8>(p, t);
    }
  }
  __syncthreads();
}

// Completions of one (expert, GEMM0 feature tile) pair: one per consumer warpgroup per token tile.
template <bool kFp8>
__device__ __forceinline__ uint32_t gemm0_arrivals(const ExpertTable& t, int expert) {
  return static_cast<uint32_t>(kConsumers * token_tiles<kFp8>(t.count[expert]));
}

// Flat task index -> task. Called by whole warps (every thread of the block decodes each task): the warp finds the
// last expert whose first task is <= index (experts without rows own no task, so the one found has tiles) as the
// length of the prefix of experts that start at or before it, 32 experts per shared load and ballot, instead of a
// binary search's chain of dependent loads. A split's tile is a multiply (split_tile_of); in a decode call
// (gemm.cuh CallTiles) every expert has one token tile, so a task's feature tile is its offset within the expert's
// tasks, and in a full call every tile is 128 tokens wide.
template <bool kFp8, CallTiles kTiles>
__device__ __forceinline__ Task decode_task(const ExpertTable& t, int index) {
  constexpr bool kDecode = kTiles == CallTiles::kDecode;
  const TaskCounts& c = t.counts;
  Task k;
  k.gemm = index >= c.gemm0;
  k.wide = !kFp8 && !kDecode && c.wide[k.gemm];
  if (k.gemm) {
    index -= c.gemm0;
    k.split = k.tile = 0;
    k.splits = 1;
    k.k_first = 0;
    k.k_steps = c.k_steps[1];
  } else {
    // A tile's splits are neighbours in the queue: taken at about the same time.
    k.tile = split_tile_of(index, c.gemm0_splits, c.split_reciprocal);
    k.split = index - k.tile * c.gemm0_splits;
    index = k.tile;
    k.splits = c.gemm0_splits;
    k.k_first = c.split_k_first[k.split];
    k.k_steps = c.split_k_first[k.split + 1] - k.k_first;
  }
  const int feature_tiles = c.feature_tiles[k.gemm];
  int expert = -1;
  for (int base = 0; base < t.num_local; base += 32) {
    const int e = base + (threadIdx.x & 31);
    const uint32_t starts = __ballot_sync(0xffffffffu, e < t.num_local && t.tile_offset[e] * feature_tiles <= index);
    expert += __popc(starts);
    if (starts != 0xffffffffu) break;  // tile offsets only grow: the prefix ended in this chunk
  }
  const int local = index - t.tile_offset[expert] * feature_tiles;
  k.expert = expert;
  if constexpr (kDecode) {
    k.feature_tile = local;
    k.tile_tokens = kDecodeTileTokens;
    k.first_row = 0;
  } else {
    const int tiles = t.tile_offset[expert + 1] - t.tile_offset[expert];
    k.feature_tile = local / tiles;
    k.tile_tokens = k.wide || kTiles == CallTiles::kFull ? kMaxTileTokens
                                                         : call_tile_tokens(t.count[expert], t.max_count);
    k.first_row = (local % tiles) * k.tile_tokens;
  }
  const int left = t.count[expert] - k.first_row;
  k.rows = left < k.tile_tokens ? left : k.tile_tokens;
  return k;
}

// The block's window on the task counter: the producer's thread 0 takes the next index and publishes it in a
// shared-memory slot; the rest of its warp gets it by shuffle, every other warp reads the slot (up to
// kTaskSlots indices not yet read by all).
struct TaskQueue {
  int slot = 0;
  uint32_t phase = 0;
  uint32_t reserved = 0;      // producer thread 0: an index taken ahead by reserve_task
  bool has_reserved = false;
  bool took_first = false;    // the block's first index is its own (reserve_task)
  __device__ void advance() {
    if (++slot == kTaskSlots) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// Stages before the end of a tile at which the producer takes the next task index: the atomic's round trip
// (1-2 us while HBM streams) then overlaps the tile's last loads instead of delaying the next tile's first.
// A few stages, not a whole tile: reserving a tile ahead left blocks idle at T = 1 (kernel-notes.md).
constexpr int kReserveStages = 4;

// Producer thread 0: take the next index now; next_task publishes it. Its value is first read there, so the
// thread does not wait for the atomic here. Block b's first index is b, no atomic: the first task of every
// block then starts without a round trip to the counter that all blocks would take at once; the counter hands
// out the indices from gridDim.x on.
__device__ __forceinline__ void reserve_task(const Params& p, TaskQueue& q) {
  if (!q.has_reserved) {
    q.reserved = q.took_first ? atomicAdd(ws_ptr<uint32_t>(p, p.ws_off.task_counter), 1u) + gridDim.x : blockIdx.x;
    q.took_first = true;
    q.has_reserved = true;
  }
}

// Next task index of this block, or -1 when the call's tasks are all taken. Called by every thread of the
// block in the same order, so all threads take the same branches (the GEMM phases have block barriers).
// Every wait is uniform within a warp: a lane spinning on a barrier that another lane of its own warp must
// release would hold that lane back (divergent paths of a warp share its issue slots).
// A task is published only after the block's previous one is issued (every stage claimed): the consumers' wait
// for a stage's previous release (gemm.cuh wait_stage_full) tells that phase from the one two back only then (a
// decode producer that published earlier computed wrong tiles and faulted: benchmarks/experiments/diffs/refuted/
// 2026-11-24-decode-producer-halves.diff).
// The wait for a published index ignores the abort flag: thread 0 publishes promptly even after an abort
// (its own waits give up then), and a thread that read a stale index would leave the block's threads on
// different tasks.
__device__ __forceinline__ int next_task(const Params& p, const GemmSmem& g, TaskQueue& q, int total) {
  int index = 0;
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      pipe_wait(p, g, g.task_empty(q.slot), q.phase ^ 1u);
      trace(kTraceProducerSlotFree);
      reserve_task(p, q);
      q.has_reserved = false;
      index = q.reserved >= static_cast<uint32_t>(total) ? -1 : static_cast<int>(q.reserved);
      trace(kTraceProducerIndex, static_cast<uint32_t>(index));
      *g.task_index(q.slot) = index;
      mbar_arrive(g.task_full(q.slot));  // release: the index is visible to the waiters
      trace(kTraceProducerPublished, static_cast<uint32_t>(index));
    }
    index = __shfl_sync(0xffffffffu, index, 0);
  } else {
    pipe_wait(p, g, g.task_full(q.slot), q.phase, /*give_up_on_abort=*/false);
    index = *reinterpret_cast<volatile int*>(g.task_index(q.slot));
    trace(kTraceConsumerSlotRead);
    mbar_arrive(g.task_empty(q.slot));
  }
  q.advance();
  return index;
}

}  // namespace flashmoe
