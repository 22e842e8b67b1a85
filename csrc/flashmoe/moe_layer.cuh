// The whole MoE layer in one persistent kernel: every block runs every phase; phases are separated by grid
// barriers (all blocks are co-resident: cooperative launch), and ranks meet only through epoch-tagged signals.
//
//   1 dispatch     send each token once per destination rank          (source side)
//   2 receive      wait for all sources, build per-expert row lists   (destination side; decode-sized calls:
//                  each block builds them all itself and starts its GEMMs without a grid barrier)
//   3 GEMMs        one task queue: GEMM0 tiles SwiGLU(x W13^T), then GEMM1 tiles act W2^T whose rows go
//                  straight into the owners' combine buffers (an expert's GEMM1 waits for its GEMM0 tiles
//                  only, not for a grid barrier); then signal every source
//   4 combine      wait for every owner, reduce over top-k slots      (source side)
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
  uint32_t epoch;
  bool any_proxied;  // some peer is reached through NVSHMEM puts
  BlockMetrics metrics;
};

template <bool kFp8>
__device__ void moe_layer(const Params& p) {
  __shared__ BlockShared sh;
  const bool producer = threadIdx.x < kProducerThreads;

  trace_begin();
  // An engine's padding call (params.cuh): no tokens leave this rank and its output is zeros.
  const bool padding = p.padding_marker != nullptr && __ldg(p.padding_marker) < 0;
  const int tokens_in = padding ? 0 : p.num_tokens;
  if (threadIdx.x == 0) {
    uint32_t e = *ws_ptr<volatile uint32_t>(p, p.ws_off.epoch) + 1;
    sh.epoch = e == 0 ? 1 : e;  // 0 is the never-signalled value
    GemmSmem{0}.init_barriers();
    sh.metrics.zero();
  }
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
  busy_start(p, sh.metrics);
  const int warp_rows_sent = dispatch_tokens<kFp8>(p, sh.peers, tokens_in);
  if ((threadIdx.x & 31) == 0) count_metric(p, sh.metrics.rows_sent, warp_rows_sent);  // every lane counted them
  __threadfence_system();  // our NVLink stores are visible before any signal that follows the barrier
  busy_stop(p, sh.metrics);
  trace(kTraceDispatchDone);
  grid_barrier(p, 1, epoch, phase_end_field(p, epoch, kRingDispatchEndNs));
  trace(kTraceBarrier1Done);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // Puts issued by any block of this PE are delivered (NVLink stores were fenced above). Only with proxied
    // peers: quiet goes through NVSHMEM's proxy channel, which costs tens of microseconds and varies with the
    // host thread's scheduling.
    if (sh.any_proxied) quiet_puts();
    const uint32_t* send_count = ws_ptr<uint32_t>(p, p.ws_off.rank_send_count);
    for (int r = 0; r < p.world_size; ++r) {
      const uint32_t n = __ldcg(send_count + r);
      send_signal(p, sh.peers, sym_ptr<uint64_t>(p, p.sym_off.dispatch_signal) + p.rank, r,
                  (static_cast<uint64_t>(epoch) << 32) | n);
      if (r != p.rank)
        count_metric(p, sh.metrics.remote_bytes, static_cast<int64_t>(n) * (dispatch_row_bytes<kFp8>(p) + meta_stride(p.top_k) * 4));
    }
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
  if (decode_call(sh.table.max_count)) {  // every block reads the same table: all take the same branch
    if (producer) produce_tasks<kFp8, true>(p, gemm, sh.table);
    else count_metric(p, sh.metrics.remote_bytes, consume_tasks<kFp8, true>(p, sh.peers, sh.any_proxied, gemm, sh.table));
  } else {
    if (producer) produce_tasks<kFp8, false>(p, gemm, sh.table);
    else count_metric(p, sh.metrics.remote_bytes, consume_tasks<kFp8, false>(p, sh.peers, sh.any_proxied, gemm, sh.table));
  }
  __threadfence_system();
  busy_stop(p, sh.metrics);
  __syncthreads();
  trace(kTraceGemmDone);
  grid_barrier(p, 3, epoch, phase_end_field(p, epoch, kRingGemm1EndNs));
  trace(kTraceBarrier3Done);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (sh.any_proxied) quiet_puts();
    for (int r = 0; r < p.world_size; ++r)
      send_signal(p, sh.peers, sym_ptr<uint64_t>(p, p.sym_off.combine_signal) + p.rank, r,
                  static_cast<uint64_t>(epoch) << 32);
    // Counters for the next call: their last readers finished before barrier 3.
    uint32_t* send_count = ws_ptr<uint32_t>(p, p.ws_off.rank_send_count);
    for (int r = 0; r < p.world_size; ++r) send_count[r] = 0;
    *ws_ptr<uint32_t>(p, p.ws_off.task_counter) = 0;
    *ws_ptr<uint32_t>(p, p.ws_off.epoch) = epoch;
  }
  if (blockIdx.x == 0) {
    uint32_t* expert_count = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
    for (int e = threadIdx.x; e < p.num_local; e += blockDim.x) expert_count[e] = 0;
    uint32_t* gemm0_done = ws_ptr<uint32_t>(p, p.ws_off.gemm0_done);
    const int pairs = p.num_local * (p.intermediate_size / kInterMultiple);
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) gemm0_done[i] = 0;
    uint32_t* split_arrivals = ws_ptr<uint32_t>(p, p.ws_off.gemm0_split_arrivals);
    for (int i = threadIdx.x; i < static_cast<int>(gridDim.x) * kSplitRowGroups; i += blockDim.x) split_arrivals[i] = 0;
  }

  // 4. Combine.
  wait_combine(p, epoch);
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
