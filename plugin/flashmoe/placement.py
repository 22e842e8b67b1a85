"""Where each global expert lives: ``expert -> (rank, local index)``.

Engines describe placement differently (vLLM: a per-rank ``expert_map`` global→local or -1; SGLang:
contiguous ranges); everything in flashmoe takes an :class:`ExpertPlacement`. Non-contiguous and
uneven placements are allowed; every expert must live on exactly one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validation import check_placement, check_positive_int


@dataclass(frozen=True)
class ExpertPlacement:
    expert_rank: torch.Tensor  # [E] int32, owning rank of each global expert
    expert_local: torch.Tensor  # [E] int32, index of the expert in its owner's w13/w2
    world_size: int

    def __post_init__(self):
        check_placement(self)
        # Per-rank expert counts, computed once: every call's validation asks for its rank's.
        counts = torch.bincount(self.expert_rank.long(), minlength=self.world_size).tolist()
        object.__setattr__(self, "_local_counts", tuple(counts))

    @property
    def num_experts(self) -> int:
        return self.expert_rank.numel()

    def num_local(self, rank: int) -> int:
        return self._local_counts[rank]

    @property
    def max_local(self) -> int:
        return max(self._local_counts)

    def local_experts(self, rank: int) -> torch.Tensor:
        """Global ids of ``rank``'s experts, ordered by local index."""
        ids = torch.nonzero(self.expert_rank == rank).flatten()
        return ids[torch.argsort(self.expert_local[ids])].to(torch.int32)

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        """Rank r owns a contiguous block; the first ``E % world_size`` ranks get one extra (vLLM 'linear')."""
        check_positive_int("num_experts", num_experts)
        check_positive_int("world_size", world_size)
        if num_experts < world_size:
            raise ValueError(f"{num_experts} experts cannot be spread over {world_size} ranks")
        base, extra = divmod(num_experts, world_size)
        sizes = [base + (1 if r < extra else 0) for r in range(world_size)]
        rank = torch.repeat_interleave(torch.arange(world_size, dtype=torch.int32), torch.tensor(sizes))
        local = torch.cat([torch.arange(s, dtype=torch.int32) for s in sizes])
        return cls(rank, local, world_size)

    @classmethod
    def round_robin(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        check_positive_int("num_experts", num_experts)
        check_positive_int("world_size", world_size)
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
                raise ValueError(
                    f"rank {r} claims an expert another rank already owns (redundant experts are not supported)"
                )
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
