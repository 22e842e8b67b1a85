// The expert GEMM engine (Hopper): swap-AB tiles, weights by TMA, tokens by cp.async, wgmma, an mbarrier
// pipeline between a producer warpgroup and two consumer warpgroups.
//
// Every expert GEMM computes out[token, feature] = sum_k x[token, k] * W[feature, k] as
// D[feature, token] = W[feature, :] . x[token, :] ("swap-AB"): 64 weight rows are wgmma's A operand and the
// tokens its N side (32, 64 or 128 per tile, chosen per expert from its row count). An expert with one row
// wastes no tensor-core row, and each weight tile streams from HBM once per call however few tokens use it.
//
//   warpgroup 0     producer: thread 0 issues the TMA loads of the 128 weight rows of a stage (128-byte
//                   swizzle); all 128 threads gather the stage's token rows with cp.async into the same
//                   swizzled layout, completing on the stage's `full` barrier.
//   warpgroups 1,2  consumers, wgmma m64nNk16 into fp32 registers; a warp releases a stage (`empty`) once its
//                   wgmma on it completed. Decode tiles (N <= 64) are ping-pong: the two warpgroups take
//                   turns, each computing all 128 rows of its tile while the other runs its previous tile's
//                   epilogue and next-task bookkeeping, so some warpgroup always drains the ring and the SM
//                   keeps streaming across tile boundaries. Wide tiles (N = 128) are split: 64 rows each.
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
constexpr int kConsumers = 2;            // consumer warpgroups
constexpr int kConsumerRows = 64;        // weight rows per consumer (wgmma M)
constexpr int kTileWeightRows = kConsumers * kConsumerRows;
constexpr int kMaxTileTokens = 128;
constexpr int kProducerThreads = 128;
constexpr int kStageWeightBytes = kTileWeightRows * kTileK * 2;  // 16 KiB
constexpr int kFullArrivals = 1 + kProducerThreads;  // TMA expect-tx + every producer thread's cp.async
constexpr int kEmptyArrivals = kConsumers * 4;       // every consumer warp once, or the owner's warps twice

// Whether tiles of width n are ping-pong (one warpgroup per tile) or split (both warpgroups, 64 rows each):
// a ping-pong warpgroup holds 128 x n fp32 accumulators, which fits the register budget up to n = 64.
__host__ __device__ constexpr bool ping_pong(int n) { return n <= 64; }
// Weight rows of a tile one consumer warpgroup computes, and their 64-row halves (one accumulator set each).
__host__ __device__ constexpr int consumer_rows(int n) { return ping_pong(n) ? kTileWeightRows : kConsumerRows; }
// Epilogue staging, per consumer: [token][feature] bf16, rows padded by 16 B to spread banks.
__host__ __device__ constexpr int staging_stride(int n) { return consumer_rows(n) + 8; }

static_assert(kThreads == kProducerThreads + kConsumers * 128, "one producer and two consumer warpgroups");
static_assert(kConsumers * kConsumerRows == kHiddenMultiple, "GEMM1 output tile = H step");
static_assert(kConsumers * kConsumerRows / 2 == kInterMultiple, "GEMM0 output tile (gate+up rows) = I step");
static_assert(kTileK == kInterMultiple, "GEMM1 K step");

// Dynamic shared memory, carved from a 1024-byte aligned base (the 128-byte swizzle needs it):
//   [barriers | task slots | row tables]  4 KiB
//   [stage pool ........................ | epilogue staging]
// A stage holds 16 KiB of weights and N x 128 B of token rows, so its size follows the tile's token count N:
// decode tiles (N = 32) get 9 stages (144 KiB of weights in flight per SM), N = 64 7, N = 128 5. The epilogue
// staging (N rows per consumer) sits at the top of the pool. Tiles of another N re-carve the pool after a
// full drain (see PipeState::enter).
constexpr int kMaxStages = 10;
constexpr int kTaskSlots = 4;  // task indices published by the producer, not yet read by every thread
constexpr int kGemmSmemBytes = 218 * 1024;  // + ~7 KiB static (scheduler tables) stays within 227 KiB
constexpr int kFullOffset = 0;                                          // u64 [kMaxStages]
constexpr int kEmptyOffset = kFullOffset + kMaxStages * 8;              // u64 [kMaxStages]
constexpr int kTaskFullOffset = kEmptyOffset + kMaxStages * 8;          // u64 [kTaskSlots]
constexpr int kTaskEmptyOffset = kTaskFullOffset + kTaskSlots * 8;      // u64 [kTaskSlots]
constexpr int kTaskIndexOffset = kTaskEmptyOffset + kTaskSlots * 8;     // int [kTaskSlots]
constexpr int kRowDstOffset = 1024;                                     // int64 [2][128]
constexpr int kRowRankOffset = kRowDstOffset + kConsumers * kMaxTileTokens * 8;  // int [2][128]
constexpr int kPoolOffset = 4096;
constexpr int kPoolBytes = kGemmSmemBytes - 1024 /* alignment slack of the dynamic base */ - kPoolOffset;
static_assert(kTaskIndexOffset + kTaskSlots * 4 <= kRowDstOffset, "barrier area");
static_assert(kRowRankOffset + kConsumers * kMaxTileTokens * 4 <= kPoolOffset, "row tables");

__host__ __device__ constexpr int stage_bytes(int n) { return kStageWeightBytes + n * kTileK * 2; }
__host__ __device__ constexpr int staging_bytes(int n) { return kConsumers * n * staging_stride(n) * 2; }
__host__ __device__ constexpr int stages_for(int n) {
  const int fit = (kPoolBytes - staging_bytes(n)) / stage_bytes(n);
  return fit < kMaxStages ? fit : kMaxStages;
}
static_assert(stages_for(32) == 9 && stages_for(64) == 7 && stages_for(128) == 5, "stage counts per tile width");
static_assert(stage_bytes(32) % 1024 == 0 && stage_bytes(64) % 1024 == 0 && stage_bytes(128) % 1024 == 0,
              "stages stay 1024-byte aligned");

struct GemmSmem {
  char* base;
  uint32_t epoch;  // for timeout reports

  __device__ static GemmSmem carve(char* dynamic_smem, uint32_t epoch) {
    const uintptr_t a = (reinterpret_cast<uintptr_t>(dynamic_smem) + 1023) & ~static_cast<uintptr_t>(1023);
    return GemmSmem{reinterpret_cast<char*>(a), epoch};
  }
  __device__ char* stage(int s, int n) const { return base + kPoolOffset + s * stage_bytes(n); }
  __device__ bf16* staging(int consumer, int n) const {
    return reinterpret_cast<bf16*>(base + kPoolOffset + kPoolBytes - staging_bytes(n)) +
           consumer * n * staging_stride(n);
  }
  __device__ int64_t* row_dst(int consumer) const {
    return reinterpret_cast<int64_t*>(base + kRowDstOffset) + consumer * kMaxTileTokens;
  }
  __device__ int* row_rank(int consumer) const {
    return reinterpret_cast<int*>(base + kRowRankOffset) + consumer * kMaxTileTokens;
  }
  __device__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + kFullOffset) + s; }
  __device__ uint64_t* empty(int s) const { return reinterpret_cast<uint64_t*>(base + kEmptyOffset) + s; }
  __device__ uint64_t* task_full(int s) const { return reinterpret_cast<uint64_t*>(base + kTaskFullOffset) + s; }
  __device__ uint64_t* task_empty(int s) const { return reinterpret_cast<uint64_t*>(base + kTaskEmptyOffset) + s; }
  __device__ int* task_index(int s) const { return reinterpret_cast<int*>(base + kTaskIndexOffset) + s; }

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
        const int64_t where = reinterpret_cast<char*>(bar) - g.base;
        record_timeout(p, kPhaseGemmPipeline, -1, (static_cast<int64_t>(threadIdx.x) << 32) | where, g.epoch, parity);
        return;
      }
    }
  }
}

// Whole-block named barrier of the GEMM phases (id 3; 0 is __syncthreads, 1-2 the consumers').
__device__ __forceinline__ void gemm_block_sync() { asm volatile("bar.sync 3, %0;\n" ::"n"(kThreads) : "memory"); }

// Position in the stage ring for the current tile width; producer and consumers advance identical copies
// (same tiles, same K steps). Each barrier's parity is tracked on its own, since the ring length changes
// with the tile width.
struct PipeState {
  int stage = 0;
  int num_stages = 0;
  int tile_tokens = 0;      // N the pool is carved for; 0 before the first tile
  uint32_t parity = 0;      // bit s: how many times stage s was used, mod 2
#if FLASHMOE_TRACE
  uint64_t trace_wait = 0;        // cycles the current tile spent waiting on pipeline barriers
  uint64_t trace_first_full = 0;  // clock when the tile's first stage had landed (consumers)
#endif

  // At the start of every tile (producer and consumers alike): a tile of another width re-carves the pool.
  // Both sides then meet at a block barrier: the consumers arrive after the previous tile's epilogue, the
  // producer after issuing that tile's loads, so no stage or staging byte of the old carving is in use.
  __device__ void enter(int n) {
    if (n == tile_tokens) return;
    gemm_block_sync();
    tile_tokens = n;
    num_stages = stages_for(n);
    stage = 0;
  }
  __device__ uint32_t phase() const { return parity >> stage & 1u; }
  __device__ void advance() {
    parity ^= 1u << stage;
    if (++stage == num_stages) stage = 0;
  }
};

// Token tile for an expert with `rows` rows: the smallest that holds them, else 128-row tiles.
__host__ __device__ constexpr int tile_tokens_for(int rows) { return rows <= 32 ? 32 : rows <= 64 ? 64 : 128; }

// Runs f(std::integral_constant<int, N>{}) for a tile width N from tile_tokens_for (32, 64 or 128).
template <typename F>
__device__ __forceinline__ void with_tile_tokens(int n, F&& f) {
  if (n == 32) f(std::integral_constant<int, 32>{});
  else if (n == 64) f(std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 128>{});
}

// Producer side of one tile of `n` tokens (a tile_tokens_for width), `rows` of them valid.
// `row_at(r)` is the start of token row r (r < rows; the rest are zero-filled); `issue_weights(stage,
// full_barrier, ks)` issues the TMA loads of K step ks's 128 weight rows (kStageWeightBytes in total, thread 0
// only); `rows_ready(ks)` returns once the token rows' K step ks may be read (all producer threads; the weights
// of that step are already on their way). All 128 producer threads call it with the same arguments.
template <typename RowAt, typename IssueWeights, typename RowsReady>
__device__ __forceinline__ void produce_tile(const Params& p, const GemmSmem& g, PipeState& st, int n, int rows,
                                             int k_steps, RowAt row_at, IssueWeights issue_weights,
                                             RowsReady rows_ready) {
  with_tile_tokens(n, [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    st.enter(N);
    const int tid = threadIdx.x;  // 0..127
    const int chunk = tid & 7;    // 16-byte chunk of the 128-byte row
    const bf16* row[N / 16];      // this thread's rows: tile rows (tid / 8) + 16 i
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      const int r = (tid >> 3) + 16 * i;
      row[i] = r < rows ? row_at(r) : nullptr;
    }
    uint64_t waited = 0;
    for (int ks = 0; ks < k_steps; ++ks) {
      const uint64_t wait_start = trace_clock();
      pipe_wait(p, g, g.empty(st.stage), st.phase() ^ 1u);
      waited += trace_clock() - wait_start;
      char* stage = g.stage(st.stage, N);
      uint64_t* full = g.full(st.stage);
      if (tid == 0) {
        mbar_arrive_expect_tx(full, kStageWeightBytes);
        issue_weights(stage, full, ks);
      }
      __syncwarp();  // warp 0 whole again before its next wait (see next_task)
      rows_ready(ks);
      const uint32_t tokens = smem_addr(stage + kStageWeightBytes);
#pragma unroll
      for (int i = 0; i < N / 16; ++i) {
        const int r = (tid >> 3) + 16 * i;
        const uint32_t dst = tokens + r * 128 + ((chunk ^ (r & 7)) << 4);  // the 128-byte swizzle
        const bf16* src = row[i] != nullptr ? row[i] + ks * kTileK + chunk * 8 : p.x;
        cp_async_16(dst, src, row[i] != nullptr);
      }
      mbar_arrive_on_cp_async(full);
      st.advance();
      if (ks == 0) trace(kTraceProducerFirstIssue);
    }
    trace(kTraceProducerLastIssue, static_cast<uint32_t>(waited));
  });
}

// Consumer side of one tile: acc[h] = 64 weight rows x N tokens over K, for the consumer's kHalves row halves
// (ping-pong: both halves of the tile; split: the consumer's own half).
template <int N, int kHalves = ping_pong(N) ? 2 : 1>
__device__ __forceinline__ void consume_tile(const Params& p, const GemmSmem& g, PipeState& st, int k_steps,
                                             float (&acc)[kHalves][N / 2]) {
  const int consumer = threadIdx.x / 128 - 1;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  // A split stage is released by all 8 consumer warps, a ping-pong stage by its owner's 4 warps, twice each.
  constexpr uint32_t kReleases = kHalves == 2 ? 2 : 1;
  const uint32_t first_row = kHalves == 2 ? 0 : consumer * kConsumerRows;
  int previous = -1;
  int ks = 0;
#if FLASHMOE_TRACE
  st.trace_wait = 0;
#endif
  do {  // k_steps >= 1 (K is a multiple of kTileK); a do-loop keeps ptxas's wgmma pipeline analysis simple
#if FLASHMOE_TRACE
    const uint64_t wait_start = clock64();
    pipe_wait(p, g, g.full(st.stage), st.phase());
    const uint64_t landed = clock64();
    st.trace_wait += landed - wait_start;
    if (ks == 0) st.trace_first_full = landed;
#else
    pipe_wait(p, g, g.full(st.stage), st.phase());
#endif
    fence_proxy_async();  // the token rows arrived through cp.async (generic proxy)
    const uint32_t stage = smem_addr(g.stage(st.stage, N));
    const uint64_t b = sw128_desc(stage + kStageWeightBytes);
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint64_t a = sw128_desc(stage + (first_row + h * kConsumerRows) * 128);
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) Wgmma<N>::mma(acc[h], a + 2 * kk, b + 2 * kk, ks > 0 || kk > 0);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's wgmma is done: its stage can be refilled
    if (previous >= 0 && warp_leader) mbar_arrive(g.empty(previous), kReleases);
    previous = st.stage;
    st.advance();
  } while (++ks < k_steps);
  wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < kHalves; ++h) fence_accumulators(acc[h]);
  if (previous >= 0 && warp_leader) mbar_arrive(g.empty(previous), kReleases);
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
// Writes the half's 32 features at staging column `column`.
template <int N>
__device__ __forceinline__ void store_swiglu(const float (&acc)[N / 2], bf16* staging, int stride, int column) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int f = column + 8 * warp + (lane >> 2);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int t = 8 * j + 2 * (lane & 3);
    staging[t * stride + f] = __float2bfloat16_rn(silu(acc[4 * j]) * acc[4 * j + 2]);
    staging[(t + 1) * stride + f] = __float2bfloat16_rn(silu(acc[4 * j + 1]) * acc[4 * j + 3]);
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

// What a consumer's epilogue finds in its staging area after mma_tile_to_staging: `features` bf16 columns per
// token row, `stride` elements apart, starting at tile feature `first_feature` (GEMM0: SwiGLU'd intermediate
// features of the tile's 64; GEMM1: output features of the tile's 128).
struct Staged {
  const bf16* rows;
  int stride, features, first_feature;
};

// The one entry point of the consumer side: run a tile's mainloop and leave its bf16 rows in the consumer's
// staging area. The caller copies them out and calls consumer_sync before the consumer's next tile.
// A separate function without calls: ptxas serialises the wgmmas of a function that calls device code.
// Smem layout and pipeline state travel by value, so the mainloop keeps them in registers; one function per
// tile shape keeps ptxas's wgmma pipeline analysis to one accumulator set.
template <bool kGateUp, int N>
__device__ __noinline__ PipeState mma_tile_to_staging(const Params& p, const GemmSmem g, PipeState st, int k_steps,
                                                      bf16* staging) {
  constexpr int kHalves = ping_pong(N) ? 2 : 1;
  float acc[kHalves][N / 2];
  consume_tile<N>(p, g, st, k_steps, acc);
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    if constexpr (kGateUp) store_swiglu<N>(acc[h], staging, staging_stride(N), h * kConsumerRows / 2);
    else store_plain<N>(acc[h], staging, staging_stride(N), h * kConsumerRows);
  }
  return st;
}

template <bool kGateUp>
__device__ __forceinline__ Staged mma_tile_to_staging(const Params& p, const GemmSmem& g, PipeState& st,
                                                      int tile_tokens, int k_steps) {
  const int consumer = threadIdx.x / 128 - 1;
  Staged out{};
  with_tile_tokens(tile_tokens, [&](auto tile) {
    constexpr int N = decltype(tile)::value;
    st.enter(N);
    bf16* staging = g.staging(consumer, N);
    st = mma_tile_to_staging<kGateUp, N>(p, g, st, k_steps, staging);
    const int rows = consumer_rows(N);  // weight rows this consumer computed
    const int first_row = ping_pong(N) ? 0 : consumer * kConsumerRows;
    out = Staged{staging, staging_stride(N), kGateUp ? rows / 2 : rows, kGateUp ? first_row / 2 : first_row};
  });
  return out;
}

// A consumer warpgroup passes over a ping-pong tile the other one computes: its pipeline position moves past
// the tile's stages (and a width change meets the block barrier like everyone else).
__device__ __forceinline__ void skip_tile(PipeState& st, int tile_tokens, int k_steps) {
  with_tile_tokens(tile_tokens, [&](auto tile) {
    st.enter(decltype(tile)::value);
    for (int ks = 0; ks < k_steps; ++ks) st.advance();
  });
}

}  // namespace flashmoe
