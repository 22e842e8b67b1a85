"""Host side of the megakernel's device metrics: the ring layout, the asynchronous copy, the decoder.

The kernel (csrc/flashmoe) writes one record per call into ``ring`` (int64 ``[RING_SLOTS,
RING_FIELDS]``, slot = call epoch % slots) and adds exact per-layer counters into ``totals`` (int64
``[MAX_LAYERS, TOTALS_FIELDS]``). Nothing on the device waits for the host, so this works inside
CUDA graphs. The host copies both buffers about once a second and turns the records it has not seen
yet into per-layer samples.

Three things the decoder must survive:
- torn records: the copy engine reads the ring while kernels write it. Each poll copies the ring
  twice; a record counts only if both copies agree, it is complete (``blocks_done == num_blocks``),
  its seq belongs to its slot, and its fields are sane. Anything else is re-read next poll.
- ring wrap: more than ``RING_SLOTS`` calls between two polls overwrite unread records, so the
  latency histogram is a sample. The totals are exact counters and never miss a call.
- several layers per ring: records carry their layer id.

Everything here accepts CPU tensors too (the tests fill them by hand); on CUDA the copy goes to
registered host memory on a dedicated stream and is awaited through an event, never a device sync.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("flashmoe")

RING_SLOTS = 4096
RING_FIELDS = 16
MAX_LAYERS = 1024
TOTALS_FIELDS = 4

# Ring record fields (int64 each).
SEQ = 0  # the call's epoch (> 0); 0 = slot never written
LAYER_ID = 1
START_NS = 2  # %globaltimer at kernel start
END_NS = 3  # %globaltimer when the last block finished
BUSY_NS = 4  # sum over blocks of the time each block did work
BLOCKS_DONE = 5  # incremented by each block as it finishes; complete when == NUM_BLOCKS
NUM_BLOCKS = 6
TOKENS_IN = 7  # this rank's T
ROWS_DISPATCHED = 8  # token rows sent to ranks, this one included
ROWS_RECEIVED = 9
REMOTE_BYTES = 10  # bytes sent to other ranks, dispatch + combine
WORLD_SIZE = 11

# Totals columns (exact cumulative counters per layer id).
TOTAL_CALLS = 0
TOTAL_TOKENS_IN = 1
TOTAL_ROWS_DISPATCHED = 2
TOTAL_REMOTE_BYTES = 3

# cudaStreamCaptureModeThreadLocal (driver_types.h).
_CAPTURE_MODE_THREAD_LOCAL = 1


@dataclass(frozen=True)
class LayerWindow:
    """The calls of one layer that one poll found in the ring (a sample when the ring wrapped)."""

    layer_id: int
    latencies_s: torch.Tensor  # float64 [n], end - start of each call
    busy_ns: int  # sum over those calls of the per-block busy time
    capacity_ns: int  # sum over those calls of num_blocks * (end - start)

    @property
    def sm_utilization(self) -> float | None:
        """Busy block-time over available block-time: the share of the kernel's SMs doing work."""
        return self.busy_ns / self.capacity_ns if self.capacity_ns > 0 else None


@dataclass(frozen=True)
class TotalsDelta:
    """How much one layer's exact counters grew since the previous poll."""

    layer_id: int
    calls: int
    tokens_in: int
    rows_dispatched: int
    remote_bytes: int


def check_buffers(ring: torch.Tensor, totals: torch.Tensor) -> None:
    if ring.dtype != torch.int64 or ring.dim() != 2 or ring.shape[1] != RING_FIELDS or ring.shape[0] < 1:
        raise ValueError(f"ring must be int64 [slots, {RING_FIELDS}], got {ring.dtype} {tuple(ring.shape)}")
    if totals.dtype != torch.int64 or totals.dim() != 2 or totals.shape[1] != TOTALS_FIELDS:
        raise ValueError(
            f"totals must be int64 [layers, {TOTALS_FIELDS}], got {totals.dtype} {tuple(totals.shape)}"
        )
    if ring.device != totals.device:
        raise ValueError(f"ring is on {ring.device}, totals on {totals.device}")
    if not (ring.is_contiguous() and totals.is_contiguous()):
        raise ValueError("ring and totals must be contiguous")


class RingDecoder:
    """Turns successive ring snapshots into per-layer windows, each record at most once."""

    def __init__(self, slots: int, max_layers: int):
        self._slots = slots
        self._max_layers = max_layers
        self._slot_index = torch.arange(slots, dtype=torch.int64)
        self._last_seq = torch.zeros(slots, dtype=torch.int64)  # the seq last consumed from each slot
        self.records_accepted = 0

    def decode(self, first: torch.Tensor, second: torch.Tensor) -> list[LayerWindow]:
        """``first`` and ``second``: two host copies of the ring taken back to back."""
        seq = first[:, SEQ]
        start, end, busy = first[:, START_NS], first[:, END_NS], first[:, BUSY_NS]
        blocks, layer = first[:, NUM_BLOCKS], first[:, LAYER_ID]
        ok = (first == second).all(dim=1)  # not torn by a concurrent write
        # A slot's seq changes only when a newer call overwrites it; "!=" rather than ">" survives the
        # kernel's 32-bit epoch wrapping (days at decode rates).
        ok &= (seq != 0) & (seq != self._last_seq)
        ok &= torch.remainder(seq, self._slots) == self._slot_index
        ok &= (blocks > 0) & (first[:, BLOCKS_DONE] == blocks)
        ok &= (start > 0) & (end >= start) & (busy >= 0)
        ok &= (layer >= 0) & (layer < self._max_layers)
        slots = ok.nonzero().flatten()
        if slots.numel() == 0:
            return []
        self._last_seq[slots] = seq[slots]
        self.records_accepted += slots.numel()
        records = first[slots]
        elapsed = records[:, END_NS] - records[:, START_NS]
        capacity = records[:, NUM_BLOCKS] * elapsed
        windows = []
        for layer_id in torch.unique(records[:, LAYER_ID]).tolist():
            mine = records[:, LAYER_ID] == layer_id
            windows.append(
                LayerWindow(
                    layer_id=int(layer_id),
                    latencies_s=elapsed[mine].to(torch.float64) * 1e-9,
                    busy_ns=int(records[mine, BUSY_NS].sum()),
                    capacity_ns=int(capacity[mine].sum()),
                )
            )
        return windows


class TotalsTracker:
    """Per-layer deltas of the exact counters between polls."""

    def __init__(self, layers: int):
        self._last = torch.zeros(layers, TOTALS_FIELDS, dtype=torch.int64)

    def update(self, totals: torch.Tensor) -> list[TotalsDelta]:
        delta = totals - self._last
        # A counter that went down was reset (buffers re-created in place): count it from zero.
        reset = (delta < 0).any(dim=1)
        delta[reset] = totals[reset]
        self._last.copy_(totals)
        rows = (delta != 0).any(dim=1).nonzero().flatten().tolist()
        return [
            TotalsDelta(
                layer_id=r,
                calls=int(delta[r, TOTAL_CALLS]),
                tokens_in=int(delta[r, TOTAL_TOKENS_IN]),
                rows_dispatched=int(delta[r, TOTAL_ROWS_DISPATCHED]),
                remote_bytes=int(delta[r, TOTAL_REMOTE_BYTES]),
            )
            for r in rows
        ]


class HostSnapshot:
    """Copies ring (twice) and totals to host buffers it owns; CUDA or CPU source alike.

    On CUDA the buffers are page-locked with ``cudaHostRegister`` (not torch's caching host
    allocator, whose per-copy events other threads would then query) and the copies run on a
    stream of their own, concurrently with whatever the compute streams are doing.
    """

    def __init__(self, ring: torch.Tensor, totals: torch.Tensor):
        check_buffers(ring, totals)
        self._ring, self._totals = ring, totals
        self.first = torch.empty(ring.shape, dtype=torch.int64)
        self.second = torch.empty(ring.shape, dtype=torch.int64)
        self.totals = torch.empty(totals.shape, dtype=torch.int64)
        self._cuda = ring.is_cuda
        self._registered: list[int] = []
        if self._cuda:
            for buf in (self.first, self.second, self.totals):
                _host_register(buf)
                self._registered.append(buf.data_ptr())
            self._stream = torch.cuda.Stream(device=ring.device)
            self._done = torch.cuda.Event()

    def take(self, timeout_s: float) -> bool:
        """Fill ``first``, ``totals``, ``second`` (in that order); False if the copy did not finish in time."""
        if not self._cuda:
            self.first.copy_(self._ring)
            self.totals.copy_(self._totals)
            self.second.copy_(self._ring)
            return True
        with torch.cuda.device(self._ring.device), torch.cuda.stream(self._stream):
            self.first.copy_(self._ring, non_blocking=True)
            self.totals.copy_(self._totals, non_blocking=True)
            self.second.copy_(self._ring, non_blocking=True)
            self._done.record(self._stream)
        deadline = time.monotonic() + timeout_s
        while not self._done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self) -> None:
        if self._cuda:
            # The event query returned or timed out; wait for our own stream only before unpinning.
            self._stream.synchronize()
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.clear()


def _host_register(buf: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of the metrics host buffer failed (cudaError {rc})")


def relax_capture_checks_for_this_thread() -> bool:
    """Switch the calling thread to ``cudaStreamCaptureModeThreadLocal``.

    vLLM and SGLang capture CUDA graphs in the default global mode, in which an event query or copy
    issued by *any* thread during the capture invalidates it. In thread-local mode our thread's
    calls are checked only against captures it started itself (none), as PyTorch's NCCL watchdog
    does. The mode lives in each CUDA runtime instance, so it is set in every libcudart loaded.
    Returns False if none could be found.
    """
    done = False
    for cudart in _loaded_cudarts():
        mode = ctypes.c_int(_CAPTURE_MODE_THREAD_LOCAL)
        done |= cudart.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    return done


def _loaded_cudarts() -> list:
    """The CUDA runtime libraries in this process (torch's, and any an extension brought)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        paths = []
    libs = []
    for path in paths or [None]:  # None: cudart linked statically into an already-loaded library
        try:
            lib = ctypes.CDLL(path)
            lib.cudaThreadExchangeStreamCaptureMode  # noqa: B018 (probe the symbol)
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    return libs
