// Tile-level timeline of one launch, for profiling builds only (FLASHMOE_TRACE=1 builds the `trace` variant;
// in every other build the calls below compile to nothing).
//
// Three threads of each block keep their own event list: thread 0 (the phases, and the GEMM producer),
// thread 128 and thread 256 (the two consumer warpgroups' leaders). An event is the global timer (ns, comparable
// across SMs), the SM's cycle counter (finer, for durations inside a block) and three words. Every launch
// overwrites the lists; `trace_dump` copies the last launch's out (bindings). Tools: scripts/kernel_trace.py.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common.cuh"

#ifndef FLASHMOE_TRACE
#define FLASHMOE_TRACE 0
#endif

namespace flashmoe {

enum TraceKind : uint32_t {
  // thread 0: phases (a: epoch)
  kTraceStart = 0,
  kTraceDispatchDone = 1,
  kTraceBarrier1Done = 2,
  kTraceReceiveWaitDone = 3,
  kTraceReceiveDone = 4,
  kTraceBarrier2Done = 5,
  kTraceGemmStart = 6,
  kTraceGemmDone = 7,
  kTraceGemmCounted = 8,  // finish_gemm_phase: the block's arrival counts sent (and, last block, the release)
  kTraceCombineWaitDone = 9,
  kTraceEnd = 10,
  // producer (thread 0) per task: a = task index, b = gemm << 24 | expert, c = feature tile << 16 | N << 8 | rows
  kTraceProducerTask = 20,
  kTraceProducerReady = 21,      // rows located, GEMM1 readiness waited for
  kTraceProducerFirstIssue = 22, // first stage issued (its empty slot was free)
  kTraceProducerLastIssue = 23,  // last stage issued; a = cycles spent waiting for empty slots in this tile
  kTraceProducerSlotFree = 24,   // next_task: the task slot is free
  kTraceProducerIndex = 25,      // next_task: the task counter's value has arrived
  kTraceProducerPublished = 26,  // next_task: the index published to the block's other warps
  kTraceProducerDecoding = 27,   // the task's index back in produce_tasks, before decode_task
  kTraceProducerRowsLocated = 28,  // produce_tile (each pass): the tile's token row pointers located
  kTraceProducerFirstSlot = 29,    // produce_tile (each pass): the first stage's slot is free
  // consumer leaders per task: a = task index
  kTraceConsumerTask = 30,
  kTraceConsumerFirstFull = 31,  // first stage of the tile landed: clock, a | b << 32 = its global time (ns)
  kTraceConsumerMmaDone = 32,    // a = cycles spent waiting for full stages in this tile
  kTraceConsumerEpilogueDone = 33,
  kTraceConsumerSlotRead = 34,   // next_task: the published index was read
  kTraceConsumerCounted = 35,    // GEMM0 epilogue: the tile's completion counted (after the release fence)
  kTraceConsumerStaged = 36,     // epilogue: the consumer's sums are in its staging (wide GEMM0, every GEMM1)
  kTraceConsumerPlaced = 37,     // GEMM1 epilogue: each row's destination known (its combine target arrived)
  kTraceConsumerStored = 38,     // epilogue: the staged rows copied out to global memory
};

constexpr int kTraceRoles = 3;
constexpr int kTraceMaxBlocks = 160;   // >= SMs of an H100/H200 (one block per SM)
constexpr int kTraceMaxEvents = 1024;  // per role; later events of a launch are dropped

struct TraceEvent {
  uint64_t global_ns;
  uint64_t clock;
  uint32_t kind, a, b, c;
};
static_assert(sizeof(TraceEvent) == 32, "trace_dump's record size");

#if FLASHMOE_TRACE
// Per translation unit (static): each kernel's own (kernels.h), whether or not its unit is relocatable code.
static __device__ TraceEvent g_trace_events[kTraceMaxBlocks][kTraceRoles][kTraceMaxEvents];
static __device__ uint32_t g_trace_counts[kTraceMaxBlocks][kTraceRoles];  // events written by the last launch
__shared__ uint32_t trace_next[kTraceRoles];
#endif

// Host: this translation unit's trace buffers into host memory (kernel.cu trace_copy).
static inline void copy_trace_buffers(void* counts_host, void* events_host) {
#if FLASHMOE_TRACE
  const cudaError_t counts = cudaMemcpyFromSymbol(counts_host, g_trace_counts, sizeof(g_trace_counts));
  const cudaError_t events = cudaMemcpyFromSymbol(events_host, g_trace_events, sizeof(g_trace_events));
  if (counts != cudaSuccess || events != cudaSuccess)
    throw std::runtime_error(std::string("flashmoe: trace copy: ") +
                             cudaGetErrorString(counts != cudaSuccess ? counts : events));
#else
  (void)counts_host, (void)events_host;
  throw std::runtime_error("flashmoe: not a trace build (set FLASHMOE_TRACE=1 before the library loads)");
#endif
}

// Which list the calling thread writes, or -1.
__device__ __forceinline__ int trace_role() {
  return threadIdx.x == 0 ? 0 : threadIdx.x == 128 ? 1 : threadIdx.x == 256 ? 2 : -1;
}

// Thread 0 at kernel start, before the block's first __syncthreads.
__device__ __forceinline__ void trace_begin() {
#if FLASHMOE_TRACE
  if (threadIdx.x == 0)
    for (int r = 0; r < kTraceRoles; ++r) trace_next[r] = 0;
#endif
}

__device__ __forceinline__ void trace_at(uint32_t kind, uint64_t clock, uint32_t a = 0, uint32_t b = 0,
                                         uint32_t c = 0) {
#if FLASHMOE_TRACE
  const int role = trace_role();
  if (role < 0 || blockIdx.x >= kTraceMaxBlocks) return;
  const uint32_t n = trace_next[role];
  if (n >= kTraceMaxEvents) return;
  trace_next[role] = n + 1;
  g_trace_events[blockIdx.x][role][n] = TraceEvent{globaltimer_ns(), clock, kind, a, b, c};
  g_trace_counts[blockIdx.x][role] = n + 1;
#else
  (void)kind, (void)clock, (void)a, (void)b, (void)c;
#endif
}

__device__ __forceinline__ void trace(uint32_t kind, uint32_t a = 0, uint32_t b = 0, uint32_t c = 0) {
#if FLASHMOE_TRACE
  trace_at(kind, clock64(), a, b, c);
#else
  (void)kind, (void)a, (void)b, (void)c;
#endif
}

// Cycle counter for trace durations; 0 (and no instruction) in other builds.
__device__ __forceinline__ uint64_t trace_clock() {
#if FLASHMOE_TRACE
  return clock64();
#else
  return 0;
#endif
}

}  // namespace flashmoe
