// Shared device-side types and PTX helpers for the flashmoe megakernel.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "contract.h"

#ifndef FLASHMOE_STRESS_DELAY_NS
#define FLASHMOE_STRESS_DELAY_NS 0  // >0: test build that sleeps randomly before signals and waits
#endif

namespace flashmoe {

using bf16 = __nv_bfloat16;

// One producer warpgroup and two consumer warpgroups in the GEMM phases (gemm.cuh); every warp works in the
// dispatch, receive and combine phases.
constexpr int kThreads = 384;
constexpr int kWarps = kThreads / 32;

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

// Adds v to a word another GPU (or this one) waits on, releasing this thread's prior writes (and, through the
// barrier before it, its block's) at system scope; no value comes back, so the thread does not wait for it.
__device__ __forceinline__ void red_release_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A flag in shared memory between the warps of a block: release and acquire at block scope (no fence instruction;
// the asm's memory clobber also keeps the compiler from moving other accesses across it).
__device__ __forceinline__ void st_release_cta(int* p, int v) {
  asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v)
               : "memory");
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared.u32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p)))
               : "memory");
  return v;
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

// Fast division (2 ulp): IEEE division has a called slow path, and a call in the GEMM function serialises its
// wgmmas. exp(-x) overflowing to inf gives 1/inf = 0, so silu(-large) = -0 as it should.
__device__ __forceinline__ float silu(float x) { return x * __fdividef(1.0f, 1.0f + __expf(-x)); }

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// This warp's index among all warps of the grid, blocks fastest: the first items of a warp-per-item loop land
// on different SMs, so a decode call's few tokens still spread over the GPU.
__device__ __forceinline__ int grid_warp_index() { return (threadIdx.x >> 5) * gridDim.x + blockIdx.x; }

}  // namespace flashmoe
