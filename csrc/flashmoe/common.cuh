// Shared device-side types and PTX helpers for the flashmoe megakernel.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#ifndef FLASHMOE_STRESS_DELAY_NS
#define FLASHMOE_STRESS_DELAY_NS 0  // >0: test build that sleeps randomly before signals and waits
#endif

namespace flashmoe {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;     // 8 warps per block: the GEMM tile wants 2x4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopK = 16;      // expert lists pack the top-k slot j into 4 bits
constexpr int kMaxLocalExperts = 1024;  // per-rank experts; prefix sums live in shared memory
constexpr int kMaxWorld = 64;

// Phases named in timeout reports (keep in sync with plugin/flashmoe/megakernel.py PHASES).
enum Phase : int {
  kPhaseNone = 0,
  kPhaseDispatchWait = 1,   // waiting for a source rank's dispatch signal
  kPhaseCombineWait = 2,    // waiting for a destination rank's combine signal
  kPhaseGridBarrier = 3,    // waiting for the other blocks of this kernel
};

// Status record in host-mapped memory: Python reads it without synchronising the device.
struct Status {
  int64_t code;     // 0 ok, 1 timeout
  int64_t rank;
  int64_t peer;     // rank waited for (-1 for a grid barrier)
  int64_t phase;    // Phase
  int64_t detail;   // barrier index or expected count
  int64_t epoch;    // call sequence number of the failing call
  int64_t observed; // last value read from the awaited word
  int64_t block;    // block that gave up first
};

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// Loads that bypass L1: data written by other GPUs or other blocks in this launch.
__device__ __forceinline__ int ldcg(const int* p) { return __ldcg(p); }
__device__ __forceinline__ uint4 ldcg(const uint4* p) { return __ldcg(p); }

__device__ __forceinline__ void stress_delay(uint32_t salt) {
#if FLASHMOE_STRESS_DELAY_NS > 0
  uint32_t h = static_cast<uint32_t>(clock64()) * 2654435761u ^ (salt * 40503u) ^ (blockIdx.x * 97u);
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  __nanosleep(h % FLASHMOE_STRESS_DELAY_NS);
#else
  (void)salt;
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace flashmoe
