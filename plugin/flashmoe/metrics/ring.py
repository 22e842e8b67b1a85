"""Host side of the megakernel's device metrics: the ring layout the kernel writes, and its decoder.

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

Everything here works on host tensors (the tests fill them by hand); :mod:`.poller` makes the copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The layout the kernel writes is defined in csrc/flashmoe/contract.h (mirrored by flashmoe.contract); the short
# names are this module's spelling of the same fields.
from ..contract import (
    MAX_LAYERS,
    RING_FIELDS,
    RING_SLOTS,
    TOTAL_CALLS,
    TOTAL_REMOTE_BYTES,
    TOTAL_ROWS_DISPATCHED,
    TOTAL_TOKENS_IN,
    TOTALS_FIELDS,
)
from ..contract import RING_BLOCKS_DONE as BLOCKS_DONE
from ..contract import RING_BUSY_NS as BUSY_NS
from ..contract import RING_END_NS as END_NS
from ..contract import RING_LAYER_ID as LAYER_ID
from ..contract import RING_NUM_BLOCKS as NUM_BLOCKS
from ..contract import RING_REMOTE_BYTES as REMOTE_BYTES
from ..contract import RING_ROWS_DISPATCHED as ROWS_DISPATCHED
from ..contract import RING_ROWS_RECEIVED as ROWS_RECEIVED
from ..contract import RING_SEQ as SEQ
from ..contract import RING_START_NS as START_NS
from ..contract import RING_TOKENS_IN as TOKENS_IN
from ..contract import RING_WORLD_SIZE as WORLD_SIZE

__all__ = [
    "BLOCKS_DONE",
    "BUSY_NS",
    "END_NS",
    "LAYER_ID",
    "MAX_LAYERS",
    "NUM_BLOCKS",
    "REMOTE_BYTES",
    "RING_FIELDS",
    "RING_SLOTS",
    "ROWS_DISPATCHED",
    "ROWS_RECEIVED",
    "SEQ",
    "START_NS",
    "TOKENS_IN",
    "TOTALS_FIELDS",
    "TOTAL_CALLS",
    "TOTAL_REMOTE_BYTES",
    "TOTAL_ROWS_DISPATCHED",
    "TOTAL_TOKENS_IN",
    "WORLD_SIZE",
]


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
        # Per layer without a Python loop over masks: this runs on the metrics thread of the engine's
        # process, where every millisecond of Python holds the GIL the step loop needs.
        records = records[torch.argsort(records[:, LAYER_ID], stable=True)]
        layer_ids, counts = torch.unique_consecutive(records[:, LAYER_ID], return_counts=True)
        segment = torch.repeat_interleave(torch.arange(layer_ids.numel()), counts)
        elapsed = records[:, END_NS] - records[:, START_NS]
        busy = torch.zeros(layer_ids.numel(), dtype=torch.int64).index_add_(0, segment, records[:, BUSY_NS])
        capacity = torch.zeros(layer_ids.numel(), dtype=torch.int64).index_add_(
            0, segment, records[:, NUM_BLOCKS] * elapsed
        )
        latencies = (elapsed.to(torch.float64) * 1e-9).split(counts.tolist())
        windows = [
            LayerWindow(layer_id=layer_id, latencies_s=lat, busy_ns=b, capacity_ns=c)
            for layer_id, lat, b, c in zip(
                layer_ids.tolist(), latencies, busy.tolist(), capacity.tolist(), strict=True
            )
        ]
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
