// The contract between the Python package and the kernel library, defined once.
//
// Everything both sides must agree on lives here: the capacity the buffers are sized for, the runtime
// arguments of a call, the status record the kernel leaves in host memory, the phases it names, the metrics
// ring it writes, and the shape limits of the tiles. Python mirrors it in plugin/flashmoe/contract.py;
// tests/test_contract.py compiles this header on the host and fails if any name, order or value differs.
// Plain C++ (no CUDA types): the host compiler, nvcc and that test all read it.
#pragma once

#include <cstdint>

namespace flashmoe {

// ---- Capacity: what the process-wide buffers are sized for (the largest layer). Passed as int64 list.
#define FLASHMOE_CAPACITY_FIELDS(X) \
  X(max_tokens_per_rank)  /* tokens per rank per call */ \
  X(hidden_size)          /* largest H */ \
  X(intermediate_size)    /* largest I */ \
  X(top_k)                /* largest k */ \
  X(world_size)           /* EP size */ \
  X(max_local)            /* most experts on one rank */ \
  X(num_blocks)           /* persistent grid size */

struct Capacity {
#define FLASHMOE_DECLARE_FIELD(name) int64_t name;
  FLASHMOE_CAPACITY_FIELDS(FLASHMOE_DECLARE_FIELD)
#undef FLASHMOE_DECLARE_FIELD
};

// ---- Runtime arguments of one call beyond the tensors. Passed as int64 list.
#define FLASHMOE_RUNTIME_FIELDS(X) \
  X(rank)         /* this rank in the EP group */ \
  X(world_size)   /* EP size */ \
  X(num_experts)  /* E, global */ \
  X(force_put)    /* 1: NVSHMEM puts even to NVLink peers */ \
  X(node_size)    /* EP ranks per node (contiguous blocks): peers on other nodes get puts */ \
  X(layer_id)     /* row of the metrics totals */ \
  X(metrics)      /* 1: timestamps and counters into the metrics ring */ \
  X(num_blocks)   /* persistent grid size of this call */ \
  X(timeout_ns)   /* bound on every spin-wait */ \
  X(gemm0_max_splits)  /* 1..kMaxGemm0Splits: most K splits of a GEMM0 tile when tiles are fewer than blocks */

struct RuntimeArgs {
#define FLASHMOE_DECLARE_FIELD(name) int64_t name;
  FLASHMOE_RUNTIME_FIELDS(FLASHMOE_DECLARE_FIELD)
#undef FLASHMOE_DECLARE_FIELD
};

// ---- Status record in host-mapped memory (int64 words), read by Python without a device sync.
#define FLASHMOE_STATUS_FIELDS(X) \
  X(code)      /* StatusCode */ \
  X(rank)      /* rank that gave up */ \
  X(peer)      /* rank waited for, -1 for a grid barrier */ \
  X(phase)     /* Phase */ \
  X(detail)    /* barrier index, or -1 */ \
  X(epoch)     /* call sequence number of the failing call */ \
  X(observed)  /* last value read from the awaited word */ \
  X(block)     /* block that gave up first */

struct Status {
#define FLASHMOE_DECLARE_FIELD(name) int64_t name;
  FLASHMOE_STATUS_FIELDS(FLASHMOE_DECLARE_FIELD)
#undef FLASHMOE_DECLARE_FIELD
};

enum StatusCode : int64_t { kStatusOk = 0, kStatusTimeout = 1 };

// Phases named in timeout reports.
enum Phase : int {
  kPhaseNone = 0,
  kPhaseDispatchWait = 1,  // waiting for a source rank's dispatch signal
  kPhaseCombineWait = 2,   // waiting for a destination rank's combine rows (detail: the chunks expected)
  kPhaseGridBarrier = 3,   // waiting for the other blocks of this kernel
  kPhaseGemmPipeline = 4,  // a GEMM pipeline stage of this block never filled or drained (a kernel bug)
  kPhaseExpertReady = 5,   // an expert's GEMM0 tiles (other blocks of this kernel) never all finished (a kernel bug)
  kPhaseReleaseWait = 6,   // waiting for a destination rank to release the previous call's receive buffers
};

// ---- Metrics ring: one record of kRingFields int64 per call, slot = epoch % kRingSlots.
enum RingField : int {
  kRingSeq = 0,             // the call's epoch (> 0), written at its start; 0 = never written
  kRingLayerId = 1,
  kRingStartNs = 2,         // %globaltimer at kernel start
  kRingEndNs = 3,           // %globaltimer when the last block finished (a maximum over blocks)
  kRingBusyNs = 4,          // sum over blocks of the time each block did work
  kRingBlocksDone = 5,      // complete when == kRingNumBlocks
  kRingNumBlocks = 6,
  kRingTokensIn = 7,        // this rank's T
  kRingRowsDispatched = 8,  // token rows sent to ranks, this one included
  kRingRowsReceived = 9,
  kRingRemoteBytes = 10,    // bytes sent to other ranks, dispatch + combine
  kRingWorldSize = 11,
  // When the last block finished each phase (%globaltimer at its arrival at the grid barrier that closes the
  // phase; GEMM0: the last GEMM0 tile's end; GEMM1: the last block's end of its GEMM phase): where a call's time goes.
  kRingDispatchEndNs = 12,
  kRingReceiveEndNs = 13,   // calls that build their lists in every block: block 0's end (moe_layer.cuh)
  kRingGemm0EndNs = 14,     // the last GEMM0 tile (GEMM1 tiles of finished experts may already run)
  kRingGemm1EndNs = 15,     // every GEMM tile
};
constexpr int kRingSlots = 4096;
constexpr int kRingFields = 16;

// Exact per-layer counters: [kMaxLayers, kTotalsFields] int64.
enum TotalsField : int { kTotalCalls = 0, kTotalTokensIn = 1, kTotalRowsDispatched = 2, kTotalRemoteBytes = 3 };
constexpr int kTotalsFields = 4;
constexpr int kMaxLayers = 1024;

// ---- Shape limits.
constexpr int kHiddenMultiple = 128;  // GEMM1 output tile (features) and GEMM0's K step
constexpr int kInterMultiple = 64;    // GEMM0 output tile (features) and GEMM1's K step
constexpr int kMaxTopK = 16;          // expert lists pack the top-k slot into 4 bits
constexpr int kMaxLocalExperts = 512; // per-rank experts: the prefix tables live in shared memory
constexpr int kMaxWorld = 64;
constexpr int kMaxGemm0Splits = 4;    // small T: a GEMM0 tile's K over at most this many tasks

}  // namespace flashmoe
