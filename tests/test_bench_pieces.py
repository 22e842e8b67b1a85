"""Routing, grouped GEMM, correctness gate and timing policy of the layer benchmark (CPU)."""

import bench_import  # noqa: F401
import pytest
import torch
from flashmoe.reference import moe_reference
from moe_bench.check import compare, expert_rows_reference
from moe_bench.grouped_gemm import GROUPED_MM, MM_LOOP, GroupedSwiGLU, group_offsets, select_grouped_gemm
from moe_bench.routing import make_routing, zipf_popularity
from moe_bench.timing import TimingPolicy

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_routing_picks_k_distinct_experts_with_normalised_weights(kind, seed):
    ids, w = make_routing(300, 32, 6, kind, seed, CPU, zipf_s=1.2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (300, 6)
    assert int(ids.min()) >= 0 and int(ids.max()) < 32
    assert all(len(set(row)) == 6 for row in ids.tolist())
    torch.testing.assert_close(w.sum(1), torch.ones(300))
    again, _ = make_routing(300, 32, 6, kind, seed, CPU, zipf_s=1.2)
    assert torch.equal(ids, again)


def test_zipf_routing_concentrates_rows_on_the_popular_experts(seed):
    E, k, T = 128, 8, 4000
    p = zipf_popularity(E, 1.0)
    hot = int(p.argmax())
    zipf_ids, _ = make_routing(T, E, k, "zipf", seed, CPU)
    uniform_ids, _ = make_routing(T, E, k, "uniform", seed, CPU)
    zipf_load = torch.bincount(zipf_ids.flatten().long(), minlength=E)
    uniform_load = torch.bincount(uniform_ids.flatten().long(), minlength=E)
    assert int(zipf_load.argmax()) == hot
    assert zipf_load.max() > 0.6 * T  # the hottest expert is in most tokens' top-k
    assert uniform_load.max() < 0.15 * T  # mean is T·k/E = 250
    assert torch.allclose(zipf_popularity(E, 0.0), torch.full((E,), 1.0 / E, dtype=torch.float64))


@pytest.mark.parametrize("impl", [GROUPED_MM, MM_LOOP])
def test_grouped_swiglu_matches_the_per_expert_reference(impl, gen):
    sizes = [3, 0, 17, 1, 0, 9]
    H, inter = 64, 48
    x = torch.randn(sum(sizes), H, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(len(sizes), 2 * inter, H, generator=gen) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(len(sizes), H, inter, generator=gen) * inter**-0.5).to(torch.bfloat16)
    y = GroupedSwiGLU(impl)(x, group_offsets(torch.tensor(sizes)), sizes, w13, w2)
    assert compare(y, expert_rows_reference(x, sizes, w13, w2)).ok
    assert GroupedSwiGLU(impl)(
        x[:0], group_offsets(torch.zeros(6, dtype=torch.long)), [0] * 6, w13, w2
    ).shape == (0, H)


def test_grouped_gemm_selection_on_cpu():
    impl, why = select_grouped_gemm("auto", CPU)
    assert impl == GROUPED_MM and "cpu" in why  # torch >= 2.8 implements it on CPU
    assert select_grouped_gemm(MM_LOOP, CPU)[0] == MM_LOOP
    with pytest.raises(ValueError):
        select_grouped_gemm("cublas", CPU)


def test_check_passes_bf16_rounding_and_fails_a_dropped_expert(gen):
    T, E, k, H, inter = 64, 8, 2, 64, 32
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    w = torch.softmax(torch.randn(T, k, generator=gen), 1)
    ref = moe_reference(x, ids, w, w13, w2)
    assert compare(ref, ref).ok
    # One bf16 ulp of error everywhere: what rounding differences look like.
    rounded = (ref.float() * (1 + 2**-8 * torch.randn(T, H, generator=gen).sign())).to(torch.bfloat16)
    assert compare(rounded, ref).ok
    dropped = ids.clone()
    dropped[:, 1] = -1  # every token loses its second expert
    assert not compare(moe_reference(x, dropped, w, w13, w2), ref).ok
    assert not compare(ref.clone().index_fill_(0, torch.tensor([3]), float("nan")), ref).ok
    assert not compare(ref[:-1], ref).ok


def test_timing_policy_bounds_the_iteration_count():
    p = TimingPolicy(warmup=1, min_iters=10, max_iters=100, target_s=0.5)
    assert p.iterations(1.0) == 10
    assert p.iterations(0.01) == 50
    assert p.iterations(1e-6) == 100
    assert p.iterations(0.0) == 100
