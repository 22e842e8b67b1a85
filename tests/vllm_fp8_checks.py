"""Builds a block-fp8 Qwen3-MoE through vLLM's own code and records what its MoE layers do;
tests/test_vllm_fp8.py runs it as a subprocess and checks the records.

    python tests/vllm_fp8_checks.py layer MODEL_DIR OUT_DIR

``vllm.LLM`` with ``moe_backend="flashmoe"`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
engine core and worker in-process, so ``apply_model`` hands the loaded model to a local function):
the plugin is loaded by vLLM's plugin loader, the config resolved by vLLM (and the plugin's engine
hook), the layers built by vLLM's model code and ``Fp8Config`` registry, the checkpoint read by
vLLM's loader. Then one MoE block runs a forward on random hidden states inside vLLM's forward
context. Writes ``OUT_DIR/layer.pt`` (tensors) and prints one ``RESULT {json}`` line. A subprocess,
because an in-process engine leaves vLLM's distributed state behind in the test process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def check_layer(model_dir: str, out_dir: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from flashmoe.integration.vllm.fp8_method import FlashMoEFp8Config, FlashMoEFp8Method
    from flashmoe.integration.vllm.kernel import FlashMoEExperts, FlashMoEPrepareFinalize
    from vllm import LLM
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization import get_quantization_config

    llm = LLM(
        model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=128, moe_backend="flashmoe"
    )
    vllm_config = llm.llm_engine.vllm_config
    out: dict = {
        "moe_backend": vllm_config.kernel_config.moe_backend,
        "quantization": vllm_config.model_config.quantization,
        "fp8_config_registered": get_quantization_config("fp8") is FlashMoEFp8Config,
    }

    def inspect_and_run(model):
        layers = []
        for name, m in model.named_modules():
            if isinstance(m, RoutedExperts):
                method = m.quant_method
                kernel = method.moe_kernel
                layers.append(
                    {
                        "name": name,
                        "method": type(method).__name__,
                        "is_flashmoe_fp8": isinstance(method, FlashMoEFp8Method),
                        "fallback_reason": getattr(method, "fallback_reason", "n/a"),
                        "backend": method.flashmoe.backend if getattr(method, "flashmoe", None) else None,
                        "fp8_weights": bool(method.flashmoe and method.flashmoe.spec.fp8_weights),
                        "experts": type(kernel.fused_experts).__name__,
                        "experts_is_flashmoe": isinstance(kernel.fused_experts, FlashMoEExperts),
                        "prepare_is_flashmoe": isinstance(kernel.prepare_finalize, FlashMoEPrepareFinalize),
                        "params": {
                            p: [str(getattr(m, p).dtype), list(getattr(m, p).shape)]
                            for p in (
                                "w13_weight",
                                "w2_weight",
                                "w13_weight_scale_inv",
                                "w2_weight_scale_inv",
                            )
                        },
                    }
                )
        # One block's forward, recording what the flashmoe op received and returned.
        block = model.model.layers[0].mlp
        routed = next(m for m in block.modules() if isinstance(m, RoutedExperts))
        op = routed.quant_method.flashmoe
        calls = []
        forward = op.forward

        def recording_forward(*args, **kwargs):
            y = forward(*args, **kwargs)
            calls.append((args, kwargs, y.clone()))
            return y

        op.forward = recording_forward
        x = torch.randn(9, routed.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
        try:
            with set_forward_context(None, vllm_config), torch.no_grad():
                y = block(x)
        finally:
            del op.forward
        (args, kwargs, op_out) = calls[0]
        tensors = {
            "x": x,
            "block_out": y,
            "op_hidden_states": args[0],
            "op_topk_ids": args[1],
            "op_topk_weights": args[2],
            "op_out": op_out,
            "w13_weight": routed.w13_weight.data,
            "w2_weight": routed.w2_weight.data,
            "w13_weight_scale_inv": routed.w13_weight_scale_inv.data,
            "w2_weight_scale_inv": routed.w2_weight_scale_inv.data,
            # The op read the layer's parameters themselves, not copies.
            "op_read_params_in_place": (
                args[3].data_ptr() == routed.w13_weight.data_ptr()
                and args[4].data_ptr() == routed.w2_weight.data_ptr()
                and kwargs["w13_scale_inv"].data_ptr() == routed.w13_weight_scale_inv.data_ptr()
                and kwargs["w2_scale_inv"].data_ptr() == routed.w2_weight_scale_inv.data_ptr()
            ),
        }
        return layers, tensors, len(calls)

    layers, tensors, ncalls = llm.apply_model(inspect_and_run)[0]
    out["layers"] = layers
    out["op_calls"] = ncalls
    out["op_read_params_in_place"] = tensors.pop("op_read_params_in_place")
    torch.save(tensors, Path(out_dir) / "layer.pt")
    # The served path end to end: a greedy completion through the same engine.
    from flashmoe.demo.tiny_model import prompt_words
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    completion = llm.generate([prompt_words(5, seed=0)], params)
    out["generated"] = list(completion[0].outputs[0].token_ids)
    return out


def main(argv: list[str]) -> int:
    if argv[0] != "layer":
        raise SystemExit(f"unknown check {argv[0]!r}")
    print("RESULT " + json.dumps(check_layer(argv[1], argv[2])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
