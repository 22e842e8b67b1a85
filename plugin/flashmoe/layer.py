"""The op every engine adapter and benchmark calls: one MoE layer forward over an EP group.

    moe = FlashMoE(spec, placement, group)          # once per layer, after weights are loaded
    out = moe(hidden_states, topk_ids, topk_weights, w13, w2)

On an sm_90 GPU with a supported shape it launches the megakernel (one launch per call; buffers are
the process-wide symmetric ones from :mod:`flashmoe.buffers`); otherwise it runs the distributed
PyTorch reference (:func:`flashmoe.reference.moe_reference_distributed`), which is also the CPU
backend inside vLLM and SGLang. ``backend`` and ``reason`` say which and why.

Block-fp8 experts (``spec.weight_dtype == torch.float8_e4m3fn``) take their scales with every call::

    out = moe(hidden_states, topk_ids, topk_weights, w13, w2, w13_scale_inv=s13, w2_scale_inv=s2)

(the contract: :mod:`flashmoe.validation`; the semantics, which the CPU backend runs:
:mod:`flashmoe.reference_fp8`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from . import config, metrics, validation
from .backend import MEGAKERNEL, REFERENCE, select_backend, spec_weight_format, unsupported_weights
from .placement import ExpertPlacement
from .reference import _reference_distributed_impl, _reference_impl
from .reference_fp8 import _reference_distributed_fp8_impl, _reference_fp8_impl
from .spec import MoELayerSpec

logger = logging.getLogger("flashmoe")


class FlashMoE:
    def __init__(
        self,
        spec: MoELayerSpec,
        placement: ExpertPlacement,
        group=None,
        *,
        cpu_group=None,
        layer_name: str = "",
        device: torch.device | None = None,
        quantized: bool = False,
    ):
        """``group``: the EP process group (NCCL on GPU, gloo on CPU; None = WORLD when initialised).
        ``cpu_group``: a gloo group over the same ranks for NVSHMEM's bootstrap (defaults to ``group``).
        ``spec.max_tokens_per_rank`` is replaced by FLASHMOE_MAX_TOKENS when that is set.
        ``quantized``: the engine's weights are quantized in a format other than ``spec.weight_dtype``
        says (the megakernel then refuses the layer); block-fp8 is described by the spec, not by this."""
        import torch.distributed as dist

        spec = dataclasses.replace(
            spec, max_tokens_per_rank=config.max_tokens_per_rank(spec.max_tokens_per_rank)
        )
        self.spec = spec
        self.placement = placement
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.layer_name = layer_name
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        validation.check_layer(spec, placement, self.world_size)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        if (
            device.type == "cuda" and device.index is None
        ):  # compared with the tensors' devices, which carry one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        weights = spec_weight_format(spec)
        if quantized and not spec.fp8_weights:
            weights = unsupported_weights("quantized weights in a format the layer spec does not describe")
        choice = select_backend(spec, device, self.world_size, weights)
        self.backend, self.reason = choice.name, choice.reason
        self.layer_id = metrics.register_layer(
            layer_name or f"layer{id(self):x}", self.backend, ep_rank=self.rank
        )
        self._kernel = None
        if self.backend == MEGAKERNEL:
            from .megakernel import MegaKernelLayer

            self._kernel = MegaKernelLayer(
                spec, placement, self.rank, self.world_size, self.group, self.cpu_group, device, self.layer_id
            )
            # After every megakernel layer: an earlier layer's buffers may have just been grown (replaced).
            buf = self._kernel.buffers
            metrics.attach_device_source(buf.metrics_ring, buf.metrics_totals)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """``layer(...)`` is ``layer.forward(...)`` (same parameters), looked up at call time as torch modules do,
        so a wrapped or patched ``forward`` is what a call runs."""
        return self.forward(*args, **kwargs)

    def forward(
        self,
        hidden_states,
        topk_ids,
        topk_weights,
        w13,
        w2,
        out: torch.Tensor | None = None,
        *,
        w13_scale_inv: torch.Tensor | None = None,
        w2_scale_inv: torch.Tensor | None = None,
        padding_marker: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out`` (optional, [T, H], input dtype, same device): written in full and returned.
        ``w13_scale_inv``/``w2_scale_inv``: the block scales, required exactly when the spec's weights
        are block-fp8. ``padding_marker`` (optional, int64 [>=1], same device): a negative first entry
        makes the whole call an engine's padding step (a DP rank's dummy batch): this rank sends no
        tokens to the experts and gets zeros back, but still serves the other ranks' tokens. Read on the
        device by the megakernel (graph-safe); see :mod:`flashmoe.validation`."""
        self._check_scales_given(w13_scale_inv, w2_scale_inv)
        on_gpu = self._kernel is not None
        # One set of checks for both backends; the GPU path skips only the id range (it would need a sync).
        validation.check_call(
            hidden_states,
            topk_ids,
            topk_weights,
            w13,
            w2,
            self.placement,
            self.rank,
            spec=self.spec,
            out=out,
            check_ids=not on_gpu,
            device=self.device if on_gpu else None,
            contiguous=on_gpu,
            w13_scale_inv=w13_scale_inv,
            w2_scale_inv=w2_scale_inv,
            padding_marker=padding_marker,
        )
        if on_gpu:
            return self._kernel.forward(
                hidden_states,
                topk_ids,
                topk_weights,
                w13,
                w2,
                out,
                w13_scale_inv=w13_scale_inv,
                w2_scale_inv=w2_scale_inv,
                padding_marker=padding_marker,
            )
        tokens_in = hidden_states.shape[0]
        if padding_marker is not None:
            # The megakernel's rule: no slot routed, so zeros out; the collectives still run. A mask on the
            # device (no host read of the marker: the reference may run on a GPU, under graph capture).
            topk_ids = topk_ids.masked_fill(padding_marker[0] < 0, -1)
            if not padding_marker.is_cuda and int(padding_marker[0]) < 0:
                tokens_in = 0
        t0 = time.perf_counter()
        # The reference implementations without their own input checks: check_call above made them.
        if self.spec.fp8_weights:
            args = (
                hidden_states,
                topk_ids,
                topk_weights,
                w13,
                w13_scale_inv,
                w2,
                w2_scale_inv,
                self.placement,
            )
            if self.world_size == 1:
                result = _reference_fp8_impl(*args)
            else:
                result = _reference_distributed_fp8_impl(*args, self.group)
        else:
            args = (hidden_states, topk_ids, topk_weights, w13, w2, self.placement)
            if self.world_size == 1:
                result = _reference_impl(*args, torch.float32, hidden_states.dtype)
            else:
                result = _reference_distributed_impl(*args, self.group)
        metrics.record_host_call(self.layer_id, time.perf_counter() - t0, tokens_in)
        if out is not None:
            out.copy_(result)
            return out
        return result

    def _check_scales_given(self, w13_scale_inv, w2_scale_inv) -> None:
        given = [
            n for n, t in (("w13_scale_inv", w13_scale_inv), ("w2_scale_inv", w2_scale_inv)) if t is not None
        ]
        if self.spec.fp8_weights:
            missing = [n for n in ("w13_scale_inv", "w2_scale_inv") if n not in given]
            if missing:
                raise ValueError(
                    f"{' and '.join(missing)} required: this layer's weights are block-fp8 "
                    f"(spec.weight_dtype={self.spec.weight_dtype})"
                )
        elif given:
            raise ValueError(
                f"{' and '.join(given)} given, but this layer's weights are {self.spec.dtype} "
                "(spec.weight_dtype is None): scales belong to block-fp8 layers only"
            )

    @property
    def buffer_bytes(self) -> int | None:
        """Bytes of the process-wide buffers this layer uses (symmetric heap + local workspace; shared
        by every layer of the process), None on the reference backend."""
        if self._kernel is None:
            return None
        buf = self._kernel.buffers
        return buf.sym_bytes + buf.workspace_bytes

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"FlashMoE({self.layer_name or '?'}: backend={self.backend} ({self.reason}), EP {self.rank}/{self.world_size}, "
            f"E={s.num_experts} k={s.top_k} H={s.hidden_size} I={s.intermediate_size} max_tokens={s.max_tokens_per_rank}"
            f"{' weights=block-fp8' if s.fp8_weights else ''})"
        )


__all__ = ["FlashMoE", "MEGAKERNEL", "REFERENCE"]
