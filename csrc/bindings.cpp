// torch.ops.flashmoe.* (torch.ops.flashmoe_stress.* / flashmoe_trace.* for the stress and trace builds): thin wrappers over api.h.
// The CUDA stream comes from Python (torch.cuda.current_stream().cuda_stream) so this file needs no
// CUDA-specific torch headers and compiles against a CPU-only torch (CI's compile check).
#include <cuda_runtime.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "flashmoe/api.h"

#ifndef FLASHMOE_OPS
#define FLASHMOE_OPS flashmoe
#endif

namespace {

using flashmoe::Capacity;
using flashmoe::RuntimeArgs;

// The field lists come from contract.h; Python builds the lists from the same names in the same order. Both
// structs are int64 fields only, so a list in field order is the struct's bytes.
#define FLASHMOE_NAME_FIELD(name) #name " "

template <typename Struct>
Struct from_list(const std::vector<int64_t>& v, const char* what, const char* names) {
  static_assert(std::is_standard_layout_v<Struct> && sizeof(Struct) % sizeof(int64_t) == 0);
  constexpr size_t n = sizeof(Struct) / sizeof(int64_t);
  TORCH_CHECK(v.size() == n, what, " must be [ ", names, "], got ", v.size(), " values");
  Struct s{};
  std::memcpy(&s, v.data(), sizeof(Struct));
  return s;
}

Capacity to_capacity(const std::vector<int64_t>& v) {
  return from_list<Capacity>(v, "capacity", FLASHMOE_CAPACITY_FIELDS(FLASHMOE_NAME_FIELD));
}

RuntimeArgs to_runtime(const std::vector<int64_t>& v) {
  return from_list<RuntimeArgs>(v, "runtime", FLASHMOE_RUNTIME_FIELDS(FLASHMOE_NAME_FIELD));
}

std::vector<int64_t> capacity_bytes(std::vector<int64_t> cap) {
  const Capacity c = to_capacity(cap);
  return {flashmoe::symmetric_bytes(c), flashmoe::workspace_bytes(c)};
}

at::Tensor uniqueid() {
  auto out = at::empty({flashmoe::uniqueid_bytes()}, at::TensorOptions().dtype(at::kByte));
  flashmoe::get_uniqueid(out.data_ptr());
  return out;
}

void nvshmem_setup(const at::Tensor& uid, int64_t rank, int64_t world_size) {
  TORCH_CHECK(uid.device().is_cpu() && uid.scalar_type() == at::kByte && uid.numel() == flashmoe::uniqueid_bytes(),
              "unique id must be a CPU uint8 tensor of ", flashmoe::uniqueid_bytes(), " bytes");
  flashmoe::nvshmem_setup(uid.contiguous().data_ptr(), static_cast<int>(rank), static_cast<int>(world_size));
}

int64_t nvshmem_status() { return flashmoe::nvshmem_status(); }
int64_t uniqueid_bytes() { return flashmoe::uniqueid_bytes(); }
int64_t symmetric_alloc(int64_t bytes) { return reinterpret_cast<int64_t>(flashmoe::symmetric_alloc(bytes)); }
void symmetric_free(int64_t ptr) { flashmoe::symmetric_free(reinterpret_cast<void*>(ptr)); }
void barrier_all(int64_t stream) { flashmoe::barrier_all_on_stream(reinterpret_cast<cudaStream_t>(stream)); }
int64_t max_resident_blocks(int64_t device) { return flashmoe::max_resident_blocks(static_cast<int>(device)); }
std::string build_info() { return flashmoe::build_info(); }

// Trace builds: [counts int32 [blocks, roles], events int64 [blocks, roles, events, 4]] of the last launch
// (an event: global ns, SM clock, kind | a << 32, b | c << 32; trace.cuh).
std::vector<at::Tensor> trace_dump() {
  TORCH_CHECK(flashmoe::trace_enabled(), "not a trace build: set FLASHMOE_TRACE=1 before flashmoe loads its library");
  const int64_t blocks = flashmoe::trace_blocks(), roles = flashmoe::trace_roles();
  auto counts = at::empty({blocks, roles}, at::TensorOptions().dtype(at::kInt));
  auto events = at::empty({blocks, roles, flashmoe::trace_events_per_list(), 4}, at::TensorOptions().dtype(at::kLong));
  flashmoe::trace_copy(counts.data_ptr(), events.data_ptr());
  return {counts, events};
}

void check_cuda(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, name, " must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void moe_forward(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
                 const at::Tensor& w2, const std::optional<at::Tensor>& w13_scale,
                 const std::optional<at::Tensor>& w2_scale, const std::optional<at::Tensor>& padding_marker,
                 const at::Tensor& expert_rank, const at::Tensor& expert_local, at::Tensor& out,
                 const at::Tensor& workspace, const at::Tensor& status, const at::Tensor& metrics_ring,
                 const at::Tensor& metrics_totals, int64_t sym, std::vector<int64_t> capacity,
                 std::vector<int64_t> runtime, int64_t stream) {
  const auto dev = x.device();
  TORCH_CHECK(dev.is_cuda(), "x must be a CUDA tensor");
  check_cuda(x, "hidden_states", at::kBFloat16, dev);
  check_cuda(topk_ids, "topk_ids", at::kInt, dev);
  check_cuda(topk_weights, "topk_weights", at::kFloat, dev);
  // bf16 weights, or block-fp8: e4m3 weights with fp32 scales per 128x128 block (both or neither).
  const bool fp8 = w13.scalar_type() == at::kFloat8_e4m3fn;
  check_cuda(w13, "w13", fp8 ? at::kFloat8_e4m3fn : at::kBFloat16, dev);
  check_cuda(w2, "w2", w13.scalar_type(), dev);
  TORCH_CHECK(fp8 == (w13_scale.has_value() && w2_scale.has_value()) && w13_scale.has_value() == w2_scale.has_value(),
              fp8 ? "fp8 weights need w13_scale_inv and w2_scale_inv" : "scales are for fp8 (float8_e4m3fn) weights");
  if (padding_marker.has_value()) {
    check_cuda(*padding_marker, "padding_marker", at::kLong, dev);
    TORCH_CHECK(padding_marker->numel() >= 1, "padding_marker must have at least one element");
  }
  check_cuda(expert_rank, "expert_rank", at::kInt, dev);
  check_cuda(expert_local, "expert_local", at::kInt, dev);
  check_cuda(out, "out", at::kBFloat16, dev);
  check_cuda(workspace, "workspace", at::kByte, dev);
  check_cuda(metrics_ring, "metrics_ring", at::kLong, dev);
  check_cuda(metrics_totals, "metrics_totals", at::kLong, dev);
  constexpr int64_t status_words = sizeof(flashmoe::Status) / sizeof(int64_t);
  TORCH_CHECK(status.is_pinned() && status.scalar_type() == at::kLong && status.numel() >= status_words,
              "status must be a pinned int64 host tensor of ", status_words, "+ elements");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "out must have the shape of hidden_states");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 and w2 must be 3-D");
  if (fp8) {
    check_cuda(*w13_scale, "w13_scale_inv", at::kFloat, dev);
    check_cuda(*w2_scale, "w2_scale_inv", at::kFloat, dev);
    constexpr int64_t block = 128;
    TORCH_CHECK(w13_scale->sizes() == at::IntArrayRef({w13.size(0), w13.size(1) / block, w13.size(2) / block}),
                "w13_scale_inv must be [E_local, 2I/128, H/128]");
    TORCH_CHECK(w2_scale->sizes() == at::IntArrayRef({w2.size(0), w2.size(1) / block, w2.size(2) / block}),
                "w2_scale_inv must be [E_local, H/128, I/128]");
  }
  const Capacity cap = to_capacity(capacity);
  TORCH_CHECK(workspace.numel() >= flashmoe::workspace_bytes(cap), "workspace too small for the capacity");

  flashmoe::LaunchArgs a{};
  a.num_tokens = static_cast<int>(x.size(0));
  a.hidden_size = static_cast<int>(x.size(1));
  a.intermediate_size = static_cast<int>(w2.size(2));
  a.top_k = static_cast<int>(topk_ids.size(1));
  a.num_local = static_cast<int>(w13.size(0));
  a.run = to_runtime(runtime);
  a.x = x.data_ptr();
  a.topk_ids = topk_ids.data_ptr();
  a.topk_weights = topk_weights.data_ptr();
  a.fp8 = fp8;
  a.w13 = w13.data_ptr();
  a.w2 = w2.data_ptr();
  a.w13_scale = fp8 ? w13_scale->data_ptr() : nullptr;
  a.w2_scale = fp8 ? w2_scale->data_ptr() : nullptr;
  a.expert_rank = expert_rank.data_ptr();
  a.expert_local = expert_local.data_ptr();
  a.out = out.data_ptr();
  a.padding_marker = padding_marker.has_value() ? padding_marker->data_ptr() : nullptr;
  a.sym = reinterpret_cast<void*>(sym);
  a.workspace = workspace.data_ptr();
  a.status = status.data_ptr();
  a.metrics_ring = metrics_ring.data_ptr();
  a.metrics_totals = metrics_totals.data_ptr();
  int current = -1;
  cudaGetDevice(&current);
  TORCH_CHECK(current == dev.index(), "current CUDA device ", current, " is not the tensors' device ", dev);
  flashmoe::launch(a, cap, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace

TORCH_LIBRARY(FLASHMOE_OPS, m) {
  m.def("capacity_bytes(int[] capacity) -> int[]", &capacity_bytes);
  m.def("uniqueid() -> Tensor", &uniqueid);
  m.def("nvshmem_setup(Tensor uniqueid, int rank, int world_size) -> ()", &nvshmem_setup);
  m.def("nvshmem_status() -> int", &nvshmem_status);
  m.def("uniqueid_bytes() -> int", &uniqueid_bytes);
  m.def("symmetric_alloc(int bytes) -> int", &symmetric_alloc);
  m.def("symmetric_free(int ptr) -> ()", &symmetric_free);
  m.def("barrier_all(int stream) -> ()", &barrier_all);
  m.def("max_resident_blocks(int device) -> int", &max_resident_blocks);
  m.def("build_info() -> str", &build_info);
  m.def("trace_dump() -> Tensor[]", &trace_dump);
  m.def(
      "moe_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
      "Tensor? w13_scale_inv, Tensor? w2_scale_inv, Tensor? padding_marker, Tensor expert_rank, Tensor expert_local, Tensor(a!) out, Tensor workspace, Tensor status, "
      "Tensor metrics_ring, Tensor metrics_totals, int sym, int[] capacity, int[] runtime, int stream) -> ()",
      &moe_forward);
}
