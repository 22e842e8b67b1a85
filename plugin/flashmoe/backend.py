"""Which implementation serves a layer, and why.

Every "can the megakernel run this?" check lives here. ``select_backend`` answers it for one layer on
one device; :func:`megakernel_unsupported_reason_for` answers it from a model config and a compute
capability alone, which is what engine adapters call at config time (no CUDA context). Adapters map
a refusal to their own fallback (vLLM's DeepEP or default path, SGLang's deepep; :func:`deep_ep_importable`),
log one line with the reason, and honour ``FLASHMOE_STRICT``.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from . import config
from .errors import FlashMoEUnsupported
from .spec import MoELayerSpec

logger = logging.getLogger("flashmoe")

MEGAKERNEL = "megakernel"
REFERENCE = "reference"

# Tile constraints of the v1 kernel (csrc/flashmoe/gemm.cuh): K and N are walked in 64/128-wide tiles.
HIDDEN_MULTIPLE = 128
INTERMEDIATE_MULTIPLE = 64
MAX_TOP_K = 16
MAX_WORLD = 64

# The one compute capability the megakernel is built for (flashmoe.build.RUNNABLE_ARCH is its arch).
HOPPER = (9, 0)


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


def megakernel_unsupported_reason_for(
    capability: tuple[int, int],
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    world_size: int,
    dtype: torch.dtype | None = torch.bfloat16,
    quantization: str | None = None,
) -> str | None:
    """None if the megakernel can serve a layer of this shape on a GPU of ``capability``, else a one-line
    reason. Needs no CUDA context: engines call it at config time with the capability their platform reports."""
    if capability != HOPPER:
        return f"GPU is sm_{capability[0]}{capability[1]}; the megakernel is built for Hopper (sm_90a)"
    if quantization is not None:
        return f"{quantization} weights (the megakernel runs bf16 weights; there is no fp8 kernel yet)"
    why = shape_unsupported_reason(hidden_size, intermediate_size, top_k, world_size, dtype)
    if why is not None:
        return why
    if not _module_exists("nvidia.nvshmem"):
        return "NVSHMEM (pip package nvidia-nvshmem-cu13) is not installed"
    from .build.toolchain import find_nvcc

    if find_nvcc() is None:  # the JIT cache key holds the nvcc version: even a prebuilt kernel needs nvcc
        return "nvcc not found (set FLASHMOE_NVCC or CUDA_HOME)"
    return None


def megakernel_unsupported_reason(
    spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False
) -> str | None:
    """None if the megakernel can serve the layer on ``device``, else a one-line reason."""
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
        "quantized" if quantized else None,
    )


def select_backend(
    spec: MoELayerSpec, device: torch.device, world_size: int, quantized: bool = False
) -> BackendChoice:
    forced = config.backend()
    if forced == REFERENCE:
        return BackendChoice(REFERENCE, "FLASHMOE_BACKEND=reference")
    why = megakernel_unsupported_reason(spec, device, world_size, quantized)
    if why is None:
        return BackendChoice(MEGAKERNEL, "sm_90 GPU, bf16, supported shape")
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


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a missing parent package
        return False
