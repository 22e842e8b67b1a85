// The persistent kernel: every block runs every phase; phases are separated by grid barriers (all blocks are
// co-resident: cooperative launch), and ranks meet only through epoch-tagged signals.
//
//   1 dispatch     send each token once per destination rank          (source side)
//   2 receive      wait for all sources, build per-expert row lists   (destination side)
//   3 GEMM0        SwiGLU(x W13^T) per (expert, m-tile, n-tile)
//   4 GEMM1        act W2^T, rows written into the owners' combine buffers; then signal every source
//   5 combine      wait for every owner, reduce over top-k slots      (source side)
//
// Busy time (work, not waiting) and traffic are accumulated per block and published in the metrics ring.
#pragma once

#include "combine.cuh"
#include "comm.cuh"
#include "common.cuh"
#include "dispatch.cuh"
#include "gemm.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "subscriber.cuh"
#include "tasks.cuh"

namespace flashmoe {

struct BlockShared {
  PeerTable peers;
  Received recv;
  ExpertTable table;
  TileRows rows;
  uint32_t epoch;
};

// Per-block busy time: only thread 0's clock is published, so only thread 0 reads %globaltimer, and only with
// metrics on.
struct BusyClock {
  uint64_t busy = 0, since = 0;
  bool on;
  __device__ explicit BusyClock(bool metrics) : on(metrics && threadIdx.x == 0) {}
  __device__ void start() {
    if (on) since = globaltimer_ns();
  }
  __device__ void stop() {
    if (on) busy += globaltimer_ns() - since;
  }
};

// Called by every thread of every block at the end of a call. Each block stores its numbers in its own slot
// (no contended atomics on the record: those cost microseconds at 132 blocks); the last block to arrive sums
// the slots with one warp and publishes the record, sequence number last.
__device__ void publish_metrics(const Params& p, uint32_t epoch, uint64_t busy_ns, uint64_t rows_sent,
                                uint64_t remote_bytes, int rows_received) {
  __shared__ int last_block;
  unsigned long long* slots = ws_ptr<unsigned long long>(p, p.ws_off.block_metrics);
  int64_t* rec = p.metrics_ring + static_cast<int64_t>(epoch % kRingSlots) * kRingFields;
  if (threadIdx.x == 0) {
    unsigned long long* mine = slots + static_cast<int64_t>(blockIdx.x) * 4;
    mine[0] = busy_ns;
    mine[1] = globaltimer_ns();
    mine[2] = rows_sent;
    mine[3] = remote_bytes;
    if (blockIdx.x == 0) rec[9] = rows_received;
    __threadfence();
    unsigned int* done = ws_ptr<unsigned int>(p, p.ws_off.metrics_done);
    last_block = atomicAdd(done, 1u) + 1 == gridDim.x;
  }
  __syncthreads();
  if (!last_block || threadIdx.x >= 32) return;
  __threadfence();
  unsigned long long busy = 0, end = 0, rows = 0, bytes = 0;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += 32) {
    const unsigned long long* s = slots + static_cast<int64_t>(b) * 4;
    busy += __ldcg(s + 0);
    end = max(end, __ldcg(s + 1));
    rows += __ldcg(s + 2);
    bytes += __ldcg(s + 3);
  }
  for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
    busy += __shfl_xor_sync(0xffffffffu, busy, lane_mask);
    end = max(end, __shfl_xor_sync(0xffffffffu, end, lane_mask));
    rows += __shfl_xor_sync(0xffffffffu, rows, lane_mask);
    bytes += __shfl_xor_sync(0xffffffffu, bytes, lane_mask);
  }
  if (threadIdx.x != 0) return;
  rec[3] = static_cast<int64_t>(end);
  rec[4] = static_cast<int64_t>(busy);
  rec[5] = gridDim.x;
  rec[8] = static_cast<int64_t>(rows);
  rec[10] = static_cast<int64_t>(bytes);
  unsigned long long* totals = reinterpret_cast<unsigned long long*>(p.metrics_totals) + p.layer_id * 4;
  totals[0] += 1;  // one writer per call, and calls of one process are stream-ordered
  totals[1] += static_cast<unsigned long long>(p.num_tokens);
  totals[2] += rows;
  totals[3] += bytes;
  *ws_ptr<unsigned int>(p, p.ws_off.metrics_done) = 0;  // for the next call (after this kernel ends)
  __threadfence();
  atomicExch(reinterpret_cast<unsigned long long*>(rec), static_cast<unsigned long long>(epoch));
}

__device__ void moe_layer(const Params& p) {
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  bf16* gemm_smem = reinterpret_cast<bf16*>(dynamic_smem);
  __shared__ BlockShared sh;
  BusyClock clock(p.metrics);
  const uint64_t t_start = p.metrics && blockIdx.x == 0 && threadIdx.x == 0 ? globaltimer_ns() : 0;

  if (threadIdx.x == 0) {
    uint32_t e = *ws_ptr<volatile uint32_t>(p, p.ws_off.epoch) + 1;
    sh.epoch = e == 0 ? 1 : e;  // 0 is the never-signalled value
  }
  load_peer_table(p, sh.peers);  // includes __syncthreads
  const uint32_t epoch = sh.epoch;

  if (p.metrics && blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t* rec = p.metrics_ring + static_cast<int64_t>(epoch % kRingSlots) * kRingFields;
    rec[0] = 0;  // incomplete until the last block publishes
    for (int f = 1; f < kRingFields; ++f) rec[f] = 0;
    rec[1] = p.layer_id;
    rec[2] = static_cast<int64_t>(t_start);
    rec[6] = gridDim.x;
    rec[7] = p.num_tokens;
    rec[11] = p.world;
    __threadfence();
  }

  // 1. Dispatch.
  clock.start();
  const DispatchCounts sent = dispatch_tokens(p, sh.peers);
  __threadfence_system();  // our NVLink stores are visible before any signal that follows the barrier
  clock.stop();
  int64_t rows_sent = (threadIdx.x & 31) == 0 ? sent.rows_sent : 0;
  grid_barrier(p, 1, epoch);
  int64_t remote_bytes = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    nvshmem_quiet();  // puts issued by any block of this PE are delivered (NVLink stores: fenced above)
    const uint32_t* send_count = ws_ptr<uint32_t>(p, p.ws_off.rank_send_count);
    for (int r = 0; r < p.world; ++r) {
      const uint32_t n = __ldcg(send_count + r);
      send_signal(p, sh.peers, sym_ptr<uint64_t>(p, p.sym_off.dispatch_signal) + p.rank, r,
                  (static_cast<uint64_t>(epoch) << 32) | n);
      if (r != p.rank) remote_bytes += static_cast<int64_t>(n) * (p.hidden * 2 + meta_stride(p.top_k) * 4);
    }
  }

  // 2. Receive.
  wait_dispatch(p, epoch, sh.recv);
  clock.start();
  build_expert_lists(p, sh.recv);
  clock.stop();
  grid_barrier(p, 2, epoch);

  // 3. GEMM0 (+ SwiGLU).
  build_expert_table(p, sh.table);
  const int m_tiles = total_m_tiles(sh.table, p.num_local);
  clock.start();
  {
    const int n_tiles = p.inter / (kBlockN / 2);
    for (int task = blockIdx.x; task < m_tiles * n_tiles; task += gridDim.x)
      run_gemm0_task(p, sh.table, decode_task(sh.table, p.num_local, n_tiles, task), sh.rows, gemm_smem);
  }
  clock.stop();
  grid_barrier(p, 3, epoch);

  // 4. GEMM1 into the owners' combine buffers.
  clock.start();
  {
    const int n_tiles = p.hidden / kBlockN;
    for (int task = blockIdx.x; task < m_tiles * n_tiles; task += gridDim.x)
      remote_bytes += run_gemm1_task(p, sh.peers, sh.table, decode_task(sh.table, p.num_local, n_tiles, task),
                                     sh.rows, gemm_smem);
  }
  __threadfence_system();
  clock.stop();
  grid_barrier(p, 4, epoch);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    nvshmem_quiet();
    for (int r = 0; r < p.world; ++r)
      send_signal(p, sh.peers, sym_ptr<uint64_t>(p, p.sym_off.combine_signal) + p.rank, r,
                  static_cast<uint64_t>(epoch) << 32);
    // Counters for the next call: their last readers finished before barrier 4.
    uint32_t* send_count = ws_ptr<uint32_t>(p, p.ws_off.rank_send_count);
    for (int r = 0; r < p.world; ++r) send_count[r] = 0;
    uint32_t* expert_count = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
    for (int e = 0; e < p.num_local; ++e) expert_count[e] = 0;
    *ws_ptr<uint32_t>(p, p.ws_off.epoch) = epoch;
  }

  // 5. Combine.
  wait_combine(p, epoch);
  clock.start();
  combine_tokens(p);
  clock.stop();

  if (p.metrics) {
    __shared__ unsigned long long block_rows, block_bytes;
    if (threadIdx.x == 0) block_rows = block_bytes = 0;
    __syncthreads();
    if (rows_sent) atomicAdd(&block_rows, static_cast<unsigned long long>(rows_sent));
    if (remote_bytes) atomicAdd(&block_bytes, static_cast<unsigned long long>(remote_bytes));
    __syncthreads();
    publish_metrics(p, epoch, clock.busy, block_rows, block_bytes, blockIdx.x == 0 ? sh.recv.total : 0);
  }
}

}  // namespace flashmoe
