"""The Python side of ``csrc/flashmoe/contract.h``: what the package and the kernel library must agree on.

The header is the definition; this module mirrors it, and ``tests/test_contract.py`` compiles the header on
the host and fails if a name, an order or a value differs. Lists passed to ``torch.ops.flashmoe.moe_forward``
(capacity, runtime arguments) are built from the dataclasses below, whose field order is the header's.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

from .errors import FlashMoEError


@dataclass(frozen=True)
class Capacity:
    """What the process-wide buffers are sized for: the largest layer announced so far."""

    max_tokens_per_rank: int  # tokens per rank per call
    hidden_size: int  # largest H
    intermediate_size: int  # largest I
    top_k: int  # largest k
    world_size: int  # EP size
    max_local: int  # most experts on one rank
    num_blocks: int  # persistent grid size

    def as_list(self) -> list[int]:
        return list(astuple(self))

    def covers(self, other: Capacity) -> bool:
        return self.world_size == other.world_size and all(
            a >= b for a, b in zip(self.as_list(), other.as_list(), strict=True)
        )

    def union(self, other: Capacity) -> Capacity:
        if self.world_size != other.world_size:
            raise FlashMoEError(
                f"one process serves one EP group: world size {self.world_size} vs {other.world_size}"
            )
        return Capacity(*(max(a, b) for a, b in zip(self.as_list(), other.as_list(), strict=True)))


@dataclass(frozen=True)
class RuntimeArgs:
    """The arguments of one call beyond its tensors."""

    rank: int
    world_size: int
    num_experts: int  # E, global
    force_put: int  # 1: NVSHMEM puts even to NVLink peers
    node_size: int  # EP ranks per node (contiguous blocks): peers on other nodes get puts
    layer_id: int  # row of the metrics totals
    metrics: int  # 1: timestamps and counters into the metrics ring
    num_blocks: int  # persistent grid size of this call
    timeout_ns: int  # bound on every spin-wait
    gemm0_max_splits: (
        int  # 1..MAX_GEMM0_SPLITS: most K splits of a GEMM0 tile when tiles are fewer than blocks
    )

    def as_list(self) -> list[int]:
        return [int(v) for v in astuple(self)]


CAPACITY_FIELDS = tuple(f.name for f in fields(Capacity))
RUNTIME_FIELDS = tuple(f.name for f in fields(RuntimeArgs))

# Status record in host-mapped memory, int64 words in this order.
STATUS_FIELDS = ("code", "rank", "peer", "phase", "detail", "epoch", "observed", "block")
STATUS_WORDS = len(STATUS_FIELDS)
STATUS_OK = 0
STATUS_TIMEOUT = 1

# Phases named in timeout reports (enum Phase).
PHASE_DISPATCH_WAIT = 1
PHASE_COMBINE_WAIT = 2
PHASE_GRID_BARRIER = 3
PHASE_GEMM_PIPELINE = 4
PHASE_EXPERT_READY = 5
PHASE_RELEASE_WAIT = 6
PHASES = {
    PHASE_DISPATCH_WAIT: "dispatch signal",
    PHASE_COMBINE_WAIT: "combine rows",
    PHASE_GRID_BARRIER: "grid barrier (blocks of this kernel)",
    PHASE_GEMM_PIPELINE: "GEMM pipeline of one block (a kernel bug: please report it)",
    PHASE_EXPERT_READY: "an expert's GEMM0 tiles on other blocks (a kernel bug: please report it)",
    PHASE_RELEASE_WAIT: "release of the previous call's receive buffers",
}

# Metrics ring: one record of RING_FIELDS int64 per call, slot = epoch % RING_SLOTS (enum RingField).
RING_SLOTS = 4096
RING_FIELDS = 16
RING_SEQ = 0  # the call's epoch (> 0); 0 = slot never written
RING_LAYER_ID = 1
RING_START_NS = 2  # %globaltimer at kernel start
RING_END_NS = 3  # %globaltimer once every block has finished (read by the last one)
RING_BUSY_NS = 4  # sum over blocks of the time each block did work
RING_BLOCKS_DONE = 5  # complete when == RING_NUM_BLOCKS
RING_NUM_BLOCKS = 6
RING_TOKENS_IN = 7  # this rank's T
RING_ROWS_DISPATCHED = 8  # token rows sent to ranks, this one included
RING_ROWS_RECEIVED = 9
RING_REMOTE_BYTES = 10  # bytes sent to other ranks, dispatch + combine
RING_WORLD_SIZE = 11
# When the last block finished each phase (%globaltimer at its arrival at the grid barrier that closes the
# phase; GEMM0: the last GEMM0 tile's end): where a call's time goes.
RING_DISPATCH_END_NS = 12
RING_RECEIVE_END_NS = 13  # calls that build their lists in every block: block 0's end (moe_layer.cuh)
RING_GEMM0_END_NS = 14  # the last GEMM0 tile (GEMM1 tiles of finished experts may already run)
RING_GEMM1_END_NS = 15  # every GEMM tile

# Exact per-layer counters: [MAX_LAYERS, TOTALS_FIELDS] int64 (enum TotalsField).
TOTALS_FIELDS = 4
MAX_LAYERS = 1024
TOTAL_CALLS = 0
TOTAL_TOKENS_IN = 1
TOTAL_ROWS_DISPATCHED = 2
TOTAL_REMOTE_BYTES = 3

# Shape limits.
HIDDEN_MULTIPLE = 128
INTER_MULTIPLE = 64
MAX_TOP_K = 16
MAX_LOCAL_EXPERTS = 512
MAX_WORLD = 64
MAX_GEMM0_SPLITS = 4  # small T: a GEMM0 tile's K over at most this many tasks
