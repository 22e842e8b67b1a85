// Dispatch (source side): each token goes once to every rank that owns at least one of its experts, with a
// metadata row naming, per top-k slot, the local expert there (or -1). Only routed tokens move.
//
// One warp per token: lane j looks at top-k slot j; lanes with the same destination elect the lowest as
// leader; the leaders take their slots in the destinations' receive areas with one atomic each, all at once (slot order does not affect
// results: each output row depends only on its own input row). NVLink peers get direct 16-byte stores into
// their heap; other peers (or all, with FLASHMOE_FORCE_PUT) get warp-wide non-blocking puts from registered
// staging memory, completed by one quiet before the signal (one fence per destination, as Perseus advises).
//
// fp8 layers send each row quantised (flashmoe/fp8.py's rule, per 128-group: e4m3 values + an fp32 scale),
// half the bytes on the wire; the warp quantises a row once, two groups per piece (a half-warp per group), 8
// pieces at a time, then stores them to every destination.
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "fp8.cuh"
#include "params.cuh"

namespace flashmoe {

// 16-byte loads of a row each lane has in flight before it stores (quantises) them: a 2048-wide row is one round
// trip to memory instead of eight dependent ones. At T = 1 the one warp with a token sends last, so its row is on
// the critical path. Measured on H200s (benchmarks/results/2026-11-23-h200x2-ep2-v2-ab.json): the EP2 fp8 layer
// 3 us faster at T = 1-128 than with one load per loop turn; bf16 unchanged.
constexpr int kRowLoadsAhead = 8;

// A warp's batch of a row: lane l loads 16-byte vectors base + 32 u + l (u < kRowLoadsAhead) of the row's `vecs`
// from `src` (read-only during the kernel); vectors past the row are zeros.
using RowBatch = uint4[kRowLoadsAhead];
__device__ __forceinline__ void load_row_batch(RowBatch& v, const uint4* src, int base, int vecs) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kRowLoadsAhead; ++u)
    v[u] = base + 32 * u + lane < vecs ? __ldg(src + base + 32 * u + lane) : make_uint4(0, 0, 0, 0);
}

// A warp copies `vecs` 16-byte vectors of a row from `src` to `dst`.
__device__ __forceinline__ void copy_row_warp(uint4* dst, const uint4* src, int vecs) {
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < vecs; base += 32 * kRowLoadsAhead) {
    RowBatch v;
    load_row_batch(v, src, base, vecs);
#pragma unroll
    for (int u = 0; u < kRowLoadsAhead; ++u)
      if (base + 32 * u + lane < vecs) dst[base + 32 * u + lane] = v[u];
  }
}

// Bytes of one dispatched row (metrics): the token, and its scales in fp8 layers.
template <bool kFp8>
__device__ __forceinline__ int64_t dispatch_row_bytes(const Params& p) {
  return kFp8 ? p.hidden_size + (p.hidden_size / kFp8Group) * 4 : p.hidden_size * 2;
}

// The metadata row of our slot `slot` at destination r: lane 0 the token id, lane i the local expert of top-k
// slot i-1 there (meta_value is this lane's entry). NVLink peers get stores, other peers a put from the
// registered staging rows.
__device__ __forceinline__ void send_meta(const Params& p, const PeerTable& peers, int r, int slot, int meta_value) {
  const int lane = threadIdx.x & 31, k = p.top_k;
  const int64_t mstride = meta_stride(k);
  const int64_t row = static_cast<int64_t>(p.rank) * p.max_tokens_per_rank + slot;
  if (use_p2p(peers, r)) {
    int* meta = reinterpret_cast<int*>(peers.base[r] + p.sym_off.recv_meta) + row * mstride;
    if (lane <= k) meta[lane] = meta_value;
  } else {
    int* meta_stage = sym_ptr<int>(p, p.sym_off.send_meta) + (static_cast<int64_t>(r) * p.max_tokens_per_rank + slot) * mstride;
    if (lane <= k) meta_stage[lane] = meta_value;
    __syncwarp();
    put_warp(sym_ptr<int>(p, p.sym_off.recv_meta) + row * mstride, meta_stage, mstride * 4, r);
  }
}

// fp8: quantise token t's row and store it to every destination in `leaders` (lane L holds destination
// dest and slot my_slot for leader L); proxied destinations get it through the staging rows, put afterwards.
// `first` is the row's first batch, already loaded (dispatch_tokens).
__device__ __forceinline__ void send_row_fp8(const Params& p, const PeerTable& peers, int t, unsigned leaders, int dest,
                                             int my_slot, const RowBatch& first) {
  const int lane = threadIdx.x & 31;
  const int H = p.hidden_size, groups = H / kFp8Group;
  const bf16* src = p.x + static_cast<int64_t>(t) * H;
  uint8_t* stage_row = sym_ptr<uint8_t>(p, p.sym_off.send_tokens) + static_cast<int64_t>(t) * H;
  float* stage_scales = sym_ptr<float>(p, p.sym_off.send_scales) + static_cast<int64_t>(t) * groups;
  bool any_proxied = false;
  for (unsigned l = leaders; l; l &= l - 1) any_proxied |= !use_p2p(peers, __shfl_sync(0xffffffffu, dest, __ffs(l) - 1));
  constexpr int kPiece = 2 * kFp8Group;  // a warp's piece of the row: two groups, 8 elements per lane
  static_assert(kPiece == 32 * 8, "a piece is 32 lanes' 16-byte vectors: a row batch's u-th");
  for (int ahead = 0; ahead < H; ahead += kRowLoadsAhead * kPiece) {
    RowBatch raw;  // the pieces' loads first, all in flight together
    if (ahead == 0) {
#pragma unroll
      for (int u = 0; u < kRowLoadsAhead; ++u) raw[u] = first[u];
    } else {
      load_row_batch(raw, reinterpret_cast<const uint4*>(src), ahead / 8, H / 8);
    }
    // Every piece quantised before any is stored: the pieces are independent, so their latency chains overlap
    // (one piece at a time left each chain exposed; the busy dispatch block took ~5 us against bf16's ~2.3).
    // Pieces past H were loaded as zeros and are not stored.
    // Three passes, each over every piece: the group maxima (conversions and shuffles, no branches, so the 8 chains
    // interleave), the scales (IEEE division: a branch to its slow path each), the e4m3 values.
    float v[kRowLoadsAhead][8];
    float amax[kRowLoadsAhead];
#pragma unroll
    for (int u = 0; u < kRowLoadsAhead; ++u) {
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(h2[q]);
        v[u][2 * q] = f.x;
        v[u][2 * q + 1] = f.y;
      }
      amax[u] = 0.f;
#pragma unroll
      for (int q = 0; q < 8; ++q) amax[u] = fmaxf(amax[u], fabsf(v[u][q]));
    }
#pragma unroll
    for (int d = 8; d > 0; d >>= 1)  // within a half-warp: one group
#pragma unroll
      for (int u = 0; u < kRowLoadsAhead; ++u) amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], d));
    Fp8Scale s[kRowLoadsAhead];
#pragma unroll
    for (int u = 0; u < kRowLoadsAhead; ++u) s[u] = fp8_scale(amax[u]);
    uint2 q8[kRowLoadsAhead];
#pragma unroll
    for (int u = 0; u < kRowLoadsAhead; ++u)
      q8[u] = make_uint2(quantize4(v[u][0], v[u][1], v[u][2], v[u][3], s[u].inverse),
                         quantize4(v[u][4], v[u][5], v[u][6], v[u][7], s[u].inverse));
    const bool scale_lane = (lane & 15) == 0;  // lanes 0-15 hold one group, 16-31 the next
    for (unsigned l = leaders; l; l &= l - 1) {
      const int L = __ffs(l) - 1;
      const int r = __shfl_sync(0xffffffffu, dest, L);
      const int slot = __shfl_sync(0xffffffffu, my_slot, L);
      if (!use_p2p(peers, r)) continue;
      const int64_t row = static_cast<int64_t>(p.rank) * p.max_tokens_per_rank + slot;
      char* heap = peers.base[r];
#pragma unroll
      for (int u = 0; u < kRowLoadsAhead; ++u) {
        const int e = ahead + u * kPiece + lane * 8;  // this lane's 8 elements
        if (e >= H) continue;
        *reinterpret_cast<uint2*>(heap + p.sym_off.recv_tokens + row * H + e) = q8[u];
        if (scale_lane) reinterpret_cast<float*>(heap + p.sym_off.recv_scales)[row * groups + e / kFp8Group] = s[u].scale;
      }
    }
    if (any_proxied) {
#pragma unroll
      for (int u = 0; u < kRowLoadsAhead; ++u) {
        const int e = ahead + u * kPiece + lane * 8;
        if (e >= H) continue;
        *reinterpret_cast<uint2*>(stage_row + e) = q8[u];
        if (scale_lane) stage_scales[e / kFp8Group] = s[u].scale;
      }
    }
  }
  if (!any_proxied) return;
  __syncwarp();
  for (unsigned l = leaders; l; l &= l - 1) {
    const int L = __ffs(l) - 1;
    const int r = __shfl_sync(0xffffffffu, dest, L);
    const int slot = __shfl_sync(0xffffffffu, my_slot, L);
    if (use_p2p(peers, r)) continue;
    const int64_t row = static_cast<int64_t>(p.rank) * p.max_tokens_per_rank + slot;
    put_warp(sym_ptr<uint8_t>(p, p.sym_off.recv_tokens) + row * H, stage_row, H, r);
    put_warp(sym_ptr<float>(p, p.sym_off.recv_scales) + row * groups, stage_scales, groups * 4, r);
  }
}

// Sends the first `num_tokens` tokens (0 in a padding call, params.cuh); returns the token-rank rows this warp
// sent (metrics). Nothing is stored to a rank before it has released the previous call (`prev_epoch`, comm.cuh):
// the block's last warp waits for every rank's release from the start (its own tokens, if any, come after) and
// raises the block's `released` flag, which a warp checks before its first stores. The flag is long up by then, so
// the release's round trip stays off the warp that carries the only token at small T. Block 0's thread 0 signals
// every rank after the grid barrier, when its last warp has waited too.
template <bool kFp8>
__device__ int dispatch_tokens(const Params& p, const PeerTable& peers, int num_tokens, uint32_t prev_epoch,
                               int* released) {
  int rows_sent = 0;
  const int lane = threadIdx.x & 31;
  const int warps_total = gridDim.x * kWarps;
  const int warp_global = grid_warp_index();
  const int k = p.top_k, H = p.hidden_size;
  const int vec_per_row = H / 8;  // 16-byte vectors
  const int64_t mstride = meta_stride(k);
  unsigned long long* send_count = ws_ptr<unsigned long long>(p, p.ws_off.rank_send_count);

  if ((threadIdx.x >> 5) == kWarps - 1) {
    wait_released(p, prev_epoch);  // gives up (and records why) after the timeout: the flag goes up regardless
    if (lane == 0) st_release_cta(released, 1);
  }
  for (int t = warp_global; t < num_tokens; t += warps_total) {
    const uint4* src_row = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(t) * H);
    // fp8: the row's first batch (a whole 2048-wide row) is loaded before the routing, so its loads overlap the
    // routing's dependent loads and the slot atomic instead of following them: at T = 1 the one warp with a token
    // is the dispatch phase's critical path. Not in bf16, whose relocatable kernel then spilled (146 -> 168
    // registers): its batch stays live across the per-destination loop.
    RowBatch first;
    if constexpr (kFp8) load_row_batch(first, src_row, 0, vec_per_row);
    int e = lane < k ? __ldg(p.topk_ids + static_cast<int64_t>(t) * k + lane) : -1;
    if (e >= p.num_experts) e = -1;  // out-of-range ids are skipped, never read out of bounds
    // A slot naming the same expert as an earlier slot of this row is computed once: its metadata entry is -1
    // and the combine reads the first slot's row for it (the output is still the sum over all slots).
    const unsigned twins = __match_any_sync(0xffffffffu, e);
    const bool repeat = e >= 0 && (__ffs(twins) - 1) != lane;
    const int dest = e >= 0 ? __ldg(p.expert_rank + e) : -1;
    const int local = e >= 0 && !repeat ? __ldg(p.expert_local + e) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, dest);
    const bool leader = dest >= 0 && (__ffs(same) - 1) == lane;
    unsigned leaders = __ballot_sync(0xffffffffu, leader);
    // Every destination's slot at once: one atomic round trip per token, not one per destination. The same add
    // counts the row's entries there (the slots with an expert computed there; rank_send_count's high half),
    // which the combine phase waits to see written back (moe_layer.cuh).
    const unsigned entries = __popc(same & __ballot_sync(0xffffffffu, local >= 0));
    const unsigned long long add = 1ull | static_cast<unsigned long long>(entries) << 32;
    const int my_slot = leader ? static_cast<int>(static_cast<uint32_t>(atomicAdd(send_count + dest, add))) : 0;
    if (t == warp_global)
      while (ld_acquire_cta(released) == 0) {
      }
    // Lane i (1..k) writes metadata entry i-1, so it needs slot i-1's destination and local id.
    const int dest_prev = __shfl_up_sync(0xffffffffu, dest, 1);
    const int local_prev = __shfl_up_sync(0xffffffffu, local, 1);
    bool staged = false;
    if constexpr (kFp8) {
      // Metadata to every destination first, then the row, quantised once.
      const unsigned all_leaders = leaders;
      while (leaders) {
        const int L = __ffs(leaders) - 1;
        leaders &= leaders - 1;
        const int r = __shfl_sync(0xffffffffu, dest, L);
        const int slot = __shfl_sync(0xffffffffu, my_slot, L);
        ++rows_sent;
        send_meta(p, peers, r, slot, lane == 0 ? t : (dest_prev == r ? local_prev : -1));
      }
      send_row_fp8(p, peers, t, all_leaders, dest, my_slot, first);
    } else {
      while (leaders) {
        const int L = __ffs(leaders) - 1;
        leaders &= leaders - 1;
        const int r = __shfl_sync(0xffffffffu, dest, L);
        const int slot = __shfl_sync(0xffffffffu, my_slot, L);
        const int64_t row = static_cast<int64_t>(p.rank) * p.max_tokens_per_rank + slot;  // our rows at the destination
        ++rows_sent;
        if (use_p2p(peers, r)) {
          send_meta(p, peers, r, slot, lane == 0 ? t : (dest_prev == r ? local_prev : -1));
          copy_row_warp(reinterpret_cast<uint4*>(peers.base[r] + p.sym_off.recv_tokens) + row * vec_per_row, src_row,
                        vec_per_row);
        } else {
          if (!staged) {  // registered source memory for the NIC, staged once per token
            copy_row_warp(sym_ptr<uint4>(p, p.sym_off.send_tokens) + static_cast<int64_t>(t) * vec_per_row, src_row,
                          vec_per_row);
            staged = true;
            __syncwarp();
          }
          send_meta(p, peers, r, slot, lane == 0 ? t : (dest_prev == r ? local_prev : -1));
          put_warp(sym_ptr<bf16>(p, p.sym_off.recv_tokens) + row * H,
                   sym_ptr<bf16>(p, p.sym_off.send_tokens) + static_cast<int64_t>(t) * H, H * 2, r);
        }
      }
    }
  }
  return rows_sent;
}

}  // namespace flashmoe
