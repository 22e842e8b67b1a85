"""Where each global expert lives: ``expert -> (rank, local index)``.

Engines describe placement differently (vLLM: a per-rank ``expert_map`` global→local or -1; SGLang:
contiguous ranges); everything in flashmoe takes an :class:`ExpertPlacement`. Non-contiguous and
uneven placements are allowed; every expert must live on exactly one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    expert_rank: torch.Tensor  # [E] int32, owning rank of each global expert
    expert_local: torch.Tensor  # [E] int32, index of the expert in its owner's w13/w2
    world_size: int

    def __post_init__(self):
        r, loc = self.expert_rank, self.expert_local
        if r.dim() != 1 or loc.shape != r.shape:
            raise ValueError(f"placement tensors must be 1-D of equal length, got {tuple(r.shape)} and {tuple(loc.shape)}")
        if r.dtype != torch.int32 or loc.dtype != torch.int32:
            raise ValueError("placement tensors must be int32")
        if r.numel() == 0:
            raise ValueError("placement has no experts")
        if int(r.min()) < 0 or int(r.max()) >= self.world_size:
            raise ValueError(f"expert_rank values must be in [0, {self.world_size}), got [{int(r.min())}, {int(r.max())}]")
        # Each rank's local indices must be exactly 0..n_r-1 (a dense w13/w2 per rank).
        for rank in range(self.world_size):
            idx = loc[r == rank]
            if idx.numel() and not torch.equal(torch.sort(idx).values, torch.arange(idx.numel(), dtype=torch.int32)):
                raise ValueError(f"rank {rank}: local expert indices must be a permutation of 0..{idx.numel() - 1}")

    @property
    def num_experts(self) -> int:
        return self.expert_rank.numel()

    def num_local(self, rank: int) -> int:
        return int((self.expert_rank == rank).sum())

    @property
    def max_local(self) -> int:
        return max(self.num_local(r) for r in range(self.world_size))

    def local_experts(self, rank: int) -> torch.Tensor:
        """Global ids of ``rank``'s experts, ordered by local index."""
        ids = torch.nonzero(self.expert_rank == rank).flatten()
        return ids[torch.argsort(self.expert_local[ids])].to(torch.int32)

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        """Rank r owns a contiguous block; the first ``E % world_size`` ranks get one extra (vLLM 'linear')."""
        if num_experts < world_size:
            raise ValueError(f"{num_experts} experts cannot be spread over {world_size} ranks")
        base, extra = divmod(num_experts, world_size)
        sizes = [base + (1 if r < extra else 0) for r in range(world_size)]
        rank = torch.repeat_interleave(torch.arange(world_size, dtype=torch.int32), torch.tensor(sizes))
        local = torch.cat([torch.arange(s, dtype=torch.int32) for s in sizes])
        return cls(rank, local, world_size)

    @classmethod
    def round_robin(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        e = torch.arange(num_experts, dtype=torch.int32)
        return cls(e % world_size, e // world_size, world_size)

    @classmethod
    def from_expert_maps(cls, expert_maps: list[torch.Tensor]) -> ExpertPlacement:
        """From every rank's vLLM-style ``expert_map`` (global id → local id, -1 if not local)."""
        maps = [m.to("cpu", torch.int64) for m in expert_maps]
        num_experts = maps[0].numel()
        rank = torch.full((num_experts,), -1, dtype=torch.int32)
        local = torch.full((num_experts,), -1, dtype=torch.int32)
        for r, m in enumerate(maps):
            if m.numel() != num_experts:
                raise ValueError("expert maps of different lengths")
            own = m >= 0
            if bool((rank[own] >= 0).any()):
                raise ValueError(f"rank {r} claims an expert another rank already owns (redundant experts are not supported)")
            rank[own] = r
            local[own] = m[own].to(torch.int32)
        if bool((rank < 0).any()):
            missing = torch.nonzero(rank < 0).flatten()[:8].tolist()
            raise ValueError(f"experts {missing}... are owned by no rank")
        return cls(rank, local, len(maps))

    def to_expert_map(self, rank: int) -> torch.Tensor:
        """vLLM-style map for ``rank``: global → local index, -1 elsewhere."""
        out = torch.full((self.num_experts,), -1, dtype=torch.int32)
        own = self.expert_rank == rank
        out[own] = self.expert_local[own]
        return out
