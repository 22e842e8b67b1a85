"""FlashMoE with block-fp8 experts (issue 15) on its CPU backend: the spec field, the call contract
(scales required exactly for fp8 layers, named in the error; the bad fp8 calls, shared with the
megakernel's GPU test, are ``validation_cases.FP8_BAD_CALLS`` in ``test_validation.py``) and the
result, which is :func:`flashmoe.moe_reference_fp8`'s bit for bit, on one rank and over a gloo EP group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, moe_reference_fp8
from moe_inputs import (
    local_weights,
    make_placement,
    random_fp8_expert_weights,
    random_grouped_hidden,
    random_routing,
)
from multiproc import init_cpu_rank, run_ranks
from test_reference_fp8 import ep_case

E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")
E, K, H, INTER, MAX_T = 8, 2, 256, 128, 32


@pytest.fixture(autouse=True)
def no_backend_override(monkeypatch):
    for name in ("FLASHMOE_BACKEND", "FLASHMOE_STRICT", "FLASHMOE_MAX_TOKENS"):
        monkeypatch.delenv(name, raising=False)


def fp8_spec(**kw) -> MoELayerSpec:
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, max_tokens_per_rank=MAX_T)
    args.update(kw)
    return MoELayerSpec(weight_dtype=E4M3, **args)


def fp8_call(gen, T=12):
    x = random_grouped_hidden(T, H, gen)
    ids, w = random_routing(T, E, K, "zipf", gen, drop_prob=0.1)
    w13, s13, w2, s2 = random_fp8_expert_weights(E, H, INTER, gen)
    return x, ids, w, w13, s13, w2, s2


# ---------------------------------------------------------------------------------------------
# MoELayerSpec.weight_dtype
# ---------------------------------------------------------------------------------------------


def test_spec_weight_dtype_values():
    assert fp8_spec().fp8_weights
    assert MoELayerSpec(E, K, H, INTER, MAX_T).weight_dtype is None
    same = MoELayerSpec(E, K, H, INTER, MAX_T, weight_dtype=torch.bfloat16)  # = dtype: unquantized
    assert same.weight_dtype is None and not same.fp8_weights and same == MoELayerSpec(E, K, H, INTER, MAX_T)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"weight_dtype": torch.float8_e5m2}, ValueError, "weight_dtype torch.float8_e5m2 not supported"),
        ({"weight_dtype": torch.int8}, ValueError, "weight_dtype torch.int8 not supported"),
        ({"weight_dtype": torch.float16}, ValueError, "weight_dtype torch.float16 not supported"),
        ({"weight_dtype": "fp8"}, TypeError, "weight_dtype must be a torch.dtype or None"),
        ({"weight_dtype": E4M3, "dtype": torch.float32}, ValueError, "needs dtype torch.bfloat16"),
        ({"weight_dtype": E4M3, "intermediate_size": 64}, ValueError, "multiples of 128.*got 256 and 64"),
        ({"weight_dtype": E4M3, "hidden_size": 192}, ValueError, "multiples of 128.*got 192 and 128"),
    ],
)
def test_spec_refuses_other_weight_dtypes(kw, error, match):
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, max_tokens_per_rank=MAX_T)
    args.update(kw)
    with pytest.raises(error, match=match):
        MoELayerSpec(**args)


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def test_fp8_layer_equals_reference_bit_for_bit(gen):
    x, ids, w, w13, s13, w2, s2 = fp8_call(gen)
    layer = FlashMoE(fp8_spec(), ExpertPlacement.contiguous(E, 1), device=CPU)
    assert layer.backend == "reference" and "weights=block-fp8" in repr(layer)
    expected = moe_reference_fp8(x, ids, w, w13, s13, w2, s2)
    assert float(expected.float().norm()) > 0
    got = layer(x, ids, w, w13, w2, w13_scale_inv=s13, w2_scale_inv=s2)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    out = torch.full_like(x, float("nan"))
    assert layer.forward(x, ids, w, w13, w2, out, w13_scale_inv=s13, w2_scale_inv=s2) is out
    assert torch.equal(out, expected)
    # The scales are really used: one block's scale doubled changes that expert's tokens.
    s13_other = s13.clone()
    s13_other[int(ids[ids >= 0][0])] *= 2  # a routed expert: ids[0, 0] may be a dropped slot (-1)
    assert not torch.equal(layer(x, ids, w, w13, w2, w13_scale_inv=s13_other, w2_scale_inv=s2), expected)


def test_bf16_layer_refuses_scales(gen):
    x, ids, w, w13, s13, w2, s2 = fp8_call(gen, T=4)
    layer = FlashMoE(MoELayerSpec(E, K, H, INTER, MAX_T), ExpertPlacement.contiguous(E, 1), device=CPU)
    with pytest.raises(ValueError, match=r"^w2_scale_inv given, but this layer's weights are torch.bfloat16"):
        layer(x, ids, w, w13.bfloat16(), w2.bfloat16(), w2_scale_inv=s2)
    with pytest.raises(ValueError, match=r"^w13_scale_inv and w2_scale_inv given"):
        layer(x, ids, w, w13, w2, w13_scale_inv=s13, w2_scale_inv=s2)


# ---------------------------------------------------------------------------------------------
# Expert parallel over gloo
# ---------------------------------------------------------------------------------------------

WORLD = 2


def _ep_worker(rank: int, world: int, port: int, case_path: str, out_dir: str) -> None:
    init_cpu_rank(rank, world, port)
    try:
        c = torch.load(case_path)
        placement = ExpertPlacement(c["expert_rank"], c["expert_local"], world)
        rows = slice(c["offsets"][rank], c["offsets"][rank + 1])
        w13, w2 = local_weights(c["w13"], c["w2"], placement, rank)
        s13, s2 = local_weights(c["s13"], c["s2"], placement, rank)
        layer = FlashMoE(fp8_spec(), placement, None, device=CPU, layer_name="fp8-ep")
        out = layer(c["x"][rows], c["ids"][rows], c["w"][rows], w13, w2, w13_scale_inv=s13, w2_scale_inv=s2)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
def test_fp8_layer_over_ep_group_equals_single_rank(gen, tmp_path):
    tokens = (11, 0)  # rank 1 brings no tokens but still serves its experts
    x, ids, w, w13, s13, w2, s2 = fp8_call(gen, T=sum(tokens))
    placement = make_placement("random_permutation", E, WORLD, gen)
    torch.save(ep_case(x, ids, w, (w13, s13, w2, s2), placement, tokens), tmp_path / "case.pt")
    run_ranks(_ep_worker, WORLD, (str(tmp_path / "case.pt"), str(tmp_path)), timeout=150)
    expected = moe_reference_fp8(x, ids, w, w13, s13, w2, s2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert got[1].shape == (0, H)
    assert torch.equal(got[0], expected[: tokens[0]])
