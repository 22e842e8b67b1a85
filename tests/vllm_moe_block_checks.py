"""Builds a tiny MoE model with shared experts (DeepSeek-V2 or Qwen2-MoE) through vLLM's own code with
``--moe-backend flashmoe`` and records what one MoE block does; tests/test_vllm_deepseek.py runs it as a
subprocess and checks the records against vLLM's own routing function and the checkpoint's weights.

    python tests/vllm_moe_block_checks.py MODEL_DIR OUT_DIR SEED

``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), float32: vLLM's loader, its MoE
block (``DeepseekV2MoE`` or ``Qwen2MoeSparseMoeBlock``: gate, shared experts, the runner that adds the
shared output and applies ``routed_scaling_factor``), the plugin's MoE method in place of vLLM's. The
block runs with the router vLLM built (run ``model``) and, for DeepSeek-V2, under each of
:data:`VARIANTS`: its router replaced by the one vLLM's ``create_fused_moe_router`` makes for those
settings (the layer, weights and flashmoe kernel stay), on the same random hidden states, inside
vLLM's forward context. Writes ``OUT_DIR/block.pt`` and prints one ``RESULT {json}`` line. A
subprocess, because an in-process engine leaves vLLM's distributed state behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NUM_TOKENS = 16
MOE_BLOCKS = ("DeepseekV2MoE", "Qwen2MoeSparseMoeBlock")
# DeepSeek-V2 routing settings that differ from the model's own (grouped softmax top-k, no
# renormalisation, routed_scaling_factor applied by vLLM's runner to the routed output).
VARIANTS = {
    "model": {},  # the router vLLM built from config.json, untouched
    "renormalize": {"renormalize": True},
    # DeepSeek-V3's noaux_tc: sigmoid scores, a per-expert bias that steers selection only.
    "sigmoid_bias": {"scoring_func": "sigmoid", "renormalize": True, "e_score_correction_bias": True},
    "ungrouped": {"num_expert_group": 1, "topk_group": 1},  # DeepSeek-V2-Lite's greedy top-k
    # The scale inside the top-k weights instead of on the output (vLLM's ROCm-AITER arrangement).
    "scale_in_router": {"scale_in_router": True},
}


def check_block(model_dir: str, out_dir: str, seed: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from flashmoe.integration.vllm.kernel import FlashMoEExperts
    from flashmoe.integration.vllm.moe_method import FlashMoEUnquantizedMethod
    from vllm import LLM
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, moe_backend="flashmoe")
    vllm_config = llm.llm_engine.vllm_config
    cfg = vllm_config.model_config.hf_config

    def inspect_and_run(model):
        layers = []
        for i, layer in enumerate(model.model.layers):
            rec = {"index": i, "mlp": type(layer.mlp).__name__}
            routed = [m for m in layer.mlp.modules() if isinstance(m, RoutedExperts)]
            if routed:
                method = routed[0].quant_method
                rec.update(
                    is_flashmoe=isinstance(method, FlashMoEUnquantizedMethod),
                    fallback_reason=getattr(method, "fallback_reason", "n/a"),
                    backend=method.flashmoe.backend if getattr(method, "flashmoe", None) else None,
                    experts_is_flashmoe=isinstance(method.moe_kernel.fused_experts, FlashMoEExperts),
                )
            layers.append(rec)
        index = next(r["index"] for r in layers if r["mlp"] in MOE_BLOCKS)
        block = model.model.layers[index].mlp
        runner = block.experts
        built_router, built_scale = runner.router, runner.routed_scaling_factor
        built = {
            "block": type(block).__name__,
            "router": type(built_router).__name__,
            "use_grouped_topk": built_router.use_grouped_topk,
            "renormalize": built_router.renormalize,
            "num_expert_group": built_router.num_expert_group,
            "topk_group": built_router.topk_group,
            "scoring_func": built_router.scoring_func,
            "router_scale": built_router.routed_scaling_factor,
            "runner_scale": built_scale,
            "has_shared_experts": runner.shared_experts is not None,
        }
        op = runner.routed_experts.quant_method.flashmoe
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(NUM_TOKENS, cfg.hidden_size, generator=gen)
        tensors = {"x": x, "layer_index": torch.tensor(index)}
        runs = {}
        for name, v in (VARIANTS if built["block"] == "DeepseekV2MoE" else {"model": {}}).items():
            settings = {
                k: built[k] for k in ("renormalize", "num_expert_group", "topk_group", "scoring_func")
            }
            settings.update({k: v[k] for k in settings if k in v})
            total_scale = built["router_scale"] * built["runner_scale"]
            scale_in_router = v.get("scale_in_router", built["runner_scale"] == 1.0)
            settings["router_scale"] = total_scale if scale_in_router else 1.0
            settings["runner_scale"] = 1.0 if scale_in_router else total_scale
            bias = None
            if v.get("e_score_correction_bias"):
                # Sigmoid scores lie in (0, 1): a bias of this size reorders the selection.
                bias = torch.randn(built_router.global_num_experts, generator=gen) * 0.1
                tensors[f"{name}.bias"] = bias
            if name != "model":
                runner.router = create_fused_moe_router(
                    top_k=built_router.top_k,
                    global_num_experts=built_router.global_num_experts,
                    renormalize=settings["renormalize"],
                    use_grouped_topk=True,
                    num_expert_group=settings["num_expert_group"],
                    topk_group=settings["topk_group"],
                    scoring_func=settings["scoring_func"],
                    routed_scaling_factor=settings["router_scale"],
                    e_score_correction_bias=bias,
                )
                runner.routed_scaling_factor = settings["runner_scale"]
            try:
                y, (args, op_out), router_logits, counts = run_recorded(
                    block, op, runner.router, x, vllm_config
                )
            finally:
                runner.router, runner.routed_scaling_factor = built_router, built_scale
            tensors.update(
                {
                    f"{name}.router_logits": router_logits,
                    f"{name}.op_hidden_states": args[0],
                    f"{name}.op_topk_ids": args[1],
                    f"{name}.op_topk_weights": args[2],
                    f"{name}.op_out": op_out,
                    f"{name}.block_out": y,
                }
            )
            runs[name] = {**settings, **counts}
        return layers, built, runs, tensors

    layers, built, runs, tensors = llm.apply_model(inspect_and_run)[0]
    torch.save(tensors, Path(out_dir) / "block.pt")
    return {
        "moe_backend": vllm_config.kernel_config.moe_backend,
        "layers": layers,
        "built": built,
        "runs": runs,
    }


def run_recorded(block, op, router, x, vllm_config):
    """``block(x)`` inside vLLM's forward context, recording the flashmoe op's first call (its
    arguments and output) and the router logits vLLM's router got: (y, (args, op_out), logits, counts)."""
    import torch
    from vllm.forward_context import set_forward_context

    calls, logits = [], []
    forward, select = op.forward, router.select_experts

    def recording_forward(*args, **kwargs):
        y = forward(*args, **kwargs)
        calls.append((args, y.clone()))
        return y

    def recording_select(hidden_states, router_logits, **kwargs):
        logits.append(router_logits.clone())
        return select(hidden_states=hidden_states, router_logits=router_logits, **kwargs)

    op.forward, router.select_experts = recording_forward, recording_select
    try:
        with set_forward_context(None, vllm_config), torch.no_grad():
            y = block(x)
    finally:
        del op.forward, router.select_experts
    return y, calls[0], logits[0], {"op_calls": len(calls), "router_calls": len(logits)}


def main(argv: list[str]) -> int:
    print("RESULT " + json.dumps(check_block(argv[0], argv[1], int(argv[2]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
