"""SGLang adapter: ``--moe-runner-backend flashmoe`` runs each MoE layer as one flashmoe call.

SGLang's plugin loader (entry point group ``sglang.srt.plugins``) calls :func:`register` in the
launcher and in every scheduler process. It adds the runner name, wraps the ``handle_a2a_moe``
resolution step (flashmoe -> ``moe_a2a_backend=customized``, ``ep_size=tp_size``; :mod:`.resolution`)
and registers the runtime hooks listed in :mod:`.hooks` (their functions: :mod:`.runtime`). SGLang only logs a plugin's exceptions, so every
misconfiguration is raised later, from the resolution step, where it stops the launch.

Importing this package imports neither SGLang nor ``prometheus_client``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# First release with resolution hooks + runner-core registry + a2a "customized" dispatch.
MIN_SGLANG = (0, 5, 23)


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def unsupported_version_reason(found: str) -> str | None:
    """None if ``found`` has the extension points flashmoe needs, else why not."""
    try:
        parts = tuple(int(p) for p in found.split("+")[0].split(".")[:3])
    except ValueError:
        return None  # a dev build: trust the extension-point checks instead of the number
    if parts < MIN_SGLANG:
        need = ".".join(map(str, MIN_SGLANG))
        return (
            f"SGLang {found} is older than {need}: it has no resolution hooks and no MoE runner-core registry "
            f"(flashmoe needs SGLang >= {need})"
        )
    return None


def register() -> None:
    """Entry point ``sglang.srt.plugins: flashmoe``."""
    found = sglang_version()
    why = unsupported_version_reason(found)
    if why is not None:
        # Without the choice registered, '--moe-runner-backend flashmoe' gets SGLang's own
        # "invalid choice" error; this line says why.
        logger.error("flashmoe is not registered with SGLang: %s", why)
        return
    install()


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
    from .hooks import RESOLUTION_STEP, RUNNER_NAME, RUNTIME_HOOKS

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
        "process_weights_after_loading": runtime.fp8_process_weights_hook,
    }
    for target, hook_type in RUNTIME_HOOKS.items():
        HookRegistry.register(target, hook_fns[target.rsplit(".", 1)[1]], HookType[hook_type])
    _installed = True


__all__ = ["register", "install", "MIN_SGLANG"]
