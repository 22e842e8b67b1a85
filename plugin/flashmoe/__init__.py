"""flashmoe: a megakernel expert-parallel MoE backend for vLLM and SGLang.

Engine-agnostic API (a complete example: README.md, "Direct use"; the tensor contract: flashmoe.validation)::

    moe = FlashMoE(MoELayerSpec(num_experts, top_k, hidden_size, intermediate_size, max_tokens_per_rank),
                   ExpertPlacement.contiguous(num_experts, world_size), ep_group)
    out = moe(hidden_states, topk_ids, topk_weights, w13, w2)   # [T, H], combined across the EP group

Importing flashmoe is cheap: no CUDA work, no compilation, no prometheus_client import.
"""

from .errors import FlashMoEBuildError, FlashMoEError, FlashMoETimeoutError, FlashMoEUnsupported
from .layer import FlashMoE
from .placement import ExpertPlacement
from .reference import moe_oracle_fp64, moe_reference, moe_reference_distributed
from .reference_fp8 import moe_oracle_fp64_fp8, moe_reference_distributed_fp8, moe_reference_fp8
from .spec import MoELayerSpec

__version__ = "0.1.0"

__all__ = [
    "ExpertPlacement",
    "FlashMoE",
    "FlashMoEBuildError",
    "FlashMoEError",
    "FlashMoETimeoutError",
    "FlashMoEUnsupported",
    "MoELayerSpec",
    "moe_oracle_fp64",
    "moe_oracle_fp64_fp8",
    "moe_reference",
    "moe_reference_distributed",
    "moe_reference_distributed_fp8",
    "moe_reference_fp8",
]
