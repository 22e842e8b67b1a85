"""Top-k routing the benchmark feeds every variant: uniform, or Zipf-skewed over experts.

Uniform: each token picks k distinct experts uniformly at random. Zipf: expert popularity is
p_e ∝ 1 / rank_e^s over a fixed random ranking of the experts (the same on every rank, so the
same experts are hot everywhere), and each token draws k distinct experts from it — a few experts,
and the EP ranks that own them, get most of the rows. Gate weights are a softmax over the k picks.
"""

from __future__ import annotations

import zlib

import torch

ROUTINGS = ("uniform", "zipf")
POPULARITY_SEED = 20250  # fixes which experts are hot; shared by all ranks and runs


def zipf_popularity(num_experts: int, s: float, seed: int = POPULARITY_SEED) -> torch.Tensor:
    """p[e] = (1 / r_e^s) / sum, where r is a seeded random ranking 1..E of the experts (float64, CPU)."""
    if s < 0:
        raise ValueError(f"Zipf exponent must be >= 0, got {s}")
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed)).double() + 1.0
    p = ranks.pow(-s)
    return p / p.sum()


def case_seed(*parts) -> int:
    """A stable 31-bit seed from the parts that name one input set (model, tokens, routing, set, rank)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


def make_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    kind: str,
    seed: int,
    device: torch.device,
    zipf_s: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int32, topk_weights [T, k] float32) on ``device``; k distinct experts per token."""
    if kind not in ROUTINGS:
        raise ValueError(f"routing {kind!r}: expected one of {ROUTINGS}")
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} > {num_experts} experts")
    gen = torch.Generator(device=device).manual_seed(seed)
    if num_tokens == 0:
        ids = torch.empty(0, top_k, dtype=torch.int64, device=device)
    elif kind == "uniform":
        # The k largest of E iid uniforms are a uniform k-subset.
        ids = torch.rand(num_tokens, num_experts, generator=gen, device=device).topk(top_k, dim=1).indices
    else:
        p = zipf_popularity(num_experts, zipf_s).to(device=device, dtype=torch.float32)
        ids = torch.multinomial(p.expand(num_tokens, num_experts), top_k, replacement=False, generator=gen)
    logits = torch.randn(num_tokens, top_k, generator=gen, device=device)
    return ids.to(torch.int32), torch.softmax(logits, dim=1)
