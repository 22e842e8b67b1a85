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

struct BusyClock {
  uint64_t busy = 0, since = 0;
  __device__ void start() { since = globaltimer_ns(); }
  __device__ void stop() { busy += globaltimer_ns() - since; }
};

__device__ void publish_metrics(const Params& p, uint32_t epoch, uint64_t busy_ns, uint64_t end_ns, int64_t rows_sent,
                                int64_t remote_bytes, int rows_received) {
  int64_t* rec = p.metrics_ring + static_cast<int64_t>(epoch % kRingSlots) * kRingFields;
  unsigned long long* u = reinterpret_cast<unsigned long long*>(rec);
  atomicAdd(u + 4, static_cast<unsigned long long>(busy_ns));
  atomicMax(u + 3, static_cast<unsigned long long>(end_ns));
  atomicAdd(u + 8, static_cast<unsigned long long>(rows_sent));
  atomicAdd(u + 10, static_cast<unsigned long long>(remote_bytes));
  if (blockIdx.x == 0) rec[9] = rows_received;
  __threadfence();
  const unsigned long long done = atomicAdd(u + 5, 1ull) + 1;
  if (done == gridDim.x) {  // last block: the record is complete
    __threadfence();
    unsigned long long* totals = reinterpret_cast<unsigned long long*>(p.metrics_totals) + p.layer_id * 4;
    atomicAdd(totals + 0, 1ull);
    atomicAdd(totals + 1, static_cast<unsigned long long>(p.num_tokens));
    atomicAdd(totals + 2, static_cast<unsigned long long>(atomicAdd(u + 8, 0ull)));
    atomicAdd(totals + 3, static_cast<unsigned long long>(atomicAdd(u + 10, 0ull)));
    atomicExch(u + 0, static_cast<unsigned long long>(epoch));
  }
}

__device__ void moe_layer(const Params& p) {
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  bf16* gemm_smem = reinterpret_cast<bf16*>(dynamic_smem);
  __shared__ BlockShared sh;
  BusyClock clock;
  const uint64_t t_start = globaltimer_ns();

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
    if (threadIdx.x == 0)
      publish_metrics(p, epoch, clock.busy, globaltimer_ns(), static_cast<int64_t>(block_rows),
                      static_cast<int64_t>(block_bytes), blockIdx.x == 0 ? sh.recv.total : 0);
  }
}

}  // namespace flashmoe
