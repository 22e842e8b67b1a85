"""flashmoe: a megakernel expert-parallel MoE backend for vLLM and SGLang.

Engine-agnostic API::

    from flashmoe import FlashMoE, MoELayerSpec, ExpertPlacement
    moe = FlashMoE(MoELayerSpec(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                                max_tokens_per_rank=8192), ExpertPlacement.contiguous(128, world_size), ep_group)
    out = moe(hidden_states, topk_ids, topk_weights, w13, w2)

Importing flashmoe is cheap: no CUDA work, no compilation, no prometheus_client import.
"""

from .errors import FlashMoEBuildError, FlashMoEError, FlashMoETimeoutError, FlashMoEUnsupported
from .layer import FlashMoE
from .placement import ExpertPlacement
from .reference import moe_oracle_fp64, moe_reference, moe_reference_distributed
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
    "moe_reference",
    "moe_reference_distributed",
]
