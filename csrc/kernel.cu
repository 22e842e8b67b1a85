// The flashmoe megakernel: one persistent, cooperative launch per MoE layer call.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <stdexcept>
#include <string>

#include "flashmoe/api.h"
#include "flashmoe/kernels.h"
#include "flashmoe/moe_layer.cuh"

namespace flashmoe {

namespace {

// One kernel per weight format: bf16, and block-fp8 (e4m3 weights with 128x128 block scales); kernels.h.
using KernelFn = void (*)(Params);
KernelFn kernel_for(bool fp8) { return fp8 ? moe_layer_fp8 : moe_layer_bf16; }
bool last_launch_fp8 = false;  // whose trace buffers trace_copy reads

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("flashmoe: ") + what + ": " + cudaGetErrorString(err));
}

int smem_bytes() { return kGemmSmemBytes; }

// cuTensorMapEncodeTiled through the runtime's driver entry point: the library links without -lcuda.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found),
          "driver entry point cuTensorMapEncodeTiled");
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw std::runtime_error("flashmoe: the driver has no cuTensorMapEncodeTiled (needs CUDA 12+ driver)");
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A tile map of bf16 or one-byte (e4m3) elements with the 128-byte swizzle the wgmma descriptors expect.
// dims/strides: innermost first, strides in bytes for dims 1.. .
template <int Rank>
CUtensorMap tile_map(bool fp8, const void* base, const cuuint64_t (&dims)[Rank], const cuuint64_t (&strides)[Rank - 1],
                     const cuuint32_t (&box)[Rank], const char* what) {
  CUtensorMap map;
  cuuint32_t unit[Rank];
  for (int i = 0; i < Rank; ++i) unit[i] = 1;
  const CUtensorMapDataType type = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_tiled()(&map, type, Rank, const_cast<void*>(base), dims, strides,
                                    box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("flashmoe: cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                             std::to_string(static_cast<int>(r)) + ")");
  return map;
}

// w13 [E_l, 2I, H] as [E_l][I/8][2][8][H] (dims innermost first: k, row in group, gate/up, group, expert;
// the gate/up stride I*H is larger than the group stride 8*H, which TMA allows). One box (128 bytes of k,
// 8 rows, gate+up, 8 groups) is a whole 16 KiB stage: for each of 8 groups of 8 features, their 8 gate rows
// then their 8 up rows, the row order store_swiglu expects.
CUtensorMap w13_map(bool fp8, const void* w13, int num_local, int hidden_size, int intermediate_size) {
  const cuuint64_t H = hidden_size, I = intermediate_size, bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[5] = {H, 8, 2, I / 8, static_cast<cuuint64_t>(num_local)};
  const cuuint64_t strides[4] = {H * bytes, I * H * bytes, 8 * H * bytes, 2 * I * H * bytes};
  const cuuint32_t box[5] = {static_cast<cuuint32_t>(tile_k(fp8)), 8, 2, kGemm0TileFeatures / 8, 1};
  return tile_map<5>(fp8, w13, dims, strides, box, "w13");
}

// w2 [E_l, H, I] as [E_l H / 8][8][I]: one box (128 bytes of k, 8 rows, 16 row groups) is the 128 output-feature
// rows of a GEMM1 tile, in the same shared-memory order as a 2-D box of 128 rows. The 3-D view streams faster:
// one SM pulled 101 GB/s through it against 64 GB/s through the 128-row 2-D box
// (benchmarks/results/2026-11-22-h200x1-tma-stream-per-sm.txt), which bounds a GEMM1 tile when HBM is not busy.
CUtensorMap w2_map(bool fp8, const void* w2, int num_local, int hidden_size, int intermediate_size) {
  const cuuint64_t I = intermediate_size, bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[3] = {I, 8, static_cast<cuuint64_t>(num_local) * hidden_size / 8};
  const cuuint64_t strides[2] = {I * bytes, 8 * I * bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(tile_k(fp8)), 8, kTileWeightRows / 8};
  return tile_map<3>(fp8, w2, dims, strides, box, "w2");
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("flashmoe: " + msg);
}

// Where each rank's symmetric heap is for this GPU: NVLink stores within our node (even where NVSHMEM maps a
// peer on another one: FLASHMOE_NODE_SIZE simulates nodes on one host), null (NVSHMEM puts) elsewhere or for
// every peer under force_put. A build without device puts (comm.cuh) cannot serve a null entry.
void peer_table(const RuntimeArgs& run, void* sym, char* (&peer_sym)[kMaxWorld]) {
  for (int r = 0; r < run.world_size; ++r) {
    const bool same_node = r / run.node_size == run.rank / run.node_size;
    char* mapped = static_cast<char*>(nvshmem_ptr(sym, r));
    peer_sym[r] = run.force_put || !same_node ? nullptr : mapped;
    if (peer_sym[r] == nullptr && !kDevicePuts)
      throw std::invalid_argument(
          "flashmoe: rank " + std::to_string(r) + " is reached by NVSHMEM puts (" +
          (run.force_put ? std::string("FLASHMOE_FORCE_PUT") : !same_node ? std::string("another node")
                                                                          : std::string("not mapped by NVSHMEM")) +
          "), which this library was built without; flashmoe loads its put build for such layers");
  }
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

// The put build links NVSHMEM's device library, whose init entry point also installs this library's copy of
// the device state; the default build has no device state and initialises the host library alone.
int init_nvshmem(unsigned flags, nvshmemx_init_attr_t* attr) {
#if FLASHMOE_DEVICE_PUTS
  return nvshmemx_init_attr(flags, attr);
#else
  return nvshmemx_hostlib_init_attr(flags, attr);
#endif
}

void nvshmem_setup(const void* uniqueid, int rank, int world_size) {
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    // Another library (e.g. torch symmetric memory, or our other build) initialised NVSHMEM. The put build
    // registers its device state with the running host library (an init call on an initialised library only
    // does that); the default build has none to register.
    if (kDevicePuts) init_nvshmem(0, nullptr);
  } else {
    nvshmemx_uniqueid_t id;
    memcpy(&id, uniqueid, sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, world_size, &id, &attr) != 0)
      throw std::runtime_error("flashmoe: nvshmemx_set_attr_uniqueid_args failed");
    if (init_nvshmem(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
      throw std::runtime_error("flashmoe: NVSHMEM initialisation failed");
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != world_size)
    throw std::runtime_error("flashmoe: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + "/" +
                             std::to_string(nvshmem_n_pes()) + " does not match EP rank " + std::to_string(rank) +
                             "/" + std::to_string(world_size) +
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
  int per_sm = 0, per_sm_fp8 = 0, sms = 0;
  check(cudaFuncSetAttribute(kernel_for(false), cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes()),
        "cudaFuncSetAttribute");
  check(cudaFuncSetAttribute(kernel_for(true), cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes()),
        "cudaFuncSetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(false), kThreads, smem_bytes()),
        "occupancy query");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_fp8, kernel_for(true), kThreads, smem_bytes()),
        "occupancy query");
  if (per_sm_fp8 < per_sm) per_sm = per_sm_fp8;  // one grid size serves both formats
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return per_sm * sms;
}

void launch(const LaunchArgs& a, const Capacity& cap, cudaStream_t stream) {
  require(reinterpret_cast<uintptr_t>(a.w13) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w2) % 16 == 0,
          "w13 and w2 must be 16-byte aligned (TMA)");
  require(a.num_tokens >= 0 && a.num_tokens <= cap.max_tokens_per_rank,
          "num_tokens " + std::to_string(a.num_tokens) + " exceeds capacity " + std::to_string(cap.max_tokens_per_rank));
  require(a.hidden_size <= cap.hidden_size && a.intermediate_size <= cap.intermediate_size && a.top_k <= cap.top_k && a.num_local <= cap.max_local,
          "layer shape exceeds the buffers' capacity");
  require(a.run.world_size == cap.world_size && a.run.world_size <= kMaxWorld, "world size mismatch with the buffers");
  require(packed_entries_fit(cap), "capacity too large for the expert lists' 32-bit entries: world_size x "
                                  "max_tokens_per_rank must stay below 2^27 and max_tokens_per_rank x top_k below 2^25");
  require(a.run.node_size >= 1 && a.run.world_size % a.run.node_size == 0, "node_size must divide the world size");
  require(a.hidden_size % kHiddenMultiple == 0 && a.intermediate_size % kInterMultiple == 0,
          "hidden must be a multiple of " + std::to_string(kHiddenMultiple) + " and intermediate of " +
              std::to_string(kInterMultiple));
  require(a.top_k >= 1 && a.top_k <= kMaxTopK, "top_k out of range");
  if (a.fp8) {
    require(a.hidden_size % kFp8Group == 0 && a.intermediate_size % kFp8Group == 0,
            "fp8 layers need hidden and intermediate sizes that are multiples of " + std::to_string(kFp8Group));
    require(a.w13_scale != nullptr && a.w2_scale != nullptr, "fp8 layers need w13_scale_inv and w2_scale_inv");
  }
  require(a.num_local >= 1 && a.num_local <= kMaxLocalExperts, "local expert count out of range");
  require(a.run.num_blocks >= 1 && a.run.num_blocks <= cap.num_blocks, "num_blocks exceeds capacity");
  require(a.run.gemm0_max_splits >= 1 && a.run.gemm0_max_splits <= kMaxGemm0Splits,
          "gemm0_max_splits must be 1.." + std::to_string(kMaxGemm0Splits));

  Params p{};
  p.num_tokens = a.num_tokens;
  p.hidden_size = a.hidden_size;
  p.intermediate_size = a.intermediate_size;
  p.top_k = a.top_k;
  p.num_experts = a.run.num_experts;
  p.num_local = a.num_local;
  p.rank = a.run.rank;
  p.world_size = a.run.world_size;
  p.max_tokens_per_rank = static_cast<int>(cap.max_tokens_per_rank);
  p.layer_id = a.run.layer_id;
  p.metrics = a.run.metrics;
  p.gemm0_max_splits = static_cast<int>(a.run.gemm0_max_splits);
  p.timeout_ns = static_cast<uint64_t>(a.run.timeout_ns);
  p.x = static_cast<const bf16*>(a.x);
  p.topk_ids = static_cast<const int*>(a.topk_ids);
  p.topk_weights = static_cast<const float*>(a.topk_weights);
  p.w13 = a.w13;
  p.w2 = a.w2;
  p.w13_scale = static_cast<const float*>(a.w13_scale);
  p.w2_scale = static_cast<const float*>(a.w2_scale);
  p.expert_rank = static_cast<const int*>(a.expert_rank);
  p.expert_local = static_cast<const int*>(a.expert_local);
  p.out = static_cast<bf16*>(a.out);
  p.padding_marker = static_cast<const int64_t*>(a.padding_marker);
  p.sym = static_cast<char*>(a.sym);
  peer_table(a.run, a.sym, p.peer_sym);
  p.sym_off = sym_layout(cap);
  p.ws = static_cast<char*>(a.workspace);
  p.ws_off = workspace_layout(cap);
  p.expert_rows_stride = cap.world_size * cap.max_tokens_per_rank;
  p.status = static_cast<Status*>(a.status);
  p.metrics_ring = static_cast<int64_t*>(a.metrics_ring);
  p.metrics_totals = static_cast<int64_t*>(a.metrics_totals);
  p.tmap_w13 = w13_map(a.fp8, a.w13, a.num_local, a.hidden_size, a.intermediate_size);
  p.tmap_w2 = w2_map(a.fp8, a.w2, a.num_local, a.hidden_size, a.intermediate_size);

  const KernelFn kernel = kernel_for(a.fp8);
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes()),
        "cudaFuncSetAttribute");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(a.run.num_blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes();
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // the driver refuses a grid that cannot be co-resident
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  check(cudaLaunchKernelEx(&config, kernel, p), "cooperative launch of the megakernel");
  last_launch_fp8 = a.fp8;
}

bool trace_enabled() { return FLASHMOE_TRACE != 0; }
int trace_blocks() { return kTraceMaxBlocks; }
int trace_roles() { return kTraceRoles; }
int trace_events_per_list() { return kTraceMaxEvents; }

void trace_copy(void* counts_host, void* events_host) {
  if (last_launch_fp8) trace_copy_fp8(counts_host, events_host);
  else trace_copy_bf16(counts_host, events_host);
}

std::string build_info() {
  const auto stages = [](bool fp8) {
    return std::to_string(stages_for(kDecodeTileTokens, fp8)) + "/" + std::to_string(stages_for(32, fp8)) + "/" +
           std::to_string(stages_for(64, fp8)) + "/" + std::to_string(stages_for(128, fp8));
  };
  const std::string widths = std::to_string(kDecodeTileTokens) + "/32/64/128";
  return std::string("flashmoe megakernel: wgmma swap-AB, ") + std::to_string(kTileWeightRows) + " weight rows x " +
         widths + " tokens x " + std::to_string(kTileK) + " k bf16 (" + stages(false) + " TMA stages) or x " + widths +
         " tokens x " + std::to_string(kTileKFp8) + " k block-fp8 (" + stages(true) + " stages, " +
         std::to_string(stage_k_steps(kDecodeTileTokens, true)) + " k steps each at " +
         std::to_string(kDecodeTileTokens) + " tokens; 128 tokens token-major), dynamic task queue, stress_delay_ns=" +
         std::to_string(FLASHMOE_STRESS_DELAY_NS) +
         (FLASHMOE_TRACE ? ", trace" : "") + (kDevicePuts ? ", device puts" : ", NVLink stores only") + ", NVSHMEM " +
         std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." + std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

}  // namespace flashmoe
