"""flashmoe as a vLLM modular MoE kernel: ``FusedMoEKernel(FlashMoEPrepareFinalize, FlashMoEExperts)``.

The megakernel does dispatch, both expert GEMMs and the combine itself, so the prepare/finalize
half is a pass-through that tells vLLM the output is already reduced across the EP group (vLLM
then skips its naive dispatch/combine and the final all-reduce), and the experts half hands the
router's ``(topk_ids, topk_weights)`` and the layer's weights (and, for block-fp8 layers, their
``*_weight_scale_inv``) to :class:`flashmoe.FlashMoE`, with the hidden states unquantized: the op
quantises them itself.
Routing stays in vLLM; ``--all2all-backend`` stays at its default and allocates nothing.
Under TP+EP (tokens replicated over the EP group) the experts half runs FlashMoE on the rank's slice
of the tokens and all-gathers the combined slices (:mod:`.token_slicing`). A DP rank's dummy steps send
no tokens to the experts (:mod:`.padding`).
"""

from __future__ import annotations

import functools

import torch
from flashmoe import FlashMoE
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from . import compat
from .padding import padding_marker
from .token_slicing import TP_SLICED, sliced_forward


class FlashMoEPrepareFinalize(compat.prepare_finalize_base()):
    """No-op dispatch/combine: ``prepare`` hands the tokens through unquantized, ``finalize`` copies
    only if vLLM did not alias the experts' output to its own buffer."""

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int32  # the kernel's id type; vLLM's routers emit it directly

    def output_is_reduced(self) -> bool:
        return True

    def supports_deferred_moe_finalize(self) -> bool:  # 0.32+
        return False  # the combine already summed over top-k: nothing is left for a consumer

    def supports_dbo(self) -> bool:  # 0.33+
        return False


class FlashMoEExperts(mk.FusedMoEExpertsModular):
    """Runs one layer's :class:`flashmoe.FlashMoE` (megakernel on Hopper, reference elsewhere)."""

    def __init__(
        self,
        moe_config,
        quant_config,
        flashmoe: FlashMoE,
        token_mode: str,
        ep_group=None,
        scales: dict[str, torch.Tensor] | None = None,
        padding_markers: bool = False,
    ):
        """``token_mode``: :data:`.token_slicing.TP_SLICED` or ``FULL``; ``ep_group``: vLLM's EP
        ``GroupCoordinator`` (needed for the all-gather in tp-sliced mode); ``scales``: the
        ``w13_scale_inv``/``w2_scale_inv`` keyword arguments of every call (block-fp8 layers: the
        layer's ``*_weight_scale_inv`` parameters, read in place); ``padding_markers``: pass vLLM's slot
        mapping as the call's padding marker (:func:`.padding.markers_usable`)."""
        super().__init__(moe_config, quant_config)
        self.flashmoe = flashmoe
        self.scales = dict(scales or {})
        self.token_mode = token_mode
        if token_mode == TP_SLICED and (ep_group is None or ep_group.world_size != flashmoe.world_size):
            raise ValueError("tp-sliced token mode needs the EP group FlashMoE runs over")
        self.ep_group = ep_group
        self.padding_markers = padding_markers

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # the megakernel/reference choice is FlashMoE's, made per layer

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym,
            kFp8Static128BlockSym,
        )

        # bf16, or block-fp8 weights with per-token-group activations (quantised inside the op).
        return (weight_key, activation_key) in ((None, None), (kFp8Static128BlockSym, kFp8Dynamic128Sym))

    @property
    def expects_unquantized_inputs(self) -> bool:
        # The op takes bf16 hidden states and quantises them itself (once per token, in dispatch):
        # the prepare step must not quantise them for an fp8 quant config.
        return True

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True  # EP layouts are validated when the engine config is built

    def workspace_shapes(
        self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation
    ):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta,
        apply_router_weight_on_input: bool,
    ) -> None:
        # topk_ids are global (physical) expert ids; the placement inside FlashMoE maps them to
        # (rank, local slot), so vLLM's expert_map is not needed here.
        topk_ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        topk_weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        kwargs = dict(self.scales)
        marker = padding_marker(hidden_states.shape[0]) if self.padding_markers else None
        if marker is not None:
            kwargs["padding_marker"] = marker
        moe = functools.partial(self.flashmoe, **kwargs) if kwargs else self.flashmoe
        if self.token_mode == TP_SLICED:
            sliced_forward(
                moe,
                hidden_states,
                topk_ids,
                topk_weights,
                w1,
                w2,
                output,
                self.flashmoe.rank,
                self.flashmoe.world_size,
                self._all_gather_rows,
            )
        else:
            moe(hidden_states, topk_ids, topk_weights, w1, w2, out=output)
        return None

    def _all_gather_rows(self, part: torch.Tensor) -> torch.Tensor:
        # vLLM's coordinator: a registered op on CUDA (graph-capturable), shared memory/gloo on CPU.
        return self.ep_group.all_gather(part, dim=0)
