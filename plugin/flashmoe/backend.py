"""Which implementation serves a layer, and why.

``select_backend`` is engine-agnostic: it answers whether the megakernel can run this layer on this
device. Engine adapters map a refusal to their own fallback (vLLM's DeepEP or default path, SGLang's
deepep), log one line with the reason, and honour ``FLASHMOE_STRICT``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import env, env_flag
from .errors import FlashMoEUnsupported
from .spec import MoELayerSpec

logger = logging.getLogger("flashmoe")

MEGAKERNEL = "megakernel"
REFERENCE = "reference"

# Tile constraints of the v1 kernel (csrc/flashmoe/gemm.cuh): K and N are walked in 64/128-wide tiles.
HIDDEN_MULTIPLE = 128
INTERMEDIATE_MULTIPLE = 64
MAX_TOP_K = 16
MAX_LOCAL_EXPERTS = 1 << 15
MAX_WORLD = 64


@dataclass(frozen=True)
class BackendChoice:
    name: str  # MEGAKERNEL or REFERENCE
    reason: str


def shape_unsupported_reason(
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    world_size: int,
    dtype: torch.dtype | None = torch.bfloat16,
) -> str | None:
    """The limits of the kernel itself, from the model config alone (no device needed): None if the
    shape fits. Engine adapters call this at config time; :func:`megakernel_unsupported_reason` adds
    the device checks."""
    if dtype is not None and dtype != torch.bfloat16:
        return f"dtype {dtype} (the kernel is bf16)"
    if hidden_size % HIDDEN_MULTIPLE:
        return f"hidden size {hidden_size} is not a multiple of {HIDDEN_MULTIPLE}"
    if intermediate_size % INTERMEDIATE_MULTIPLE:
        return f"MoE intermediate size {intermediate_size} is not a multiple of {INTERMEDIATE_MULTIPLE}"
    if top_k > MAX_TOP_K:
        return f"top_k {top_k} > {MAX_TOP_K}"
    if world_size > MAX_WORLD:
        return f"EP size {world_size} > {MAX_WORLD}"
    return None


def megakernel_unsupported_reason(
    spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False
) -> str | None:
    """None if the megakernel can serve the layer on ``device``, else a one-line reason."""
    if quantized:
        return "quantized weights (the fp8 kernel does not exist yet)"
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor}; the megakernel is built for Hopper (sm_90a)"
    why = shape_unsupported_reason(
        spec.hidden_size, spec.intermediate_size, spec.top_k, world_size, spec.dtype
    )
    if why is not None:
        return why
    try:
        import nvidia.nvshmem  # noqa: F401
    except ImportError:
        return "NVSHMEM (pip package nvidia-nvshmem-cu13) is not installed"
    from .build import find_nvcc

    if find_nvcc() is None:  # the JIT cache key holds the nvcc version: even a prebuilt kernel needs nvcc
        return "nvcc not found (set FLASHMOE_NVCC or CUDA_HOME)"
    return None


def select_backend(
    spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False
) -> BackendChoice:
    forced = env("FLASHMOE_BACKEND").strip().lower()
    if forced not in ("auto", MEGAKERNEL, REFERENCE):
        raise ValueError(f"FLASHMOE_BACKEND={forced!r}: expected auto, megakernel or reference")
    if forced == REFERENCE:
        return BackendChoice(REFERENCE, "FLASHMOE_BACKEND=reference")
    why = megakernel_unsupported_reason(spec, device, world_size, quantized)
    if why is None:
        return BackendChoice(MEGAKERNEL, "sm_90 GPU, bf16, supported shape")
    if forced == MEGAKERNEL or env_flag("FLASHMOE_STRICT"):
        raise FlashMoEUnsupported(f"flashmoe megakernel cannot serve this layer: {why}")
    return BackendChoice(REFERENCE, why)
