// Combine (source side): out[t] = sum_j w[t,j] * y[t,j] over valid slots, fp32, ascending j (a repeated expert
// id contributes once per slot, from the row computed for its first slot).
// y[t,j] was written into our combine buffer by the rank owning expert topk_ids[t,j]. The fixed order and the
// absence of atomics make the output bitwise reproducible. Every row of `out` is written (zeros if no slot
// is valid).
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

__device__ void combine_tokens(const Params& p) {
  const int lane = threadIdx.x & 31;
  const int warps_total = gridDim.x * kWarps;
  const int warp_global = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int k = p.top_k, H = p.hidden_size;
  const bf16* rows = sym_ptr<bf16>(p, p.sym_off.combine_rows);
  for (int t = warp_global; t < p.num_tokens; t += warps_total) {
    // Lane j holds slot j's weight (0 for skipped slots). Broadcast every slot's weight once, before the column
    // loop: lanes run different numbers of column steps when H is not a multiple of 256, so no warp-wide
    // shuffle may sit inside that loop.
    const int id = lane < k ? __ldg(p.topk_ids + static_cast<int64_t>(t) * k + lane) : -1;
    const bool routed = id >= 0 && id < p.num_experts;  // same rule as dispatch
    const float w = routed ? __ldg(p.topk_weights + static_cast<int64_t>(t) * k + lane) : 0.f;
    const unsigned valid = __ballot_sync(0xffffffffu, routed);
    // A repeated expert id was computed once, in the row of its first slot (dispatch.cuh).
    const int first_twin = __ffs(__match_any_sync(0xffffffffu, id)) - 1;
    float weight[kMaxTopK];
    int source[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      weight[j] = __shfl_sync(0xffffffffu, w, j);
      source[j] = __shfl_sync(0xffffffffu, first_twin, j);
    }
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        if (j >= k) break;
        if (!(valid >> j & 1u)) continue;
        const float wj = weight[j];
        const uint4 v = ldcg(reinterpret_cast<const uint4*>(rows + (static_cast<int64_t>(t) * k + source[j]) * H + c));
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h2[q]);
          acc[2 * q] = fmaf(wj, f.x, acc[2 * q]);
          acc[2 * q + 1] = fmaf(wj, f.y, acc[2 * q + 1]);
        }
      }
      uint4 o;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(t) * H + c) = o;
    }
  }
}

}  // namespace flashmoe
