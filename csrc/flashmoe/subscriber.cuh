// Subscriber: turns signals from peers into work. After every source's dispatch signal for this call has
// arrived, the received metadata rows become per-expert lists of (row, top-k slot) entries; after every
// owner's combine signal has arrived, the combine buffer is complete.
#pragma once

#include "comm.cuh"
#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

struct Received {
  int rows[kMaxWorld];  // rows each source sent us this call
  int total;
};

// Thread 0 of every block waits for all dispatch signals; the counts go to shared memory.
static __device__ void wait_dispatch(const Params& p, uint32_t epoch, Received& recv) {
  if (threadIdx.x == 0) {
    const uint64_t* signals = sym_ptr<uint64_t>(p, p.sym_off.dispatch_signal);
    recv.total = 0;
    for (int s = 0; s < p.world_size; ++s) {
      const uint64_t v = wait_signal(p, signals + s, epoch, kPhaseDispatchWait, s);
      const int n = static_cast<int>(v & 0xffffffffu);
      recv.rows[s] = v ? n : 0;
      recv.total += recv.rows[s];
    }
  }
  __syncthreads();
}

// One thread per received (row, top-k slot): append (row, j) to its expert's list. Per entry, not per row, so
// no thread runs k dependent load -> atomic -> store chains in a row.
static __device__ void build_expert_lists(const Params& p, const Received& recv) {
  const int k = p.top_k;
  const int64_t mstride = meta_stride(k);
  const int* meta = sym_ptr<int>(p, p.sym_off.recv_meta);
  uint32_t* expert_count = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
  int* expert_rows = ws_ptr<int>(p, p.ws_off.expert_rows);
  const int entries = recv.total * k;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < entries; i += gridDim.x * blockDim.x) {
    const int received = i / k, j = i - received * k;
    int s = 0, slot = received;
    while (slot >= recv.rows[s]) slot -= recv.rows[s++];
    const int64_t row = static_cast<int64_t>(s) * p.max_tokens_per_rank + slot;
    const int local = ldcg(meta + row * mstride + 1 + j);
    if (local < 0) continue;
    const uint32_t pos = atomicAdd(expert_count + local, 1u);
    expert_rows[static_cast<int64_t>(local) * p.expert_rows_stride + pos] = static_cast<int>(row << 4) | j;
  }
}

// Thread 0 of every block waits for every owner's combine signal (a timeout is recorded, not returned: the
// block runs on and Python raises).
static __device__ void wait_combine(const Params& p, uint32_t epoch) {
  if (threadIdx.x == 0) {
    const uint64_t* signals = sym_ptr<uint64_t>(p, p.sym_off.combine_signal);
    for (int r = 0; r < p.world_size; ++r) wait_signal(p, signals + r, epoch, kPhaseCombineWait, r);
  }
  __syncthreads();
}

}  // namespace flashmoe
