"""The MoE methods that vLLM instantiates when the plugin is loaded.

:class:`FlashMoEUnquantizedMethod` is registered out-of-tree under ``UnquantizedFusedMoEMethod``
(vLLM looks OOT classes up by the in-tree class name), so every unquantized MoE layer is built
through it, whatever the ``--moe-backend``. Block-fp8 layers get :class:`.fp8_method.FlashMoEFp8Method`
the same way through the registered ``fp8`` quantization config. Without ``--moe-backend flashmoe``
either is exactly vLLM's method. With it (:class:`FlashMoEServing`, shared by both):

- ``__init__`` lets vLLM's oracle pick its own kernel as if ``moe_backend`` were ``auto`` (that is
  the per-layer fallback, and no oracle ever sees the name ``flashmoe``);
- ``process_weights_after_loading`` leaves the weights in vLLM's layout (``w13 [E_local, 2I, H]``
  gate rows first, ``w2 [E_local, H, I]``, and for fp8 their ``*_weight_scale_inv``), gathers the
  EP placement, and builds the layer's :class:`flashmoe.FlashMoE`. That happens while vLLM loads
  the model, before it profiles memory and captures CUDA graphs, so the process-wide symmetric
  buffers are counted against the KV cache and exist at fixed addresses when graphs are captured.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from flashmoe import ExpertPlacement, FlashMoE, MoELayerSpec, config, metrics
from flashmoe.backend import REFERENCE, UNQUANTIZED, WeightFormat
from flashmoe.errors import FlashMoEError, FlashMoEUnsupported
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from . import compat
from .kernel import FlashMoEExperts, FlashMoEPrepareFinalize
from .log import logger
from .padding import markers_usable
from .token_slicing import TP_SLICED, sliced_max_tokens, token_mode

# One log line per distinct (backend, reason, shape) per process, not one per layer.
_logged_layer_types: set[tuple] = set()


class FlashMoEServing:
    """The flashmoe half of a vLLM MoE method; mixed in before the vLLM method it extends.

    Subclasses call :meth:`_init_serving` from ``__init__`` and say what their weights are
    (:meth:`_weight_format`, :meth:`_scale_kwargs`) and which vLLM kernel a fallback uses
    (:meth:`_vllm_kernel_name`). A layer that flashmoe cannot serve falls back, alone, to what vLLM
    chose under ``auto`` (one log line per reason; ``FLASHMOE_STRICT=1`` makes it an error)."""

    def _init_serving(self, moe, init_vllm_method) -> None:
        self.serves_flashmoe = moe.moe_backend == compat.BACKEND_NAME
        self.flashmoe: FlashMoE | None = None
        self.fallback_reason: str | None = None
        if not self.serves_flashmoe:
            init_vllm_method()
            return
        # vLLM's oracle rejects unknown names; let it choose what it would under "auto" (used if
        # this layer falls back), then put the name back for anything reading the config later.
        moe.moe_backend = "auto"
        try:
            init_vllm_method()
        finally:
            moe.moe_backend = compat.BACKEND_NAME

    def _weight_format(self) -> WeightFormat:
        return UNQUANTIZED

    def _scale_kwargs(self, layer) -> dict[str, torch.Tensor]:
        """The extra tensors each FlashMoE call takes (fp8: the block scales)."""
        return {}

    def _vllm_kernel_name(self) -> str:
        raise NotImplementedError

    def _flashmoe_quant_config(self, layer):
        return self.get_fused_moe_quant_config(layer)

    @property
    def is_monolithic(self) -> bool:
        # vLLM 0.26 forces its CPU MoE onto the monolithic path; ours is always modular.
        if self.serves_flashmoe and self.fallback_reason is None:
            return False
        return super().is_monolithic

    @property
    def supports_eplb(self) -> bool:
        # The placement is fixed when the layer is built (the engine config refuses EPLB earlier,
        # with a message; this keeps RoutedExperts' own check consistent).
        return not self.serves_flashmoe and super().supports_eplb

    def process_weights_after_loading(self, layer) -> None:
        if not self.serves_flashmoe or self.fallback_reason is not None:
            return super().process_weights_after_loading(layer)
        if self.moe_kernel is not None:
            # A weight reload: loaders copied into the same parameters, which FlashMoE reads on
            # every call, and CUDA graphs hold those addresses. Nothing to rebuild.
            return
        if not self._serve_with_flashmoe(layer):
            super().process_weights_after_loading(layer)

    def _serve_with_flashmoe(self, layer) -> bool:
        """Build the layer's FlashMoE and modular kernel; False (logged) if the layer falls back."""
        weights = self._weight_format()
        reason = unsupported_layer_reason(layer, self.moe, weights)
        mode, mode_why = token_mode(self.moe.moe_parallel_config)
        if reason is None:
            try:
                self.flashmoe = build_flashmoe(layer, self.moe, mode, weights)
            except FlashMoEUnsupported:
                raise  # FLASHMOE_STRICT / FLASHMOE_BACKEND=megakernel: the user asked for an error
            except FlashMoEError as e:  # JIT build or NVSHMEM init failed on this worker
                if config.strict():
                    raise
                reason = f"{type(e).__name__}: {e}"
            else:
                if self.flashmoe.backend == REFERENCE and _megakernel_expected(self.flashmoe.device):
                    reason = self.flashmoe.reason
        elif config.strict():
            raise FlashMoEUnsupported(f"{layer.layer_name}: flashmoe cannot serve this layer: {reason}")

        if reason is not None:
            self.fallback_reason = reason
            self.flashmoe = None
            metrics.record_fallback(reason)
            _log_once(
                ("fallback", reason),
                "flashmoe: %s falls back to vLLM's %s kernel: %s",
                layer.layer_name,
                self._vllm_kernel_name(),
                reason,
            )
            return False

        compat.ensure_moe_workspace(layer.w13_weight.device)
        self.moe_quant_config = self._flashmoe_quant_config(layer)
        from vllm.distributed import get_ep_group

        markers, markers_why = markers_usable()

        self.moe_kernel = mk.FusedMoEKernel(
            FlashMoEPrepareFinalize(),
            FlashMoEExperts(
                self.moe,
                self.moe_quant_config,
                self.flashmoe,
                mode,
                get_ep_group() if mode == TP_SLICED else None,
                self._scale_kwargs(layer),
                padding_markers=markers,
            ),
        )
        _log_layer(self.flashmoe)
        _log_once(
            ("token_mode", mode, mode_why), "flashmoe: MoE layers run in token mode %s (%s)", mode, mode_why
        )
        _log_once(("padding", markers_why), "flashmoe: padding steps: %s", markers_why)
        return True


class FlashMoEUnquantizedMethod(FlashMoEServing, UnquantizedFusedMoEMethod):
    def __init__(self, moe):
        self._init_serving(moe, functools.partial(UnquantizedFusedMoEMethod.__init__, self, moe))

    def _vllm_kernel_name(self) -> str:
        return self.unquantized_backend.value


def unsupported_layer_reason(layer, moe, weights: WeightFormat = UNQUANTIZED) -> str | None:
    """What in this layer's definition the flashmoe op does not compute (None if it does)."""
    if weights.weight_dtype is not None and moe.in_dtype != torch.bfloat16:
        return f"{str(moe.in_dtype).removeprefix('torch.')} activations (block-fp8 experts take bf16 activations)"
    if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
        return f"activation {moe.activation.value} (flashmoe computes SwiGLU: silu(gate) * up)"
    if moe.has_bias:
        return "expert biases"
    if layer.apply_router_weight_on_input:
        return "router weights applied on the input"
    if getattr(moe, "is_lora_enabled", False):
        return "LoRA on experts"
    if getattr(layer, "swiglu_limit", None) is not None or getattr(layer, "swiglu_alpha", None) is not None:
        return "clamped/scaled SwiGLU parameters"
    return None


def build_flashmoe(layer, moe, mode: str, weights: WeightFormat = UNQUANTIZED) -> FlashMoE:
    """The layer's FlashMoE over vLLM's EP group, sized from vLLM's configs (in tp-sliced token
    mode a rank dispatches at most ceil(max_num_tokens / W) tokens, so the buffers shrink too)."""
    from vllm.distributed import get_ep_group

    ep = get_ep_group()
    w13, w2 = layer.w13_weight, layer.w2_weight
    placement = gather_placement(layer.expert_map, layer.global_num_experts, ep.cpu_group, ep.world_size)
    max_tokens = moe.max_num_tokens
    if mode == TP_SLICED:
        max_tokens = sliced_max_tokens(max_tokens, ep.world_size)
    spec = MoELayerSpec(
        num_experts=layer.global_num_experts,
        top_k=moe.experts_per_token,
        hidden_size=w13.shape[2],  # the weights' (possibly padded) sizes are what the kernel reads
        intermediate_size=w2.shape[2],
        max_tokens_per_rank=max_tokens,  # FlashMoE applies FLASHMOE_MAX_TOKENS
        # fp8 weights: the activations are the model's dtype (bf16), the weights e4m3.
        dtype=moe.in_dtype if weights.weight_dtype is not None else w13.dtype,
        weight_dtype=weights.weight_dtype,
    )
    return FlashMoE(
        spec,
        placement,
        ep.device_group,
        cpu_group=ep.cpu_group,
        layer_name=layer.layer_name,
        device=w13.device,
    )


def gather_placement(
    expert_map: torch.Tensor | None, num_experts: int, cpu_group, world_size: int
) -> ExpertPlacement:
    """Every EP rank's ``expert_map`` (global id -> local slot, -1 elsewhere), all-gathered over
    the gloo group: whatever ``--expert-placement-strategy`` vLLM used, this is what it loaded."""
    if world_size == 1:
        if expert_map is not None and bool((expert_map < 0).any()):
            raise ValueError("EP world of 1 but the expert map leaves experts unowned")
        return ExpertPlacement.contiguous(num_experts, 1)
    if expert_map is None:
        raise ValueError(f"EP world of {world_size} ranks but the layer has no expert_map")
    local = expert_map.detach().to("cpu", torch.int32).contiguous()
    maps = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(maps, local, group=cpu_group)
    return ExpertPlacement.from_expert_maps(maps)


def _megakernel_expected(device: torch.device) -> bool:
    """On CUDA the reference is a fallback unless the user forced it; on CPU it is the backend."""
    return device.type == "cuda" and config.backend() != REFERENCE


def _log_layer(moe: FlashMoE) -> None:
    s = moe.spec
    key = (
        moe.backend,
        moe.reason,
        s.weight_dtype,
        s.num_experts,
        s.top_k,
        s.hidden_size,
        s.intermediate_size,
        s.max_tokens_per_rank,
    )
    owned = moe.placement.local_experts(moe.rank).tolist()
    _log_once(
        key,
        "flashmoe: MoE layers E=%d top_k=%d H=%d I=%d %s -> backend %s (%s); EP rank %d/%d owns %d experts %s; "
        "max %d tokens/rank%s",
        s.num_experts,
        s.top_k,
        s.hidden_size,
        s.intermediate_size,
        str(s.dtype).removeprefix("torch.") + (" block-fp8 weights" if s.fp8_weights else ""),
        moe.backend,
        moe.reason,
        moe.rank,
        moe.world_size,
        len(owned),
        _ranges(owned),
        s.max_tokens_per_rank,
        _buffers_note(getattr(moe, "buffer_bytes", None)),
    )


def _buffers_note(buffer_bytes: int | None) -> str:
    """The log line's account of the megakernel's process-wide buffers ('' on the reference backend).
    They are allocated while vLLM loads the model, before it profiles memory, so vLLM's memory report
    counts them (the NVSHMEM heap as non-torch memory) and its KV-cache budget excludes them."""
    if buffer_bytes is None:
        return ""
    return (
        f"; symmetric buffers {buffer_bytes} bytes ({buffer_bytes / 2**30:.2f} GiB, NVSHMEM heap + workspace, "
        "shared by all layers), allocated before vLLM profiles memory: its KV-cache budget excludes them"
    )


def _log_once(key: tuple, msg: str, *args) -> None:
    if key in _logged_layer_types:
        return
    _logged_layer_types.add(key)
    logger.info(msg, *args)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '[0-2, 5]'."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}-{e}" if e != start else f"{e}")
            start = None
    return "[" + ", ".join(out) + "]"
