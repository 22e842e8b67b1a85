"""Floor arithmetic of the layer benchmark against hand-computed cases (kernel-design §4.3), bf16 and fp8."""

import math

import bench_import  # noqa: F401
import pytest
import torch
from moe_bench.floor import (
    Floor,
    RankWork,
    Rates,
    layer_floor,
    link_bytes_one_way,
    load_imbalance,
    rank_floor,
    rank_work,
)
from moe_bench.formats import BF16, FP8
from moe_bench.routing import make_routing
from moe_bench.shapes import MODELS

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
    assert w == RankWork(
        expert_rows=4, experts_touched=3, sent_nodedup=0, recv_nodedup=0, sent_dedup=0, recv_dedup=0
    )
    f = rank_floor(w, 64, 32, Rates(1e12, 1e12, 0.0))
    assert f.link_s == 0 and f.weights_s == pytest.approx(3 * 3 * 64 * 32 * 2 / 1e12)


def test_missing_experts_are_ignored_and_imbalance_is_max_over_mean():
    # Rank 0's token has one expert (its own), rank 1's token hits both of rank 0's experts.
    ids = torch.tensor([[[0, -1]], [[0, 1]]], dtype=torch.int32)
    works = rank_work(ids, torch.tensor([0, 0, 1, 1], dtype=torch.int32))
    assert [w.expert_rows for w in works] == [3, 0]
    assert works[1].link_rows_nodedup == 2 and works[1].link_rows_dedup == 1
    assert works[0].link_rows_nodedup == 2 and works[0].link_rows_dedup == 1

    # Rank 1 dispatches one row (two without dedup) and rank 0 receives it and returns its result.
    def counts(w):
        return w.sent_dedup, w.recv_dedup, w.sent_nodedup, w.recv_nodedup

    assert counts(works[1]) == (1, 0, 2, 0) and counts(works[0]) == (0, 1, 0, 2)
    assert load_imbalance(works) == 2.0


def test_link_rate_zero_with_remote_rows_is_an_error():
    with pytest.raises(ValueError, match="link rate is 0"):
        rank_floor(RankWork(1, 1, 1, 1, 1, 1), 64, 32, Rates(1e12, 1e12, 0.0))
    with pytest.raises(ValueError):
        Rates(0.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        Rates(1.0, 1.0, 1.0, fp8_gemm_flops=-1.0)
    # An fp8 floor without the fp8 rate is an error, not a silent bf16 rate.
    with pytest.raises(ValueError, match="fp8 GEMM rate"):
        rank_floor(RankWork(1, 1, 0, 0, 0, 0), 128, 128, Rates(1e12, 1e12, 0.0), FP8)


def test_floor_mean_is_termwise_and_bound_follows():
    a, b = Floor(1.0, 4.0, 2.0, 3.0), Floor(3.0, 2.0, 6.0, 9.0)
    m = Floor.mean([a, b])
    assert (m.gemm_s, m.weights_s, m.link_s, m.link_nodedup_s) == (2.0, 3.0, 4.0, 6.0)
    assert m.floor_s == 4.0 and m.bound == "link" and m.floor_nodedup_s == 6.0


# -------------------------------------------------------------------------------------------- fp8

PEAK_FP8 = Rates(gemm_flops=989e12, copy_bytes=4.8e12, link_bytes=450e9, fp8_gemm_flops=1978.9e12)  # §4.2


def test_format_bytes_by_hand():
    # bf16: 3·H·I elements of 2 bytes, rows of H·2 bytes both ways.
    assert BF16.expert_weight_bytes(2048, 768) == 3 * 2048 * 768 * 2
    assert BF16.dispatch_row_bytes(2048) == BF16.combine_row_bytes(2048) == 4096
    # fp8, Qwen3-30B-A3B: 4,718,592 e4m3 weights; w13 scales (1536/128)·(2048/128) = 12·16 = 192 and w2 scales
    # (2048/128)·(768/128) = 16·6 = 96, 288 fp32 scales = 1152 bytes.
    assert FP8.expert_weight_bytes(2048, 768) == 4_718_592 + 1_152
    # A dispatched row: 2048 e4m3 + 16 fp32 group scales; a combined row stays bf16.
    assert FP8.dispatch_row_bytes(2048) == 2048 + 64 and FP8.combine_row_bytes(2048) == 4096
    # DeepSeek-V4-Flash: 25,165,824 weights + (32·32 + 32·16)·4 = 6,144 scale bytes = 25.17 MB (§4.1 [d]: "25.2 MB FP8").
    flash = MODELS["dsv4-flash"]
    assert flash.expert_weight_bytes(FP8) == 25_165_824 + 6_144
    assert flash.expert_weight_bytes() == 2 * 25_165_824


def test_fp8_floor_qwen3_30b_ep4_decode_by_hand():
    # The §4.3 case of test_qwen3_30b_ep4_decode_matches_the_design_notes, with fp8 weights and dispatch.
    ids = balanced_ids(world=4, tokens=128, experts_per_rank=32, per_rank_hits=2)
    works = rank_work(ids, contiguous_owner(128, 4))
    w = works[0]
    assert (w.sent_dedup, w.recv_dedup) == (384, 384)  # 128 tokens x 3 remote ranks, each way
    f = layer_floor(works, hidden=2048, intermediate=768, rates=PEAK_FP8, fmt=FP8)
    # gemm: 6 · 1024 · 2048 · 768 = 9.664e9 FLOP at 1978.9 TFLOP/s = 4.884 µs (half the bf16 9.77).
    assert f.gemm_s * 1e6 == pytest.approx(4.884, abs=1e-3)
    # weights: 32 touched experts x 4,719,744 B = 151,031,808 B at 4.8 TB/s = 31.465 µs (bf16: 62.9).
    assert f.weights_s * 1e6 == pytest.approx(31.465, abs=1e-3)
    # link, dedup: 384 rows out at 2112 B + 384 results back at 4096 B = 2,383,872 B at 450 GB/s = 5.297 µs
    # (bf16: 768 x 4096 B = 7.0 µs); no dedup: 768 + 768 rows, 4,767,744 B = 10.595 µs.
    assert f.link_s * 1e6 == pytest.approx(5.297, abs=1e-3)
    assert f.link_nodedup_s * 1e6 == pytest.approx(10.595, abs=1e-3)
    assert f.bound == "weights" and f.floor_s == f.weights_s
    bf16 = layer_floor(works, 2048, 768, PEAK_FP8)  # the default format is bf16, at the bf16 rate
    assert bf16.gemm_s == pytest.approx(f.gemm_s * 1978.9 / 989)
    assert bf16.weights_s * 1e6 == pytest.approx(62.9, abs=0.1)


def test_fp8_link_counts_the_busier_direction():
    # Rank 0 only receives (1 row) and returns its result; rank 1 only sends. fp8 dispatch rows (H + H/32 bytes)
    # are smaller than bf16 results (2H), so each rank's busier direction carries the result: 2H bytes.
    ids = torch.tensor([[[0, -1]], [[0, 1]]], dtype=torch.int32)
    works = rank_work(ids, torch.tensor([0, 0, 1, 1], dtype=torch.int32))
    H = 256
    # Rank 0: ingress 264, egress 512; rank 1: egress 264, ingress 512.
    assert link_bytes_one_way(works[0].sent_dedup, works[0].recv_dedup, H, FP8) == 512
    assert link_bytes_one_way(works[1].sent_dedup, works[1].recv_dedup, H, FP8) == 512
    assert link_bytes_one_way(works[1].sent_nodedup, works[1].recv_nodedup, H, FP8) == 1024
    # bf16: both directions equal, (sent + received) x 2H: the floor's definition before fp8.
    for w in works:
        assert link_bytes_one_way(w.sent_dedup, w.recv_dedup, H) == w.link_rows_dedup * 2 * H
    f = layer_floor(works, H, 128, Rates(1e12, 1e12, 1e9, 2e12), FP8)
    assert f.link_s == pytest.approx(512 / 1e9) and f.link_nodedup_s == pytest.approx(1024 / 1e9)
    assert f.gemm_s == pytest.approx(6 * 3 * H * 128 / 2e12)  # rank 0's 3 rows, at the fp8 rate


def test_bf16_floor_is_unchanged_by_the_format_parameter(gen):
    ids = torch.stack(
        [make_routing(64, 32, 4, "zipf", int(torch.randint(1 << 30, (1,), generator=gen)), torch.device("cpu"))[0]
         for _ in range(4)]
    )  # fmt: skip
    works = rank_work(ids, contiguous_owner(32, 4))
    rates = Rates(790e12, 4.3e12, 392e9, 1500e12)
    for w in works:  # the pre-fp8 definition, term by term
        f = rank_floor(w, 1024, 512, rates)
        assert f.gemm_s == pytest.approx(6.0 * w.expert_rows * 1024 * 512 / 790e12)
        assert f.weights_s == pytest.approx(w.experts_touched * 3.0 * 1024 * 512 * 2 / 4.3e12)
        assert f.link_s == pytest.approx(w.link_rows_dedup * 1024 * 2 / 392e9)
        assert f.link_nodedup_s == pytest.approx(w.link_rows_nodedup * 1024 * 2 / 392e9)
