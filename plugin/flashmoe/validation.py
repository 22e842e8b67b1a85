"""Every check on what callers hand flashmoe, in one place: the layer description (spec, placement, EP
size) and each call's tensors. Every backend runs the same functions before it computes anything: the
PyTorch reference (``moe_reference``, ``moe_oracle_fp64``, ``moe_reference_distributed``, FlashMoE on
CPU) and the megakernel (FlashMoE on sm_90). A bad argument is a ``TypeError`` (not a tensor / not an
int) or ``ValueError`` (wrong shape, dtype, device or value) whose message starts with its name.

The tensor contract of one call on one EP rank (T tokens on this rank, k = top_k, H hidden, I
intermediate, E global experts, E_local = the placement's experts on this rank)::

    hidden_states  [T, H]            the spec's dtype (bf16 for the megakernel)
    topk_ids       [T, k]   int32    global expert ids; -1 = no expert for this slot
    topk_weights   [T, k]   float32
    w13            [E_local, 2I, H]  gate rows then up rows, this rank's experts in local-index order
    w2             [E_local, H, I]
    out (optional) [T, H]            hidden_states' dtype and device; written in full
    padding_marker (optional) [>=1] int64, hidden_states' device: if its first entry is negative, every
                   token of the call is an engine's padding (a DP rank's dummy step): no expert work for
                   it, zeros out; the call still runs (collective). Read on the device: graph-safe. vLLM's
                   slot mapping is one (-1 on dummy steps).

The fp8 path (:mod:`flashmoe.reference_fp8`) takes the weights as vLLM and SGLang load a block-fp8
checkpoint, read in place (``*_scale_inv``: one fp32 scale per 128 x 128 block, dequantised weight =
e4m3 value * its block's scale); hidden_states must then be bf16 and H and I multiples of 128 (vLLM
refuses a block-fp8 MoE whose intermediate size is not a multiple of the block too)::

    w13            [E_local, 2I, H]              float8_e4m3fn
    w13_scale_inv  [E_local, 2I/128, H/128]      float32
    w2             [E_local, H, I]               float8_e4m3fn
    w2_scale_inv   [E_local, H/128, I/128]       float32

Routing ids, defined the same for every backend:

* ``-1`` (the kernel treats any negative id alike) contributes nothing.
* An id outside ``[-1, E)`` is an error. Reading the ids costs a device sync on a GPU, so only the
  reference backends check them (``check_ids``); the megakernel skips such a slot, as it does -1, and
  never reads out of bounds.
* A duplicate id within one token's row counts once per occurrence, each with its own weight
  (``w[t,a] * y + w[t,b] * y``, as vLLM's fused MoE does): summed, not an error.

Only Python types, shapes, dtypes and devices are looked at on the megakernel path: host-side, no
device sync, safe under CUDA graph capture.
"""

from __future__ import annotations

import torch

from .fp8 import E4M3, GROUP

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_positive_int(name: str, value) -> None:
    # bool is an int subclass: MoELayerSpec(num_experts=True) must not mean 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_spec(spec) -> None:
    """The fields of a :class:`~flashmoe.MoELayerSpec` (called from its constructor)."""
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "max_tokens_per_rank"):
        check_positive_int(f"MoELayerSpec.{name}", getattr(spec, name))
    if spec.top_k > spec.num_experts:
        raise ValueError(f"MoELayerSpec.top_k={spec.top_k} exceeds num_experts={spec.num_experts}")
    if not isinstance(spec.dtype, torch.dtype):
        raise TypeError(
            f"MoELayerSpec.dtype must be a torch.dtype, got {type(spec.dtype).__name__} {spec.dtype!r}"
        )
    if spec.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"MoELayerSpec.dtype {spec.dtype} not supported (use one of {SUPPORTED_DTYPES})")
    w = spec.weight_dtype
    if w is None or w == spec.dtype:
        return
    if not isinstance(w, torch.dtype):
        raise TypeError(
            f"MoELayerSpec.weight_dtype must be a torch.dtype or None, got {type(w).__name__} {w!r}"
        )
    if w != E4M3:
        raise ValueError(
            f"MoELayerSpec.weight_dtype {w} not supported: use None (weights in dtype {spec.dtype}) or "
            f"{E4M3} (block-fp8 experts)"
        )
    if spec.dtype != torch.bfloat16:
        raise ValueError(
            f"MoELayerSpec.weight_dtype {E4M3} needs dtype torch.bfloat16 (bf16 activations), got {spec.dtype}"
        )
    if spec.hidden_size % GROUP or spec.intermediate_size % GROUP:
        raise ValueError(
            f"MoELayerSpec: block-fp8 weights need hidden_size and intermediate_size multiples of {GROUP} "
            f"(the block size), got {spec.hidden_size} and {spec.intermediate_size}"
        )


def check_placement(placement) -> None:
    """The fields of an :class:`~flashmoe.ExpertPlacement` (called from its constructor)."""
    check_positive_int("ExpertPlacement.world_size", placement.world_size)
    for name in ("expert_rank", "expert_local"):
        require_tensor(f"ExpertPlacement.{name}", getattr(placement, name))
    r, loc = placement.expert_rank, placement.expert_local
    if r.dim() != 1 or loc.shape != r.shape:
        raise ValueError(
            f"placement tensors must be 1-D of equal length, got {tuple(r.shape)} and {tuple(loc.shape)}"
        )
    if r.dtype != torch.int32 or loc.dtype != torch.int32:
        raise ValueError("placement tensors must be int32")
    if r.numel() == 0:
        raise ValueError("placement has no experts")
    world = placement.world_size
    if int(r.min()) < 0 or int(r.max()) >= world:
        raise ValueError(f"expert_rank values must be in [0, {world}), got [{int(r.min())}, {int(r.max())}]")
    # Each rank's local indices must be exactly 0..n_r-1 (a dense w13/w2 per rank).
    for rank in range(world):
        idx = loc[r == rank]
        dense = torch.arange(idx.numel(), dtype=torch.int32, device=idx.device)
        if idx.numel() and not torch.equal(torch.sort(idx).values, dense):
            raise ValueError(
                f"rank {rank}: local expert indices must be a permutation of 0..{idx.numel() - 1}"
            )


def check_layer(spec, placement, world_size: int) -> None:
    """A layer's spec, placement and EP group belong together (FlashMoE's constructor, every backend)."""
    from .placement import ExpertPlacement
    from .spec import MoELayerSpec

    if not isinstance(spec, MoELayerSpec):
        raise TypeError(f"spec must be a flashmoe.MoELayerSpec, got {type(spec).__name__}")
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"placement must be a flashmoe.ExpertPlacement, got {type(placement).__name__}")
    if placement.world_size != world_size:
        raise ValueError(f"placement is for {placement.world_size} ranks, EP group has {world_size}")
    # The kernel sizes and bounds ids by the spec's E: a larger placement's extra experts would never be used.
    if placement.num_experts != spec.num_experts:
        raise ValueError(
            f"placement has {placement.num_experts} experts but the spec's num_experts is {spec.num_experts}"
        )


def check_call(
    hidden_states,
    topk_ids,
    topk_weights,
    w13,
    w2,
    placement,
    rank: int,
    *,
    spec=None,
    out=None,
    check_ids: bool = True,
    device: torch.device | None = None,
    contiguous: bool = False,
    w13_scale_inv=None,
    w2_scale_inv=None,
    padding_marker=None,
) -> None:
    """One call's inputs (see the module docstring for the contract).

    ``spec``: the layer's; its H, k, I, dtype and token bound must match (FlashMoE passes it; the
    standalone reference functions have none). ``check_ids``: read ``topk_ids`` to check its range (a
    host sync on a GPU: the megakernel path passes False). ``device``/``contiguous``: what the
    megakernel additionally needs. ``w13_scale_inv``/``w2_scale_inv``: given (both) for fp8 weights."""
    fp8 = w13_scale_inv is not None or w2_scale_inv is not None
    args = (
        ("hidden_states", hidden_states),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("w13", w13),
        ("w2", w2),
    )
    if fp8:
        args += (("w13_scale_inv", w13_scale_inv), ("w2_scale_inv", w2_scale_inv))
    for name, t in args:
        require_tensor(name, t)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"hidden_states dtype {hidden_states.dtype} not supported (use one of {SUPPORTED_DTYPES})"
        )
    T, H = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be [E_local, 2I, H] and w2 [E_local, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    E_local, two_i, h13 = w13.shape
    if h13 != H or two_i % 2:
        raise ValueError(
            f"w13 shape {tuple(w13.shape)} does not fit hidden size {H} (expected [E_local, 2I, {H}])"
        )
    I = two_i // 2
    if tuple(w2.shape) != (E_local, H, I):
        raise ValueError(f"w2 shape {tuple(w2.shape)} != (E_local={E_local}, H={H}, I={I}) implied by w13")
    if fp8:
        _check_fp8_weights(hidden_states.dtype, w13, w13_scale_inv, w2, w2_scale_inv, H, I)
    elif w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError(
            f"w13/w2 dtype ({w13.dtype}, {w2.dtype}) must equal hidden_states dtype {hidden_states.dtype}"
        )
    if E_local != placement.num_local(rank):
        raise ValueError(
            f"w13 holds {E_local} experts but the placement gives rank {rank} {placement.num_local(rank)}"
        )
    if spec is not None:
        _check_against_spec(spec, T, H, topk_ids.shape[1], I, hidden_states.dtype, w13.dtype)
    for name, t in args[1:]:
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}")
    if device is not None and hidden_states.device != device:
        raise ValueError(f"hidden_states is on {hidden_states.device}, the layer on {device}")
    if contiguous:
        for name, t in args:
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (the megakernel reads it in place)")
    if out is not None and (
        out.shape != hidden_states.shape
        or out.dtype != hidden_states.dtype
        or out.device != hidden_states.device
    ):
        raise ValueError(
            f"out must be {tuple(hidden_states.shape)} {hidden_states.dtype} on {hidden_states.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if padding_marker is not None:
        require_tensor("padding_marker", padding_marker)
        if padding_marker.dtype != torch.int64 or padding_marker.dim() != 1 or padding_marker.numel() < 1:
            raise ValueError(
                f"padding_marker must be a 1-D int64 tensor with at least one element, got "
                f"{padding_marker.dtype} {tuple(padding_marker.shape)}"
            )
        if padding_marker.device != hidden_states.device:
            raise ValueError(
                f"padding_marker is on {padding_marker.device}, hidden_states on {hidden_states.device}"
            )
    if check_ids and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= placement.num_experts:
            raise ValueError(f"topk_ids values must be in [-1, {placement.num_experts}), got [{lo}, {hi}]")


def _check_fp8_weights(x_dtype: torch.dtype, w13, w13_scale_inv, w2, w2_scale_inv, H: int, I: int) -> None:
    """The fp8 half of the contract (module docstring); shapes of w13/w2 themselves are checked already."""
    if x_dtype != torch.bfloat16:
        raise ValueError(f"hidden_states dtype {x_dtype}: the fp8 path takes bf16 hidden states")
    if w13.dtype != E4M3 or w2.dtype != E4M3:
        raise ValueError(f"w13/w2 dtype ({w13.dtype}, {w2.dtype}) must be {E4M3} when scales are given")
    if H % GROUP or I % GROUP:
        raise ValueError(
            f"w13/w2: fp8 weights need H and I multiples of {GROUP} (the block size), got H={H}, I={I}"
        )
    E_local = w13.shape[0]
    expected = {
        "w13_scale_inv": (w13_scale_inv, (E_local, 2 * I // GROUP, H // GROUP)),
        "w2_scale_inv": (w2_scale_inv, (E_local, H // GROUP, I // GROUP)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != {shape} (one scale per 128 x 128 block)")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")


def _check_against_spec(
    spec, T: int, H: int, k: int, I: int, dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    if H != spec.hidden_size:
        raise ValueError(f"hidden_states has H={H}, the layer's hidden_size is {spec.hidden_size}")
    if k != spec.top_k:
        raise ValueError(f"topk_ids has k={k}, the layer's top_k is {spec.top_k}")
    if I != spec.intermediate_size:
        raise ValueError(f"w13/w2 have I={I}, the layer's intermediate_size is {spec.intermediate_size}")
    if dtype != spec.dtype:
        raise ValueError(f"hidden_states dtype {dtype} differs from the layer's dtype {spec.dtype}")
    expected = spec.weight_dtype or spec.dtype
    if weight_dtype != expected:
        raise ValueError(f"w13/w2 dtype {weight_dtype} differs from the layer's weight dtype {expected}")
    if T > spec.max_tokens_per_rank:
        raise ValueError(
            f"{T} tokens exceed max_tokens_per_rank={spec.max_tokens_per_rank} this layer was sized for"
        )
