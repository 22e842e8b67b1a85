// Compile-only probe: does ptxas honour `setmaxnreg` in the megakernel's build mode? A kernel of 384 threads gets 168
// registers per thread; a warpgroup that raises its limit to 232 runs a function holding 200 live floats, once
// inlined and once `__noinline__` (the consumer mainloops are noinline functions, gemm.cuh). Compile with -Xptxas -v
// twice (twentieth session, nvcc 13.0):
//   nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -Xptxas -v benchmarks/experiments/setmaxnreg_rdc.cu
//     whole program: no spills anywhere, the noinline function included (its SASS uses registers up to R207);
//   ... -rdc=true (the JIT build's mode, which NVSHMEM's device library needs):
//     "(C7504) 'setmaxnreg' ignored to maintain compatibility across compilation units", and the noinline
//     function spills 840 bytes.
// So 256-token fp8 stages (128 accumulators + the promotion's per thread) need either a build without -rdc (the
// NVSHMEM device calls of the put path moved out of this kernel) or link-time optimisation (code=lto_90a; untested:
// this machine's nvlink could not load its LTO library).
#include <cstdint>

template <int R>
static __device__ __forceinline__ float heavy_inline(const float* __restrict__ in, int n) {
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = in[i];
  for (int k = 0; k < n; ++k)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = acc[i] * acc[(i + 1) % R] + in[k];
  float s = 0;
#pragma unroll
  for (int i = 0; i < R; ++i) s += acc[i];
  return s;
}
template <int R>
static __device__ __noinline__ float heavy(const float* __restrict__ in, int n) {
  return heavy_inline<R>(in, n);
}

// Consumers (warpgroups 1, 2) raise their limit to 232 and run the 200-float function; the producer lowers its to 40.
template <bool kNoinline>
__global__ void __launch_bounds__(384, 1) probe(const float* in, float* out, int n) {
  float s = 0;
  if (threadIdx.x >= 128) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    s = kNoinline ? heavy<200>(in, n) : heavy_inline<200>(in, n);
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
  }
  out[threadIdx.x] = s;
}
template __global__ void probe<true>(const float*, float*, int);
template __global__ void probe<false>(const float*, float*, int);
