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


# ------------------------------------------------------------------------------------ fp8 weights
#
# The fp8 baselines' expert stage (``--dtype fp8``): the same SwiGLU MLP over rows grouped by local expert,
# with block-fp8 weights (:mod:`flashmoe.fp8`: e4m3 values, one fp32 ``scale_inv`` per 128 x 128 block).
# Two implementations, chosen once per run (``--fp8-gemm``) and named in every baseline row's ``backend``:
#
# * ``scaled_mm_loop`` — the fp8 layer's own function: each row quantised per 128-group
#   (:func:`flashmoe.fp8.quantize_per_token_group`), one ``torch._scaled_mm`` per non-empty expert with 1x128
#   activation scales and the weights' block scales (cuBLASLt on sm_90, CUDA >= 12.9; see
#   :func:`weight_scale_recipe`) giving GEMM0 in fp32, the SwiGLU in fp32, the activation quantised per
#   128-group the same way, GEMM1 to bf16. Checked against :func:`flashmoe.reference_fp8.moe_reference_fp8`
#   with the fp8 budgets.
# * ``dequant_bf16_mm_loop`` — where torch has no block-scaled fp8 GEMM on the device (e.g. a CPU): each
#   touched expert's weights dequantised to bf16 on every call (fp32 product, one rounding), then the bf16
#   SwiGLU with ``torch.mm``. Activations are not quantised, so it computes another function (the bf16
#   layer on the dequantised weights) and is checked against that, with the bf16 check.
#
# Both loop over experts on the host with host-side group sizes (no sync: the callers have them), so
# they can be graph-captured per input set like compute_only's bf16 GEMMs.

SCALED_MM_LOOP = "scaled_mm_loop"
DEQUANT_MM_LOOP = "dequant_bf16_mm_loop"
FP8_GEMM_CHOICES = ("auto", SCALED_MM_LOOP, DEQUANT_MM_LOOP)
SCALED_MM_ROW_MULTIPLE = 4  # cuBLASLt's block-scaled fp8 GEMM wants M % 4 == 0 (vLLM pads the same way)

# How cuBLASLt reads 128x128 block scales: K-major with a leading dimension of round_up(K/128, 4) (cuBLAS
# docs, "1D and 128x128 2D block scaling for FP8"; PyTorch's test/test_scaled_matmul_cuda.py pads them so,
# `_pad_128x128_scales`). torch._scaled_mm (ScaledBlas.cpp, is_blockwise_128x128_scaling) accepts only the
# unpadded [N/128, K/128] row-major layout and passes its pointer on, so where K/128 % 4 != 0 and the
# weight has more than one 128-row block, cuBLASLt reads every block row after the first from the wrong
# place: no error, a wrong product (the probe below on H200s, K = 384, N = 256: rel err 31.9,
# benchmarks/results/2026-11-22-h200x2-layer-serving-fp8.json, config.fp8.expert_gemm_note). There the
# weights' scales go as 1x128 (one scale per row and 128-K group, each row its block's), which torch and
# cuBLASLt lay out alike ([K/128, N] N-major) and which computes the same products.
SCALE_LEADING_DIM_MULTIPLE = 4
BLOCK_128x128 = "128x128"
BLOCK_1x128 = "1x128 (block scales repeated per row)"


def weight_scale_recipe(n: int, k: int) -> str:
    """The scale recipe :func:`scaled_mm_blockwise` uses for a weight ``[n, k]`` (see above)."""
    if -(-n // 128) == 1 or (k // 128) % SCALE_LEADING_DIM_MULTIPLE == 0:
        return BLOCK_128x128
    return BLOCK_1x128


def weight_scale_b(s_w: torch.Tensor) -> torch.Tensor:
    """``scale_b`` of ``torch._scaled_mm(a, w.T, ...)`` for block scales ``s_w [..., N/128, K/128]`` (one
    expert, or all of them: index the result by expert). 128x128: the transposed view; 1x128: ``[..., K/128,
    N]``, contiguous (a new tensor of N·K/128 fp32: compute it once per weight, not per call)."""
    n, k = s_w.shape[-2] * 128, s_w.shape[-1] * 128
    if weight_scale_recipe(n, k) == BLOCK_128x128:
        return s_w.transpose(-1, -2)
    return s_w.repeat_interleave(128, dim=-2).transpose(-1, -2).contiguous()


class BlockFp8:
    """One layer's block-fp8 expert weights, ``q [E_local, N, K]`` e4m3 and ``scale_inv [E_local, N/128,
    K/128]`` fp32 (dequantised weight = q x its block's scale_inv). ``shape`` is ``q``'s, so the baselines,
    which read only ``w13.shape[0]``, take it where they take a bf16 weight tensor."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor):
        if q.dim() != 3 or scale_inv.dim() != 3 or q.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"expected e4m3 [E, N, K] and fp32 [E, N/128, K/128], got {q.dtype} {tuple(q.shape)}"
            )
        self.q = q
        self.scale_inv = scale_inv
        self._scale_b = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def scale_b(self, e: int) -> torch.Tensor:
        """Expert ``e``'s ``scale_b`` for ``torch._scaled_mm`` (:func:`weight_scale_b`), built for every
        expert on first use (the warm-up before a graph capture) and kept."""
        if self._scale_b is None:
            self._scale_b = weight_scale_b(self.scale_inv)
        return self._scale_b[e]

    def expert(self, e: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Expert ``e``'s dequantised weight ``[N, K]``: the fp32 product (exact but for one rounding),
        rounded once to ``dtype``."""
        from flashmoe.fp8 import dequantize_weight_blocks

        return dequantize_weight_blocks(self.q[e], self.scale_inv[e], dtype=torch.float32).to(dtype)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Every expert's dequantised weight ``[E, N, K]``, one expert at a time (no fp32 copy of all)."""
        out = torch.empty(self.q.shape, dtype=dtype, device=self.q.device)
        for e in range(self.q.shape[0]):
            out[e] = self.expert(e, dtype)
        return out

    def as_bf16(self) -> _DequantizedExperts:
        """Indexable like a bf16 ``[E, N, K]`` weight tensor (``[e]``, ``.shape``), each expert dequantised
        when read: for per-expert reference loops without a bf16 copy of every expert."""
        return _DequantizedExperts(self)


class _DequantizedExperts:
    def __init__(self, weights: BlockFp8):
        self._w = weights
        self.shape = weights.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._w.expert(e, torch.bfloat16)


def scaled_mm_blockwise(
    q_a: torch.Tensor,
    s_a: torch.Tensor,
    q_w: torch.Tensor,
    s_w: torch.Tensor,
    out_dtype: torch.dtype,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ w.T`` for ``a = (q_a [m, K] e4m3, s_a [m, K/128] fp32)`` scaled per row and 128-group and ``w =
    (q_w [N, K] e4m3, s_w [N/128, K/128] fp32)`` per 128 x 128 block, by ``torch._scaled_mm`` with 1x128 scales
    on ``a`` and :func:`weight_scale_recipe`'s on ``w``. Layouts: ``a`` row-major, ``b = w.T`` column-major,
    ``scale_a`` [m, K/128] outer-dim-major (strides (1, m)), ``scale_b`` = :func:`weight_scale_b` of ``s_w``
    (pass it as ``scale_b`` to reuse it). Rows are zero-padded to a multiple of :data:`SCALED_MM_ROW_MULTIPLE`
    and the result sliced back."""
    m, K = q_a.shape
    pad = -m % SCALED_MM_ROW_MULTIPLE
    if pad:
        # Padded through a uint8 view: zero-filling and row copies need no fp8 kernels that way.
        a_bytes = torch.zeros(m + pad, K, dtype=torch.uint8, device=q_a.device)
        a_bytes[:m] = q_a.view(torch.uint8)
        q_a = a_bytes.view(torch.float8_e4m3fn)
        s_a = torch.cat((s_a, s_a.new_ones(pad, s_a.shape[1])))
    scale_a = s_a.t().contiguous().t()
    if scale_b is None:
        scale_b = weight_scale_b(s_w)
    out = torch._scaled_mm(q_a, q_w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[:m] if pad else out


class Fp8SwiGLU:
    """``y = swiglu(x)`` for bf16 rows grouped by local expert with :class:`BlockFp8` weights (see above).
    Same call as :class:`GroupedSwiGLU`; ``sizes`` (host list of rows per local expert) is required."""

    def __init__(self, impl: str):
        if impl not in (SCALED_MM_LOOP, DEQUANT_MM_LOOP):
            raise ValueError(f"fp8 expert GEMM {impl!r}: expected {SCALED_MM_LOOP} or {DEQUANT_MM_LOOP}")
        self.impl = impl

    def __call__(self, x: torch.Tensor, offs, sizes: list[int], w13: BlockFp8, w2: BlockFp8) -> torch.Tensor:
        if sizes is None:
            raise ValueError("the fp8 expert stage loops over experts: it needs the group sizes on the host")
        out = x.new_empty(x.shape[0], w2.shape[1])
        if x.shape[0] == 0:
            return out
        if self.impl == SCALED_MM_LOOP:
            return self._scaled(x, sizes, w13, w2, out)
        return self._dequant(x, sizes, w13, w2, out)

    @staticmethod
    def _scaled(x, sizes, w13: BlockFp8, w2: BlockFp8, out):
        from flashmoe.fp8 import quantize_per_token_group

        inter = w2.shape[2]
        q_x, s_x = quantize_per_token_group(x)
        gate_up = torch.empty(x.shape[0], 2 * inter, dtype=torch.float32, device=x.device)
        for e, rows in _groups(sizes):
            gate_up[rows] = scaled_mm_blockwise(
                q_x[rows], s_x[rows], w13.q[e], w13.scale_inv[e], torch.float32, w13.scale_b(e)
            )
        q_a, s_a = quantize_per_token_group(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        for e, rows in _groups(sizes):
            out[rows] = scaled_mm_blockwise(
                q_a[rows], s_a[rows], w2.q[e], w2.scale_inv[e], out.dtype, w2.scale_b(e)
            )
        return out

    @staticmethod
    def _dequant(x, sizes, w13: BlockFp8, w2: BlockFp8, out):
        inter = w2.shape[2]
        for e, rows in _groups(sizes):
            h = torch.mm(x[rows], w13.expert(e, x.dtype).t())
            out[rows] = torch.mm(F.silu(h[:, :inter]) * h[:, inter:], w2.expert(e, x.dtype).t())
        return out


def _groups(sizes: list[int]):
    """(expert, row slice) of each non-empty group."""
    start = 0
    for e, n in enumerate(sizes):
        if n:
            yield e, slice(start, start + n)
            start += n


def select_fp8_expert_gemm(requested: str, device: torch.device) -> tuple[str, str]:
    """(implementation, why). ``auto``: ``scaled_mm_loop`` if ``torch._scaled_mm`` takes the block-scaled
    recipe on ``device`` and agrees with the fp8 reference's GEMM on a probe, else the dequantising loop."""
    if requested not in FP8_GEMM_CHOICES:
        raise ValueError(f"--fp8-gemm {requested!r}: expected one of {FP8_GEMM_CHOICES}")
    if requested == DEQUANT_MM_LOOP:
        return DEQUANT_MM_LOOP, "requested: weights dequantised to bf16 per call, bf16 GEMMs (no fp8 GEMM)"
    try:
        err = _probe_scaled_mm(device)
    except Exception as e:  # no block-scaled fp8 GEMM here: that is the answer
        if requested == SCALED_MM_LOOP:
            raise
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return DEQUANT_MM_LOOP, (
            f"torch._scaled_mm has no 1x128 x 128x128 block-scaled fp8 GEMM here ({type(e).__name__}: {first_line})"
            "; weights dequantised to bf16 per call, bf16 GEMMs"
        )
    if not err <= SCALED_MM_PROBE_TOL:  # NaN (garbage read as a scale) disagrees too
        why = f"torch._scaled_mm (block-scaled) disagrees with the fp8 reference's GEMM (rel err {err:.3g})"
        if requested == SCALED_MM_LOOP:
            raise RuntimeError(why)
        return DEQUANT_MM_LOOP, why + "; weights dequantised to bf16 per call, bf16 GEMMs"
    return SCALED_MM_LOOP, (
        f"torch._scaled_mm per expert, 1x128 activation scales, weight block scales as 128x128 where K/128 % "
        f"{SCALE_LEADING_DIM_MULTIPLE} == 0 and as 1x128 per row elsewhere (config.fp8.scaled_mm_weight_scales), "
        f"fp32 GEMM0 output (probe rel err {err:.2g} against the fp8 reference's GEMM, both weight recipes)"
    )


# The probe's GEMMs differ from the reference's only in fp32 summation (and, if the tensor core keeps
# ~14 bits inside a 128-K block, in that: ~1e-4); a wrong scale layout is off by O(1).
SCALED_MM_PROBE_TOL = 1e-3


# (K, N) of the probe: K/128 = 3 takes the 1x128 weight recipe, K/128 = 4 the 128x128 one; two 128-row
# blocks each, so a block row read from the wrong place shows.
SCALED_MM_PROBE_SHAPES = ((384, 256), (512, 256))


def _probe_scaled_mm(device: torch.device) -> float:
    """Largest relative (Frobenius) error of :func:`scaled_mm_blockwise` against
    :func:`flashmoe.reference_fp8.block_scaled_gemm` over both weight-scale recipes and row counts off the
    padding multiple, with block scales of different magnitude (a scale read from the wrong block shows)."""
    from flashmoe.fp8 import quantize_per_token_group, quantize_weight_blocks
    from flashmoe.reference_fp8 import block_scaled_gemm

    gen = torch.Generator(device=device).manual_seed(0)
    errors = []
    for K, N in SCALED_MM_PROBE_SHAPES:
        w = torch.randn(N // 128, 128, K // 128, 128, generator=gen, device=device)
        w *= torch.rand(N // 128, 1, K // 128, 1, generator=gen, device=device) * 8 + 0.1
        q_w, s_w = quantize_weight_blocks(w.reshape(N, K))
        for m in (1, 5, 8, 33):
            a = torch.randn(m, K, generator=gen, device=device)
            a *= torch.rand(m, 1, generator=gen, device=device) * 4 + 0.1
            q_a, s_a = quantize_per_token_group(a.to(torch.bfloat16))
            got = scaled_mm_blockwise(q_a, s_a, q_w, s_w, torch.float32)
            want = block_scaled_gemm(q_a, s_a, q_w, s_w)
            if got.shape != want.shape:
                raise RuntimeError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
            errors.append(float((got - want).norm() / want.norm()))
    return float(torch.tensor(errors).max())  # NaN if any is (Python's max would drop it)
