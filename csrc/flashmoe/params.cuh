// Everything one launch needs, passed by value as a __grid_constant__ parameter.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "common.cuh"
#include "layout.cuh"

namespace flashmoe {

struct Params {
  // Shapes of this call.
  int num_tokens;    // T on this rank (0..capacity.max_tokens_per_rank)
  int hidden_size;        // H
  int intermediate_size;  // I
  int top_k;         // k
  int num_experts;   // E (global)
  int num_local;     // experts on this rank
  int rank, world_size;
  int max_tokens_per_rank;  // capacity: rows per source in the receive buffers
  int layer_id;
  int metrics;       // 1: write the metrics ring
  int gemm0_max_splits;  // 1..kMaxGemm0Splits (scheduler.cuh)
  uint64_t timeout_ns;

  // Inputs and output.
  const bf16* x;               // [T, H]
  const int* topk_ids;         // [T, k], -1 = skip
  const float* topk_weights;   // [T, k]
  const void* w13;             // [E_l, 2I, H], gate rows then up rows (bf16, or e4m3 in fp8 layers)
  const void* w2;              // [E_l, H, I]
  const float* w13_scale;      // fp8 layers: [E_l, 2I/128, H/128] per 128x128 block (dequantised = q * scale)
  const float* w2_scale;       // fp8 layers: [E_l, H/128, I/128]
  const int* expert_rank;      // [E]
  const int* expert_local;     // [E]
  bf16* out;                   // [T, H]
  // null, or int64 [>=1], read on the device at launch: a negative first entry marks every token of this call
  // as an engine's padding (a DP rank's dummy step): the rank dispatches nothing and writes zeros, but still
  // takes part in the call (the GEMMs of other ranks' rows, the signals).
  const int64_t* padding_marker;

  // Symmetric heap (local addresses) and local workspace.
  char* sym;
  // Rank r's symmetric heap mapped into this GPU (NVLink stores), or null where r is reached by puts: another
  // node, or FLASHMOE_FORCE_PUT (the host applies the rules, kernel.cu peer_table).
  char* peer_sym[kMaxWorld];
  SymLayout sym_off;
  char* ws;
  WorkspaceLayout ws_off;
  int64_t expert_rows_stride;  // entries per local expert list (W * max_tokens)

  // TMA descriptors of this call's weights (built on the host per launch, see kernel.cu).
  CUtensorMap tmap_w13;  // w13 as [E_l][I/8][2][8][H]: one box = a stage's 128 gate/up rows x 128 bytes of K
  CUtensorMap tmap_w2;   // w2 as [E_l H / 8][8][I]: one box = 128 rows x 128 bytes of K

  Status* status;              // host-mapped
  int64_t* metrics_ring;       // [kRingSlots, kRingFields]
  int64_t* metrics_totals;     // [kMaxLayers, kTotalsFields]
};

template <typename T>
__device__ __forceinline__ T* sym_ptr(const Params& p, int64_t off) { return reinterpret_cast<T*>(p.sym + off); }
template <typename T>
__device__ __forceinline__ T* ws_ptr(const Params& p, int64_t off) { return reinterpret_cast<T*>(p.ws + off); }

}  // namespace flashmoe
