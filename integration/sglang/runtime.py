"""Scheduler-side flashmoe: the pass-through dispatcher, the fused call and per-layer preparation.

Flow of one SGLang MoE layer (``FusedMoE.forward_impl``) under ``--moe-runner-backend flashmoe``:

    dispatcher.dispatch      -> PassThroughDispatcher: global (physical) expert ids, no token movement
    FusedMoE.run_moe_core    -> run_flashmoe_layer: one FlashMoE call (dispatch, SwiGLU experts, combine)
    dispatcher.combine       -> the tensor as is; post_experts_output_is_complete() is True, so no all-reduce

``prepare_model`` builds each layer's :class:`flashmoe.FlashMoE` right after ``ModelRunner.load_model``
(before KV-cache sizing and CUDA-graph capture), so nothing is allocated or compiled during capture.

Weights: unquantized layers (``UnquantizedFusedMoEMethod``) and block-fp8 layers (``Fp8MoEMethod`` with
``weight_block_size`` [128, 128]: ``w13_weight``/``w2_weight`` e4m3 and their fp32
``w13_weight_scale_inv``/``w2_weight_scale_inv``). Both are read in place; for fp8 layers
``Fp8MoEMethod.process_weights_after_loading`` is skipped (:func:`fp8_process_weights_hook`), so the
loaded tensors are exactly the checkpoint's.
"""

from __future__ import annotations

import logging

import torch
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, config, metrics
from flashmoe.backend import FP8_BLOCK, FP8_BLOCK_128, UNQUANTIZED, WeightFormat

from .hooks import RUNNER_NAME

logger = logging.getLogger(__name__)

LAYER_ATTR = "_flashmoe"  # the FlashMoE op stored on each prepared FusedMoE layer


def flashmoe_selected() -> bool:
    """True in a scheduler process whose resolved configuration routes MoE layers to flashmoe."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_moe_runner_backend

    return get_moe_a2a_backend().is_customized() and get_moe_runner_backend().value == RUNNER_NAME


# --------------------------------------------------------------------------- dispatcher


def _dispatcher_base():
    from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher

    return BaseDispatcher


class PassThroughDispatcher(_dispatcher_base()):
    """SGLang dispatcher that moves nothing: the kernel does dispatch and combine over NVSHMEM.

    Unlike ``StandardDispatcher`` it never maps expert ids to local ones (non-local -> -1): the
    kernel routes every (token, expert) pair to the owning rank itself.
    """

    def __init__(self, moe_runner_config):
        super().__init__()
        self.runner_backend = moe_runner_config.runner_backend

    def dispatch(self, hidden_states: torch.Tensor, topk_output):
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        elif not TopKOutputChecker.format_is_standard(topk_output):
            raise TypeError(
                f"flashmoe needs explicit top-k ids and weights, got {type(topk_output).__name__}"
            )
        return StandardDispatchOutput(
            hidden_states=hidden_states, hidden_states_scale=None, topk_output=topk_output
        )

    def combine(self, combine_input) -> torch.Tensor:
        return combine_input.hidden_states


# --------------------------------------------------------------------------- hooks (targets in hooks.py)


def create_moe_dispatcher_hook(original, *args, **kwargs):
    if flashmoe_selected():
        moe_runner_config = kwargs.get("moe_runner_config", args[0] if args else None)
        return PassThroughDispatcher(moe_runner_config)
    return original(*args, **kwargs)


def output_is_complete_hook(original, *args, **kwargs) -> bool:
    # The kernel's combine sums each token's expert outputs back on its source rank.
    return True if flashmoe_selected() else original(*args, **kwargs)


def run_moe_core_hook(original, layer, *args, **kwargs):
    if getattr(layer, LAYER_ATTR, None) is None:
        if flashmoe_selected():
            raise RuntimeError(
                f"flashmoe: MoE layer {layer.layer_name or layer.layer_id} ran before prepare_model() built its "
                "FlashMoE op (ModelRunner.load_model prepares every FusedMoE layer)"
            )
        return original(layer, *args, **kwargs)
    dispatch_output = kwargs.get("dispatch_output", args[0] if args else None)
    return run_flashmoe_layer(layer, dispatch_output)


def load_model_hook(result, model_runner, *args, **kwargs):
    if flashmoe_selected():
        prepare_model(model_runner.model)
    else:
        _record_launch_fallback()
    return result


def fp8_process_weights_hook(original, method, layer, *args, **kwargs):
    """Under flashmoe a block-fp8 layer keeps its weights and scales as loaded (flashmoe reads them in
    place); any other fp8 layer gets SGLang's processing (and is refused by prepare_layer)."""
    if flashmoe_selected() and fp8_method_unsupported_reason(method) is None:
        return None
    return original(method, layer, *args, **kwargs)


def fp8_method_unsupported_reason(method) -> str | None:
    """None if an SGLang ``Fp8MoEMethod`` holds block-fp8 128x128 experts flashmoe reads in place."""
    if getattr(method, "use_mxfp8", False):
        return "MXFP8 experts"
    if getattr(method, "is_fp4_expert", False):
        return "FP4 experts in an fp8 checkpoint"
    if not getattr(method, "block_quant", False):
        return "per-tensor fp8 experts (no weight_block_size)"
    block = list(method.weight_block_size or ())
    if block != [FP8_BLOCK, FP8_BLOCK]:
        return f"fp8 weight blocks {block} (flashmoe reads {FP8_BLOCK}x{FP8_BLOCK})"
    if getattr(method.quant_config, "activation_scheme", "dynamic") != "dynamic":
        return f"{method.quant_config.activation_scheme} activation scales"
    return None


_fallback_recorded = False


def _record_launch_fallback() -> None:
    """Count the launcher's fallback decision (resolution.resolve_flashmoe) once per scheduler process."""
    global _fallback_recorded
    reason = config.sglang_fallback()
    if reason and not _fallback_recorded:
        metrics.record_fallback(reason)
        _fallback_recorded = True


# --------------------------------------------------------------------------- the fused call


def run_flashmoe_layer(layer, dispatch_output):
    """One flashmoe call for a prepared FusedMoE layer -> ``StandardCombineInput`` (already combined)."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    op: FlashMoE = getattr(layer, LAYER_ATTR)
    topk = dispatch_output.topk_output
    topk_ids = topk.topk_ids if topk.topk_ids.dtype == torch.int32 else topk.topk_ids.to(torch.int32)
    topk_weights = topk.topk_weights.float()
    scale = layer._flashmoe_output_scale
    if scale is not None:
        topk_weights = topk_weights * scale  # the weighted sum is linear: fold the scale into the weights
    scales = {}
    if op.spec.fp8_weights:
        scales = {"w13_scale_inv": layer.w13_weight_scale_inv, "w2_scale_inv": layer.w2_weight_scale_inv}
    out = op(
        dispatch_output.hidden_states, topk_ids, topk_weights, layer.w13_weight, layer.w2_weight, **scales
    )
    return StandardCombineInput(hidden_states=out)


def _runner_core_base():
    from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore

    return DispatchMoeRunnerCore


class FlashMoERunnerCore(_runner_core_base()):
    """The runner core SGLang's registry builds for ``--moe-runner-backend flashmoe``.

    Registering it makes ``flashmoe`` a runner name SGLang resolves. The unquantized MoE method
    keeps its own runner (its ``run_moe_core`` is intercepted instead); a quantization method that
    does select this runner reaches the same fused call through here.
    """

    @property
    def runner_backend(self):
        from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

        return resolve_moe_runner_backend(RUNNER_NAME)

    def run_from_dispatch(self, dispatch_output, quant_info, runner_config, hooks=None):
        if hooks is not None:
            raise NotImplementedError("flashmoe does not run LoRA MoE hooks")
        return run_flashmoe_layer(runner_config.layer, dispatch_output)


# --------------------------------------------------------------------------- preparation


def prepare_model(model: torch.nn.Module) -> int:
    """Build the FlashMoE op of every FusedMoE layer in ``model``; returns how many were prepared."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in layers:
        prepare_layer(layer)
    if layers:
        op = getattr(layers[0], LAYER_ATTR)
        logger.info("flashmoe: prepared %d MoE layers: %r", len(layers), op)
    return len(layers)


def prepare_layer(layer) -> FlashMoE:
    """Check that flashmoe computes exactly what SGLang's layer would, then build its FlashMoE op."""
    if getattr(layer, LAYER_ATTR, None) is not None:
        return getattr(layer, LAYER_ATTR)
    weights = _check_layer_semantics(layer)
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    world_size = layer.moe_ep_size
    if layer.num_local_experts * world_size != layer.num_experts:
        raise ValueError(
            f"flashmoe: layer {layer.layer_name}: {layer.num_experts} experts over {world_size} ranks "
            f"but {layer.num_local_experts} local"
        )
    spec = MoELayerSpec(
        num_experts=layer.num_experts,
        top_k=layer.top_k,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size_per_partition,
        max_tokens_per_rank=max_tokens_per_rank(),
        dtype=layer.params_dtype,  # the activations' (fp8 layers too: their weights are created e4m3)
        weight_dtype=weights.weight_dtype,
    )
    group = parallel.moe_ep_group
    op = FlashMoE(
        spec,
        # SGLang places experts contiguously: rank r owns [r * E_local, (r + 1) * E_local).
        ExpertPlacement.contiguous(layer.num_experts, world_size),
        group.device_group if world_size > 1 else None,
        cpu_group=group.cpu_group if world_size > 1 else None,
        layer_name=layer.layer_name or f"layer{layer.layer_id}",
        device=layer.w13_weight.device,
    )
    setattr(layer, LAYER_ATTR, op)
    layer._flashmoe_output_scale = _output_scale(layer)
    return op


def max_tokens_per_rank() -> int:
    """Tokens one rank brings to one call: SGLang's own bound (the max of the prefill chunk, the
    piecewise-prefill capture size and decode batch x draft tokens); FlashMoE applies FLASHMOE_MAX_TOKENS."""
    from sglang.srt.runtime_context import cutedsl_moe_max_num_tokens

    return max(1, int(cutedsl_moe_max_num_tokens()))


def _output_scale(layer) -> float | None:
    """SGLang's CUDA runners multiply the routed output by ``routed_scaling_factor`` (DeepSeek);
    elsewhere the model does it (deepseek_v2.py: ``if not _is_cuda: *= routed_scaling_factor``)."""
    from sglang.srt.utils.common import is_cuda

    factor = layer.moe_runner_config.routed_scaling_factor
    if factor is None or factor == 1.0 or layer.should_fuse_routed_scaling_factor_in_topk or not is_cuda():
        return None
    return float(factor)


def layer_weight_format(layer) -> tuple[WeightFormat, str | None]:
    """(format, None) for a layer whose weights flashmoe reads, else (format, why not)."""
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    method = layer.quant_method
    if isinstance(method, UnquantizedFusedMoEMethod):
        return UNQUANTIZED, None
    if type(method) is Fp8MoEMethod:
        why = fp8_method_unsupported_reason(method)
        if why is None and layer.params_dtype != torch.bfloat16:
            why = f"{layer.params_dtype} activations (block-fp8 experts take bf16)"
        return FP8_BLOCK_128, why
    return UNQUANTIZED, (
        f"quantization method {type(method).__name__} (flashmoe reads unquantized or block-fp8 128x128 experts)"
    )


def _check_layer_semantics(layer) -> WeightFormat:
    cfg = layer.moe_runner_config
    name = layer.layer_name or f"layer {layer.layer_id}"
    problems = []
    weights, why = layer_weight_format(layer)
    if why is not None:
        problems.append(why)
    if cfg.activation != "silu" or not cfg.is_gated:
        problems.append(f"activation {cfg.activation!r} gated={cfg.is_gated} (flashmoe computes SwiGLU)")
    if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None or cfg.swiglu_limit is not None:
        problems.append("a clamped/alpha SwiGLU variant")
    if cfg.apply_router_weight_on_input:
        problems.append("router weights applied on the input")
    if cfg.no_combine:
        problems.append("no_combine")
    if getattr(layer, "with_bias", False):
        problems.append("expert biases")
    if layer.num_fused_shared_experts:
        problems.append("fused shared experts (launch with --disable-shared-experts-fusion)")
    if layer.moe_tp_size != 1:
        problems.append(
            f"MoE tensor parallelism {layer.moe_tp_size} (flashmoe is pure EP: ep_size == tp_size)"
        )
    # SGLang loads gate_proj into w13[:, :I] and up_proj into w13[:, I:] (FusedMoE._load_w13), as
    # flashmoe expects, unless the quant method asks for up first (FlashInfer CUTLASS layout).
    weight_layout = getattr(layer, "weight_load_method", None) or layer.quant_method
    if getattr(weight_layout, "load_up_proj_weight_first", False):
        problems.append("w13 stored up-then-gate (load_up_proj_weight_first)")
    if problems:
        raise ValueError(f"flashmoe cannot serve MoE layer {name}: " + "; ".join(problems))
    return weights
