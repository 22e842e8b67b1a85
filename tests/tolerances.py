"""bf16 error budgets for comparing MoE outputs, and the error measures they apply to.

bf16 keeps 8 significant bits: unit roundoff ``U = 2**-8`` (~3.9e-3), one rounding changes a value by
at most ``U`` relative (RMS ~0.4 U for values spread across a binade).

Two kinds of comparison:

* **Against the fp64 oracle** (no rounding at all). The documented semantics round three times: the
  SwiGLU activation, each expert's output, and the final sum. Three independent roundings of RMS
  ~0.4 U give a relative Frobenius error of ~0.7 U (measured: 2.4e-3 to 2.9e-3 on random inputs of
  every shape in the suites). Budget: ``2 U`` for the whole batch and ``3 U`` for any single row
  (a row of H >= 128 elements averages its roundings nearly as well).
* **Against the fp32 reference with the same rounding** (:func:`flashmoe.moe_reference`). Both sides
  round at the same points; they differ only where a different fp32 summation order (GEMM blocking,
  tile order, a rank seeing a different batch) moves a value across a bf16 rounding boundary. Such a
  flip in the SwiGLU activation is then carried through GEMM1, so the difference grows with the
  reduction length H: measured on 4xH200 (matrix of 60 shapes x worlds 1/2/4, results committed) 5e-4 at
  H=1024, 9e-4 at H=2048 and up to 1.6e-3 (0.42 U) at H=4096/7168, while the kernel's error against
  the fp64 oracle stayed the reference's own (2.4e-3 to 2.9e-3). Budget: ``U / 2`` for the batch,
  ``2 U`` for any row; a batch of fewer than ``MIN_ROWS_FOR_BATCH_BUDGET`` non-zero rows averages too few
  rows for the batch figure to mean more than a row's, so it gets the row budget (seen on an H100: one
  row with H=7168, I=256 at 2.0e-3, where 256 activations make each flip count more). A dropped or doubled (token, expert) pair fails the row bound by an order of
  magnitude; a rounding the semantics do not have shows up against the oracle.

Rows whose exact value is zero (every slot -1) must come out exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16_UNIT_ROUNDOFF = 2.0**-8

ORACLE_REL_FRO = 2 * BF16_UNIT_ROUNDOFF
ORACLE_ROW_REL = 3 * BF16_UNIT_ROUNDOFF
SAME_ROUNDING_REL_FRO = BF16_UNIT_ROUNDOFF / 2
SAME_ROUNDING_ROW_REL = 2 * BF16_UNIT_ROUNDOFF
MIN_ROWS_FOR_BATCH_BUDGET = 16


@dataclass
class ErrorStats:
    """Sums that combine across ranks by addition (squares) or max; ``rel_fro`` and ``max_row_rel`` read them."""

    err_sq: float = 0.0  # sum (out - ref)^2
    ref_sq: float = 0.0  # sum ref^2
    max_abs: float = 0.0
    max_row_rel: float = 0.0  # over rows with a non-zero reference
    nonzero_in_zero_rows: int = 0  # elements != 0 where the reference row is exactly zero
    nonfinite: int = 0  # NaN/Inf elements in the output (unwritten rows of a NaN-poisoned out=)
    rows: int = 0  # rows with a non-zero reference

    @property
    def rel_fro(self) -> float:
        if self.ref_sq == 0.0:
            return 0.0 if self.err_sq == 0.0 else float("inf")
        return (self.err_sq / self.ref_sq) ** 0.5

    def within(self, rel_fro: float, row_rel: float) -> bool:
        return (
            self.nonfinite == 0
            and self.nonzero_in_zero_rows == 0
            and self.rel_fro <= (rel_fro if self.rows >= MIN_ROWS_FOR_BATCH_BUDGET else max(rel_fro, row_rel))
            and self.max_row_rel <= row_rel
        )

    def merge(self, other: ErrorStats) -> ErrorStats:
        return ErrorStats(
            self.err_sq + other.err_sq,
            self.ref_sq + other.ref_sq,
            max(self.max_abs, other.max_abs),
            max(self.max_row_rel, other.max_row_rel),
            self.nonzero_in_zero_rows + other.nonzero_in_zero_rows,
            self.nonfinite + other.nonfinite,
            self.rows + other.rows,
        )

    def as_tensor(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxima) float64 tensors, for all_reduce(SUM) and all_reduce(MAX)."""
        sums = torch.tensor(
            [self.err_sq, self.ref_sq, self.nonzero_in_zero_rows, self.nonfinite, self.rows],
            dtype=torch.float64,
            device=device,
        )
        maxima = torch.tensor([self.max_abs, self.max_row_rel], dtype=torch.float64, device=device)
        return sums, maxima

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, maxima: torch.Tensor) -> ErrorStats:
        s, m = sums.tolist(), maxima.tolist()
        return cls(s[0], s[1], m[0], m[1], int(s[2]), int(s[3]), int(s[4]))


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Compare ``out`` [T, H] with ``ref`` [T, H] in float64 (non-finite outputs counted, not propagated)."""
    o, r = out.double(), ref.double()
    finite = torch.isfinite(o)
    nonfinite = int((~finite).sum())
    o = torch.where(finite, o, torch.zeros_like(o))
    diff = o - r
    row_ref = r.norm(dim=1)
    zero_rows = row_ref == 0
    row_rel = diff.norm(dim=1)[~zero_rows] / row_ref[~zero_rows]
    return ErrorStats(
        err_sq=float(diff.square().sum()),
        ref_sq=float(r.square().sum()),
        max_abs=float(diff.abs().max()) if diff.numel() else 0.0,
        max_row_rel=float(row_rel.max()) if row_rel.numel() else 0.0,
        nonzero_in_zero_rows=int((o[zero_rows] != 0).sum()),
        nonfinite=nonfinite,
        rows=int(row_rel.numel()),
    )


def assert_within(
    out: torch.Tensor, ref: torch.Tensor, rel_fro: float, row_rel: float, what: str
) -> ErrorStats:
    stats = error_stats(out, ref)
    assert stats.within(rel_fro, row_rel), (
        f"{what}: rel Frobenius {stats.rel_fro:.3e} (budget {rel_fro:.3e}), worst row {stats.max_row_rel:.3e} "
        f"(budget {row_rel:.3e}), max abs {stats.max_abs:.3e}, non-finite {stats.nonfinite}, "
        f"non-zero in all-skipped rows {stats.nonzero_in_zero_rows}"
    )
    return stats
