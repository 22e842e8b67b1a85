"""MoE layer shapes the benchmark measures (routed experts only, bf16)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int  # H
    intermediate: int  # I, per expert (w13 is [E_local, 2I, H])
    num_experts: int  # E, global
    top_k: int

    def expert_weight_bytes(self, bytes_per_elem: int = 2) -> int:
        """w13 + w2 of one expert: 3·H·I elements."""
        return 3 * self.hidden * self.intermediate * bytes_per_elem


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("qwen3-30b-a3b", hidden=2048, intermediate=768, num_experts=128, top_k=8),
        ModelShape("qwen3-235b-a22b", hidden=4096, intermediate=1536, num_experts=128, top_k=8),
        ModelShape("deepseek-v3", hidden=7168, intermediate=2048, num_experts=256, top_k=8),
        # CPU smoke shape: small enough for gloo on two cores, multiples of 16 so torch._grouped_mm's
        # alignment rules hold as they do for the real shapes.
        ModelShape("tiny", hidden=256, intermediate=128, num_experts=16, top_k=4),
    )
}

GPU_DEFAULT_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
GPU_DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 4096, 16384)
CPU_DEFAULT_MODELS = ("tiny",)
CPU_DEFAULT_TOKENS = (1, 8, 32)


def with_experts(shape: ModelShape, num_experts: int) -> ModelShape:
    """The same layer with fewer experts (when a GPU cannot hold E/world experts); k is kept."""
    if num_experts < shape.top_k:
        raise ValueError(f"{shape.name}: {num_experts} experts < top_k {shape.top_k}")
    return ModelShape(shape.name, shape.hidden, shape.intermediate, num_experts, shape.top_k)
