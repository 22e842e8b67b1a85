// In-kernel metrics: one record per call in the metrics ring (fields in contract.h) and exact per-layer totals.
// Graph-safe: nothing waits for the host. With metrics off nothing here runs and no timer is read.
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

// What a block counts for its metrics record, in shared memory rather than in registers: in the whole-program
// fp8 kernel, values live from dispatch to the end take registers from every phase between, the GEMM phase's
// included. Kept in registers they spilled (208 bytes of spill stores, 92 now), and the fp8 layer was 1-3% slower
// (benchmarks/kernel-notes.md, twenty-fifth session). Zeroed before the first __syncthreads; the time fields are
// thread 0's.
struct BlockMetrics {
  unsigned long long busy_ns, since_ns;  // busy time of the block (work, not waiting), the open interval's start
  unsigned long long rows_sent;          // token-rank rows this block dispatched
  unsigned long long remote_bytes;       // bytes this block sent to other ranks
  __device__ void zero() { busy_ns = since_ns = rows_sent = remote_bytes = 0; }
};
__device__ __forceinline__ void busy_start(const Params& p, BlockMetrics& m) {
  if (p.metrics && threadIdx.x == 0) m.since_ns = globaltimer_ns();
}
__device__ __forceinline__ void busy_stop(const Params& p, BlockMetrics& m) {
  if (p.metrics && threadIdx.x == 0) m.busy_ns += globaltimer_ns() - m.since_ns;
}
// Any thread: add to a count (shared-memory atomics; nothing with metrics off or a zero count).
__device__ __forceinline__ void count_metric(const Params& p, unsigned long long& field, int64_t value) {
  if (p.metrics && value != 0) atomicAdd(&field, static_cast<unsigned long long>(value));
}

__device__ __forceinline__ int64_t* ring_record(const Params& p, uint32_t epoch) {
  return p.metrics_ring + static_cast<int64_t>(epoch % kRingSlots) * kRingFields;
}

// The calling thread finished a piece of a phase now: the record keeps the latest such time. A reduction (no value
// comes back, so the thread does not wait for it), from each GEMM0 tile's epilogue and each block's GEMM end.
__device__ __forceinline__ void mark_time(const Params& p, uint32_t epoch, RingField field) {
  if (p.metrics)
    atomicMax(reinterpret_cast<unsigned long long*>(ring_record(p, epoch)) + field,
              static_cast<unsigned long long>(globaltimer_ns()));
}

// Where the grid barrier that closes a phase stores the phase's end (comm.cuh: the last block to arrive
// writes its arrival time there), or nullptr with metrics off.
__device__ __forceinline__ int64_t* phase_end_field(const Params& p, uint32_t epoch, RingField field) {
  return p.metrics ? ring_record(p, epoch) + field : nullptr;
}

// Block 0, thread 0, at kernel start: the record is incomplete (seq 0) until the last block publishes it.
static __device__ void open_record(const Params& p, uint32_t epoch, uint64_t start_ns, int tokens_in) {
  int64_t* rec = ring_record(p, epoch);
  // The phase-end fields are not cleared: other blocks may already have marked this call's dispatch end, and
  // what the slot held (a call kRingSlots earlier) is older than any time of this call, so atomicMax is right.
  for (int f = 0; f < kRingDispatchEndNs; ++f) rec[f] = 0;
  rec[kRingLayerId] = p.layer_id;
  rec[kRingStartNs] = static_cast<int64_t>(start_ns);
  rec[kRingNumBlocks] = gridDim.x;
  rec[kRingTokensIn] = tokens_in;
  rec[kRingWorldSize] = p.world_size;
  rec[kRingSeq] = epoch;  // the record is complete once every block has counted itself (kRingBlocksDone)
  // No fence: every block's count (publish_metrics) follows grid barrier 1, whose fences order these stores first.
}

// Thread 0 of every block, at its end; the kernel ends with the last of these. All of a block's atomics go
// to the record's one cache line or the layer's totals, where they serialise with every other block's, so
// each block adds only what it has (rows and bytes are zero for most blocks at small T). None returns a value,
// so no block waits for a round trip here: each adds its end time as a maximum, fences its adds, and counts
// itself; the record is complete when the count reaches the number of blocks (metrics/ring.py checks that).
static __device__ void publish_metrics(const Params& p, uint32_t epoch, uint64_t busy_ns, int64_t rows_sent,
                                int64_t remote_bytes, int rows_received, int tokens_in) {
  int64_t* rec = ring_record(p, epoch);
  unsigned long long* u = reinterpret_cast<unsigned long long*>(rec);
  unsigned long long* totals =
      reinterpret_cast<unsigned long long*>(p.metrics_totals) + static_cast<int64_t>(p.layer_id) * kTotalsFields;
  atomicAdd(u + kRingBusyNs, static_cast<unsigned long long>(busy_ns));
  if (rows_sent) {
    atomicAdd(u + kRingRowsDispatched, static_cast<unsigned long long>(rows_sent));
    atomicAdd(totals + kTotalRowsDispatched, static_cast<unsigned long long>(rows_sent));
  }
  if (remote_bytes) {
    atomicAdd(u + kRingRemoteBytes, static_cast<unsigned long long>(remote_bytes));
    atomicAdd(totals + kTotalRemoteBytes, static_cast<unsigned long long>(remote_bytes));
  }
  if (blockIdx.x == 0) {
    rec[kRingRowsReceived] = rows_received;
    atomicAdd(totals + kTotalCalls, 1ull);
    atomicAdd(totals + kTotalTokensIn, static_cast<unsigned long long>(tokens_in));
  }
  atomicMax(u + kRingEndNs, static_cast<unsigned long long>(globaltimer_ns()));
  __threadfence();  // this block's adds before its count: a complete record has every block's
  atomicAdd(u + kRingBlocksDone, 1ull);
}

}  // namespace flashmoe
