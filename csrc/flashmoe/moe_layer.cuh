// The whole MoE layer in one persistent kernel: every block runs every phase (all blocks are co-resident:
// cooperative launch); ranks meet only through one-sided signals and counts (comm.cuh: the ordering argument).
//
//   1 dispatch     send each token once per destination rank; a grid barrier, then every destination gets
//                  the number of rows it was sent                        (source side)
//   2 receive      wait for all sources, build per-expert row lists   (destination side; decode-sized calls:
//                  each block builds them all itself and starts its GEMMs without a grid barrier)
//   3 GEMMs        one task queue: GEMM0 tiles SwiGLU(x W13^T), then GEMM1 tiles act W2^T whose rows go
//                  straight into the owners' combine buffers (an expert's GEMM1 waits for its GEMM0 tiles
//                  only, not for a grid barrier); each block then adds what it wrote to each source's arrival
//                  count, and the last block to finish releases the receive buffers to every source
//   4 combine      once each owner's rows are all in (the counts), reduce over top-k slots   (source side)
//
// In the GEMM phase warpgroup 0 produces (TMA, cp.async) and warpgroups 1-2 consume (wgmma); the ring of
// stages is set up once per launch and carries over from tile to tile. kFp8: block-fp8 weights (e4m3 with
// 128x128 block scales), tokens quantised per 128-group in dispatch, activations re-quantised after SwiGLU.
#pragma once

#include "combine.cuh"
#include "comm.cuh"
#include "common.cuh"
#include "dispatch.cuh"
#include "gemm.cuh"
#include "metrics.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "subscriber.cuh"
#include "tasks.cuh"
#include "trace.cuh"

namespace flashmoe {

static_assert(kCombineStageBytesPerTile == kConsumers * kMaxTileTokens * kConsumerRows * 2,
              "layout.cuh sizes each put-path staging slot for one GEMM1 tile of both consumers");

struct BlockShared {
  PeerTable peers;
  Received recv;
  ExpertTable table;
  uint32_t epoch, prev_epoch;
  bool any_proxied;  // some peer is reached through NVSHMEM puts
  int released;      // every rank has released the previous call (dispatch.cuh)
  BlockMetrics metrics;
  uint32_t combine_chunks[kMaxWorld];  // 16-byte chunks of output rows this block wrote into each source's rows
  uint32_t sent_entries[kMaxWorld];    // (row, top-k slot) entries this rank sent each destination
};

// The call's own counters, zeroed at its start by every block's threads from the last block down (block 0's first
// warp carries the first token at small T): every use of them follows grid barrier 1, whose fences order these
// stores first. The combine arrivals too: destinations add to them only after this call's dispatch signal, which
// block 0 sends after barrier 1 (comm.cuh).
static __device__ void zero_call_counters(const Params& p) {
  const int num_gemm0_done = p.num_local * (p.intermediate_size / kInterMultiple);
  const int num_splits = static_cast<int>(gridDim.x) * kSplitRowGroups;
  const int n = p.world_size * 3 + p.num_local + num_gemm0_done + num_splits + 1;
  for (int i = (gridDim.x - 1 - blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    int j = i;
    if (j < p.world_size * 2) {  // u64 words as pairs of u32
      ws_ptr<uint32_t>(p, p.ws_off.proxied_chunks)[j] = 0;
      continue;
    }
    j -= p.world_size * 2;
    if (j < p.world_size) {
      sym_ptr<uint64_t>(p, p.sym_off.combine_arrivals)[j] = 0;
      continue;
    }
    j -= p.world_size;
    if (j < p.num_local) {
      ws_ptr<uint32_t>(p, p.ws_off.expert_count)[j] = 0;
      continue;
    }
    j -= p.num_local;
    if (j < num_gemm0_done) {
      ws_ptr<uint32_t>(p, p.ws_off.gemm0_done)[j] = 0;
      continue;
    }
    j -= num_gemm0_done;
    if (j < num_splits) ws_ptr<uint32_t>(p, p.ws_off.gemm0_split_arrivals)[j] = 0;
    else *ws_ptr<uint32_t>(p, p.ws_off.task_counter) = 0;
  }
}

// After a block's GEMM phase, once every thread has fenced its combine-row stores at system scope and the block has
// met at a barrier. Warp 0 adds what the block wrote to each source's arrival count (lane r: source r, a release
// add over NVLink) and goes on to the combine wait. Warp 1, meanwhile (its atomic's round trip is then off the
// block's path), adds a proxied source's share to this rank's total for it and counts the block done; the last
// block knows every block has finished reading this call's receive area and the dispatch counts: it resets those
// counts (used before barrier 1, so not zeroed at the start), sends the proxied totals after a quiet, and
// releases the call to every rank.
static __device__ void finish_gemm_phase(const Params& p, const PeerTable& peers, bool any_proxied, uint32_t epoch,
                                         const uint32_t* chunks) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned long long* proxied_chunks = ws_ptr<unsigned long long>(p, p.ws_off.proxied_chunks);
  if (warp == 0) {
    for (int r = lane; r < p.world_size; r += 32) {
      if (chunks[r] == 0 || !use_p2p(peers, r)) continue;
      uint64_t* arrivals = reinterpret_cast<uint64_t*>(peers.base[r] + p.sym_off.combine_arrivals);
      red_release_sys_add(arrivals + p.rank, chunks[r]);
    }
    return;
  }
  if (warp != 1) return;
  if (any_proxied) {
    for (int r = lane; r < p.world_size; r += 32)
      if (chunks[r] != 0 && !use_p2p(peers, r))
        atomicAdd(proxied_chunks + r, static_cast<unsigned long long>(chunks[r]));
    __syncwarp();
  }
  if (lane != 0) return;
  mark_time(p, epoch, kRingGemm1EndNs);  // the latest block's end (a reduction, no value comes back)
  uint32_t* done = ws_ptr<uint32_t>(p, p.ws_off.gemm_done_blocks);
  __threadfence();  // this block's proxied totals (ordered by the warp barrier) before its count
  if (atomicAdd(done, 1u) != gridDim.x - 1) return;
  __threadfence();  // every block's totals, after their counts
  *done = 0;
  unsigned long long* send_count = ws_ptr<unsigned long long>(p, p.ws_off.rank_send_count);
  for (int r = 0; r < p.world_size; ++r) send_count[r] = 0;
  if (any_proxied) {
    quiet_puts();  // every block's combine puts are delivered before their counts
    for (int r = 0; r < p.world_size; ++r) {
      if (use_p2p(peers, r)) continue;
      const unsigned long long n = __ldcg(proxied_chunks + r);
      if (n) signal_add(sym_ptr<uint64_t>(p, p.sym_off.combine_arrivals) + p.rank, n, r);
    }
  }
  uint64_t* release = sym_ptr<uint64_t>(p, p.sym_off.release_signal) + p.rank;
  for (int r = 0; r < p.world_size; ++r) send_signal(p, peers, release, r, static_cast<uint64_t>(epoch) << 32);
}

template <bool kFp8>
__device__ void moe_layer(const Params& p) {
  __shared__ BlockShared sh;
  const bool producer = threadIdx.x < kProducerThreads;

  trace_begin();
  // An engine's padding call (params.cuh): no tokens leave this rank and its output is zeros.
  const bool padding = p.padding_marker != nullptr && __ldg(p.padding_marker) < 0;
  const int tokens_in = padding ? 0 : p.num_tokens;
  if (threadIdx.x == 0) {
    const uint32_t prev = *ws_ptr<volatile uint32_t>(p, p.ws_off.epoch);
    sh.prev_epoch = prev;
    sh.epoch = prev + 1 == 0 ? 1 : prev + 1;  // 0 is the never-signalled value
    GemmSmem{0}.init_barriers();
    sh.metrics.zero();
    sh.released = 0;
  }
  if (threadIdx.x < p.world_size) sh.combine_chunks[threadIdx.x] = 0;
  load_peer_table(p, sh.peers);  // includes __syncthreads
  const uint32_t epoch = sh.epoch;
  const GemmSmem gemm{epoch};
  if (threadIdx.x == 0) {
    bool any = false;
    for (int r = 0; r < p.world_size; ++r) any = any || !use_p2p(sh.peers, r);
    sh.any_proxied = any;
    if (p.metrics && blockIdx.x == 0) open_record(p, epoch, globaltimer_ns(), tokens_in);
  }
  trace(kTraceStart, epoch);

  // 1. Dispatch.
  zero_call_counters(p);
  busy_start(p, sh.metrics);
  const int warp_rows_sent = dispatch_tokens<kFp8>(p, sh.peers, tokens_in, sh.prev_epoch, &sh.released);
  if ((threadIdx.x & 31) == 0) count_metric(p, sh.metrics.rows_sent, warp_rows_sent);  // every lane counted them
  __threadfence_system();  // our NVLink stores are visible before any signal that follows the barrier
  busy_stop(p, sh.metrics);
  trace(kTraceDispatchDone);
  grid_barrier(p, 1, epoch, phase_end_field(p, epoch, kRingDispatchEndNs));
  trace(kTraceBarrier1Done);
  read_sent_entries(p, sh.sent_entries);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // Every rank has released the previous call (dispatch_tokens: block 0's last warp waited for it). Puts issued
    // by any block of this PE are delivered (NVLink stores were fenced above). Only with proxied peers: quiet goes
    // through NVSHMEM's proxy channel, which costs tens of microseconds and varies with the host thread's
    // scheduling.
    if (sh.any_proxied) quiet_puts();
    const unsigned long long* send_count = ws_ptr<unsigned long long>(p, p.ws_off.rank_send_count);
    for (int r = 0; r < p.world_size; ++r) {
      const uint32_t n = static_cast<uint32_t>(__ldcg(send_count + r));
      send_signal(p, sh.peers, sym_ptr<uint64_t>(p, p.sym_off.dispatch_signal) + p.rank, r,
                  (static_cast<uint64_t>(epoch) << 32) | n);
      if (r != p.rank)
        count_metric(p, sh.metrics.remote_bytes, static_cast<int64_t>(n) * (dispatch_row_bytes<kFp8>(p) + meta_stride(p.top_k) * 4));
    }
    *ws_ptr<uint32_t>(p, p.ws_off.epoch) = epoch;  // every block read the previous one before barrier 1
  }

  // 2. Receive.
  wait_dispatch(p, epoch, sh.recv);
  trace(kTraceReceiveWaitDone);
  busy_start(p, sh.metrics);
  const bool lists_here = lists_per_block(p, sh.recv);  // the same in every block
  static_assert(kListRounds * kWarps * kMaxLocalExperts <= kPoolBytes, "receive scratch in the stage pool");
  if (lists_here) build_expert_lists_in_block(p, sh.recv, sh.table.count, reinterpret_cast<uint8_t*>(gemm.pool()));
  else build_expert_lists(p, sh.recv);
  busy_stop(p, sh.metrics);
  trace(kTraceReceiveDone);
  if (!lists_here) {
    grid_barrier(p, 2, epoch, phase_end_field(p, epoch, kRingReceiveEndNs));
  } else if (blockIdx.x == 0 && threadIdx.x == 0) {
    mark_time(p, epoch, kRingReceiveEndNs);  // every block builds the same lists: block 0's end stands for all
  }
  trace(kTraceBarrier2Done);

  // 3-4. GEMM0 (+ SwiGLU) and GEMM1 into the owners' combine buffers, one task queue (scheduler.cuh).
  build_expert_table<kFp8>(p, sh.table, lists_here);
  trace(kTraceGemmStart);
  busy_start(p, sh.metrics);
  const auto gemm_phase = [&](auto tiles) {  // compiled per kind of call (gemm.cuh CallTiles)
    constexpr CallTiles kTiles = decltype(tiles)::value;
    if (producer) produce_tasks<kFp8, kTiles>(p, gemm, sh.table);
    else
      count_metric(p, sh.metrics.remote_bytes,
                   consume_tasks<kFp8, kTiles>(p, sh.peers, sh.any_proxied, gemm, sh.table, sh.combine_chunks));
  };
  // Every block reads the same table: all take the same branch.
  if (decode_call(sh.table.max_count)) {
    gemm_phase(CallTilesConstant<CallTiles::kDecode>{});
  } else if constexpr (kFp8) {
    if (full_call(sh.table.min_count)) gemm_phase(CallTilesConstant<CallTiles::kFull>{});
    else gemm_phase(CallTilesConstant<CallTiles::kAny>{});
  } else {
    gemm_phase(CallTilesConstant<CallTiles::kAny>{});
  }
  __threadfence_system();  // this thread's combine-row stores, before the block's arrival counts
  busy_stop(p, sh.metrics);
  __syncthreads();
  trace(kTraceGemmDone);
  finish_gemm_phase(p, sh.peers, sh.any_proxied, epoch, sh.combine_chunks);
  trace(kTraceGemmCounted);

  // 4. Combine.
  wait_combine(p, epoch, sh.sent_entries);
  trace(kTraceCombineWaitDone);
  busy_start(p, sh.metrics);
  combine_tokens(p, padding);
  busy_stop(p, sh.metrics);
  trace(kTraceEnd);

  if (p.metrics) {
    __syncthreads();  // every thread's counts are in
    if (threadIdx.x == 0)
      publish_metrics(p, epoch, sh.metrics.busy_ns, static_cast<int64_t>(sh.metrics.rows_sent),
                      static_cast<int64_t>(sh.metrics.remote_bytes), blockIdx.x == 0 ? sh.recv.total : 0, tokens_in);
  }
}

}  // namespace flashmoe
