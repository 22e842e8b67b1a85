"""Which implementation serves a layer, and why.

Every "can the megakernel run this?" check lives here. ``select_backend`` answers it for one layer on
one device; :func:`megakernel_unsupported_reason_for` answers it from a model config and a compute
capability alone, which is what engine adapters call at config time (no CUDA context). Adapters map
a refusal to the engine's own MoE path (its all-to-all DeepEP or the engine's default: :func:`fallback_uses_deepep`),
log one line with the reason, and honour ``FLASHMOE_STRICT``.

Weight formats: flashmoe computes two, on both backends (the megakernel and the PyTorch reference):
unquantized experts (weights in the activation dtype) and block-fp8 experts (e4m3 weights in 128x128
blocks with one fp32 ``scale_inv`` per block, bf16 activations quantised per token inside the layer;
:mod:`flashmoe.reference_fp8`). Adapters describe a checkpoint's expert weights as a
:class:`WeightFormat` -- :func:`weight_format_for` reads the Hugging Face ``quantization_config`` both
vLLM and SGLang load -- and :func:`weights_unsupported_reason` says why any other format (per-tensor
or per-channel fp8, UE8M0 scales, other block sizes, e5m2, MXFP4, NVFP4, int4/int8 weight-only, AWQ,
GPTQ, ...) is not served.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import config
from .errors import FlashMoEUnsupported
from .spec import MoELayerSpec

logger = logging.getLogger("flashmoe")

MEGAKERNEL = "megakernel"
REFERENCE = "reference"
# FLASHMOE_BACKEND=fallback: the engine adapters decline flashmoe (A/B runs against the engine's own path).
FORCED_FALLBACK = "fallback"
FORCED_FALLBACK_WHAT = "flashmoe declines the MoE layers"

# Tile constraints of the kernel (csrc/flashmoe/gemm.cuh): K and N are walked in 64/128-wide tiles;
# block-fp8 weights come in 128x128 blocks, so both dimensions are whole blocks.
HIDDEN_MULTIPLE = 128
INTERMEDIATE_MULTIPLE = 64
FP8_BLOCK = 128
MAX_TOP_K = 16
MAX_WORLD = 64

# The one compute capability the megakernel is built for (flashmoe.build.RUNNABLE_ARCH is its arch).
HOPPER = (9, 0)


@dataclass(frozen=True)
class BackendChoice:
    name: str  # MEGAKERNEL or REFERENCE
    reason: str


@dataclass(frozen=True)
class WeightFormat:
    """How a layer's expert weights are stored, as far as flashmoe is concerned. Adapters build one at
    config time (:func:`weight_format_for`), no CUDA needed; use the constants for the two that
    flashmoe computes and :func:`unsupported_weights` for anything else."""

    kind: str  # "unquantized", "fp8_block" or "unsupported"
    description: str  # what it is, in words: log lines and errors quote it

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """``MoELayerSpec.weight_dtype`` for this format (None: the activation dtype)."""
        return torch.float8_e4m3fn if self.kind == "fp8_block" else None


UNQUANTIZED = WeightFormat("unquantized", "unquantized weights")
FP8_BLOCK_128 = WeightFormat(
    "fp8_block",
    "block-fp8 weights (e4m3, 128x128 blocks, fp32 scale_inv, dynamic per-token-group activations)",
)


def unsupported_weights(description: str) -> WeightFormat:
    return WeightFormat("unsupported", description)


def weights_unsupported_reason(
    weights: WeightFormat,
    *,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """None if flashmoe computes experts stored as ``weights`` (both backends compute the same
    formats), else a one-line reason naming the format. The layer facts given (activation
    ``dtype``, sizes) are checked against what the format needs: block-fp8 takes bf16 activations
    and whole 128x128 blocks."""
    if weights.kind == FP8_BLOCK_128.kind:
        if dtype is not None and dtype != torch.bfloat16:
            return f"block-fp8 experts with {str(dtype).removeprefix('torch.')} activations (flashmoe's fp8 path takes bf16)"
        for what, size in (("hidden size", hidden_size), ("MoE intermediate size", intermediate_size)):
            if size is not None and size % FP8_BLOCK:
                return f"block-fp8 experts with {what} {size}, not a multiple of the {FP8_BLOCK}-wide block"
        return None
    if weights.kind == UNQUANTIZED.kind:
        return None
    return (
        f"{weights.description}: flashmoe serves unquantized or block-fp8 experts "
        f"(e4m3, {FP8_BLOCK}x{FP8_BLOCK} blocks, fp32 scale_inv)"
    )


# quant_method values of checkpoints and engines -> what they are, for the reason line ({bits}: the
# config's bit width).
_QUANT_METHOD_NAMES = {
    "awq": "AWQ int{bits} weights (W{bits}A16)",
    "awq_marlin": "AWQ int{bits} weights (W{bits}A16)",
    "auto_awq": "AWQ int{bits} weights (W{bits}A16)",
    "gptq": "GPTQ int{bits} weights (W{bits}A16)",
    "gptq_marlin": "GPTQ int{bits} weights (W{bits}A16)",
    "auto_gptq": "GPTQ int{bits} weights (W{bits}A16)",
    "moe_wna16": "int{bits} weight-only experts (moe_wna16, W{bits}A16)",
    "experts_int8": "int8 experts (experts_int8)",
    "mxfp4": "MXFP4 weights",
    "gpt_oss_mxfp4": "MXFP4 weights",
    "mxfp8": "MXFP8 weights",
    "modelopt": "ModelOpt-quantized weights (per-tensor fp8 or NVFP4)",
    "modelopt_fp4": "NVFP4 weights (modelopt_fp4)",
    "modelopt_mxfp8": "MXFP8 weights (modelopt_mxfp8)",
    "fbgemm_fp8": "per-channel fp8 weights (fbgemm_fp8)",
    "bitsandbytes": "bitsandbytes int8/4-bit weights",
    "gguf": "GGUF-quantized weights",
    "compressed-tensors": (
        "a compressed-tensors checkpoint (flashmoe reads block-fp8 from quant_method=fp8 checkpoints only)"
    ),
}


def weight_format_for(quant_method: str | None, quant_config: Mapping | None = None) -> WeightFormat:
    """The expert weight format of a checkpoint: ``quant_method`` as the engine resolved it (vLLM's
    ``ModelConfig.quantization``, SGLang's ``--quantization`` or the checkpoint's) and
    ``quant_config`` the checkpoint's Hugging Face ``quantization_config`` (None: none in the checkpoint).
    Only what flashmoe can read in place counts as block-fp8: ``quant_method`` ``fp8`` with
    ``weight_block_size`` [128, 128], e4m3 (``fmt``), fp32 scales (no ``scale_fmt``) and dynamic
    activations, the layout of DeepSeek-V3 and Qwen3-*-FP8."""
    cfg = dict(quant_config or {})
    method = (quant_method or cfg.get("quant_method") or "").lower()
    if not method:
        return UNQUANTIZED
    if method != "fp8":
        bits = cfg.get("bits") or cfg.get("w_bit") or cfg.get("weight_bits") or "N"
        template = _QUANT_METHOD_NAMES.get(method, f"{method}-quantized weights")
        return unsupported_weights(template.format(bits=bits))
    if not cfg:  # --quantization fp8 on an unquantized checkpoint: vLLM 0.26 quantises online, per tensor
        return unsupported_weights("fp8 weights quantised online at load (per-tensor scales)")
    fmt = str(cfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        return unsupported_weights(f"fp8 {fmt} weights (fmt={fmt}; the fp8 path reads e4m3)")
    if cfg.get("store_dtype") == "mxfp4":
        return unsupported_weights("MXFP4 experts in an fp8 checkpoint (store_dtype=mxfp4)")
    block = cfg.get("weight_block_size")
    if block is None:
        scheme = cfg.get("activation_scheme", "dynamic")
        return unsupported_weights(
            f"per-tensor fp8 weights (no weight_block_size; {scheme} activation scales)"
        )
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        return unsupported_weights(
            f"fp8 weights in {'x'.join(map(str, block))} blocks (weight_block_size={list(block)})"
        )
    scale_fmt = cfg.get("scale_fmt")
    if scale_fmt not in (None, "float32", "fp32"):
        return unsupported_weights(
            f"block-fp8 weights with {str(scale_fmt).upper()} scales (scale_fmt={scale_fmt})"
        )
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        return unsupported_weights(f"block-fp8 weights with {cfg['activation_scheme']} activation scales")
    return FP8_BLOCK_128


def hf_quantization_config(*hf_configs) -> dict | None:
    """The checkpoint's ``quantization_config`` as a dict, from the first of ``hf_configs`` (a model's
    Hugging Face config, then its text config) that has one; None for an unquantized checkpoint."""
    for hf in hf_configs:
        cfg = getattr(hf, "quantization_config", None)
        if cfg is not None:
            return (
                dict(cfg) if isinstance(cfg, Mapping) else cfg.to_dict()
            )  # a transformers QuantizationConfig
    return None


def shape_unsupported_reason(
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    world_size: int,
    dtype: torch.dtype | None = torch.bfloat16,
    weights: WeightFormat = UNQUANTIZED,
) -> str | None:
    """The limits of the kernel itself, from the model config alone (no device needed): None if the
    shape fits. Engine adapters call this at config time; :func:`megakernel_unsupported_reason` adds
    the device checks."""
    if dtype is not None and dtype != torch.bfloat16:
        return f"dtype {dtype} (the kernel is bf16)"
    fp8 = weights.kind == FP8_BLOCK_128.kind
    if hidden_size % HIDDEN_MULTIPLE:
        return f"hidden size {hidden_size} is not a multiple of {HIDDEN_MULTIPLE}"
    inter_multiple = FP8_BLOCK if fp8 else INTERMEDIATE_MULTIPLE
    if intermediate_size % inter_multiple:
        what = f" (block-fp8 weights come in {FP8_BLOCK}x{FP8_BLOCK} blocks)" if fp8 else ""
        return f"MoE intermediate size {intermediate_size} is not a multiple of {inter_multiple}{what}"
    if top_k > MAX_TOP_K:
        return f"top_k {top_k} > {MAX_TOP_K}"
    if world_size > MAX_WORLD:
        return f"EP size {world_size} > {MAX_WORLD}"
    return None


def megakernel_unsupported_reason_for(
    capability: tuple[int, int],
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    world_size: int,
    dtype: torch.dtype | None = torch.bfloat16,
    weights: WeightFormat = UNQUANTIZED,
) -> str | None:
    """None if the megakernel can serve a layer of this shape and weight format on a GPU of
    ``capability``, else a one-line reason. Needs no CUDA context: engines call it at config time with
    the capability their platform reports and :func:`weight_format_for` of the checkpoint."""
    if not isinstance(weights, WeightFormat):
        raise TypeError(
            f"weights must be a flashmoe.backend.WeightFormat, got {type(weights).__name__} {weights!r}"
        )
    if capability != HOPPER:
        return f"GPU is sm_{capability[0]}{capability[1]}; the megakernel is built for Hopper (sm_90a)"
    why = weights_unsupported_reason(weights)
    if why is not None:
        return why
    why = shape_unsupported_reason(hidden_size, intermediate_size, top_k, world_size, dtype, weights)
    if why is not None:
        return why
    if not _module_exists("nvidia.nvshmem"):
        return "NVSHMEM (pip package nvidia-nvshmem-cu13) is not installed"
    from .build.toolchain import find_nvcc

    if find_nvcc() is None:  # the JIT cache key holds the nvcc version: even a prebuilt kernel needs nvcc
        return "nvcc not found (set FLASHMOE_NVCC or CUDA_HOME)"
    return None


def spec_weight_format(spec: MoELayerSpec) -> WeightFormat:
    """The weight format a spec describes (its ``weight_dtype``)."""
    return FP8_BLOCK_128 if spec.fp8_weights else UNQUANTIZED


def megakernel_unsupported_reason(
    spec: MoELayerSpec, device: torch.device, world_size: int, weights: WeightFormat | None = None
) -> str | None:
    """None if the megakernel can serve the layer on ``device``, else a one-line reason. ``weights``:
    the engine's format when it differs from what the spec says (None: the spec's)."""
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return megakernel_unsupported_reason_for(
        tuple(torch.cuda.get_device_capability(device)),
        spec.hidden_size,
        spec.intermediate_size,
        spec.top_k,
        world_size,
        spec.dtype,
        weights if weights is not None else spec_weight_format(spec),
    )


def forced_fallback_reason() -> str | None:
    """The reason adapters give when ``FLASHMOE_BACKEND=fallback`` tells them to decline flashmoe (None
    otherwise). They take the path of a real decline with it: their fallback, its log line and metric,
    and ``FLASHMOE_STRICT=1``'s error."""
    return "FLASHMOE_BACKEND=fallback" if config.backend() == FORCED_FALLBACK else None


def select_backend(
    spec: MoELayerSpec, device: torch.device, world_size: int, weights: WeightFormat | None = None
) -> BackendChoice:
    forced = config.backend()
    if forced == FORCED_FALLBACK:
        # Adapters decline before any layer is built; a layer built outside them has no other path.
        raise FlashMoEUnsupported(
            "FLASHMOE_BACKEND=fallback makes the vLLM and SGLang adapters serve with the engine's own MoE "
            "path; a FlashMoE layer built outside them has nothing to fall back to (use auto, megakernel or reference)"
        )
    if forced == REFERENCE:
        return BackendChoice(REFERENCE, "FLASHMOE_BACKEND=reference")
    why = megakernel_unsupported_reason(spec, device, world_size, weights)
    if why is None:
        what = "block-fp8" if spec.fp8_weights else "bf16"
        return BackendChoice(MEGAKERNEL, f"sm_90 GPU, {what}, supported shape")
    if forced == MEGAKERNEL or config.strict():
        raise FlashMoEUnsupported(f"flashmoe megakernel cannot serve this layer: {why}")
    return BackendChoice(REFERENCE, why)


def deep_ep_importable() -> bool:
    """Whether the engines' DeepEP fallback can be used here (deep_ep imports, its CUDA extension loads)."""
    try:
        import deep_ep  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA extension
        return False
    return True


def fallback_uses_deepep(ep_spans_nodes: bool) -> tuple[bool, str]:
    """Whether an engine's fallback should run its DeepEP all-to-all, and why (for the log line).

    ``FLASHMOE_FALLBACK_ALL2ALL`` = ``deepep`` or ``default`` decides; ``auto`` (the default) takes DeepEP
    only when the EP group spans nodes. On one node the DeepEP tier is the slower path: vLLM 0.26 runs
    deepep_high_throughput with DP > 1 without CUDA graphs, and on 2xH200 it served 0.14x of vLLM's default
    DP2+EP output tokens/s at c = 64, same token ids (benchmarks/results/
    2026-11-23-h200x2-vllm-serve-dp2-deepep-fallback.json). Across nodes DeepEP is the engines' own EP
    path; that case is not measured here (no multi-node machines).
    """
    mode = config.fallback_all2all()
    if mode == "default":
        return False, "FLASHMOE_FALLBACK_ALL2ALL=default"
    if not deep_ep_importable():
        return False, "deep_ep is not installed"
    if mode == "deepep":
        return True, "FLASHMOE_FALLBACK_ALL2ALL=deepep"
    if ep_spans_nodes:
        return True, "the EP group spans nodes"
    return False, (
        "the EP group is on one node, where the engine's default all-to-all is faster than its DeepEP one "
        "(FLASHMOE_FALLBACK_ALL2ALL=deepep takes DeepEP anyway)"
    )


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a missing parent package
        return False
