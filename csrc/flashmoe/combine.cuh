// Combine (source side): out[t] = sum_j w[t,j] * y[t,j] over valid slots, fp32, ascending j (a repeated expert
// id contributes once per slot, from the row computed for its first slot).
// y[t,j] was written into our combine buffer by the rank owning expert topk_ids[t,j]. The fixed order and the
// absence of atomics make the output bitwise reproducible. Every row of `out` is written (zeros if no slot
// is valid, and in a padding call).
//
// One warp per (token, 256-column chunk), chunks of a token on neighbouring items, items spread over the
// blocks first: a decode call's few tokens still use many SMs, and each lane has the rows of all (up to 8)
// slots in flight at once instead of one dependent load after another.
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

constexpr int kCombineColumns = 32 * 8;  // a warp's chunk: 8 bf16 per lane
constexpr int kCombineBatch = 8;         // slot rows loaded before their multiply-adds

// In a whole program (the default build's fp8 kernel) a function of its own: inlined there, where ptxas allocates
// the kernel's registers for every phase at once, this loop's loaded rows went to local memory, and the fp8 layer
// ran 1.02-1.09x slower. In relocatable code (the bf16 kernel, the put build) it stays inlined: as a call its phase
// took 1-4 us longer there (benchmarks/kernel-notes.md, twenty-second session).
#ifdef __CUDACC_RDC__
static __device__ void combine_tokens(const Params& p, bool padding) {
#else
static __device__ __noinline__ void combine_tokens(const Params& p, bool padding) {
#endif
  const int lane = threadIdx.x & 31;
  const int warps_total = gridDim.x * kWarps;
  const int warp_global = grid_warp_index();
  const int k = p.top_k, H = p.hidden_size;
  const int chunks = ceil_div(H, kCombineColumns);
  const int items = p.num_tokens * chunks;
  const bf16* rows = sym_ptr<bf16>(p, p.sym_off.combine_rows);
  for (int item = warp_global; item < items; item += warps_total) {
    const int t = item / chunks;
    const int c = (item - t * chunks) * kCombineColumns + lane * 8;
    // Lane j holds slot j's weight (0 for skipped slots). Each batch's weights and source rows are broadcast by
    // the whole warp (shuffles need every lane), then only lanes with columns (all, unless H is not a multiple of
    // 256) load and add; one batch's 8 + 8 values are live at a time, not all 16 slots'.
    const int id = lane < k ? __ldg(p.topk_ids + static_cast<int64_t>(t) * k + lane) : -1;
    const bool routed = !padding && id >= 0 && id < p.num_experts;  // same rule as dispatch
    const float w = routed ? __ldg(p.topk_weights + static_cast<int64_t>(t) * k + lane) : 0.f;
    const unsigned valid = __ballot_sync(0xffffffffu, routed);
    // A repeated expert id was computed once, in the row of its first slot (dispatch.cuh).
    const int first_twin = __ffs(__match_any_sync(0xffffffffu, id)) - 1;
    const bool has_columns = c < H;
    const bf16* token_rows = rows + static_cast<int64_t>(t) * k * H + c;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j0 = 0; j0 < kMaxTopK; j0 += kCombineBatch) {
      if (j0 >= k) break;  // uniform: k is the call's
      float weight[kCombineBatch];
      int source[kCombineBatch];
#pragma unroll
      for (int j = 0; j < kCombineBatch; ++j) {
        weight[j] = __shfl_sync(0xffffffffu, w, j0 + j);
        source[j] = __shfl_sync(0xffffffffu, first_twin, j0 + j);
      }
      const auto used = [&](int j) { return has_columns && j0 + j < k && (valid >> (j0 + j) & 1u); };
      uint4 v[kCombineBatch];
#pragma unroll
      for (int j = 0; j < kCombineBatch; ++j)  // all loads first: up to 8 rows in flight per lane
        if (used(j)) v[j] = ldcg(reinterpret_cast<const uint4*>(token_rows + static_cast<int64_t>(source[j]) * H));
#pragma unroll
      for (int j = 0; j < kCombineBatch; ++j) {
        if (!used(j)) continue;
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&v[j]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(h2[q]);
          acc[2 * q] = fmaf(weight[j], f.x, acc[2 * q]);
          acc[2 * q + 1] = fmaf(weight[j], f.y, acc[2 * q + 1]);
        }
      }
    }
    if (!has_columns) continue;
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(t) * H + c) = o;
  }
}

}  // namespace flashmoe
