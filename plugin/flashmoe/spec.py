"""Static description of one MoE layer, as the engines report it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validation import check_spec


@dataclass(frozen=True)
class MoELayerSpec:
    num_experts: int  # global (physical) experts
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert, per partition (w13 is [E_local, 2 * this, H])
    max_tokens_per_rank: int  # most tokens one rank passes to one call
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        check_spec(self)
