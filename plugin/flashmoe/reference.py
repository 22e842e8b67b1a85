"""The function the megakernel computes, in PyTorch: the semantics every backend must match.

One MoE layer call on one rank of an expert-parallel group::

    out[t] = sum_j  topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t])        (j with id >= 0)
    expert_e(x) = w2[e] @ (silu(w13[e][:I] @ x) * (w13[e][I:] @ x))                         (SwiGLU)

The sum runs over slots, not distinct experts: an id that appears twice in a row counts twice, each
time with its own weight. ``-1`` marks an empty slot. The tensor contract, id rules and every input
check are in :mod:`flashmoe.validation`, which all backends call before computing.

``w13`` is the engine's fused gate/up weight ``[E_local, 2I, H]`` with the gate rows first (vLLM
loads ``gate_proj`` into shard 0 and ``up_proj`` into shard 1, and ``silu_and_mul`` takes
``silu(x[:I]) * x[I:]``); ``w2`` is ``[E_local, H, I]``.

Rounding follows the kernel exactly: both GEMMs accumulate in fp32; the SwiGLU activation and each
expert's output are rounded to the activation dtype (the kernel stores them in bf16, the latter in
the source rank's combine buffer); the weighted sum over ``j`` runs in fp32 in ascending ``j``
order and is rounded once. :func:`moe_oracle_fp64` is the same function with no rounding at all.

:func:`moe_reference_distributed` is a real expert-parallel implementation over ``torch.distributed``
(gloo on CPU, NCCL on GPU): tokens go once to each rank that owns one of their experts, results come
back per (token, j) and are summed at the source in the same order, so it equals the single-rank
result up to GEMM blocking. The vLLM and SGLang adapters use it as the CPU backend.

The fp8 block-scaled layer (fp8 weights with per-block scales, activations quantised per token group)
is :mod:`flashmoe.reference_fp8`: the same routing and combine (``_combine_local``,
``_combine_distributed`` below take the expert computation as a function), different experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import validation
from .placement import ExpertPlacement


def swiglu_expert(
    x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor, round_dtype: torch.dtype | None
) -> torch.Tensor:
    """expert(x) for rows x, computed in the dtype of ``x``; optional rounding of the activation."""
    I = w13_e.shape[0] // 2
    gate_up = x @ w13_e.t()
    act = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    if round_dtype is not None:
        act = act.to(round_dtype).to(x.dtype)
    return act @ w2_e.t()


def _per_expert(local_ids: torch.Tensor, out: torch.Tensor, compute) -> torch.Tensor:
    """``out[rows] = compute(e, rows)`` for each local expert ``e`` in ``local_ids``, ``rows`` being the
    indices ``n`` with ``local_ids[n] == e`` in ascending order (one call per expert)."""
    if local_ids.numel() == 0:
        return out
    order = torch.argsort(local_ids, stable=True)
    experts, counts = torch.unique_consecutive(local_ids[order], return_counts=True)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist(), strict=False):
        rows = order[start : start + c]
        start += c
        out[rows] = compute(e, rows)
    return out


def _expert_outputs(
    x: torch.Tensor,
    local_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    compute_dtype: torch.dtype,
    round_dtype,
) -> torch.Tensor:
    """y[n] = expert_{local_ids[n]}(x[n]) for a flat list of (row, local expert) pairs, grouped by expert."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return swiglu_expert(
            x[rows].to(compute_dtype), w13[e].to(compute_dtype), w2[e].to(compute_dtype), round_dtype
        )

    y = torch.empty(x.shape[0], w2.shape[1], dtype=compute_dtype, device=x.device)
    return _per_expert(local_ids, y, expert)


def _weighted_sum(
    y: torch.Tensor, valid: torch.Tensor, topk_weights: torch.Tensor, acc_dtype, out_dtype
) -> torch.Tensor:
    """sum_j w[t,j] * y[t,j] in ascending j, invalid slots contributing nothing. y: [T, k, H]."""
    T, k, H = y.shape
    out = torch.zeros(T, H, dtype=acc_dtype, device=y.device)
    w = torch.where(valid, topk_weights, torch.zeros_like(topk_weights)).to(acc_dtype)
    for j in range(k):  # fixed order, as the kernel's combine
        out += w[:, j : j + 1] * y[:, j].to(acc_dtype)
    return out.to(out_dtype)


def moe_reference(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    placement: ExpertPlacement | None = None,
    rank: int = 0,
) -> torch.Tensor:
    """Single-process reference: ``w13``/``w2`` hold every expert (one rank owns all)."""
    validation.require_tensor("w13", w13)
    if placement is None:
        placement = ExpertPlacement.contiguous(w13.shape[0], 1)
    if placement.world_size != 1:
        raise ValueError(
            "moe_reference computes a whole layer on one rank; use moe_reference_distributed for EP groups"
        )
    validation.check_call(hidden_states, topk_ids, topk_weights, w13, w2, placement, rank)
    return _reference_impl(
        hidden_states, topk_ids, topk_weights, w13, w2, placement, torch.float32, hidden_states.dtype
    )


def moe_oracle_fp64(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    placement: ExpertPlacement | None = None,
) -> torch.Tensor:
    """The same function in float64 with no intermediate rounding (returns float64)."""
    validation.require_tensor("w13", w13)
    if placement is None:
        placement = ExpertPlacement.contiguous(w13.shape[0], 1)
    validation.check_call(hidden_states, topk_ids, topk_weights, w13, w2, placement, 0)
    return _reference_impl(
        hidden_states,
        topk_ids,
        topk_weights,
        w13,
        w2,
        placement,
        torch.float64,
        torch.float64,
        rounding=False,
    )


def _reference_impl(x, topk_ids, topk_weights, w13, w2, placement, compute_dtype, out_dtype, rounding=True):
    round_dtype = x.dtype if rounding and compute_dtype != x.dtype else None

    def expert_outputs(rows_x, local):
        y = _expert_outputs(rows_x, local, w13, w2, compute_dtype, round_dtype)
        return y if round_dtype is None else y.to(round_dtype).to(compute_dtype)

    return _combine_local(x, topk_ids, topk_weights, placement, expert_outputs, compute_dtype, out_dtype)


def _combine_local(x, topk_ids, topk_weights, placement, expert_outputs, acc_dtype, out_dtype):
    """One rank owning every expert: ``expert_outputs(rows, local_ids)`` gives each valid (token, j)
    pair's expert output (``rows``: the pairs' token rows of ``x``), summed over j by
    :func:`_weighted_sum`. The bf16 and fp8 semantics differ only in ``expert_outputs``."""
    T, k = topk_ids.shape
    H = x.shape[1]
    valid = topk_ids >= 0
    flat_ids = topk_ids.reshape(-1).long()
    pairs = torch.nonzero(valid.reshape(-1)).flatten()
    local = placement.expert_local.to(x.device)[flat_ids[pairs]].long()
    y = torch.zeros(T * k, H, dtype=acc_dtype, device=x.device)
    y[pairs] = expert_outputs(x[pairs // k], local).to(acc_dtype)
    return _weighted_sum(y.view(T, k, H), valid, topk_weights, acc_dtype, out_dtype)


def moe_reference_distributed(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    placement: ExpertPlacement,
    group=None,
) -> torch.Tensor:
    """Expert-parallel reference over ``torch.distributed``: this rank's tokens in, this rank's output out.

    Every rank of ``group`` must call it (collectives), each with its own tokens (T may be 0 or differ
    per rank) and its own experts' weights. Payload-efficient like the kernel: a token row travels once
    to each rank owning one of its experts; results travel back once per (token, j).
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    if placement.world_size != world_size:
        raise ValueError(f"placement is for {placement.world_size} ranks but the group has {world_size}")
    validation.check_call(hidden_states, topk_ids, topk_weights, w13, w2, placement, dist.get_rank(group))
    return _reference_distributed_impl(hidden_states, topk_ids, topk_weights, w13, w2, placement, group)


def _reference_distributed_impl(
    hidden_states, topk_ids, topk_weights, w13, w2, placement, group
) -> torch.Tensor:
    """moe_reference_distributed without the input checks (FlashMoE has made them already)."""
    x = hidden_states
    round_dtype = x.dtype if x.dtype != torch.float32 else None

    def expert_outputs(rows_x, local):
        return _expert_outputs(rows_x, local, w13, w2, torch.float32, round_dtype).to(x.dtype)

    return _combine_distributed(hidden_states, topk_ids, topk_weights, placement, group, expert_outputs)


def _combine_distributed(hidden_states, topk_ids, topk_weights, placement, group, expert_outputs):
    """The expert-parallel skeleton: ``expert_outputs(rows, local_ids)`` runs on the owning rank for the
    received rows, returns one output per (row, local expert) pair in ``hidden_states``' dtype (what
    travels back), and the source sums them over j in fp32 as the single-rank reference does."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    x = hidden_states
    dev = x.device
    T, k = topk_ids.shape
    H = x.shape[1]
    expert_rank = placement.expert_rank.to(dev)
    expert_local = placement.expert_local.to(dev)

    valid = topk_ids >= 0
    safe_ids = torch.where(valid, topk_ids, torch.zeros_like(topk_ids)).long()
    dest = torch.where(valid, expert_rank[safe_ids].long(), torch.full_like(safe_ids, -1))  # [T, k]

    # Token rows per destination (deduplicated), grouped by destination, ascending token order.
    hit_t, hit_j = torch.nonzero(valid, as_tuple=True)  # token-major, ascending j
    hit_dest = dest[hit_t, hit_j]
    onehot = torch.zeros(T, world_size, dtype=torch.bool, device=dev)
    onehot[hit_t, hit_dest] = True
    send_dest, send_tok = torch.nonzero(onehot.t(), as_tuple=True)  # sorted by dest then token
    row_counts = torch.bincount(send_dest, minlength=world_size)
    # Per sent row: ids masked to the destination's experts (as local ids, -1 elsewhere).
    send_ids = torch.where(
        dest[send_tok] == send_dest[:, None],
        expert_local[safe_ids[send_tok]],
        torch.full_like(safe_ids[send_tok], -1).int(),
    )
    send_ids = send_ids.to(torch.int32)

    recv_row_counts = _exchange_counts(row_counts, group)
    recv_x = _all_to_all(x[send_tok], row_counts, recv_row_counts, group)
    recv_ids = _all_to_all(send_ids, row_counts, recv_row_counts, group)

    # Compute every (received row, j) hit, in row-major order.
    r_valid = recv_ids >= 0
    r_pairs = torch.nonzero(r_valid.reshape(-1)).flatten()
    r_rows = r_pairs // k
    r_local = recv_ids.reshape(-1)[r_pairs].long()
    y = expert_outputs(recv_x[r_rows], r_local)

    # Send results back: per source rank, its rows' hits in the order it sent them.
    src_of_row = torch.repeat_interleave(torch.arange(world_size, device=dev), recv_row_counts)
    back_counts = torch.bincount(src_of_row[r_rows], minlength=world_size)
    expect_counts = torch.bincount(hit_dest, minlength=world_size)
    y_back = _all_to_all(y, back_counts, expect_counts, group)

    # Hits came back grouped by destination, within it by (token, j): scatter to [T, k].
    order = torch.argsort(hit_dest, stable=True)
    y_full = torch.zeros(T * k, H, dtype=torch.float32, device=dev)
    y_full[(hit_t * k + hit_j)[order]] = y_back.float()
    return _weighted_sum(y_full.view(T, k, H), valid, topk_weights, torch.float32, x.dtype)


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _all_to_all(t: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty((int(recv_counts.sum()),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_to_all_single(
        out,
        t.contiguous(),
        output_split_sizes=recv_counts.tolist(),
        input_split_sizes=send_counts.tolist(),
        group=group,
    )
    return out
