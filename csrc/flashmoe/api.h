// Host API of the kernel library (compiled by nvcc), called by the torch bindings (compiled by the host
// compiler against torch headers). Plain types only, so the two halves build independently.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "contract.h"
#include "layout.cuh"

namespace flashmoe {

struct LaunchArgs {
  RuntimeArgs run;                                  // contract.h
  int num_tokens, hidden_size, intermediate_size, top_k, num_local;  // from the tensors' shapes
  bool fp8;                                          // w13/w2 e4m3 with block scales
  const void *x, *topk_ids, *topk_weights, *w13, *w2, *expert_rank, *expert_local;
  const void *w13_scale, *w2_scale;                 // fp8: fp32 [E_l, 2I/128, H/128], [E_l, H/128, I/128]
  void* out;
  const void* padding_marker;  // null, or int64 [>=1]: a negative first entry makes every token padding
  void* sym;        // this rank's symmetric region (nvshmem_malloc)
  void* workspace;  // local, zero-initialised once
  void* status;     // host-mapped Status
  void* metrics_ring;
  void* metrics_totals;
};

int64_t symmetric_bytes(const Capacity& c);
int64_t workspace_bytes(const Capacity& c);
int uniqueid_bytes();
void get_uniqueid(void* out);
// Initialise NVSHMEM over a unique id, or attach to an NVSHMEM another library initialised. Throws on error.
void nvshmem_setup(const void* uniqueid, int rank, int world_size);
int nvshmem_status();
void* symmetric_alloc(int64_t bytes);
void symmetric_free(void* p);
void barrier_all_on_stream(cudaStream_t stream);
int max_resident_blocks(int device);  // co-resident blocks of the kernel on this device
void launch(const LaunchArgs& args, const Capacity& cap, cudaStream_t stream);
std::string build_info();

// Trace builds (FLASHMOE_TRACE=1, trace.cuh): the last launch's event lists, copied to host memory of
// trace_blocks() * kTraceRoles counts (uint32) and as many lists of trace_events_per_list() 32-byte events.
// Throws in other builds.
bool trace_enabled();
int trace_blocks();
int trace_roles();
int trace_events_per_list();
void trace_copy(void* counts_host, void* events_host);

}  // namespace flashmoe
