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


def megakernel_unsupported_reason(spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False) -> str | None:
    """None if the megakernel can serve the layer, else a one-line reason."""
    if quantized:
        return "quantized weights (the fp8 kernel does not exist yet)"
    if device.type != "cuda":
        return f"device is {device.type}, not cuda"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor}; the megakernel is built for Hopper (sm_90a)"
    if spec.dtype != torch.bfloat16:
        return f"dtype {spec.dtype} (the kernel is bf16)"
    if spec.hidden_size % HIDDEN_MULTIPLE:
        return f"hidden size {spec.hidden_size} is not a multiple of {HIDDEN_MULTIPLE}"
    if spec.intermediate_size % INTERMEDIATE_MULTIPLE:
        return f"intermediate size {spec.intermediate_size} is not a multiple of {INTERMEDIATE_MULTIPLE}"
    if spec.top_k > MAX_TOP_K:
        return f"top_k {spec.top_k} > {MAX_TOP_K}"
    if world_size > MAX_WORLD:
        return f"EP size {world_size} > {MAX_WORLD}"
    try:
        import nvidia.nvshmem  # noqa: F401
    except ImportError:
        return "NVSHMEM (pip package nvidia-nvshmem-cu13) is not installed"
    from .jit import find_nvcc

    if find_nvcc() is None and not _prebuilt_available():
        return "nvcc not found (set FLASHMOE_NVCC or CUDA_HOME) and no prebuilt kernel in the cache"
    return None


def _prebuilt_available() -> bool:
    from .jit import cache_has_any_build

    return cache_has_any_build()


def select_backend(spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False) -> BackendChoice:
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
