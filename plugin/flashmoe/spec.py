"""Static description of one MoE layer, as the engines report it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoELayerSpec:
    num_experts: int  # global (physical) experts
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert, per partition (w13 is [E_local, 2 * this, H])
    max_tokens_per_rank: int  # most tokens one rank passes to one call
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens_per_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoELayerSpec.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
