"""Weight formats the benchmark runs (``--dtype``): the bytes the floor counts and the GEMM rate it uses.

* ``bf16``: ``w13``/``w2`` bf16 (2 B per element); dispatch and combine move bf16 token rows (2 B per element);
  GEMMs at the measured bf16 rate.
* ``fp8``: the block-fp8 layer of issue 15 (:mod:`flashmoe.fp8`, :mod:`flashmoe.reference_fp8`): ``w13``/``w2``
  e4m3 (1 B per element) plus one fp32 ``scale_inv`` per 128 x 128 block; dispatch moves each token row as
  e4m3 (1 B per element) plus one fp32 scale per 128-group (quantised once, on the source rank); combine
  moves bf16 expert results, as in the bf16 layer; GEMMs at the measured fp8 rate.

Activations enter and leave the layer in bf16 in both formats.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 4  # fp32 scales (weights' scale_inv and the dispatched rows' per-group scales)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Format:
    name: str  # --dtype value and the rows' ``dtype``
    weight_elem_bytes: int
    weight_block: int | None  # one fp32 scale per block x block weight tile; None: no scales
    dispatch_elem_bytes: int
    dispatch_group: int | None  # one fp32 scale per token per group of this many elements; None: none
    combine_elem_bytes: int
    gemm: str  # which measured GEMM rate bounds the expert GEMMs: "bf16" or "fp8" (floor.Rates.gemm_rate)

    def expert_weight_bytes(self, hidden: int, intermediate: int) -> int:
        """``w13 [2I, H]`` + ``w2 [H, I]`` of one expert, with their block scales."""
        elems = 3 * hidden * intermediate
        scales = 0
        if self.weight_block:
            b = self.weight_block
            scales = _cdiv(2 * intermediate, b) * _cdiv(hidden, b) + _cdiv(hidden, b) * _cdiv(intermediate, b)
        return elems * self.weight_elem_bytes + scales * SCALE_BYTES

    def dispatch_row_bytes(self, hidden: int) -> int:
        """One token row as dispatch moves it to an expert's rank."""
        scales = _cdiv(hidden, self.dispatch_group) if self.dispatch_group else 0
        return hidden * self.dispatch_elem_bytes + scales * SCALE_BYTES

    def combine_row_bytes(self, hidden: int) -> int:
        """One expert result row (or a per-rank pre-reduced sum) as combine moves it back."""
        return hidden * self.combine_elem_bytes


BF16 = Format("bf16", 2, None, 2, None, 2, "bf16")
FP8 = Format("fp8", 1, 128, 1, 128, 2, "fp8")
FORMATS: dict[str, Format] = {f.name: f for f in (BF16, FP8)}
