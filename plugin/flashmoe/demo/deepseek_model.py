"""DeepSeek-V2-architecture checkpoints made locally (no hub access), tiny or DeepSeek-V2-Lite-shaped.

A tiny one for CPU tests and one with DeepSeek-V2-Lite's real shapes for GPU serving runs:

    python -m flashmoe.demo.deepseek_model /tmp/tiny-deepseek-v2
    python -m flashmoe.demo.deepseek_model /tmp/deepseek-v2-lite-random --v2-lite [--num-layers 27]

Both are ``DeepseekV2ForCausalLM`` checkpoints in the original per-expert layout
(``mlp.experts.{e}.gate_proj.weight``, ``mlp.shared_experts.*``, MLA's ``kv_a_proj_with_mqa`` /
``kv_b_proj``), written tensor by tensor from :class:`~flashmoe.demo.tiny_model.SeededWeights`:
N(0, ``initializer_range``) linear weights, norms 1, each tensor's values a function of the seed and
its name only.

The tiny model (:data:`DEEPSEEK_V2_TINY`) keeps everything the DeepSeek family adds around the routed
experts: MLA with a query LoRA (``q_lora_rank``), 2 shared experts, grouped top-k routing
(``group_limited_greedy``: 16 experts in 4 groups, the best 2 groups, top-3 inside them),
``routed_scaling_factor`` 2.5 with ``norm_topk_prob`` off (DeepSeek-V2's own combination), and one
dense layer first (``first_k_dense_replace``). MLA's latent sizes are DeepSeek's (``kv_lora_rank``
512, ``qk_rope_head_dim`` 64): vLLM's CPU MLA decode kernel is compiled for a 576-wide latent only.
The rest is small: hidden 128, 3 layers, expert intermediate 64 (multiples of 32, for vLLM's own CPU
MoE kernel), 3.9 MB of bf16 safetensors. Weights are N(0, 0.08): on random inputs the routed and
the shared experts' parts are each 0.4 to 0.9 of a MoE block's output, and applying
``routed_scaling_factor`` twice or not at all changes the greedy tokens. The tokenizer is the tiny
Qwen3-MoE's (:func:`~flashmoe.demo.tiny_model.make_tokenizer`).

:func:`make_deepseek_v2_lite_shaped` writes DeepSeek-V2-Lite's real config (27 layers, 64 routed
experts top-6 plus 2 shared, MLA without query LoRA, YaRN RoPE; 31.4 GB of bf16 at 27 layers) with
N(0, 0.02) weights; ``benchmarks/vllm_serve_gpu.py --model deepseek-v2-lite`` serves it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .tiny_model import VOCAB_SIZE, SeededWeights, make_tokenizer, write_sharded_checkpoint, writer_cli

ARCHITECTURE = "DeepseekV2ForCausalLM"

# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the keys vLLM and transformers read.
DEEPSEEK_V2_LITE = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    aux_loss_alpha=0.001,
    seq_aux=True,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=100000,
    eos_token_id=100001,
)

DEEPSEEK_V2_TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,  # the dense layer's MLP
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=512,  # 512 + 64: the only latent width vLLM's CPU MLA decode kernel is built for
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_routed_experts=16,
    n_shared_experts=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rope_theta=10000,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)


def is_moe_layer(c: dict, i: int) -> bool:
    """vLLM's and DeepSeek's rule: dense before ``first_k_dense_replace``, then every
    ``moe_layer_freq``-th layer sparse."""
    return (
        c["n_routed_experts"] is not None and i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
    )


def _mlp(w: SeededWeights, prefix: str, hidden: int, inter: int) -> dict:
    return {
        prefix + "gate_proj.weight": w.normal(prefix + "gate_proj", inter, hidden),
        prefix + "up_proj.weight": w.normal(prefix + "up_proj", inter, hidden),
        prefix + "down_proj.weight": w.normal(prefix + "down_proj", hidden, inter),
    }


def _layer(c: dict, w: SeededWeights, i: int) -> dict:
    H, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    p = f"model.layers.{i}."
    a = p + "self_attn."
    t = {p + "input_layernorm.weight": w.ones(H), p + "post_attention_layernorm.weight": w.ones(H)}
    if c["q_lora_rank"] is None:
        t[a + "q_proj.weight"] = w.normal(a + "q_proj", heads * qk_head, H)
    else:
        t[a + "q_a_proj.weight"] = w.normal(a + "q_a_proj", c["q_lora_rank"], H)
        t[a + "q_a_layernorm.weight"] = w.ones(c["q_lora_rank"])
        t[a + "q_b_proj.weight"] = w.normal(a + "q_b_proj", heads * qk_head, c["q_lora_rank"])
    kv = c["kv_lora_rank"]
    t[a + "kv_a_proj_with_mqa.weight"] = w.normal(a + "kv_a_proj_with_mqa", kv + c["qk_rope_head_dim"], H)
    t[a + "kv_a_layernorm.weight"] = w.ones(kv)
    t[a + "kv_b_proj.weight"] = w.normal(
        a + "kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv
    )
    t[a + "o_proj.weight"] = w.normal(a + "o_proj", H, heads * c["v_head_dim"])
    if not is_moe_layer(c, i):
        t.update(_mlp(w, p + "mlp.", H, c["intermediate_size"]))
        return t
    I = c["moe_intermediate_size"]
    t[p + "mlp.gate.weight"] = w.normal(p + "mlp.gate.weight", c["n_routed_experts"], H)
    for e in range(c["n_routed_experts"]):
        t.update(_mlp(w, f"{p}mlp.experts.{e}.", H, I))
    if c["n_shared_experts"]:
        t.update(_mlp(w, p + "mlp.shared_experts.", H, I * c["n_shared_experts"]))
    return t


def _head(c: dict, w: SeededWeights) -> dict:
    V, H = c["vocab_size"], c["hidden_size"]
    return {
        "model.embed_tokens.weight": w.normal("model.embed_tokens.weight", V, H),
        "model.norm.weight": w.ones(H),
        "lm_head.weight": w.normal("lm_head.weight", V, H),
    }


def write_deepseek_v2(path: str | Path, c: dict, seed: int, device: str, shapes: str) -> Path:
    """A DeepSeek-V2-architecture checkpoint of config ``c`` in ``path``, one shard per layer plus one
    for the embeddings and LM head (idempotent: a directory with the same marker is left as is)."""
    w = SeededWeights(seed, c["initializer_range"], device)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v2",
        **c,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    marker = {
        "seed": seed,
        "architecture": ARCHITECTURE,
        "num_layers": c["num_hidden_layers"],
        "shapes": shapes,
    }
    shards = [functools.partial(_layer, c, w, i) for i in range(c["num_hidden_layers"])]
    shards.append(functools.partial(_head, c, w))
    return write_sharded_checkpoint(Path(path), shards, config, marker)


def make_tiny_deepseek_v2(path: str | Path, seed: int = 0, **overrides) -> Path:
    """The tiny DeepSeek-V2 (module docstring) with the tiny Qwen3-MoE's tokenizer; ``overrides``
    replace :data:`DEEPSEEK_V2_TINY` entries (``norm_topk_prob=True``, ...). Idempotent."""
    unknown = set(overrides) - set(DEEPSEEK_V2_TINY)
    if unknown:
        raise ValueError(f"not DeepSeek-V2 config keys of the tiny model: {sorted(unknown)}")
    c = {**DEEPSEEK_V2_TINY, **overrides}
    tag = "deepseek-v2-tiny" + "".join(f",{k}={v}" for k, v in sorted(overrides.items()))
    path = write_deepseek_v2(path, c, seed, "cpu", tag)
    if not (path / "tokenizer.json").is_file():
        make_tokenizer().save_pretrained(path)
    return path


def make_deepseek_v2_lite_shaped(
    path: str | Path, num_layers: int = 27, seed: int = 0, device: str = "cuda"
) -> Path:
    """A random-weight bf16 checkpoint with DeepSeek-V2-Lite's config and shapes (module docstring);
    ``num_layers`` below 27 shortens load time (layer 0 stays the dense one). No tokenizer: serve it
    with token-id prompts or add one (``benchmarks/vllm_serve_gpu.py`` writes a word-level one)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    c = {**DEEPSEEK_V2_LITE, "num_hidden_layers": num_layers}
    return write_deepseek_v2(path, c, seed, device, "deepseek-v2-lite")


def main() -> None:
    writer_cli(
        "flashmoe.demo.deepseek_model",
        __doc__,
        "v2-lite",
        27,
        make_deepseek_v2_lite_shaped,
        make_tiny_deepseek_v2,
    )


if __name__ == "__main__":
    main()
