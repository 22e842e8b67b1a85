// The megakernel for bf16 weights. Every build compiles it as relocatable device code (recipe.py): as a whole
// program, its mainloops inlined (gemm.cuh FLASHMOE_MAINLOOP), it ran 1.1-2.6x slower (benchmarks/kernel-notes.md).
#include "flashmoe/kernels.h"
#include "flashmoe/moe_layer.cuh"

namespace flashmoe {

__global__ void __launch_bounds__(kThreads, 1) moe_layer_bf16(const __grid_constant__ Params params) {
  moe_layer<false>(params);
}

void trace_copy_bf16(void* counts_host, void* events_host) { copy_trace_buffers(counts_host, events_host); }

}  // namespace flashmoe
