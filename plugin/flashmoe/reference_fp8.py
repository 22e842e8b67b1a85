"""The fp8 block-scaled MoE layer (issue 15) in PyTorch: the semantics an fp8 kernel must match.

The function is :mod:`flashmoe.reference`'s (same routing, -1 slots, duplicate ids counted twice,
gate rows first in ``w13``, the same combine), with the weights as vLLM and SGLang load a block-fp8
checkpoint (DeepSeek-V3, Qwen3-30B-A3B-FP8), read in place::

    w13 [E_local, 2I, H] e4m3, w13_scale_inv [E_local, 2I/128, H/128] fp32
    w2  [E_local, H, I]  e4m3, w2_scale_inv  [E_local, H/128, I/128]  fp32

(the contract and its checks: :mod:`flashmoe.validation`; the quantisation rule and its sources:
:mod:`flashmoe.fp8`). One (token t, slot j) with expert e, step by step, with the kernel's rounding
points; every step is fp32 unless it says otherwise:

1. Dispatch quantises the bf16 token once, per 128-group of H: ``(qx, sx) = quantize(x[t])``.
2. GEMM0 over K = H in 128-blocks ``kb``, ascending::

       P[n, kb]    = sum_{i in kb} qx[i] * w13[e, n, i]      exact, rounded once to fp32
       gate_up[n] += (sx[kb] * w13_scale_inv[e, n // 128, kb]) * P[n, kb]

   The kernel's partial sum P is the tensor core's (fp8 WGMMA, promoted to fp32 registers every
   128-K block as DeepGEMM does); the reference's is the exact sum rounded once (exact in float64:
   products of two e4m3 values sit on a 2**-18 grid below 2**18, so 128 of them need 43 bits). The
   scale product, its multiply and the add are three fp32 roundings (the kernel may fuse the last two
   into an FMA).
3. SwiGLU: ``act = silu(gate) * up`` with gate = rows ``[0, I)``, up = rows ``[I, 2I)``; silu is
   evaluated in float64 and rounded to fp32 (so it does not depend on where torch's vectorised loop
   puts an element), the product is fp32.
4. ``(qa, sa) = quantize(act)`` per 128-group of I, straight from fp32 (no bf16 rounding before it;
   vLLM's Triton path rounds gate_up and act to bf16 first).
5. GEMM1 as step 2 over K = I with ``w2`` and ``w2_scale_inv``: ``y[h]``, fp32.
6. ``y`` is rounded to bf16 (the combine payload, as in the bf16 path).
7. ``out[t] = sum_j topk_weights[t, j] * y_j`` in fp32 in ascending j, rounded once to bf16.

So the reference is deterministic: a (token, slot)'s value does not depend on the batch, the
placement or the EP world (the distributed reference equals the single-rank one bit for bit).

:func:`moe_oracle_fp64_fp8` is the same function in float64. It keeps the quantisations: the weights'
dequantised values (exact in float64), and the two activation quantisations with the rule of
:mod:`flashmoe.fp8` itself (fp32 scale, reciprocal and product), applied to its own values -- x is
bf16, so its ``qx`` and scales are the reference's bit for bit; the activation is float64, rounded
to fp32 as the quantiser reads it. It drops every other rounding: the fp32 partial sums, scale
products and accumulation (it dequantises and multiplies in float64), the fp32 SwiGLU, the bf16
rounding of each expert output and of the result (it returns float64). Why not a float64
quantiser: the fp32 rule decides exact e4m3 ties, which bf16 input hits often (:mod:`flashmoe.fp8`),
and one tie decided the other way moves a whole GEMM0 row by ~1e-3, which flips ~1% of that row's
activation roundings: an oracle that broke ties to even disagreed with the reference by 5.6e-3
instead of 2.3e-3 (16 tokens, H=512, I=256). The oracle's and the reference's activations still
differ by fp32 rounding, so an activation element near a rounding boundary can land on the other
side: the flips that ``tests/tolerances.py`` budgets for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import validation
from .fp8 import GROUP, dequantize_per_token_group, dequantize_weight_blocks, quantize_per_token_group
from .placement import ExpertPlacement
from .reference import _combine_distributed, _combine_local, _per_expert


def block_scaled_gemm(
    q_a: torch.Tensor, s_a: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor
) -> torch.Tensor:
    """``a @ w.T`` for ``a = (q_a [n, K] e4m3, s_a [n, K/128])`` per-row-group scaled and ``w = (q_w [N, K]
    e4m3, s_w [N/128, K/128])`` block scaled, with the kernel's promotion: per 128-K block the exact
    partial sum rounded to fp32, times ``s_a * s_w`` (fp32), added in ascending block order. fp32 [n, N]."""
    n, K = q_a.shape
    w_scale = s_w.repeat_interleave(GROUP, dim=0)  # [N, K/128]: each output row's block scales
    acc = torch.zeros(n, q_w.shape[0], dtype=torch.float32, device=q_a.device)
    for kb in range(K // GROUP):
        cols = slice(kb * GROUP, (kb + 1) * GROUP)
        partial = (q_a[:, cols].double() @ q_w[:, cols].double().t()).float()  # exact sum, one rounding
        acc += (s_a[:, kb : kb + 1] * w_scale[:, kb]) * partial
    return acc


def _fp8_expert_outputs(rows_x, local, w13, w13_scale_inv, w2, w2_scale_inv) -> torch.Tensor:
    """Steps 1-6 for a flat list of (row, local expert) pairs: bf16 [n, H]."""
    q_x, s_x = quantize_per_token_group(rows_x)  # per row: a token sent to two experts quantises alike
    inter = w13.shape[1] // 2

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = block_scaled_gemm(q_x[rows], s_x[rows], w13[e], w13_scale_inv[e])
        act = F.silu(gate_up[:, :inter].double()).float() * gate_up[:, inter:]
        q_a, s_a = quantize_per_token_group(act)
        return block_scaled_gemm(q_a, s_a, w2[e], w2_scale_inv[e])

    y = torch.empty(rows_x.shape[0], w2.shape[1], dtype=torch.float32, device=rows_x.device)
    return _per_expert(local, y, expert).to(torch.bfloat16)


def _oracle_expert_outputs(rows_x, local, w13, w13_scale_inv, w2, w2_scale_inv) -> torch.Tensor:
    """The oracle's expert outputs, float64 [n, H]: dequantised operands, float64 arithmetic."""
    x64 = dequantize_per_token_group(*quantize_per_token_group(rows_x), dtype=torch.float64)
    inter = w13.shape[1] // 2

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = x64[rows] @ dequantize_weight_blocks(w13[e], w13_scale_inv[e], dtype=torch.float64).t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        act = dequantize_per_token_group(*quantize_per_token_group(act), dtype=torch.float64)
        return act @ dequantize_weight_blocks(w2[e], w2_scale_inv[e], dtype=torch.float64).t()

    y = torch.empty(rows_x.shape[0], w2.shape[1], dtype=torch.float64, device=rows_x.device)
    return _per_expert(local, y, expert)


def _single_rank_layer(
    who,
    expert_outputs,
    acc_dtype,
    out_dtype,
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_scale_inv,
    w2,
    w2_scale_inv,
    placement: ExpertPlacement | None,
) -> torch.Tensor:
    """The single-rank fp8 layer with ``expert_outputs(rows_x, local, w13, w13_scale_inv, w2, w2_scale_inv)``
    (the reference's or the oracle's), after the fp8 input checks."""
    validation.require_tensor("w13", w13)
    if placement is None:
        placement = ExpertPlacement.contiguous(w13.shape[0], 1)
    if placement.world_size != 1:
        raise ValueError(
            f"{who} computes a whole layer on one rank; use moe_reference_distributed_fp8 for EP groups"
        )
    scales = {"w13_scale_inv": w13_scale_inv, "w2_scale_inv": w2_scale_inv}
    validation.check_call(x, topk_ids, topk_weights, w13, w2, placement, 0, **scales)
    weights = (w13, w13_scale_inv, w2, w2_scale_inv)
    return _single_rank_impl(
        expert_outputs, acc_dtype, out_dtype, x, topk_ids, topk_weights, weights, placement
    )


def _single_rank_impl(expert_outputs, acc_dtype, out_dtype, x, topk_ids, topk_weights, weights, placement):
    """The single-rank fp8 layer without the input checks; ``weights`` = (w13, w13_scale_inv, w2, w2_scale_inv)."""

    def outputs(rows_x, local):
        return expert_outputs(rows_x, local, *weights)

    return _combine_local(x, topk_ids, topk_weights, placement, outputs, acc_dtype, out_dtype)


def _reference_fp8_impl(
    x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, placement
) -> torch.Tensor:
    """moe_reference_fp8 without the input checks (FlashMoE has made them)."""
    weights = (w13, w13_scale_inv, w2, w2_scale_inv)
    return _single_rank_impl(
        _fp8_expert_outputs, torch.float32, torch.bfloat16, x, topk_ids, topk_weights, weights, placement
    )


def moe_reference_fp8(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    placement: ExpertPlacement | None = None,
) -> torch.Tensor:
    """Single-process fp8 reference (bf16 [T, H]): ``w13``/``w2`` and their scales hold every expert."""
    return _single_rank_layer(
        "moe_reference_fp8",
        _fp8_expert_outputs,
        torch.float32,
        torch.bfloat16,
        hidden_states,
        topk_ids,
        topk_weights,
        w13,
        w13_scale_inv,
        w2,
        w2_scale_inv,
        placement,
    )


def moe_oracle_fp64_fp8(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    placement: ExpertPlacement | None = None,
) -> torch.Tensor:
    """The fp8 function in float64 (returns float64): quantisation grids kept, other roundings dropped
    (module docstring)."""
    return _single_rank_layer(
        "moe_oracle_fp64_fp8",
        _oracle_expert_outputs,
        torch.float64,
        torch.float64,
        hidden_states,
        topk_ids,
        topk_weights,
        w13,
        w13_scale_inv,
        w2,
        w2_scale_inv,
        placement,
    )


def moe_reference_distributed_fp8(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    placement: ExpertPlacement,
    group=None,
) -> torch.Tensor:
    """:func:`flashmoe.moe_reference_distributed` with fp8 weights: every rank of ``group`` calls it with
    its own tokens and its own experts' weights and scales. Token rows travel in bf16 and are quantised
    on the expert's rank (the kernel sends them quantised; per-token quantisation gives the same
    values either way); expert outputs travel back in bf16, as in the bf16 path."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    if placement.world_size != world_size:
        raise ValueError(f"placement is for {placement.world_size} ranks but the group has {world_size}")
    scales = {"w13_scale_inv": w13_scale_inv, "w2_scale_inv": w2_scale_inv}
    validation.check_call(
        hidden_states, topk_ids, topk_weights, w13, w2, placement, dist.get_rank(group), **scales
    )
    return _reference_distributed_fp8_impl(
        hidden_states, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, placement, group
    )


def _reference_distributed_fp8_impl(
    hidden_states, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, placement, group
) -> torch.Tensor:
    """moe_reference_distributed_fp8 without the input checks (FlashMoE has made them)."""

    def expert_outputs(rows_x, local):
        return _fp8_expert_outputs(rows_x, local, w13, w13_scale_inv, w2, w2_scale_inv)

    return _combine_distributed(hidden_states, topk_ids, topk_weights, placement, group, expert_outputs)
