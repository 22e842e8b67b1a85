"""Process-wide NVSHMEM state and the megakernel's buffers: initialised once, allocated once, shared by
every layer and call for the life of the process.

NVSHMEM is bootstrapped with a unique id that EP rank 0 creates and broadcasts over the engine's process
group (no MPI, no launcher integration). If another library already initialised NVSHMEM in this process
(``nvshmemx_init_status``), flashmoe attaches to it and checks that its PE numbering is the EP group's.

Capacity (what the buffers are sized for) is the maximum over every layer announced so far; a larger layer
arriving later triggers one collective reallocation (before any CUDA graph is captured, since engines build
all layers first). The sizes are in ``csrc/flashmoe/layout.cuh``; ``SymmetricBuffers.describe()`` reports them.
"""

from __future__ import annotations

import logging
import os

import torch

from . import config
from .contract import MAX_LAYERS, RING_FIELDS, RING_SLOTS, STATUS_WORDS, TOTALS_FIELDS, Capacity
from .errors import FlashMoEError, FlashMoETimeoutError

logger = logging.getLogger("flashmoe")


# How long the first launch waits on the host for the other EP ranks (vLLM waits 600 s for its engines).
FIRST_LAUNCH_WAIT_S = 600.0


def rendezvous(group, world: int, timeout_s: float = FIRST_LAUNCH_WAIT_S) -> None:
    """Wait on the host until every rank of ``group`` is here; FlashMoETimeoutError after ``timeout_s``.

    Before the first launch on a set of buffers: EP ranks reach their first MoE call far apart at start-up
    (vLLM compiles the model in each rank: one DP2 start had rank 0 finish its 50 s torch.compile more than
    5 s after rank 1), and a kernel launched early would spend that skew in its bounded waits and time out.
    Every rank's first launch is the same layer's call #1 (each call is collective), so the waits pair up.
    """
    if world == 1 or group is None:
        return
    import datetime

    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        dist.barrier(group=group)  # no bounded barrier there; the engine's own timeout applies
        return
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise FlashMoETimeoutError(
            f"flashmoe: not every EP rank reached its first MoE call within {timeout_s:.0f} s ({e}); "
            "a rank of the EP group died or runs a different model"
        ) from e


class SymmetricBuffers:
    def __init__(self, ops, capacity: Capacity, rank: int, device: torch.device, group=None, world: int = 1):
        self.ops, self.capacity, self.rank, self.device = ops, capacity, rank, device
        self.group, self.world = group, world
        self.launched = False  # rendezvous() before the first launch on these buffers
        self.capacity_list = capacity.as_list()  # what every launch passes: built once, not per call
        self.sym_bytes, self.workspace_bytes = ops.capacity_bytes(self.capacity_list)
        self.sym_ptr = ops.symmetric_alloc(self.sym_bytes)  # collective, zeroed: signals start at epoch 0
        with torch.cuda.device(device):
            # Counters start at 0 and are reset by the kernel itself after each call: zeroed once, never again.
            self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self.metrics_ring = torch.zeros(RING_SLOTS, RING_FIELDS, dtype=torch.int64, device=device)
            self.metrics_totals = torch.zeros(MAX_LAYERS, TOTALS_FIELDS, dtype=torch.int64, device=device)
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int64).pin_memory()
        self.poisoned: str | None = None
        ops.barrier_all(torch.cuda.current_stream(device).cuda_stream)
        torch.cuda.synchronize(device)

    def before_launch(self) -> None:
        """The first launch on these buffers waits for every EP rank (:func:`rendezvous`); a launch
        inside a CUDA graph capture has no host point to wait at, so a first launch there skips it."""
        if self.launched:
            return
        if not torch.cuda.is_current_stream_capturing():
            rendezvous(self.group, self.world)
        self.launched = True

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        self.ops.symmetric_free(self.sym_ptr)  # collective
        self.sym_ptr = 0

    def describe(self) -> str:
        c = self.capacity
        return (
            f"flashmoe buffers: symmetric {self.sym_bytes / 2**20:.1f} MiB + local {self.workspace_bytes / 2**20:.1f} MiB "
            f"(max_tokens/rank {c.max_tokens_per_rank}, H {c.hidden_size}, I {c.intermediate_size}, k {c.top_k}, EP {c.world_size}, "
            f"experts/rank {c.max_local}, blocks {c.num_blocks})"
        )


_state: dict = {"buffers": None, "nvshmem": False, "attached": set()}


def _broadcast_uniqueid(ops, group, rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist

    uid = ops.uniqueid() if rank == 0 else torch.empty(0, dtype=torch.uint8)
    if world == 1:
        return uid
    holder = [uid.numpy().tobytes() if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(holder, src=src, group=group)
    return torch.frombuffer(bytearray(holder[0]), dtype=torch.uint8).clone()


def ensure(ops, capacity: Capacity, rank: int, world: int, group, device: torch.device) -> SymmetricBuffers:
    """The process's buffers, (re)allocated to cover ``capacity``. Collective over the EP group."""
    if not _state["nvshmem"]:
        # NVLink multicast can take shared hosts down and the kernel does not use it.
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        need = ops.capacity_bytes(capacity.as_list())[0]
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(int(need * 1.25) + (256 << 20)))
        torch.cuda.set_device(device)
        uid = _broadcast_uniqueid(ops, group, rank, world)
        ops.nvshmem_setup(uid, rank, world)
        _state["nvshmem"] = True
        _state["attached"].add(id(ops))
        logger.info("flashmoe: NVSHMEM ready, PE %d of %d on %s", rank, world, device)
    elif id(ops) not in _state["attached"]:
        # Another kernel variant (its own copy of NVSHMEM's device state) joins the running library.
        ops.nvshmem_setup(torch.zeros(ops.uniqueid_bytes(), dtype=torch.uint8), rank, world)
        _state["attached"].add(id(ops))
    current: SymmetricBuffers | None = _state["buffers"]
    if current is not None and current.poisoned:
        raise FlashMoEError(f"flashmoe state is unusable after an earlier failure: {current.poisoned}")
    if current is not None and current.capacity.covers(capacity):
        return current
    if current is not None:
        capacity = current.capacity.union(capacity)
        logger.warning("flashmoe: growing buffers (collective reallocation) to %s", capacity)
        current.release()
    buffers = SymmetricBuffers(ops, capacity, rank, device, group, world)
    _state["buffers"] = buffers
    logger.info("%s", buffers.describe())
    return buffers


def current() -> SymmetricBuffers | None:
    return _state["buffers"]


def default_num_blocks(ops, device: torch.device) -> int:
    resident = ops.max_resident_blocks(device.index)
    budget = config.num_blocks()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = min(budget if budget > 0 else sms, resident)
    if blocks < 1:
        raise FlashMoEError(
            "the megakernel cannot be resident on this GPU (occupancy query returned 0 blocks)"
        )
    return blocks
