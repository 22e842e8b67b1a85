"""The deepep_ll baselines of the layer benchmark: listed, unavailable without deep_ep (and why), and the glue
between DeepEP's masked per-expert layout and the grouped GEMMs, on CPU tensors (DeepEP itself needs Hopper
GPUs: its kernels run in the GPU benchmark only)."""

import bench_import  # noqa: F401
import layer_bench
import pytest
import torch
from flashmoe import ExpertPlacement
from flashmoe.reference import moe_reference
from moe_bench import deepep_ll, table
from moe_bench.check import compare
from moe_bench.grouped_gemm import GROUPED_MM, MM_LOOP, GroupedSwiGLU
from moe_inputs import random_expert_weights, random_hidden, random_routing

CPU = torch.device("cpu")


def test_variants_are_listed_and_selectable():
    for v in ("deepep_ll", "deepep_ll_fp8", "deepep_ll_comm"):
        assert v in table.VARIANTS and v in layer_bench.GRAPH_SAFE
    assert "deepep_ll" in table.BASELINES and "deepep_ll_comm" not in table.BASELINES  # comm is no layer
    args = layer_bench.parse_args(["--device", "cpu", "--variants", "flashmoe,deepep_ll,deepep_ll_comm"])
    assert args.variants == ["flashmoe", "deepep_ll", "deepep_ll_comm"]
    assert args.deepep_max_tokens == deepep_ll.DEFAULT_MAX_TOKENS == 512
    with pytest.raises(SystemExit):
        layer_bench.parse_args(["--device", "cpu", "--deepep-max-tokens", "0"])


def test_unavailable_without_deep_ep_says_why():
    mod, version, reason = deepep_ll.load_deep_ep(CPU)
    assert mod is None and reason
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        assert reason.startswith("deep_ep not importable: ") and str(e) in reason
        assert "scripts/build-deepep.sh" in reason and version is None
    else:  # built and importable here: still no CPU path
        assert "no CUDA device" in reason


def test_dispatch_capacity_and_qp_depth():
    assert [deepep_ll.dispatch_capacity(t) for t in (1, 4, 5, 128, 511, 512)] == [4, 4, 8, 128, 512, 512]
    assert deepep_ll.qp_depth(8) == 1024 and deepep_ll.qp_depth(508) == 1024  # DeepEP's default suffices
    assert deepep_ll.qp_depth(509) == deepep_ll.qp_depth(512) == 2048 and deepep_ll.qp_depth(1024) == 4096


def test_packed_rows_map_valid_rows_and_send_the_rest_to_the_spare_row():
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    src, offs = deepep_ll.packed_rows(counts, capacity=5, bound=8)
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 2, 5, 6]
    assert src.dtype == torch.int64
    # expert 0 rows 0-1, expert 2 rows 10-12, expert 3 row 15; then the spare row 4 * 5 = 20
    assert src.tolist() == [0, 1, 10, 11, 12, 15, 20, 20]
    assert deepep_ll.packed_rows(counts, 5, 6)[0].tolist() == [0, 1, 10, 11, 12, 15]  # exact bound
    assert deepep_ll.packed_rows(torch.zeros(3, dtype=torch.int32), 4, 2)[0].tolist() == [12, 12]
    assert deepep_ll.packed_rows(counts, 5, 0)[0].numel() == 0
    assert deepep_ll.packed_rows(counts, 5, 4)[1].tolist() == [2, 2, 4, 4]  # a short bound caps the offsets


def test_gather_and_scatter_round_trip_the_valid_rows(gen):
    E, cap, H = 3, 6, 16
    recv = torch.randn(E, cap, H, generator=gen).to(torch.bfloat16)
    counts = torch.tensor([4, 1, 0])
    src, _ = deepep_ll.packed_rows(counts, cap, bound=7)
    rows = deepep_ll.gather_rows(recv, src)
    assert torch.equal(rows[:4], recv[0, :4]) and torch.equal(rows[4], recv[1, 0])
    back = deepep_ll.scatter_rows(rows, src, E, cap)
    assert back.shape == (E, cap, H) and back.is_contiguous()
    assert torch.equal(back[0, :4], recv[0, :4]) and torch.equal(back[1, :1], recv[1, :1])


def test_fp8_gather_dequantises_deepeps_column_major_scales(gen):
    E, cap, H = 2, 4, 256
    x = torch.randn(E * cap, H, generator=gen).to(torch.bfloat16)
    # DeepEP's send-side cast, per token and 128 channels; its scales tensor is [E, H/128, cap] transposed.
    xf = x.float().view(-1, H // 128, 128)
    amax = xf.abs().amax(-1).clamp(min=deepep_ll.FP8_MARGIN)
    q = (xf * (deepep_ll.FP8_MAX / amax).unsqueeze(-1)).to(torch.float8_e4m3fn).view(E, cap, H)
    scales = torch.empty(E, H // 128, cap).transpose(1, 2)
    scales.copy_((amax * (1.0 / deepep_ll.FP8_MAX)).view(E, cap, H // 128))  # DeepEP: amax * (1 / 448)
    assert not scales.is_contiguous()
    src, _ = deepep_ll.packed_rows(torch.tensor([3, 2]), cap, bound=5)
    got = deepep_ll.gather_rows_fp8(q, scales, src, torch.bfloat16)
    want = deepep_ll.fp8_roundtrip(x)[[0, 1, 2, 4, 5]]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_fp8_roundtrip_is_within_e4m3_rounding_and_exact_on_representable_values(gen):
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    r = deepep_ll.fp8_roundtrip(x)
    blocks = x.float().view(8, 4, 128).abs().amax(-1, keepdim=True)
    err = (r.float() - x.float()).view(8, 4, 128).abs()
    assert bool((err <= blocks * 2**-4 + 1e-6).all())  # half an e4m3 ulp at the top binade, bf16 on top
    assert compare(r, x).rel_l2 > 1e-3  # it really rounds
    exact = torch.tensor([[448.0, -224.0, 1.0, 0.0] * 32], dtype=torch.bfloat16)  # amax 448: scale 1
    assert torch.equal(deepep_ll.fp8_roundtrip(exact), exact)


def test_masked_layout_through_grouped_swiglu_matches_the_reference(gen):
    """World 1: the masked layout DeepEP's dispatch leaves (expert e's rows at [e, 0:count_e), garbage
    after), packed, through the grouped SwiGLU, scattered back and combined with the routing weights as
    DeepEP's combine does, equals the layer's reference."""
    T, E, k, H, inter = 24, 6, 2, 128, 64
    x = random_hidden(T, H, gen)
    w13, w2 = random_expert_weights(E, H, inter, gen)
    ids, weights = random_routing(T, E, k, "uniform", gen)
    cap = deepep_ll.dispatch_capacity(T)
    recv = torch.full((E, cap, H), float("nan"), dtype=torch.bfloat16)  # unused rows: garbage
    counts = torch.zeros(E, dtype=torch.int32)
    where = {}  # (token, j) -> (expert, slot)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            recv[e, counts[e]] = x[t]
            where[t, j] = (e, int(counts[e]))
            counts[e] += 1
    rows = deepep_ll.received_rows(ids.unsqueeze(0), torch.arange(E), E)
    assert rows == T * k == int(counts.sum())
    for impl in (GROUPED_MM, MM_LOOP):
        src, offs = deepep_ll.packed_rows(counts, cap, rows)
        y = GroupedSwiGLU(impl)(deepep_ll.gather_rows(recv, src), offs, counts.tolist(), w13, w2)
        masked = deepep_ll.scatter_rows(y, src, E, cap)
        out = torch.stack(
            [sum(weights[t, j] * masked[where[t, j]].float() for j in range(k)) for t in range(T)]
        ).to(torch.bfloat16)
        assert compare(out, moe_reference(x, ids, weights, w13, w2)).ok


def test_received_rows_count_every_pair_for_this_ranks_experts():
    ids_all = torch.tensor([[[0, 5], [5, 5]], [[7, -1], [2, 3]]], dtype=torch.int32)  # [W=2, T=2, k=2]
    assert deepep_ll.received_rows(ids_all, torch.tensor([0, 1, 2, 3]), 8) == 3  # 0, 2, 3
    assert deepep_ll.received_rows(ids_all, torch.tensor([4, 5, 6, 7]), 8) == 4  # 5 three times, 7


def test_comm_reference_is_the_token_times_its_weight_sum():
    x = torch.tensor([[1.0, -2.0], [4.0, 0.5]], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    w = torch.tensor([[0.25, 0.5], [0.5, 0.5]])
    assert deepep_ll.comm_reference(x, ids, w).tolist() == [[0.75, -1.5], [2.0, 0.25]]


def test_unsupported_cases_are_named():
    ll = deepep_ll.LowLatency(deep_ep=None, buffer=None, world=4, max_tokens=512, num_rdma_bytes=0)
    contiguous = ExpertPlacement.contiguous(128, 4)
    assert ll.unsupported(512, 2048, 128, contiguous) is None
    assert "--deepep-max-tokens" in ll.unsupported(513, 2048, 128, contiguous)
    assert "hidden 64" in ll.unsupported(8, 64, 128, contiguous)
    assert "contiguous" in ll.unsupported(8, 2048, 128, ExpertPlacement.round_robin(128, 4))


def test_flashmoe_heap_estimate_covers_its_readme_formula():
    T, H, k, W = 8192, 2048, 8, 4
    data = W * T * H * 2 + T * k * H * 2 + W * T * (1 + k) * 4  # README, Memory: 134 + 268 + 1.2 MB
    assert deepep_ll.flashmoe_symmetric_bytes(T, H, k, W) > data * 1.25 + (256 << 20)
