"""Block-fp8 MoE layers (``quant_method: fp8``, ``weight_block_size: [128, 128]``) served by flashmoe.

vLLM builds every MoE layer of an fp8 checkpoint with ``Fp8Config.get_quant_method`` ->
``Fp8MoEMethod``. ``Fp8MoEMethod`` is not a ``CustomOp`` (no out-of-tree slot as the unquantized
method has), and its constructor hands ``moe_backend`` to vLLM's fp8 oracle, which rejects
``flashmoe``. The extension point both releases we checked share (0.26.0, read in its wheel; 0.32.0,
run on CPU; 0.33.0 not checked) is the quantization-config registry: :func:`register` registers :class:`FlashMoEFp8Config` (an
``Fp8Config``) under ``fp8`` with ``register_quantization_config``. Its ``get_quant_method`` is
``Fp8Config``'s, except for an MoE layer under ``--moe-backend flashmoe`` that ``Fp8Config`` would
give a block-quantized ``Fp8MoEMethod``: that layer gets :class:`FlashMoEFp8Method` instead.

:class:`FlashMoEFp8Method` is ``Fp8MoEMethod`` with the flashmoe half of :mod:`.moe_method`:

- ``create_weights`` is vLLM's: ``w13_weight [E_local, 2I, H]`` and ``w2_weight [E_local, H, I]``
  in e4m3, ``w13_weight_scale_inv [E_local, 2I/128, H/128]`` and ``w2_weight_scale_inv
  [E_local, H/128, I/128]`` in fp32, filled by vLLM's loader (gate rows first in ``w13``);
- ``process_weights_after_loading`` changes nothing: no conversion to a kernel format, no
  re-layout, no requantisation, no parameter replaced. The four parameters are read in place by
  every call; the only new state is the FlashMoE op (and, on GPUs, the process-wide symmetric
  buffers) and the modular kernel that calls it;
- ``apply`` is vLLM's (it calls the modular kernel with the layer's weights).

A layer flashmoe cannot serve (another block size, non-bf16 activations, ...) keeps vLLM's own fp8
method and kernel, with one log line (``FLASHMOE_STRICT=1``: an error). Checkpoint formats flashmoe
does not read at all (per-tensor fp8, UE8M0 scales, MXFP4, ...) never reach this module: the engine
config falls back first (:mod:`.engine_config`).
"""

from __future__ import annotations

import functools

from flashmoe import config, metrics
from flashmoe.backend import FP8_BLOCK, FP8_BLOCK_128, WeightFormat
from flashmoe.errors import FlashMoEUnsupported
from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

from . import compat
from .log import logger
from .moe_method import FlashMoEServing

QUANT_METHOD = "fp8"  # the checkpoint quant_method (and vLLM quantization name) this config serves


class FlashMoEFp8Method(FlashMoEServing, Fp8MoEMethod):
    def __init__(self, quant_config: Fp8Config, layer):
        self._init_serving(
            layer.moe_config, functools.partial(Fp8MoEMethod.__init__, self, quant_config, layer)
        )

    def _weight_format(self) -> WeightFormat:
        return FP8_BLOCK_128

    def _scale_kwargs(self, layer) -> dict:
        return {"w13_scale_inv": layer.w13_weight_scale_inv, "w2_scale_inv": layer.w2_weight_scale_inv}

    def _vllm_kernel_name(self) -> str:
        return f"fp8 {self.fp8_backend.value}"

    def _flashmoe_quant_config(self, layer):
        # The scales as the op reads them, whatever fp8 backend vLLM's oracle chose for a fallback.
        return fp8_w8a8_moe_quant_config(
            w1_scale=layer.w13_weight_scale_inv,
            w2_scale=layer.w2_weight_scale_inv,
            block_shape=[FP8_BLOCK, FP8_BLOCK],
        )


class FlashMoEFp8Config(Fp8Config):
    """vLLM's ``Fp8Config`` (registered under ``fp8``) that routes block-fp8 MoE layers to flashmoe
    under ``--moe-backend flashmoe`` and is ``Fp8Config`` everywhere else."""

    def get_quant_method(self, layer, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod

        moe = getattr(layer, "moe_config", None)
        if not isinstance(layer, RoutedExperts) or moe is None or moe.moe_backend != compat.BACKEND_NAME:
            return super().get_quant_method(layer, prefix)
        # Fp8Config decides what this layer is (skipped, MXFP4-stored, online, per-tensor, block):
        # ask it with the name vLLM's oracle knows, and serve only what it makes an Fp8MoEMethod.
        moe.moe_backend = "auto"
        try:
            method = super().get_quant_method(layer, prefix)
        finally:
            moe.moe_backend = compat.BACKEND_NAME
        if isinstance(method, UnquantizedFusedMoEMethod):
            # Experts the checkpoint left unquantized (ignored_layers): built again now that the
            # name is back, they get the out-of-tree flashmoe method, bf16.
            return UnquantizedFusedMoEMethod(moe)
        reason = fp8_layer_unsupported_reason(method)
        if reason is None:
            # A second Fp8MoEMethod construction: the oracle's choice in it is the layer's fallback.
            return FlashMoEFp8Method(self, layer)
        if config.strict():
            raise FlashMoEUnsupported(f"{prefix}: flashmoe cannot serve this fp8 layer: {reason}")
        metrics.record_fallback(reason)
        logger.warning("flashmoe: %s keeps vLLM's %s: %s", prefix, type(method).__name__, reason)
        return method


def fp8_layer_unsupported_reason(method) -> str | None:
    """None if ``Fp8Config`` made a block-fp8 method flashmoe reads in place, else why not."""
    if type(method) is not Fp8MoEMethod:
        return f"{type(method).__name__} (not a block-fp8 Fp8MoEMethod)"
    if not method.block_quant:
        return "per-tensor fp8 weights (no weight_block_size)"
    block = list(getattr(method, "moe_block_shape", None) or method.weight_block_size)
    if block != [FP8_BLOCK, FP8_BLOCK]:
        return f"fp8 weight blocks {block} (flashmoe reads {FP8_BLOCK}x{FP8_BLOCK})"
    return None


def register() -> None:
    """Register :class:`FlashMoEFp8Config` as vLLM's ``fp8`` quantization config (idempotent)."""
    import vllm.model_executor.layers.quantization as quantization

    # The registry of plugin configs (same name in 0.26-0.33); vLLM's own table is built lazily, and
    # building it here would import every quantization backend in the API server.
    current = getattr(quantization, "_CUSTOMIZED_METHOD_TO_QUANT_CONFIG", {}).get(QUANT_METHOD)
    if current is FlashMoEFp8Config:
        return
    if current is not None:
        raise RuntimeError(
            f"flashmoe: another vLLM plugin already replaced the '{QUANT_METHOD}' quantization config "
            f"({current.__module__}.{current.__qualname__}); disable one of them with VLLM_PLUGINS"
        )
    quantization.register_quantization_config(QUANT_METHOD)(FlashMoEFp8Config)
