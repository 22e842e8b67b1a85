// The flashmoe megakernel: one persistent, cooperative launch per MoE layer call.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <stdexcept>
#include <string>

#include "flashmoe/api.h"
#include "flashmoe/processor.cuh"

namespace flashmoe {

__global__ void __launch_bounds__(kThreads, 1) moe_layer_kernel(const __grid_constant__ Params params) {
  moe_layer(params);
}

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashmoe: ") + what + ": " + cudaGetErrorString(err));
}

int smem_bytes() { return kGemmSmemBytes; }

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("flashmoe: " + msg);
}

}  // namespace

int64_t symmetric_bytes(const Capacity& c) { return sym_layout(c).total; }
int64_t workspace_bytes(const Capacity& c) { return workspace_layout(c).total; }

int uniqueid_bytes() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

void get_uniqueid(void* out) {
  nvshmemx_uniqueid_t id;
  if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("flashmoe: nvshmemx_get_uniqueid failed");
  memcpy(out, &id, sizeof(id));
}

int nvshmem_status() { return nvshmemx_init_status(); }

void nvshmem_setup(const void* uniqueid, int rank, int world) {
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    // Another library (e.g. torch symmetric memory) initialised NVSHMEM: register this module's device state
    // with the running host library (an init call on an initialised library only does that).
    nvshmemx_init_attr(0, nullptr);
  } else {
    nvshmemx_uniqueid_t id;
    memcpy(&id, uniqueid, sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr) != 0)
      throw std::runtime_error("flashmoe: nvshmemx_set_attr_uniqueid_args failed");
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
      throw std::runtime_error("flashmoe: nvshmemx_init_attr failed");
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world)
    throw std::runtime_error("flashmoe: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + "/" +
                             std::to_string(nvshmem_n_pes()) + " does not match EP rank " + std::to_string(rank) +
                             "/" + std::to_string(world) +
                             " (NVSHMEM was initialised by another library over a different group)");
}

void* symmetric_alloc(int64_t bytes) {
  // Zeroed: every signal starts at epoch 0 (never signalled).
  void* p = nvshmem_calloc(1, static_cast<size_t>(bytes));
  if (p == nullptr) throw std::runtime_error("flashmoe: nvshmem_calloc of " + std::to_string(bytes) + " bytes failed");
  return p;
}

void symmetric_free(void* p) { nvshmem_free(p); }

void barrier_all_on_stream(cudaStream_t stream) { nvshmemx_barrier_all_on_stream(stream); }

int max_resident_blocks(int device) {
  int per_sm = 0, sms = 0;
  check(cudaFuncSetAttribute(moe_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes()),
        "cudaFuncSetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_layer_kernel, kThreads, smem_bytes()),
        "occupancy query");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return per_sm * sms;
}

void launch(const LaunchArgs& a, const Capacity& cap, cudaStream_t stream) {
  require(a.num_tokens >= 0 && a.num_tokens <= cap.max_tokens,
          "num_tokens " + std::to_string(a.num_tokens) + " exceeds capacity " + std::to_string(cap.max_tokens));
  require(a.hidden <= cap.hidden && a.inter <= cap.inter && a.top_k <= cap.top_k && a.num_local <= cap.max_local,
          "layer shape exceeds the buffers' capacity");
  require(a.world == cap.world && a.world <= kMaxWorld, "world size mismatch with the buffers");
  require(a.hidden % kBlockN == 0 && a.inter % (kBlockN / 2) == 0 && a.hidden % kBlockK == 0 && a.inter % kBlockK == 0,
          "hidden must be a multiple of 128 and intermediate of 64");
  require(a.top_k >= 1 && a.top_k <= kMaxTopK, "top_k out of range");
  require(a.num_local >= 1 && a.num_local <= kMaxLocalExperts, "local expert count out of range");
  require(a.num_blocks >= 1 && a.num_blocks <= cap.num_blocks, "num_blocks exceeds capacity");

  Params p{};
  p.num_tokens = a.num_tokens;
  p.hidden = a.hidden;
  p.inter = a.inter;
  p.top_k = a.top_k;
  p.num_experts = a.num_experts;
  p.num_local = a.num_local;
  p.rank = a.rank;
  p.world = a.world;
  p.max_tokens = static_cast<int>(cap.max_tokens);
  p.force_put = a.force_put;
  p.layer_id = a.layer_id;
  p.metrics = a.metrics;
  p.timeout_ns = a.timeout_ns;
  p.x = static_cast<const bf16*>(a.x);
  p.topk_ids = static_cast<const int*>(a.topk_ids);
  p.topk_weights = static_cast<const float*>(a.topk_weights);
  p.w13 = static_cast<const bf16*>(a.w13);
  p.w2 = static_cast<const bf16*>(a.w2);
  p.expert_rank = static_cast<const int*>(a.expert_rank);
  p.expert_local = static_cast<const int*>(a.expert_local);
  p.out = static_cast<bf16*>(a.out);
  p.sym = static_cast<char*>(a.sym);
  p.sym_off = sym_layout(cap);
  p.ws = static_cast<char*>(a.workspace);
  p.ws_off = workspace_layout(cap);
  p.expert_rows_stride = cap.world * cap.max_tokens;
  p.status = static_cast<Status*>(a.status);
  p.metrics_ring = static_cast<int64_t*>(a.metrics_ring);
  p.metrics_totals = static_cast<int64_t*>(a.metrics_totals);

  check(cudaFuncSetAttribute(moe_layer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes()),
        "cudaFuncSetAttribute");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(a.num_blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes();
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // the driver refuses a grid that cannot be co-resident
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  check(cudaLaunchKernelEx(&config, moe_layer_kernel, p), "cooperative launch of the megakernel");
}

std::string build_info() {
  return std::string("flashmoe megakernel: mma.sync bf16, tile ") + std::to_string(kBlockM) + "x" +
         std::to_string(kBlockN) + "x" + std::to_string(kBlockK) + ", " + std::to_string(kStages) +
         " stages, stress_delay_ns=" + std::to_string(FLASHMOE_STRESS_DELAY_NS) + ", NVSHMEM " +
         std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." + std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

}  // namespace flashmoe
