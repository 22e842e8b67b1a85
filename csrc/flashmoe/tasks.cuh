// Expert tasks: what each GEMM reads and where its tiles go. The GEMM engine (gemm.cuh) does the math; the
// scheduler (scheduler.cuh) says which task runs next. fp8 layers read e4m3 rows with per-128-group scales
// (received tokens, activations) and e4m3 weights with their block scales; a GEMM0 task computes 128 features
// in two passes and its epilogue quantises each token's 128 SwiGLU values with one scale (the reference's
// activation group).
//   GEMM0: act = silu(x W_gate^T) * (x W_up^T); x = received rows gathered through the expert's list,
//          W = the engine's w13 read in place (gate and up rows of 32 features per consumer, one mainloop; a wide
//          tile's consumer 64). Each finished tile counts on its (expert, 64-feature tile) completion counters.
//   GEMM1: y = act W2^T, each bf16 row written straight into the combine buffer of the rank that owns the
//          token, at slot (token, j), so the source reduces over j in a fixed order (no atomics). Its weights
//          stream at once; the activations of K step s load once (expert, feature tile s) has all counted.
// The producer warpgroup runs produce_tasks, the consumer warpgroups consume_tasks; both walk the block's
// task sequence from the queue, so their pipeline states stay in step.
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "fp8.cuh"
#include "gemm.cuh"
#include "metrics.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "trace.cuh"

namespace flashmoe {

// An expert's received-row list: `lists` the workspace's expert_rows, `stride` Params::expert_rows_stride.
__device__ __forceinline__ const int* expert_list(const int* lists, int64_t stride, int expert) {
  return lists + static_cast<int64_t>(expert) * stride;
}
__device__ __forceinline__ const int* expert_list(const Params& p, int expert) {
  return expert_list(ws_ptr<int>(p, p.ws_off.expert_rows), p.expert_rows_stride, expert);
}

// Completion counter of (local expert, GEMM0 feature tile) = GEMM1 K step: `counters` the workspace's
// gemm0_done, `feature_tiles` the counters per expert (TaskCounts::gemm0_counters; bf16 64 features each, so a wide
// task's consumers count on two).
__device__ __forceinline__ uint32_t* gemm0_done(uint32_t* counters, int feature_tiles, int expert, int feature_tile) {
  return counters + static_cast<int64_t>(expert) * feature_tiles + feature_tile;
}
template <bool kFp8>
__device__ __forceinline__ uint32_t* gemm0_done(const Params& p, int expert, int feature_tile) {
  return gemm0_done(ws_ptr<uint32_t>(p, p.ws_off.gemm0_done), p.intermediate_size / gemm0_task_features(kFp8), expert,
                    feature_tile);
}

// Which K steps of a GEMM1 tile have their activation rows written: bit s of `ready` is K step window + s.
// Every producer warp reads up to 32 counters at once (lane s reads step window + s) and shares the result by
// ballot, so a ready tile costs one round trip and a warp never waits on its own lanes.
struct ActReadiness {
  const uint32_t* counters;  // the expert's [I/64] completion counters
  uint32_t arrivals;         // each counter's value once its GEMM0 feature tile is done
  int k_steps;
  int window = 0;
  uint32_t ready = 0;
  bool polled = false;

  // Returns once K step ks is ready; `on_first_wait()` runs (on every calling thread) if the first look
  // finds it not ready.
  template <typename OnFirstWait>
  __device__ void wait(const Params& p, const GemmSmem& g, int expert, int ks, OnFirstWait on_first_wait) {
    if (ks - window >= 32) {
      window = ks;
      polled = false;
    }
    if (polled && (ready >> (ks - window) & 1u)) return;
    const int lane = threadIdx.x & 31;
    const int step = window + lane;
    const uint64_t start = lane == 0 ? globaltimer_ns() : 0;
    for (uint32_t spins = 0;; ++spins) {
      const bool ok = step >= k_steps || ld_acquire_gpu(counters + step) >= arrivals;
      ready = __ballot_sync(0xffffffffu, ok);
      polled = true;
      if (ready >> (ks - window) & 1u) break;
      if (spins == 0) on_first_wait();
      if ((spins & 15) == 15) {
        // Lane 0 decides for the warp: the ballot above needs every lane in the next round too.
        bool give_up = false;
        if (lane == 0) {
          const bool timed_out = globaltimer_ns() - start > p.timeout_ns;
          give_up = timed_out || aborted(p);
          if (timed_out && threadIdx.x == 0)
            record_timeout(p, kPhaseExpertReady, -1, static_cast<int64_t>(expert) << 16 | ks, g.epoch,
                           ld_acquire_gpu(counters + ks));
        }
        if (__shfl_sync(0xffffffffu, give_up, 0)) break;
      }
    }
    __syncwarp();  // each lane's acquire orders the activation reads of the whole warp
  }
};

// The producer warpgroup's whole GEMM phase (kTiles: the call's tile widths, gemm.cuh CallTiles).
template <bool kFp8, CallTiles kTiles>
static __device__ __noinline__ void produce_tasks(const Params& p, const GemmSmem& g, const ExpertTable& table) {
  constexpr bool kDecode = kTiles == CallTiles::kDecode;
  const TaskCounts& counts = table.counts;
  const char* recv = sym_ptr<char>(p, p.sym_off.recv_tokens);
  const float* recv_scales = sym_ptr<float>(p, p.sym_off.recv_scales);
  const char* act = ws_ptr<char>(p, p.ws_off.act);
  const float* act_scales = ws_ptr<float>(p, p.ws_off.act_scales);
  constexpr int kElementBytes = kFp8 ? 1 : 2;
  const int64_t hidden_row_bytes = static_cast<int64_t>(p.hidden_size) * kElementBytes;
  const int64_t inter_row_bytes = static_cast<int64_t>(p.intermediate_size) * kElementBytes;
  const int hidden_groups = p.hidden_size / kFp8Group, inter_groups = p.intermediate_size / kFp8Group;
  // What each task reads from Params, loaded once: the producer's stores (barriers, trace, the task slot) may
  // alias Params as far as the compiler knows, so a use inside the loop would load the field again each time.
  const int* expert_rows = ws_ptr<int>(p, p.ws_off.expert_rows);
  const int64_t expert_rows_stride = p.expert_rows_stride;
  uint32_t* gemm0_counters = ws_ptr<uint32_t>(p, p.ws_off.gemm0_done);
  const int gemm0_feature_tiles = counts.gemm0_counters;
  const float* const w13_scale = p.w13_scale;
  const float* const w2_scale = p.w2_scale;
  const int hidden_size = p.hidden_size;
  // Expert weights are read once per call: evict-first keeps them from displacing the token rows and activations
  // that every feature tile reads again (8-13% of bf16 decode time, benchmarks/kernel-notes.md).
  const uint64_t stream_policy = l2_policy_evict_first();
  PipeState st;
  TaskQueue queue;
  int index;
  while ((index = next_task(p, g, queue, counts.total)) >= 0) {
    trace(kTraceProducerDecoding, index);
    const Task task = decode_task<kFp8, kTiles>(table, index);
    trace(kTraceProducerTask, index, task.gemm << 24 | task.expert,
          task.splits << 28 | task.feature_tile << 16 | task.tile_tokens << 8 | task.rows);
    const int k_steps = task.k_steps;
    const int reserve_step = k_steps > kReserveStages ? k_steps - kReserveStages : 0;
    if (task.gemm == 0) {
      trace(kTraceProducerReady);
      const int* list = expert_list(expert_rows, expert_rows_stride, task.expert) + task.first_row;
      // A split task reads K steps [k_first, k_first + k_steps) of the rows and weights.
      const auto row_at = [&](int r) {
        return recv + static_cast<int64_t>(ldcg(list + r) >> 4) * hidden_row_bytes + task.k_first * kRowBytesK;
      };
      const auto scale_at = [&](int r) {
        return recv_scales + static_cast<int64_t>(ldcg(list + r) >> 4) * hidden_groups + task.k_first;
      };
      if constexpr (!kFp8 && !kDecode) {
        if (task.wide) {  // one pass (never split), both boxes of the task's 128 features a stage
          const int feature_group = task.feature_tile * kWideGemm0Features / 8;
          produce_tile<false, CallTiles::kAny, true>(
              p, g, st, task.tile_tokens, task.rows, k_steps, row_at, scale_at,
              [&](char* stage, uint64_t* full, int ks, uint32_t, bool) {
                for (int box = 0; box < kWideBoxes; ++box)
                  tma_load_5d(stage + box * kStageWeightBytes, &p.tmap_w13, full, ks * kTileK, 0, 0,
                              feature_group + box * kGemm0TileFeatures / 8, task.expert, stream_policy);
                if (ks == reserve_step) reserve_task(p, queue);
              },
              [](int) {});
          continue;
        }
      }
      // fp8: the gate and up rows of the task's 128 features are one weight block each (per K step).
      const float* gate_scale =
          kFp8 ? w13_scale + (static_cast<int64_t>(task.expert) * 2 * inter_groups + task.feature_tile) * hidden_groups
               : nullptr;
      const float* up_scale = kFp8 ? gate_scale + static_cast<int64_t>(inter_groups) * hidden_groups : nullptr;
      constexpr int kPasses = kFp8 ? kFp8Gemm0Passes : 1;
      for (int pass = 0; pass < kPasses; ++pass) {
        // One 5-D box = the stage: 8 groups of (8 gate rows, the same 8 features' up rows).
        const int feature_group = (task.feature_tile * gemm0_task_features(kFp8) + pass * kGemm0TileFeatures) / 8;
        produce_tile<kFp8, kTiles>(
            p, g, st, task.tile_tokens, task.rows, k_steps, row_at, scale_at,
            [&](char* stage, uint64_t* full, int ks, uint32_t weight_scales, bool real) {
              // A zero step (produce_tile) loads the box at K = hidden: all out of bounds, zero-filled.
              const int k = task.k_first + ks;
              tma_load_5d(stage, &p.tmap_w13, full, real ? k * tile_k(kFp8) : hidden_size, 0, 0, feature_group,
                          task.expert, stream_policy);
              if constexpr (kFp8) {
                cp_async_4(weight_scales, gate_scale + (real ? k : 0), real);
                cp_async_4(weight_scales + 4, up_scale + (real ? k : 0), real);
              }
              if (pass == kPasses - 1 && ks == reserve_step) reserve_task(p, queue);
            },
            [](int) {});
      }
    } else {
      const int64_t first = table.row_offset[task.expert] + task.first_row;
      ActReadiness readiness{gemm0_done(gemm0_counters, gemm0_feature_tiles, task.expert, 0),
                             gemm0_arrivals<kFp8>(table, task.expert), k_steps};
      const auto row_at = [&](int r) { return act + (first + r) * inter_row_bytes; };
      const auto scale_at = [&](int r) { return act_scales + (first + r) * inter_groups; };
      if constexpr (!kFp8 && !kDecode) {
        if (task.wide) {  // both boxes of the task's 256 output features a stage
          const int w2_group = (task.expert * hidden_size + task.feature_tile * kWideGemm1Features) / 8;
          produce_tile<false, CallTiles::kAny, true>(
              p, g, st, task.tile_tokens, task.rows, k_steps, row_at, scale_at,
              [&](char* stage, uint64_t* full, int ks, uint32_t, bool) {
                for (int box = 0; box < kWideBoxes; ++box)
                  tma_load_3d(stage + box * kStageWeightBytes, &p.tmap_w2, full, ks * kTileK, 0,
                              w2_group + box * kGemm1TileFeatures / 8, stream_policy);
                if (ks == reserve_step) reserve_task(p, queue);
              },
              [&](int ks) {
                // Not ready: the tile's remaining weights into L2 meanwhile, both boxes (the narrow tile's lambda
                // below with a box count moved the fp8 kernel's whole-program register allocation).
                readiness.wait(p, g, task.expert, ks, [&] {
                  if (threadIdx.x == 0 && ks == 0)
                    for (int s = 1; s < k_steps; ++s)
                      for (int box = 0; box < kWideBoxes; ++box)
                        tma_prefetch_l2_3d(&p.tmap_w2, s * kTileK, 0, w2_group + box * kGemm1TileFeatures / 8);
                });
                if (ks == 0) trace(kTraceProducerReady);
              });
          continue;
        }
      }
      // w2 viewed as [E_l H / 8][8][I] (kernel.cu): the tile's 128 rows are 16 groups of 8 from this one.
      const int w2_group = (task.expert * hidden_size + task.feature_tile * kGemm1TileFeatures) / 8;
      const float* weight_scale =
          kFp8 ? w2_scale + (static_cast<int64_t>(task.expert) * hidden_groups + task.feature_tile) * inter_groups
               : nullptr;
      produce_tile<kFp8, kTiles>(
          p, g, st, task.tile_tokens, task.rows, k_steps, row_at, scale_at,
          [&](char* stage, uint64_t* full, int ks, uint32_t weight_scales, bool real) {
            // A GEMM1 tile spans the whole K: a zero step's box (produce_tile) is past I, zero-filled.
            tma_load_3d(stage, &p.tmap_w2, full, ks * tile_k(kFp8), 0, w2_group, stream_policy);
            if constexpr (kFp8) {  // one block for the tile's rows: both slots
              cp_async_4(weight_scales, weight_scale + (real ? ks : 0), real);
              cp_async_4(weight_scales + 4, weight_scale + (real ? ks : 0), real);
            }
            if (ks == reserve_step) reserve_task(p, queue);
          },
          [&](int ks) {
            // Not ready (small T: GEMM0 still streaming): pull the tile's remaining weights into L2 meanwhile.
            readiness.wait(p, g, task.expert, ks, [&] {
              if (threadIdx.x == 0 && ks == 0)
                for (int s = 1; s < k_steps; ++s) tma_prefetch_l2_3d(&p.tmap_w2, s * tile_k(kFp8), 0, w2_group);
            });
            if (ks == 0) trace(kTraceProducerReady);
          });
    }
  }
}

// GEMM0 epilogue of one consumer: its SwiGLU'd features of the tile's rows into act, then count the tile on the
// counter of 64-feature tile `feature_tile` (a split tile counts once per consumer, a ping-pong tile kConsumers
// times by its owner). kWide: the staging rows are a wide consumer's (gemm.cuh store_swiglu_wide: its 64 tokens x
// the task's 128 features, chunks swizzled), which count once on both of the task's 64-feature counters from
// `feature_tile` on.
template <bool kWide = false>
__device__ __forceinline__ void store_activations(const Params& p, const GemmSmem& g, const ExpertTable& table,
                                                  const Task& task, const Staged& staged, int feature_tile,
                                                  int consumer) {
  const int tid = threadIdx.x & 127;
  bf16* act = ws_ptr<bf16>(p, p.ws_off.act) +
              static_cast<int64_t>(table.row_offset[task.expert] + task.first_row + staged.tokens.first) *
                  p.intermediate_size +
              feature_tile * kGemm0TileFeatures + staged.first_feature;
  const int chunks = staged.features / 8;  // 16-byte chunks per row
  const int rows = staged.tokens.valid(task.rows);
  for (int c = tid; c < rows * chunks; c += 128) {
    const int r = c / chunks, q = c - r * chunks;
    const bf16* src = kWide ? staged.rows + wide_chunk(r, q) * 8 : staged.rows + r * staged.stride + q * 8;
    *reinterpret_cast<uint4*>(act + static_cast<int64_t>(r) * p.intermediate_size + q * 8) =
        *reinterpret_cast<const uint4*>(src);
  }
  consumer_sync(consumer);  // every row stored; staging is rewritten by the next tile
  trace(kTraceConsumerStored);
  if (tid == 0) {
    __threadfence();  // the warpgroup's stores (ordered by the barrier) before the count: release
    if constexpr (kWide) {
      static_assert(kWideStagingFeatures == 2 * kGemm0TileFeatures, "a wide task: two 64-feature counters");
      atomicAdd(gemm0_done<false>(p, task.expert, feature_tile), 1u);
      atomicAdd(gemm0_done<false>(p, task.expert, feature_tile + 1), 1u);
    } else {
      atomicAdd(gemm0_done<false>(p, task.expert, feature_tile),
                staged.features == kGemm0TileFeatures ? kConsumers : 1u);
    }
    mark_time(p, g.epoch, kRingGemm0EndNs);  // the last GEMM0 tile of the call
  }
  __syncwarp();
  trace(kTraceConsumerCounted);
}

// fp8 GEMM0 epilogue: each token row's 128 fp32 SwiGLU values -> max |v| -> scale -> e4m3 into act, the scale
// into act_scales, then count the task. Ping-pong tiles: the owner's 4 warps; split tiles: both consumers' 8
// warps over the joint staging, between two barriers of both (the second keeps either consumer's next tile from
// rewriting staging the other still reads). A warp takes 4 rows at a time, 8 lanes of 16 values per row, so
// the rows' reductions and scale divisions (IEEE, for the reference's bits) run side by side: a row per warp
// at a time made this epilogue a chain of dependent latencies, ~5 us of a 34 us 128-token tile.
__device__ __forceinline__ void store_activations_fp8(const Params& p, const GemmSmem& g, const ExpertTable& table,
                                                      const Task& task, const float* staging, int consumer) {
  const bool split = !ping_pong(task.tile_tokens, true);
  const int lane = threadIdx.x & 31;
  if (split) consumers_sync();
  else consumer_sync(consumer);
  constexpr int kLanesPerRow = 8, kRowsPerWarp = 32 / kLanesPerRow, kValues = kFp8Group / kLanesPerRow;
  static_assert(kValues == 16, "a lane's values are one 16-byte store of e4m3");
  const int warps = split ? kConsumers * 4 : 4;
  const int warp = (split ? consumer * 4 : 0) + ((threadIdx.x >> 5) & 3);
  const int part = lane % kLanesPerRow;  // values [16 part, 16 part + 16) of its row
  const int64_t first = table.row_offset[task.expert] + task.first_row;
  const int groups = p.intermediate_size / kFp8Group;
  uint8_t* act = ws_ptr<uint8_t>(p, p.ws_off.act) + first * p.intermediate_size + task.feature_tile * kFp8Group;
  float* act_scales = ws_ptr<float>(p, p.ws_off.act_scales) + first * groups + task.feature_tile;
  for (int r0 = warp * kRowsPerWarp; r0 < task.rows; r0 += warps * kRowsPerWarp) {
    const int r = r0 + lane / kLanesPerRow;
    const bool valid = r < task.rows;  // a row past the tile's reads a valid one (r0) and stores nothing
    const float* src = staging + (valid ? r : r0) * kFp8StagingStride + part * kValues;
    float v[kValues];
#pragma unroll
    for (int i = 0; i < kValues; i += 4)
      *reinterpret_cast<float4*>(v + i) = *reinterpret_cast<const float4*>(src + i);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int d = kLanesPerRow / 2; d > 0; d >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const Fp8Scale s = fp8_scale(amax);
    uint32_t q[kValues / 4];
#pragma unroll
    for (int i = 0; i < kValues / 4; ++i)
      q[i] = quantize4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], s.inverse);
    if (valid) {
      *reinterpret_cast<uint4*>(act + static_cast<int64_t>(r) * p.intermediate_size + part * kValues) =
          make_uint4(q[0], q[1], q[2], q[3]);
      if (part == 0) act_scales[static_cast<int64_t>(r) * groups] = s.scale;
    }
  }
  if (split) consumers_sync();
  else consumer_sync(consumer);
  if (threadIdx.x % 128 == 0 && (!split || consumer == 0)) {
    __threadfence();  // every row of the task (ordered by the barrier) before the count: release
    atomicAdd(gemm0_done<true>(p, task.expert, task.feature_tile), static_cast<uint32_t>(kConsumers));
    mark_time(p, g.epoch, kRingGemm0EndNs);
  }
  __syncwarp();
  trace(kTraceConsumerCounted);
}

// Before a GEMM1 mainloop: the combine targets of the consumer's token rows (layout.cuh, beside the expert-list
// entries) into its row table by cp.async, so they arrive while the mainloop runs and store_outputs places its rows
// without a load of its own. The lists were written in the receive phase, before the grid barrier's acquire.
// (With the list entries instead, each row's token came from the row's metadata, one dependent L2 load: ~0.6 us
// of a 128-token fp8 GEMM1 tile's epilogue, benchmarks/kernel-notes.md.)
__device__ __forceinline__ void prefetch_combine_targets(const Params& p, const GemmSmem& g, const Task& task,
                                                     TokenRange tokens, int consumer) {
  const int tid = threadIdx.x & 127;
  const int* targets = expert_list(ws_ptr<int>(p, p.ws_off.combine_targets), p.expert_rows_stride, task.expert);
  if (tid < tokens.valid(task.rows))
    cp_async_4(smem_addr(g.row_rank(consumer) + tid), targets + task.first_row + tokens.first + tid, true);
}

// GEMM1 epilogue of one consumer: its output features of the tile's rows into the owners' combine buffers,
// counted per source in `combine_chunks` (the block's; moe_layer.cuh finish_gemm_phase sends them).
// The row table holds the rows' combine targets (prefetch_combine_targets).
// Returns the bytes sent to other ranks (metrics). Proxied rows go out as non-blocking puts from slot
// `put_tiles % kPutRingTiles` of the block's staging ring; the one quiet that lets the ring be rewritten comes
// when it wraps, and the GEMM phase's last block quiets once more before it sends the proxied sources their counts
// (moe_layer.cuh finish_gemm_phase). `column`: the first output feature of the staged rows.
// kWide: a wide consumer's 64 tokens x 256 features in two staging areas of 128 (gemm.cuh mma_wide_tile_to_staging);
// its rows take two ring slots, 32 rows in this consumer's part of each (a wide call's GEMM1 tiles are all wide, so
// the position stays even and a pair never straddles the wrap).
template <bool kWide = false>
__device__ __forceinline__ int64_t store_outputs(const Params& p, const PeerTable& peers, bool any_proxied,
                                                 const GemmSmem& g, const Task& task, const Staged& staged, int column,
                                                 int consumer, int& put_tiles, uint32_t* combine_chunks) {
  any_proxied = kDevicePuts && any_proxied;  // the default build has no puts (comm.cuh): their code compiles out
  static_assert(kPutRingTiles % 2 == 0 && kConsumerRows / 2 * kWideBoxes * kWideStagingFeatures <=
                                              kMaxTileTokens * kConsumerRows,
                "a wide consumer's rows fill its part of two ring slots");
  const int tid = threadIdx.x & 127;
  const int H = p.hidden_size;
  int64_t* row_dst = g.row_dst(consumer);
  int* row_rank = g.row_rank(consumer);
  const int features = staged.features;
  const int rows = staged.tokens.valid(task.rows);  // this consumer's token rows (a token-major one: up to 64)
  // Put path: this consumer's part of the ring slot (rows x features <= its size).
  const int ring_slot = put_tiles % kPutRingTiles;
  bf16* put_stage = sym_ptr<bf16>(p, p.sym_off.combine_stage) +
                    ((static_cast<int64_t>(blockIdx.x) * kPutRingTiles + ring_slot) * kConsumers + consumer) *
                        kMaxTileTokens * kConsumerRows;
  // Row r's source in the ring: a wide consumer's rows from 32 on sit in the next slot.
  const auto put_row = [&](int r) {
    constexpr int kSlotElements = kConsumers * kMaxTileTokens * kConsumerRows;
    return kWide && r >= kConsumerRows / 2 ? put_stage + kSlotElements + (r - kConsumerRows / 2) * features
                                           : put_stage + r * features;
  };
  if (any_proxied && ring_slot == 0 && put_tiles > 0) {
    // Wrapped: the puts from every slot are complete (quiet covers all of this PE's) before one is rewritten.
    if (tid == 0) quiet_puts();
    consumer_sync(consumer);
  }
  int64_t remote_bytes = 0;
  trace(kTraceConsumerStaged);
  cp_async_wait_all();  // this thread's prefetched target
  int source = -1;
  if (tid < rows) {  // where each row goes: its source rank, and its address there (by NVLink) or element offset
    const int target = row_rank[tid];
    source = target_source(target);
    row_rank[tid] = source;
    const int64_t offset = static_cast<int64_t>(target_row(target)) * H + column;  // in the source's combine rows
    bf16* const rows_there = reinterpret_cast<bf16*>(peers.base[source] + p.sym_off.combine_rows);  // NVLink only
    row_dst[tid] = use_p2p(peers, source) ? reinterpret_cast<int64_t>(rows_there + offset) : offset;
  }
  // The chunks per source: one shared-memory add per source and warp (rows of one source would contend).
  const unsigned same_source = __match_any_sync(0xffffffffu, source);
  if (source >= 0 && __ffs(same_source) - 1 == (tid & 31))
    atomicAdd(combine_chunks + source, static_cast<uint32_t>(__popc(same_source) * features / kCombineChunkFeatures));
  consumer_sync(consumer);
  trace(kTraceConsumerPlaced);
  // Row r's destination: row_dst's address (NVLink; every row without proxied peers), else its slot in the put ring.
  // Looking up the row's rank, the rank's base and the row's offset one after the other before every 16-byte store
  // took ~2 us of a 128-token fp8 GEMM1 tile's 3.4 us epilogue (kernel-notes.md, thirty-fifth session). (Loading
  // several chunks before the first store spilled the fp8 mainloop's registers.)
  const auto row_out = [&](int r) {
    return !any_proxied || use_p2p(peers, row_rank[r]) ? reinterpret_cast<bf16*>(row_dst[r]) : put_row(r);
  };
  if constexpr (kWide) {  // two staging areas of 128 features (gemm.cuh store_plain_wide)
    constexpr int kAreaChunks = kWideStagingFeatures / 8;
    for (int c = tid; c < rows * 2 * kAreaChunks; c += 128) {
      const int r = c / (2 * kAreaChunks), q = c - r * (2 * kAreaChunks);
      const bf16* area = q < kAreaChunks ? staged.rows : staged.rows_hi;
      const uint4 value = *reinterpret_cast<const uint4*>(area + wide_chunk(r, q % kAreaChunks) * 8);
      *reinterpret_cast<uint4*>(row_out(r) + q * 8) = value;
    }
  } else {  // 64 or 128 features: 8 or 16 chunks of 16 bytes per row
    const int chunk_shift = 31 - __clz(features / 8), total = rows << chunk_shift;
    for (int c = tid; c < total; c += 128) {
      const int r = c >> chunk_shift, q = c & ((1 << chunk_shift) - 1);
      const uint4 value = *reinterpret_cast<const uint4*>(staged.rows + r * staged.stride + q * 8);
      *reinterpret_cast<uint4*>(row_out(r) + q * 8) = value;
    }
  }
  if (tid < rows && row_rank[tid] != p.rank) remote_bytes += features * 2;
  if (any_proxied) {
    // Proxied rows: one put per row segment from the staging slot.
    consumer_sync(consumer);
    if (tid < rows && !use_p2p(peers, row_rank[tid]))
      put_thread(sym_ptr<bf16>(p, p.sym_off.combine_rows) + row_dst[tid], put_row(tid), features * 2, row_rank[tid]);
    put_tiles += kWide ? 2 : 1;
  }
  consumer_sync(consumer);  // staging and the row table are rewritten by the consumer's next tile
  trace(kTraceConsumerStored);
  return remote_bytes;
}

// This consumer's part of a split GEMM0 tile (gemm.cuh), or the whole tile. A ping-pong tile's owner sums all
// 128 rows; a split-width tile's consumers each their own 64, and decide alone (bf16: separate epilogues) or
// together (fp8: one epilogue quantises both halves' features, so both must run it or neither).
template <bool kFp8>
__device__ __forceinline__ SplitK split_k(const Params& p, const GemmSmem& g, const Task& task, int consumer) {
  if (task.splits == 1) return SplitK{};
  const bool ping = ping_pong(task.tile_tokens, kFp8);
  const int rows = ping ? 0 : consumer;
  const bool joint = kFp8 && !ping;
  const int64_t group = static_cast<int64_t>(task.tile) * kSplitRowGroups + rows;
  const int64_t counter = static_cast<int64_t>(task.tile) * kSplitRowGroups + (joint ? 0 : rows);
  return SplitK{ws_ptr<float>(p, p.ws_off.gemm0_partials) + group * task.splits * kSplitSlotFloats,
                ws_ptr<uint32_t>(p, p.ws_off.gemm0_split_arrivals) + counter, g.split_last(joint ? 0 : consumer),
                task.split, task.splits, joint};
}

__device__ __forceinline__ void trace_mma_done(const PipeState& st) {
#if FLASHMOE_TRACE
  trace_at(kTraceConsumerFirstFull, st.trace_first_full, static_cast<uint32_t>(st.trace_first_full_ns),
           static_cast<uint32_t>(st.trace_first_full_ns >> 32));
  trace(kTraceConsumerMmaDone, static_cast<uint32_t>(st.trace_wait));
#else
  (void)st;
#endif
}

// A consumer warpgroup's whole GEMM phase. Returns the bytes its tiles sent to other ranks (metrics).
// Both warpgroups read every task; ping-pong tiles (decode widths) alternate between them in the order the
// block takes them, split tiles are computed by both.
template <bool kFp8, CallTiles kTiles>
__device__ int64_t consume_tasks(const Params& p, const PeerTable& peers, bool any_proxied, const GemmSmem& g,
                                 const ExpertTable& table, uint32_t* combine_chunks) {
  constexpr bool kDecode = kTiles == CallTiles::kDecode;
  const int consumer = threadIdx.x / 128 - 1;
  const TaskCounts& counts = table.counts;
  PipeState st;
  TaskQueue queue;
  int64_t remote_bytes = 0;
  int ping_pong_tiles = 0;  // ping-pong tiles this block has taken so far
  int put_tiles = 0;        // GEMM1 tiles this consumer has staged for puts (store_outputs' ring position)
  int index;
  while ((index = next_task(p, g, queue, counts.total)) >= 0) {
    const Task task = decode_task<kFp8, kTiles>(table, index);
    const int k_steps = task.k_steps;
    if (ping_pong(task.tile_tokens, kFp8) && (ping_pong_tiles++ & 1) != consumer) {
      const int passes = kFp8 && task.gemm == 0 ? kFp8Gemm0Passes : 1;
      skip_tile<kFp8, kTiles>(st, task.tile_tokens, passes, k_steps);
      continue;
    }
    trace(kTraceConsumerTask, index);
#if FLASHMOE_TRACE
    st.trace_wait = 0;  // over the whole tile: an fp8 GEMM0 task runs two passes of its K steps
    st.trace_first_full = 0;
    st.trace_first_full_ns = 0;
#endif
    if (task.gemm == 0) {
      if constexpr (kFp8) {
        const float* staging =
            mma_fp8_gemm0_to_staging<kTiles>(p, g, st, task.tile_tokens, k_steps, split_k<true>(p, g, task, consumer));
        trace_mma_done(st);
        if (staging != nullptr) store_activations_fp8(p, g, table, task, staging, consumer);
      } else {
        if constexpr (!kDecode) {
          if (task.wide) {
            const WideStaged wide = wide_tile_to_staging<true>(p, g, st, k_steps);
            trace_mma_done(st);
            consumer_sync(consumer);
            trace(kTraceConsumerStaged);
            store_activations<true>(p, g, table, task, wide.staged, kWideBoxes * task.feature_tile, consumer);
            release_held_stages(g, wide.held);
            trace(kTraceConsumerEpilogueDone);
            continue;
          }
        }
        const Staged staged = mma_tile_to_staging<true, false, kTiles>(p, g, st, task.tile_tokens, k_steps, split_k<false>(p, g, task, consumer));
        trace_mma_done(st);
        if (staged.rows != nullptr) {  // the whole tile, or the last of its splits
          consumer_sync(consumer);
          store_activations(p, g, table, task, staged, task.feature_tile, consumer);
        }
      }
    } else {
      const TokenRange tokens = task.wide ? wide_tokens(consumer) : staged_tokens(task.tile_tokens, kFp8, consumer);
      prefetch_combine_targets(p, g, task, tokens, consumer);
      if constexpr (!kFp8 && !kDecode) {
        if (task.wide) {
          const WideStaged wide = wide_tile_to_staging<false>(p, g, st, k_steps);
          trace_mma_done(st);
          remote_bytes += store_outputs<true>(p, peers, any_proxied, g, task, wide.staged,
                                              task.feature_tile * kWideGemm1Features + wide.staged.first_feature,
                                              consumer, put_tiles, combine_chunks);
          release_held_stages(g, wide.held);
          trace(kTraceConsumerEpilogueDone);
          continue;
        }
      }
      const Staged staged = mma_tile_to_staging<false, kFp8, kTiles>(p, g, st, task.tile_tokens, k_steps);
      trace_mma_done(st);
      remote_bytes += store_outputs(p, peers, any_proxied, g, task, staged,
                                    task.feature_tile * kGemm1TileFeatures + staged.first_feature, consumer, put_tiles,
                                    combine_chunks);
    }
    trace(kTraceConsumerEpilogueDone);
  }
  return remote_bytes;
}

}  // namespace flashmoe
