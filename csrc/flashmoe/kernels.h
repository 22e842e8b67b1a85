// The megakernel, one per weight format, each defined in its own translation unit (csrc/kernel_bf16.cu,
// csrc/kernel_fp8.cu) so that each is compiled in the mode it is fastest in (plugin/flashmoe/build/recipe.py),
// and the host-side copy of each one's trace buffers (trace builds; the buffers are per translation unit).
#pragma once

#include "common.cuh"
#include "params.cuh"

namespace flashmoe {

__global__ void __launch_bounds__(kThreads, 1) moe_layer_bf16(const __grid_constant__ Params params);
__global__ void __launch_bounds__(kThreads, 1) moe_layer_fp8(const __grid_constant__ Params params);

void trace_copy_bf16(void* counts_host, void* events_host);
void trace_copy_fp8(void* counts_host, void* events_host);

}  // namespace flashmoe
