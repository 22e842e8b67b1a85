"""Server-argument resolution for ``--moe-runner-backend flashmoe`` (runs in the launcher).

Wraps SGLang's ``handle_a2a_moe`` step. When flashmoe is selected it either declares
``moe_a2a_backend=customized, ep_size=tp_size`` (flashmoe serves the MoE layers) or hands the
layers back to SGLang's own path (``deepep`` if ``deep_ep`` imports, else the default) with one log
line saying why: on any platform when ``FLASHMOE_BACKEND=fallback`` asks for it, or when the
checkpoint's experts are in a format flashmoe does not compute (anything but unquantized or
block-fp8 128x128 with fp32 scales), and on CUDA when the megakernel cannot serve the model. Configurations flashmoe cannot serve correctly at all are
refused here, with an error that names the flag to change.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from flashmoe import MoELayerSpec, config
from flashmoe.backend import (
    FORCED_FALLBACK_WHAT,
    MEGAKERNEL,
    REFERENCE,
    WeightFormat,
    fallback_uses_deepep,
    forced_fallback_reason,
    hf_quantization_config,
    select_backend,
    weight_format_for,
    weights_unsupported_reason,
)
from flashmoe.errors import FlashMoEUnsupported

from .hooks import A2A_BACKEND, RUNNER_NAME, RUNTIME_HOOKS, runtime_hooks_applied

logger = logging.getLogger(__name__)

SOURCE = "flashmoe"  # provenance tag on SGLang's resolution declarations

# Models whose shared experts SGLang replicates per rank when SGLANG_SHARED_EXPERT_TP1=1
# (sglang/srt/models/deepseek_v2.py). Elsewhere a shared expert stays TP-sharded under a
# custom all-to-all and its partial sums would never be reduced, so those models are refused.
SHARED_EXPERT_TP1_ARCHS = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"}
)


@dataclass(frozen=True)
class Resolution:
    """What the resolution step declares, and the one line it logs."""

    fields: dict
    message: str
    fallback: bool


def resolve_flashmoe(server_args, previous) -> None:
    """``register_resolution_hook("handle_a2a_moe")`` wrapper: flashmoe first, then SGLang's step."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    cfg = resolving_view(server_args)
    if cfg.moe_runner_backend == RUNNER_NAME:
        decision = decide(server_args)
        declare_resolution(server_args, SOURCE, **decision.fields)
        (logger.warning if decision.fallback else logger.info)(decision.message)
        # The scheduler processes count a fallback in the metrics: the launcher must not import
        # prometheus_client before SGLang exports PROMETHEUS_MULTIPROC_DIR.
        config.set_sglang_fallback(decision.message if decision.fallback else None)
    previous(server_args)


def decide(server_args) -> Resolution:
    """Validate a flashmoe launch and choose between flashmoe and SGLang's own MoE path."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    cfg = resolving_view(server_args)
    _refuse_incompatible_flags(cfg)
    forced = forced_fallback_reason()
    if forced is not None:
        return _strict_or_fallback(cfg, forced, FORCED_FALLBACK_WHAT)
    model_config = model_config_of(server_args)
    weights = checkpoint_weight_format(model_config, cfg)
    hf = model_config.hf_text_config
    unreadable = weights_unsupported_reason(  # no flashmoe backend computes these experts
        weights,
        hidden_size=hf.hidden_size,
        intermediate_size=_first_attr(hf, ("moe_intermediate_size", "intermediate_size")),
        dtype=model_config.dtype,
    )
    if unreadable is not None:
        return _strict_or_fallback(cfg, unreadable, "flashmoe cannot serve this model's experts")
    spec = layer_spec_from_model(model_config, cfg, weights)
    device = _target_device(cfg.device)
    choice = select_backend(spec, device, cfg.tp_size)  # raises under FLASHMOE_STRICT=1

    if choice.name != MEGAKERNEL and device.type == "cuda" and config.backend() != REFERENCE:
        return _fallback(cfg, choice.reason)

    missing = [t for t in RUNTIME_HOOKS if t not in runtime_hooks_applied()]
    if missing:
        raise RuntimeError(
            f"flashmoe: SGLang did not apply the runtime hooks {missing} (see the plugin loader's log above); "
            "refusing to start a server whose MoE layers would not run flashmoe"
        )
    _refuse_unsupported_shared_experts(model_config, cfg)
    backend = "megakernel" if choice.name == MEGAKERNEL else f"the PyTorch reference ({choice.reason})"
    fields = {
        "moe_a2a_backend": A2A_BACKEND,
        # SGLang only widens EP to TP for its own a2a backends; 'customized' must be declared.
        "ep_size": cfg.tp_size,
        # Fused shared experts would add per-rank shared slots the kernel does not know about.
        "disable_shared_experts_fusion": True,
    }
    return Resolution(
        fields,
        f"flashmoe: MoE layers run {backend}; moe_a2a_backend={A2A_BACKEND}, ep_size={cfg.tp_size}",
        fallback=False,
    )


def checkpoint_weight_format(model_config, cfg) -> WeightFormat:
    """The expert weight format: ``--quantization`` (or what SGLang resolved from the checkpoint) and
    the checkpoint's ``quantization_config``."""
    quant_cfg = hf_quantization_config(model_config.hf_config, getattr(model_config, "hf_text_config", None))
    return weight_format_for(cfg.quantization or getattr(model_config, "quantization", None), quant_cfg)


def layer_spec_from_model(model_config, cfg, weights: WeightFormat | None = None) -> MoELayerSpec:
    """The MoE layer shape as the scheduler's FusedMoE will see it (EP only: intermediate unsplit)."""
    hf = model_config.hf_text_config
    num_experts = _first_attr(hf, ("num_experts", "n_routed_experts", "num_local_experts"))
    top_k = _first_attr(hf, ("num_experts_per_tok", "moe_topk", "top_k"))
    intermediate = _first_attr(hf, ("moe_intermediate_size", "intermediate_size"))
    if num_experts is None or top_k is None:
        raise ValueError(
            f"flashmoe: {model_config.hf_config.architectures} has no MoE layers that flashmoe recognises "
            "(no num_experts / num_experts_per_tok in its config); drop --moe-runner-backend flashmoe"
        )
    num_experts += cfg.ep_num_redundant_experts or 0
    if num_experts % cfg.tp_size:
        raise ValueError(
            f"flashmoe: {num_experts} experts do not divide over --tp-size {cfg.tp_size} EP ranks"
        )
    return MoELayerSpec(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hf.hidden_size,
        intermediate_size=intermediate,
        max_tokens_per_rank=max(
            1, cfg.chunked_prefill_size or 8192
        ),  # for the decision; scheduler layers size buffers
        dtype=model_config.dtype,
        weight_dtype=weights.weight_dtype if weights is not None else None,
    )


def _refuse_incompatible_flags(cfg) -> None:
    if cfg.moe_a2a_backend not in (None, "none", A2A_BACKEND):
        raise ValueError(
            f"--moe-runner-backend flashmoe does its own all-to-all; remove --moe-a2a-backend {cfg.moe_a2a_backend}"
        )
    if cfg.enable_two_batch_overlap or cfg.enable_single_batch_overlap:
        raise ValueError(
            "--moe-runner-backend flashmoe runs dispatch, experts and combine in one kernel and cannot overlap "
            "two micro-batches: remove --enable-two-batch-overlap / --enable-single-batch-overlap"
        )
    if cfg.tp_size > 1 and cfg.attn_dp_size != cfg.tp_size:
        raise ValueError(
            f"--moe-runner-backend flashmoe needs data-parallel attention over the whole EP group "
            f"(--attn-dp-size {cfg.tp_size} with --tp-size {cfg.tp_size}, got --attn-dp-size {cfg.attn_dp_size}): "
            "each rank must bring its own tokens to the kernel"
        )


def _refuse_unsupported_shared_experts(model_config, cfg) -> None:
    hf = model_config.hf_text_config
    has_shared = bool(getattr(hf, "n_shared_experts", 0) or getattr(hf, "shared_expert_intermediate_size", 0))
    if not has_shared or cfg.tp_size == 1:
        return
    archs = set(model_config.hf_config.architectures or ())
    if archs & SHARED_EXPERT_TP1_ARCHS:
        if os.environ.get("SGLANG_SHARED_EXPERT_TP1", "1").strip().lower() in ("0", "false", "no", "off"):
            raise ValueError(
                "flashmoe: SGLANG_SHARED_EXPERT_TP1=0 keeps DeepSeek's shared experts TP-sharded, but the "
                "flashmoe output is already complete per rank and is not all-reduced; unset it"
            )
        # Inherited by the scheduler processes the launcher spawns after resolution.
        os.environ["SGLANG_SHARED_EXPERT_TP1"] = "1"
        return
    raise ValueError(
        f"flashmoe: {sorted(archs)} has shared experts that SGLang keeps TP-sharded under a custom all-to-all; "
        "their partial sums would not be reduced. Supported with shared experts: "
        f"{sorted(SHARED_EXPERT_TP1_ARCHS)}"
    )


def _strict_or_fallback(cfg, reason: str, what: str) -> Resolution:
    if config.strict():
        raise FlashMoEUnsupported(f"FLASHMOE_STRICT=1 and {what}: {reason}")
    return _fallback(cfg, reason, what)


def _fallback(cfg, reason: str, what: str = "megakernel unavailable") -> Resolution:
    """SGLang's own MoE path; DeepEP for its all-to-all where :func:`fallback_uses_deepep` says so (the EP
    group spans nodes: ``--nnodes`` > 1)."""
    deepep, why = fallback_uses_deepep(getattr(cfg, "nnodes", 1) > 1)
    if deepep:
        fields = {"moe_runner_backend": "auto", "moe_a2a_backend": "deepep"}
        target = "SGLang's deepep backend"
    else:
        fields = {"moe_runner_backend": "auto", "moe_a2a_backend": "none"}
        target = f"SGLang's default MoE path ({why})"
    return Resolution(fields, f"flashmoe: {what} ({reason}); falling back to {target}", fallback=True)


def _target_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _first_attr(obj, names):
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None
