"""bf16 and fp8 error budgets for comparing MoE outputs, and the error measures they apply to.

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

**fp8** (the block-scaled path, :mod:`flashmoe.reference_fp8`; the quantiser: :mod:`flashmoe.fp8`).
e4m3 keeps 4 significant bits: unit roundoff ``U8 = 2**-4``; one e4m3 step is 1/16 to 1/8 of the value
it rounds (``v / step`` averages ``8 / ln 2 = 11.5`` over a binade), and 32/448 = 1/14 of its group's
amax at the top. Measured numbers: ``scripts/fp8_tolerances.py`` on CPU (results:
``benchmarks/results/2026-11-22-cpu-fp8-tolerances.json``; DeepSeek-V3 routed shape H=7168, I=2048,
k=8 with 8 experts, 32 tokens x 3 seeds; Qwen3-30B-A3B H=2048, I=768, k=8, 128 tokens x 4; and
H/I/k = 1024/512/4, 512/256/2, 256/128/1, 7168/128/8 with 64 to 1024 tokens; 7.8k rows in all).

* **Kernel against the same-rounding reference.** The semantics fix every rounding point, and the
  quantiser bit for bit (fp32 steps): a kernel's ``qx`` and x scales equal the reference's. It can
  differ only in how it sums: (a) fp32 order in the 128-K promotion (an FMA, another order of the
  block partials): relative ``delta ~ 1e-7`` in GEMM0's output (measured 3e-8 to 9e-8); (b) the
  tensor core's block partial sums: Hopper's fp8 WGMMA accumulates with "around 14 bits"
  (DeepSeek-V3 report, section 3.3.2), why DeepGEMM, and the kernel, promote to fp32 every 128 K:
  ``delta ~ 2**-13`` (1.23e-4 to 1.25e-4 measured with a 13-bit truncating stand-in, 1.7e-4 to
  1.9e-4 after the SwiGLU). Either then meets the e4m3 re-quantisation of the activation: a
  perturbation ``D`` of an activation ``v`` flips its rounding with probability ``|D| / step(v)`` and
  then moves it by one step, so the squared error of a row is ``sum step * |D|`` and
  ``eps_act^2 ~ delta_act * E|v| / (11.5 rms v) = 0.07 delta_act``: **eps ~ 0.27 sqrt(delta)**, the
  square root of the summation error, not the error itself (measured coefficient 0.18 to 0.30).
  GEMM1 carries ``eps_act`` to the expert output (``|W2 e| / |W2 a| ~ |e| / |a|`` for random W2)
  and the slot sum keeps it relative. (a) alone: ``eps ~ 1e-4``; measured (stand-in
  ``fp32_order``) 8e-7 to 1.7e-4, rows <= 2.3e-3. (b): ``eps ~ 3.6e-3 = 0.9 U``; measured
  (``tensor_core_13b``) 2.5e-3 to 4.8e-3, ~1% of activation roundings flipped (mostly small ones);
  each bit of accumulator precision divides it by about sqrt(2) (``--quick --tc-bits 9 11 13 15
  17``, ``...-fp8-tolerances-accumulator-bits.json``, Qwen3 shape, 32 tokens: 2.0e-2 at 9 bits,
  1.0e-2 at 11, 3.5e-3 at 13, 2.0e-3 at 15, 6.5e-4 at 17). Budget ``FP8_SAME_ROUNDING_REL_FRO =
  2.5 U`` (9.8e-3): twice the measured worst for 13 bits; a kernel that keeps fewer than ~11 bits in
  a block partial, or promotes less often than every 128 K, fails it.
  **Rows:** one flip near the top of a group moves one activation by amax/14 and the expert output
  row by ``(amax / 14) / |a|``; with ``|a| ~ sqrt(I) rms`` and amax 2.6 to 8 rms (one Gaussian group's
  maximum, up to 8 with groups of different magnitude) that is 0.19 to 0.57 ``/ sqrt(I)``, and a row
  rarely takes more than one or two large flips. Measured worst rows: 0.61 ``/ sqrt(I)`` (4.4e-2 at
  I=128, 1.8e-2 at I=768, 1.05e-2 at I=2048). Budget :func:`fp8_row_rel`: ``max(2.5 U, 1.25 /
  sqrt(I))`` (0.11 at I=128, 4.5e-2 at 768, 2.8e-2 at 2048), for both comparisons.
* **Against the fp64 oracle.** The reference differs by its bf16 roundings (each expert output and
  the result: ~0.6 U; measured 1.6e-3 to 2.8e-3, rows <= 2.8e-3) and, rarely, by an activation flip
  of its own (fp32 against the oracle's float64): one DeepSeek-V3 row at 8.2e-3 = 0.37 ``/ sqrt(I)``.
  A kernel adds its flips: ``sqrt(0.6^2 + 0.9^2) U ~ 1.1 U``; measured 2.8e-3 to 5.0e-3, rows <= 0.61
  ``/ sqrt(I)``. Budget ``FP8_ORACLE_REL_FRO = 2.5 U``, rows :func:`fp8_row_rel`. The two budgets are
  equal because the flips, common to both comparisons, dominate; a missing quantisation (4e-2) or a
  scale on the wrong block fails both by far.
* **Information, not a budget: the quantisation itself.** The fp8 oracle against the same layer with
  unquantised activations on the same dequantised weights: 4.2e-2 to 4.6e-2 (rows <= 8.1e-2). Two
  e4m3 roundings of RMS ``step / sqrt(12)`` = 2.6% each, the first carried through GEMM0 and the
  SwiGLU's product: ``~ sqrt(2 + 1) * 2.6% = 4.6%``. ``FP8_ACTIVATION_QUANTISATION_REL_FRO`` = 9e-2,
  twice that, bounds the fp8 reference against the bf16 reference on weights both represent exactly
  (test_reference_fp8: 3.8e-2 to 4.7e-2 over 12 seeds).
* **Few rows.** A batch's relative Frobenius error is about the RMS of its rows' (rows of similar norm),
  so one row at the row bound ``R`` alone puts a batch of ``n`` rows at ``R / sqrt(n)``. The batch
  budget ``B = 2.5 U`` describes an average over many rows, each carrying a few large flips (above); it
  applies once one row at ``R`` takes at most half of it, ``n >= 4 (R / B)^2``
  (:func:`fp8_min_rows_for_batch`: 86 rows at I=768, 32 at I=2048, 512 at I=128), and a smaller batch is
  held to the row budget in both figures, as a bf16 batch under ``MIN_ROWS_FOR_BATCH_BUDGET`` rows is.
  Seen: Qwen3-30B with all 16 tokens on one expert (16 rows, I=768) at 1.28e-2 with rows <= 2.66e-2
  (kernel_check seed 1795537672; 40 draws of that case 1.7e-3 to 9.9e-3, every activation within one
  top-of-group step of the reference's: ``benchmarks/results/2026-11-24-h200x1-per-block-lists-tail-split.json``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

BF16_UNIT_ROUNDOFF = 2.0**-8

ORACLE_REL_FRO = 2 * BF16_UNIT_ROUNDOFF
ORACLE_ROW_REL = 3 * BF16_UNIT_ROUNDOFF
SAME_ROUNDING_REL_FRO = BF16_UNIT_ROUNDOFF / 2
SAME_ROUNDING_ROW_REL = 2 * BF16_UNIT_ROUNDOFF
MIN_ROWS_FOR_BATCH_BUDGET = 16

E4M3_UNIT_ROUNDOFF = 2.0**-4
FP8_SAME_ROUNDING_REL_FRO = 2.5 * BF16_UNIT_ROUNDOFF
FP8_ORACLE_REL_FRO = 2.5 * BF16_UNIT_ROUNDOFF
FP8_ROW_FLIP_COEFF = 1.25  # x 1/sqrt(I): twice the worst measured row
FP8_ACTIVATION_QUANTISATION_REL_FRO = 9e-2  # information: twice the derived 4.6%


def fp8_row_rel(intermediate: int) -> float:
    """Any row's budget on the fp8 path, both comparisons (module docstring, "Rows")."""
    return max(FP8_ORACLE_REL_FRO, FP8_ROW_FLIP_COEFF / intermediate**0.5)


def fp8_min_rows_for_batch(intermediate: int, batch_rel_fro: float = FP8_SAME_ROUNDING_REL_FRO) -> int:
    """Non-zero rows an fp8 batch needs before ``batch_rel_fro`` applies (module docstring, "Few rows")."""
    ratio = fp8_row_rel(intermediate) / batch_rel_fro
    return max(MIN_ROWS_FOR_BATCH_BUDGET, math.ceil(4 * ratio * ratio))


class Budget(NamedTuple):
    """One comparison's budgets: the batch's relative Frobenius error, any row's, and the non-zero rows a batch
    needs before the batch figure applies (below that it is held to the row budget)."""

    rel_fro: float
    row_rel: float
    min_rows: int = MIN_ROWS_FOR_BATCH_BUDGET

    def batch_rel_fro(self, rows: int) -> float:
        """The batch figure a batch of ``rows`` non-zero rows is held to: ``rel_fro``, or below ``min_rows`` the
        row budget where that is larger."""
        return self.rel_fro if rows >= self.min_rows else max(self.rel_fro, self.row_rel)


WEIGHT_DTYPES = ("bf16", "fp8")


def kernel_budgets(dtype: str, intermediate: int) -> dict[str, Budget]:
    """A kernel's budgets for ``dtype`` weights ("bf16", or "fp8": block-fp8), keyed by what it is compared
    with: "ref" (the same-rounding reference) and "oracle" (the fp64 oracle)."""
    if dtype == "bf16":
        return {
            "ref": Budget(SAME_ROUNDING_REL_FRO, SAME_ROUNDING_ROW_REL),
            "oracle": Budget(ORACLE_REL_FRO, ORACLE_ROW_REL),
        }
    if dtype == "fp8":
        row = fp8_row_rel(intermediate)
        return {
            "ref": Budget(
                FP8_SAME_ROUNDING_REL_FRO,
                row,
                fp8_min_rows_for_batch(intermediate, FP8_SAME_ROUNDING_REL_FRO),
            ),
            "oracle": Budget(
                FP8_ORACLE_REL_FRO, row, fp8_min_rows_for_batch(intermediate, FP8_ORACLE_REL_FRO)
            ),
        }
    raise ValueError(f"weight dtype {dtype!r}: expected one of {WEIGHT_DTYPES}")


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

    def within(self, rel_fro: float, row_rel: float, min_rows: int = MIN_ROWS_FOR_BATCH_BUDGET) -> bool:
        """Within the budgets (:class:`Budget`'s fields): a batch of fewer than ``min_rows`` non-zero rows is held
        to the row budget in both figures."""
        return (
            self.nonfinite == 0
            and self.nonzero_in_zero_rows == 0
            and self.rel_fro <= Budget(rel_fro, row_rel, min_rows).batch_rel_fro(self.rows)
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


def repeat_difference(
    first: torch.Tensor, other: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor | None = None
) -> dict:
    """Where two calls that should repeat bit for bit differ: how many elements and token rows, the largest
    difference, each call's error against ``ref`` (the odd one out is the call that went wrong) and, given the
    routing ``ids``, the experts of the first differing rows (a race in one tile shows as rows sharing an expert)."""
    diff = (first.double() - other.double()).abs()
    rows = torch.nonzero(diff.amax(dim=1) > 0).flatten()
    out = {
        "differing_elements": int((first.view(torch.int16) != other.view(torch.int16)).sum()),
        "differing_rows": int(rows.numel()),
        "first_differing_rows": rows[:8].tolist(),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "first_call_vs_ref": error_stats(first, ref).rel_fro,
        "other_call_vs_ref": error_stats(other, ref).rel_fro,
    }
    if ids is not None:
        out["their_experts"] = [ids[r].tolist() for r in rows[:8].tolist()]
    return out


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


def within_kernel_budgets(stats: dict[str, ErrorStats], dtype: str, intermediate: int) -> bool:
    """Every comparison in ``stats`` ("ref", "oracle") within :func:`kernel_budgets`."""
    budgets = kernel_budgets(dtype, intermediate)
    return all(s.within(*budgets[against]) for against, s in stats.items())
