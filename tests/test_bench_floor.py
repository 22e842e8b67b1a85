"""Floor arithmetic of the layer benchmark against hand-computed cases (kernel-design §4.3)."""

import math

import bench_import  # noqa: F401
import pytest
import torch
from moe_bench.floor import Floor, RankWork, Rates, layer_floor, load_imbalance, rank_floor, rank_work
from moe_bench.routing import make_routing

PEAK = Rates(gemm_flops=989e12, copy_bytes=4.8e12, link_bytes=450e9)  # the §4.3 "peak" column


def contiguous_owner(num_experts, world):
    return torch.arange(num_experts, dtype=torch.int32) // (num_experts // world)


def balanced_ids(world, tokens, experts_per_rank, per_rank_hits):
    """Every token picks ``per_rank_hits`` experts on every rank, cycling through each rank's experts."""
    ids = torch.empty(world, tokens, world * per_rank_hits, dtype=torch.int32)
    for t in range(tokens):
        picks = [
            r * experts_per_rank + (t * per_rank_hits + i) % experts_per_rank
            for r in range(world)
            for i in range(per_rank_hits)
        ]
        ids[:, t] = torch.tensor(picks, dtype=torch.int32)
    return ids


def test_qwen3_30b_ep4_decode_matches_the_design_notes():
    # Qwen3-30B-A3B, EP4, 128 tokens/rank, k = 8 spread 2 per rank: the §4.3 row "9.8 / 63 / 14 -> 6.3" µs.
    ids = balanced_ids(world=4, tokens=128, experts_per_rank=32, per_rank_hits=2)
    works = rank_work(ids, contiguous_owner(128, 4))
    assert all(w == works[0] for w in works)
    w = works[0]
    assert w.expert_rows == 128 * 8  # every source's 2 hits per token, 4 sources
    assert w.experts_touched == 32
    assert w.link_rows_nodedup == 2 * 128 * 6  # 6 remote copies per token, out + back
    assert w.link_rows_dedup == 2 * 128 * 3  # 3 remote ranks per token
    f = layer_floor(works, hidden=2048, intermediate=768, rates=PEAK)
    assert f.gemm_s * 1e6 == pytest.approx(9.77, abs=0.01)
    assert f.weights_s * 1e6 == pytest.approx(62.9, abs=0.1)
    assert f.link_nodedup_s * 1e6 == pytest.approx(14.0, abs=0.05)
    assert f.link_s * 1e6 == pytest.approx(7.0, abs=0.05)
    assert f.bound == "weights" and f.floor_s == f.weights_s == f.floor_nodedup_s


def test_qwen3_30b_ep4_prefill_is_link_bound_without_dedup_and_compute_bound_with_it():
    ids = balanced_ids(world=4, tokens=4096, experts_per_rank=32, per_rank_hits=2)
    f = layer_floor(rank_work(ids, contiguous_owner(128, 4)), 2048, 768, PEAK)
    assert f.gemm_s * 1e6 == pytest.approx(313, abs=1)
    assert f.link_nodedup_s * 1e6 == pytest.approx(447, abs=1)
    assert f.floor_nodedup_s == f.link_nodedup_s
    assert f.link_s < f.gemm_s and f.bound == "gemm"


def test_uniform_routing_reaches_2_72_remote_ranks_per_token_at_ep4(gen):
    T, world = 4096, 4
    ids = torch.stack(
        [
            make_routing(
                T, 128, 8, "uniform", int(torch.randint(1 << 30, (1,), generator=gen)), torch.device("cpu")
            )[0]
            for _ in range(world)
        ]
    )
    works = rank_work(ids, contiguous_owner(128, world))
    remote_ranks = sum(w.link_rows_dedup for w in works) / (2 * world * T)
    # E[distinct owners among 8 of 128 experts] = 4 (1 - C(96,8)/C(128,8)); 3/4 of them are remote.
    p_miss = math.comb(96, 8) / math.comb(128, 8)
    assert remote_ranks == pytest.approx(3 * (1 - p_miss), abs=0.03)
    assert sum(w.link_rows_nodedup for w in works) / (2 * world * T) == pytest.approx(8 * 3 / 4, abs=0.05)
    assert sum(w.expert_rows for w in works) == world * T * 8


def test_one_rank_has_no_link_term_and_counts_only_touched_experts():
    ids = torch.tensor([[[0, 3], [3, 5]]], dtype=torch.int32)  # 1 rank, 2 tokens, k=2
    (w,) = rank_work(ids, torch.zeros(8, dtype=torch.int32))
    assert w == RankWork(expert_rows=4, experts_touched=3, link_rows_nodedup=0, link_rows_dedup=0)
    f = rank_floor(w, 64, 32, Rates(1e12, 1e12, 0.0))
    assert f.link_s == 0 and f.weights_s == pytest.approx(3 * 3 * 64 * 32 * 2 / 1e12)


def test_missing_experts_are_ignored_and_imbalance_is_max_over_mean():
    # Rank 0's token has one expert (its own), rank 1's token hits both of rank 0's experts.
    ids = torch.tensor([[[0, -1]], [[0, 1]]], dtype=torch.int32)
    works = rank_work(ids, torch.tensor([0, 0, 1, 1], dtype=torch.int32))
    assert [w.expert_rows for w in works] == [3, 0]
    assert works[1].link_rows_nodedup == 2 and works[1].link_rows_dedup == 1
    assert works[0].link_rows_nodedup == 2 and works[0].link_rows_dedup == 1
    assert load_imbalance(works) == 2.0


def test_link_rate_zero_with_remote_rows_is_an_error():
    with pytest.raises(ValueError, match="link rate is 0"):
        rank_floor(RankWork(1, 1, 2, 2), 64, 32, Rates(1e12, 1e12, 0.0))
    with pytest.raises(ValueError):
        Rates(0.0, 1.0, 1.0)


def test_floor_mean_is_termwise_and_bound_follows():
    a, b = Floor(1.0, 4.0, 2.0, 3.0), Floor(3.0, 2.0, 6.0, 9.0)
    m = Floor.mean([a, b])
    assert (m.gemm_s, m.weights_s, m.link_s, m.link_nodedup_s) == (2.0, 3.0, 4.0, 6.0)
    assert m.floor_s == 4.0 and m.bound == "link" and m.floor_nodedup_s == 6.0
