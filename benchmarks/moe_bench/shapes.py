"""MoE layer shapes the benchmark measures (routed experts only), and published numbers to hold them against."""

from __future__ import annotations

from dataclasses import dataclass, field

from .formats import BF16, Format


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int  # H
    intermediate: int  # I, per expert (w13 is [E_local, 2I, H])
    num_experts: int  # E, global
    top_k: int

    def expert_weight_bytes(self, fmt: Format = BF16) -> int:
        """w13 + w2 of one expert: 3·H·I elements (and, for fp8, their block scales)."""
        return fmt.expert_weight_bytes(self.hidden, self.intermediate)


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("qwen3-30b-a3b", hidden=2048, intermediate=768, num_experts=128, top_k=8),
        ModelShape("qwen3-235b-a22b", hidden=4096, intermediate=1536, num_experts=128, top_k=8),
        ModelShape("deepseek-v3", hidden=7168, intermediate=2048, num_experts=256, top_k=8),
        # DeepSeek-V4-Flash's routed experts (the shape DeepGEMM's Mega MoE reports, kernel-design §4.1).
        ModelShape("dsv4-flash", hidden=4096, intermediate=2048, num_experts=256, top_k=6),
        # CPU smoke shape: small enough for gloo on two cores, multiples of 16 so torch._grouped_mm's
        # alignment rules hold as they do for the real shapes (and of 128, so it has an fp8 layer).
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


@dataclass(frozen=True)
class Anchor:
    """A published latency of one MoE layer by another system, shown beside ours (never measured here).

    It holds for its own EP size: a rank there holds E/ep experts. Ours may run at another EP size (or
    at world 1 with ``--per-rank-of-ep``); a latency ratio means something only where a rank does the
    same work: the same experts per rank (hence weight bytes per rank, at the same format), tokens per
    rank and routing width. :meth:`comparable` says when; the tables print the ratio only then.
    """

    system: str
    source: str
    dtype: str  # the weight format it ran ("fp8", "bf16")
    ep: int
    gpu: str
    num_experts: int  # the model's global expert count
    latency_us: dict[int, float] = field(default_factory=dict)  # tokens per rank -> µs per layer

    @property
    def experts_per_rank(self) -> float:
        return self.num_experts / self.ep

    @property
    def label(self) -> str:
        return f"{self.system}, EP{self.ep} {self.gpu} {self.dtype}"

    def comparable(self, num_experts: int, world_size: int, dtype: str) -> bool:
        """Whether a row with ``num_experts`` global experts over ``world_size`` ranks (and ``dtype``
        weights) gives each rank the anchor's per-rank expert work."""
        return dtype == self.dtype and num_experts / world_size == self.experts_per_rank


# DeepGEMM PR #383 (SM90 FP8 Mega MoE), as kernel-design.md §4.1 cites it: 8 x H200, EP8, fp8, the
# DeepSeek-V4-Flash routed shape; 8 / 128 / 1024 tokens per rank. (Its DeepEP high-throughput path took
# 414 µs at 128.) At EP8 a rank holds 32 experts: 32 x 25.17 MB of fp8 weights = 806 MB per rank.
ANCHORS: dict[str, Anchor] = {
    "dsv4-flash": Anchor(
        system="DeepGEMM Mega MoE",
        source="deepseek-ai/DeepGEMM PR #383",
        dtype="fp8",
        ep=8,
        gpu="H200",
        num_experts=256,
        latency_us={8: 225.0, 128: 265.0, 1024: 637.0},
    ),
}
