// Subscriber: turns signals from peers into work. After every source's dispatch signal for this call has
// arrived, the received metadata rows become per-expert lists of (row, top-k slot) entries; once every owner's
// arrival count matches what this rank sent it, the combine buffer is complete.
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

// Received row `received` (counted over the sources in order) -> its row in the receive area: source x
// max_tokens_per_rank + slot.
struct ReceivedRow {
  int64_t row;
  int source;
};
__device__ __forceinline__ ReceivedRow received_row(const Params& p, const Received& recv, int received) {
  int s = 0, slot = received;
  while (slot >= recv.rows[s]) slot -= recv.rows[s++];
  return {static_cast<int64_t>(s) * p.max_tokens_per_rank + slot, s};
}

// One list entry: the expert its top-k slot j names (negative: not a local expert), the entry (row, j) and its
// combine target (layout.cuh), whose token comes from the row's metadata (both loads in flight at once).
struct ListEntry {
  int local, entry, target;
};
__device__ __forceinline__ ListEntry list_entry(const Params& p, const int* meta, ReceivedRow r, int j) {
  const int* row_meta = meta + r.row * meta_stride(p.top_k);
  const int local = ldcg(row_meta + 1 + j);
  const int token = ldcg(row_meta);
  return {local, static_cast<int>(r.row << 4) | j, combine_target(r.source, token, p.top_k, j)};
}

// One thread per received (row, top-k slot): append the entry to its expert's list. Per entry, not per row, so
// no thread runs k dependent load -> atomic -> store chains in a row.
static __device__ void build_expert_lists(const Params& p, const Received& recv) {
  const int k = p.top_k;
  const int* meta = sym_ptr<int>(p, p.sym_off.recv_meta);
  uint32_t* expert_count = ws_ptr<uint32_t>(p, p.ws_off.expert_count);
  int* expert_rows = ws_ptr<int>(p, p.ws_off.expert_rows);
  int* targets = ws_ptr<int>(p, p.ws_off.combine_targets);
  const int entries = recv.total * k;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < entries; i += gridDim.x * blockDim.x) {
    const int received = i / k, j = i - received * k;
    const ListEntry e = list_entry(p, meta, received_row(p, recv, received), j);
    if (e.local < 0) continue;
    const int64_t at = static_cast<int64_t>(e.local) * p.expert_rows_stride + atomicAdd(expert_count + e.local, 1u);
    expert_rows[at] = e.entry;
    targets[at] = e.target;
  }
}

// Calls whose received entries (rows x top-k slots) fit kListRounds per thread of a block (decode: T <= 96 at top-8
// and world 1, ~26 per rank at EP4): every block builds the whole lists itself, in one order that does not depend
// on timing (by source, slot, top-k slot), and goes on to its GEMMs without waiting for the other blocks (the grid
// barrier after the list building of larger calls) or reading the counts back from L2.
constexpr int kListRounds = 2;
__device__ __forceinline__ bool lists_per_block(const Params& p, const Received& recv) {
  return recv.total * p.top_k <= kListRounds * kThreads;
}

// lists_per_block calls, every thread of every block: thread t takes entries r kThreads + t. An entry's place in its
// expert's list is the number of that expert's entries before it: in its warp by match, in earlier warps and
// rounds from `warp_counts` ([round][warp][expert] bytes of shared scratch, kListRounds x kWarps x num_local).
// Every block stores the same entries at the same places; its own stores are what its GEMM phase reads. The
// counts go to `count` (the block's expert table).
static __device__ void build_expert_lists_in_block(const Params& p, const Received& recv, int* count,
                                                   uint8_t* warp_counts) {
  const int k = p.top_k, entries = recv.total * k, num_local = p.num_local;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int* meta = sym_ptr<int>(p, p.sym_off.recv_meta);
  for (int i = threadIdx.x; i < kListRounds * kWarps * num_local; i += blockDim.x) warp_counts[i] = 0;
  ListEntry e[kListRounds];
  unsigned same[kListRounds];
#pragma unroll
  for (int r = 0; r < kListRounds; ++r) {  // every round's loads in flight at once
    const int i = r * kThreads + static_cast<int>(threadIdx.x);
    e[r] = ListEntry{-1, 0, 0};
    if (i < entries) {
      const int received = i / k, j = i - received * k;
      e[r] = list_entry(p, meta, received_row(p, recv, received), j);
    }
  }
#pragma unroll
  for (int r = 0; r < kListRounds; ++r) same[r] = __match_any_sync(0xffffffffu, e[r].local);
  __syncthreads();  // scratch zeroed
#pragma unroll
  for (int r = 0; r < kListRounds; ++r)
    if (e[r].local >= 0 && __ffs(same[r]) - 1 == lane)
      warp_counts[(r * kWarps + warp) * num_local + e[r].local] = static_cast<uint8_t>(__popc(same[r]));
  __syncthreads();
  int* lists = ws_ptr<int>(p, p.ws_off.expert_rows);
  int* targets = ws_ptr<int>(p, p.ws_off.combine_targets);
#pragma unroll
  for (int r = 0; r < kListRounds; ++r) {
    if (e[r].local < 0) continue;
    int pos = __popc(same[r] & ((1u << lane) - 1u));
    for (int w = 0; w < r * kWarps + warp; ++w) pos += warp_counts[w * num_local + e[r].local];
    const int64_t at = static_cast<int64_t>(e[r].local) * p.expert_rows_stride + pos;
    lists[at] = e[r].entry;
    targets[at] = e[r].target;
  }
  const int warps = ceil_div(entries, 32);  // warps (over all rounds) holding entries
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int c = 0;
    for (int w = 0; w < warps; ++w) c += warp_counts[w * num_local + e];
    count[e] = c;
  }
  __syncthreads();  // the counts and this block's list stores, before the table and the GEMM phase read them
}

// Warp 1 of every block, after grid barrier 1 (every dispatch add is in): the (row, top-k slot) entries this rank
// sent each destination (dispatch.cuh), whose rows wait_combine waits to see written back. Read before the block's
// GEMM phase ends: the last block to end it resets the counts for the next call (moe_layer.cuh finish_gemm_phase).
static __device__ void read_sent_entries(const Params& p, uint32_t* entries) {
  if ((threadIdx.x >> 5) != 1) return;
  const unsigned long long* send_count = ws_ptr<unsigned long long>(p, p.ws_off.rank_send_count);
  for (int r = threadIdx.x & 31; r < p.world_size; r += 32)
    entries[r] = static_cast<uint32_t>(__ldcg(send_count + r) >> 32);
}

// Warp 0 of every block waits until each destination has written back all H features of every entry this rank
// sent it (lane r: destination r; its count of 16-byte chunks, comm.cuh). A timeout is recorded, not returned: the
// block runs on and Python raises.
static __device__ void wait_combine(const Params& p, uint32_t epoch, const uint32_t* sent_entries) {
  if (threadIdx.x < 32) {
    const uint64_t* arrivals = sym_ptr<uint64_t>(p, p.sym_off.combine_arrivals);
    for (int r = threadIdx.x; r < p.world_size; r += 32) {
      const uint64_t expected = static_cast<uint64_t>(sent_entries[r]) * (p.hidden_size / kCombineChunkFeatures);
      if (expected != 0) wait_count(p, arrivals + r, expected, epoch, kPhaseCombineWait, r);
    }
  }
  __syncthreads();
}

}  // namespace flashmoe
