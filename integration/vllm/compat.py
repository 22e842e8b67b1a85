"""Every difference between the vLLM releases we support (0.26.0, 0.32.0, 0.33.0), in one place.

The rest of the adapter is written against the API the three share (plugin loading,
``CustomOp.register_oot``, ``FusedMoEKernel`` and the modular prepare/finalize/experts arguments,
``FusedMoEConfig``). Names that only exist in newer releases are feature-detected here with
``hasattr``, never by comparing version strings, so a vLLM between or after those releases keeps
working as long as it has the shared API.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

BACKEND_NAME = "flashmoe"

# vLLM's all2all default, and the one we switch to when falling back to DeepEP.
DEFAULT_ALL2ALL_BACKEND = "allgather_reducescatter"
DEEPEP_ALL2ALL_BACKEND = "deepep_high_throughput"


def ep_spans_nodes(parallel) -> bool:
    """Whether vLLM's EP group (its DP x TP ranks) crosses nodes: TP/PP over several nodes (``nnodes``), DP
    ranks beyond this node's (``data_parallel_size_local`` below ``data_parallel_size``: multi-node DP, or an
    external load balancer's one-rank servers, which may share a host), or Ray placing the DP ranks (it can
    spread them, and the config does not say where)."""
    if getattr(parallel, "nnodes", 1) > 1:
        return True
    if parallel.data_parallel_size <= 1:
        return False
    local = getattr(parallel, "data_parallel_size_local", parallel.data_parallel_size)
    return local < parallel.data_parallel_size or getattr(parallel, "data_parallel_backend", "mp") == "ray"


def accept_moe_backend_name() -> None:
    """Make ``flashmoe`` a valid ``moe_backend`` for argparse, ``KernelConfig(...)``, JSON kernel
    configs, ``EngineArgs``/``LLM(...)`` and ``SpeculativeConfig``.

    No release has a registry for backend names: the choices are the ``MoEBackend`` Literal, read by
    argparse through ``fields(cls)`` and by pydantic at class build time. We extend that Literal
    (the list differs per release) and rebuild the two pydantic dataclasses that validate it.
    Must run before any parser is built (``_compute_kwargs`` is an ``lru_cache``); the general
    plugin hook runs early enough in every entry point.
    """
    import pydantic.dataclasses
    import vllm.config.kernel as kernel_mod
    from vllm.config import KernelConfig
    from vllm.engine.arg_utils import EngineArgs

    current = kernel_mod.MoEBackend
    names = get_args(current)
    if BACKEND_NAME in names:
        return
    widened = Literal[names + (BACKEND_NAME,)]  # type: ignore[valid-type]
    kernel_mod.MoEBackend = widened
    _retype_field(KernelConfig, "moe_backend", current, widened)
    _retype_field(EngineArgs, "moe_backend", current, widened)
    pydantic.dataclasses.rebuild_dataclass(KernelConfig, force=True)

    try:
        from vllm.config import SpeculativeConfig
    except ImportError:  # pragma: no cover - every supported release has it
        return
    if _retype_field(SpeculativeConfig, "moe_backend", current, widened):
        pydantic.dataclasses.rebuild_dataclass(SpeculativeConfig, force=True)


def _retype_field(cls, name: str, old, new) -> bool:
    """Replace ``old`` by ``new`` in the annotation of dataclass field ``name`` (``X`` or ``X | None``)."""
    field = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    if field is None:
        return False
    if field.type is old or field.type == "MoEBackend":
        new_type = new
    elif old in get_args(field.type):
        new_type = new | None
    else:
        raise RuntimeError(
            f"flashmoe: cannot extend {cls.__name__}.{name} (annotation {field.type!r}); "
            "this vLLM release changed how MoE backends are declared"
        )
    field.type = new_type
    cls.__annotations__[name] = new_type
    return True


def prepare_finalize_base():
    """The modular no-DP/EP prepare/finalize base (same module and name in 0.26–0.33)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )

    return MoEPrepareAndFinalizeNoDPEPModular


def ensure_moe_workspace(device) -> None:
    """vLLM 0.26's modular kernel takes the experts' output buffer from the worker's
    ``WorkspaceManager`` on every platform, but only the GPU/XPU workers create one; 0.32+ bypasses
    it on CPU. On a CPU worker without one, create it (GPU workers make theirs before loading)."""
    if getattr(device, "type", str(device)) != "cpu":
        return
    try:
        from vllm.v1.worker import workspace
    except ImportError:  # pragma: no cover - every supported release has it
        return
    if (
        hasattr(workspace, "is_workspace_manager_initialized")
        and not workspace.is_workspace_manager_initialized()
    ):
        workspace.init_workspace_manager(device)


def current_device_capability() -> tuple[int, int] | None:
    """(major, minor) of the local GPU through vLLM's platform (NVML on CUDA: no CUDA context is
    created in the API-server process, which vLLM relies on before forking workers)."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    if cap is None:
        return None
    return int(cap.major), int(cap.minor)


def platform_kind() -> str:
    """'cuda', 'cpu' or the platform's device type (rocm, xpu, tpu, ...)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return str(getattr(current_platform, "device_type", "unknown"))
