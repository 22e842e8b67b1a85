"""Issue 19: bad input is refused with a TypeError/ValueError naming the argument, before anything is
computed, by every backend through the one set of checks in ``flashmoe.validation``; routing ids mean
the same on every backend (-1 none, out-of-range refused where it can be checked for free and skipped
by the megakernel, duplicates summed).

CPU tests run the CPU path (FlashMoE on ``device="cpu"``, the reference functions, the gloo backend).
GPU tests (marked ``gpu``, skip without an sm_90 GPU) spawn rank processes that run the same cases
(``validation_cases.py``) against the megakernel. Block-fp8 layers (issue 15) get the same treatment
with their own cases (the scales and the fp8 half of the contract).
"""

from __future__ import annotations

import pytest
import torch
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, moe_oracle_fp64, moe_reference
from moe_inputs import random_expert_weights, random_hidden
from multiproc import run_ranks
from test_megakernel import gpu_skip_reason
from tolerances import (
    ORACLE_REL_FRO,
    ORACLE_ROW_REL,
    SAME_ROUNDING_REL_FRO,
    SAME_ROUNDING_ROW_REL,
    assert_within,
)
from validation_cases import (
    ARGS,
    BAD_CALLS,
    FP8_BAD_CALLS,
    MAX_T,
    E,
    bad_call_failures,
    cpu_duplicates_worker,
    duplicate_routing,
    fp8_reference,
    gpu_bad_inputs_worker,
    gpu_fp8_bad_inputs_worker,
    gpu_routing_ids_worker,
    layer_spec,
    valid_call,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_backend_override(monkeypatch):
    for name in ("FLASHMOE_BACKEND", "FLASHMOE_STRICT", "FLASHMOE_MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)


def cpu_layer(spec: MoELayerSpec | None = None) -> FlashMoE:
    layer = FlashMoE(
        spec or layer_spec(),
        ExpertPlacement.contiguous((spec or layer_spec()).num_experts, 1),
        None,
        device=CPU,
    )
    assert layer.backend == "reference"
    return layer


# ---------------------------------------------------------------------------------------------
# CPU path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c.name for c in BAD_CALLS])
def test_cpu_layer_refuses_bad_call_before_computing(case, seed):
    assert bad_call_failures(cpu_layer(), [case], CPU, seed) == []


def test_the_bad_call_cases_are_valid_without_their_corruption(seed):
    a = valid_call(CPU, seed)
    out = a["out"]
    assert cpu_layer()(**a) is out and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("case", FP8_BAD_CALLS, ids=[c.name for c in FP8_BAD_CALLS])
def test_cpu_fp8_layer_refuses_bad_call_before_computing(case, seed):
    assert bad_call_failures(cpu_layer(layer_spec(dtype="fp8")), [case], CPU, seed, "fp8") == []


def test_the_fp8_bad_call_cases_are_valid_without_their_corruption(seed):
    a = valid_call(CPU, seed, dtype="fp8")
    out = a["out"]
    assert cpu_layer(layer_spec(dtype="fp8"))(**a) is out
    assert torch.equal(out, fp8_reference(a)) and float(out.float().norm()) > 0


@pytest.mark.parametrize("name", ARGS)
@pytest.mark.parametrize("entry", [moe_reference, moe_oracle_fp64], ids=["moe_reference", "moe_oracle_fp64"])
@pytest.mark.parametrize("bad", [None, [[1.0]]], ids=["None", "list"])
def test_reference_functions_refuse_non_tensors(entry, name, bad, seed):
    a = valid_call(CPU, seed)
    del a["out"]
    a[name] = bad
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got {type(bad).__name__}"):
        entry(**a)


def test_placement_for_more_experts_than_the_spec_is_refused():
    with pytest.raises(ValueError, match="^placement has 16 experts but the spec's num_experts is 8"):
        FlashMoE(layer_spec(), ExpertPlacement.contiguous(2 * E, 1), None, device=CPU)
    with pytest.raises(ValueError, match="^placement has 4 experts"):
        FlashMoE(layer_spec(), ExpertPlacement.contiguous(4, 1), None, device=CPU)
    with pytest.raises(TypeError, match="^placement must be a flashmoe.ExpertPlacement, got list"):
        FlashMoE(layer_spec(), [0] * E, None, device=CPU)


SPEC_FIELDS = ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens_per_rank")


@pytest.mark.parametrize("field", SPEC_FIELDS)
@pytest.mark.parametrize("value", [True, False, 8.0, "8", None], ids=repr)
def test_spec_fields_must_be_real_ints(field, value):
    base = {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 256,
        "intermediate_size": 128,
        "max_tokens_per_rank": 64,
    }
    with pytest.raises(
        TypeError, match=f"^MoELayerSpec.{field} must be a positive int, got {type(value).__name__}"
    ):
        MoELayerSpec(**{**base, field: value})


@pytest.mark.parametrize(
    "dtype,error,match",
    [
        ("bfloat16", TypeError, "MoELayerSpec.dtype must be a torch.dtype, got str"),
        (torch.int8, ValueError, "MoELayerSpec.dtype torch.int8 not supported"),
    ],
)
def test_spec_dtype_must_be_a_supported_torch_dtype(dtype, error, match):
    with pytest.raises(error, match=f"^{match}"):
        MoELayerSpec(8, 2, 256, 128, 64, dtype=dtype)


def test_placement_fields_must_be_tensors_and_ints():
    i32 = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="^ExpertPlacement.expert_rank must be a torch.Tensor, got list"):
        ExpertPlacement([0, 0], torch.tensor([0, 1], dtype=torch.int32), 1)
    with pytest.raises(TypeError, match="^ExpertPlacement.expert_local must be a torch.Tensor, got NoneType"):
        ExpertPlacement(i32, None, 1)
    with pytest.raises(TypeError, match="^ExpertPlacement.world_size must be a positive int, got bool"):
        ExpertPlacement(i32, torch.tensor([0, 1], dtype=torch.int32), True)
    with pytest.raises(TypeError, match="^num_experts must be a positive int, got bool"):
        ExpertPlacement.contiguous(True, 1)
    with pytest.raises(ValueError, match="^world_size must be a positive int, got 0"):
        ExpertPlacement.round_robin(8, 0)


@pytest.mark.parametrize("bad_id", [-7, -2, E, E + 100, 2**31 - 1])
def test_cpu_refuses_ids_outside_minus_one_to_e(bad_id, seed):
    a = valid_call(CPU, seed)
    a["topk_ids"][3, 1] = bad_id
    # The message reports the observed range; its other end depends on the random routing.
    seen = rf"\[{bad_id}, -?\d+\]" if bad_id < -1 else rf"\[-?\d+, {bad_id}\]"
    with pytest.raises(ValueError, match=rf"^topk_ids values must be in \[-1, 8\), got {seen}"):
        cpu_layer()(**a)
    assert bool(torch.isnan(a["out"]).all())
    del a["out"]
    with pytest.raises(ValueError, match="^topk_ids values"):
        moe_reference(**a)


def test_minus_one_is_no_expert(seed):
    a = valid_call(CPU, seed)
    a["topk_ids"][0] = -1
    a["topk_ids"][1, 0] = -1
    got = cpu_layer()(**a)
    assert bool((got[0] == 0).all())
    # Row 1 is its other slot alone (same rounding; the GEMM batch differs, so not bit for bit).
    alone = moe_reference(
        a["hidden_states"][1:2],
        a["topk_ids"][1:2, 1:].contiguous(),
        a["topk_weights"][1:2, 1:].contiguous(),
        a["w13"],
        a["w2"],
    )
    assert_within(
        got[1:2], alone, SAME_ROUNDING_REL_FRO, SAME_ROUNDING_ROW_REL, "-1 slot vs the row without it"
    )


def test_duplicate_ids_are_summed_on_the_cpu_backends(seed):
    """An id twice in a row counts twice, each time with its own weight: in fp64 the same as one slot
    carrying the summed weight (up to that fp32 sum's rounding), and FlashMoE's CPU backend equals
    moe_reference."""
    num_experts, k, tokens = 4, 4, 16
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_expert_weights(num_experts, 256, 128, gen)
    x = random_hidden(tokens, 256, gen)
    ids, w = duplicate_routing(tokens, num_experts, k, 2, seed, CPU)  # rows of {0, 0, 1, 1}
    merged_ids = torch.tensor([[0, 1, -1, -1]], dtype=torch.int32).repeat(tokens, 1)
    merged_w = torch.zeros(tokens, k)
    merged_w[:, 0] = torch.where(ids == 0, w, 0).sum(1)
    merged_w[:, 1] = torch.where(ids == 1, w, 0).sum(1)
    oracle = moe_oracle_fp64(x, ids, w, w13, w2)
    assert torch.allclose(oracle, moe_oracle_fp64(x, merged_ids, merged_w, w13, w2), rtol=1e-6, atol=1e-7)
    ref = moe_reference(x, ids, w, w13, w2)
    assert_within(ref, oracle, ORACLE_REL_FRO, ORACLE_ROW_REL, "reference with duplicate ids vs fp64 oracle")
    layer = cpu_layer(MoELayerSpec(num_experts, k, 256, 128, MAX_T))
    assert torch.equal(layer(x, ids, w, w13, w2), ref)


@pytest.mark.timeout(200)
def test_duplicate_ids_are_summed_on_the_distributed_cpu_backend(tmp_path, seed):
    run_ranks(cpu_duplicates_worker, 2, (str(tmp_path), seed), timeout=150)


# ---------------------------------------------------------------------------------------------
# GPU path (megakernel), through the same checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(660)
def test_gpu_refuses_bad_call_before_launch(tmp_path, seed):
    """Every case of BAD_CALLS plus the megakernel's own (device, contiguity) and the 16-vs-8 placement;
    ``out`` stays NaN; a valid call afterwards still matches the reference."""
    if reason := gpu_skip_reason(1):
        pytest.skip(reason)
    run_ranks(gpu_bad_inputs_worker, 1, (str(tmp_path), seed), timeout=600)


@pytest.mark.gpu
@pytest.mark.timeout(660)
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_routing_ids_agree_with_reference(world, tmp_path, seed):
    """Out-of-range and negative ids skipped like -1 (world 1); duplicate ids summed like the reference,
    in a small batch and in one that fills the buffers (max_tokens_per_rank rows)."""
    if reason := gpu_skip_reason(world):
        pytest.skip(reason)
    run_ranks(gpu_routing_ids_worker, world, (str(tmp_path), seed), timeout=600)


@pytest.mark.gpu
@pytest.mark.timeout(660)
def test_gpu_fp8_layer_refuses_bad_call_before_launch(tmp_path, seed):
    """Every case of FP8_BAD_CALLS plus the megakernel's own (scales on the CPU, not contiguous) on a block-fp8
    layer; ``out`` stays NaN; a valid call on fresh random inputs afterwards matches the fp8 reference."""
    if reason := gpu_skip_reason(1):
        pytest.skip(reason)
    run_ranks(gpu_fp8_bad_inputs_worker, 1, (str(tmp_path), seed), timeout=600)


def test_gpu_tests_skip_cleanly_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "CUDA is not available" in gpu_skip_reason(1)
