"""Every SGLang extension point flashmoe uses, and the one function that installs them.

Keeping the targets here (and nowhere else) means one unit test proves each still resolves in the
installed SGLang, and a release that moves one fails that test instead of a server at startup.
All targets were read from SGLang 0.5.23.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

RUNNER_NAME = "flashmoe"  # --moe-runner-backend value
A2A_BACKEND = "customized"  # SGLang's a2a value for a backend that brings its own all-to-all
RESOLUTION_STEP = "handle_a2a_moe"  # the server-argument resolution step flashmoe wraps

# HookRegistry targets (dotted paths) -> hook type; the hook functions live in runtime.py.
RUNTIME_HOOKS: dict[str, str] = {
    # The pass-through dispatcher: the kernel moves tokens, SGLang must not remap ids to local.
    "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher": "AROUND",
    # The combined output is complete: no post-experts all-reduce over TP/EP.
    "sglang.srt.layers.moe.utils.post_experts_output_is_complete": "AROUND",
    # The fused call: one kernel launch per MoE layer instead of the quant method's runner.
    "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core": "AROUND",
    # Weights and buffers prepared after load, before KV sizing and CUDA-graph capture.
    "sglang.srt.model_executor.model_runner.ModelRunner.load_model": "AFTER",
}

# Plain (non-HookRegistry) extension points, resolved by name for the same unit test.
EXTENSION_POINTS: tuple[str, ...] = (
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.server_args.add_moe_runner_backend_choices",
    "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
    "sglang.srt.arg_groups.overrides.declare_resolution",
    "sglang.srt.arg_groups.model_override_base.resolving_view",
    "sglang.srt.arg_groups.model_override_base.model_config_of",
    "sglang.srt.arg_groups.moe_hook.handle_a2a_moe",
    "sglang.srt.layers.moe.moe_runner.runner.register_moe_runner_core",
    "sglang.srt.layers.moe.moe_runner.base.DispatchMoeRunnerCore",
    "sglang.srt.layers.moe.token_dispatcher.base.BaseDispatcher",
    "sglang.srt.layers.moe.token_dispatcher.standard.StandardDispatchOutput",
    "sglang.srt.layers.moe.token_dispatcher.standard.StandardCombineInput",
    "sglang.srt.layers.moe.utils.get_moe_a2a_backend",
    "sglang.srt.layers.moe.utils.get_moe_runner_backend",
    "sglang.srt.layers.moe.utils.MoeA2ABackend.CUSTOMIZED",
    "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod",
    "sglang.srt.runtime_context.get_parallel",
    "sglang.srt.runtime_context.cutedsl_moe_max_num_tokens",
)

_installed = False


def install() -> None:
    """Register flashmoe with SGLang (idempotent). Called by the ``sglang.srt.plugins`` entry point,
    before ``HookRegistry.apply_hooks()``, in the launcher and in every scheduler process."""
    global _installed
    if _installed:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.moe.moe_runner.runner import (
        _CUSTOM_RUNNER_CORE_FACTORIES,
        register_moe_runner_core,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices

    from . import resolution, runtime

    if RUNNER_NAME not in MOE_RUNNER_BACKEND_CHOICES:
        add_moe_runner_backend_choices([RUNNER_NAME])
    register_resolution_hook(RESOLUTION_STEP)(resolution.resolve_flashmoe)
    # register_moe_runner_core raises on a second registration (e.g. a re-imported plugin).
    if RUNNER_NAME not in _CUSTOM_RUNNER_CORE_FACTORIES:
        register_moe_runner_core(RUNNER_NAME, runtime.FlashMoERunnerCore)
    hook_fns = {
        "create_moe_dispatcher": runtime.create_moe_dispatcher_hook,
        "post_experts_output_is_complete": runtime.output_is_complete_hook,
        "run_moe_core": runtime.run_moe_core_hook,
        "load_model": runtime.load_model_hook,
    }
    for target, hook_type in RUNTIME_HOOKS.items():
        HookRegistry.register(target, hook_fns[target.rsplit(".", 1)[1]], HookType[hook_type])
    _installed = True


def runtime_hooks_applied() -> list[str]:
    """The runtime hook targets HookRegistry has patched (apply_hooks only logs its failures)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in RUNTIME_HOOKS if t in HookRegistry._patched]
