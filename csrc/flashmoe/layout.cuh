// Where everything lives: the symmetric heap (same offsets on every rank) and the local workspace.
//
// One layout per process, sized once for the largest layer ("capacity"); every layer and call reuses it.
// Sizes (bytes, T = max tokens per rank, W = EP size, k = top-k, E_l = max local experts, B = blocks):
//   symmetric  recv_tokens   W*T*H*2          a source's rows land at [src][slot] (fp8 layers: e4m3, H bytes)
//              recv_scales   W*T*(H/128)*4    fp8 layers: the rows' per-128-group scales
//              recv_meta     W*T*(1+k)*4      per received row: source token id, local expert per top-k slot
//              combine_rows  T*k*H*2          expert outputs for this rank's (token, j), written by the owners
//              dispatch_signal W*8            per source: (epoch << 32) | rows it sent us
//              combine_arrivals W*8           per destination: 16-byte chunks it wrote into combine_rows this call
//              release_signal W*8             per destination: (epoch << 32) of the last call whose receive
//                                             area it has finished reading (our next rows may overwrite it)
//              send_tokens   T*H*2            put path only: x staged in registered memory
//              send_scales   T*(H/128)*4      put path only (fp8 layers)
//              send_meta     W*T*(1+k)*4      put path only
//              combine_stage B*R*128*128*2    put path only: a ring of R GEMM1 output tiles per block
//   workspace  expert_rows   E_l*W*T*4        per local expert: received (row, j) entries
//              combine_targets E_l*W*T*4      beside each entry: where its GEMM1 output row goes (combine_target)
//              act           W*T*min(k,E_l)*I*2   SwiGLU activations, grouped by expert (fp8 layers: e4m3)
//              act_scales    W*T*min(k,E_l)*(I/128)*4  fp8 layers: their per-128-group scales
//              gemm0_partials B*2*32 KiB     split GEMM0 tiles (small T): fp32 partial sums per (tile, rows, split)
//              counters      small (per rank, per local expert, per call; split arrivals 2*B)
//
// Counters are zeroed where their previous call can no longer touch them (moe_layer.cuh zero_call_counters): most
// at the call's start, before grid barrier 1, which every use follows; the dispatch's slot counters (used before
// barrier 1) and gemm_done_blocks by the last block to finish its GEMMs.
#pragma once

#include <cstdint>

#include "contract.h"

#ifndef __CUDACC__
#include <cuda_runtime.h>  // __host__ / __device__ for the host compiler
#endif

namespace flashmoe {

constexpr int64_t kAlign = 256;
__host__ __device__ constexpr int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct SymLayout {
  int64_t recv_tokens, recv_scales, recv_meta, combine_rows, dispatch_signal, combine_arrivals, release_signal;
  int64_t send_tokens, send_scales, send_meta, combine_stage;
  int64_t total;
};

struct WorkspaceLayout {
  int64_t expert_rows, combine_targets, act, act_scales;
  int64_t rank_send_count;   // [W] u64   per destination: rows this rank sends (low half: the atomic slots) and
                             //           their (row, top-k slot) entries there (high half)
  int64_t proxied_chunks;    // [W] u64   put path: combine chunks written for each proxied source, sent after a quiet
  int64_t gemm_done_blocks;  // u32       blocks past the GEMM phase this call (the last one releases the buffers)
  int64_t expert_count;      // [E_l] u32 rows received per local expert
  int64_t gemm0_done;        // [E_l][I/64] u32 GEMM0 tile completions per (local expert, feature tile); fp8: I/128
  int64_t gemm0_partials;    // fp32 [tile][consumer rows][split][kSplitSlotFloats] of split GEMM0 tiles
  int64_t gemm0_split_arrivals;  // [tile][consumer rows] u32 splits of a GEMM0 tile finished this call
  int64_t task_counter;      // u32       GEMM tasks taken by the blocks this call
  int64_t remote_entries;    // u32       received (row, j) entries from other ranks (metrics)
  int64_t barrier;           // u32       grid barrier word
  int64_t epoch;             // u32       calls completed by this process
  int64_t abort_flag;        // u32       set when any block gave up waiting
  int64_t total;
};

// The combine arrivals count 16-byte chunks of bf16 output rows: an entry (row, top-k slot) is complete at H / 8.
constexpr int kCombineChunkFeatures = 8;

// Put path: a ring of kPutRingTiles GEMM1 output tiles per block (up to 128 tokens x 128 features, bf16, each),
// the registered source of the combine puts. A slot is rewritten only after a quiet (tasks.cuh store_outputs),
// so each consumer warpgroup (its own position in the ring) quiets once per kPutRingTiles of its tiles, not
// once per tile; a decode call's few tiles never wrap.
constexpr int kPutRingTiles = 4;
constexpr int64_t kCombineStageBytesPerTile = 128 * kHiddenMultiple * 2;

// Split GEMM0 tiles (scheduler.cuh): a slot holds one consumer warpgroup's fp32 accumulators of one split (64
// per thread: 128 rows x 64 tokens, or 64 rows x 128). A call keeps GEMM0 tiles x splits <= blocks, so
// B x kConsumers slots suffice.
constexpr int64_t kSplitSlotFloats = 128 * 64;
constexpr int kSplitRowGroups = 2;  // = kConsumers: a split-width tile's two consumers keep their own sums

__host__ __device__ inline int64_t meta_stride(int64_t top_k) { return 1 + top_k; }

// An expert-list entry (subscriber.cuh) packs its received row and top-k slot: row << 4 | j, so W x T < 2^27.
// Its combine target packs where the GEMM1 output row goes: combine row (token x k + j) of the source's combine
// rows, and the source: (token x k + j) << 6 | source, so T x k < 2^25. The list building reads the token from the
// row's metadata once; a GEMM1 epilogue then finds each row's destination without a dependent load.
constexpr int kTargetSourceBits = 6;
static_assert(1 << kTargetSourceBits == kMaxWorld, "a combine target's source field holds any rank");
__host__ __device__ constexpr int combine_target(int source, int token, int top_k, int j) {
  return (token * top_k + j) << kTargetSourceBits | source;
}
__host__ __device__ constexpr int target_source(int target) { return target & (kMaxWorld - 1); }
__host__ __device__ constexpr int target_row(int target) { return target >> kTargetSourceBits; }
// Whether a capacity's entries and targets fit their 31 bits.
__host__ __device__ inline bool packed_entries_fit(const Capacity& c) {
  return c.world_size * c.max_tokens_per_rank < (int64_t{1} << 27) &&
         c.max_tokens_per_rank * c.top_k < (int64_t{1} << (31 - kTargetSourceBits));
}

__host__ __device__ inline SymLayout sym_layout(const Capacity& c) {
  SymLayout l{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) { int64_t o = off; off += align_up(bytes); return o; };
  l.recv_tokens = take(c.world_size * c.max_tokens_per_rank * c.hidden_size * 2);
  l.recv_scales = take(c.world_size * c.max_tokens_per_rank * (c.hidden_size / kHiddenMultiple) * 4);
  l.recv_meta = take(c.world_size * c.max_tokens_per_rank * meta_stride(c.top_k) * 4);
  l.combine_rows = take(c.max_tokens_per_rank * c.top_k * c.hidden_size * 2);
  l.dispatch_signal = take(c.world_size * 8);
  l.combine_arrivals = take(c.world_size * 8);
  l.release_signal = take(c.world_size * 8);
  l.send_tokens = take(c.max_tokens_per_rank * c.hidden_size * 2);
  l.send_scales = take(c.max_tokens_per_rank * (c.hidden_size / kHiddenMultiple) * 4);
  l.send_meta = take(c.world_size * c.max_tokens_per_rank * meta_stride(c.top_k) * 4);
  l.combine_stage = take(c.num_blocks * kPutRingTiles * kCombineStageBytesPerTile);
  l.total = off;
  return l;
}

__host__ __device__ inline int64_t max_received_entries(const Capacity& c) {
  const int64_t per_row = c.top_k < c.max_local ? c.top_k : c.max_local;
  return c.world_size * c.max_tokens_per_rank * per_row;
}

__host__ __device__ inline WorkspaceLayout workspace_layout(const Capacity& c) {
  WorkspaceLayout l{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) { int64_t o = off; off += align_up(bytes); return o; };
  l.expert_rows = take(c.max_local * c.world_size * c.max_tokens_per_rank * 4);
  l.combine_targets = take(c.max_local * c.world_size * c.max_tokens_per_rank * 4);
  // Expert e's rows start at the prefix of the counts before it; tiles read and write only valid rows.
  l.act = take(max_received_entries(c) * c.intermediate_size * 2);
  l.act_scales = take(max_received_entries(c) * (c.intermediate_size / kHiddenMultiple) * 4);
  l.rank_send_count = take(c.world_size * 8);
  l.proxied_chunks = take(c.world_size * 8);
  l.gemm_done_blocks = take(4);
  l.expert_count = take(c.max_local * 4);
  l.gemm0_done = take(c.max_local * (c.intermediate_size / kInterMultiple) * 4);
  l.gemm0_partials = take(c.num_blocks * kSplitRowGroups * kSplitSlotFloats * 4);
  l.gemm0_split_arrivals = take(c.num_blocks * kSplitRowGroups * 4);
  l.task_counter = take(4);
  l.remote_entries = take(4);
  l.barrier = take(4);
  l.epoch = take(4);
  l.abort_flag = take(4);
  l.total = off;
  return l;
}

}  // namespace flashmoe
