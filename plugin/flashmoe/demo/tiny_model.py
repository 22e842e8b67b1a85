"""A tiny Qwen3-MoE checkpoint and tokenizer made locally (no hub access), for tests and the demo.

    python -m flashmoe.demo.tiny_model /tmp/tiny-qwen3-moe

Same architecture as Qwen3-30B-A3B (``Qwen3MoeForCausalLM``: every layer sparse, top-k routing
without renormalisation, SwiGLU experts), shrunk to 2 layers of 8 experts, top-2, hidden 128,
expert intermediate 64: about 1.3 MB of bf16 safetensors. The sizes are multiples of 32 so vLLM's
own CPU MoE kernel can run it too. Weights are random but seeded, so a directory made twice with
the same seed is byte-for-byte the same model.

The tokenizer is a word-level ``tokenizers`` model over synthetic two-syllable words, split on
whitespace; :func:`prompt_words` gives prompts it encodes without unknown tokens.

:func:`make_tiny_qwen3_moe_fp8` writes the block-fp8 variant (issue 15): expert intermediate 128 (one
fp8 block), experts stored as DeepSeek-V3 / Qwen3-*-FP8 checkpoints store them (e4m3 weights, one
fp32 ``weight_scale_inv`` per 128x128 block, ``quantization_config`` with ``weight_block_size``
[128, 128]); attention, router and LM head stay bf16 (``modules_to_not_convert``).

Needs ``transformers`` and ``tokenizers`` (both come with vLLM and SGLang).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3: unk, bos, eos, pad
VOCAB_SIZE = 512
NUM_EXPERTS = 8
TOP_K = 2
HIDDEN_SIZE = 128
MOE_INTERMEDIATE_SIZE = 64
# Random init at HF's default scale (0.02) gives nearly flat logits and a model that repeats one
# token whatever the prompt; a larger scale makes greedy outputs depend on the prompt and on the
# experts, which is what the tests need to tell a wrong MoE from a right one.
INITIALIZER_RANGE = 0.08

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def vocabulary() -> list[str]:
    """The 508 words after the special tokens: 'baba', 'babe', ... (deterministic)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = (a + b for a, b in itertools.product(syllables, repeat=2))
    return list(SPECIAL_TOKENS) + list(itertools.islice(words, VOCAB_SIZE - len(SPECIAL_TOKENS)))


def prompt_words(n: int, seed: int) -> str:
    """``n`` in-vocabulary words, chosen by ``seed`` (a prompt the tokenizer maps 1:1 to ids)."""
    import random

    words = vocabulary()[len(SPECIAL_TOKENS) :]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n))


def qwen3_moe_config(dtype: str = "bfloat16", moe_intermediate_size: int = MOE_INTERMEDIATE_SIZE):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,  # dense MLP size; unused (every layer is sparse)
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
        max_position_embeddings=512,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


# The Qwen3-30B-A3B architecture (its config.json), for GPU serving runs without hub access:
# random weights, the real shapes; ``num_hidden_layers`` can be lowered to shorten load time.
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)


class SeededWeights:
    """Random bf16 checkpoint tensors for the real-shaped GPU models: N(0, ``std``), each drawn from a
    generator seeded by ``seed`` and the name it is asked for, so a tensor's values do not depend on
    which other tensors exist or the order they are made in (every parallel layout loads the same
    model), and norms are ones. ``keep``: leave the drawn tensors on ``device`` (for a caller that
    quantises them there) instead of returning them on the CPU."""

    def __init__(self, seed: int, std: float, device: str, keep: bool = False):
        self.seed, self.std, self.device, self.keep = seed, std, device, keep

    def normal(self, name: str, *shape: int):
        import zlib

        import torch

        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = (torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32) * self.std).to(
            torch.bfloat16
        )
        return t if self.keep else t.cpu()

    @staticmethod
    def ones(n: int):
        import torch

        return torch.ones(n, dtype=torch.bfloat16)


def write_sharded_checkpoint(path: Path, shards: list, config: dict, marker: dict) -> Path:
    """Write ``shards`` (callables returning one shard's ``{name: tensor}``, made one at a time so a
    large model never sits in memory whole) as safetensors with their index, then ``config.json``,
    then ``flashmoe_random_model.json`` = ``marker``: a directory whose marker matches is complete and
    is returned as is."""
    from safetensors.torch import save_file

    marker_file = path / "flashmoe_random_model.json"
    if marker_file.exists() and json.loads(marker_file.read_text()) == marker:
        return path
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for i, make in enumerate(shards):
        fname = names[i]
        tensors = {name: t.cpu() for name, t in make().items()}  # a shard may be made on the GPU
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    total = sum((path / f).stat().st_size for f in names)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    marker_file.write_text(json.dumps(marker))
    return path


def _block_fp8_tensors(tensors: dict, is_fp8_linear) -> dict:
    """``tensors`` with every ``*.weight`` that ``is_fp8_linear(name)`` accepts stored as checkpoints store block-fp8
    linears: e4m3 values plus ``*.weight_scale_inv`` (fp32, one per 128x128 block); the rest as given. Each is
    quantised on the device it is on; the writer moves them to the CPU."""
    from flashmoe.fp8 import quantize_weight_blocks

    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and is_fp8_linear(name):
            q, scale_inv = quantize_weight_blocks(t, FP8_BLOCK[0])
            out[name] = q
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv
        else:
            out[name] = t
    return out


def _block_fp8_quantization_config(kept_bf16: list[str]) -> dict:
    """The ``quantization_config`` of a block-fp8 checkpoint (DeepSeek-V3, Qwen3-*-FP8), ``kept_bf16`` modules
    listed as not converted."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
        "modules_to_not_convert": kept_bf16,
    }


def make_qwen3_30b_a3b_fp8_shaped(
    path: str | Path, num_layers: int = 48, seed: int = 0, device: str = "cuda"
) -> Path:
    """:func:`make_qwen3_30b_a3b_shaped`'s model (the same seeded bf16 values) stored as Qwen3-30B-A3B-FP8
    stores its linears: e4m3 weights with one fp32 ``weight_scale_inv`` per 128x128 block for the attention
    projections and every expert, ``quantization_config`` {fp8, e4m3, dynamic activations, block [128, 128]}
    (~31 GB at 48 layers). The router gates and the LM head stay bf16 and are listed in
    ``modules_to_not_convert`` (the gates feed the routing both engines' paths share; keeping them exact keeps
    the comparison about the experts); embeddings and norms are bf16 as in the real checkpoint."""
    return _qwen3_30b_a3b_checkpoint(path, num_layers, seed, device, fp8=True)


def make_qwen3_30b_a3b_shaped(
    path: str | Path, num_layers: int = 48, seed: int = 0, device: str = "cuda"
) -> Path:
    """A random-weight bf16 checkpoint with Qwen3-30B-A3B's shapes (~61 GB at 48 layers), written as
    the original per-expert safetensors layout (``mlp.experts.{e}.gate_proj.weight``, ...) one shard
    per layer, plus ``config.json``; serve it with ``--skip-tokenizer-init`` and token-id prompts.

    Linear weights are N(0, ``initializer_range``), norms 1 (:class:`SeededWeights`): unlike vLLM's
    ``--load-format dummy`` (uniform +-1e-3 everywhere, which leaves the MoE output below bf16
    resolution of the residual stream) every layer moves the logits, so comparing greedy tokens across
    MoE backends means something. Idempotent, like :func:`make_tiny_qwen3_moe`."""
    return _qwen3_30b_a3b_checkpoint(path, num_layers, seed, device, fp8=False)


# Linears a block-fp8 Qwen3-MoE checkpoint stores in e4m3 (the router gate, embeddings, norms and LM head stay bf16).
_FP8_LINEARS = (
    "self_attn.q_proj.",
    "self_attn.k_proj.",
    "self_attn.v_proj.",
    "self_attn.o_proj.",
    "mlp.experts.",
)


def _qwen3_30b_a3b_checkpoint(path: str | Path, num_layers: int, seed: int, device: str, fp8: bool) -> Path:
    c = {**QWEN3_30B_A3B, "num_hidden_layers": num_layers}
    H, I, V, E = c["hidden_size"], c["moe_intermediate_size"], c["vocab_size"], c["num_experts"]
    q_out, kv_out = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    # fp8: the layers' tensors stay where they are drawn until quantised there (no round trip through the CPU).
    w = SeededWeights(seed, c["initializer_range"], device, keep=fp8)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": w.ones(H),
            p + "post_attention_layernorm.weight": w.ones(H),
            p + "self_attn.q_norm.weight": w.ones(c["head_dim"]),
            p + "self_attn.k_norm.weight": w.ones(c["head_dim"]),
            p + "mlp.gate.weight": w.normal(p + "mlp.gate.weight", E, H),
        }
        for proj, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            tensors[p + f"self_attn.{proj}.weight"] = w.normal(p + proj, rows, H)
        tensors[p + "self_attn.o_proj.weight"] = w.normal(p + "o_proj", H, q_out)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors[q + "gate_proj.weight"] = w.normal(q + "gate_proj", I, H)
            tensors[q + "up_proj.weight"] = w.normal(q + "up_proj", I, H)
            tensors[q + "down_proj.weight"] = w.normal(q + "down_proj", H, I)
        if not fp8:
            return tensors
        return _block_fp8_tensors(tensors, lambda name: any(m in name for m in _FP8_LINEARS))

    def head() -> dict:  # the last shard: embeddings, final norm, LM head
        return {
            "model.embed_tokens.weight": w.normal("model.embed_tokens.weight", V, H),
            "model.norm.weight": w.ones(H),
            "lm_head.weight": w.normal("lm_head.weight", V, H),
        }

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **c,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": num_layers,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    marker = {
        "seed": seed,
        "architecture": "Qwen3MoeForCausalLM",
        "num_layers": num_layers,
        "shapes": "qwen3-30b-a3b",
    }
    if fp8:
        config["quantization_config"] = _block_fp8_quantization_config(
            [f"model.layers.{i}.mlp.gate" for i in range(num_layers)] + ["lm_head"]
        )
        marker["linears"] = "fp8_block_128"
    shards = [functools.partial(layer, i) for i in range(num_layers)] + [head]
    return write_sharded_checkpoint(Path(path), shards, config, marker)


def make_tiny_qwen3_moe(path: str | Path, seed: int = 0) -> Path:
    """Write config, bf16 safetensors weights and tokenizer to ``path`` (created); return it.

    Idempotent: a directory already holding a model made by this function is left as is.
    """
    import torch
    from transformers import Qwen3MoeForCausalLM

    path = Path(path)
    marker = path / "flashmoe_tiny_model.json"
    if marker.exists() and json.loads(marker.read_text()).get("seed") == seed:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(qwen3_moe_config()).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    marker.write_text(json.dumps({"seed": seed, "architecture": "Qwen3MoeForCausalLM"}))
    return path


FP8_MOE_INTERMEDIATE_SIZE = 128  # one 128x128 block: block-fp8 experts need whole blocks
FP8_BLOCK = [128, 128]


def make_tiny_qwen3_moe_fp8(path: str | Path, seed: int = 0) -> Path:
    """The tiny Qwen3-MoE with block-fp8 experts (module docstring): config, safetensors and
    tokenizer in ``path``; idempotent like :func:`make_tiny_qwen3_moe`.

    Only the experts are fp8: vLLM's CPU platform has no block-fp8 linear kernel without AMX
    (``CPUFp8BlockScaledMMKernel requires AMX tile support``), so attention, the router gates and
    the LM head are listed in ``modules_to_not_convert`` and stay bf16, as some real fp8
    checkpoints keep theirs."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    path = Path(path)
    marker = path / "flashmoe_tiny_model.json"
    want = {"seed": seed, "architecture": "Qwen3MoeForCausalLM", "experts": "fp8_block_128"}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = qwen3_moe_config(moe_intermediate_size=FP8_MOE_INTERMEDIATE_SIZE)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)

    weights_file = path / "model.safetensors"
    tensors = _block_fp8_tensors(
        load_file(weights_file), lambda name: ".mlp.experts." in name
    )  # gate/up/down
    save_file(tensors, str(weights_file), metadata={"format": "pt"})

    config = json.loads((path / "config.json").read_text())
    kept_bf16 = [
        f"model.layers.{i}.{m}"
        for i in range(cfg.num_hidden_layers)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate")
    ] + ["lm_head"]
    config["quantization_config"] = _block_fp8_quantization_config(kept_bf16)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps(want))
    return path


def fp8_prompt_logprobs(path: str | Path, prompts: list[list[int]]) -> list[list[float]]:
    """For each token-id prompt, the log-probability of every token after the first given the ones
    before it, from transformers' Qwen3MoeForCausalLM (bf16) on the checkpoint of
    :func:`make_tiny_qwen3_moe_fp8`, its experts computed by :func:`flashmoe.moe_reference_fp8` on the
    checkpoint's e4m3 weights and scales: the fp8 ground truth outside any serving engine."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from flashmoe import moe_reference_fp8

    class ReferenceFp8Experts(torch.nn.Module):
        def __init__(self, w13, w13_scale_inv, w2, w2_scale_inv):
            super().__init__()
            self.weights = (w13, w13_scale_inv, w2, w2_scale_inv)

        def forward(self, hidden_states, top_k_index, top_k_weights):  # transformers' experts call
            ids, weights = top_k_index.to(torch.int32), top_k_weights.float()
            return moe_reference_fp8(hidden_states, ids, weights, *self.weights).to(hidden_states.dtype)

    path = Path(path)
    cfg = qwen3_moe_config(moe_intermediate_size=FP8_MOE_INTERMEDIATE_SIZE)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    tensors = load_file(path / "model.safetensors")
    dense = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    if unexpected or any(".mlp.experts." not in k for k in missing):
        raise ValueError(f"{path} is not a tiny fp8 Qwen3-MoE: missing {missing}, unexpected {unexpected}")
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.mlp.experts."

        def stack(*names, p=p):
            return torch.stack(
                [torch.cat([tensors[f"{p}{e}.{n}"] for n in names]) for e in range(NUM_EXPERTS)]
            )

        layer.mlp.experts = ReferenceFp8Experts(
            stack("gate_proj.weight", "up_proj.weight"),  # w13: gate rows, then up rows
            stack("gate_proj.weight_scale_inv", "up_proj.weight_scale_inv"),
            stack("down_proj.weight"),
            stack("down_proj.weight_scale_inv"),
        )
    out = []
    with torch.no_grad():
        for ids in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            out.append([float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))])
    return out


def greedy_reference(path: str | Path, prompts: list[str], max_tokens: int, dtype=None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` computed by transformers' Qwen3MoeForCausalLM, outside
    any serving engine: the ground truth the engines' token ids are compared with."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    dtype = dtype or torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p)["input_ids"]
            start = len(ids)
            for _ in range(max_tokens):  # plain argmax loop: no EOS handling, like ignore_eos=True
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            out.append(ids[start:])
    return out


def writer_cli(module: str, doc: str, shaped: str, num_layers: int, make_shaped, make_tiny) -> None:
    """``python -m <module> PATH [--<shaped> [--num-layers N] [--device D]] [--seed S]``: write the tiny
    model, or with ``--<shaped>`` the real-shaped one, and print its directory."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    ap.add_argument("path", help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(f"--{shaped}", action="store_true", help=f"{shaped} shapes instead of the tiny model")
    ap.add_argument("--num-layers", type=int, default=num_layers, help=f"layers of the --{shaped} checkpoint")
    ap.add_argument("--device", default="cuda", help=f"where --{shaped} weights are initialised")
    args = ap.parse_args()
    if getattr(args, shaped.replace("-", "_")):
        print(make_shaped(args.path, args.num_layers, args.seed, args.device))
    else:
        print(make_tiny(args.path, args.seed))


def main() -> None:
    writer_cli(
        "flashmoe.demo.tiny_model",
        __doc__,
        "qwen3-30b-a3b",
        48,
        make_qwen3_30b_a3b_shaped,
        make_tiny_qwen3_moe,
    )


if __name__ == "__main__":
    main()
