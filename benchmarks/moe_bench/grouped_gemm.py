"""The expert stage every baseline shares: rows grouped by local expert -> SwiGLU MLP -> rows.

    h = x_e @ w13[e]^T          [n_e, 2I]   (gate rows first, as vLLM's w13)
    a = silu(h[:, :I]) * h[:, I:]
    y = a @ w2[e]^T             [n_e, H]

Two implementations of the grouped GEMM, chosen once per run and recorded in the JSON:

* ``torch._grouped_mm`` — on sm_90/sm_100 with bf16 operands it is a CUTLASS grouped GEMM that reads
  the group offsets on the device (no host sync); elsewhere ATen falls back to an mm loop.
* ``mm_loop`` — one ``torch.mm`` per non-empty expert, driven by host-side group sizes.

``auto`` probes ``torch._grouped_mm`` on a small problem with empty and odd-sized groups against the
loop and falls back to the loop if it is missing, raises, or disagrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM = "torch._grouped_mm"
MM_LOOP = "mm_loop"
GEMM_CHOICES = ("auto", GROUPED_MM, MM_LOOP)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    # w is [G, N, K] (nn.Linear layout); _grouped_mm wants [G, K, N] and takes the transposed view as is.
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def _mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(x[start : start + n], w[e].t(), out=out[start : start + n])
            start += n
    return out


class GroupedSwiGLU:
    """``y = swiglu(x)`` for rows grouped by local expert. ``offs``: int32 cumulative row ends on the
    device (for _grouped_mm); ``sizes``: the same counts on the host (for the loop)."""

    def __init__(self, impl: str):
        if impl not in (GROUPED_MM, MM_LOOP):
            raise ValueError(f"grouped GEMM {impl!r}: expected {GROUPED_MM} or {MM_LOOP}")
        self.impl = impl
        self._gemm = _grouped_mm if impl == GROUPED_MM else _mm_loop

    def __call__(
        self, x: torch.Tensor, offs: torch.Tensor, sizes: list[int], w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, w2.shape[1])
        inter = w2.shape[2]
        h = self._gemm(x, w13, offs, sizes)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        return self._gemm(a, w2, offs, sizes)


def group_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """int32 cumulative ends of groups of ``sizes`` rows, on the sizes' device."""
    return torch.cumsum(sizes, 0).to(torch.int32)


def select_grouped_gemm(requested: str, device: torch.device) -> tuple[str, str]:
    """(implementation, why). ``requested``: one of :data:`GEMM_CHOICES`."""
    if requested not in GEMM_CHOICES:
        raise ValueError(f"--grouped-gemm {requested!r}: expected one of {GEMM_CHOICES}")
    if requested == MM_LOOP:
        return MM_LOOP, "requested"
    if not hasattr(torch, "_grouped_mm"):
        if requested == GROUPED_MM:
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
        return MM_LOOP, f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        err = _probe(device)
    except Exception as e:  # an unsupported device/dtype raises here; that is the answer we want
        if requested == GROUPED_MM:
            raise
        return MM_LOOP, f"torch._grouped_mm failed its probe: {type(e).__name__}: {e}"[:300]
    if err > 2e-2:
        if requested == GROUPED_MM:
            raise RuntimeError(f"torch._grouped_mm disagrees with the mm loop (rel err {err:.3g})")
        return MM_LOOP, f"torch._grouped_mm disagrees with the mm loop (rel err {err:.3g})"
    return GROUPED_MM, _fast_path_note(device)


def _probe(device: torch.device) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    sizes = [5, 0, 33, 1, 0, 17]  # empty groups and sizes off any tile multiple
    G, K, N = len(sizes), 128, 96
    x = torch.randn(sum(sizes), K, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(G, N, K, device=device, generator=gen).to(torch.bfloat16)
    sizes_t = torch.tensor(sizes, device=device)
    offs = group_offsets(sizes_t)
    got = _grouped_mm(x, w, offs, sizes).float()
    want = _mm_loop(x, w, offs, sizes).float()
    return float((got - want).norm() / want.norm())


def _fast_path_note(device: torch.device) -> str:
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major in (9, 10):
            return f"CUTLASS grouped GEMM (sm_{major}0, bf16)"
        return f"ATen fallback loop inside torch._grouped_mm (sm_{major}x has no fast path)"
    return f"ATen {device.type} implementation"
