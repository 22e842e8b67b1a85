"""TP+EP token slicing: which tokens a rank hands to FlashMoE, and how the full output comes back.

Under ``--tensor-parallel-size W --enable-expert-parallel`` with no DP, every rank of the EP group
holds the same T tokens. Dispatching all of them from every rank repeats the expert work W times.
In ``tp-sliced`` mode rank r dispatches only its contiguous slice (the first ``T % W`` ranks one
extra token), then the combined slices are all-gathered over the EP group, so every rank ends with
the full ``[T, H]`` output, already reduced (vLLM must not all-reduce it again: the prepare/finalize
still reports ``output_is_reduced``). In ``full`` mode (DP+EP, sequence-parallel MoE, one rank, or
``FLASHMOE_TP_SLICE=0``) the rank's tokens go to FlashMoE unchanged.

No vLLM import here: :func:`sliced_forward` takes the all-gather as a callable (vLLM's
``GroupCoordinator.all_gather`` in the adapter, so it is CUDA-graph capturable), which keeps the
arithmetic testable over plain gloo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flashmoe import config

TP_SLICED = "tp-sliced"
FULL = "full"


def token_mode(parallel) -> tuple[str, str]:
    """(mode, why) for a layer with vLLM ``FusedMoEParallelConfig`` ``parallel``: the one place the
    slicing is decided. Tokens are replicated over the EP group exactly when EP spans only TP ranks
    (with EP, vLLM folds TP into ``ep_size`` and reports ``tp_size`` 1): no DP, no PCP, and no
    sequence-parallel MoE (that already chunks the tokens over TP)."""
    ep_size = getattr(parallel, "ep_size", 1)
    if not getattr(parallel, "use_ep", False) or ep_size <= 1:
        return FULL, "no expert parallelism across ranks"
    dp, pcp, sp = parallel.dp_size, getattr(parallel, "pcp_size", 1), getattr(parallel, "sp_size", 1)
    if dp > 1 or pcp > 1 or sp > 1:
        return FULL, f"tokens differ per rank (dp={dp}, pcp={pcp}, sp={sp})"
    if not config.tp_slice():
        return FULL, f"FLASHMOE_TP_SLICE=0: every rank of TP{ep_size}+EP dispatches all replicated tokens"
    return TP_SLICED, (
        f"TP{ep_size}+EP, tokens replicated: each rank dispatches its 1/{ep_size} slice, "
        "outputs all-gathered over the EP group"
    )


def token_slice(num_tokens: int, world: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank's contiguous slice; the first ``num_tokens % world`` ranks get one more."""
    base, extra = divmod(num_tokens, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def sliced_max_tokens(max_tokens: int, world: int) -> int:
    """Most tokens one rank dispatches per call when at most ``max_tokens`` are replicated."""
    return max(1, -(-max_tokens // world))


def sliced_forward(
    moe: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    rank: int,
    world: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Run ``moe`` (a FlashMoE) on rank's slice of the replicated tokens and fill ``out`` [T, H]
    with every rank's combined rows, in token order. Collective over the EP group: every rank calls
    it with the same T. ``all_gather(x [R, H]) -> [world * R, H]`` concatenates in rank order."""
    T, H = out.shape
    if T == 0:
        # T is the same on every rank, so all of them skip the gather together; the op still runs
        # (it is collective).
        return moe(hidden_states, topk_ids, topk_weights, w13, w2, out=out)
    rows = -(-T // world)  # every rank gathers this many rows; slices shorter by one carry a pad row
    start, count = token_slice(T, world, rank)
    part = out.new_empty(rows, H)
    end = start + count
    moe(hidden_states[start:end], topk_ids[start:end], topk_weights[start:end], w13, w2, out=part[:count])
    gathered = all_gather(part).view(world, rows, H)
    long_ranks = T % world or world  # ranks whose slice has all `rows` rows
    head = long_ranks * rows
    out[:head].copy_(gathered[:long_ranks].reshape(head, H))
    if head < T:
        out[head:].copy_(gathered[long_ranks:, : rows - 1].reshape(T - head, H))
    return out
