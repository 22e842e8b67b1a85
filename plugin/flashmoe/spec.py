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
    dtype: torch.dtype = torch.bfloat16  # hidden states and output
    # None: weights in ``dtype``. torch.float8_e4m3fn: block-fp8 experts (128x128 blocks, fp32
    # ``*_scale_inv`` per block, bf16 activations; the contract is in flashmoe.validation).
    weight_dtype: torch.dtype | None = None

    def __post_init__(self):
        check_spec(self)
        if self.weight_dtype == self.dtype:  # one spelling per layer kind: None means "same as dtype"
            object.__setattr__(self, "weight_dtype", None)

    @property
    def fp8_weights(self) -> bool:
        """Whether the layer's experts are block-fp8 (each call then takes the two scale tensors)."""
        return self.weight_dtype == torch.float8_e4m3fn
