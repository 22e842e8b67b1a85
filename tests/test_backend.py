"""flashmoe.backend: which weight formats flashmoe serves, and the one-line reasons for the rest.

Adapters call these at config time with the checkpoint's Hugging Face ``quantization_config`` (the
dicts below are the shapes real checkpoints carry), so every refusal must name what the format is.
"""

from __future__ import annotations

import pytest
import torch
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec
from flashmoe.backend import (
    FP8_BLOCK_128,
    HOPPER,
    REFERENCE,
    UNQUANTIZED,
    fallback_uses_deepep,
    forced_fallback_reason,
    megakernel_unsupported_reason_for,
    select_backend,
    shape_unsupported_reason,
    unsupported_weights,
    weight_format_for,
    weights_unsupported_reason,
)
from flashmoe.errors import FlashMoEUnsupported

DEEPSEEK_V3_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
QWEN3_FP8 = {
    "activation_scheme": "dynamic",
    "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# (engine quant_method, checkpoint quantization_config, words the reason must contain)
UNSUPPORTED = [
    ("fp8", {"quant_method": "fp8", "activation_scheme": "static"}, ["per-tensor fp8", "static"]),
    (
        "fp8",
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        ["per-tensor fp8", "no weight_block_size"],
    ),
    ("fp8", None, ["quantised online", "per-tensor"]),
    ("fp8", {**DEEPSEEK_V3_FP8, "scale_fmt": "ue8m0"}, ["UE8M0", "scale_fmt=ue8m0"]),
    ("fp8", {**DEEPSEEK_V3_FP8, "weight_block_size": [64, 64]}, ["64x64 blocks"]),
    ("fp8", {**DEEPSEEK_V3_FP8, "weight_block_size": [128, 64]}, ["128x64 blocks"]),
    ("fp8", {**DEEPSEEK_V3_FP8, "fmt": "e5m2"}, ["e5m2"]),
    ("fp8", {**DEEPSEEK_V3_FP8, "store_dtype": "mxfp4"}, ["MXFP4"]),
    ("mxfp4", {"quant_method": "mxfp4"}, ["MXFP4"]),
    ("awq_marlin", {"quant_method": "awq", "bits": 4, "group_size": 128}, ["AWQ int4", "W4A16"]),
    ("gptq_marlin", {"quant_method": "gptq", "bits": 8}, ["GPTQ int8"]),
    ("moe_wna16", {"quant_method": "awq", "bits": 4}, ["moe_wna16", "int4"]),
    ("compressed-tensors", {"quant_method": "compressed-tensors"}, ["compressed-tensors"]),
    ("fbgemm_fp8", {"quant_method": "fbgemm_fp8"}, ["per-channel fp8"]),
    ("modelopt_fp4", {"quant_method": "modelopt"}, ["NVFP4"]),
    ("some_new_scheme", {}, ["some_new_scheme"]),
]


@pytest.fixture(autouse=True)
def no_backend_override(monkeypatch):
    for name in ("FLASHMOE_BACKEND", "FLASHMOE_STRICT", "FLASHMOE_MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cfg", [DEEPSEEK_V3_FP8, QWEN3_FP8], ids=["deepseek_v3", "qwen3"])
def test_block_fp8_checkpoints_are_served(cfg):
    assert weight_format_for("fp8", cfg) is FP8_BLOCK_128
    assert weight_format_for(None, cfg) is FP8_BLOCK_128  # the checkpoint's own quant_method
    assert weights_unsupported_reason(FP8_BLOCK_128) is None
    assert FP8_BLOCK_128.weight_dtype == torch.float8_e4m3fn


def test_unquantized_is_served():
    assert weight_format_for(None, None) is UNQUANTIZED
    assert weights_unsupported_reason(UNQUANTIZED) is None
    assert UNQUANTIZED.weight_dtype is None


@pytest.mark.parametrize(
    "method,cfg,words", UNSUPPORTED, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(UNSUPPORTED)]
)
def test_other_formats_get_a_one_line_reason_naming_them(method, cfg, words):
    fmt = weight_format_for(method, cfg)
    assert fmt.kind == "unsupported"
    why = weights_unsupported_reason(fmt)
    assert why is not None and "\n" not in why
    for w in words:
        assert w in why, why
    assert "flashmoe serves unquantized or block-fp8" in why  # and what would be served instead
    # The megakernel's own answer carries the same reason (after the GPU check).
    assert megakernel_unsupported_reason_for(HOPPER, 2048, 768, 8, 4, torch.bfloat16, fmt) == why


def test_shape_rules_depend_on_the_weight_format():
    # bf16 tiles: I in 64-steps; block-fp8: whole 128x128 blocks in both dimensions.
    assert shape_unsupported_reason(2048, 192, 8, 4) is None
    why = shape_unsupported_reason(2048, 192, 8, 4, torch.bfloat16, FP8_BLOCK_128)
    assert (
        why == "MoE intermediate size 192 is not a multiple of 128 (block-fp8 weights come in 128x128 blocks)"
    )
    assert "hidden size 2112" in shape_unsupported_reason(2112, 768, 8, 4, torch.bfloat16, FP8_BLOCK_128)
    assert shape_unsupported_reason(2048, 768, 8, 4, torch.bfloat16, FP8_BLOCK_128) is None
    assert "dtype torch.float16" in shape_unsupported_reason(2048, 768, 8, 4, torch.float16, FP8_BLOCK_128)


def test_gpu_check_comes_first_and_format_is_typed():
    why = megakernel_unsupported_reason_for((10, 0), 2048, 768, 8, 4, torch.bfloat16, FP8_BLOCK_128)
    assert why.startswith("GPU is sm_100")
    with pytest.raises(TypeError, match="WeightFormat"):
        megakernel_unsupported_reason_for(HOPPER, 2048, 768, 8, 4, torch.bfloat16, "fp8")


def test_block_fp8_passes_the_format_and_shape_checks():
    why = megakernel_unsupported_reason_for(HOPPER, 7168, 2048, 8, 8, torch.bfloat16, FP8_BLOCK_128)
    # What is left depends on this machine's toolchain, not on the format.
    assert why is None or why.startswith(("NVSHMEM", "nvcc")), why


def _spec(**kw):
    return MoELayerSpec(
        num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, max_tokens_per_rank=16, **kw
    )


def test_select_backend_on_cpu_and_strict(monkeypatch):
    fp8 = _spec(weight_dtype=torch.float8_e4m3fn)
    choice = select_backend(fp8, torch.device("cpu"), 1)
    assert (choice.name, choice.reason) == (REFERENCE, "device is cpu, not cuda")
    monkeypatch.setenv("FLASHMOE_STRICT", "1")
    with pytest.raises(FlashMoEUnsupported, match="device is cpu"):
        select_backend(fp8, torch.device("cpu"), 1)
    monkeypatch.setenv("FLASHMOE_BACKEND", "reference")
    assert select_backend(fp8, torch.device("cpu"), 1).name == REFERENCE


def test_forced_fallback_is_for_the_adapters(monkeypatch):
    """FLASHMOE_BACKEND=fallback gives adapters their decline reason; a layer built directly refuses it."""
    monkeypatch.delenv("FLASHMOE_BACKEND", raising=False)
    assert forced_fallback_reason() is None
    monkeypatch.setenv("FLASHMOE_BACKEND", "Fallback")
    assert forced_fallback_reason() == "FLASHMOE_BACKEND=fallback"
    with pytest.raises(FlashMoEUnsupported, match="nothing to fall back to"):
        FlashMoE(_spec(), ExpertPlacement.contiguous(8, 1), device=torch.device("cpu"))


def test_flashmoe_quantized_flag_still_accepted():
    """``quantized=True`` (weights in a format the spec does not describe) keeps working; a block-fp8
    spec is not 'quantized -> unsupported'."""
    placement = ExpertPlacement.contiguous(8, 1)
    cpu = torch.device("cpu")
    assert FlashMoE(_spec(), placement, device=cpu, quantized=True).backend == REFERENCE
    layer = FlashMoE(_spec(weight_dtype=torch.float8_e4m3fn), placement, device=cpu, quantized=True)
    assert layer.backend == REFERENCE and layer.spec.fp8_weights


def test_unsupported_weights_description_is_kept():
    assert weights_unsupported_reason(unsupported_weights("int3 weights")).startswith("int3 weights: ")


def test_block_fp8_layer_facts():
    """Block-fp8 needs bf16 activations and whole 128-wide blocks on every backend; the reason says which."""
    assert (
        weights_unsupported_reason(
            FP8_BLOCK_128, hidden_size=2048, intermediate_size=768, dtype=torch.bfloat16
        )
        is None
    )
    why = weights_unsupported_reason(FP8_BLOCK_128, dtype=torch.float16)
    assert why == "block-fp8 experts with float16 activations (flashmoe's fp8 path takes bf16)"
    why = weights_unsupported_reason(FP8_BLOCK_128, hidden_size=2048, intermediate_size=192)
    assert why == "block-fp8 experts with MoE intermediate size 192, not a multiple of the 128-wide block"
    assert "hidden size 2100" in weights_unsupported_reason(FP8_BLOCK_128, hidden_size=2100)
    # Unquantized layers are not held to the fp8 rules.
    assert weights_unsupported_reason(UNQUANTIZED, intermediate_size=1408, dtype=torch.float16) is None


def test_hf_quantization_config_reads_dicts_and_objects():
    from types import SimpleNamespace

    from flashmoe.backend import hf_quantization_config

    class TransformersStyle:
        def to_dict(self):
            return dict(DEEPSEEK_V3_FP8)

    assert hf_quantization_config(SimpleNamespace()) is None
    assert (
        hf_quantization_config(SimpleNamespace(), SimpleNamespace(quantization_config=QWEN3_FP8)) == QWEN3_FP8
    )
    assert hf_quantization_config(SimpleNamespace(quantization_config=TransformersStyle())) == DEEPSEEK_V3_FP8


@pytest.mark.parametrize(
    "mode, importable, spans_nodes, expected",
    [
        ("auto", True, False, (False, "the EP group is on one node")),
        ("auto", True, True, (True, "the EP group spans nodes")),
        ("auto", False, True, (False, "deep_ep is not installed")),
        ("deepep", True, False, (True, "FLASHMOE_FALLBACK_ALL2ALL=deepep")),
        ("deepep", False, False, (False, "deep_ep is not installed")),
        ("default", True, True, (False, "FLASHMOE_FALLBACK_ALL2ALL=default")),
    ],
)
def test_fallback_takes_deepep_across_nodes_or_when_asked(
    monkeypatch, mode, importable, spans_nodes, expected
):
    """The engines' fallback all-to-all: DeepEP only where the EP group spans nodes unless told otherwise (on one
    node vLLM's DeepEP tier served at 0.14x of its default path), and never without deep_ep."""
    import sys
    import types

    monkeypatch.setenv("FLASHMOE_FALLBACK_ALL2ALL", mode)
    if importable:
        monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))  # a stand-in that imports
    else:
        monkeypatch.setitem(sys.modules, "deep_ep", None)  # import raises ImportError
    deepep, why = fallback_uses_deepep(spans_nodes)
    assert deepep == expected[0] and why.startswith(expected[1]), why


def test_fallback_all2all_is_validated(monkeypatch):
    from flashmoe import config

    monkeypatch.setenv("FLASHMOE_FALLBACK_ALL2ALL", " DeepEP ")
    assert config.fallback_all2all() == "deepep"
    monkeypatch.setenv("FLASHMOE_FALLBACK_ALL2ALL", "nccl")
    with pytest.raises(ValueError, match="FLASHMOE_FALLBACK_ALL2ALL='nccl'"):
        fallback_uses_deepep(True)
