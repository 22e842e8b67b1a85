"""Rank-side checks of the megakernel against the reference, shared by ``test_megakernel.py`` and
``megakernel_matrix.py``.

A *world run* spawns one process per rank (one process group, NVSHMEM initialised once), reserves the
symmetric buffers for the largest configuration, and runs the selected checks in order, for each weight
dtype of the task (``bf16``, and ``fp8``: block-fp8 experts, e4m3 with one fp32 scale per 128 x 128 block,
drawn by :func:`moe_inputs.random_fp8_expert_weights` with token groups of random magnitude, compared with
:mod:`flashmoe.reference_fp8` under the fp8 budgets of ``tolerances.py``):

* ``matrix``: random configurations (:func:`draw_configs`); each rank's output (``out=`` poisoned with
  NaN first) vs :func:`flashmoe.moe_reference` on the same rows (same rounding) and vs the fp64 oracle.
  A token's output depends only on its own row and the weights, so every rank regenerates the global
  weights from the configuration's seed and checks its own rows: the same comparison as gathering the
  global batch, done in parallel. Error sums are all-reduced, so the record is the global error.
* ``graph``: one CUDA graph captured around the layer, >= 1000 replays with new inputs copied into the
  static tensors before each; every replay must equal the eager output for those inputs bit for bit,
  and every 100th is checked against the reference.
* ``determinism``: the same call repeated (incl. skewed routing with k=8): bitwise equal every time.
* ``stress`` / ``put`` / ``nodes``: a layer built with ``FLASHMOE_STRESS_DELAY_NS`` (random sleeps before
  every signal and wait), ``FLASHMOE_FORCE_PUT=1`` (NVSHMEM put-with-signal to NVLink peers) or
  ``FLASHMOE_NODE_SIZE=W/2`` (two simulated nodes: stores within a half, puts across; W >= 2) must give
  the normal layer's bits.
* ``padding``: the odd ranks, then the even ones, pass a negative ``padding_marker`` (a DP rank's dummy
  step): exact zeros there, the other ranks' rows unaffected; then one CUDA graph with a marker buffer,
  replayed while the set of padding ranks changes: each replay bitwise equal to the eager call of its
  pattern.
* ``timeout`` (its own fresh processes: a timed-out process is poisoned): one rank never calls the layer;
  every other rank must raise FlashMoETimeoutError naming rank, peer and phase within 15 s.

Each rank appends one JSON line per record to ``<out_dir>/rank<r>.jsonl`` as it goes, so a world that
hangs or dies still leaves everything finished before it; :func:`run_world` merges the ranks' lines.
A failing configuration is recorded and the next one runs; a kernel timeout poisons the process, so it
ends the world run (recorded as the world's error). The same code runs on CPU over gloo with the
reference backend (``device="cpu"``), which tests this harness without a GPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from flashmoe import (
    ExpertPlacement,
    FlashMoE,
    FlashMoETimeoutError,
    MoELayerSpec,
    moe_oracle_fp64,
    moe_oracle_fp64_fp8,
    moe_reference,
    moe_reference_fp8,
)
from moe_inputs import (
    PLACEMENTS,
    ROUTINGS,
    make_placement,
    random_expert_weights,
    random_fp8_expert_weights,
    random_grouped_hidden,
    random_hidden,
    random_routing,
    storage_order,
)
from multiproc import RanksTimedOut, apply_rank_env, run_ranks
from tolerances import WEIGHT_DTYPES, Budget, ErrorStats, error_stats, kernel_budgets, repeat_difference

CHECKS = ("matrix", "graph", "determinism", "stress", "put", "nodes", "padding", "timeout")

# The shape grid of issue 3, with draw weights biased toward small values (see draw_configs).
EXPERTS = {8: 0.3, 32: 0.3, 128: 0.25, 256: 0.15}
TOP_K = {1: 0.25, 2: 0.25, 4: 0.25, 8: 0.25}
HIDDEN = {1024: 0.4, 2048: 0.3, 4096: 0.2, 7168: 0.1}
INTERMEDIATE = {256: 0.4, 768: 0.3, 1536: 0.2, 2048: 0.1}
TOKENS = {0: 0.12, 1: 0.2, 7: 0.28, 128: 0.3, 4096: 0.1}
ROUTING = {"uniform": 0.4, "zipf": 0.35, "one_expert": 0.25}
DROP_PROB = {0.0: 0.4, 0.1: 0.4, 0.5: 0.2}
# Tiny grid for running the harness on CPU (reference backend); fp8 needs I a multiple of the 128 block.
TINY = {
    "EXPERTS": {8: 0.5, 16: 0.5},
    "TOP_K": {1: 0.3, 2: 0.4, 4: 0.3},
    "HIDDEN": {128: 0.6, 256: 0.4},
    "INTERMEDIATE": {64: 0.6, 128: 0.4},
    "INTERMEDIATE_FP8": {128: 0.6, 256: 0.4},
    "TOKENS": {0: 0.2, 1: 0.2, 7: 0.3, 33: 0.3},
}
BIG_WEIGHTS_BYTES = 4 << 30  # global weights above this are kept with probability BIG_KEEP
BIG_KEEP = 0.2
MAX_WORLD = 4
TIMEOUT_BOUND_S = 15.0


@dataclass(frozen=True)
class MatrixConfig:
    index: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    tokens: tuple[int, ...]  # per rank of a 4-rank world; a W-rank world takes the first W
    routing: str
    placement: str
    drop_prob: float
    seed: int
    dtype: str = "bf16"  # expert weights: "bf16", or "fp8" (block-fp8; H and I multiples of 128)

    def tokens_for(self, world: int) -> list[int]:
        return list(self.tokens[:world])

    def weight_bytes(self) -> int:
        return _weight_bytes(asdict(self))

    def budgets(self, compare: tuple[str, ...] = ("ref", "oracle")) -> dict[str, Budget]:
        """The :class:`~tolerances.Budget` per comparison, for this configuration's dtype and I."""
        budgets = kernel_budgets(self.dtype, self.intermediate)
        return {against: budgets[against] for against in compare}

    def label(self) -> str:
        return (
            f"{self.dtype} E{self.num_experts} k{self.top_k} H{self.hidden} I{self.intermediate} "
            f"T{'/'.join(map(str, self.tokens))} {self.routing} {self.placement} drop{self.drop_prob}"
        )


def _pick(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def draw_configs(n: int, seed: int, tiny: bool = False, dtype: str = "bf16") -> list[MatrixConfig]:
    """``n`` configurations of ``dtype`` weights drawn with a fixed ``seed``, biased toward small shapes.

    Each dimension is drawn independently from its grid with the weights above (E=8/32 60%, H=1024
    40% ... H=7168 10%, T=4096 10% per rank). A draw whose global weights exceed 4 GiB is kept with
    probability 0.2 and redrawn otherwise, so the 15 GB DeepSeek-sized layers (E=256, H=7168, I=2048:
    22.5 GB with w2) appear rarely. Afterwards every grid value, routing and placement that no draw
    hit is written into a random configuration that stays under 4 GiB, so all of the grid is covered
    once n >= 16. ``tiny`` swaps in a small grid for CPU runs of the harness. Every H and I of the
    full grid is a multiple of 128, so fp8 draws the same shapes as bf16 from the same seed (the 4 GiB
    rule counts bf16 bytes for both).
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {dtype!r}: expected one of {WEIGHT_DTYPES}")
    rng = random.Random(seed)
    grid = {
        "num_experts": TINY["EXPERTS"] if tiny else EXPERTS,
        "top_k": TINY["TOP_K"] if tiny else TOP_K,
        "hidden": TINY["HIDDEN"] if tiny else HIDDEN,
        "intermediate": TINY[f"INTERMEDIATE{'_FP8' if dtype == 'fp8' else ''}"] if tiny else INTERMEDIATE,
        "routing": ROUTING,
        "placement": {p: 1.0 for p in PLACEMENTS},
    }
    tokens_grid = TINY["TOKENS"] if tiny else TOKENS
    configs: list[dict] = []
    while len(configs) < n:
        c = {k: _pick(rng, w) for k, w in grid.items()}
        c["top_k"] = min(c["top_k"], c["num_experts"])
        c["tokens"] = tuple(_pick(rng, tokens_grid) for _ in range(MAX_WORLD))
        c["drop_prob"] = _pick(rng, DROP_PROB)
        if _weight_bytes(c) > BIG_WEIGHTS_BYTES and rng.random() > BIG_KEEP:
            continue
        configs.append(c)
    for key, values in grid.items():
        for value in values:
            if n >= 16 and not any(c[key] == value for c in configs):
                _place(rng, configs, lambda c, k=key, v=value: {**c, k: v})
    if n >= 16:
        for t in tokens_grid:
            if not any(t in c["tokens"] for c in configs):
                slot = rng.randrange(MAX_WORLD)
                _place(
                    rng,
                    configs,
                    lambda c, t=t, s=slot: {**c, "tokens": c["tokens"][:s] + (t,) + c["tokens"][s + 1 :]},
                )
    return [MatrixConfig(index=i, seed=seed * 1_000_003 + i, dtype=dtype, **c) for i, c in enumerate(configs)]


def _weight_bytes(c: dict) -> int:
    """Global w13 + w2 bytes in bf16 (the draw's size rule, the same for both dtypes)."""
    return c["num_experts"] * 3 * c["hidden"] * c["intermediate"] * 2


def _place(rng: random.Random, configs: list[dict], change) -> None:
    for i in rng.sample(range(len(configs)), len(configs)):
        candidate = change(configs[i])
        candidate["top_k"] = min(candidate["top_k"], candidate["num_experts"])
        if _weight_bytes(candidate) <= BIG_WEIGHTS_BYTES:
            configs[i] = candidate
            return


# ---------------------------------------------------------------------------------------------
# One rank's view of a configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class RankCase:
    spec: MoELayerSpec
    placement: ExpertPlacement
    x: torch.Tensor  # this rank's rows
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor  # this rank's experts: a view into w13_all
    w2: torch.Tensor
    w13_all: torch.Tensor  # every expert, rank after rank (storage_order)
    w2_all: torch.Tensor
    ref_placement: ExpertPlacement
    # fp8: the block scales, laid out as the weights (all experts, and this rank's view); None for bf16.
    w13_scale_all: torch.Tensor | None = None
    w2_scale_all: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.topk_ids, self.topk_weights, self.w13, self.w2)

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        """The keyword arguments an fp8 layer takes with every call (none for bf16)."""
        if not self.spec.fp8_weights:
            return {}
        return {"w13_scale_inv": self.w13_scale, "w2_scale_inv": self.w2_scale}

    def reference(self, x=None, topk_ids=None, topk_weights=None) -> torch.Tensor:
        """fp32 reference with the kernel's rounding for this rank's rows (or the given inputs)."""
        x, ids, w = (self.x, self.topk_ids, self.topk_weights) if x is None else (x, topk_ids, topk_weights)
        if self.spec.fp8_weights:
            return moe_reference_fp8(x, ids, w, *self._fp8_weights(), self.ref_placement)
        return moe_reference(x, ids, w, self.w13_all, self.w2_all, self.ref_placement)

    def oracle(self) -> torch.Tensor:
        args = (self.x, self.topk_ids, self.topk_weights)
        if self.spec.fp8_weights:
            return moe_oracle_fp64_fp8(*args, *self._fp8_weights(), self.ref_placement)
        return moe_oracle_fp64(*args, self.w13_all, self.w2_all, self.ref_placement)

    def _fp8_weights(self) -> tuple[torch.Tensor, ...]:
        return self.w13_all, self.w13_scale_all, self.w2_all, self.w2_scale_all


def rank_inputs(
    spec: MoELayerSpec, seed: int, routing: str, drop_prob: float, tokens: list[int], rank: int, device
):
    """This rank's (x, topk_ids, topk_weights) out of a global batch drawn from ``seed``. For fp8 layers
    each (token, 128-group) gets its own magnitude, so a scale applied to the wrong group shows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total, lo = sum(tokens), sum(tokens[:rank])
    ids, w = random_routing(total, spec.num_experts, spec.top_k, routing, gen, device, drop_prob)
    draw = random_grouped_hidden if spec.fp8_weights else random_hidden
    x = draw(total, spec.hidden_size, gen, device)
    rows = slice(lo, lo + tokens[rank])
    return x[rows].contiguous(), ids[rows].contiguous(), w[rows].contiguous()


def build_rank_case(cfg: MatrixConfig, world: int, rank: int, device: torch.device) -> RankCase:
    """Regenerate the configuration's global batch and weights (identical on every rank) and keep this
    rank's rows and experts."""
    tokens = cfg.tokens_for(world)
    placement = make_placement(cfg.placement, cfg.num_experts, world, torch.Generator().manual_seed(cfg.seed))
    ref_placement, offsets = storage_order(placement)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    fp8 = cfg.dtype == "fp8"
    spec = MoELayerSpec(
        cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, max(1, max(tokens)),
        weight_dtype=torch.float8_e4m3fn if fp8 else None,
    )  # fmt: skip
    mine = slice(offsets[rank], offsets[rank + 1])
    if fp8:
        w13_all, s13_all, w2_all, s2_all = random_fp8_expert_weights(
            cfg.num_experts, cfg.hidden, cfg.intermediate, gen, device
        )
        scales = dict(
            w13_scale_all=s13_all, w2_scale_all=s2_all, w13_scale=s13_all[mine], w2_scale=s2_all[mine]
        )
    else:
        w13_all, w2_all = random_expert_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, gen, device)
        scales = {}
    x, ids, w = rank_inputs(spec, cfg.seed + 1, cfg.routing, cfg.drop_prob, tokens, rank, device)
    return RankCase(
        spec, placement, x, ids, w, w13_all[mine], w2_all[mine], w13_all, w2_all, ref_placement, **scales
    )


# ---------------------------------------------------------------------------------------------
# Rank process plumbing
# ---------------------------------------------------------------------------------------------


@dataclass
class RankContext:
    rank: int
    world: int
    device: torch.device
    store: dist.Store
    out_dir: Path
    cuda: bool = field(init=False)

    def __post_init__(self):
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for the kernels; raise FlashMoETimeoutError if one timed out."""
        if self.cuda:
            from flashmoe import megakernel

            megakernel.synchronize_and_check()

    def write(self, record: dict) -> None:
        with open(self.out_dir / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def init_rank(
    rank: int, world: int, port: int, device_kind: str, out_dir: str, env: dict | None = None
) -> RankContext:
    apply_rank_env(env)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 GEMMs, not TF32
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120), device_id=device
        )
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
    return RankContext(rank, world, device, store, Path(out_dir))


def make_layer(ctx: RankContext, case: RankCase, name: str, env: dict | None = None) -> FlashMoE:
    """Construct a layer (collective) with ``env`` set only while it is built (variants are fixed then)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        layer = FlashMoE(case.spec, case.placement, layer_name=name)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if ctx.cuda and layer.backend != "megakernel":
        raise AssertionError(
            f"backend is {layer.backend!r} ({layer.reason}); the GPU suites test the megakernel"
        )
    return layer


def run_layer(layer: FlashMoE, x, ids, w, w13, w2, **kwargs) -> torch.Tensor:
    """One call into an ``out=`` poisoned with NaN, so unwritten rows show up as non-finite. ``kwargs``:
    an fp8 layer's ``w13_scale_inv``/``w2_scale_inv`` (:attr:`RankCase.scales`), a ``padding_marker``."""
    out = torch.full_like(x, float("nan"))
    got = layer(x, ids, w, w13, w2, out=out, **kwargs)
    if got is not out:
        raise AssertionError("FlashMoE did not return the out= tensor it was given")
    return out


class WorldAborted(RuntimeError):
    """A kernel timed out on some rank: flashmoe state is poisoned, the world run ends."""


def _reduce_stats(ctx: RankContext, stats: ErrorStats) -> ErrorStats:
    sums, maxima = stats.as_tensor(ctx.device)
    dist.all_reduce(sums, dist.ReduceOp.SUM)
    dist.all_reduce(maxima, dist.ReduceOp.MAX)
    return ErrorStats.from_tensors(sums, maxima)


def _stats_fields(prefix: str, s: ErrorStats) -> dict:
    return {
        f"rel_err_{prefix}": s.rel_fro,
        f"row_rel_err_{prefix}": s.max_row_rel,
        f"max_abs_err_{prefix}": s.max_abs,
        f"nonfinite_{prefix}": s.nonfinite,
        f"nonzero_in_skipped_rows_{prefix}": s.nonzero_in_zero_rows,
    }


def finish(
    ctx: RankContext,
    record: dict,
    error: str | None,
    poisoned: bool,
    stats: dict[str, ErrorStats],
    passed: bool,
    budgets: dict[str, Budget],
) -> dict:
    """Collective: agree on errors and global error measures across ranks, then write this rank's line.

    The verdict is global: no rank failed or erred, and the all-reduced errors are within ``budgets``
    (comparison -> :class:`~tolerances.Budget`, :meth:`MatrixConfig.budgets`)."""
    flags = torch.tensor(
        [float(error is not None or not passed), float(poisoned)], dtype=torch.float64, device=ctx.device
    )
    dist.all_reduce(flags, dist.ReduceOp.MAX)
    reduced = {p: _reduce_stats(ctx, stats.get(p, ErrorStats())) for p in budgets}  # same calls on every rank
    for prefix, s in reduced.items():
        record.update(_stats_fields(prefix, s))
    within = all(reduced[p].within(*budget) for p, budget in budgets.items())
    record.update(rank=ctx.rank, rank_error=error, passed=not bool(flags[0]) and within)
    ctx.write(record)
    if bool(flags[1]):
        raise WorldAborted(
            f"a kernel timed out during {record['check']} #{record.get('index')}: {error or 'on another rank'}"
        )
    return record


def guarded(ctx: RankContext, record: dict, body, budgets: dict[str, Budget]) -> dict:
    """Run ``body() -> (stats, passed, extra)``, catching any error; then :func:`finish` collectively."""
    t0 = time.perf_counter()
    error, poisoned, stats, passed = None, False, {}, False
    try:
        stats, passed, extra = body()
        record.update(extra)
    except FlashMoETimeoutError as e:
        error, poisoned = f"FlashMoETimeoutError: {e}", True
    except Exception as e:  # recorded; the next configuration runs
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    if ctx.cuda:
        torch.cuda.empty_cache()
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return finish(ctx, record, error, poisoned, stats, passed, budgets)


def new_record(check: str, ctx: RankContext, cfg: MatrixConfig, **extra) -> dict:
    return {
        "check": check,
        "world": ctx.world,
        "dtype": cfg.dtype,
        "index": cfg.index,
        "label": cfg.label(),
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# Checks (every rank runs the same sequence of collective calls)
# ---------------------------------------------------------------------------------------------


def check_matrix_config(ctx: RankContext, cfg: MatrixConfig) -> dict:
    record = new_record("matrix", ctx, cfg, config=asdict(cfg))

    def body():
        case = build_rank_case(cfg, ctx.world, ctx.rank, ctx.device)
        layer = make_layer(ctx, case, f"matrix{cfg.index}_{cfg.dtype}")
        out = run_layer(layer, *case.inputs, **case.scales)
        ctx.sync()
        stats = {"ref": error_stats(out, case.reference()), "oracle": error_stats(out, case.oracle())}
        return stats, True, {"backend": layer.backend}

    return guarded(ctx, record, body, cfg.budgets())


# Every H and I here is a multiple of 128: the same configurations serve both dtypes.
GRAPH_CONFIG = MatrixConfig(-1, 32, 4, 2048, 768, (128, 64, 96, 1), "zipf", "round_robin", 0.1, seed=0)
DETERMINISM_CONFIGS = (
    MatrixConfig(-2, 32, 8, 2048, 768, (512, 130, 0, 77), "one_expert", "random_permutation", 0.1, seed=0),
    MatrixConfig(-3, 128, 8, 1024, 256, (128, 128, 128, 128), "zipf", "contiguous", 0.0, seed=0),
    MatrixConfig(-4, 8, 1, 4096, 1536, (7, 1, 0, 33), "uniform", "round_robin", 0.5, seed=0),
)
VARIANT_CONFIGS = DETERMINISM_CONFIGS[:2] + (
    MatrixConfig(-5, 256, 8, 1024, 256, (256, 3, 64, 0), "zipf", "random_permutation", 0.1, seed=0),
)


def shrink(cfg: MatrixConfig, tiny: bool) -> MatrixConfig:
    """The fixed configurations cut down for CPU runs of the harness (same routing and placement)."""
    if not tiny:
        return cfg
    tokens = tuple(min(t, 33) for t in cfg.tokens)
    return replace(
        cfg,
        num_experts=min(cfg.num_experts, 16),
        top_k=min(cfg.top_k, 4),
        hidden=128,
        intermediate=128 if cfg.dtype == "fp8" else 64,
        tokens=tokens,
    )


def fixed(cfg: MatrixConfig, seed: int, dtype: str, tiny: bool = False) -> MatrixConfig:
    """A fixed configuration as a check runs it: ``dtype`` weights, inputs from ``seed``."""
    return shrink(replace(cfg, seed=seed, dtype=dtype), tiny)


def capture_graph(ctx: RankContext, call, warmups: int) -> torch.cuda.CUDAGraph:
    """``call`` run ``warmups`` times on a side stream (as torch's capture recipe asks), every rank synced,
    then captured into a graph."""
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    ctx.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def check_graph(
    ctx: RankContext,
    seed: int,
    replays: int,
    dtype: str = "bf16",
    input_sets: int = 8,
    check_every: int = 100,
) -> dict:
    cfg = fixed(GRAPH_CONFIG, seed, dtype)
    record = new_record("graph", ctx, cfg, replays=replays)
    tokens = cfg.tokens_for(ctx.world)

    def body():
        if not ctx.cuda:
            raise RuntimeError("CUDA graphs need a GPU")
        case = build_rank_case(cfg, ctx.world, ctx.rank, ctx.device)
        layer = make_layer(ctx, case, f"graph_{dtype}")
        weights = (case.w13, case.w2)
        routings = ROUTINGS * input_sets
        sets = [
            rank_inputs(case.spec, seed + 100 + s, routings[s], 0.1, tokens, ctx.rank, ctx.device)
            for s in range(input_sets)
        ]
        eager = [run_layer(layer, *inp, *weights, **case.scales) for inp in sets]
        ctx.sync()
        refs = [case.reference(*inp) for inp in sets]
        stats = {"ref": ErrorStats()}
        for out, ref in zip(eager, refs, strict=True):
            stats["ref"] = stats["ref"].merge(error_stats(out, ref))
        static = [t.clone() for t in sets[0]]
        static_out = torch.empty_like(static[0])
        graph = capture_graph(ctx, lambda: layer(*static, *weights, out=static_out, **case.scales), warmups=3)
        order = random.Random(seed).choices(range(input_sets), k=replays)
        for i in range(1, replays):  # a different input set on every replay
            if order[i] == order[i - 1]:
                order[i] = (order[i] + 1) % input_sets
        mismatched = torch.zeros((), dtype=torch.int64, device=ctx.device)
        for i, s in enumerate(order):
            for dst, src in zip(static, sets[s], strict=True):
                dst.copy_(src)
            static_out.fill_(float("nan"))
            graph.replay()
            mismatched += (static_out != eager[s]).any()
            if i % check_every == 0 or i == replays - 1:
                stats["ref"] = stats["ref"].merge(error_stats(static_out, refs[s]))
        ctx.sync()
        n_bad = int(mismatched)
        return stats, n_bad == 0, {"replays_not_bitwise_eager": n_bad}

    return guarded(ctx, record, body, cfg.budgets(("ref",)))


def runs_differing(layer, case: RankCase, expected: torch.Tensor, reference: torch.Tensor, runs: int):
    """Call ``layer`` on ``case``'s inputs ``runs`` times: how many outputs differ from ``expected`` in any bit,
    and where the first one did (``{"first_difference": tolerances.repeat_difference(...)}``, or ``{}``)."""
    differing, where = 0, {}
    for _ in range(runs):
        got = run_layer(layer, *case.inputs, **case.scales)
        if not torch.equal(got, expected):
            differing += 1
            where = where or {"first_difference": repeat_difference(expected, got, reference, case.topk_ids)}
    return differing, where


def check_determinism(
    ctx: RankContext, seed: int, tiny: bool = False, dtype: str = "bf16", repeats: int = 5
) -> list[dict]:
    records = []
    for cfg in DETERMINISM_CONFIGS:
        cfg = fixed(cfg, seed + cfg.index, dtype, tiny)
        record = new_record("determinism", ctx, cfg, repeats=repeats)

        def body(cfg=cfg):
            case = build_rank_case(cfg, ctx.world, ctx.rank, ctx.device)
            layer = make_layer(ctx, case, f"determinism{cfg.index}_{dtype}")
            first = run_layer(layer, *case.inputs, **case.scales)
            reference = case.reference()
            differing, where = runs_differing(layer, case, first, reference, repeats - 1)
            ctx.sync()
            stats = {"ref": error_stats(first, reference)}
            return stats, differing == 0, {"repeats_differing": differing, **where}

        records.append(guarded(ctx, record, body, cfg.budgets(("ref",))))
    return records


def check_variant(
    ctx: RankContext,
    check: str,
    env: dict,
    seed: int,
    tiny: bool = False,
    dtype: str = "bf16",
    repeats: int = 3,
) -> list[dict]:
    """A layer built with ``env`` must reproduce the normal layer's output bit for bit."""
    records = []
    for cfg in VARIANT_CONFIGS:
        cfg = fixed(cfg, seed + cfg.index, dtype, tiny)
        record = new_record(check, ctx, cfg, env=env)

        def body(cfg=cfg):
            case = build_rank_case(cfg, ctx.world, ctx.rank, ctx.device)
            normal = make_layer(ctx, case, f"{check}{cfg.index}_{dtype}_normal")
            variant = make_layer(ctx, case, f"{check}{cfg.index}_{dtype}_variant", env)
            expected = run_layer(normal, *case.inputs, **case.scales)
            reference = case.reference()
            differing, where = runs_differing(variant, case, expected, reference, repeats)
            ctx.sync()
            stats = {"ref": error_stats(expected, reference)}
            return stats, differing == 0, {"runs_differing": differing, "runs": repeats, **where}

        records.append(guarded(ctx, record, body, cfg.budgets(("ref",))))
    return records


def check_padding(
    ctx: RankContext, seed: int, tiny: bool = False, dtype: str = "bf16", replays: int = 40
) -> dict:
    """Padding calls (``padding_marker`` with a negative first entry: a DP rank's dummy step). Two
    patterns, the odd ranks padding and then the even ones: a padding rank must get exact zeros, the others
    what their own rows give (a rank's outputs never depend on other ranks' tokens). Then one CUDA graph
    with a marker buffer, replayed while the pattern changes: each replay must equal the eager call of its
    pattern bit for bit (the marker is read on the device at replay, not baked into the capture)."""
    cfg = fixed(DETERMINISM_CONFIGS[0], seed, dtype, tiny)
    record = new_record("padding", ctx, cfg, replays=replays if ctx.cuda else 0)

    def marker(pads: bool) -> torch.Tensor:
        return torch.tensor([-1 if pads else 3], dtype=torch.int64, device=ctx.device)

    def body():
        case = build_rank_case(cfg, ctx.world, ctx.rank, ctx.device)
        layer = make_layer(ctx, case, f"padding_{dtype}")
        # Pattern p pads rank r when (r + p) is odd, so rank 0 pads in pattern 1 and the others take turns.
        patterns = [(ctx.rank + p) % 2 == 1 for p in range(2)]
        eager = [run_layer(layer, *case.inputs, **case.scales, padding_marker=marker(m)) for m in patterns]
        ctx.sync()
        ref, zeros = case.reference(), torch.zeros_like(case.x)
        stats = {"ref": ErrorStats()}
        for out, pads in zip(eager, patterns, strict=True):
            stats["ref"] = stats["ref"].merge(error_stats(out, zeros if pads else ref))
        mismatched = 0
        if ctx.cuda:
            static_marker = marker(patterns[0])
            static_out = torch.empty_like(case.x)
            graph = capture_graph(
                ctx,
                lambda: layer(*case.inputs, out=static_out, **case.scales, padding_marker=static_marker),
                warmups=1,
            )
            bad = torch.zeros((), dtype=torch.int64, device=ctx.device)
            for i in range(replays):
                p = random.Random(seed + i).randrange(2)  # the same draw on every rank
                static_marker.copy_(marker(patterns[p]))
                static_out.fill_(float("nan"))
                graph.replay()
                bad += (static_out != eager[p]).any()
            ctx.sync()
            mismatched = int(bad)
        return stats, mismatched == 0, {"replays_not_bitwise_eager": mismatched}

    return guarded(ctx, record, body, cfg.budgets(("ref",)))


def world_worker(rank: int, world: int, port: int, task: dict, out_dir: str) -> None:
    """Rank entry point of a world run: every check in ``task["checks"]`` except ``timeout``, the matrix
    over ``task["configs"]`` (each with its dtype), the fixed-configuration checks once per dtype of
    ``task["dtypes"]``."""
    ctx = init_rank(rank, world, port, task["device"], out_dir)
    try:
        configs = [MatrixConfig(**{**c, "tokens": tuple(c["tokens"])}) for c in task["configs"]]
        dtypes = task.get("dtypes", ["bf16"])
        if ctx.cuda:
            from flashmoe import megakernel

            every = configs + list(DETERMINISM_CONFIGS) + list(VARIANT_CONFIGS) + [GRAPH_CONFIG]
            megakernel.reserve(
                max(max(c.tokens_for(world)) for c in every) or 1,
                max(c.hidden for c in every),
                max(c.intermediate for c in every),
                max(c.top_k for c in every),
                max(c.num_experts for c in every),
            )
        checks, seed, tiny = task["checks"], task["seed"], task.get("tiny", False)
        if "matrix" in checks:
            for cfg in configs:
                check_matrix_config(ctx, cfg)
        for dtype in dtypes:
            if "graph" in checks:
                check_graph(ctx, seed, task["graph_replays"], dtype)
            if "determinism" in checks:
                check_determinism(ctx, seed, tiny, dtype)
            if "stress" in checks:
                stress_env = {"FLASHMOE_STRESS_DELAY_NS": str(task["stress_delay_ns"])}
                check_variant(ctx, "stress", stress_env, seed, tiny, dtype)
            if "put" in checks:
                check_variant(ctx, "put", {"FLASHMOE_FORCE_PUT": "1"}, seed, tiny, dtype)
            if "nodes" in checks and world >= 2:
                check_variant(ctx, "nodes", {"FLASHMOE_NODE_SIZE": str(world // 2)}, seed, tiny, dtype)
            if "padding" in checks:
                check_padding(ctx, seed, tiny, dtype)
        dist.barrier()
    except WorldAborted as e:
        # Poisoned: skip NCCL/NVSHMEM teardown, which may wait on the peer that never came.
        print(f"rank {rank}: {e}", flush=True)
        os._exit(3)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Timeout: its own processes, one rank never calls the layer
# ---------------------------------------------------------------------------------------------


def timeout_worker(rank: int, world: int, port: int, task: dict, out_dir: str) -> None:
    """``task["timeout_dtype"]`` (default bf16): the weight dtype of the layer that times out."""
    ctx = init_rank(
        rank, world, port, task["device"], out_dir, {"FLASHMOE_TIMEOUT_MS": str(task["timeout_ms"])}
    )
    silent = world - 1
    dtype = task.get("timeout_dtype", "bf16")
    result = {
        "check": "timeout",
        "world": world,
        "dtype": dtype,
        "rank": rank,
        "silent_rank": silent,
        "timeout_ms": task["timeout_ms"],
    }
    cfg = fixed(VARIANT_CONFIGS[0], task["seed"], dtype)
    try:
        case = build_rank_case(cfg, world, rank, ctx.device)
        layer = make_layer(ctx, case, f"timeout_{dtype}")
        inputs = case.inputs
        # One good call first: build and first-launch costs stay out of the bound.
        run_layer(layer, *inputs, **case.scales)
        ctx.sync()
        dist.barrier()
        if rank != silent:
            t0 = time.monotonic()
            try:
                run_layer(layer, *inputs, **case.scales)
                ctx.sync()
                result["error"] = "no FlashMoETimeoutError although a peer never called the layer"
            except FlashMoETimeoutError as e:
                result["message"] = str(e)
            result["seconds"] = round(time.monotonic() - t0, 3)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    ctx.write(result)
    # Leave without NVSHMEM/NCCL teardown (poisoned state); the silent rank stays until all are done.
    try:
        ctx.store.set(f"timeout_done{rank}", "1")
        ctx.store.wait([f"timeout_done{r}" for r in range(world)], timedelta(seconds=60))
    except Exception:
        pass
    os._exit(0)


def judge_timeout(results: list[dict], world: int, bound_s: float = TIMEOUT_BOUND_S) -> dict:
    """Every calling rank raised in time, naming itself, a peer and a phase; someone names the silent rank."""
    from flashmoe.megakernel import PHASES

    silent = world - 1
    problems, named_silent = [], False
    by_rank = {r["rank"]: r for r in results}
    for rank in range(world):
        r = by_rank.get(rank)
        if r is None:
            problems.append(f"rank {rank}: no result (died or hung)")
            continue
        if r.get("error"):
            problems.append(f"rank {rank}: {r['error']}")
            continue
        if rank == silent:
            continue
        msg = r.get("message", "")
        if r["seconds"] > bound_s:
            problems.append(f"rank {rank}: raised after {r['seconds']:.1f} s (bound {bound_s:.0f} s)")
        if not re.search(rf"\brank {rank}\b", msg):
            problems.append(f"rank {rank}: message does not name its rank: {msg!r}")
        peers = [int(p) for p in re.findall(r"\bpeer(?: rank)?\W{0,3}(\d+)", msg)]
        if not peers:
            problems.append(f"rank {rank}: message names no peer: {msg!r}")
        named_silent |= silent in peers
        if not any(p in msg for p in PHASES.values()):
            problems.append(f"rank {rank}: message names no phase ({sorted(PHASES.values())}): {msg!r}")
    if not problems and not named_silent:
        problems.append(f"no rank's message names the silent rank {silent}")
    dtype = next((r["dtype"] for r in results if "dtype" in r), None)
    return {"check": "timeout", "world": world, "dtype": dtype, "index": 0, "passed": not problems,
            "error": "; ".join(problems) or None, "ranks": results}  # fmt: skip


def run_timeout_check(world: int, task: dict, out_dir: Path, limit_s: float = 90.0) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        run_ranks(timeout_worker, world, (task, str(out_dir)), timeout=limit_s)
        error = None
    except RanksTimedOut as e:
        error = f"hang: {e}"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    verdict = judge_timeout(read_rank_lines(out_dir, world), world)
    if error:
        verdict.update(passed=False, error=f"{error}; {verdict['error'] or ''}".rstrip("; "))
    verdict["seconds"] = round(time.monotonic() - t0, 3)
    return verdict


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


def read_rank_lines(out_dir: Path, world: int) -> list[dict]:
    lines = []
    for r in range(world):
        path = out_dir / f"rank{r}.jsonl"
        if path.exists():
            lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def merge_records(lines: list[dict]) -> list[dict]:
    """One record per (check, dtype, index): the global numbers (identical on every rank after the
    all-reduce) from the lowest rank, pass only if every rank passed, every rank's error and failed repeat
    (``first_difference``) listed by rank."""
    merged: dict[tuple, dict] = {}
    for line in sorted(lines, key=lambda r: r["rank"]):
        key = (line["check"], line.get("dtype"), line.get("index"))
        per_rank = ("rank", "rank_error", "first_difference")
        rec = merged.setdefault(key, {**{k: v for k, v in line.items() if k not in per_rank}, "errors": {}})
        rec["passed"] = rec["passed"] and line["passed"]
        if line.get("rank_error"):
            rec["errors"][str(line["rank"])] = line["rank_error"]
        # Where this rank's output failed to repeat (tolerances.repeat_difference).
        if line.get("first_difference"):
            rec.setdefault("first_difference_by_rank", {})[str(line["rank"])] = line["first_difference"]
    return list(merged.values())


def run_world(world: int, task: dict, out_dir: Path, limit_s: float) -> dict:
    """Spawn ``world`` ranks running ``task``'s checks; never raises, never outlives ``limit_s``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    error = None
    try:
        run_ranks(world_worker, world, (task, str(out_dir)), timeout=limit_s)
    except RanksTimedOut as e:
        error = f"hang: {e}"
    except Exception as e:  # a rank died: ProcessRaisedException carries its traceback
        error = f"{type(e).__name__}: {str(e)[-3000:]}"
    records = merge_records(read_rank_lines(out_dir, world))
    return {"world": world, "error": error, "seconds": round(time.monotonic() - t0, 1), "records": records}
