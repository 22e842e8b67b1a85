"""The real-shaped random checkpoints the GPU serving runs load (flashmoe.demo.tiny_model), built here with the
shapes shrunk: the bf16 one, and its block-fp8 twin stored as Qwen3-30B-A3B-FP8 stores its linears, which vLLM's
fp8 config reads as block-quantised and flashmoe's backend check accepts for the experts."""

from __future__ import annotations

import json

import pytest
import torch
from flashmoe.demo import tiny_model

SMALL = {
    **tiny_model.QWEN3_30B_A3B,
    "vocab_size": 512,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@pytest.fixture
def small_shapes(monkeypatch):
    monkeypatch.setattr(tiny_model, "QWEN3_30B_A3B", SMALL)


def _load(path):
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors.update(load_file(path / shard))
    assert set(tensors) == set(index)
    return tensors


def test_fp8_checkpoint_is_the_bf16_model_block_quantised(small_shapes, tmp_path):
    from flashmoe.fp8 import dequantize_weight_blocks

    bf16 = _load(tiny_model.make_qwen3_30b_a3b_shaped(tmp_path / "bf16", num_layers=2, seed=3, device="cpu"))
    path = tiny_model.make_qwen3_30b_a3b_fp8_shaped(tmp_path / "fp8", num_layers=2, seed=3, device="cpu")
    fp8 = _load(path)

    quantised = [n for n in bf16 if n.endswith(".weight") and any(m in n for m in tiny_model._FP8_LINEARS)]
    assert len(quantised) == 2 * (4 + 3 * SMALL["num_experts"])
    for name in quantised:
        q, scale_inv = fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"]
        n, k = bf16[name].shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (n // 128, k // 128)
        ref = bf16[name].float()
        err = (dequantize_weight_blocks(q, scale_inv, 128) - ref).norm() / ref.norm()
        assert 0 < err < 0.05, (name, float(err))  # e4m3: ~3 mantissa bits, relative error a few percent
    for name, t in bf16.items():  # everything else is the bf16 model's tensor, bit for bit
        if name not in quantised:
            assert fp8[name].dtype == torch.bfloat16 and torch.equal(fp8[name], t), name

    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]

    from flashmoe.backend import FP8_BLOCK_128, weight_format_for

    assert weight_format_for("fp8", qc) == FP8_BLOCK_128  # the experts are what flashmoe serves in fp8
    # Idempotent: a second call finds the marker and writes nothing.
    stamp = (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    tiny_model.make_qwen3_30b_a3b_fp8_shaped(path, num_layers=2, seed=3, device="cpu")
    assert (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns == stamp


def test_vllm_reads_the_fp8_config_as_block_quantised_with_the_gates_kept(small_shapes, tmp_path):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    path = tiny_model.make_qwen3_30b_a3b_fp8_shaped(tmp_path / "fp8", num_layers=1, seed=0, device="cpu")
    cfg = Fp8Config.from_config(json.loads((path / "config.json").read_text())["quantization_config"])
    assert cfg.weight_block_size == [128, 128] and cfg.is_checkpoint_fp8_serialized
    assert "model.layers.0.mlp.gate" in cfg.ignored_layers and "lm_head" in cfg.ignored_layers
