"""Serving mode, the vllm_fused baseline and the TFLOP/s comparison of the layer benchmark (CPU pieces).

The GPU parts (CUDA graph capture, vLLM's Triton fused_experts) cannot run here; what can is checked:
the layer count rule, that a serving step's check catches a layer run with another layer's weights,
world-1 compute rows, vLLM's expert_map over a real placement, the skip reason, and the tables.
"""

import argparse

import bench_import  # noqa: F401
import layer_bench
import pytest
import torch
from flashmoe import ExpertPlacement
from flashmoe.reference import moe_reference
from moe_bench import results, serving, table
from moe_bench.baselines import EPLayout, ExpertRows
from moe_bench.check import expert_rows_reference
from moe_bench.shapes import MODELS
from moe_bench.vllm_fused import expert_map, load_fused_experts

CPU = torch.device("cpu")
MiB = 2**20


def test_layer_count_exceeds_four_l2_sizes_of_weights():
    # Qwen3-30B at EP4: 32 experts x 9.4 MB = 302 MB per rank, over 4 x 50 MiB already with one layer.
    per_rank = 32 * MODELS["qwen3-30b-a3b"].expert_weight_bytes()
    assert serving.layers_for(per_rank, 50 * MiB, min_layers=1) == 1
    assert serving.layers_for(per_rank, 50 * MiB, min_layers=4) == 4
    # Small per-rank weights: the fewest layers whose weights exceed 4 x L2, strictly.
    assert serving.layers_for(10 * MiB, 50 * MiB, min_layers=1) == 21
    assert serving.layers_for(20 * MiB, 50 * MiB, min_layers=1) == 11  # 10 x 20 = 4 x 50 is not more
    for per_rank in (1, 3 * MiB, 7 * MiB + 5, 200 * MiB):
        n = serving.layers_for(per_rank, 60 * MiB, min_layers=1)
        assert n * per_rank > 4 * 60 * MiB and (n == 1 or (n - 1) * per_rank <= 4 * 60 * MiB)
    with pytest.raises(ValueError):
        serving.layers_for(0, 50 * MiB, 1)


def _model(layers: int, gen) -> layer_bench.ModelState:
    shape = MODELS["tiny"]
    placement = ExpertPlacement.contiguous(shape.num_experts, 1)
    w13 = [(torch.randn(16, 256, 256, generator=gen) / 16).to(torch.bfloat16) for _ in range(layers)]
    w2 = [(torch.randn(16, 256, 128, generator=gen) / 12).to(torch.bfloat16) for _ in range(layers)]
    return layer_bench.ModelState(shape, 16, "", placement, None, w13, w2)


def _inputs(m, tokens, gen) -> layer_bench.InputSet:
    layers = []
    for _ in m.w13:
        x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)]).int()
        w = torch.softmax(torch.randn(tokens, 4, generator=gen), 1)
        layers.append(
            layer_bench.LayerInput(x, ids, w, torch.empty_like(x), ExpertRows.of_tokens(x, ids, 16))
        )
    return layer_bench.InputSet(layers)


def test_serving_check_catches_a_layer_run_with_another_layers_weights(gen):
    m = _model(3, gen)
    inputs = _inputs(m, 8, gen)
    refs = {
        "reference": [
            moe_reference(a.x, a.ids, a.weights, m.w13[i], m.w2[i]) for i, a in enumerate(inputs.layers)
        ]
    }
    right = [moe_reference(a.x, a.ids, a.weights, m.w13[i], m.w2[i]) for i, a in enumerate(inputs.layers)]
    assert layer_bench.check_step("flashmoe", right, inputs, m, refs).ok
    wrong = list(right)
    a = inputs.layers[2]
    wrong[2] = moe_reference(
        a.x, a.ids, a.weights, m.w13[0], m.w2[0]
    )  # the last layer reads layer 0's weights
    checked = layer_bench.check_step("flashmoe", wrong, inputs, m, refs)
    assert not checked.ok and checked.rel_l2 > 0.1 and checked.kind == "reference" and checked.stats is None
    # compute_only is checked per layer against its own weights too.
    rows_out = [expert_rows_reference(a.expert_rows.x, a.expert_rows.sizes, m.w13[i], m.w2[i])
                for i, a in enumerate(inputs.layers)]  # fmt: skip
    assert layer_bench.check_step("compute_only", rows_out, inputs, m, None).ok
    rows_out[1] = rows_out[1].flip(0)
    assert not layer_bench.check_step("compute_only", rows_out, inputs, m, None).ok


def test_world_one_compute_rows_are_the_layers_own_pairs_by_expert(gen):
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[3, 0], [1, 3], [0, 2], [3, 1], [2, 0]], dtype=torch.int32)
    rows = ExpertRows.of_tokens(x, ids, 4)
    assert rows.sizes == [3, 2, 2, 3]
    assert rows.offs.tolist() == [3, 5, 7, 10]
    # Tokens in order within each expert: expert 0 is hit by tokens 0, 2, 4, expert 3 by 0, 1, 3.
    assert torch.equal(rows.x[:3], x[[0, 2, 4]]) and torch.equal(rows.x[7:], x[[0, 1, 3]])


def test_vllm_expert_map_names_local_experts_and_hides_the_others():
    placement = ExpertPlacement.round_robin(8, 2)  # local index differs from global id / 2
    owner, local = placement.expert_rank.long(), placement.expert_local.long()
    for rank in (0, 1):
        ep = EPLayout(None, rank, 2, [4, 4], owner, local, local)
        m = expert_map(ep)
        assert m.dtype == torch.int32 and m.shape == (8,)
        for e in range(8):
            assert int(m[e]) == (int(local[e]) if int(owner[e]) == rank else -1)
        assert sorted(int(v) for v in m if v >= 0) == [0, 1, 2, 3]
    assert expert_map(EPLayout(None, 0, 1, [8], owner * 0, torch.arange(8), torch.arange(8))) is None


def test_vllm_fused_has_no_cpu_path_and_says_why():
    fused, version, reason = load_fused_experts(CPU)
    assert fused is None and "no CUDA device" in reason and "Triton" in reason
    try:  # the CPU build of vLLM really has no Triton fused_experts (if it is installed here)
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        assert version is None or version in reason
        return
    assert version in reason and not HAS_TRITON
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(NotImplementedError):
        fused_experts(x, torch.zeros(4, 64, 64).bfloat16(), torch.zeros(4, 64, 32).bfloat16(),
                      torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32))  # fmt: skip


def test_mode_and_layer_options_are_validated():
    args = layer_bench.parse_args(["--device", "cpu", "--mode", "serving,flushed", "--layers", "2"])
    assert args.mode == ["serving", "flushed"] and args.layers == 2
    assert layer_bench.parse_args(["--device", "cpu"]).mode == ["flushed"]  # today's behaviour by default
    for bad in (["--mode", "decode"], ["--layers", "0"], ["--per-rank-of-ep", "0"]):
        with pytest.raises(SystemExit):
            layer_bench.parse_args(["--device", "cpu", *bad])
    ns = argparse.Namespace(mode=["flushed"], layers=None)
    assert layer_bench.serving_layers(MODELS["tiny"], None, ns) == 1


def _row(variant, mode, latency, p10, p90, world=1, rows=64.0):
    flops = 6 * rows * 2048 * 768
    return results.new_row(
        model="qwen3-30b-a3b", hidden=2048, intermediate=768, num_experts=32, model_num_experts=128, top_k=8,
        world_size=world, tokens_per_rank=8, routing="uniform", variant=variant, mode=mode,
        layers=4 if mode == "serving" else 1, backend="megakernel" if variant == "flashmoe" else "x", status="ok", latency_us=latency, latency_p10_us=p10,
        latency_p50_us=latency, latency_p90_us=p90, latency_per_rank_us=[latency], iters=8, sets=2,
        floor_us=60.0, floor_nodedup_us=60.0, t_gemm_us=1.0, t_weights_us=60.0, t_link_us=0.0,
        t_link_nodedup_us=0.0, bound="weights", x_floor=latency / 60, x_floor_nodedup=latency / 60,
        gemm_rows=rows, tflops=flops / (latency * 1e-6) / 1e12,
    )  # fmt: skip


def test_tables_show_spread_modes_and_the_tflops_comparison():
    rows = [_row("flashmoe", "serving", 150.0, 140.0, 180.0), _row("compute_only", "serving", 120.0, 115.0, 130.0),
            _row("flashmoe", "flushed", 200.0, 190.0, 230.0), _row("vllm_fused", "serving", 300.0, 290.0, 330.0)]  # fmt: skip
    layer_bench.add_compute_ratios(rows[:2])
    assert rows[0]["tflops_vs_compute_only"] == pytest.approx(120.0 / 150.0)
    # 6 x 64 rows x 2048 x 768 flops in 150 us
    assert rows[0]["tflops"] == pytest.approx(6 * 64 * 2048 * 768 / 150e-6 / 1e12)
    text = table.text_table(rows)
    assert "[flushed]" in text and "[serving (per layer of a 4-layer step)]" in text
    assert "150.0 (2.50x) 1.29" in text  # p50 (x floor) p90/p10
    assert "[world 1: expert GEMM throughput" in text and "0.80x" in text
    md = table.markdown_table(rows, tokens=(8,), mode="serving")
    assert "vllm_fused µs (×floor)" in md and "2.00×" in md  # flashmoe speedup over vllm_fused: 300 / 150
    cmd = table.compute_markdown_table(rows, "serving")
    assert "| qwen3-30b-a3b | 8 | uniform | 64 |" in cmd and "0.80× |" in cmd
    rows[0]["world_size"] = 4  # at EP4 flashmoe includes communication: no GEMM comparison
    assert table.compute_markdown_table(rows, "serving") == ""


def test_percentiles_out_of_order_are_refused_and_old_files_load_as_flushed(tmp_path):
    doc = {"schema": results.SCHEMA, "complete": True, "machine": {}, "software": {}, "config": {},
           "rates": {"gemm_tflops": 1.0, "copy_GBps": 1.0, "link_GBps": 0.0},
           "rows": [_row("flashmoe", "serving", 150.0, 160.0, 180.0)]}  # fmt: skip
    assert any("percentiles out of order" in e for e in results.validate(doc))
    old = _row("flashmoe", "flushed", 150.0, 140.0, 180.0)
    for f in results.LATER_FIELDS:
        del old[f]
    doc["rows"] = [old]
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(doc))
    (row,) = results.load(path)["rows"]
    assert (row["mode"], row["layers"], row["graph"], row["latency_p50_us"]) == ("flushed", 1, False, 150.0)
