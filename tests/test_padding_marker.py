"""Padding calls (``FlashMoE(..., padding_marker=m)``, a negative ``m[0]``: an engine's dummy step), on CPU.

The semantics on the reference backend (world 1 here; world 2 and the megakernel, with CUDA graphs: the
``padding`` check of ``megakernel_cases.py``), the argument checks, and where the vLLM adapter takes the
marker from: vLLM's own forward context, whose slot mapping is -1 on dummy steps.
"""

from __future__ import annotations

import pytest
import torch
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec

E, K, H, I, T = 8, 2, 64, 32, 6


@pytest.fixture(scope="module")
def layer_and_inputs():
    gen = torch.Generator().manual_seed(7)
    spec = MoELayerSpec(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, max_tokens_per_rank=16)
    moe = FlashMoE(
        spec, ExpertPlacement.contiguous(E, 1), layer_name="padding.test", device=torch.device("cpu")
    )
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) * 0.05).bfloat16()
    return moe, (x, ids, w, w13, w2)


def test_a_padding_call_returns_zeros_and_a_real_marker_changes_nothing(layer_and_inputs):
    moe, args = layer_and_inputs
    plain = moe(*args)
    assert plain.abs().sum() > 0
    out = torch.full_like(args[0], float("nan"))  # poisoned: every row must be written
    padded = moe(*args, out=out, padding_marker=torch.tensor([-1, -1, -1, -1, -1, -1]))
    assert padded is out and torch.equal(padded, torch.zeros_like(padded))
    # Only the first entry counts (vLLM pads after the real tokens): a real step with padding rows.
    real = moe(*args, padding_marker=torch.tensor([12, 40, -1, -1, -1, -1]))
    assert torch.equal(real, plain)


@pytest.mark.parametrize(
    "marker, message",
    [
        (torch.tensor([-1], dtype=torch.int32), "padding_marker must be a 1-D int64 tensor"),
        (torch.tensor([[-1]]), "padding_marker must be a 1-D int64 tensor"),
        (torch.tensor([], dtype=torch.int64), "padding_marker must be a 1-D int64 tensor"),
        ([-1], "padding_marker"),
    ],
)
def test_bad_markers_are_refused_by_name(layer_and_inputs, marker, message):
    moe, args = layer_and_inputs
    with pytest.raises((TypeError, ValueError), match=message):
        moe(*args, padding_marker=marker)


def test_the_vllm_adapter_reads_the_marker_from_vllms_forward_context():
    pytest.importorskip("vllm")
    from flashmoe.integration.vllm.padding import markers_usable, padding_marker
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    slots = torch.full((3,), -1, dtype=torch.int64)
    assert padding_marker(3) is None  # no forward pass running
    with set_forward_context(
        None, VllmConfig(), num_tokens=3, slot_mapping={"model.layers.0.self_attn.attn": slots}
    ):
        assert padding_marker(3) is slots
        assert padding_marker(2) is None  # rows that do not line up (sequence-parallel chunks): no marker
    with set_forward_context(None, VllmConfig(), num_tokens=3, slot_mapping=[{"a": slots}, {"a": slots}]):
        assert padding_marker(3) is None  # micro-batches
    usable, why = markers_usable()  # no vLLM process groups here: the size of DCP is unknown
    assert not usable and "decode-context-parallel size unknown" in why


def test_skip_padding_off_turns_the_marker_off_for_ab_runs(monkeypatch):
    pytest.importorskip("vllm")
    from flashmoe.integration.vllm.padding import markers_usable

    monkeypatch.setenv("FLASHMOE_SKIP_PADDING", "0")
    usable, why = markers_usable()
    assert not usable and why.startswith("FLASHMOE_SKIP_PADDING=0")
