"""Random MoE layer inputs for the correctness suites: routing, placements, weights, hidden states.

Every generator takes an explicit ``torch.Generator`` so a failing case is reproduced from its seed,
and produces the same values on every rank given the same seed (ranks draw the global batch and keep
their own rows). Routing gives each token ``top_k`` distinct experts, as a real router does, then
masks slots to -1 with probability ``drop_prob``; masked slots keep a non-zero weight so an
implementation that forgets to skip them is caught.
"""

from __future__ import annotations

import math

import torch
from flashmoe import ExpertPlacement

ROUTINGS = ("uniform", "zipf", "one_expert")
PLACEMENTS = ("contiguous", "round_robin", "random_permutation")
ZIPF_EXPONENT = 1.2  # expert popularity ~ 1/rank^1.2: the hottest of 128 experts gets ~25% of the slots


def make_placement(kind: str, num_experts: int, world: int, gen: torch.Generator) -> ExpertPlacement:
    """``random_permutation``: experts dealt out evenly after a random shuffle, local order shuffled too."""
    if kind == "contiguous":
        return ExpertPlacement.contiguous(num_experts, world)
    if kind == "round_robin":
        return ExpertPlacement.round_robin(num_experts, world)
    if kind == "random_permutation":
        perm = torch.randperm(num_experts, generator=gen)
        rank = torch.empty(num_experts, dtype=torch.int32)
        rank[perm] = (torch.arange(num_experts) % world).to(torch.int32)
        local = torch.empty(num_experts, dtype=torch.int32)
        for r in range(world):
            owned = torch.nonzero(rank == r).flatten()
            local[owned] = torch.randperm(owned.numel(), generator=gen).to(torch.int32)
        return ExpertPlacement(rank, local, world)
    raise ValueError(f"unknown placement kind {kind!r}; expected one of {PLACEMENTS}")


def random_routing(
    tokens: int,
    num_experts: int,
    top_k: int,
    kind: str,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
    drop_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]); ``kind`` in :data:`ROUTINGS`."""
    device = torch.device(device)
    if tokens == 0:
        return (
            torch.empty(0, top_k, dtype=torch.int32, device=device),
            torch.empty(0, top_k, dtype=torch.float32, device=device),
        )
    scores = torch.rand(tokens, num_experts, generator=gen, device=device)
    if kind == "uniform":
        ids = scores.topk(top_k, dim=1).indices
    elif kind == "zipf":
        popularity = (
            1.0 / torch.arange(1, num_experts + 1, device=device, dtype=torch.float64) ** ZIPF_EXPONENT
        )
        popularity = popularity[torch.randperm(num_experts, generator=gen, device=device)]
        ids = torch.multinomial(
            popularity.float().expand(tokens, num_experts), top_k, replacement=False, generator=gen
        )
    elif kind == "one_expert":
        hot = int(torch.randint(num_experts, (1,), generator=gen, device=device))
        scores[:, hot] = 2.0  # above every uniform score: in every token's top-k
        ids = scores.topk(top_k, dim=1).indices
    else:
        raise ValueError(f"unknown routing kind {kind!r}; expected one of {ROUTINGS}")
    # Random slot order per token, so expert order within a row carries no pattern.
    ids = ids.gather(1, torch.rand(tokens, top_k, generator=gen, device=device).argsort(dim=1))
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen, device=device), dim=1)
    if drop_prob > 0:
        ids = ids.masked_fill(torch.rand(tokens, top_k, generator=gen, device=device) < drop_prob, -1)
    return ids.to(torch.int32).contiguous(), weights.float().contiguous()


def random_hidden(
    tokens: int, hidden: int, gen: torch.Generator, device="cpu", dtype=torch.bfloat16
) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)


def random_expert_weights(
    num_experts: int, hidden: int, intermediate: int, gen: torch.Generator, device="cpu", dtype=torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) scaled by 1/sqrt(fan-in) so activations and outputs stay O(1)."""
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device=device, dtype=dtype)
    w13.mul_(1.0 / math.sqrt(hidden))
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen, device=device, dtype=dtype)
    w2.mul_(1.0 / math.sqrt(intermediate))
    return w13, w2


# fp8 inputs. Real block-fp8 checkpoints and activations have groups of very different magnitude (outlier
# channels, per-block weight scales over a decade or more); i.i.d. Gaussians would give every group the
# same scale, and a scale applied to the wrong group would go unnoticed. So each 128-group of a token
# and each 128 x 128 weight block is drawn with its own magnitude, 2**u with u uniform in
# [-FP8_LOG2_SPREAD, FP8_LOG2_SPREAD].
FP8_LOG2_SPREAD = 2.0


def _group_magnitudes(shape, gen: torch.Generator, device) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, device=device) * (2 * FP8_LOG2_SPREAD) - FP8_LOG2_SPREAD
    return torch.exp2(u)


def random_grouped_hidden(tokens: int, hidden: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """bf16 [T, H] (H a multiple of 128) with a random magnitude per (token, 128-group), RMS ~1."""
    x = torch.randn(tokens, hidden // 128, 128, generator=gen, device=device)
    x *= _group_magnitudes((tokens, hidden // 128, 1), gen, device)
    return (x / x.square().mean().clamp(min=1e-30).sqrt()).reshape(tokens, hidden).to(torch.bfloat16)


def random_fp8_expert_weights(
    num_experts: int, hidden: int, intermediate: int, gen: torch.Generator, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13, w13_scale_inv, w2, w2_scale_inv) as a block-fp8 checkpoint loads them: Gaussian weights
    scaled by 1/sqrt(fan-in) and by a random magnitude per 128 x 128 block, quantised with
    :func:`flashmoe.fp8.quantize_weight_blocks`. Drawn one expert at a time (a DeepSeek-V3 expert is
    44M weights; the fp32 draft of all of them would not fit a test's memory)."""
    from flashmoe.fp8 import quantize_weight_blocks

    def draw(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(rows // 128, 128, cols // 128, 128, generator=gen, device=device)
        w *= _group_magnitudes((rows // 128, 1, cols // 128, 1), gen, device) / math.sqrt(cols)
        return quantize_weight_blocks(w.reshape(rows, cols))

    w13, w13_scale_inv = zip(*(draw(2 * intermediate, hidden) for _ in range(num_experts)), strict=True)
    w2, w2_scale_inv = zip(*(draw(hidden, intermediate) for _ in range(num_experts)), strict=True)
    return torch.stack(w13), torch.stack(w13_scale_inv), torch.stack(w2), torch.stack(w2_scale_inv)


def local_weights(
    w13: torch.Tensor, w2: torch.Tensor, placement: ExpertPlacement, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``w13``/``w2`` (local index order) from weights indexed by global expert id."""
    ids = placement.local_experts(rank).long().to(w13.device)
    return w13.index_select(0, ids).contiguous(), w2.index_select(0, ids).contiguous()


def storage_order(placement: ExpertPlacement) -> tuple[ExpertPlacement, list[int]]:
    """Lay all experts out rank after rank, each rank's in local order, so that a rank's weights are
    the contiguous slice ``[offsets[r], offsets[r + 1])`` of one global tensor (a view, no copy).

    Returns the world-1 placement that reads that global tensor (for :func:`flashmoe.moe_reference`)
    and the offsets.
    """
    counts = [placement.num_local(r) for r in range(placement.world_size)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    start = torch.tensor(offsets[:-1], dtype=torch.int32)
    slot = start[placement.expert_rank.long()] + placement.expert_local
    return ExpertPlacement(torch.zeros_like(placement.expert_rank), slot.to(torch.int32), 1), offsets
