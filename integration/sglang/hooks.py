"""Every SGLang extension point flashmoe uses, and the names flashmoe registers under.

Keeping the targets here (and nowhere else) means one unit test proves each still resolves in the
installed SGLang, and a release that moves one fails that test instead of a server at startup.
All targets were read from SGLang 0.5.23. This module imports nothing from the adapter: resolution
and runtime read it, and the package's ``install()`` wires the three together.
"""

from __future__ import annotations

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
    # Block-fp8 experts are read in place: no platform re-layout of the loaded weights (the CPU
    # path repacks them for AMX, the CUDA path is already a no-op for non-DeepGEMM runners).
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod.process_weights_after_loading": "AROUND",
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
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod",
    "sglang.srt.runtime_context.get_parallel",
    "sglang.srt.runtime_context.cutedsl_moe_max_num_tokens",
)


def runtime_hooks_applied() -> list[str]:
    """The runtime hook targets HookRegistry has patched (apply_hooks only logs its failures)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in RUNTIME_HOOKS if t in HookRegistry._patched]
