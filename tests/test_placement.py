"""ExpertPlacement: the constructors engines use, the vLLM expert_map round trip, and clear errors."""

from __future__ import annotations

import pytest
import torch
from flashmoe import ExpertPlacement
from moe_inputs import PLACEMENTS, make_placement


def _assert_valid(p: ExpertPlacement, num_experts: int, world: int) -> None:
    """Every expert on exactly one rank; each rank's local ids dense; local_experts inverts the map."""
    assert p.num_experts == num_experts and p.world_size == world
    seen = torch.zeros(num_experts, dtype=torch.int64)
    for r in range(world):
        ids = p.local_experts(r).long()
        assert ids.numel() == p.num_local(r)
        assert torch.equal(p.expert_rank[ids], torch.full_like(ids, r, dtype=torch.int32))
        assert torch.equal(p.expert_local[ids], torch.arange(ids.numel(), dtype=torch.int32))
        seen[ids] += 1
    assert torch.equal(seen, torch.ones_like(seen))


@pytest.mark.parametrize("num_experts,world", [(8, 1), (8, 2), (10, 4), (7, 3), (256, 4), (5, 5)])
def test_contiguous_blocks_extra_experts_on_first_ranks(num_experts, world):
    p = ExpertPlacement.contiguous(num_experts, world)
    _assert_valid(p, num_experts, world)
    base, extra = divmod(num_experts, world)
    assert [p.num_local(r) for r in range(world)] == [base + (r < extra) for r in range(world)]
    assert bool((p.expert_rank[1:] >= p.expert_rank[:-1]).all()), "contiguous placement must be rank-sorted"
    assert p.max_local == base + (extra > 0)


@pytest.mark.parametrize("num_experts,world", [(8, 2), (10, 4), (3, 4), (128, 4)])
def test_round_robin(num_experts, world):
    p = ExpertPlacement.round_robin(num_experts, world)
    _assert_valid(p, num_experts, world)
    e = torch.arange(num_experts)
    assert torch.equal(p.expert_rank.long(), e % world)
    assert torch.equal(p.expert_local.long(), e // world)


@pytest.mark.parametrize("kind", PLACEMENTS)
@pytest.mark.parametrize("num_experts,world", [(8, 2), (33, 4), (64, 3)])
def test_expert_map_round_trip(kind, num_experts, world, gen):
    p = make_placement(kind, num_experts, world, gen)
    _assert_valid(p, num_experts, world)
    maps = [p.to_expert_map(r) for r in range(world)]
    for r, m in enumerate(maps):
        assert m.dtype == torch.int32 and m.shape == (num_experts,)
        assert int((m >= 0).sum()) == p.num_local(r)
        own = p.expert_rank == r
        assert torch.equal(m[own], p.expert_local[own]) and bool((m[~own] == -1).all())
    back = ExpertPlacement.from_expert_maps(maps)
    assert torch.equal(back.expert_rank, p.expert_rank) and torch.equal(back.expert_local, p.expert_local)
    assert back.world_size == world


def test_from_expert_maps_accepts_int64_maps_on_any_device():
    maps = [torch.tensor([0, -1, 1, -1]), torch.tensor([-1, 0, -1, 1])]
    p = ExpertPlacement.from_expert_maps(maps)
    assert p.expert_rank.tolist() == [0, 1, 0, 1] and p.expert_local.tolist() == [0, 0, 1, 1]


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize(
    "rank,local,world,match",
    [
        (_i32(0, 1), _i32(0, 0, 0), 2, "1-D of equal length"),
        (_i32(0, 1).view(1, 2), _i32(0, 0).view(1, 2), 2, "1-D"),
        (torch.tensor([0, 1]), _i32(0, 0), 2, "int32"),
        (_i32(0, 1), torch.tensor([0, 0]), 2, "int32"),
        (_i32(), _i32(), 2, "no experts"),
        (_i32(0, 2), _i32(0, 0), 2, r"expert_rank values must be in \[0, 2\)"),
        (_i32(-1, 0), _i32(0, 0), 2, "expert_rank values"),
        (_i32(0, 0, 1), _i32(0, 0, 0), 2, "rank 0: local expert indices must be a permutation of 0..1"),
        (_i32(0, 0, 1), _i32(0, 2, 0), 2, "permutation"),
        (_i32(0, 1, 1), _i32(0, 1, 2), 2, "rank 1"),
    ],
)
def test_invalid_placement_raises_value_error(rank, local, world, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(rank, local, world)


def test_contiguous_refuses_fewer_experts_than_ranks():
    with pytest.raises(ValueError, match="3 experts cannot be spread over 4 ranks"):
        ExpertPlacement.contiguous(3, 4)


def test_from_expert_maps_errors():
    with pytest.raises(ValueError, match="different lengths"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, -1]), torch.tensor([-1, 0, 1])])
    with pytest.raises(ValueError, match="already owns"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, -1]), torch.tensor([0, 0])])
    with pytest.raises(ValueError, match=r"experts \[1\]"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, -1, -1]), torch.tensor([-1, -1, 0])])
    with pytest.raises(ValueError, match="permutation"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, 2]), torch.tensor([-1, -1])])
