"""Correctness gate run on every variant before it is timed: its output against the reference.

bf16 layers are compared with :func:`flashmoe.reference.moe_reference_distributed` on the same inputs;
``compute_only`` with a per-expert fp32 loop. Both error measures are relative to the reference as a
whole, so they do not blow up on near-zero elements, and loose enough for bf16 rounding differences
(a bf16 ulp is 2^-8 ≈ 0.4%; the baselines round the GEMM-1 output and the weighted terms, the
reference does not) yet far below what a dropped or misrouted expert does (tens of percent).

fp8 layers (``--dtype fp8``) are compared with :mod:`flashmoe.reference_fp8` (single rank:
``moe_reference_fp8``; EP: ``moe_reference_distributed_fp8``) under the test suite's fp8 budgets for a
kernel against the same-rounding reference (``tests/tolerances.py``: ``FP8_SAME_ROUNDING_REL_FRO`` for
the whole output, :func:`fp8_row_rel` for any row), judged on every rank's rows together as the suite
does (:func:`reduce_stats`). The baselines that dequantise fp8 weights to bf16 compute the bf16 layer on
those weights, and are checked against that with the bf16 check above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REL_L2_TOL = 1e-2
MAX_REL_TOL = 5e-2


@dataclass(frozen=True)
class CheckResult:
    rel_l2: float  # ||out - ref||_2 / ||ref||_2
    max_rel: float  # max |out - ref| / max |ref|
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.rel_l2 <= REL_L2_TOL and self.max_rel <= MAX_REL_TOL


def compare(out: torch.Tensor, ref: torch.Tensor) -> CheckResult:
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(float("inf"), float("inf"), False)
    if out.numel() == 0:
        return CheckResult(0.0, 0.0, True)
    o, r = out.double(), ref.double()
    finite = bool(torch.isfinite(o).all())
    diff = (o - r).nan_to_num(nan=float("inf"))
    ref_norm, ref_max = float(r.norm()), float(r.abs().max())
    rel_l2 = float(diff.norm()) / ref_norm if ref_norm else float(diff.norm())
    max_rel = float(diff.abs().max()) / ref_max if ref_max else float(diff.abs().max())
    return CheckResult(rel_l2, max_rel, finite)


def expert_rows_reference(
    x: torch.Tensor, sizes: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of rows grouped by expert, in fp32 with the activation rounded to x's dtype (as the kernel)."""
    from flashmoe.reference import swiglu_expert

    out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(sizes):
        if n:
            rows = slice(start, start + n)
            out[rows] = swiglu_expert(x[rows].float(), w13[e].float(), w2[e].float(), x.dtype).to(x.dtype)
            start += n
    return out


# ------------------------------------------------------------------------------------------- fp8


def fp8_budget(intermediate: int):
    """(whole-output relative Frobenius budget, any row's budget, rows before the first applies) of an fp8
    output against the fp8 reference: ``tests/tolerances.py``'s same-rounding :class:`Budget`."""
    from .testsuite import tolerances

    return tolerances().kernel_budgets("fp8", intermediate)["ref"]


def error_stats(out: torch.Tensor, ref: torch.Tensor):
    """``tests/tolerances.py``'s :class:`ErrorStats` of ``out`` against ``ref`` (summable over layers and
    ranks); an output of the wrong shape counts as non-finite, so it fails any budget."""
    from .testsuite import tolerances

    tol = tolerances()
    if tuple(out.shape) != tuple(ref.shape):
        return tol.ErrorStats(nonfinite=max(1, out.numel()), rows=ref.shape[0] if ref.dim() else 0)
    return tol.error_stats(out, ref)


def empty_stats():
    from .testsuite import tolerances

    return tolerances().ErrorStats()


def reduce_stats(stats, group, device: torch.device):
    """Every rank's stats combined (sums added, maxima maxed): collective over ``group``."""
    import torch.distributed as dist

    from .testsuite import tolerances

    sums, maxima = stats.as_tensor(device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return tolerances().ErrorStats.from_tensors(sums, maxima)


def fp8_within(stats, intermediate: int) -> bool:
    return stats.within(*fp8_budget(intermediate))


def expert_rows_reference_fp8(x: torch.Tensor, sizes: list[int], w13, w2) -> torch.Tensor:
    """bf16 [N, H]: rows grouped by local expert through the fp8 reference, each row as a token routed to
    its expert alone with weight 1 (the combine of one term is the expert's bf16 output itself).
    ``w13``/``w2``: :class:`~moe_bench.grouped_gemm.BlockFp8`."""
    from flashmoe import ExpertPlacement
    from flashmoe.reference_fp8 import moe_reference_fp8

    num_local = w13.shape[0]
    ids = torch.repeat_interleave(
        torch.arange(num_local, device=x.device), torch.tensor(sizes, device=x.device), output_size=x.shape[0]
    )
    return moe_reference_fp8(
        x,
        ids.to(torch.int32).unsqueeze(1),
        torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device),
        w13.q,
        w13.scale_inv,
        w2.q,
        w2.scale_inv,
        ExpertPlacement.contiguous(num_local, 1),
    )
