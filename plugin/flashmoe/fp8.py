"""The fp8 number format and quantisation rule of flashmoe's fp8 path (issue 15): e4m3 values with
fp32 scales, per token per 128-group for activations, per 128x128 block for weights.

One rule for every quantisation (activations in dispatch, the SwiGLU activation before GEMM1, and
:func:`quantize_weight_blocks` for generated weights), over a group ``g`` of values::

    amax  = max(max |g|, AMAX_FLOOR)              AMAX_FLOOR = fp32(1e-4)
    scale = amax / 448                            fp32, correctly rounded (the stored scale)
    q     = e4m3_rne(clamp(g * (1 / scale), -448, 448))
    dequantised value = q * scale

``e4m3_rne`` is round-to-nearest-even onto the ``float8_e4m3fn`` grid (3 mantissa bits, subnormals
down to 2**-9, max 448): torch's fp32 -> float8_e4m3fn cast, and CUDA's
``cvt.rn.satfinite.e4m3x2.f32``. Every step is fp32 arithmetic on the fp32 value of the input
(exact for bf16): the scale is an fp32 number by contract, and ``1 / scale`` and the product are
correctly rounded fp32 operations, so an implementation that does the same (IEEE division and
reciprocal, no fast-math approximations) gets the same ``q`` and scales bit for bit. That matters:
``g * 448 / amax`` is *exactly* an e4m3 midpoint surprisingly often for bf16 input (when ``g`` and
``amax`` share a factor, e.g. 1.21875 in a group with amax 3.25 gives 168, halfway between 160 and
176: 1 element in 190 of Gaussian bf16 data), and the fp32 roundings of ``1 / scale`` and of the
product decide such a tie, not round-half-even (they decide 1 element in 2000 the other way). A
float64 input (the oracle's activation) is rounded to fp32 first, as the quantiser reads it.

What the ecosystem does, and the choice:

* DeepGEMM (``deep_gemm/utils/math.py``: ``per_token_cast_to_fp8``, ``per_block_cast_to_fp8``, the
  casts its tests and vLLM/SGLang's DeepGEMM paths are checked against): ``amax`` clamped to
  ``1e-4``, ``sf = amax / 448``, ``q = (x * (1 / sf)).to(e4m3)``, no explicit clamp (the cast
  rounds the largest element's 448 * (1 +- 2**-23) to 448 anyway). This is the rule above.
* vLLM ``per_token_group_quant_fp8`` (``vllm/model_executor/layers/quantization/utils/fp8_utils.py``
  and its CUDA kernel ``csrc/quantization/w8a8/fp8/per_token_group_quant.cu``): ``eps = 1e-10``,
  ``amax = max(max|x|, eps)``, ``y_s = amax / 448``, ``q = clamp(x / y_s, -448, 448)`` -- it
  *divides* (the CUDA kernel says the reciprocal "costs an ulp" and would break bit-exactness with
  its other kernel).
* DeepEP low-latency dispatch (``csrc/kernels/internode_ll.cu``, ``calculate_fp8_scales``): ``amax``
  starts at ``kFP8Margin = 1e-4``, multiplier ``448 / amax``, stored ``scale_inv = amax * (1/448)``
  (the fp32 constant ``1/448``, so the stored scale can differ from ``amax / 448`` by an ulp).

We take DeepGEMM's rule (it is also DeepGEMM's weight cast, so one rule covers every tensor). The
floor: ``1e-4`` (DeepEP, DeepGEMM) rather than vLLM's ``1e-10``. Both make an all-zero group well
defined (``q = 0``, a finite positive scale) and keep ``1 / scale`` finite for any bf16 input (with
no floor a group of amax 1e-37 would need 1 / 2.2e-40 = inf). They differ only on groups whose amax
is below 1e-4: vLLM's keeps 3 significant bits there down to 1e-10, the 1e-4 floor quantises them on
a fixed absolute grid (error <= 2**-10 * 1e-4 / 448 = 2.2e-10 per element), which is all an O(1)
token row needs (such a group is < 1e-4 of it), and is what the fp8 MoE recipe we follow (DeepEP
low-latency dispatch + DeepGEMM grouped GEMMs) does, so comparisons with it do not diverge on tiny
groups. The reciprocal: the kernel quantises in the dispatch loop and in the GEMM0 epilogue, one
division per group and a multiply per element instead of a division per element; the stored scale
is the correctly rounded ``amax / 448`` (vLLM, DeepGEMM), not DeepEP's ``amax * fp32(1/448)``.
UE8M0 (power-of-two) scales, DeepGEMM's Blackwell format, are not part of this path.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128  # activation group along K, and the weight block edge
AMAX_FLOOR = 1e-4  # compared in fp32, i.e. fp32(1e-4), as DeepEP's and DeepGEMM's fp32 clamp


def _quantize_groups(g: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on fp32 values ``g`` with their group maxima ``amax`` broadcast against them.

    The divisor is a tensor on ``amax``'s device, not a Python number: torch's CUDA division by a CPU
    scalar multiplies by the scalar's reciprocal (one more rounding), which moves ~1 scale in 3 by an
    ulp and with it the e4m3 ties the rule decides; tensor / tensor is IEEE division on both devices,
    so the reference computes the same bits on a GPU as on the CPU (checked on an H200 against the
    kernel's dispatch quantisation: scripts/fp8_internals.py)."""
    scale = amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, E4M3_MAX)
    scaled = (g * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(E4M3), scale


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(q e4m3 [..., K], scales [..., K / group])``, one scale per row per group
    of ``group`` consecutive elements; fp32 scales."""
    K = x.shape[-1]
    if K % group:
        raise ValueError(f"the last dimension ({K}) must be a multiple of the group size {group}")
    g = x.float().reshape(*x.shape[:-1], K // group, group)
    q, scale = _quantize_groups(g, g.abs().amax(dim=-1, keepdim=True))
    return q.reshape(x.shape), scale.squeeze(-1)


def dequantize_per_token_group(
    q: torch.Tensor, scales: torch.Tensor, group: int = GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` of its group, in ``dtype`` (exact in float64; fp32 rounds the 28-bit product)."""
    K = q.shape[-1]
    g = q.to(dtype).reshape(*q.shape[:-1], K // group, group)
    return (g * scales.to(dtype).unsqueeze(-1)).reshape(q.shape)


def quantize_weight_blocks(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(w e4m3 [..., N, K], scale_inv fp32 [..., N / block, K / block])``, one
    scale per ``block x block`` tile: the layout vLLM and SGLang load ``*_weight_scale_inv`` in
    (dequantised weight = e4m3 value * scale_inv of its block). N and K must be multiples of ``block``."""
    *batch, N, K = w.shape
    if N % block or K % block:
        raise ValueError(
            f"weight [..., {N}, {K}]: both dimensions must be multiples of the block size {block}"
        )
    tiles = w.float().reshape(*batch, N // block, block, K // block, block)
    q, scale = _quantize_groups(tiles, tiles.abs().amax(dim=(-3, -1), keepdim=True))
    return q.reshape(w.shape), scale.squeeze(-1).squeeze(-2)


def dequantize_weight_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int = GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Each e4m3 weight times its block's scale, in ``dtype`` (exact in float64)."""
    *batch, N, K = w.shape
    tiles = w.to(dtype).reshape(*batch, N // block, block, K // block, block)
    return (tiles * scale_inv.to(dtype)[..., :, None, :, None]).reshape(w.shape)
