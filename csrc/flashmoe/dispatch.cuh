// Dispatch (source side): each token goes once to every rank that owns at least one of its experts, with a
// metadata row naming, per top-k slot, the local expert there (or -1). Only routed tokens move.
//
// One warp per token: lane j looks at top-k slot j; lanes with the same destination elect the lowest as
// leader; the leaders take their slots in the destinations' receive areas with one atomic each, all at once (slot order does not affect
// results: each output row depends only on its own input row). NVLink peers get direct 16-byte stores into
// their heap; other peers (or all, with FLASHMOE_FORCE_PUT) get warp-wide non-blocking puts from registered
// staging memory, completed by one quiet before the signal (one fence per destination, as Perseus advises).
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

// Returns the token-rank rows this warp sent (metrics).
__device__ int dispatch_tokens(const Params& p, const PeerTable& peers) {
  int rows_sent = 0;
  const int lane = threadIdx.x & 31;
  const int warps_total = gridDim.x * kWarps;
  const int warp_global = grid_warp_index();
  const int k = p.top_k, H = p.hidden_size;
  const int vec_per_row = H / 8;  // 16-byte vectors
  const int64_t mstride = meta_stride(k);
  uint32_t* send_count = ws_ptr<uint32_t>(p, p.ws_off.rank_send_count);

  for (int t = warp_global; t < p.num_tokens; t += warps_total) {
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
    // Every destination's slot at once: one atomic round trip per token, not one per destination.
    const int my_slot = leader ? static_cast<int>(atomicAdd(send_count + dest, 1u)) : 0;
    // Lane i (1..k) writes metadata entry i-1, so it needs slot i-1's destination and local id.
    const int dest_prev = __shfl_up_sync(0xffffffffu, dest, 1);
    const int local_prev = __shfl_up_sync(0xffffffffu, local, 1);
    const uint4* src_row = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(t) * H);
    bool staged = false;

    while (leaders) {
      const int L = __ffs(leaders) - 1;
      leaders &= leaders - 1;
      const int r = __shfl_sync(0xffffffffu, dest, L);
      const int slot = __shfl_sync(0xffffffffu, my_slot, L);
      const int meta_value = lane == 0 ? t : (dest_prev == r ? local_prev : -1);
      const int64_t row = static_cast<int64_t>(p.rank) * p.max_tokens_per_rank + slot;  // our rows at the destination
      ++rows_sent;

      if (use_p2p(peers, r)) {
        int* meta = reinterpret_cast<int*>(peers.base[r] + p.sym_off.recv_meta) + row * mstride;
        if (lane <= k) meta[lane] = meta_value;
        uint4* dst = reinterpret_cast<uint4*>(peers.base[r] + p.sym_off.recv_tokens) + row * vec_per_row;
        for (int i = lane; i < vec_per_row; i += 32) dst[i] = __ldg(src_row + i);
      } else {
        if (!staged) {  // registered source memory for the NIC, staged once per token
          uint4* stage = sym_ptr<uint4>(p, p.sym_off.send_tokens) + static_cast<int64_t>(t) * vec_per_row;
          for (int i = lane; i < vec_per_row; i += 32) stage[i] = __ldg(src_row + i);
          staged = true;
          __syncwarp();
        }
        int* meta_stage = sym_ptr<int>(p, p.sym_off.send_meta) + (static_cast<int64_t>(r) * p.max_tokens_per_rank + slot) * mstride;
        if (lane <= k) meta_stage[lane] = meta_value;
        __syncwarp();
        nvshmemx_putmem_nbi_warp(sym_ptr<int>(p, p.sym_off.recv_meta) + row * mstride, meta_stage, mstride * 4, r);
        nvshmemx_putmem_nbi_warp(sym_ptr<bf16>(p, p.sym_off.recv_tokens) + row * H,
                                 sym_ptr<bf16>(p, p.sym_off.send_tokens) + static_cast<int64_t>(t) * H, H * 2, r);
      }
    }
  }
  return rows_sent;
}

}  // namespace flashmoe
