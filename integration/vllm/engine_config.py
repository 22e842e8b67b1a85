"""Engine-level decisions for ``--moe-backend flashmoe``, taken once where vLLM builds its config.

``EngineArgs.create_engine_config`` runs in the process that owns the engine (API server or
``LLM``); the resulting ``VllmConfig`` is shipped to every engine core and worker. Deciding here
means a fallback can still pick vLLM's DeepEP all2all (chosen at config time, not per layer) and
that unsupported deployments fail before any worker starts.

What is decided here:
- refused with an error: EP disabled on more than one rank, EPLB, dual-batch overlap, and the
  host-synchronising reference backend on CUDA with CUDA graphs on;
- fallback, on every platform, when ``FLASHMOE_BACKEND=fallback`` asks for it (A/B runs against
  vLLM's path; reason ``FLASHMOE_BACKEND=fallback``);
- fallback, on every platform: expert weights in a format flashmoe does not compute (anything but
  unquantized or block-fp8 128x128 with fp32 scales: per-tensor fp8, UE8M0 scales, MXFP4, AWQ, GPTQ,
  ...; :func:`flashmoe.backend.weight_format_for` reads the checkpoint's ``quantization_config``);
- fallback (megakernel cannot serve this deployment): non-Hopper or non-CUDA accelerator,
  non-bf16 dtype, shapes outside the kernel's tile limits. The fallback is vLLM's own MoE path; its
  all-to-all is DeepEP (``deepep_high_throughput``) where the user left ``--all2all-backend`` at its
  default, ``deep_ep`` imports and the EP group spans nodes (``FLASHMOE_FALLBACK_ALL2ALL``:
  :func:`flashmoe.backend.fallback_uses_deepep`), else vLLM's default; ``FLASHMOE_STRICT=1`` makes it
  an error;
- CPU: the distributed PyTorch reference serves the layers (bf16 or block-fp8), no fallback.

Per-layer conditions that only a worker can see (NVSHMEM init, JIT build) are handled in
:mod:`.moe_method`, which falls back to vLLM's default kernel for that layer.
"""

from __future__ import annotations

from flashmoe import config
from flashmoe.backend import (
    FORCED_FALLBACK_WHAT,
    REFERENCE,
    WeightFormat,
    fallback_uses_deepep,
    forced_fallback_reason,
    hf_quantization_config,
    megakernel_unsupported_reason_for,
    weight_format_for,
    weights_unsupported_reason,
)
from flashmoe.errors import FlashMoEUnsupported

from . import compat
from .log import logger


def requested_backend(args) -> str:
    """The ``moe_backend`` the user asked for (``--moe-backend`` wins over ``--kernel-config``)."""
    if args.moe_backend != "auto":
        return args.moe_backend
    kernel_config = getattr(args, "kernel_config", None)
    return getattr(kernel_config, "moe_backend", "auto")


def wrap_create_engine_config(engine_args_cls) -> None:
    """Route ``EngineArgs.create_engine_config`` (and subclasses') through :func:`resolve`."""
    original = engine_args_cls.create_engine_config
    if getattr(original, "_flashmoe_wrapped", False):
        return

    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        if requested_backend(self) != compat.BACKEND_NAME:
            return vllm_config
        fallback = resolve(vllm_config)
        if fallback is None:
            return vllm_config
        # Rebuild with the fallback choices so vLLM derives everything (compilation splitting ops,
        # CUDA-graph mode for DeepEP, all2all manager) from them, as if the user had asked for it.
        self.moe_backend = "auto"
        if getattr(self, "kernel_config", None) is not None:
            self.kernel_config.moe_backend = "auto"
        if fallback.all2all_backend is not None:
            self.all2all_backend = fallback.all2all_backend
        return original(self, *args, **kwargs)

    create_engine_config._flashmoe_wrapped = True  # type: ignore[attr-defined]
    create_engine_config.__doc__ = original.__doc__
    engine_args_cls.create_engine_config = create_engine_config


class Fallback:
    def __init__(self, reason: str, all2all_backend: str | None):
        self.reason = reason
        self.all2all_backend = all2all_backend


def resolve(vllm_config) -> Fallback | None:
    """Validate a flashmoe deployment; return the fallback to apply, or None to serve with flashmoe."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    ranks = (
        parallel.tensor_parallel_size
        * parallel.data_parallel_size
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )
    if ranks > 1 and not parallel.enable_expert_parallel:
        raise ValueError(
            "--moe-backend flashmoe is an expert-parallel backend: add --enable-expert-parallel "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}, data_parallel_size={parallel.data_parallel_size})"
        )
    if parallel.enable_eplb:
        raise ValueError(
            "--moe-backend flashmoe does not support EPLB yet (the megakernel's expert placement is fixed "
            "when the layer is built and redundant experts are not supported); drop --enable-eplb"
        )
    if getattr(parallel, "enable_dbo", False):
        raise ValueError("--moe-backend flashmoe does not support dual-batch overlap; drop --enable-dbo")

    forced = forced_fallback_reason()
    if forced is not None:  # before the platform's choice: on CPU too it lands on vLLM's own path
        return _fall_back(FORCED_FALLBACK_WHAT, forced, parallel)

    platform = compat.platform_kind()
    weights = checkpoint_weight_format(model)
    text_config = model.hf_text_config
    unreadable = weights_unsupported_reason(  # no flashmoe backend computes these experts
        weights,
        hidden_size=getattr(text_config, "hidden_size", None),
        intermediate_size=getattr(text_config, "moe_intermediate_size", None),
        dtype=model.dtype,
    )
    if unreadable is not None:
        return _fall_back("flashmoe cannot serve this model's experts", unreadable, parallel)
    if platform == "cpu":
        if config.strict():
            raise FlashMoEUnsupported(
                "FLASHMOE_STRICT=1: on CPU flashmoe runs the PyTorch reference, not the megakernel"
            )
        logger.info(
            "flashmoe: CPU platform: MoE layers run flashmoe's distributed PyTorch reference over the EP group"
        )
        return None
    if platform == "cuda" and config.backend() == REFERENCE:
        if not model.enforce_eager:
            raise ValueError(
                "FLASHMOE_BACKEND=reference on CUDA synchronises with the host inside the MoE layer, "
                "which CUDA graphs cannot capture: add --enforce-eager"
            )
        return None

    reason = megakernel_refusal(vllm_config, platform, weights)
    if reason is None:
        return None
    return _fall_back("the flashmoe megakernel cannot serve this model", reason, parallel)


def _fall_back(what: str, reason: str, parallel) -> Fallback:
    """vLLM's own MoE path for this deployment, with one log line (``FLASHMOE_STRICT=1``: an error)."""
    if config.strict():
        raise FlashMoEUnsupported(f"FLASHMOE_STRICT=1 and {what}: {reason}")
    from flashmoe import metrics

    metrics.record_fallback(reason)
    all2all = None
    # The all-to-all is ours to pick only if the user left it at vLLM's default.
    ours = parallel.enable_expert_parallel and parallel.all2all_backend == compat.DEFAULT_ALL2ALL_BACKEND
    deepep, why = fallback_uses_deepep(compat.ep_spans_nodes(parallel)) if ours else (False, "")
    if deepep:
        all2all = compat.DEEPEP_ALL2ALL_BACKEND
        chosen = f"vLLM's DeepEP path (all2all_backend={all2all}, moe_backend=auto"
    else:
        chosen = f"vLLM's default MoE path (all2all_backend={parallel.all2all_backend}, moe_backend=auto"
    # Why that all-to-all, where it was ours to pick (SGLang's adapter says it the same way).
    chosen += f"; {why})" if why else ")"
    logger.warning("flashmoe: %s (%s); using %s", what, reason, chosen)
    return Fallback(reason, all2all)


def checkpoint_weight_format(model_config) -> WeightFormat:
    """The expert weight format of the model vLLM loads: its resolved ``quantization`` and the
    checkpoint's ``quantization_config`` (on the HF config or its text config)."""
    quant_cfg = hf_quantization_config(model_config.hf_config, getattr(model_config, "hf_text_config", None))
    return weight_format_for(model_config.quantization, quant_cfg)


def megakernel_refusal(vllm_config, platform: str, weights: WeightFormat) -> str | None:
    """Why the megakernel cannot serve this deployment, from config alone (None if it can): the
    platform here, everything else in :func:`flashmoe.backend.megakernel_unsupported_reason_for`."""
    if platform != "cuda":
        return f"platform is {platform}, the megakernel needs an NVIDIA Hopper GPU"
    capability = compat.current_device_capability()
    if capability is None:
        return "no CUDA device visible"
    model = vllm_config.model_config
    text_config = model.hf_text_config
    parallel = vllm_config.parallel_config
    return megakernel_unsupported_reason_for(  # a field the config lacks (or sets to None) is not checked
        capability,
        getattr(text_config, "hidden_size", None) or 0,
        getattr(text_config, "moe_intermediate_size", None) or 0,
        getattr(text_config, "num_experts_per_tok", None) or 0,
        parallel.tensor_parallel_size * parallel.data_parallel_size,
        model.dtype,
        weights,
    )
