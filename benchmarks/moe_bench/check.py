"""Correctness gate run on every variant before it is timed: its output against the reference.

Layers are compared with :func:`flashmoe.reference.moe_reference_distributed` on the same inputs;
``compute_only`` with a per-expert fp32 loop. Both error measures are relative to the reference as a
whole, so they do not blow up on near-zero elements, and loose enough for bf16 rounding differences
(a bf16 ulp is 2^-8 ≈ 0.4%; the baselines round the GEMM-1 output and the weighted terms, the
reference does not) yet far below what a dropped or misrouted expert does (tens of percent).
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
