// The expert GEMM engine (Hopper): swap-AB tiles, weights by TMA, tokens by cp.async, wgmma, an mbarrier
// pipeline between a producer warpgroup and two consumer warpgroups. Two weight formats: bf16, and e4m3 with
// fp32 scales per 128x128 weight block and per token per 128-element group (fp8 layers).
//
// Every expert GEMM computes out[token, feature] = sum_k x[token, k] * W[feature, k] as
// D[feature, token] = W[feature, :] . x[token, :] ("swap-AB"): 64 weight rows are wgmma's A operand and the
// tokens its N side (16, 32, 64 or 128 per tile, chosen per expert from its row count; 16 only in calls whose
// every expert fits it, see call_tile_tokens). An expert with one row wastes no tensor-core row, and each
// weight tile streams from HBM once per call however few tokens use it.
//
//   warpgroup 0     producer: thread 0 issues the TMA loads of the 128 weight rows of a stage (128-byte
//                   swizzle); all 128 threads gather the stage's token rows with cp.async into the same
//                   swizzled layout, completing on the stage's `full` barrier.
//   warpgroups 1,2  consumers, wgmma m64nNk16 into fp32 registers; a warp releases a stage (`empty`) once its
//                   wgmma on it completed. Decode tiles (N <= 64) are ping-pong: the two warpgroups take
//                   turns, each computing all 128 rows of its tile while the other runs its previous tile's
//                   epilogue and next-task bookkeeping, so some warpgroup always drains the ring and the SM
//                   keeps streaming across tile boundaries. 128-token tiles are split: 64 rows each.
//
// fp8 tiles stream 128-byte rows too (128 e4m3 of K per K step, one scale block), so a step has the bytes and swizzle
// of a bf16 one (a decode stage carries two steps, stage_k_steps). Each stage also carries its scales (a float per
// token row, the weight block's), and the consumers promote: a K step's wgmmas accumulate into fresh registers, which
// are added to the fp32 accumulators times (token scale x weight scale) -- the tensor core's fp8 accumulation keeps ~13
// bits, so partial sums longer than one block would lose precision (DeepGEMM does the same). The promotion registers
// double the accumulator footprint, so fp8 tiles are ping-pong up to 32 tokens and split (two warpgroups) at 64 and
// 128. A 128-token fp8 tile (prefill: an expert with more than 64 rows) is token-major instead of swap-AB: each
// consumer's 64 tokens are wgmma's A operand and the stage's 128 weight rows its N side, so a thread's accumulators
// belong to 2 tokens and the 128-K promotion needs 4 scale products per thread, where a swap-AB thread of that tile
// holds 32 tokens and needs 64 (the instruction stream that bounded the swap-AB 128-token stage,
// benchmarks/kernel-notes.md). Its GEMM0 epilogue stages 128 tokens x 128 fp32 features (66 KiB), which leaves 4
// stages.
//
// bf16 prefill tiles are wide (scheduler.cuh wide_call): a 128-token tile's stage holds 256 weight rows (two boxes:
// GEMM0 128 intermediate features, GEMM1 256 output features) beside its token rows, 48 KiB for twice the tensor
// work of a 128-row tile's 32 KiB stage, whose loads bounded it (benchmarks/kernel-notes.md). Wide tiles are
// token-major: each consumer computes its 64 tokens against all 256 weight rows (wgmma m64n256k16, 128 fp32
// accumulators; the operands' shared-memory reads are 80 KiB a stage, swap-AB's were 96), then stages its rows in its
// own box of the tile's last stage (GEMM0: 128 SwiGLU features, 16 KiB) or last two (GEMM1: 256 output features, 128
// in each), which it releases only after the copy-out: 4 stages of 48 KiB fill the pool.
//
// The pipeline is drained only when the tile width changes (the stage pool is re-carved, PipeState::enter);
// otherwise the producer runs ahead into the next tile while the consumers run an epilogue. Tasks (tasks.cuh)
// call produce_tile on the producer side and mma_tile_to_staging on the consumer side; only this file knows
// the accumulator layout.
#pragma once

#include <type_traits>

#include "comm.cuh"
#include "hopper.cuh"
#include "params.cuh"
#include "trace.cuh"

namespace flashmoe {

constexpr int kTileK = 64;               // 64 bf16 = one 128-byte swizzle row
constexpr int kTileKFp8 = 128;           // 128 e4m3 = the same row = one scale block of K
constexpr int kRowBytesK = 128;          // bytes of K per stage row, either format
// fp8 partial sums are promoted to the fp32 accumulators every kFp8PromoteK of K (a multiple of 32, dividing
// 128). Measured on an H200 (scripts/fp8_internals.py, Qwen3-30B shape): the tensor core's accumulation over
// a 128-K chain of four wgmmas moves 0.93% of the SwiGLU activations' e4m3 codes by a step against the
// exact-partial reference, promoting after every wgmma (32) 0.37%; the layer output differs from the
// reference by 5.0e-3 vs 2.7e-3 (rel. Frobenius), both far below fp8's own quantisation error (4.6e-2).
constexpr int kFp8PromoteK = 128;
__host__ __device__ constexpr int tile_k(bool fp8) { return fp8 ? kTileKFp8 : kTileK; }
constexpr int kConsumers = 2;            // consumer warpgroups
constexpr int kConsumerRows = 64;        // weight rows per consumer (wgmma M)
constexpr int kTileWeightRows = kConsumers * kConsumerRows;
constexpr int kMaxTileTokens = 128;
constexpr int kProducerThreads = 128;
constexpr int kStageWeightBytes = kTileWeightRows * kTileK * 2;  // 16 KiB
constexpr int kFullArrivals = 1 + kProducerThreads;  // TMA expect-tx + every producer thread's cp.async
constexpr int kEmptyArrivals = kConsumers * 4;       // every consumer warp once, or the owner's warps twice

// fp8 tiles of width n whose consumers split the tokens (64 each, all 128 weight rows) rather than the weight
// rows: token-major, see above.
__host__ __device__ constexpr bool token_major(int n, bool fp8) { return fp8 && n == kMaxTileTokens; }
// bf16 staging row stride of a token-major consumer: its 64 tokens x the tile's 128 features, padded by 16 B.
constexpr int kTokenMajorStride = kTileWeightRows + 8;

// A wide stage (bf16, 128 tokens): two weight boxes of 128 rows, then the token rows.
constexpr int kWideBoxes = 2;
constexpr int kWideStageBytes = kWideBoxes * kStageWeightBytes + kMaxTileTokens * kRowBytesK;  // 48 KiB
constexpr int kWideTokensOffset = kWideBoxes * kStageWeightBytes;

// Whether tiles of width n are ping-pong (one warpgroup per tile) or split (both warpgroups, 64 rows each):
// a ping-pong warpgroup holds 128 x n fp32 accumulators, which fits the register budget up to n = 64 (bf16)
// or n = 32 (fp8, whose promotion registers double that).
__host__ __device__ constexpr bool ping_pong(int n, bool fp8) { return n <= (fp8 ? 32 : 64); }
// Weight rows of a tile one consumer warpgroup computes, and their 64-row halves (one accumulator set each).
__host__ __device__ constexpr int consumer_rows(int n, bool fp8) {
  return ping_pong(n, fp8) ? kTileWeightRows : kConsumerRows;
}
// bf16 epilogue staging, per consumer: [token][feature] bf16, rows padded by 16 B to spread banks.
__host__ __device__ constexpr int staging_stride(int n, bool fp8) { return consumer_rows(n, fp8) + 8; }
// fp8 GEMM0 staging: fp32 SwiGLU values [token][128 features] (padded by 16 B), so the epilogue can take each
// token's 128-group maximum before quantising. A ping-pong consumer's 32 tokens fill its half of the area; a
// split tile's 64 or 128 tokens span the whole area (each consumer writes its features' columns).
constexpr int kFp8StagingStride = kTileKFp8 + 4;                   // floats
constexpr int kFp8Gemm0Passes = kTileKFp8 / 64;  // an fp8 GEMM0 task: 128 features = two 64-feature weight tiles
__host__ __device__ constexpr int fp8_staging_bytes(int n) {
  return (ping_pong(n, true) ? kConsumers * n : n) * kFp8StagingStride * 4;
}

static_assert(kThreads == kProducerThreads + kConsumers * 128, "one producer and two consumer warpgroups");
static_assert(kConsumers * kConsumerRows == kHiddenMultiple, "GEMM1 output tile = H step");
static_assert(kConsumers * kConsumerRows / 2 == kInterMultiple, "GEMM0 output tile (gate+up rows) = I step");
static_assert(kTileK == kInterMultiple, "GEMM1 K step");

// How the consumer mainloops are compiled. ptxas serialises wgmmas that may be in flight across a call, and it
// judges that per function in relocatable device code, where each mainloop is a separate function without
// calls, but for the whole kernel in a whole program (the default build's fp8 kernel, recipe.py), where the
// kernel's calls (a timeout's report, IEEE division's slow path) would serialise every wgmma behind a call into
// a mainloop (ptxas C7510): there the mainloops are inlined into the consumer's loop.
#ifdef __CUDACC_RDC__
#define FLASHMOE_MAINLOOP static __device__ __noinline__
#else
#define FLASHMOE_MAINLOOP static __device__ __forceinline__
#endif

// Decode tiles: an expert with a handful of rows (EP4 decode: 1-8) fills 16 token columns no worse than 32, and
// the narrower wgmma, token loads and promotion shorten each stage of the SM's own work, which bounds the
// decode stream wherever fewer than all SMs stream (benchmarks/kernel-notes.md).
constexpr int kDecodeTileTokens = 16;

// K steps per pipeline stage. An fp8 decode stage carries two, so the per-stage work of both sides (the producer's
// slot wait, expect-tx and arrive; the consumer's wait, proxy fence, drain and release) comes once per 32 KiB of
// weights, and a consumer issues the second step's wgmmas before it drains and promotes the first's. A tile with
// an odd number of K steps (a K split, I = 1408 in fp8) ends on a stage whose second step is zeros: its weights
// come from a TMA box past the tensor's K (zero-filled, no memory read), its token rows and scales are
// zero-filled. The consumers then run the same straight-line stage every time (a stage of a run-time step
// count put their wgmmas on a divergent path, which ptxas serialises: C7520).
// bf16 decode stages keep one K step: two measured 0.97-1.05x of one (benchmarks/kernel-notes.md).
__host__ __device__ constexpr int stage_k_steps(int n, bool fp8) { return fp8 && n == kDecodeTileTokens ? 2 : 1; }
// Stages a tile of width n and k_steps K steps takes from the ring.
__host__ __device__ constexpr int tile_stages(int n, bool fp8, int k_steps) {
  return (k_steps + stage_k_steps(n, fp8) - 1) / stage_k_steps(n, fp8);
}

// Dynamic shared memory, carved from a 1024-byte aligned base (the 128-byte swizzle needs it):
//   [barriers | task slots | row tables]  4 KiB
//   [stage pool ........................ | epilogue staging]
// A stage holds 16 KiB of weights and N x 128 B of token rows per K step ([weights of each step | token rows of
// each step]), so its size follows the tile's token count N: decode tiles (N = 16, two K steps) get 5 stages
// (160 KiB of weights in flight per SM), N = 32 9, 64 7, 128 5. The epilogue staging (N rows per consumer) sits
// at the top of the pool. Tiles of another N re-carve the pool after a full drain (see PipeState::enter).
constexpr int kMaxStages = 10;
constexpr int kTaskSlots = 4;  // task indices published by the producer, not yet read by every thread
constexpr int kGemmSmemBytes = 218 * 1024;  // + ~7 KiB static (scheduler tables) stays within 227 KiB
constexpr int kFullOffset = 0;                                          // u64 [kMaxStages]
constexpr int kEmptyOffset = kFullOffset + kMaxStages * 8;              // u64 [kMaxStages]
constexpr int kTaskFullOffset = kEmptyOffset + kMaxStages * 8;          // u64 [kTaskSlots]
constexpr int kTaskEmptyOffset = kTaskFullOffset + kTaskSlots * 8;      // u64 [kTaskSlots]
constexpr int kTaskIndexOffset = kTaskEmptyOffset + kTaskSlots * 8;     // int [kTaskSlots]
constexpr int kSplitLastOffset = kTaskIndexOffset + kTaskSlots * 4;     // int [kConsumers]
constexpr int kRowDstOffset = 1024;                                     // int64 [2][128]
constexpr int kRowRankOffset = kRowDstOffset + kConsumers * kMaxTileTokens * 8;  // int [2][128]
constexpr int kPoolOffset = 4096;
constexpr int kPoolBytes = kGemmSmemBytes - 1024 /* alignment slack of the dynamic base */ - kPoolOffset;
// Scales of each stage (fp8): a float per token row, then the weight block's (GEMM0: gate, up), at the pool's
// top. They complete on the stage's `full` barrier with its token rows. A two-step stage (N <= 64) keeps step
// j's token scales at 64 j and its weight block's at kWeightScaleSlot + 2 j.
constexpr int kScaleSlotFloats = kMaxTileTokens + 8;
constexpr int kWeightScaleSlot = kMaxTileTokens;
__host__ __device__ constexpr int token_scale_slot(int step) { return step * (kMaxTileTokens / 2); }
__host__ __device__ constexpr int weight_scale_slot(int step) { return kWeightScaleSlot + 2 * step; }
static_assert(stage_k_steps(kDecodeTileTokens, true) <= 2 && kDecodeTileTokens <= kMaxTileTokens / 2 &&
                  weight_scale_slot(1) + 2 <= kScaleSlotFloats,
              "a two-step stage's scales fit its slot");
constexpr int kScaleAreaBytes = kMaxStages * kScaleSlotFloats * 4;
constexpr int kStagePoolBytes = kPoolBytes - kScaleAreaBytes;  // stages + staging
static_assert(kSplitLastOffset + kConsumers * 4 <= kRowDstOffset, "barrier area");
static_assert(kSplitRowGroups == kConsumers, "split partial sums: one row group per consumer warpgroup");
static_assert(kRowRankOffset + kConsumers * kMaxTileTokens * 4 <= kPoolOffset, "row tables");

__host__ __device__ constexpr int stage_bytes(int n, bool fp8) {
  return stage_k_steps(n, fp8) * (kStageWeightBytes + n * kRowBytesK);
}
// Step j's weights and token rows within a stage of width n.
__host__ __device__ constexpr int stage_weights_offset(int step) { return step * kStageWeightBytes; }
__host__ __device__ constexpr int stage_tokens_offset(int n, bool fp8, int step) {
  return stage_k_steps(n, fp8) * kStageWeightBytes + step * n * kRowBytesK;
}
__host__ __device__ constexpr int staging_bytes(int n, bool fp8) {
  return fp8 ? fp8_staging_bytes(n) : kConsumers * n * staging_stride(n, fp8) * 2;
}
__host__ __device__ constexpr int stages_for(int n, bool fp8) {
  const int fit = (kStagePoolBytes - staging_bytes(n, fp8)) / stage_bytes(n, fp8);
  return fit < kMaxStages ? fit : kMaxStages;
}
static_assert(stages_for(16, false) == 10 && stages_for(32, false) == 9 && stages_for(64, false) == 7 &&
                  stages_for(128, false) == 5,
              "bf16 stage counts per tile width");
static_assert(stages_for(16, true) == 5 && stages_for(32, true) == 8 && stages_for(64, true) == 7 &&
                  stages_for(128, true) == 4,
              "fp8 stage counts per tile width");
static_assert(stage_bytes(16, false) % 1024 == 0 && stage_bytes(16, true) % 1024 == 0 &&
                  stage_bytes(32, false) % 1024 == 0 && stage_bytes(64, false) % 1024 == 0 &&
                  stage_bytes(128, false) % 1024 == 0,
              "stages stay 1024-byte aligned");
// Wide stages take the whole pool: their epilogue staging is the tile's last stages (see the top of this file).
constexpr int kWideStages = kStagePoolBytes / kWideStageBytes < kMaxStages ? kStagePoolBytes / kWideStageBytes : kMaxStages;
static_assert(kWideStages == 4 && kWideStageBytes % 1024 == 0, "wide stages: 4 of 48 KiB, 1024-byte aligned");
static_assert(kWideStages * kWideStageBytes <= kStagePoolBytes, "wide stages fit the pool");
// A consumer's wide staging area (its 64 token rows of 128 bf16 features, 256 B each) is its own box of a held stage.
constexpr int kWideStagingFeatures = kStageWeightBytes / (kConsumerRows * 2);
static_assert(kWideStagingFeatures == 2 * kInterMultiple && kWideStagingFeatures == kHiddenMultiple,
              "a wide staging area: a GEMM0 consumer's 128 SwiGLU features, half of a GEMM1 consumer's 256 outputs");
static_assert(fp8_staging_bytes(16) / kConsumers >= 16 * kFp8StagingStride * 4 &&
                  fp8_staging_bytes(16) / kConsumers >= 16 * staging_stride(16, true) * 2 &&
                  fp8_staging_bytes(32) / kConsumers >= 32 * kFp8StagingStride * 4 &&
                  fp8_staging_bytes(32) / kConsumers >= 32 * staging_stride(32, true) * 2 &&
                  fp8_staging_bytes(64) / kConsumers >= 64 * staging_stride(64, true) * 2 &&
                  fp8_staging_bytes(128) / kConsumers >= kConsumerRows * kTokenMajorStride * 2,
              "fp8 staging: a ping-pong consumer's fp32 rows in its half, a consumer's GEMM1 bf16 rows in its half");

// The kernel's dynamic shared memory (the launch sizes it: kGemmSmemBytes).
extern __shared__ unsigned char gemm_dynamic_smem[];

struct GemmSmem {
  uint32_t epoch;  // for timeout reports

  // The 1024-byte aligned base, recomputed from the symbol at each use (a few instructions) rather than carried
  // in a register: the whole-program kernel spilled a carried pointer and reloaded it from local memory in the
  // producer's per-stage loop (fp8 1.02-1.06x without those reloads, benchmarks/kernel-notes.md).
  __device__ char* base() const {
    const uintptr_t a = (reinterpret_cast<uintptr_t>(gemm_dynamic_smem) + 1023) & ~static_cast<uintptr_t>(1023);
    return reinterpret_cast<char*>(a);
  }
  __device__ char* stage(int s, int n, bool fp8) const { return base() + kPoolOffset + s * stage_bytes(n, fp8); }
  __device__ char* wide_stage(int s) const { return base() + kPoolOffset + s * kWideStageBytes; }
  // A consumer's wide staging area: its box of wide stage s (one the tile holds until the copy-out).
  __device__ bf16* wide_staging(int s, int consumer) const {
    return reinterpret_cast<bf16*>(wide_stage(s) + consumer * kStageWeightBytes);
  }
  // The stage pool, free before the GEMM phase: scratch for the receive phase (subscriber.cuh).
  __device__ char* pool() const { return base() + kPoolOffset; }
  __device__ char* staging_base(int n, bool fp8) const {
    return base() + kPoolOffset + kStagePoolBytes - staging_bytes(n, fp8);
  }
  // A consumer's bf16 staging (GEMM1 rows, bf16 GEMM0 rows).
  __device__ bf16* staging(int consumer, int n, bool fp8) const {
    return reinterpret_cast<bf16*>(staging_base(n, fp8) + consumer * (staging_bytes(n, fp8) / kConsumers));
  }
  // fp8 GEMM0 fp32 staging: a ping-pong consumer's own area, or (split tiles) both areas as one.
  __device__ float* fp8_staging(int consumer, int n) const {
    const int offset = ping_pong(n, true) ? consumer * (fp8_staging_bytes(n) / kConsumers) : 0;
    return reinterpret_cast<float*>(staging_base(n, true) + offset);
  }
  __device__ float* scales(int s) const {
    return reinterpret_cast<float*>(base() + kPoolOffset + kStagePoolBytes) + s * kScaleSlotFloats;
  }
  // A GEMM1 consumer's rows (tasks.cuh store_outputs): where each goes, its address in the source's combine rows
  // (reached by NVLink) or its element offset there (a proxied source); row_rank holds the source's rank.
  __device__ int64_t* row_dst(int consumer) const {
    return reinterpret_cast<int64_t*>(base() + kRowDstOffset) + consumer * kMaxTileTokens;
  }
  __device__ int* row_rank(int consumer) const {
    return reinterpret_cast<int*>(base() + kRowRankOffset) + consumer * kMaxTileTokens;
  }
  __device__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base() + kFullOffset) + s; }
  __device__ uint64_t* empty(int s) const { return reinterpret_cast<uint64_t*>(base() + kEmptyOffset) + s; }
  __device__ uint64_t* task_full(int s) const { return reinterpret_cast<uint64_t*>(base() + kTaskFullOffset) + s; }
  __device__ uint64_t* task_empty(int s) const { return reinterpret_cast<uint64_t*>(base() + kTaskEmptyOffset) + s; }
  __device__ int* task_index(int s) const { return reinterpret_cast<int*>(base() + kTaskIndexOffset) + s; }
  __device__ int* split_last(int consumer) const { return reinterpret_cast<int*>(base() + kSplitLastOffset) + consumer; }

  // Thread 0, once per launch, before the first __syncthreads.
  __device__ void init_barriers() const {
    for (int s = 0; s < kMaxStages; ++s) {
      mbar_init(full(s), kFullArrivals);
      mbar_init(empty(s), kEmptyArrivals);
    }
    for (int s = 0; s < kTaskSlots; ++s) {
      mbar_init(task_full(s), 1);                 // the producer's thread 0 publishes a task index
      mbar_init(task_empty(s), kThreads - 32);    // every thread outside the producer's first warp has read it
    }
    mbar_init_fence();
  }
};

// Bounded wait on a pipeline barrier: a stall here is a kernel bug, reported like any other timeout (detail:
// the barrier's byte offset in the GEMM area and the thread; observed: the parity waited for).
__device__ __forceinline__ void pipe_wait(const Params& p, const GemmSmem& g, uint64_t* bar, uint32_t parity,
                                          bool give_up_on_abort = true) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (!mbar_try_wait(bar, parity)) {
    if ((++spins & 15) == 0) {
      if (give_up_on_abort && aborted(p)) return;
      if (globaltimer_ns() - start > p.timeout_ns) {
        const int64_t where = reinterpret_cast<char*>(bar) - g.base();
        record_timeout(p, kPhaseGemmPipeline, -1, (static_cast<int64_t>(threadIdx.x) << 32) | where, g.epoch, parity);
        return;
      }
    }
  }
}

// Whole-block named barrier of the GEMM phases (id 3; 0 is __syncthreads, 1-2 the consumers').
__device__ __forceinline__ void gemm_block_sync() { asm volatile("bar.sync 3, %0;\n" ::"n"(kThreads) : "memory"); }
// Both consumer warpgroups (id 4): the two halves of a split fp8 GEMM0 tile meet in the epilogue.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 4, %0;\n" ::"n"(kConsumers * 128) : "memory");
}

// Position in the stage ring for the current tile width; producer and consumers advance identical copies
// (same tiles, same stages). Each barrier's parity is tracked on its own, since the ring length changes
// with the tile width.
struct PipeState {
  int stage = 0;
  int num_stages = 0;
  int carving = 0;          // N the pool is carved for (-N: wide stages); 0 before the first tile
  uint32_t parity = 0;      // bit s: how many times stage s was used, mod 2
#if FLASHMOE_TRACE
  uint64_t trace_wait = 0;        // cycles the current tile spent waiting on pipeline barriers (all passes)
  uint64_t trace_first_full = 0;  // clock when the tile's first stage had landed (consumers; reset per tile)
  uint64_t trace_first_full_ns = 0;  // and its global time: the clock's rate moves under load
#endif

  // At the start of every tile (producer and consumers alike): a tile of another width re-carves the pool.
  // Both sides then meet at a block barrier: the consumers arrive after the previous tile's epilogue, the
  // producer after issuing that tile's loads, so no stage or staging byte of the old carving is in use.
  template <bool kFp8, bool kWide = false>
  __device__ void enter(int n) {
    const int want = kWide ? -n : n;
    if (want == carving) return;
    gemm_block_sync();
    carving = want;
    num_stages = kWide ? kWideStages : stages_for(n, kFp8);
    stage = 0;
  }
  __device__ uint32_t phase() const { return parity >> stage & 1u; }
  __device__ void advance() {
    parity ^= 1u << stage;
    if (++stage == num_stages) stage = 0;
  }
};

// Token tile for an expert with `rows` rows (either format): the smallest of 32, 64 and 128 that holds them,
// else tiles of the widest.
__host__ __device__ constexpr int tile_tokens_for(int rows) {
  return rows <= 32 ? 32 : rows <= 64 ? 64 : kMaxTileTokens;
}

// A decode call: its largest expert fits a 16-token tile, so every tile of the call is 16 tokens wide.
__host__ __device__ constexpr bool decode_call(int max_rows) { return max_rows <= kDecodeTileTokens; }

// The token tile of an expert with `rows` rows in a call whose largest expert has `max_rows`: 16 when every
// expert of the call fits it, else tile_tokens_for. Per call, not per expert: a width change drains the ring
// (PipeState::enter), and a call mixing 16- and 32-token experts would change width between most of a
// block's tiles. Either width gives an expert of <= 16 rows one tile, so tile counts follow tile_tokens_for.
__host__ __device__ constexpr int call_tile_tokens(int rows, int max_rows) {
  return decode_call(max_rows) ? kDecodeTileTokens : tile_tokens_for(rows);
}
static_assert(call_tile_tokens(3, 16) == 16 && call_tile_tokens(3, 17) == 32 && call_tile_tokens(100, 100) == 128,
              "tile width rule");

// A full call (fp8): even the expert with the fewest rows (of those with any) takes 128-token tiles, so every tile
// of the call is 128 tokens wide.
__host__ __device__ constexpr bool full_call(int min_rows) { return tile_tokens_for(min_rows) == kMaxTileTokens; }
static_assert(call_tile_tokens(65, 300) == kMaxTileTokens && full_call(65) && !full_call(64), "full call rule");

// The tile widths one compilation of the GEMM phase runs. The phase is compiled once per kind of call (moe_layer.cuh
// picks it from the expert table: every block reads the same table, so all take the same branch), so a call runs
// producer and consumer code that holds its widths alone: the widths' instantiations are most of the phase's code,
// and a decode call was 2-7% faster (twenty-fourth session), an fp8 prefill call ~3% (thirty-sixth), without the
// others in its path (benchmarks/kernel-notes.md).
enum class CallTiles {
  kDecode,  // decode_call: 16-token tiles, one per expert
  kFull,    // full_call, fp8 only: 128-token tiles
  kAny,     // 32, 64 or 128 tokens per expert (call_tile_tokens)
};
template <CallTiles kTiles>
using CallTilesConstant = std::integral_constant<CallTiles, kTiles>;

// Runs f(std::integral_constant<int, N>{}) for a tile width N from call_tile_tokens, of the widths kTiles holds.
template <CallTiles kTiles, typename F>
__device__ __forceinline__ void with_tile_tokens(int n, F&& f) {
  if constexpr (kTiles == CallTiles::kDecode) {
    f(std::integral_constant<int, kDecodeTileTokens>{});
  } else if constexpr (kTiles == CallTiles::kFull) {
    f(std::integral_constant<int, kMaxTileTokens>{});
  } else {
    if (n == 32) f(std::integral_constant<int, 32>{});
    else if (n == 64) f(std::integral_constant<int, 64>{});
    else f(std::integral_constant<int, 128>{});
  }
}

// Producer side of one tile of `n` tokens (a call_tile_tokens width), `rows` of them valid.
// `row_at(r)` is the start of token row r (r < rows; the rest are zero-filled), K step ks its bytes
// [128 ks, 128 ks + 128); fp8: `scale_at(r)` is row r's scales, one per K step. `issue_weights(weights,
// full_barrier, ks, weight_scale_dst, real)` issues the TMA loads of K step ks's 128 weight rows
// (kStageWeightBytes in total; fp8: and cp.async of the weight block scales to weight_scale_dst; thread 0 only),
// or, where `real` is false (a zero step past k_steps, see stage_k_steps), a box past the tensor's K and
// zero-filled scales. `rows_ready(ks)` returns once the token rows' K step ks may be read (all producer threads;
// the weights of that step are already on their way). All 128 producer threads call it with the same
// arguments. A stage takes stage_k_steps(n, kFp8) K steps. kWide: a wide tile (n = 128, bf16), whose
// issue_weights loads both boxes of the stage (kWideBoxes x kStageWeightBytes).
template <bool kFp8, CallTiles kTiles, bool kWide = false, typename RowAt, typename ScaleAt, typename IssueWeights,
          typename RowsReady>
__device__ __forceinline__ void produce_tile(const Params& p, const GemmSmem& g, PipeState& st, int n, int rows,
                                             int k_steps, RowAt row_at, ScaleAt scale_at, IssueWeights issue_weights,
                                             RowsReady rows_ready) {
  static_assert(!kWide || (!kFp8 && kTiles == CallTiles::kAny), "wide tiles: bf16 prefill");
  const auto body = [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    constexpr int kSteps = stage_k_steps(N, kFp8);
    constexpr int kWeightBytes = (kWide ? kWideBoxes : 1) * kStageWeightBytes;
    st.enter<kFp8, kWide>(N);
    const int tid = threadIdx.x;  // 0..127
    const int chunk = tid & 7;    // 16-byte chunk of the 128-byte row
    const char* row[N / 16];      // this thread's rows: tile rows (tid / 8) + 16 i
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const int r = (tid >> 3) + 16 * i;
      row[i] = r < rows ? row_at(r) : nullptr;
    }
    [[maybe_unused]] const float* scale_row = nullptr;  // fp8: row tid's scales
    if constexpr (kFp8) {
      if (tid < rows) scale_row = scale_at(tid);
    }
    const void* const zero_fill = p.x;  // any global address: the zero-filling copies below read nothing
    uint64_t waited = 0;
    trace(kTraceProducerRowsLocated);
    for (int ks = 0; ks < k_steps; ks += kSteps) {
      const uint64_t wait_start = trace_clock();
      pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);
      waited += trace_clock() - wait_start;
      if (ks == 0) trace(kTraceProducerFirstSlot);
      char* stage = kWide ? g.wide_stage(st.stage) : g.stage(st.stage, N, kFp8);
      uint64_t* full = g.full(st.stage);
      const uint32_t scales = smem_addr(g.scales(st.stage));
      if (tid == 0) {
        mbar_arrive_expect_tx(full, kSteps * kWeightBytes);
#pragma unroll
        for (int j = 0; j < kSteps; ++j)
          issue_weights(stage + stage_weights_offset(j), full, ks + j, scales + weight_scale_slot(j) * 4,
                        kSteps == 1 || ks + j < k_steps);
      }
      __syncwarp();  // warp 0 whole again before its next wait (see next_task)
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        const bool real = kSteps == 1 || ks + j < k_steps;  // else the zero step of an odd tile
        if (real) rows_ready(ks + j);
        const uint32_t tokens = smem_addr(stage + (kWide ? kWideTokensOffset : stage_tokens_offset(N, kFp8, j)));
#pragma unroll
        for (int i = 0; i < N / 16; ++i) {
          const int r = (tid >> 3) + 16 * i;
          const uint32_t dst = tokens + r * 128 + ((chunk ^ (r & 7)) << 4);  // the 128-byte swizzle
          const bool load = real && row[i] != nullptr;
          cp_async_16(dst, load ? row[i] + (ks + j) * kRowBytesK + chunk * 16 : zero_fill, load);
        }
        if constexpr (kFp8) {  // padding rows get scale 0 (their zero rows contribute nothing either way)
          const bool load = real && scale_row != nullptr;
          const uint32_t dst = scales + (token_scale_slot(j) + tid) * 4;
          if (tid < N) cp_async_4(dst, load ? scale_row + ks + j : zero_fill, load);
        }
      }
      mbar_arrive_on_cp_async(full);
      st.advance();
      if (ks == 0) trace(kTraceProducerFirstIssue);
    }
    trace(kTraceProducerLastIssue, static_cast<uint32_t>(waited));
  };
  if constexpr (kWide) body(std::integral_constant<int, kMaxTileTokens>{});
  else with_tile_tokens<kTiles>(n, body);
}

// Consumers: wait until the current stage has landed (trace builds time the wait), then make its cp.async
// token rows (generic proxy) visible to wgmma (async proxy).
// Ping-pong tiles (kPingPong) first wait until the stage's previous use was released (the producer's own
// condition for this fill): a parity wait only tells the phase it names from the one before, so a consumer that
// skipped the other's ping-pong tile and reaches the stage while that tile's fill of it is still in flight would
// take the pending phase's parity for its own and read the stage early. bf16 tiles release a stage only after
// waiting for the next one (a tile's last excepted), which closes that window for tiles longer than the ring;
// fp8 tiles release right after their wgmma (consume_tile_fp8), which leaves it open (benchmarks/kernel-notes.md,
// evict-first section). Split and token-major tiles need no such wait: both consumers take every stage of a run
// of them, so this consumer released the stage's previous use itself and the producer refills it only after
// that; and a run starts behind PipeState::enter's block barrier, which each consumer reaches only after its
// last tile, so no fill of the old width is in flight by then (the tiles it skipped were the other's, finished
// before the other reached the barrier).
template <bool kPingPong>
__device__ __forceinline__ void wait_stage_full(const Params& p, const GemmSmem& g, PipeState& st, int ks) {
  if constexpr (kPingPong) pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);
#if FLASHMOE_TRACE
  const uint64_t wait_start = clock64();
  pipe_wait(p, g, g.full(st.stage), st.phase());
  const uint64_t landed = clock64();
  st.trace_wait += landed - wait_start;
  if (ks == 0 && st.trace_first_full == 0) {  // a tile's first pass only
    st.trace_first_full = landed;
    st.trace_first_full_ns = globaltimer_ns();
  }
#else
  (void)ks;
  pipe_wait(p, g, g.full(st.stage), st.phase());
#endif
  fence_proxy_async();
}

// The stages a wide tile holds for its epilogue's staging: the last (held[1]) and, GEMM1, the one before (held[0]).
struct HeldStages {
  int held[2] = {-1, -1};
};

// Consumer side of one tile: acc[h] = 64 weight rows x N tokens over K, for the consumer's kHalves row halves
// (ping-pong: both halves of the tile; split: the consumer's own half). A wide tile is token-major instead: acc is
// the consumer's 64 tokens x the stage's 256 weight rows (wgmma m64n256k16, tokens as A): its wgmmas read 80 KiB of
// shared memory a stage where swap-AB's read 96 (the token rows four times), and the fills' 48 KiB share the same
// ~128 B a cycle (benchmarks/experiments/wide_stage.cu).
// A wide tile's last kHold stages are not released: they hold the consumer's staging until the epilogue has copied
// it out (release_held_stages); k_steps >= kHold.
template <int N, int kHalves = ping_pong(N, false) ? 2 : 1, bool kWide = false, int kHold = kWide ? 1 : 0>
__device__ __forceinline__ HeldStages consume_tile(const Params& p, const GemmSmem& g, PipeState& st, int k_steps,
                                                   float (&acc)[kHalves][N / 2]) {
  static_assert(!kWide || (N == kMaxTileTokens && kHalves == 2 && N == 2 * kConsumerRows &&
                            kHalves * N / 2 == kConsumerRows * 2 * kTileWeightRows / 128),
                "a wide consumer: its 64 tokens x 256 weight rows, 128 accumulators (acc's two halves, one wgmma)");
  static_assert(kWide ? kHold == 1 || kHold == 2 : kHold == 0, "only wide tiles hold stages");
  const int consumer = threadIdx.x / 128 - 1;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  // Both consumers take every stage of a split or wide tile: all 8 consumer warps release it once. A ping-pong
  // stage is released by its owner's 4 warps, twice each.
  constexpr bool kPingPong = kHalves == 2 && !kWide;
  constexpr uint32_t kReleases = kPingPong ? 2 : 1;
  const uint32_t first_row = kHalves == 2 ? 0 : consumer * kConsumerRows;
  int previous = -1;
  int ks = 0;
  do {  // k_steps >= 1 (K is a multiple of kTileK); a do-loop keeps ptxas's wgmma pipeline analysis simple
    wait_stage_full<kPingPong>(p, g, st, ks);
    if constexpr (kWide) {
      const uint32_t stage = smem_addr(g.wide_stage(st.stage));
      const uint64_t a = sw128_desc(stage + kWideTokensOffset + consumer * kConsumerRows * 128);  // its 64 tokens
      const uint64_t b = sw128_desc(stage);                                                     // 256 weight rows
      float(&all)[kHalves * N / 2] = *reinterpret_cast<float(*)[kHalves * N / 2]>(&acc[0][0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk)
        Wgmma<2 * kTileWeightRows>::mma(all, a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);
    } else {
      const uint32_t stage = smem_addr(g.stage(st.stage, N, false));
      const uint64_t b = sw128_desc(stage + kStageWeightBytes);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * kConsumerRows) * 128);
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) Wgmma<N>::mma(acc[h], a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's wgmma is done: its stage can be refilled
    if (previous >= 0 && (kHold < 2 || ks + 1 < k_steps) && warp_leader) mbar_arrive(g.empty(previous), kReleases);
    previous = st.stage;
    st.advance();
  } while (++ks < k_steps);
  wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < kHalves; ++h) fence_accumulators(acc[h]);
  HeldStages out;
  if constexpr (kHold == 0) {
    if (previous >= 0 && warp_leader) mbar_arrive(g.empty(previous), kReleases);
  } else {
    out.held[1] = previous;
    if constexpr (kHold == 2) out.held[0] = previous == 0 ? st.num_stages - 1 : previous - 1;  // the ring's order
  }
  return out;
}

// A consumer's release of the stages a wide tile held, once its epilogue has read its staging there: its generic
// stores and loads are ordered before the TMA writes of the stages' next fills (async proxy), which follow the release.
__device__ __forceinline__ void release_held_stages(const GemmSmem& g, const HeldStages& held) {
  fence_proxy_async();
  __syncwarp();
  if ((threadIdx.x & 31) == 0)
    for (int s : held.held)
      if (s >= 0) mbar_arrive(g.empty(s), 1);
}

// fp8 consumer side of one swap-AB tile (N <= 64): each K step (one 128-K scale block) accumulates into fresh
// registers, which are promoted into acc with the step's scales: acc += (token scale * weight scale) * partial,
// the reference's order (flashmoe/reference_fp8.py). Row r0 = 16 w + l/4 of a half takes the stage's first
// weight scale, row r0 + 8 the second: GEMM0's gate and up rows (the w13 box interleaves 8 of each), GEMM1's
// one block twice. The stage is released once its scales are in registers.
template <int N, int kHalves = ping_pong(N, true) ? 2 : 1>
__device__ __forceinline__ void consume_tile_fp8(const Params& p, const GemmSmem& g, PipeState& st, int k_steps,
                                                 float (&acc)[kHalves][N / 2]) {
  static_assert(!token_major(N, true), "128-token fp8 tiles: consume_tile_fp8_token_major");
  static_assert(stage_k_steps(N, true) == 1, "two-step stages: consume_tile_fp8_two_steps");
  const int consumer = threadIdx.x / 128 - 1;
  const int lane = threadIdx.x & 31;
  constexpr uint32_t kReleases = kHalves == 2 ? 2 : 1;
  const uint32_t first_row = kHalves == 2 ? 0 : consumer * kConsumerRows;
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;
  int ks = 0;
  do {
    wait_stage_full<kHalves == 2>(p, g, st, ks);
    const uint32_t stage = smem_addr(g.stage(st.stage, N, true));
    const uint64_t b = sw128_desc(stage + kStageWeightBytes);
    const float* scales = g.scales(st.stage);
    const float weight_lo = scales[kWeightScaleSlot], weight_hi = scales[kWeightScaleSlot + 1];
    float token[N / 4];  // this thread's token columns 8 j + 2 (l % 4) (+1)
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      token[2 * j] = scales[8 * j + 2 * (lane & 3)];
      token[2 * j + 1] = scales[8 * j + 2 * (lane & 3) + 1];
    }
    constexpr int kPerPromotion = kFp8PromoteK / 32;
#pragma unroll
    for (int k0 = 0; k0 < kTileKFp8 / 32; k0 += kPerPromotion) {
      float partial[kHalves][N / 2];
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + (first_row + h * kConsumerRows) * 128);
#pragma unroll
        for (int kk = k0; kk < k0 + kPerPromotion; ++kk)
          WgmmaFp8<N>::mma(partial[h], a + 2 * kk, b + 2 * kk, kk > k0);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[h]);
      if (k0 + kPerPromotion == kTileKFp8 / 32) {
        __syncwarp();
        if (lane == 0) mbar_arrive(g.empty(st.stage), kReleases);
      }
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          acc[h][4 * j] = fmaf(token[2 * j] * weight_lo, partial[h][4 * j], acc[h][4 * j]);
          acc[h][4 * j + 1] = fmaf(token[2 * j + 1] * weight_lo, partial[h][4 * j + 1], acc[h][4 * j + 1]);
          acc[h][4 * j + 2] = fmaf(token[2 * j] * weight_hi, partial[h][4 * j + 2], acc[h][4 * j + 2]);
          acc[h][4 * j + 3] = fmaf(token[2 * j + 1] * weight_hi, partial[h][4 * j + 3], acc[h][4 * j + 3]);
        }
    }
    st.advance();
  } while (++ks < k_steps);
}

// consume_tile_fp8 for a decode tile's stages of two K steps (stage_k_steps): a stage's wgmmas are issued at once,
// one commit group per promotion (kGroups: its K steps x promotions per step), then each group is drained and
// promoted in order, so the first step's promotion overlaps the second step's wgmmas. The scales are read before
// the stage is released (its slot is refilled then). Its own function: with one loop for both stage sizes the
// whole-program kernel was 0.5-4% slower at prefill than with the one-step loop kept as it was (kernel-notes.md).
template <int N, int kHalves = ping_pong(N, true) ? 2 : 1>
__device__ __forceinline__ void consume_tile_fp8_two_steps(const Params& p, const GemmSmem& g, PipeState& st,
                                                           int k_steps, float (&acc)[kHalves][N / 2]) {
  constexpr int kSteps = stage_k_steps(N, true);
  static_assert(kSteps == 2 && kHalves == 2, "ping-pong decode tiles only; one-step stages: consume_tile_fp8");
  const int lane = threadIdx.x & 31;
  constexpr uint32_t kReleases = 2;  // the owner's 4 warps, twice each
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[h][i] = 0.f;
  constexpr int kPerPromotion = kFp8PromoteK / 32;     // wgmma k32 per group
  constexpr int kPromotions = kTileKFp8 / kFp8PromoteK;  // groups per K step
  constexpr int kGroups = kSteps * kPromotions;
  int ks = 0;
  do {
    wait_stage_full<kHalves == 2>(p, g, st, ks);
    const uint32_t stage = smem_addr(g.stage(st.stage, N, true));
    // The stage's scales into registers now: the slot is refilled once the stage is released, before promotion.
    const float* scales = g.scales(st.stage);
    float weight_lo[kSteps], weight_hi[kSteps];
    float token[kSteps][N / 4];  // this thread's token columns 8 j + 2 (l % 4) (+1)
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      weight_lo[step] = scales[weight_scale_slot(step)];
      weight_hi[step] = scales[weight_scale_slot(step) + 1];
      const float* token_scales = scales + token_scale_slot(step);
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        token[step][2 * j] = token_scales[8 * j + 2 * (lane & 3)];
        token[step][2 * j + 1] = token_scales[8 * j + 2 * (lane & 3) + 1];
      }
    }
    float partial[kGroups][kHalves][N / 2];
    wgmma_fence();
#pragma unroll
    for (int group = 0; group < kGroups; ++group) {
      const int step = group / kPromotions, k0 = group % kPromotions * kPerPromotion;
      const uint64_t b = sw128_desc(stage + stage_tokens_offset(N, true, step));
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const uint64_t a = sw128_desc(stage + stage_weights_offset(step) + h * kConsumerRows * 128);  // all 128 rows
#pragma unroll
        for (int kk = k0; kk < k0 + kPerPromotion; ++kk)
          WgmmaFp8<N>::mma(partial[group][h], a + 2 * kk, b + 2 * kk, kk > k0);
      }
      wgmma_commit();
    }
#pragma unroll
    for (int group = 0; group < kGroups; ++group) {
      wgmma_wait_pending(kGroups - 1 - group);  // known once unrolled
#pragma unroll
      for (int h = 0; h < kHalves; ++h) fence_accumulators(partial[group][h]);
      if (group == kGroups - 1) {  // the stage's last wgmma is done: release it
        __syncwarp();
        if (lane == 0) mbar_arrive(g.empty(st.stage), kReleases);
      }
      const int step = group / kPromotions;
      const float lo = weight_lo[step], hi = weight_hi[step];
      const float* t = token[step];
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          float* d = acc[h] + 4 * j;
          const float* q = partial[group][h] + 4 * j;
          d[0] = fmaf(t[2 * j] * lo, q[0], d[0]);
          d[1] = fmaf(t[2 * j + 1] * lo, q[1], d[1]);
          d[2] = fmaf(t[2 * j] * hi, q[2], d[2]);
          d[3] = fmaf(t[2 * j + 1] * hi, q[3], d[3]);
        }
    }
    st.advance();
  } while ((ks += kSteps) < k_steps);
}

// Tokens of a token-major consumer thread's accumulators: tile rows token_major_row() and + 8 (wgmma m64nN's
// fp32 layout: warp w, lane l holds rows 16 w + l/4 (+8) and columns 8 j + 2 (l % 4) (+1)).
__device__ __forceinline__ int token_major_row() {
  const int consumer = threadIdx.x / 128 - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  return consumer * kConsumerRows + 16 * warp + (lane >> 2);
}

// fp8 consumer side of a token-major 128-token tile: acc = this consumer's 64 tokens x the tile's 128 weight
// rows (columns 8 j + 2 (l % 4) (+1): column group j is GEMM0's gate rows for even j and up rows for odd j, the
// w13 box's interleave, so it takes the first weight scale or the second; GEMM1's one block twice). The same
// promotion as consume_tile_fp8, acc += (token scale * weight scale) * partial, from 4 products per thread.
__device__ __forceinline__ void consume_tile_fp8_token_major(const Params& p, const GemmSmem& g, PipeState& st,
                                                             int k_steps, float (&acc)[kTileWeightRows / 2]) {
  constexpr int N = kMaxTileTokens;
  const int consumer = threadIdx.x / 128 - 1;
  const int lane = threadIdx.x & 31;
  const int row = token_major_row();
#pragma unroll
  for (int i = 0; i < kTileWeightRows / 2; ++i) acc[i] = 0.f;
  int ks = 0;
  do {
    wait_stage_full<false>(p, g, st, ks);
    const uint32_t stage = smem_addr(g.stage(st.stage, N, true));
    const uint64_t a = sw128_desc(stage + kStageWeightBytes + consumer * kConsumerRows * 128);  // the tokens
    const uint64_t b = sw128_desc(stage);                                                        // the weights
    const float* scales = g.scales(st.stage);
    const float weight_lo = scales[kWeightScaleSlot], weight_hi = scales[kWeightScaleSlot + 1];
    const float token_lo = scales[row], token_hi = scales[row + 8];
    const float lo_lo = token_lo * weight_lo, lo_hi = token_lo * weight_hi;  // (token row, weight scale)
    const float hi_lo = token_hi * weight_lo, hi_hi = token_hi * weight_hi;
    float partial[kTileWeightRows / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileKFp8 / 32; ++kk) WgmmaFp8<kTileWeightRows>::mma(partial, a + 2 * kk, b + 2 * kk, kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(partial);
    __syncwarp();
    if (lane == 0) mbar_arrive(g.empty(st.stage), 1);  // every consumer warp once
#pragma unroll
    for (int j = 0; j < kTileWeightRows / 8; ++j) {
      const float first = j % 2 == 0 ? lo_lo : lo_hi, second = j % 2 == 0 ? hi_lo : hi_hi;
      acc[4 * j] = fmaf(first, partial[4 * j], acc[4 * j]);
      acc[4 * j + 1] = fmaf(first, partial[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(second, partial[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(second, partial[4 * j + 3], acc[4 * j + 3]);
    }
    st.advance();
  } while (++ks < k_steps);
}

// Named barrier of one consumer warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int consumer) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
}

// ---- Epilogues: accumulators -> bf16 [token][feature] rows in the consumer's staging area.
// wgmma m64nN fp32 layout: warp w, lane l holds, for each 8-token group j, rows 16w + l/4 (+8) and
// tokens 8j + 2(l%4) (+1).

// GEMM0 row half whose 64 A rows are 4 groups of (8 gate rows, 8 up rows) of the same 8 features (that is
// how the w13 tensor map loads them): a thread holds gate and up of one feature, so SwiGLU happens here.
// Writes the half's 32 features at staging column `column`: bf16 rows, or fp32 ones (fp8 GEMM0: the epilogue
// quantises each token's 128-group from these values).
template <int N, typename T>
__device__ __forceinline__ void store_swiglu(const float (&acc)[N / 2], T* staging, int stride, int column) {
  static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, float>, "bf16 or fp32 staging");
  const auto to_staging = [](float v) {
    if constexpr (std::is_same_v<T, bf16>) return __float2bfloat16_rn(v);
    else return v;
  };
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int f = column + 8 * warp + (lane >> 2);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int t = 8 * j + 2 * (lane & 3);
    staging[t * stride + f] = to_staging(silu(acc[4 * j]) * acc[4 * j + 2]);
    staging[(t + 1) * stride + f] = to_staging(silu(acc[4 * j + 1]) * acc[4 * j + 3]);
  }
}

// A wide (token-major) consumer's staging: its 64 token rows of 128 bf16 features (256 B), the 16-byte chunks of
// each row XOR-swizzled by the row's low bits (chunk q of row t at q ^ (t % 8)), so the rows fill the consumer's 16 KiB
// box without padding and the 8 rows of a stmatrix block fall on distinct banks. wide_chunk reads them back.
// Accumulators (token-major, m64n256): warp w, lane l holds tokens 16 w + l/4 and + 8, columns 8 i + 2 (l % 4) and
// + 1 for i < 32, in acc[4 i..4 i + 3]: an 8-token x 8-column block per (token group, i) is an mma fragment, stored by
// non-transposed stmatrix, four blocks an instruction. (Each value stored alone made ptxas serialise the mainloop's
// wgmmas, C7514.)
constexpr int kWideRowChunks = kWideStagingFeatures / 8;
__device__ __forceinline__ int wide_chunk(int row, int chunk) { return row * kWideRowChunks + (chunk ^ (row & 7)); }
// The address this lane gives stmatrix for block pair (b, b + 1) of its warp's tokens: matrices (b, tokens 0-7),
// (b, 8-15), (b + 1, 0-7), (b + 1, 8-15) of the warp's 16, block b at chunk `chunk`.
__device__ __forceinline__ uint32_t wide_stmatrix_addr(uint32_t staging, int chunk) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int matrix = lane >> 3;
  const int row = 16 * warp + 8 * (matrix & 1) + (lane & 7);
  return staging + wide_chunk(row, chunk + (matrix >> 1)) * 16;
}

// GEMM0: the w13 boxes interleave 8 gate rows and the same 8 features' up rows, so column blocks 2 q and 2 q + 1 are
// gate and up of features 8 q..8 q + 7 (q < 16: the tile's 128 features) and SwiGLU is register-local.
__device__ __forceinline__ void store_swiglu_wide(const float (&acc)[2 * kTileWeightRows / 2], uint32_t staging) {
  uint32_t v[4];
#pragma unroll
  for (int q = 0; q < kWideStagingFeatures / 8; q += 2) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float* gate = acc + 8 * (q + m);
      const float* up = gate + 4;
      v[2 * m] = pack_bf16x2(silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
      v[2 * m + 1] = pack_bf16x2(silu(gate[2]) * up[2], silu(gate[3]) * up[3]);
    }
    stmatrix_x4(wide_stmatrix_addr(staging, q), v[0], v[1], v[2], v[3]);
  }
}

// GEMM1: 256 output features, the first 128 into `area0`, the others into `area1`.
__device__ __forceinline__ void store_plain_wide(const float (&acc)[2 * kTileWeightRows / 2], uint32_t area0,
                                                 uint32_t area1) {
#pragma unroll
  for (int i = 0; i < 2 * kTileWeightRows / 8; i += 2) {
    const uint32_t area = i < kWideRowChunks ? area0 : area1;
    stmatrix_x4(wide_stmatrix_addr(area, i % kWideRowChunks), pack_bf16x2(acc[4 * i], acc[4 * i + 1]),
                pack_bf16x2(acc[4 * i + 2], acc[4 * i + 3]), pack_bf16x2(acc[4 * i + 4], acc[4 * i + 5]),
                pack_bf16x2(acc[4 * i + 6], acc[4 * i + 7]));
  }
}

// Plain row half: its 64 features at staging column `column`.
template <int N>
__device__ __forceinline__ void store_plain(const float (&acc)[N / 2], bf16* staging, int stride, int column) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int f = column + 16 * warp + (lane >> 2);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int t = 8 * j + 2 * (lane & 3);
    staging[t * stride + f] = __float2bfloat16_rn(acc[4 * j]);
    staging[(t + 1) * stride + f] = __float2bfloat16_rn(acc[4 * j + 1]);
    staging[t * stride + f + 8] = __float2bfloat16_rn(acc[4 * j + 2]);
    staging[(t + 1) * stride + f + 8] = __float2bfloat16_rn(acc[4 * j + 3]);
  }
}

// Token-major GEMM0 accumulators (consume_tile_fp8_token_major): column groups 2q and 2q + 1 are the gate and
// up rows of features 8q..8q+7, so a thread holds gate and up of features 8q + 2 (l % 4) (+1) for its 2 tokens.
// Writes the fp32 SwiGLU values of the consumer's tokens at staging column `column` (64 features).
__device__ __forceinline__ void store_swiglu_token_major(const float (&acc)[kTileWeightRows / 2], float* staging,
                                                         int column) {
  const int row = token_major_row(), lane = threadIdx.x & 31;
#pragma unroll
  for (int q = 0; q < kTileWeightRows / 16; ++q) {
    const int f = column + 8 * q + 2 * (lane & 3);
    const float* gate = acc + 8 * q;
    const float* up = acc + 8 * q + 4;
    *reinterpret_cast<float2*>(staging + row * kFp8StagingStride + f) =
        make_float2(silu(gate[0]) * up[0], silu(gate[1]) * up[1]);
    *reinterpret_cast<float2*>(staging + (row + 8) * kFp8StagingStride + f) =
        make_float2(silu(gate[2]) * up[2], silu(gate[3]) * up[3]);
  }
}

// Token-major GEMM1 accumulators: the consumer's 64 tokens x 128 output features as bf16 rows of its staging
// (its own token rows from 0, kTokenMajorStride apart).
__device__ __forceinline__ void store_plain_token_major(const float (&acc)[kTileWeightRows / 2], bf16* staging) {
  const int row = token_major_row() % kConsumerRows, lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kTileWeightRows / 8; ++j) {
    const int f = 8 * j + 2 * (lane & 3);
    *reinterpret_cast<__nv_bfloat162*>(staging + row * kTokenMajorStride + f) =
        __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<__nv_bfloat162*>(staging + (row + 8) * kTokenMajorStride + f) =
        __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

// ---- Split GEMM0 tiles (scheduler.cuh): each split leaves its fp32 accumulators in its own slot and counts
// itself; the last split of the tile to count adds every slot in split order (the sum does not depend on which
// split finished last, so results repeat bitwise) and runs the epilogue, the others are done with the tile.
// A slot holds 64 floats per thread: bf16 tiles use them for one set of sums, fp8 GEMM0 tasks for their two
// passes' (part 0 and 1, 32 floats each).
struct SplitK {
  float* slots = nullptr;         // slot s of this consumer's rows at slots + s * kSplitSlotFloats; null: whole tile
  uint32_t* arrivals = nullptr;   // splits of the tile (or of this consumer's rows) counted so far this call
  int* last = nullptr;            // shared word: the answer for the warpgroup (or both: `joint`)
  int split = 0, splits = 1;
  bool joint = false;             // both consumers decide together (an fp8 split-width tile: one epilogue)
};

// This thread's float4 `i4` of slot s.
__device__ __forceinline__ float4* split_slot(const SplitK& sk, int s, int i4) {
  return reinterpret_cast<float4*>(sk.slots + s * kSplitSlotFloats) + i4 * 128 + (threadIdx.x & 127);
}

// Part `part` of this split's slot <- acc.
template <int kHalves, int kValues>
__device__ __forceinline__ void store_split(const float (&acc)[kHalves][kValues], const SplitK& sk, int part) {
  static_assert(kValues % 4 == 0, "float4 slots");
  constexpr int kPart4 = kHalves * kValues / 4;
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < kValues; i += 4)
      __stcg(split_slot(sk, sk.split, part * kPart4 + (h * kValues + i) / 4),
             make_float4(acc[h][i], acc[h][i + 1], acc[h][i + 2], acc[h][i + 3]));
}

// Counts this split once its slot is written; whether it was the tile's last. Thread 0 of the warpgroup (of
// consumer 0 when joint) fences around the count: the release/acquire of the classic threadfence reduction.
__device__ __forceinline__ bool count_split(const SplitK& sk, int consumer) {
  if (sk.joint) consumers_sync();
  else consumer_sync(consumer);
  if ((threadIdx.x & 127) == 0 && (!sk.joint || consumer == 0)) {
    __threadfence();  // every thread's slot stores (ordered by the barrier) before the count
    const bool last = atomicAdd(sk.arrivals, 1u) == static_cast<uint32_t>(sk.splits - 1);
    if (last) __threadfence();  // and the other splits' stores before our reads
    *sk.last = last;
  }
  if (sk.joint) consumers_sync();
  else consumer_sync(consumer);
  return *reinterpret_cast<volatile int*>(sk.last) != 0;
}

// acc <- the sum of part `part` over every split's slot, own included, in split order (L2 reads: other SMs
// wrote them).
template <int kHalves, int kValues>
__device__ __forceinline__ void sum_splits(float (&acc)[kHalves][kValues], const SplitK& sk, int part) {
  constexpr int kPart4 = kHalves * kValues / 4;
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < kValues; i += 4) {
      const float4 v = __ldcg(split_slot(sk, 0, part * kPart4 + (h * kValues + i) / 4));
      acc[h][i] = v.x;
      acc[h][i + 1] = v.y;
      acc[h][i + 2] = v.z;
      acc[h][i + 3] = v.w;
    }
  for (int s = 1; s < sk.splits; ++s)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int i = 0; i < kValues; i += 4) {
        const float4 v = __ldcg(split_slot(sk, s, part * kPart4 + (h * kValues + i) / 4));
        acc[h][i] += v.x;
        acc[h][i + 1] += v.y;
        acc[h][i + 2] += v.z;
        acc[h][i + 3] += v.w;
      }
}

// bf16: whether this consumer warpgroup holds the tile's whole sum in acc (it was the last split, or the tile
// is not split). acc is dead across the count (the sum is read back, own slot included), which keeps the
// mainloop's registers as they were.
template <int kHalves, int kValues>
__device__ __forceinline__ bool reduce_split(float (&acc)[kHalves][kValues], const SplitK& sk, int consumer) {
  if (sk.slots == nullptr) return true;
  static_assert(kHalves * kValues * 128 <= kSplitSlotFloats, "a split slot holds the sums");
  store_split(acc, sk, 0);
  if (!count_split(sk, consumer)) return false;
  sum_splits(acc, sk, 0);
  return true;
}

// Token rows [first, first + count) of a tile that one consumer's staging holds.
struct TokenRange {
  int first = 0, count = kMaxTileTokens;
  // How many of a tile's `tile_rows` valid rows fall in the range.
  __device__ int valid(int tile_rows) const {
    const int left = tile_rows - first;
    return left <= 0 ? 0 : left < count ? left : count;
  }
};
// A token-major consumer stages its 64 tokens; every other consumer the whole tile (tasks.cuh reads it before
// the mainloop too, to prefetch the rows' list entries).
__device__ __forceinline__ TokenRange staged_tokens(int n, bool fp8, int consumer) {
  return token_major(n, fp8) ? TokenRange{consumer * kConsumerRows, kConsumerRows} : TokenRange{};
}
// A wide tile's consumer computes and stages its own 64 tokens (consume_tile).
__device__ __forceinline__ TokenRange wide_tokens(int consumer) {
  return TokenRange{consumer * kConsumerRows, kConsumerRows};
}

// What a consumer's epilogue finds in its staging area after mma_tile_to_staging: `features` bf16 columns per
// token row, `stride` elements apart, starting at tile feature `first_feature` (GEMM0: SwiGLU'd intermediate
// features of the tile's 64; GEMM1: output features of the tile's 128), for the tile's token rows in `tokens`.
struct Staged {
  const bf16* rows;  // null: a split GEMM0 tile whose epilogue another split runs
  int stride, features, first_feature;
  TokenRange tokens{};
  const bf16* rows_hi = nullptr;  // a wide GEMM1 consumer's features 64..127 (its other staging area)
};

struct TileDone {
  PipeState st;
  bool staged;  // false: a split tile's other split has the sum
};

// The one entry point of the consumer side: run a tile's mainloop and leave its bf16 rows in the consumer's
// staging area. The caller copies them out and calls consumer_sync before the consumer's next tile.
// A mainloop function (FLASHMOE_MAINLOOP: without calls, or inlined; ptxas's wgmma pipeline analysis).
// Smem layout and pipeline state travel by value, so the mainloop keeps them in registers; one function per
// tile shape keeps ptxas's wgmma pipeline analysis to one accumulator set.
template <bool kGateUp, int N>
FLASHMOE_MAINLOOP TileDone mma_tile_to_staging(const Params& p, const GemmSmem g, PipeState st, int k_steps,
                                               bf16* staging, SplitK sk) {
  constexpr int kHalves = ping_pong(N, false) ? 2 : 1;
  float acc[kHalves][N / 2];
  consume_tile<N>(p, g, st, k_steps, acc);
  if (!reduce_split(acc, sk, threadIdx.x / 128 - 1)) return TileDone{st, false};
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    if constexpr (kGateUp) store_swiglu<N>(acc[h], staging, staging_stride(N, false), h * kConsumerRows / 2);
    else store_plain<N>(acc[h], staging, staging_stride(N, false), h * kConsumerRows);
  }
  return TileDone{st, true};
}

// A wide tile (bf16, 128 tokens, 256 weight rows, token-major): this consumer's 64 tokens into its staging in the
// stages the tile holds (release_held_stages after the copy-out). GEMM0 (kGateUp): 128 SwiGLU features per token in
// the last stage; GEMM1: 256 output features, the first 128 in the stage before the last, the others in the last.
// Never split: its 128 sums per thread do not fit a split slot (scheduler.cuh task_counts).
struct WideDone {
  PipeState st;
  HeldStages stages;
};
template <bool kGateUp>
FLASHMOE_MAINLOOP WideDone mma_wide_tile_to_staging(const Params& p, const GemmSmem g, PipeState st, int k_steps) {
  const int consumer = threadIdx.x / 128 - 1;
  float acc[2][kMaxTileTokens / 2];
  const HeldStages held = consume_tile<kMaxTileTokens, 2, true, kGateUp ? 1 : 2>(p, g, st, k_steps, acc);
  const float(&all)[2 * kMaxTileTokens / 2] = *reinterpret_cast<const float(*)[2 * kMaxTileTokens / 2]>(&acc[0][0]);
  consumers_sync();  // both consumers read both boxes of the held stages: each has finished before either stages
  if constexpr (kGateUp) {
    store_swiglu_wide(all, smem_addr(g.wide_staging(held.held[1], consumer)));
  } else {
    store_plain_wide(all, smem_addr(g.wide_staging(held.held[0], consumer)),
                     smem_addr(g.wide_staging(held.held[1], consumer)));
  }
  return WideDone{st, held};
}

// A wide tile's consumer side for the tasks (tasks.cuh): the mainloop, then where its rows are staged: its 64 token
// rows (`tokens`). GEMM0: 128 SwiGLU features per row; GEMM1: the tile's 256 output features, the first 128 in `rows`
// and the others in `rows_hi`. `held`: the stages to release (release_held_stages) once the rows are copied out.
struct WideStaged {
  Staged staged;
  HeldStages held;
};
template <bool kGateUp>
__device__ __forceinline__ WideStaged wide_tile_to_staging(const Params& p, const GemmSmem& g, PipeState& st,
                                                           int k_steps) {
  const int consumer = threadIdx.x / 128 - 1;
  st.enter<false, true>(kMaxTileTokens);
  const WideDone done = mma_wide_tile_to_staging<kGateUp>(p, g, st, k_steps);
  st = done.st;
  const HeldStages& held = done.stages;
  const TokenRange tokens = wide_tokens(consumer);
  if constexpr (kGateUp) {
    return {Staged{g.wide_staging(held.held[1], consumer), kWideStagingFeatures, kWideStagingFeatures, 0, tokens},
            held};
  } else {
    Staged staged{g.wide_staging(held.held[0], consumer), kWideStagingFeatures, kWideBoxes * kWideStagingFeatures, 0,
                  tokens};
    staged.rows_hi = g.wide_staging(held.held[1], consumer);
    return {staged, held};
  }
}

// Whether a split fp8 GEMM0 task of width n fits its sums (both passes') in a split slot: not at 128 tokens, so
// the scheduler never splits a call's GEMM0 tiles when one of them has 128 (scheduler.cuh task_counts).
__host__ __device__ constexpr bool fp8_gemm0_splittable(int n) {
  return kFp8Gemm0Passes * (ping_pong(n, true) ? 2 : 1) * (n / 2) * 128 <= kSplitSlotFloats;
}
static_assert(fp8_gemm0_splittable(16) && fp8_gemm0_splittable(32) && fp8_gemm0_splittable(64) &&
                  !fp8_gemm0_splittable(128),
              "split slots");

// fp8: GEMM0 (kGateUp: fp32 SwiGLU values at fp32 staging column `column`; a split task's pass instead leaves
// its sums in part `pass` of its slot) or GEMM1 (bf16 rows). Token-major tiles (128 tokens) are never split.
template <bool kGateUp, int N>
FLASHMOE_MAINLOOP PipeState mma_fp8_tile_to_staging(const Params& p, const GemmSmem g, PipeState st, int k_steps,
                                                    void* staging, int column, SplitK sk = SplitK{}, int pass = 0) {
  if constexpr (token_major(N, true)) {
    (void)sk, (void)pass;
    float acc[kTileWeightRows / 2];
    consume_tile_fp8_token_major(p, g, st, k_steps, acc);
    if constexpr (kGateUp) store_swiglu_token_major(acc, static_cast<float*>(staging), column);
    else store_plain_token_major(acc, static_cast<bf16*>(staging));
    return st;
  } else {
    constexpr int kHalves = ping_pong(N, true) ? 2 : 1;
    float acc[kHalves][N / 2];
    if constexpr (stage_k_steps(N, true) == 2) consume_tile_fp8_two_steps<N>(p, g, st, k_steps, acc);
    else consume_tile_fp8<N>(p, g, st, k_steps, acc);
    if constexpr (kGateUp) {
      if (sk.slots != nullptr) {
        store_split(acc, sk, pass);
        return st;
      }
    }
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      if constexpr (kGateUp) store_swiglu<N>(acc[h], static_cast<float*>(staging), kFp8StagingStride, column + h * kConsumerRows / 2);
      else store_plain<N>(acc[h], static_cast<bf16*>(staging), staging_stride(N, true), h * kConsumerRows);
    }
    return st;
  }
}

// `sk`: the split of a split GEMM0 tile (bf16), default: the whole tile.
template <bool kGateUp, bool kFp8, CallTiles kTiles>
__device__ __forceinline__ Staged mma_tile_to_staging(const Params& p, const GemmSmem& g, PipeState& st,
                                                      int tile_tokens, int k_steps, const SplitK& sk = SplitK{}) {
  const int consumer = threadIdx.x / 128 - 1;
  Staged out{};
  with_tile_tokens<kTiles>(tile_tokens, [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    st.enter<kFp8>(N);
    bf16* staging = g.staging(consumer, N, kFp8);
    if constexpr (kFp8) {
      st = mma_fp8_tile_to_staging<false, N>(p, g, st, k_steps, staging, 0);
    } else {
      const TileDone done = mma_tile_to_staging<kGateUp, N>(p, g, st, k_steps, staging, sk);
      st = done.st;
      if (!done.staged) return;  // out.rows stays null
    }
    if constexpr (token_major(N, kFp8)) {  // fp8 GEMM1 only: this consumer's 64 tokens, all 128 features
      out = Staged{staging, kTokenMajorStride, kTileWeightRows, 0, staged_tokens(N, kFp8, consumer)};
      return;
    }
    const int rows = consumer_rows(N, kFp8);  // weight rows this consumer computed
    const int first_row = ping_pong(N, kFp8) ? 0 : consumer * kConsumerRows;
    out = Staged{staging, staging_stride(N, kFp8), kGateUp ? rows / 2 : rows, kGateUp ? first_row / 2 : first_row};
  });
  return out;
}

// The last split of an fp8 GEMM0 task: both passes' sums into SwiGLU values in the fp32 staging, as the unsplit
// passes leave them. Its own function in relocatable units: its 32 sums per pass would otherwise live in the
// kernel body's registers (a whole program inlines it with the mainloops, FLASHMOE_MAINLOOP).
template <int N>
FLASHMOE_MAINLOOP void fp8_split_sums_to_staging(const SplitK sk, float* staging, int column) {
  constexpr int kHalves = ping_pong(N, true) ? 2 : 1;
  for (int pass = 0; pass < kFp8Gemm0Passes; ++pass) {
    float acc[kHalves][N / 2];
    sum_splits(acc, sk, pass);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      store_swiglu<N>(acc[h], staging, kFp8StagingStride, column + pass * kInterMultiple + h * kConsumerRows / 2);
  }
}

// fp8 GEMM0 task (128 intermediate features = one activation group): two passes of 64 features over K, their
// fp32 SwiGLU values into the fp32 staging (ping-pong: the consumer's area, all 128 columns; split: the joint
// area, this consumer's 32 columns of each pass). Returns that staging, or null for a split task whose tile's
// last split is another one (a split task's passes leave their sums in its slot; the last adds them up).
template <CallTiles kTiles>
__device__ __forceinline__ const float* mma_fp8_gemm0_to_staging(const Params& p, const GemmSmem& g, PipeState& st,
                                                                 int tile_tokens, int k_steps, const SplitK& sk) {
  const int consumer = threadIdx.x / 128 - 1;
  const float* out = nullptr;
  with_tile_tokens<kTiles>(tile_tokens, [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    st.enter<true>(N);
    float* staging = g.fp8_staging(consumer, N);
    // Ping-pong: all 128 features of the consumer's own staging; split: this consumer's 32 of each pass's 64;
    // token-major: all of them for its 64 tokens.
    const int column = ping_pong(N, true) || token_major(N, true) ? 0 : consumer * kConsumerRows / 2;
    for (int pass = 0; pass < kFp8Gemm0Passes; ++pass)
      st = mma_fp8_tile_to_staging<true, N>(p, g, st, k_steps, staging, column + pass * kInterMultiple, sk, pass);
    if constexpr (fp8_gemm0_splittable(N)) {
      if (sk.slots != nullptr) {
        if (!count_split(sk, consumer)) return;
        fp8_split_sums_to_staging<N>(sk, staging, column);
      }
    }
    out = staging;
  });
  return out;
}

// A consumer warpgroup passes over a ping-pong tile the other one computes: its pipeline position moves past
// the tile's stages (and a width change meets the block barrier like everyone else).
template <bool kFp8, CallTiles kTiles>
__device__ __forceinline__ void skip_tile(PipeState& st, int tile_tokens, int passes, int k_steps) {
  with_tile_tokens<kTiles>(tile_tokens, [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    st.enter<kFp8>(N);
    for (int s = passes * tile_stages(N, kFp8, k_steps); s > 0; --s) st.advance();
  });
}

}  // namespace flashmoe
