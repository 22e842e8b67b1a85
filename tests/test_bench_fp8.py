"""``layer_bench --dtype fp8`` on the CPU: the shape registry and anchor, options, the fp8 expert stage of
the baselines, the fp8 check wiring and whole runs (world 1 in-process, world 2 over gloo).

flashmoe's fp8 layer is the real one: ``FlashMoE(MoELayerSpec(..., weight_dtype=float8_e4m3fn))`` on its CPU
(reference) backend, which computes :mod:`flashmoe.reference_fp8`.

One thing of the GPU path cannot run here and is stood in for, checked against its definition:
``torch._scaled_mm`` with block scales (cuBLASLt on sm_90; torch's CPU build takes only TensorWise and
RowWise scales, see :func:`test_cpu_torch_has_no_block_scaled_scaled_mm`). :func:`emulated_scaled_mm`
enforces the layouts torch's CUDA implementation accepts (``aten/src/ATen/native/cuda/ScaledBlas.cpp``:
``a`` row-major, ``b`` column-major, ``scale_a`` [M, K/128] outer-dim-major; ``scale_b.t()`` [N/128, K/128]
row-major (128x128) or [N, K/128] outer-dim-major (1x128); cuBLASLt's M % 4 == 0), reads the scales from
memory as cuBLASLt does (128x128 ones with a leading dimension of round_up(K/128, 4), which torch does not
pad: ``moe_bench.grouped_gemm.weight_scale_recipe``) and computes the product as
:func:`flashmoe.reference_fp8.block_scaled_gemm` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import bench_import  # noqa: F401
import layer_bench
import pytest
import torch
import torch.distributed as dist
from flashmoe import ExpertPlacement
from flashmoe.fp8 import quantize_per_token_group, quantize_weight_blocks
from flashmoe.reference_fp8 import block_scaled_gemm
from moe_bench import check, grouped_gemm, results, table
from moe_bench.formats import BF16, FP8
from moe_bench.grouped_gemm import (
    DEQUANT_MM_LOOP,
    SCALED_MM_LOOP,
    BLOCK_1x128,
    BLOCK_128x128,
    BlockFp8,
    Fp8SwiGLU,
    group_offsets,
    scaled_mm_blockwise,
    select_fp8_expert_gemm,
    weight_scale_b,
    weight_scale_recipe,
)
from moe_bench.ranks import Ranks
from moe_bench.shapes import ANCHORS, MODELS, ModelShape
from moe_inputs import random_fp8_expert_weights, random_grouped_hidden
from multiproc import free_port, run_ranks
from tolerances import FP8_SAME_ROUNDING_REL_FRO, fp8_min_rows_for_batch, fp8_row_rel

CPU = torch.device("cpu")
SCRIPT = bench_import.BENCH_DIR / "layer_bench.py"
E4M3 = torch.float8_e4m3fn
_REAL_SCALED_MM = torch._scaled_mm


# ------------------------------------------------------------------------------------------ stand-in


def emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, out=None):  # fmt: skip
    """torch._scaled_mm as its CUDA build takes the block-scaled recipes (1x128 on ``a``; 128x128 or 1x128 on
    ``b``), with the weight scales read from memory as cuBLASLt reads them; per-tensor scales (the rate
    measurement) go to the real CPU implementation."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return _REAL_SCALED_MM(
            a,
            b,
            scale_a=scale_a,
            scale_b=scale_b,
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
            out=out,
        )
    M, K = a.shape
    N, L = b.shape[1], K // 128

    # ScaledBlas.cpp check_size_stride: the stride of a dimension of size 1 is free.
    def size_stride(t, dim, size, stride):
        return t.shape[dim] == size and (size <= 1 or t.stride(dim) == stride)

    assert a.dtype == b.dtype == E4M3 and scale_a.dtype == scale_b.dtype == torch.float32
    assert a.stride() == (K, 1), f"a must be row-major, got strides {a.stride()}"
    assert b.shape[0] == K and b.stride() == (1, K), f"b must be column-major, got strides {b.stride()}"
    assert M % 4 == 0, f"cuBLASLt's block-scaled fp8 GEMM wants M % 4 == 0, got M={M}"
    assert scale_a.dim() == 2 and size_stride(scale_a, 0, M, 1) and size_stride(scale_a, 1, L, M), (
        f"scale_a must be [M, K/128] outer-dim-major, got {tuple(scale_a.shape)} strides {scale_a.stride()}"
    )
    assert bias is None and scale_result is None and out is None
    sb = scale_b.t()
    if sb.dim() == 2 and size_stride(sb, 0, N // 128, L) and size_stride(sb, 1, L, 1):
        # 128x128: cuBLASLt reads block (n, k) at n * round_up(L, 4) + k from the pointer on; past the
        # tensor's storage lies memory the test cannot know: NaN.
        ld = -(-L // 4) * 4
        avail = sb.untyped_storage().nbytes() // sb.element_size() - sb.storage_offset()
        flat = torch.as_strided(sb, (avail,), (1,), sb.storage_offset())
        at = torch.arange(N // 128)[:, None] * ld + torch.arange(L)
        blocks = torch.where(at < avail, flat[at.clamp(max=avail - 1)], torch.tensor(float("nan")))
    elif sb.dim() == 2 and size_stride(sb, 0, N, 1) and size_stride(sb, 1, L, N):
        # 1x128: [K/128, N] N-major, as torch lays it out. The product below takes one scale per 128-row
        # block, so the emulator takes only per-row scales that are their block's.
        rows = sb.contiguous().reshape(N // 128, 128, L)
        assert torch.equal(rows, rows[:, :1].expand_as(rows)), (
            "emulator: 1x128 b scales must be constant per block"
        )
        blocks = rows[:, 0]
    else:
        raise AssertionError(
            f"scale_b.t() must be [N/128, K/128] row-major or [N, K/128] outer-dim-major, "
            f"got {tuple(sb.shape)} strides {sb.stride()}"
        )
    return block_scaled_gemm(a, scale_a.contiguous(), b.t(), blocks.contiguous()).to(
        out_dtype or torch.bfloat16
    )


def install_scaled_mm_emulator(monkeypatch=None) -> None:
    if monkeypatch is None:
        torch._scaled_mm = emulated_scaled_mm
    else:
        monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)


def test_cpu_torch_has_no_block_scaled_scaled_mm(gen):
    """Why the emulator exists: the CPU build refuses the (BlockWise1x128, BlockWise128x128) recipe in the
    layouts the CUDA build takes. Should a torch take it, this fails: drop the emulator, use the real op."""
    M, K, N = 8, 512, 256
    a = torch.randn(M, K, generator=gen).to(E4M3)
    b = torch.randn(N, K, generator=gen).to(E4M3).t()
    scale_a = torch.rand(K // 128, M, generator=gen).t()
    scale_b = torch.rand(N // 128, K // 128, generator=gen).t()
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        _REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    emulated = emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    assert torch.equal(emulated, block_scaled_gemm(a, scale_a.contiguous(), b.t(), scale_b.t().contiguous()))


def test_weight_scale_recipe_follows_cublaslt_scale_layout(gen):
    """128x128 weight scales only where cuBLASLt's padded leading dimension round_up(K/128, 4) equals torch's
    K/128 (or one block row makes it moot); elsewhere per-row 1x128 scales, which compute the same product.
    The emulator reproduces what an H200 did with unpadded 128x128 scales at K = 384: a wrong product."""
    assert weight_scale_recipe(256, 512) == BLOCK_128x128 and weight_scale_recipe(4096, 7168) == BLOCK_128x128
    assert (
        weight_scale_recipe(128, 384) == BLOCK_128x128
    )  # one block row: the leading dimension is never used
    assert weight_scale_recipe(256, 384) == BLOCK_1x128 and weight_scale_recipe(2048, 768) == BLOCK_1x128
    M, N = 8, 256
    for K in (384, 512):
        w = torch.randn(N // 128, 128, K // 128, 128, generator=gen) * torch.rand(
            N // 128, 1, K // 128, 1, generator=gen
        )
        q_w, s_w = quantize_weight_blocks(w.reshape(N, K))
        q_a, s_a = quantize_per_token_group(torch.randn(M, K, generator=gen).bfloat16())
        want = block_scaled_gemm(q_a, s_a, q_w, s_w)
        scale_a = s_a.t().contiguous().t()
        unpadded = emulated_scaled_mm(q_a, q_w.t(), scale_a, s_w.t(), out_dtype=torch.float32)
        assert torch.equal(unpadded, want) == (K == 512)  # K/128 = 3: block row 1 read from the wrong place
        got = emulated_scaled_mm(q_a, q_w.t(), scale_a, weight_scale_b(s_w), out_dtype=torch.float32)
        assert torch.equal(got, want)
    per_row = weight_scale_b(s_w[:, :3])  # K/128 = 3 again: [3, N] N-major, each row its block's
    assert per_row.shape == (3, N) and per_row.is_contiguous() and torch.equal(per_row[:, 127], per_row[:, 0])


# ------------------------------------------------------------------------------------ shapes, options


def test_dsv4_flash_shape_and_its_anchor():
    s = MODELS["dsv4-flash"]
    assert (s.num_experts, s.top_k, s.hidden, s.intermediate) == (256, 6, 4096, 2048)
    a = ANCHORS["dsv4-flash"]
    assert (a.dtype, a.ep, a.gpu, a.num_experts) == ("fp8", 8, "H200", 256)
    assert a.latency_us == {8: 225.0, 128: 265.0, 1024: 637.0} and "#383" in a.source
    assert a.experts_per_rank == 32
    assert a.comparable(256, 8, "fp8")  # EP8: the anchor's own setup
    assert a.comparable(32, 1, "fp8")  # world 1 with --per-rank-of-ep 8: 256 x 1 / 8 experts on the GPU
    assert not a.comparable(256, 4, "fp8")  # EP4: 64 experts per rank, twice the weight bytes
    assert not a.comparable(256, 8, "bf16")
    # Every shape of the registry has an fp8 layer (H and I multiples of the 128 block).
    assert all(m.hidden % 128 == 0 and m.intermediate % 128 == 0 for m in MODELS.values())


def test_dtype_options_are_parsed_and_validated(monkeypatch):
    args = layer_bench.parse_args(["--device", "cpu"])
    assert args.dtype == "bf16" and args.fp8_gemm == "auto" and layer_bench.weight_format(args) is BF16
    args = layer_bench.parse_args(
        ["--dtype", "fp8", "--models", "dsv4-flash,qwen3-30b-a3b", "--fp8-gemm", SCALED_MM_LOOP]
    )
    assert args.dtype == "fp8" and args.fp8_gemm == SCALED_MM_LOOP and layer_bench.weight_format(args) is FP8
    assert args.models == ["dsv4-flash", "qwen3-30b-a3b"]
    for bad in (["--dtype", "fp16"], ["--fp8-gemm", "cublas"]):
        with pytest.raises(SystemExit):
            layer_bench.parse_args(["--device", "cpu", *bad])
    monkeypatch.setitem(layer_bench.MODELS, "odd", ModelShape("odd", 256, 96, 16, 4))
    assert layer_bench.parse_args(["--device", "cpu", "--models", "odd"]).dtype == "bf16"  # fine in bf16
    with pytest.raises(SystemExit):
        layer_bench.parse_args(["--device", "cpu", "--models", "odd", "--dtype", "fp8"])


def test_fp8_weights_take_half_the_memory_and_serving_layers_follow(monkeypatch):
    import argparse

    s = MODELS["deepseek-v3"]
    assert layer_bench.per_rank_weight_bytes(s, 4) == 64 * 3 * 7168 * 2048 * 2
    fp8 = layer_bench.per_rank_weight_bytes(s, 4, FP8)
    assert fp8 == 64 * (3 * 7168 * 2048 + (32 * 56 + 56 * 16) * 4)

    class GpuRanks:
        device = torch.device("cuda", 0)
        world = 4

    monkeypatch.setattr(layer_bench.serving, "l2_bytes", lambda device: 50 * 2**20)
    ns = argparse.Namespace(mode=["serving"], layers=None, min_layers=1, dtype="fp8")
    qwen = MODELS["qwen3-30b-a3b"]  # 32 experts per rank: 151 MB of fp8 weights, 302 MB of bf16
    assert layer_bench.serving_layers(qwen, GpuRanks(), ns) == 2  # 4 x 50 MiB = 210 MB needs two fp8 layers
    ns.dtype = "bf16"
    assert layer_bench.serving_layers(qwen, GpuRanks(), ns) == 1


# --------------------------------------------------------------------------------- fp8 expert stage


def _fp8_layer(gen, E=4, H=256, inter=128):
    q13, s13, q2, s2 = random_fp8_expert_weights(E, H, inter, gen)
    return BlockFp8(q13, s13), BlockFp8(q2, s2)


@pytest.mark.parametrize("hidden", [256, 384, 512])  # GEMM0's K/128 = 2, 3: 1x128 weight scales; 4: 128x128
@pytest.mark.parametrize("m", [1, 3, 4, 7, 12])
def test_scaled_mm_blockwise_uses_the_cuda_layouts_and_pads_rows(m, hidden, gen, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    w13, w2 = _fp8_layer(gen, H=hidden)
    x = random_grouped_hidden(m, hidden, gen)
    q_x, s_x = quantize_per_token_group(x)
    for e in range(w13.shape[0]):
        want = block_scaled_gemm(q_x, s_x, w13.q[e], w13.scale_inv[e])
        got = scaled_mm_blockwise(q_x, s_x, w13.q[e], w13.scale_inv[e], torch.float32)
        assert got.shape == (m, 256) and got.dtype == torch.float32 and torch.equal(got, want)
        # The expert's scale_b kept by BlockFp8 (built once for all experts) gives the same bits.
        kept = scaled_mm_blockwise(q_x, s_x, w13.q[e], w13.scale_inv[e], torch.float32, w13.scale_b(e))
        assert torch.equal(kept, want)
    assert w13.scale_b(0).data_ptr() == w13.scale_b(0).data_ptr()  # kept, not rebuilt per call


def test_fp8_swiglu_scaled_mm_loop_matches_the_fp8_reference(gen, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    w13, w2 = _fp8_layer(gen, E=5)
    sizes = [3, 0, 9, 1, 6]  # an empty expert and row counts off the padding multiple
    x = random_grouped_hidden(sum(sizes), 256, gen)
    y = Fp8SwiGLU(SCALED_MM_LOOP)(x, group_offsets(torch.tensor(sizes)), sizes, w13, w2)
    ref = check.expert_rows_reference_fp8(x, sizes, w13, w2)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    stats = check.error_stats(y, ref)
    # The emulator sums each 128-block exactly, as the reference does: only the SwiGLU's fp32 (torch's silu)
    # against the reference's float64 silu differs, which flips an activation rounding now and then.
    assert check.fp8_within(stats, 128) and stats.rel_fro < 2e-3, stats
    with pytest.raises(ValueError, match="group sizes"):
        Fp8SwiGLU(SCALED_MM_LOOP)(x, None, None, w13, w2)


def test_fp8_swiglu_dequant_loop_is_the_bf16_layer_on_dequantised_weights(gen):
    w13, w2 = _fp8_layer(gen, E=3)
    sizes = [4, 0, 5]
    x = random_grouped_hidden(9, 256, gen)
    y = Fp8SwiGLU(DEQUANT_MM_LOOP)(x, group_offsets(torch.tensor(sizes)), sizes, w13, w2)
    assert check.compare(y, check.expert_rows_reference(x, sizes, w13.as_bf16(), w2.as_bf16())).ok
    # The dequantised weights are the fp32 product rounded once to bf16, expert by expert.
    from flashmoe.fp8 import dequantize_weight_blocks

    full = w13.dequantized()
    assert full.dtype == torch.bfloat16 and torch.equal(
        full[2], dequantize_weight_blocks(w13.q[2], w13.scale_inv[2]).to(torch.bfloat16)
    )
    # It is not the fp8 function (no activation quantisation): several percent away from the fp8 reference.
    fp8_ref = check.expert_rows_reference_fp8(x, sizes, w13, w2)
    assert check.error_stats(y, fp8_ref).rel_fro > FP8_SAME_ROUNDING_REL_FRO


def test_fp8_expert_gemm_selection(monkeypatch):
    impl, why = select_fp8_expert_gemm("auto", CPU)  # torch's CPU build has no block-scaled _scaled_mm
    assert impl == DEQUANT_MM_LOOP and "dequantised" in why and "\n" not in why
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, asking for it explicitly fails
        select_fp8_expert_gemm(SCALED_MM_LOOP, CPU)
    assert select_fp8_expert_gemm(DEQUANT_MM_LOOP, CPU)[0] == DEQUANT_MM_LOOP
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    impl, why = select_fp8_expert_gemm("auto", CPU)
    assert impl == SCALED_MM_LOOP and "probe rel err" in why

    def ignores_weight_scales(a, b, scale_a, scale_b, **kw):  # a GEMM that reads the weight scales wrong
        return emulated_scaled_mm(a, b, scale_a, torch.ones_like(scale_b), **kw)

    monkeypatch.setattr(torch, "_scaled_mm", ignores_weight_scales)
    impl, why = select_fp8_expert_gemm("auto", CPU)
    assert impl == DEQUANT_MM_LOOP and "disagrees" in why
    with pytest.raises(RuntimeError, match="disagrees"):
        select_fp8_expert_gemm(SCALED_MM_LOOP, CPU)
    # A GEMM that returns NaN (garbage scales read past a tensor) disagrees too: NaN is no small error.
    monkeypatch.setattr(
        torch, "_scaled_mm", lambda a, b, **kw: torch.full((a.shape[0], b.shape[1]), float("nan"))
    )
    assert select_fp8_expert_gemm("auto", CPU)[0] == DEQUANT_MM_LOOP


def test_probe_catches_unpadded_128x128_weight_scales(monkeypatch):
    """What the H200 run hit (128x128 weight scales for every shape, K/128 = 3 in the probe): the probe
    disagrees and auto falls back; with the recipe choice the same emulated cuBLASLt passes both recipes."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    seen = []
    real_recipe = grouped_gemm.weight_scale_recipe
    monkeypatch.setattr(
        grouped_gemm, "weight_scale_recipe", lambda n, k: seen.append(real_recipe(n, k)) or seen[-1]
    )
    impl, why = select_fp8_expert_gemm("auto", CPU)
    assert impl == SCALED_MM_LOOP and "both weight recipes" in why
    assert set(seen) == {BLOCK_128x128, BLOCK_1x128}
    monkeypatch.setattr(grouped_gemm, "weight_scale_recipe", lambda n, k: BLOCK_128x128)
    impl, why = select_fp8_expert_gemm("auto", CPU)
    assert impl == DEQUANT_MM_LOOP and "disagrees" in why


# ------------------------------------------------------------------------------------- check wiring


def _tiny_model(gen, layers=2) -> layer_bench.ModelState:
    s = MODELS["tiny"]
    placement = ExpertPlacement.contiguous(s.num_experts, 1)
    w13, w2 = [], []
    for _ in range(layers):
        a, b = _fp8_layer(gen, s.num_experts, s.hidden, s.intermediate)
        w13.append(a)
        w2.append(b)
    return layer_bench.ModelState(s, s.num_experts, "", placement, None, w13, w2, FP8)


def _tiny_inputs(m, tokens, gen) -> layer_bench.InputSet:
    from moe_bench.baselines import ExpertRows

    layers = []
    for _ in m.w13:
        x = random_grouped_hidden(tokens, m.shape.hidden, gen)
        ids = torch.stack(
            [torch.randperm(m.shape.num_experts, generator=gen)[: m.shape.top_k] for _ in range(tokens)]
        )
        w = torch.softmax(torch.randn(tokens, m.shape.top_k, generator=gen), 1)
        rows = ExpertRows.of_tokens(x, ids.int(), m.shape.num_experts)
        layers.append(layer_bench.LayerInput(x, ids.int(), w, torch.empty_like(x), rows))
    return layer_bench.InputSet(layers)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (the fp8 verdict is a collective), torn down after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield Ranks(dist.group.WORLD, CPU)
    dist.destroy_process_group()


def test_check_kinds_by_variant_and_expert_stage():
    k = layer_bench.check_kind
    assert [k(v, FP8, SCALED_MM_LOOP) for v in ("flashmoe", "all_to_all", "allgather_rs", "compute_only")] == [
        "reference_fp8", "reference_fp8", "reference_fp8", "rows_fp8",
    ]  # fmt: skip
    assert [k(v, FP8, DEQUANT_MM_LOOP) for v in ("flashmoe", "all_to_all", "compute_only")] == [
        "reference_fp8", "reference_dequant", "rows_dequant",
    ]  # fmt: skip
    assert [k(v) for v in ("flashmoe", "compute_only", "deepep_ll_comm", "deepep_ll_fp8")] == [
        "reference", "rows", "comm", "deepep_fp8_input",
    ]  # fmt: skip
    assert set(layer_bench.CHECKS) >= set(layer_bench.LAYER_CHECKS) | set(layer_bench.FP8_BUDGET_CHECKS)


def test_fp8_check_uses_the_suites_budgets_and_catches_wrong_outputs(gen, one_rank_group):
    m = _tiny_model(gen)
    inputs = _tiny_inputs(m, 24, gen)
    refs = {"reference_fp8": layer_bench.layer_references("reference_fp8", m, inputs, None, 1)}
    assert check.fp8_budget(128) == (FP8_SAME_ROUNDING_REL_FRO, fp8_row_rel(128), fp8_min_rows_for_batch(128))

    def judged(outputs, variant="flashmoe"):
        checked = layer_bench.check_step(variant, outputs, inputs, m, refs, kind="reference_fp8")
        row = {}
        return layer_bench.judge(checked, row, m, one_rank_group), row

    wrong, row = judged(list(refs["reference_fp8"]))
    assert wrong is None and row["check_rel_l2"] == 0 and row["check_max_row_rel"] == 0
    assert row["check_against"] == "flashmoe.reference_fp8 (fp8 budgets)"
    # Rounding-level differences (one bf16 ulp on every element) pass.
    noisy = [
        (r.float() * (1 + 2**-8 * torch.randn(r.shape, generator=gen).sign())).bfloat16()
        for r in refs["reference_fp8"]
    ]
    assert judged(noisy)[0] is None
    # A layer computed with every weight block's scale set to its expert's mean (scales ignored per block) fails.
    a = inputs.layers[1]
    from flashmoe.reference_fp8 import moe_reference_fp8

    w13, w2 = m.w13[1], m.w2[1]
    flat = [s.mean(dim=(1, 2), keepdim=True).expand_as(s).contiguous() for s in (w13.scale_inv, w2.scale_inv)]
    unscaled = moe_reference_fp8(a.x, a.ids, a.weights, w13.q, flat[0], w2.q, flat[1])
    wrong, row = judged([refs["reference_fp8"][0], unscaled])
    assert wrong and "fp8 budgets" in wrong and row["check_rel_l2"] > FP8_SAME_ROUNDING_REL_FRO
    # A dropped expert slot fails by far, and so does a truncated output.
    dropped_ids = a.ids.clone()
    dropped_ids[:, 0] = -1
    dropped = moe_reference_fp8(a.x, dropped_ids, a.weights, w13.q, w13.scale_inv, w2.q, w2.scale_inv)
    assert judged([refs["reference_fp8"][0], dropped])[0]
    assert judged([refs["reference_fp8"][0], refs["reference_fp8"][1][:-1]])[0]


def test_compute_only_fp8_rows_check(gen, one_rank_group, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    m = _tiny_model(gen)
    inputs = _tiny_inputs(m, 8, gen)
    sw = Fp8SwiGLU(SCALED_MM_LOOP)
    outs = [sw(a.expert_rows.x, a.expert_rows.offs, a.expert_rows.sizes, m.w13[i], m.w2[i]) for i, a in enumerate(inputs.layers)]  # fmt: skip
    kind = layer_bench.check_kind("compute_only", FP8, sw.impl)
    checked = layer_bench.check_step("compute_only", outs, inputs, m, {}, kind=kind)
    assert checked.kind == "rows_fp8" and checked.stats.rows == 2 * 8 * 4
    assert layer_bench.judge(checked, {}, m, one_rank_group) is None
    swapped = [outs[1], outs[0]]  # each layer's rows through the other layer's weights
    assert layer_bench.judge(
        layer_bench.check_step("compute_only", swapped, inputs, m, {}, kind=kind), {}, m, one_rank_group
    )


def test_results_rows_carry_the_dtype_and_old_files_read_as_bf16(tmp_path):
    row = results.new_row(model="tiny", variant="flashmoe", status="unavailable", note="x")
    assert row["dtype"] == "bf16" and row["check_max_row_rel"] is None and row["check_against"] is None
    doc = {"schema": results.SCHEMA, "complete": True, "machine": {}, "software": {}, "config": {},
           "rates": {"gemm_tflops": 1.0, "copy_GBps": 1.0, "link_GBps": 0.0}, "rows": [dict(row, dtype="fp16")]}  # fmt: skip
    assert any("dtype 'fp16'" in e for e in results.validate(doc))
    doc["rows"] = [dict(row, dtype="fp8")]
    assert any("fp8_gemm_tflops" in e for e in results.validate(doc))
    doc["rates"]["fp8_gemm_tflops"] = 1500.0
    assert results.validate(doc) == []
    old = dict(row)
    for f in ("dtype", "check_max_row_rel", "check_against"):
        del old[f]
    doc["rows"] = [old]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert results.load(path)["rows"][0]["dtype"] == "bf16"


def _fp8_row(variant, latency, world, experts, tokens=128, backend="megakernel"):
    return results.new_row(
        model="dsv4-flash", hidden=4096, intermediate=2048, num_experts=experts, model_num_experts=256, top_k=6,
        dtype="fp8", world_size=world, tokens_per_rank=tokens, routing="uniform", variant=variant, mode="flushed",
        layers=1, backend=backend, status="ok", latency_us=latency, latency_p10_us=latency, latency_p50_us=latency,
        latency_p90_us=latency, latency_per_rank_us=[latency] * world, iters=8, sets=2, floor_us=170.0,
        floor_nodedup_us=170.0, t_gemm_us=10.0, t_weights_us=170.0, t_link_us=0.0, t_link_nodedup_us=0.0,
        bound="weights", x_floor=latency / 170, x_floor_nodedup=latency / 170,
    )  # fmt: skip


def test_tables_put_the_anchor_beside_fp8_rows_and_a_ratio_only_at_equal_per_rank_work():
    one_gpu = [
        _fp8_row("flashmoe", 318.0, 1, 32),
        _fp8_row("compute_only", 300.0, 1, 32, backend=SCALED_MM_LOOP),
    ]
    ep4 = [_fp8_row("flashmoe", 400.0, 4, 256), _fp8_row("all_to_all", 900.0, 4, 256, backend=SCALED_MM_LOOP)]
    text = table.text_table(one_gpu, expert_gemm=SCALED_MM_LOOP)
    assert "[flushed · fp8 weights · baselines' expert GEMM: scaled_mm_loop]" in text and "anchor us" in text
    assert "265 (EP8) flashmoe 1.20x" in text  # world 1 with E/8 experts: the anchor's per-rank work
    assert "DeepGEMM Mega MoE, EP8 H200 fp8" in text and "32 experts" in text
    text4 = table.text_table(ep4)
    assert "265 (EP8)" in text4 and "flashmoe 1." not in text4  # EP4: 64 experts per rank, no ratio
    md = table.markdown_table(ep4, tokens=(128,), dtype="fp8")
    assert "| anchor µs |" in md and "| 265 (EP8) |" in md and "2.25×" in md  # speedup over all_to_all
    assert table.markdown_table(ep4, tokens=(128,)) == ""  # fp8 rows stay out of the bf16 tables
    assert "265 (EP8) flashmoe 1.20×" in table.markdown_table(one_gpu, tokens=(128,), dtype="fp8")
    mixed = ep4 + [dict(r, dtype="bf16") for r in ep4]
    assert table.text_table(mixed).count("anchor us") == 1  # the anchor is fp8: only the fp8 table has it
    assert table.markdown_table([_fp8_row("flashmoe", 400.0, 4, 256, tokens=512)], tokens=(512,), dtype="fp8")


def test_plot_keeps_fp8_rows_apart(tmp_path):
    pytest.importorskip("matplotlib")
    import plot

    rows = [_fp8_row("flashmoe", 400.0, 4, 256, tokens=t) for t in (8, 128, 1024)]
    bf16 = [dict(r, dtype="bf16", latency_us=700.0, latency_p50_us=700.0, latency_p10_us=700.0, latency_p90_us=700.0) for r in rows]  # fmt: skip
    doc = {"schema": results.SCHEMA, "created": "2026-01-02T03:04:05+00:00", "argv": [], "complete": True,
           "stopped_reason": None, "elapsed_s": 1.0, "env": {},
           "machine": {"tag": "4xH200", "hostname": "h", "device": "cuda", "gpu_count": 4},
           "software": {"torch": "2.11.0+cu130", "commit": "0123456789abcdef"},
           "config": {"world_size": 4, "grouped_gemm": "torch._grouped_mm", "fp8": {"expert_gemm": SCALED_MM_LOOP}},
           "rates": {"gemm_tflops": 790.0, "copy_GBps": 4300.0, "link_GBps": 392.0, "link_method": "copy engine",
                     "fp8_gemm_tflops": 1500.0},
           "rows": rows + bf16}  # fmt: skip
    assert len(plot.merge_runs([doc, dict(doc, created="2026-01-03T00:00:00+00:00")])[0]["rows"]) == 6
    path = tmp_path / "2026-01-02-4xH200-layer.json"
    results.write_json(path, doc)
    readme = tmp_path / "README.md"
    readme.write_text(f"{plot.BEGIN}\n{plot.END}\n")
    assert plot.main([str(path), "--readme", str(readme)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "2026-01-02-4xH200-layer-fp8-uniform.png", "2026-01-02-4xH200-layer-uniform.png",
    ]  # fmt: skip
    text = readme.read_text()
    assert "fp8 GEMM rate measured in the run: 1500 TFLOP/s" in text and "| 265 (EP8) |" in text
    assert "| dsv4-flash | 1024 |" in text and "anchor for dsv4-flash" in text


# ------------------------------------------------------------------------------------------ whole runs

RUN_ARGS = ["--device", "cpu", "--dtype", "fp8", "--tokens", "8", "--routing", "uniform", "--min-iters", "2",
            "--max-iters", "2", "--warmup", "1", "--max-sets", "2", "--no-warmup-case"]  # fmt: skip


def _assert_fp8_run(doc: dict, world: int, expert_gemm: str) -> dict:
    assert results.validate(doc) == [] and doc["complete"] and doc["config"]["world_size"] == world
    assert doc["config"]["dtype"] == "fp8" and doc["config"]["fp8"]["expert_gemm"] == expert_gemm
    recipes = doc["config"]["fp8"]["scaled_mm_weight_scales"]
    if expert_gemm == SCALED_MM_LOOP:  # tiny: H = 256, I = 128, two 128-row blocks in each weight
        assert recipes == {"tiny": {"gemm0 (w13)": BLOCK_1x128, "gemm1 (w2)": BLOCK_1x128}}
    else:
        assert recipes is None
    assert doc["config"]["check"]["fp8_budgets"]["rel_fro"] == FP8_SAME_ROUNDING_REL_FRO
    rate = doc["rates"]["fp8_gemm_tflops"]
    assert rate > 0 and doc["rates"]["fp8_gemm"].startswith("e4m3 torch._scaled_mm")
    rows = {r["variant"]: r for r in doc["rows"]}
    for r in rows.values():
        assert r["dtype"] == "fp8"
        # The floor's GEMM term is at the fp8 rate measured in this run (one input set per case, by --max-sets 2:
        # the mean over sets of the busiest rank's rows, as gemm_rows).
        assert r["t_gemm_us"] == pytest.approx(6 * r["gemm_rows"] * 256 * 128 / (rate * 1e12) * 1e6, rel=1e-6)
        assert r["floor_us"] == max(r["t_gemm_us"], r["t_weights_us"], r["t_link_us"])
    return rows


def test_one_rank_fp8_run_with_flashmoe_and_scaled_mm(tmp_path, monkeypatch, capsys):
    install_scaled_mm_emulator(monkeypatch)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so that what main() sets is undone after the test
        monkeypatch.delenv(k)
    for k in layer_bench.NO_MULTICAST_ENV:
        monkeypatch.setenv(k, os.environ.get(k, layer_bench.NO_MULTICAST_ENV[k]))
    out = tmp_path / "w1.json"
    variants = "flashmoe,all_to_all,allgather_rs,compute_only,vllm_fused,deepep_ll"
    assert layer_bench.main([*RUN_ARGS, "--variants", variants, "--mode", "flushed,serving", "--layers", "2",
                             "--fp8-gemm", SCALED_MM_LOOP, "--out", str(out)]) == 0  # fmt: skip
    doc = results.load(out)
    rows = _assert_fp8_run(doc, 1, SCALED_MM_LOOP)
    assert doc["rates"]["fp8_blockwise_gemm_tflops"] > 0  # via the emulator
    # flashmoe's own fp8 layer, built as an engine builds it: two block-fp8 layers on the CPU (reference) backend,
    # for the reason flashmoe's backend selection gives.
    assert "flashmoe tiny: 2 layer(s), backend reference (device is cpu, not cuda)" in capsys.readouterr().out
    for mode in ("flushed", "serving"):
        got = {r["variant"]: r for r in doc["rows"] if r["mode"] == mode}
        fm = got["flashmoe"]
        # The CPU backend computes flashmoe.reference_fp8 itself: the check finds no difference at all.
        assert fm["status"] == "ok" and fm["backend"] == "reference", fm["note"]
        assert fm["check_rel_l2"] == 0 and fm["check_max_row_rel"] == 0
        assert fm["check_against"] == "flashmoe.reference_fp8 (fp8 budgets)"
        for v in ("all_to_all", "allgather_rs", "compute_only"):
            r = got[v]
            assert r["status"] == "ok" and r["backend"] == SCALED_MM_LOOP, r["note"]
            assert 0 <= r["check_rel_l2"] <= FP8_SAME_ROUNDING_REL_FRO
            assert r["check_max_row_rel"] <= fp8_row_rel(128)
            assert "fp8 budgets" in r["check_against"]
        assert got["vllm_fused"]["status"] == got["deepep_ll"]["status"] == "unavailable"
        assert "no fp8" in got["vllm_fused"]["note"] and "no fp8-weight path" in got["deepep_ll"]["note"]
    assert rows["compute_only"]["gemm_rows"] == rows["flashmoe"]["gemm_rows"] == 8 * 4  # world 1: same rows


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    install_scaled_mm_emulator()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    variants = "flashmoe,all_to_all,allgather_rs,compute_only"
    assert layer_bench.main([*RUN_ARGS, "--variants", variants, "--fp8-gemm", "auto", "--out", out]) == 0


@pytest.mark.timeout(240)
def test_two_rank_fp8_run_judges_all_ranks_rows_together(tmp_path):
    """EP2 over gloo: flashmoe's fp8 layer (its distributed CPU backend), scaled_mm baselines (emulated) and the
    verdict over both ranks' rows; ``--fp8-gemm auto`` picks scaled_mm_loop because the emulated probe agrees."""
    out = tmp_path / "w2.json"
    run_ranks(_two_rank_worker, 2, (str(out),), timeout=200)
    rows = _assert_fp8_run(results.load(out), 2, SCALED_MM_LOOP)
    fm = rows["flashmoe"]
    assert fm["status"] == "ok" and fm["backend"] == "reference", fm["note"]
    assert fm["check_rel_l2"] == 0 and fm["check_against"] == "flashmoe.reference_fp8 (fp8 budgets)"
    for v in ("all_to_all", "allgather_rs", "compute_only"):
        assert rows[v]["status"] == "ok" and rows[v]["check_max_row_rel"] is not None, rows[v]["note"]
    assert rows["all_to_all"]["t_link_us"] > 0  # EP2 moves rows: fp8 dispatch, bf16 combine


@pytest.mark.timeout(180)
def test_two_rank_cpu_smoke_fp8(tmp_path):
    """The plain CPU run a user gets (torchrun, no stand-ins): baselines dequantise (no block-scaled
    _scaled_mm on a CPU) and say so; flashmoe runs its fp8 layer on the reference backend."""
    out = tmp_path / "smoke-fp8.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           *RUN_ARGS, "--out", str(out), "--mode", "flushed,serving"]  # fmt: skip
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = results.load(out)
    assert doc["config"]["fp8"]["expert_gemm"] == DEQUANT_MM_LOOP and doc["rates"]["fp8_gemm_tflops"] > 0
    assert len(doc["rows"]) == 2 * len(table.VARIANTS)
    for r in doc["rows"]:
        assert r["dtype"] == "fp8"
        if r["variant"] in ("all_to_all", "allgather_rs", "compute_only"):
            assert r["status"] == "ok" and r["backend"] == DEQUANT_MM_LOOP and "dequantised" in r["note"]
            assert "bf16-dequantised weights" in r["check_against"] and r["check_rel_l2"] < 1e-2
        elif r["variant"] == "flashmoe":
            assert r["status"] == "ok" and r["backend"] == "reference", r
            assert r["check_against"] == "flashmoe.reference_fp8 (fp8 budgets)" and r["check_rel_l2"] == 0
        else:
            assert r["status"] == "unavailable" and r["note"]
    assert "[flushed · fp8 weights · baselines' expert GEMM: dequant_bf16_mm_loop]" in run.stdout
    assert "backend reference (device is cpu, not cuda)" in run.stdout
