"""Which MoE calls are padding: vLLM's slot mapping as flashmoe's ``padding_marker``.

With data parallelism, a rank without requests runs dummy steps in lockstep with the others (vLLM's
``execute_dummy_batch``), and those tokens go through every MoE layer: vLLM's own path computes their experts
like real ones, and so did flashmoe, so at low concurrency most of the experts a layer streams serve
nobody. vLLM marks them: on every dummy step it fills the slot mapping with -1 ("Dummy runs have no real
slot assignments", ``_dummy_run`` in 0.26 and 0.32), and in a real step only the padding rows after the real
tokens get -1. So a negative first entry means the whole call is padding, which is what flashmoe's
``padding_marker`` says (:mod:`flashmoe.validation`): that rank then sends no token to the experts and gets
zeros back. The slot mapping is a slice of a persistent buffer, so a captured CUDA graph reads the current
step's value on every replay.

Not used under decode context parallelism: there a real token whose KV lives on another rank also gets -1.
"""

from __future__ import annotations

import torch


def markers_usable() -> tuple[bool, str]:
    """(use the slot mapping as padding marker, why): decided once per layer, when the kernel is built."""
    from flashmoe import config

    if not config.skip_padding():
        return (
            False,
            "FLASHMOE_SKIP_PADDING=0: a DP rank's dummy steps compute their experts like real tokens",
        )
    try:
        from vllm.distributed import get_dcp_group

        dcp = get_dcp_group().world_size
    except (ImportError, AssertionError, AttributeError) as e:  # AssertionError: group not initialised
        return False, f"decode-context-parallel size unknown ({type(e).__name__}): every step's experts run"
    if dcp > 1:
        return (
            False,
            f"decode context parallel {dcp}: real tokens can carry slot -1, every step's experts run",
        )
    return True, "a DP rank's dummy steps (slot mapping -1) send no tokens to the experts"


def padding_marker(num_rows: int) -> torch.Tensor | None:
    """This forward pass's slot mapping when it lines up with the MoE layer's ``num_rows`` rows, else None
    (no forward context, micro-batches, sequence-parallel chunks: then every row counts as real)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mapping = get_forward_context().slot_mapping
    if not isinstance(mapping, dict) or not mapping:
        return None
    slots = next(iter(mapping.values()))
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        return None
    return slots if slots.shape[0] == num_rows and num_rows > 0 else None
