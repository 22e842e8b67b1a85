"""Time one MoE layer forward several ways and hold each against the physical floor of the case.

    torchrun --nproc-per-node 4 benchmarks/layer_bench.py --max-minutes 8
    torchrun --nproc-per-node 4 benchmarks/layer_bench.py --mode serving --tokens 1,8,32,128
    torchrun --nproc-per-node 2 benchmarks/layer_bench.py --device cpu      # smoke run over gloo
    python benchmarks/layer_bench.py --dtype fp8 --models dsv4-flash --per-rank-of-ep 8   # block-fp8 weights

Variants (``--variants``): ``flashmoe`` (the megakernel; the reference backend where it cannot run,
marked in ``backend``), ``all_to_all`` (NCCL all-to-all dispatch/combine around grouped GEMMs),
``allgather_rs`` (all-gather, local experts on every token, reduce-scatter: vLLM's default EP path
written with grouped GEMMs), ``vllm_fused`` (the same path with vLLM's own Triton ``fused_experts``),
``deepep_ll`` / ``deepep_ll_fp8`` (DeepEP's low-latency dispatch in bf16 / fp8, grouped GEMMs on its
masked per-expert layout, its low-latency combine), ``deepep_ll_comm`` (that dispatch and combine alone)
and ``compute_only`` (the grouped GEMMs with rows already in place). Every variant's output is
checked against the reference before it is timed.

Modes (``--mode``): ``flushed`` times one layer call at a time with the L2 flushed before each;
``serving`` times a step of L consecutive layers with distinct weights and their own routing, as one
CUDA graph (where the variant can be captured) with no flush: what a decode step sees. On a CPU the
serving step runs its layers eagerly. Rates for the floor (GEMM, copy, link) are
measured first, in the same run.

Weights (``--dtype``): ``bf16``, or ``fp8`` (issue 15: block-fp8 e4m3 weights with one fp32 scale per
128 x 128 block, bf16 activations): flashmoe's fp8 layer, the ``all_to_all``/``allgather_rs``/``compute_only``
baselines with an fp8 expert stage (``--fp8-gemm``), checked against ``flashmoe.reference_fp8`` with the
test suite's fp8 budgets, and a floor in fp8 bytes at the fp8 GEMM rate measured in the run.

Rows go to ``--out`` after every case, so a run cut short by ``--max-minutes`` or a crash keeps what it
measured; a short table is printed last.
See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from moe_bench import deepep_ll, serving, table, testsuite
from moe_bench.baselines import EPLayout, ExpertRows, all_to_all_moe, allgather_rs_moe, compute_only
from moe_bench.check import (
    MAX_REL_TOL,
    REL_L2_TOL,
    compare,
    empty_stats,
    error_stats,
    expert_rows_reference,
    expert_rows_reference_fp8,
    fp8_budget,
    fp8_within,
    reduce_stats,
)
from moe_bench.floor import Floor, layer_floor, load_imbalance, rank_work
from moe_bench.formats import BF16, FORMATS, FP8, Format
from moe_bench.grouped_gemm import (
    DEQUANT_MM_LOOP,
    FP8_GEMM_CHOICES,
    GEMM_CHOICES,
    SCALED_MM_LOOP,
    BlockFp8,
    Fp8SwiGLU,
    GroupedSwiGLU,
    select_fp8_expert_gemm,
    select_grouped_gemm,
    weight_scale_recipe,
)
from moe_bench.ranks import Ranks
from moe_bench.rates import measure_rates
from moe_bench.results import (
    SCHEMA,
    default_out_path,
    machine_info,
    new_row,
    run_env,
    software_info,
    utc_now,
    write_json,
)
from moe_bench.routing import ROUTINGS, case_seed, make_routing
from moe_bench.shapes import (
    CPU_DEFAULT_MODELS,
    CPU_DEFAULT_TOKENS,
    GPU_DEFAULT_MODELS,
    GPU_DEFAULT_TOKENS,
    MODELS,
    ModelShape,
    with_experts,
)
from moe_bench.timing import L2Flusher, TimingPolicy, time_calls
from moe_bench.vllm_fused import allgather_fused_moe, expert_map, load_fused_experts

REPO = Path(__file__).resolve().parents[1]
# Newer torch renames these two collectives; the GPU machines' torch 2.11 has only these names.
warnings.filterwarnings(
    "ignore",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    FutureWarning,
)
VARIANTS = table.VARIANTS
MODES = ("flushed", "serving")
# Variants whose layer has no host synchronisation, so a serving step of them is one CUDA graph. The
# all_to_all and allgather_rs baselines read split sizes on the host; their serving steps run eagerly.
GRAPH_SAFE = ("flashmoe", "vllm_fused", "compute_only", *deepep_ll.VARIANTS)
DTYPE = torch.bfloat16  # activations (and bf16 weights)
# Under --dtype fp8, flashmoe, all_to_all, allgather_rs and compute_only run; these give unavailable rows
# saying why.
FP8_NOT_WIRED = {
    "vllm_fused": "vllm_fused has no fp8 path in this benchmark (vLLM's block-fp8 Triton kernel rounds GEMM0 and "
    "the SwiGLU to bf16 before quantising, another function than flashmoe.reference_fp8; not wired)",
    **{
        v: f"{v} has no fp8-weight path in this benchmark (its packed rows reach the GEMMs without host group "
        "sizes, which the fp8 expert loop needs; not wired)"
        for v in deepep_ll.VARIANTS
        if v != deepep_ll.COMM
    },
    deepep_ll.COMM: "deepep_ll_comm moves no weights (DeepEP's bf16 dispatch and combine alone): its rows come from "
    "a bf16 run",
}
# NVLink multicast is absent on our machines (kernel-design §5); NCCL, torch symmetric memory and
# NVSHMEM must not try it. Explicit settings in the environment win.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Expert weights may take this share of the free GPU memory at start; beyond it the expert count is
# halved (and the rows say so).
WEIGHT_MEMORY_FRACTION = 0.5


def _csv(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: gloo smoke run (flashmoe = reference backend)",
    )
    p.add_argument(
        "--models", help=f"comma list of {sorted(MODELS)}; default {','.join(GPU_DEFAULT_MODELS)} (cpu: tiny)"
    )
    p.add_argument(
        "--tokens",
        help=f"tokens per rank, comma list; default {','.join(map(str, GPU_DEFAULT_TOKENS))} (cpu: 1,8,32)",
    )
    p.add_argument("--routing", default=",".join(ROUTINGS), help="uniform and/or zipf")
    p.add_argument(
        "--dtype",
        choices=tuple(FORMATS),
        default="bf16",
        help="expert weights: bf16, or fp8 (block-fp8 e4m3 with 128x128 fp32 scales, bf16 activations; issue 15)",
    )
    p.add_argument(
        "--fp8-gemm",
        choices=FP8_GEMM_CHOICES,
        default="auto",
        help="--dtype fp8: the baselines' expert GEMMs (auto: torch._scaled_mm with block scales where it runs, "
        "else weights dequantised to bf16)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument(
        "--mode",
        default="flushed",
        help="flushed (one layer per call, L2 flushed before each) and/or serving (a CUDA graph of L layers "
        "with distinct weights and routing, no flush), comma list",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="serving: layers per step (default: the fewest >= --min-layers whose weights exceed "
        f"{serving.L2_MULTIPLE}x the L2; {serving.CPU_LAYERS} on cpu)",
    )
    p.add_argument(
        "--min-layers", type=int, default=4, help="serving: lower bound of the default layer count"
    )
    p.add_argument(
        "--per-rank-of-ep",
        type=int,
        default=None,
        help="give each rank E/N experts, as at EP N (world 1 with N=4: one GPU doing one EP4 rank's "
        "expert work); rows note the changed expert count",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop after this much wall time (checked between variants)",
    )
    p.add_argument(
        "--out", type=Path, help="JSON path; default benchmarks/results/<date>-<machine>-layer.json"
    )
    p.add_argument(
        "--grouped-gemm", choices=GEMM_CHOICES, default="auto", help="grouped GEMM of the baselines"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument(
        "--target-ms",
        type=float,
        default=250.0,
        help="timed device time per variant and case (bounded by min/max iters)",
    )
    p.add_argument(
        "--rotate-mib",
        type=float,
        default=256.0,
        help="input sets per case: enough to hold this much (2..--max-sets)",
    )
    p.add_argument("--max-sets", type=int, default=16)
    p.add_argument(
        "--no-l2-flush", action="store_true", help="do not overwrite the L2 before each timed call"
    )
    p.add_argument(
        "--no-check", action="store_true", help="skip the correctness check (rows record check_rel_l2 = null)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="process-group timeout: a stuck collective aborts the run",
    )
    p.add_argument(
        "--commit", help="commit to record when the tree has no .git (default: git rev-parse HEAD)"
    )
    p.add_argument("--seed", type=int, default=0, help="changes every input set and weight")
    p.add_argument(
        "--no-warmup-case", action="store_true", help="do not run the first case once untimed before the rest"
    )
    p.add_argument(
        "--deepep-max-tokens",
        type=int,
        default=deepep_ll.DEFAULT_MAX_TOKENS,
        help="tokens per rank the DeepEP low-latency buffer is sized for; larger cases are unavailable for "
        "the deepep_ll variants (its buffer grows with E x tokens x H: 7.1 GiB per rank for DeepSeek-V3 at EP4, 512)",
    )
    p.add_argument(
        "--padding-ranks",
        type=int,
        default=0,
        help="the last N ranks are idle DP ranks (vLLM's dummy steps): flashmoe gets a padding_marker there and "
        "must return zeros; the baselines compute those tokens, as vLLM's own paths do; the floor counts the "
        "other ranks' tokens only (c = 1 with DP: --tokens 1 --padding-ranks W-1)",
    )
    p.add_argument(
        "--metrics-overhead",
        action="store_true",
        help="also time flashmoe with its in-kernel metrics off, interleaved with on (metrics_* columns)",
    )
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.models = (
        _csv(args.models) if args.models else list(CPU_DEFAULT_MODELS if cpu else GPU_DEFAULT_MODELS)
    )
    args.tokens = (
        _csv(args.tokens, int) if args.tokens else list(CPU_DEFAULT_TOKENS if cpu else GPU_DEFAULT_TOKENS)
    )
    args.routing = _csv(args.routing)
    args.variants = _csv(args.variants)
    args.mode = _csv(args.mode)
    for name, got, allowed in (
        ("--models", args.models, MODELS),
        ("--routing", args.routing, ROUTINGS),
        ("--variants", args.variants, VARIANTS),
        ("--mode", args.mode, MODES),
    ):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            p.error(f"{name}: {bad or 'empty'} not in {list(allowed)}")
    if any(t <= 0 for t in args.tokens):
        p.error("--tokens must be positive")
    if args.dtype == "fp8":
        block = FP8.weight_block
        odd = [m for m in args.models if MODELS[m].hidden % block or MODELS[m].intermediate % block]
        if odd:
            p.error(f"--dtype fp8: {odd} have H or I not a multiple of {block} (the fp8 block)")
    if (args.layers is not None and args.layers < 1) or args.min_layers < 1:
        p.error("--layers and --min-layers must be at least 1")
    if args.per_rank_of_ep is not None and args.per_rank_of_ep < 1:
        p.error("--per-rank-of-ep must be at least 1")
    if args.deepep_max_tokens < 1:
        p.error("--deepep-max-tokens must be at least 1")
    return args


# ----------------------------------------------------------------------------------------- setup


def init_distributed(device_kind: str, timeout_s: float):
    """(EP group, gloo group over the same ranks, device). Works under torchrun or as one process."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if "RANK" not in os.environ:  # plain `python layer_bench.py`: a one-rank group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    timeout = dt.timedelta(seconds=timeout_s)
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but CUDA is not available (use --device cpu for the smoke run)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        cpu_group = dist.group.WORLD
    return dist.group.WORLD, cpu_group, device


def per_rank_weight_bytes(shape: ModelShape, world: int, fmt: Format = BF16) -> int:
    return math.ceil(shape.num_experts / world) * shape.expert_weight_bytes(fmt)


def weight_format(args) -> Format:
    return FORMATS[getattr(args, "dtype", "bf16")]


def serving_layers(shape: ModelShape, ranks: Ranks, args) -> int:
    """Layers of distinct weights the model needs: 1 unless serving mode runs (see moe_bench.serving)."""
    if "serving" not in args.mode:
        return 1
    if args.layers is not None:
        return args.layers
    if ranks.device.type != "cuda":
        return serving.CPU_LAYERS
    return serving.layers_for(
        per_rank_weight_bytes(shape, ranks.world, weight_format(args)),
        serving.l2_bytes(ranks.device),
        args.min_layers,
    )


def fit_experts(shape: ModelShape, ranks: Ranks, args) -> tuple[ModelShape, str, int]:
    """(shape, note, layers): the expert count set by --per-rank-of-ep, then halved until the layers'
    weights (E/world experts each) fit in WEIGHT_MEMORY_FRACTION of free memory."""
    notes = []
    if args.per_rank_of_ep is not None and args.per_rank_of_ep != ranks.world:
        E = shape.num_experts * ranks.world // args.per_rank_of_ep
        shape = with_experts(shape, E)
        notes.append(f"{E} experts: E/{args.per_rank_of_ep} per rank, as at EP{args.per_rank_of_ep}")
    if ranks.device.type != "cuda":
        return shape, "; ".join(notes), serving_layers(shape, ranks, args)
    budget = ranks.min(torch.cuda.mem_get_info(ranks.device)[0] * WEIGHT_MEMORY_FRACTION)
    E = shape.num_experts
    fitted = shape
    fmt = weight_format(args)
    while serving_layers(fitted, ranks, args) * per_rank_weight_bytes(fitted, ranks.world, fmt) > budget and (
        E // 2 >= max(ranks.world, shape.top_k)
    ):
        E //= 2
        fitted = with_experts(shape, E)
    if E != shape.num_experts:
        notes.append(f"experts cut {shape.num_experts} -> {E} to fit GPU memory")
    return fitted, "; ".join(notes), serving_layers(fitted, ranks, args)


@dataclass
class FlashMoELayers:
    """One flashmoe layer per model, built before any timing (see :func:`build_flashmoe_layers`)."""

    layers: dict = field(default_factory=dict)  # model -> one FlashMoE per layer of distinct weights
    errors: dict = field(default_factory=dict)


def layer_spec(shape: ModelShape, max_tokens: int, fmt: Format = BF16):
    """flashmoe's ``MoELayerSpec`` of ``shape``; for fp8, ``weight_dtype = float8_e4m3fn`` (w13/w2 e4m3 with
    ``*_scale_inv`` per 128 x 128 block, bf16 activations; the contract: :mod:`flashmoe.validation`)."""
    from flashmoe import MoELayerSpec

    dims = (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, max_tokens, DTYPE)
    if fmt is BF16:
        return MoELayerSpec(*dims)
    return MoELayerSpec(*dims, weight_dtype=torch.float8_e4m3fn)


def reserve_flashmoe_buffers(
    shapes: dict[str, ModelShape], max_tokens: int, cpu_group, ranks: Ranks, fmt: Format = BF16
) -> None:
    """Size flashmoe's process-wide symmetric buffers once, for the union of the selected layers: the
    NVSHMEM heap is sized at the first allocation and cannot grow past it. Collective; raises on failure.
    The sizes are the bf16 layer's: fp8 dispatch rows (H + H/32 bytes) are smaller than bf16 ones (2H)."""
    from flashmoe.backend import MEGAKERNEL, select_backend

    def largest(attr: str) -> int:
        return max(getattr(s, attr) for s in shapes.values())

    union = layer_spec(
        ModelShape(
            "union", largest("hidden"), largest("intermediate"), largest("num_experts"), largest("top_k")
        ),
        max_tokens,
        fmt,
    )
    if select_backend(union, ranks.device, ranks.world).name != MEGAKERNEL:
        return  # each layer says why when it is built
    from flashmoe.megakernel import reserve

    reserve(
        max_tokens,
        union.hidden_size,
        union.intermediate_size,
        union.top_k,
        union.num_experts,
        group=cpu_group,
        device=ranks.device,
    )


def build_flashmoe_layers(
    shapes: dict[str, ModelShape],
    placements: dict,
    num_layers: dict[str, int],
    max_tokens: int,
    group,
    cpu_group,
    ranks: Ranks,
    log,
    fmt: Format = BF16,
) -> FlashMoELayers:
    """``num_layers[model]`` layers per model (one FlashMoE per layer, as an engine holds them), sized
    for the largest token count, after the buffers are reserved for all of them; built largest first,
    so that without the reservation the first allocation covers the rest."""
    built = FlashMoELayers()
    err = None
    try:
        from flashmoe import FlashMoE

        if ranks.device.type == "cuda":
            reserve_flashmoe_buffers(shapes, max_tokens, cpu_group, ranks, fmt)
    except Exception as e:  # keep measuring the baselines
        err = f"{type(e).__name__}: {e}"
    if ranks.any(err is not None):
        for name in shapes:
            built.errors[name] = f"flashmoe setup failed: {err or 'on another rank'}"
        log(built.errors[next(iter(shapes))])
        return built
    order = sorted(
        shapes,
        key=lambda n: (shapes[n].hidden * shapes[n].top_k, shapes[n].intermediate, shapes[n].num_experts),
        reverse=True,
    )
    for name in order:
        s = shapes[name]
        err = None
        try:
            spec = layer_spec(s, max_tokens, fmt)
            layers = [
                FlashMoE(
                    spec,
                    placements[name],
                    group,
                    cpu_group=cpu_group,
                    layer_name=f"bench-{name}" + (f"-{i}" if i else ""),
                    device=ranks.device,
                )
                for i in range(num_layers[name])
            ]
        except Exception as e:  # recorded in the rows; the baselines still run
            layers, err = None, f"{type(e).__name__}: {e}"
        if ranks.any(err is not None):
            built.errors[name] = err or "construction failed on another rank"
            log(f"flashmoe {name}: unavailable ({built.errors[name]})")
        else:
            built.layers[name] = layers
            log(f"flashmoe {name}: {len(layers)} layer(s), backend {layers[0].backend} ({layers[0].reason})")
    return built


def prepare_deepep(args, shapes: dict[str, ModelShape], ranks: Ranks, log):
    """(deep_ep module or None, reason or None, tokens, shapes) for the deepep_ll variants, before flashmoe
    initialises NVSHMEM: where both run, one symmetric heap must hold flashmoe's buffers and DeepEP's LL
    buffer, so NVSHMEM_SYMMETRIC_SIZE is set for both (unless already set)."""
    mod, version, reason = deepep_ll.load_deep_ep(ranks.device)
    tokens = min(max(args.tokens), args.deepep_max_tokens)
    sized = [
        (s.hidden, s.num_experts)
        for s in shapes.values()
        if s.hidden in deepep_ll.SUPPORTED_HIDDEN and s.num_experts % ranks.world == 0
    ]
    if mod is not None and not sized:
        mod, reason = (
            None,
            f"no selected model's hidden size is one of DeepEP LL's {deepep_ll.SUPPORTED_HIDDEN}",
        )
    if ranks.any(mod is None):
        reason = reason or "deep_ep unavailable on another rank"
        log(f"deepep_ll: unavailable ({reason})")
        return None, reason, tokens, sized
    ll_bytes = deepep_ll.LowLatency.rdma_bytes(mod, sized, tokens, ranks.world)
    if "flashmoe" in args.variants:
        fm_bytes = deepep_ll.flashmoe_symmetric_bytes(
            max(args.tokens),
            max(s.hidden for s in shapes.values()),
            max(s.top_k for s in shapes.values()),
            ranks.world,
        )
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(ll_bytes + fm_bytes))
    log(
        f"deepep_ll: deep_ep {version}, LL buffer {ll_bytes / 2**30:.2f} GiB for {tokens} tokens/rank; "
        f"NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE', 'default')}"
    )
    return mod, None, tokens, sized


def create_deepep(sizing, group, ranks: Ranks, log) -> tuple:
    """(deepep_ll.LowLatency or None, version, reason): the LL buffer, after flashmoe's layers (so that
    flashmoe's NVSHMEM initialisation, the one known to work on our machines, comes first). Collective."""
    mod, reason, tokens, sized = sizing
    version = deepep_ll.deep_ep_version()
    if mod is None:
        return None, version, reason
    ll, err = None, None
    try:
        ll = deepep_ll.LowLatency.create(mod, group, sized, tokens, ranks.world)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"[:400]
    if ranks.any(err is not None):
        reason = f"DeepEP LL buffer setup failed: {err or 'on another rank'}"
        log(f"deepep_ll: {reason}")
        return None, version, reason
    log(f"deepep_ll: LL buffer {ll.num_rdma_bytes / 2**30:.2f} GiB per rank ready")
    return ll, version, None


@dataclass
class ModelState:
    shape: ModelShape
    model_num_experts: int
    note: str
    placement: object
    ep: EPLayout
    w13: list  # per layer of distinct weights (bf16 tensors, or BlockFp8); flushed mode uses layer 0
    w2: list
    fmt: Format = BF16


def make_model(
    shape: ModelShape,
    model_num_experts: int,
    note: str,
    placement,
    group,
    ranks: Ranks,
    seed: int,
    num_layers: int = 1,
    fmt: Format = BF16,
) -> ModelState:
    # One generator for all layers: layer 0 is the same weights whatever the layer count.
    gen = torch.Generator(device=ranks.device).manual_seed(case_seed("weights", shape.name, ranks.rank, seed))
    n = placement.num_local(ranks.rank)
    hidden, inter = shape.hidden, shape.intermediate
    w13, w2 = [], []
    for _ in range(num_layers):
        if fmt is FP8:
            # The test suite's block-fp8 draw (tests/moe_inputs.py): Gaussian weights / sqrt(fan-in), each
            # 128 x 128 block with its own magnitude (a scale read from the wrong block shows in the check),
            # quantised by flashmoe.fp8.quantize_weight_blocks one expert at a time, on the device.
            q13, s13, q2, s2 = testsuite.moe_inputs().random_fp8_expert_weights(
                n, hidden, inter, gen, ranks.device
            )
            w13.append(BlockFp8(q13, s13))
            w2.append(BlockFp8(q2, s2))
            continue
        # Scaled so activations stay O(1) through both GEMMs.
        w13.append(
            torch.randn(n, 2 * inter, hidden, generator=gen, device=ranks.device, dtype=DTYPE).mul_(
                hidden**-0.5
            )
        )
        w2.append(
            torch.randn(n, hidden, inter, generator=gen, device=ranks.device, dtype=DTYPE).mul_(inter**-0.5)
        )
    return ModelState(
        shape,
        model_num_experts,
        note,
        placement,
        EPLayout.from_placement(placement, group, ranks.device),
        w13,
        w2,
        fmt,
    )


# ------------------------------------------------------------------------------------------ cases


@dataclass
class LayerInput:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor  # flashmoe writes here
    expert_rows: ExpertRows | None = None  # compute_only's input
    recv_rows: int | None = None  # (token, expert) rows this rank's experts receive: the deepep_ll pack bound
    padding_marker: torch.Tensor | None = None  # --padding-ranks: [-1] on an idle rank (flashmoe only)


@dataclass
class InputSet:
    layers: list[LayerInput]  # one per layer of the timed step (1 when flushed)


@dataclass
class Context:
    args: argparse.Namespace
    ranks: Ranks
    rates: object
    swiglu: GroupedSwiGLU | Fp8SwiGLU  # the baselines' expert stage (Fp8SwiGLU with --dtype fp8)
    flush: L2Flusher
    policy: TimingPolicy
    flashmoe: FlashMoELayers
    vllm: tuple  # load_fused_experts(): (fused_experts or None, vllm version, reason it cannot run)
    deadline: float
    log: object
    deepep: tuple = (None, None, "not selected")  # (deepep_ll.LowLatency or None, deep_ep version, reason)

    def out_of_time(self) -> bool:
        return self.ranks.any(time.monotonic() > self.deadline)


def num_input_sets(tokens: int, shape: ModelShape, args, layers: int = 1) -> int:
    per_set = layers * tokens * shape.hidden * 2 * (1 + shape.top_k * ("compute_only" in args.variants))
    return max(2, min(args.max_sets, math.ceil(args.rotate_mib * 2**20 / per_set)))


@dataclass
class CaseInputs:
    sets: list[InputSet]
    floor: Floor  # mean over sets and layers
    imbalance: float
    gemm_rows: float  # expert rows of the busiest rank per layer, mean over sets and layers


def make_inputs(ctx: Context, m: ModelState, tokens: int, routing: str, layers: int) -> CaseInputs:
    """Rotated input sets of ``layers`` layers each, every layer with its own tokens and routing."""
    s, ranks, dev = m.shape, ctx.ranks, ctx.ranks.device
    sets, floors, imbalance, gemm_rows = [], [], [], []
    mine = m.placement.local_experts(ranks.rank).long()
    idle = ranks.world - ctx.args.padding_ranks  # ranks from here on run dummy steps
    marker = torch.full((1,), -1, dtype=torch.int64, device=dev) if ranks.rank >= idle else None
    for i in range(num_input_sets(tokens, s, ctx.args, layers)):
        per_layer = []
        for layer in range(layers):
            # Layer 0 keeps the seed of the single-layer (flushed) case.
            seed = case_seed(
                s.name, tokens, routing, i, ranks.rank, ctx.args.seed, *(("layer", layer) * bool(layer))
            )
            gen = torch.Generator(device=dev).manual_seed(seed)
            ids, weights = make_routing(tokens, s.num_experts, s.top_k, routing, seed, dev, ctx.args.zipf_s)
            if m.fmt is FP8:  # a magnitude per (token, 128-group), as the suite draws fp8 inputs
                x = testsuite.moe_inputs().random_grouped_hidden(tokens, s.hidden, gen, dev)
            else:
                x = torch.randn(tokens, s.hidden, generator=gen, device=dev, dtype=DTYPE)
            ids_all = ranks.gather_tensor(ids)  # [world, T, k]: the floor needs every rank's routing
            if idle < ranks.world:  # the floor (and the work figures) count the real tokens only
                ids_all = ids_all.clone()
                ids_all[idle:] = -1
            works = rank_work(ids_all, m.placement.expert_rank)
            floors.append(layer_floor(works, s.hidden, s.intermediate, ctx.rates.rates, m.fmt))
            imbalance.append(load_imbalance(works))
            gemm_rows.append(max(w.expert_rows for w in works))
            recv_rows = None
            if any(v in deepep_ll.VARIANTS for v in ctx.args.variants):
                recv_rows = deepep_ll.received_rows(ids_all, mine, s.num_experts)
            rows = None
            if "compute_only" in ctx.args.variants:
                if ranks.world == 1:  # the very rows flashmoe computes: the comparison is like for like
                    rows = ExpertRows.of_tokens(x, ids, len(mine))
                else:  # this rank's row count per expert, from every rank's routing
                    sizes = torch.bincount(ids_all.flatten().long(), minlength=s.num_experts)[mine.to(dev)]
                    rows = ExpertRows.random(sizes, s.hidden, DTYPE, gen)
            per_layer.append(LayerInput(x, ids, weights, torch.empty_like(x), rows, recv_rows, marker))
        sets.append(InputSet(per_layer))
    return CaseInputs(
        sets, Floor.mean(floors), sum(imbalance) / len(imbalance), sum(gemm_rows) / len(gemm_rows)
    )


def layer_fn(ctx: Context, m: ModelState, variant: str, tokens: int | None = None):
    """(fn(layer index, LayerInput) -> output, backend label, reason it cannot run or None). ``tokens``
    (per rank, this case's) sizes the deepep_ll dispatch; its buffer is cleaned here when the layout changes,
    so this is collective for those variants."""
    sw, ep = ctx.swiglu, m.ep
    if m.fmt is FP8 and variant in FP8_NOT_WIRED:
        return None, None, FP8_NOT_WIRED[variant]
    if variant == "flashmoe":
        layers = ctx.flashmoe.layers.get(m.shape.name)
        if layers is None:
            return None, None, ctx.flashmoe.errors.get(m.shape.name, "not built")
        backend = layers[0].backend
        if backend != "megakernel" and ctx.ranks.device.type == "cuda":
            return (
                None,
                backend,
                f"backend {backend}: {layers[0].reason}",
            )  # timing the reference on a GPU says nothing

        if m.fmt is FP8:  # block-fp8: e4m3 weights in place, their block scales by keyword

            def flashmoe_layer(i, a):
                w13, w2 = m.w13[i], m.w2[i]
                return layers[i].forward(
                    a.x,
                    a.ids,
                    a.weights,
                    w13.q,
                    w2.q,
                    out=a.out,
                    w13_scale_inv=w13.scale_inv,
                    w2_scale_inv=w2.scale_inv,
                    padding_marker=a.padding_marker,
                )

        else:

            def flashmoe_layer(i, a):
                return layers[i](
                    a.x, a.ids, a.weights, m.w13[i], m.w2[i], out=a.out, padding_marker=a.padding_marker
                )

        return flashmoe_layer, backend, None
    if variant == "all_to_all":
        return (lambda i, a: all_to_all_moe(a.x, a.ids, a.weights, m.w13[i], m.w2[i], sw, ep)), sw.impl, None
    if variant == "allgather_rs":
        return (
            (lambda i, a: allgather_rs_moe(a.x, a.ids, a.weights, m.w13[i], m.w2[i], sw, ep)),
            sw.impl,
            None,
        )
    if variant == "vllm_fused":
        fused, version, unavailable = ctx.vllm
        if unavailable:
            return None, None, unavailable
        local_map = expert_map(ep)

        def vllm_layer(i, a):
            return allgather_fused_moe(a.x, a.ids, a.weights, m.w13[i], m.w2[i], ep, fused, local_map)

        return vllm_layer, f"vllm {version} fused_experts", None
    if variant == "compute_only":
        return (lambda i, a: compute_only(a.expert_rows, m.w13[i], m.w2[i], sw)), sw.impl, None
    if variant in deepep_ll.VARIANTS:
        ll, version, unavailable = ctx.deepep
        if unavailable:
            return None, None, unavailable
        s = m.shape
        unavailable = ll.unsupported(tokens, s.hidden, s.num_experts, m.placement)
        if unavailable:
            return None, None, unavailable
        try:  # collective (a buffer clean when the layout changes): all ranks get here together
            capacity = ll.prepare(tokens, s.hidden, s.num_experts)
        except Exception as e:
            return None, None, f"DeepEP LL buffer clean failed: {type(e).__name__}: {e}"[:400]
        how = {"deepep_ll": "bf16", "deepep_ll_fp8": "fp8"}.get(variant)
        backend = f"deep_ep {version} LL " + (f"{how} + {sw.impl}" if how else "dispatch+combine")

        def deepep_layer(i, a):
            return ll.layer(
                a.x, a.ids, a.weights, m.w13[i], m.w2[i], sw, s.num_experts, capacity, variant, a.recv_rows
            )

        return deepep_layer, backend, None
    raise ValueError(variant)


# What each kind of check compares a variant's output with (rows' ``check_against``). The bf16 kinds use
# moe_bench.check's tolerances per rank; the fp8-budget kinds tests/tolerances.py's over all ranks' rows.
CHECKS = {
    "reference": "flashmoe.reference (bf16 check)",
    "rows": "per-expert fp32 loop (bf16 check)",
    "comm": "x * sum_j w (bf16 check)",
    "deepep_fp8_input": "flashmoe.reference on DeepEP's fp8-rounded input (bf16 check)",
    "reference_fp8": "flashmoe.reference_fp8 (fp8 budgets)",
    "rows_fp8": "flashmoe.reference_fp8 per expert row (fp8 budgets)",
    "reference_dequant": "flashmoe.reference on the bf16-dequantised weights (bf16 check)",
    "rows_dequant": "per-expert fp32 loop on the bf16-dequantised weights (bf16 check)",
}
FP8_BUDGET_CHECKS = ("reference_fp8", "rows_fp8")
LAYER_CHECKS = ("reference", "reference_fp8", "reference_dequant")  # computed once per case in run_mode


def check_kind(variant: str, fmt: Format = BF16, expert_gemm: str | None = None) -> str:
    """Which reference ``variant``'s output is checked against (a key of :data:`CHECKS`). ``expert_gemm``:
    the fp8 baselines' expert stage; one that dequantises to bf16 computes the bf16 layer on those weights."""
    if fmt is FP8:
        fp8_function = variant == "flashmoe" or expert_gemm == SCALED_MM_LOOP
        if variant == "compute_only":
            return "rows_fp8" if fp8_function else "rows_dequant"
        return "reference_fp8" if fp8_function else "reference_dequant"
    if variant == "compute_only":
        return "rows"
    if variant == deepep_ll.COMM:
        return "comm"
    if variant == deepep_ll.FP8:
        return "deepep_fp8_input"
    return "reference"


@dataclass
class Check:
    """One rank's check of a step (its worst layer for the bf16 check). For the fp8-budget kinds ``stats``
    holds the step's summed errors and the verdict is taken on every rank's together (run_variant)."""

    rel_l2: float
    max_rel: float
    ok: bool
    kind: str
    stats: object = None  # tests/tolerances.py ErrorStats (fp8-budget kinds)


def layer_references(kind: str, m: ModelState, inputs: InputSet, group, world: int) -> list[torch.Tensor]:
    """Each layer's reference output of ``kind`` (one of :data:`LAYER_CHECKS`); collective at world > 1."""
    refs = []
    for i, a in enumerate(inputs.layers):
        w13, w2 = m.w13[i], m.w2[i]
        if kind == "reference_fp8":
            from flashmoe.reference_fp8 import moe_reference_distributed_fp8, moe_reference_fp8

            args = (a.x, a.ids, a.weights, w13.q, w13.scale_inv, w2.q, w2.scale_inv, m.placement)
            ref = moe_reference_fp8(*args) if world == 1 else moe_reference_distributed_fp8(*args, group)
        else:
            from flashmoe.reference import moe_reference_distributed

            if kind == "reference_dequant":
                w13, w2 = w13.dequantized(DTYPE), w2.dequantized(DTYPE)
            ref = moe_reference_distributed(a.x, a.ids, a.weights, w13, w2, m.placement, group)
        refs.append(ref)
    return refs


def check_step(
    variant: str,
    outputs: list,
    inputs: InputSet,
    m: ModelState,
    references,
    group=None,
    kind: str | None = None,
) -> Check:
    """The step's outputs against each layer's own reference of ``kind`` (default: :func:`check_kind` of the
    variant and the model's format). ``references``: {kind: per-layer outputs} for :data:`LAYER_CHECKS`.
    Collective over ``group`` for deepep_ll_fp8 (its reference runs on the fp8-rounded input)."""
    kind = kind or check_kind(variant, m.fmt)
    rel_l2, max_rel, ok = 0.0, 0.0, True
    stats = empty_stats() if kind in FP8_BUDGET_CHECKS else None
    for i, (out, a) in enumerate(zip(outputs, inputs.layers, strict=True)):
        padded = variant == "flashmoe" and a.padding_marker is not None  # an idle rank's dummy step
        if padded:
            ref = torch.zeros_like(out)  # nothing computed, zeros out
        elif kind == "rows":
            ref = expert_rows_reference(a.expert_rows.x, a.expert_rows.sizes, m.w13[i], m.w2[i])
        elif kind == "rows_fp8":
            ref = expert_rows_reference_fp8(a.expert_rows.x, a.expert_rows.sizes, m.w13[i], m.w2[i])
        elif kind == "rows_dequant":
            ref = expert_rows_reference(
                a.expert_rows.x, a.expert_rows.sizes, m.w13[i].as_bf16(), m.w2[i].as_bf16()
            )
        elif kind == "comm":
            ref = deepep_ll.comm_reference(a.x, a.ids, a.weights)
        elif kind == "deepep_fp8_input":
            from flashmoe.reference import moe_reference_distributed

            x8 = deepep_ll.fp8_roundtrip(a.x)
            ref = moe_reference_distributed(x8, a.ids, a.weights, m.w13[i], m.w2[i], m.placement, group)
        else:
            ref = references[kind][i]
        result = compare(out, ref)
        rel_l2, max_rel, ok = max(rel_l2, result.rel_l2), max(max_rel, result.max_rel), ok and result.ok
        if padded and bool(out.count_nonzero()):
            ok = False  # zeros exactly, not zeros within a tolerance
        if stats is not None:
            stats = stats.merge(error_stats(out, ref))
    return Check(rel_l2, max_rel, ok, kind, stats)


def judge(checked: Check, row: dict, m: ModelState, ranks: Ranks) -> str | None:
    """Records the check's errors in ``row``; None if the output passed, else why not. Collective: the
    fp8-budget kinds are judged on every rank's rows together (as the test suite does), the bf16 check
    on each rank's own (any rank failing fails the row)."""
    row["check_against"] = CHECKS[checked.kind]
    if checked.stats is not None:
        stats = reduce_stats(checked.stats, ranks.group, ranks.device)
        row.update(
            check_rel_l2=stats.rel_fro,
            check_max_rel=ranks.max(checked.max_rel),
            check_max_row_rel=stats.max_row_rel,
        )
        if fp8_within(stats, m.shape.intermediate):
            return None
        budget = fp8_budget(m.shape.intermediate)
        return (
            f"output differs from {CHECKS[checked.kind]}: rel_fro {stats.rel_fro:.3g} "
            f"(budget {budget.batch_rel_fro(stats.rows):.3g} for {stats.rows} rows), "
            f"worst row {stats.max_row_rel:.3g} (budget {budget.row_rel:.3g}), non-finite {stats.nonfinite}, "
            f"non-zero in all-skipped rows {stats.nonzero_in_zero_rows}"
        )
    row.update(check_rel_l2=ranks.max(checked.rel_l2), check_max_rel=ranks.max(checked.max_rel))
    if ranks.any(not checked.ok):
        return f"output differs from {CHECKS[checked.kind]} (tolerance rel_l2 {REL_L2_TOL}, max_rel {MAX_REL_TOL})"
    return None


def not_run(row: dict, status: str, reason: str) -> dict:
    """A row that was not timed; ``reason`` goes after the case's own note (e.g. experts cut)."""
    return new_row(**dict(row, note="; ".join(n for n in (row.get("note"), reason) if n)), status=status)


def run_variant(
    ctx: Context, m: ModelState, variant: str, mode: str, sets: list[InputSet], references, base: dict
) -> dict:
    ranks = ctx.ranks
    fn, backend, unavailable = layer_fn(ctx, m, variant, sets[0].layers[0].x.shape[0])
    num_layers = len(sets[0].layers)
    graph = mode == "serving" and ranks.device.type == "cuda" and variant in GRAPH_SAFE
    row = dict(base, variant=variant, backend=backend, mode=mode, layers=num_layers, graph=graph)
    if ranks.any(unavailable is not None):
        return not_run(row, "unavailable", unavailable or "unavailable on another rank")

    def step(s: int) -> list:
        return [fn(i, a) for i, a in enumerate(sets[s].layers)]

    # Capture (serving, GPU) and correctness on input set 0. An exception inside a collective leaves the
    # other ranks waiting in it; the process-group timeout (--timeout-s) then ends the run, with every
    # earlier row on disk.
    err, checked, calls = None, None, None
    try:
        if graph:
            calls, outputs = serving.capture([lambda s=s: step(s) for s in range(len(sets))], ranks.device)
            calls[0]()
            first = outputs[0]
        else:
            calls = [lambda s=s: step(s) for s in range(len(sets))]
            first = calls[0]()
        if not ctx.args.no_check:
            kind = check_kind(variant, m.fmt, ctx.swiglu.impl)
            checked = check_step(variant, first, sets[0], m, references, ranks.group, kind)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"[:500]
    if ranks.any(err is not None):
        return not_run(row, "error", err or "raised on another rank")
    if checked is not None:
        wrong = judge(checked, row, m, ranks)
        if wrong:
            return not_run(row, "wrong", wrong)

    def call(s: int):
        return calls[s]()

    flush = ctx.flush if mode == "flushed" else L2Flusher(ranks.device, enabled=False)
    times = time_calls(call, len(sets), ranks, flush, ctx.policy)
    overhead = {}
    if variant == "flashmoe" and backend == "megakernel" and ctx.args.metrics_overhead and mode == "flushed":
        overhead = metrics_overhead(ctx, ctx.flashmoe.layers[m.shape.name][0], call, len(sets))
    per_layer = [t / num_layers for t in (times.median, times.quantile(0.1), times.quantile(0.9))]
    per_rank = ranks.gather([*per_layer, len(times.seconds)])
    slowest = max(per_rank, key=lambda r: r[0])
    latency = slowest[0]
    notes = [base["note"]] if base["note"] else []
    if backend == "reference":
        notes.append("flashmoe ran its reference backend (no megakernel on this device)")
    if m.fmt is FP8 and variant != "flashmoe" and backend == DEQUANT_MM_LOOP:
        notes.append(
            "no fp8 GEMM: weights dequantised to bf16 on every call, bf16 GEMMs, unquantised activations"
        )
    if mode == "serving" and ranks.device.type == "cuda" and not graph:
        notes.append("host sync inside the layer: not graph-capturable, the serving step ran eagerly")
    # deepep_ll_comm runs no GEMM: no TFLOP/s for it.
    flops = 6.0 * base["gemm_rows"] * base["hidden"] * base["intermediate"] * (variant != deepep_ll.COMM)
    return new_row(
        **dict(row, note="; ".join(notes) or None),
        status="ok",
        latency_us=latency * 1e6,
        latency_p10_us=slowest[1] * 1e6,
        latency_p50_us=latency * 1e6,
        latency_p90_us=slowest[2] * 1e6,
        latency_per_rank_us=[r[0] * 1e6 for r in per_rank],
        iters=int(slowest[3]),
        x_floor=latency * 1e6 / base["floor_us"] if base["floor_us"] else None,
        x_floor_nodedup=latency * 1e6 / base["floor_nodedup_us"] if base["floor_nodedup_us"] else None,
        tflops=flops / latency / 1e12 if latency > 0 and flops else None,
        **overhead,
    )


METRICS_ROUNDS = 6


def metrics_overhead(ctx: Context, layer, call, num_sets: int) -> dict:
    """The kernel's metrics ring on vs off, in alternating rounds so that clock and thermal drift
    fall on both sides alike; medians over all rounds, max over ranks."""
    kernel = layer._kernel
    policy = TimingPolicy(1, ctx.policy.min_iters, ctx.policy.max_iters, ctx.policy.target_s / METRICS_ROUNDS)
    samples = {True: [], False: []}
    try:
        for _ in range(METRICS_ROUNDS):
            for on in (True, False):
                kernel.metrics = on
                samples[on] += time_calls(call, num_sets, ctx.ranks, ctx.flush, policy).seconds
    finally:
        kernel.metrics = True
    on_s = ctx.ranks.max(statistics.median(samples[True]))
    off_s = ctx.ranks.max(statistics.median(samples[False]))
    return {"metrics_on_us": on_s * 1e6, "metrics_off_us": off_s * 1e6, "metrics_overhead": on_s / off_s - 1}


def add_compute_ratios(rows: list[dict]) -> None:
    """tflops_vs_compute_only of each ok row, from the case's compute_only row (same rows, same mode)."""
    co = next(
        (r for r in rows if r["variant"] == "compute_only" and r["status"] == "ok" and r["tflops"]), None
    )
    if co is None:
        return
    for r in rows:
        if r["status"] == "ok" and r["tflops"] and r is not co:
            r["tflops_vs_compute_only"] = r["tflops"] / co["tflops"]


def run_case(ctx: Context, m: ModelState, tokens: int, routing: str) -> list[dict]:
    rows = []
    for mode in ctx.args.mode:
        if ctx.out_of_time():
            break
        rows += run_mode(ctx, m, tokens, routing, mode)
    return rows


def run_mode(ctx: Context, m: ModelState, tokens: int, routing: str, mode: str) -> list[dict]:
    s, ranks = m.shape, ctx.ranks
    num_layers = len(m.w13) if mode == "serving" else 1
    case = make_inputs(ctx, m, tokens, routing, num_layers)
    references = {}
    if not ctx.args.no_check:
        # The whole-layer references the selected variants are checked against, computed once per case
        # (collectives, on every rank in the same order, before any variant runs).
        runnable = [v for v in ctx.args.variants if not (m.fmt is FP8 and v in FP8_NOT_WIRED)]
        for kind in dict.fromkeys(check_kind(v, m.fmt, ctx.swiglu.impl) for v in runnable):
            if kind in LAYER_CHECKS:
                references[kind] = layer_references(kind, m, case.sets[0], ranks.group, ranks.world)
    floor = case.floor
    base = dict(
        model=s.name,
        hidden=s.hidden,
        intermediate=s.intermediate,
        num_experts=s.num_experts,
        model_num_experts=m.model_num_experts,
        top_k=s.top_k,
        dtype=m.fmt.name,
        world_size=ranks.world,
        tokens_per_rank=tokens,
        routing=routing,
        padding_ranks=ctx.args.padding_ranks,
        sets=len(case.sets),
        floor_us=floor.floor_s * 1e6,
        floor_nodedup_us=floor.floor_nodedup_s * 1e6,
        t_gemm_us=floor.gemm_s * 1e6,
        t_weights_us=floor.weights_s * 1e6,
        t_link_us=floor.link_s * 1e6,
        t_link_nodedup_us=floor.link_nodedup_s * 1e6,
        bound=floor.bound,
        load_imbalance=case.imbalance,
        gemm_rows=case.gemm_rows,
        note=m.note or None,
    )
    rows = []
    for variant in ctx.args.variants:
        if ctx.out_of_time():
            break
        row = run_variant(ctx, m, variant, mode, case.sets, references, base)
        rows.append(row)
        lat = (
            f"p50 {row['latency_us']:.1f} us ({row['x_floor']:.2f}x floor), p10-p90 "
            f"{row['latency_p10_us']:.1f}-{row['latency_p90_us']:.1f}"
            if row["status"] == "ok"
            else f"{row['status']}: {row['note']}"
        )
        ctx.log(f"{s.name} T={tokens} {routing} {mode} {variant}: {lat}")
        if ranks.device.type == "cuda":
            torch.cuda.empty_cache()  # a variant's graphs and their pool are gone: give the memory back
    add_compute_ratios(rows)
    return rows


# ------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.max_minutes * 60 if args.max_minutes is not None else math.inf
    group, cpu_group, device = init_distributed(args.device, args.timeout_s)
    ranks = Ranks(group, device)
    lead = ranks.rank == 0
    if not 0 <= args.padding_ranks < ranks.world:
        raise SystemExit(f"--padding-ranks must be in [0, {ranks.world - 1}] at world {ranks.world}")

    def log(msg: str) -> None:
        if lead:
            print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    fmt = weight_format(args)
    gemm_impl, gemm_note = select_grouped_gemm(args.grouped_gemm, device)
    log(f"grouped GEMM: {gemm_impl} ({gemm_note})")
    swiglu = GroupedSwiGLU(gemm_impl)
    fp8_gemm = fp8_gemm_note = None
    if fmt is FP8:
        fp8_gemm, fp8_gemm_note = select_fp8_expert_gemm(args.fp8_gemm, device)
        if ranks.any(fp8_gemm != SCALED_MM_LOOP):  # every rank runs the same expert stage
            if fp8_gemm == SCALED_MM_LOOP:
                fp8_gemm, fp8_gemm_note = DEQUANT_MM_LOOP, "torch._scaled_mm failed its probe on another rank"
        swiglu = Fp8SwiGLU(fp8_gemm)
        log(f"fp8 expert GEMM of the baselines: {fp8_gemm} ({fp8_gemm_note})")
    measured = measure_rates(ranks, fp8=fmt is FP8)
    r = measured.rates
    log(
        f"rates: GEMM {r.gemm_flops / 1e12:.1f} TFLOP/s"
        + (f", fp8 GEMM {r.fp8_gemm_flops / 1e12:.1f} TFLOP/s" if fmt is FP8 else "")
        + f", copy {r.copy_bytes / 1e9:.0f} GB/s, link {r.link_bytes / 1e9:.0f} GB/s ({measured.link_method})"
    )

    machine = machine_info(device, ranks.world)
    out_path = args.out or default_out_path(REPO / "benchmarks" / "results", machine["tag"], dtype=fmt.name)
    doc = {
        "schema": SCHEMA,
        "created": utc_now(),
        "argv": sys.argv,
        "complete": False,
        "stopped_reason": None,
        "elapsed_s": None,
        "machine": machine,
        "software": software_info(REPO, args.commit),
        "env": run_env(),
        "config": {
            "world_size": ranks.world,
            "dtype": "bfloat16" if fmt is BF16 else "fp8",
            "fp8": None
            if fmt is BF16
            else {
                "weights": "float8_e4m3fn w13/w2 with one fp32 scale_inv per 128x128 block (flashmoe.fp8); "
                "generated on the device by tests/moe_inputs.random_fp8_expert_weights",
                "activations": "bfloat16 in and out; the fp8 layer quantises per token and 128-group",
                "expert_gemm": fp8_gemm,
                "expert_gemm_note": fp8_gemm_note,
                # Which weight-scale recipe each model's GEMMs ran with (moe_bench.grouped_gemm.weight_scale_recipe).
                "scaled_mm_weight_scales": {
                    name: {
                        "gemm0 (w13)": weight_scale_recipe(
                            2 * MODELS[name].intermediate, MODELS[name].hidden
                        ),
                        "gemm1 (w2)": weight_scale_recipe(MODELS[name].hidden, MODELS[name].intermediate),
                    }
                    for name in args.models
                }
                if fp8_gemm == SCALED_MM_LOOP
                else None,
                "not_wired": sorted(v for v in FP8_NOT_WIRED if v in args.variants),
                "floor_bytes": "weights 1 B/element + fp32 block scales; dispatch rows H·1 B + one fp32 scale per "
                "128-group; combine rows H·2 B (bf16); GEMM at rates.fp8_gemm_tflops",
            },
            "variants": args.variants,
            "modes": args.mode,
            "models": args.models,
            "tokens_per_rank": args.tokens,
            "routings": args.routing,
            "zipf_s": args.zipf_s,
            "padding_ranks": args.padding_ranks,
            "placement": "contiguous",
            "grouped_gemm": gemm_impl,
            "grouped_gemm_note": gemm_note,
            "timing": {
                "warmup": args.warmup,
                "min_iters": args.min_iters,
                "max_iters": args.max_iters,
                "target_ms": args.target_ms,
                "rotate_mib": args.rotate_mib,
                "max_sets": args.max_sets,
                "l2_flush": not args.no_l2_flush,
                "latency": "max over ranks of each rank's median per-call time (CUDA events around each call, after an L2 flush and a stream barrier)",
                "percentiles": "latency_p10/p50/p90_us: the slowest rank's 10th/50th/90th percentile call",
            },
            "serving": None,
            "check": None
            if args.no_check
            else {
                "rel_l2_tol": REL_L2_TOL,
                "max_rel_tol": MAX_REL_TOL,
                "on": "input set 0 of each case",
                "fp8_budgets": None
                if fmt is BF16
                else {
                    "rel_fro": fp8_budget(1)[0],
                    "row_rel": "max(2.5 U, 1.25 / sqrt(I)) (tests/tolerances.py fp8_row_rel)",
                    "min_rows": "max(16, 4 (row_rel / rel_fro)^2): fewer rows are held to row_rel "
                    "(tests/tolerances.py fp8_min_rows_for_batch)",
                    "source": "tests/tolerances.py FP8_SAME_ROUNDING_REL_FRO, fp8_row_rel: a kernel against "
                    "the same-rounding fp8 reference, judged over all ranks' rows",
                },
            },
            "floor": "max(gemm, weights, link) per rank, maxed over ranks; link with dispatch dedup (one row per token and remote rank); floor_nodedup counts one row per token and remote expert; x_floor uses the dedup floor",
            "max_minutes": args.max_minutes,
            "warmup_case": not args.no_warmup_case,
            "seed": args.seed,
        },
        "rates": measured.to_json(),
        "rows": [],
    }

    def save() -> None:
        doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if lead:
            write_json(out_path, doc)

    from flashmoe import ExpertPlacement

    shapes, notes, placements, num_layers = {}, {}, {}, {}
    for name in args.models:
        shapes[name], notes[name], num_layers[name] = fit_experts(MODELS[name], ranks, args)
        placements[name] = ExpertPlacement.contiguous(shapes[name].num_experts, ranks.world)
    if "serving" in args.mode:
        doc["config"]["serving"] = {
            "layers": num_layers,
            "l2_bytes": serving.l2_bytes(device),
            "rule": None
            if args.layers or device.type != "cuda"
            else f"fewest layers >= {args.min_layers} with layers x per-rank weight bytes > {serving.L2_MULTIPLE} x L2",
            "step": "CUDA graph of the layers (graph-safe variants; others eager), no L2 flush; per-layer = step / layers",
        }
        log(f"serving: layers per step {num_layers} (L2 {serving.l2_bytes(device) / 2**20:.0f} MiB)")
    deepep_sizing = None
    if any(v in deepep_ll.VARIANTS for v in args.variants) and fmt is BF16:
        deepep_sizing = prepare_deepep(args, shapes, ranks, log)
    flashmoe_layers = FlashMoELayers()
    if "flashmoe" in args.variants:
        flashmoe_layers = build_flashmoe_layers(
            shapes, placements, num_layers, max(args.tokens), group, cpu_group, ranks, log, fmt
        )
    vllm = (None, None, None)
    if "vllm_fused" in args.variants and fmt is BF16:
        vllm = load_fused_experts(device)
        log(f"vllm_fused: {vllm[2] or f'vllm {vllm[1]} fused_experts'}")
    deepep = (None, None, "not selected")
    if deepep_sizing is not None:
        deepep = create_deepep(deepep_sizing, group, ranks, log)
        doc["config"]["deepep"] = {
            "version": deepep[1],
            "max_tokens": deepep_sizing[2],
            "rdma_bytes": deepep[0].num_rdma_bytes if deepep[0] else None,
            "unavailable": deepep[2],
            "pack_bound": "this rank's received rows, from the routing (see moe_bench/deepep_ll.py)",
        }
    ctx = Context(
        args,
        ranks,
        measured,
        swiglu,
        L2Flusher(device, enabled=not args.no_l2_flush),
        TimingPolicy(args.warmup, args.min_iters, args.max_iters, args.target_ms / 1e3),
        flashmoe_layers,
        vllm,
        deadline,
        log,
        deepep,
    )
    save()

    stopped = None
    for name in args.models:
        if stopped:
            break
        m = make_model(
            shapes[name],
            MODELS[name].num_experts,
            notes[name],
            placements[name],
            group,
            ranks,
            args.seed,
            num_layers[name],
            fmt,
        )
        if name == args.models[0] and not args.no_warmup_case:
            # The first case of a run measured 1.5-2x slow and noisy (2026-11-21, 4xH200, T=1): run
            # it once untimed so lazy first-use costs and clock ramp-up land here, not in a row.
            t0 = time.monotonic()
            run_case(ctx, m, args.tokens[0], args.routing[0])
            log(
                f"warm-up case ({name} T={args.tokens[0]} {args.routing[0]}, rows discarded): {time.monotonic() - t0:.1f} s"
            )
        for tokens in args.tokens:
            for routing in args.routing:
                if ctx.out_of_time():
                    stopped = f"--max-minutes {args.max_minutes} reached before {name} T={tokens} {routing}"
                    break
                doc["rows"] += run_case(ctx, m, tokens, routing)
                save()
            if stopped:
                break
        del m
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if stopped is None and ctx.out_of_time():
        stopped = f"--max-minutes {args.max_minutes} reached during the last case"
    doc["complete"] = stopped is None
    doc["stopped_reason"] = stopped
    save()
    if lead:
        print()
        print(table.text_table(doc["rows"], expert_gemm=fp8_gemm))
        print(
            f"\n{len(doc['rows'])} rows -> {out_path}" + (f"  (stopped: {stopped})" if stopped else ""),
            flush=True,
        )
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
