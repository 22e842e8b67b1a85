// The megakernel for block-fp8 weights (e4m3 with 128x128 block scales). The default build compiles it as a whole
// program (recipe.py), where it runs 1.00-1.06x faster than as relocatable device code (benchmarks/kernel-notes.md)
// and where alone ptxas honours setmaxnreg; the put build needs relocatable code for NVSHMEM's device library.
#include "flashmoe/kernels.h"
#include "flashmoe/moe_layer.cuh"

namespace flashmoe {

__global__ void __launch_bounds__(kThreads, 1) moe_layer_fp8(const __grid_constant__ Params params) {
  moe_layer<true>(params);
}

void trace_copy_fp8(void* counts_host, void* events_host) { copy_trace_buffers(counts_host, events_host); }

}  // namespace flashmoe
