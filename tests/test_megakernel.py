"""The megakernel against the reference (issue 3), on 1, 2 and 4 GPUs, plus CPU tests of the harness.

GPU tests (marked ``gpu``; skipped without sm_90 GPUs, or with fewer GPUs than the world size) run
through the same rank code as ``tests/megakernel_matrix.py`` (``megakernel_cases.py``): one process
group per world size runs every configuration and check once per module, for bf16 and for block-fp8
experts (issue 15: e4m3 weights with 128 x 128 block scales, against ``flashmoe.reference_fp8``); each
test asserts on its part of the records. Inputs and shapes are drawn from the session seed (in the
report header). Budgets: ``tolerances.py``. The timeout test uses its own processes (a timed-out
process is poisoned).

CPU tests check that the harness runs and that its verdicts can fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SESSION_SEED
from megakernel_cases import (
    CHECKS,
    EXPERTS,
    HIDDEN,
    INTERMEDIATE,
    TINY,
    TOKENS,
    TOP_K,
    MatrixConfig,
    draw_configs,
    judge_timeout,
    merge_records,
    run_timeout_check,
    run_world,
)
from tolerances import SAME_ROUNDING_ROW_REL, WEIGHT_DTYPES, ErrorStats, error_stats

GPU_CONFIGS = {"bf16": 50, "fp8": 16}  # fp8: its float64 block reference is the slow part
WORLD_LIMIT_S = 900
TIMEOUT_MS = 2000


def gpu_skip_reason(world: int) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (the megakernel suites need sm_90 GPUs)"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor}; the megakernel is built for sm_90a"
    if torch.cuda.device_count() < world:
        return f"needs {world} GPUs, this machine has {torch.cuda.device_count()}"
    return None


def require_gpus(world: int) -> None:
    reason = gpu_skip_reason(world)
    if reason:
        pytest.skip(reason)


def gpu_task(configs, dtypes=WEIGHT_DTYPES) -> dict:
    return {
        "device": "cuda",
        "checks": [c for c in CHECKS if c != "timeout"],
        "configs": [vars(c) | {"tokens": list(c.tokens)} for c in configs],
        "dtypes": list(dtypes),
        "seed": SESSION_SEED,
        "tiny": False,
        "graph_replays": 1000,
        "stress_delay_ns": 2000,
        "timeout_ms": TIMEOUT_MS,
    }


_WORLD_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    """world -> run_world result, run once per module (all configurations and checks, both dtypes)."""

    def get(world: int) -> dict:
        require_gpus(world)
        if world not in _WORLD_RUNS:
            configs = [c for d in WEIGHT_DTYPES for c in draw_configs(GPU_CONFIGS[d], SESSION_SEED, dtype=d)]
            _WORLD_RUNS[world] = run_world(
                world, gpu_task(configs), tmp_path_factory.mktemp(f"world{world}"), WORLD_LIMIT_S
            )
        result = _WORLD_RUNS[world]
        assert result["error"] is None, f"world {world} aborted: {result['error']}"
        return result

    return get


def failures(records: list[dict]) -> str:
    lines = []
    for r in records:
        if not r["passed"]:
            errs = "; ".join(f"rank {k}: {v.splitlines()[0]}" for k, v in r.get("errors", {}).items())
            nums = ", ".join(
                f"{k}={v:.3g}" for k, v in r.items() if k.startswith(("rel_err", "row_rel")) and v is not None
            )
            lines.append(f"#{r['index']} {r.get('label', '')}: {errs or 'over budget'} ({nums})")
    return "\n".join(lines)


def records_of(result: dict, check: str, dtype: str) -> list[dict]:
    return [r for r in result["records"] if r["check"] == check and r["dtype"] == dtype]


WORLDS = [1, 2, 4]


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_matrix_matches_reference(world, dtype, world_run):
    recs = records_of(world_run(world), "matrix", dtype)
    assert len(recs) == GPU_CONFIGS[dtype], f"only {len(recs)} of {GPU_CONFIGS[dtype]} configurations ran"
    bad = failures(recs)
    assert not bad, f"world {world}: {bad}"
    worst = max(recs, key=lambda r: r["rel_err_oracle"])
    print(
        f"world {world} {dtype}: worst rel err vs fp64 oracle {worst['rel_err_oracle']:.3e} ({worst['label']})"
    )


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_cuda_graph_replays_match_eager_and_reference(world, dtype, world_run):
    (rec,) = records_of(world_run(world), "graph", dtype)
    assert rec["replays"] >= 1000
    assert rec["passed"], failures([rec])
    assert rec["replays_not_bitwise_eager"] == 0


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_repeated_calls_are_bitwise_identical(world, dtype, world_run):
    recs = records_of(world_run(world), "determinism", dtype)
    assert recs and all(r["repeats_differing"] == 0 for r in recs), failures(recs)
    assert all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_stress_build_is_bitwise_identical(world, dtype, world_run):
    recs = records_of(world_run(world), "stress", dtype)
    assert recs and all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_forced_put_path_is_bitwise_identical(world, dtype, world_run):
    recs = records_of(world_run(world), "put", dtype)
    assert recs and all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_two_simulated_nodes_are_bitwise_identical(world, dtype, world_run):
    """FLASHMOE_NODE_SIZE=W/2: NVLink stores within each half of the ranks, NVSHMEM puts across."""
    recs = records_of(world_run(world), "nodes", dtype)
    assert recs and all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_padding_calls_send_nothing_get_zeros_and_follow_the_marker_under_graphs(world, dtype, world_run):
    """padding_marker < 0 (a DP rank's dummy step): zeros there, the other ranks' rows unaffected, and a
    captured graph follows the marker's value at every replay."""
    recs = records_of(world_run(world), "padding", dtype)
    assert recs and all(r["passed"] for r in recs), failures(recs)
    assert all(r["replays_not_bitwise_eager"] == 0 and r["replays"] > 0 for r in recs)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_missing_rank_raises_timeout_naming_rank_peer_phase(world, dtype, tmp_path):
    require_gpus(world)
    task = gpu_task([]) | {"timeout_ms": TIMEOUT_MS, "timeout_dtype": dtype}
    verdict = run_timeout_check(world, task, tmp_path, limit_s=120)
    assert verdict["passed"], verdict["error"]
    assert verdict["dtype"] == dtype


# ---------------------------------------------------------------------------------------------
# CPU: the harness itself
# ---------------------------------------------------------------------------------------------


def test_gpu_tests_skip_with_a_reason_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "CUDA is not available" in gpu_skip_reason(1)


def test_config_draw_is_reproducible_covers_the_grid_and_favours_small_shapes():
    a, b = draw_configs(60, 0), draw_configs(60, 0)
    assert a == b and draw_configs(60, 1) != a
    for values, get in [
        (EXPERTS, lambda c: [c.num_experts]),
        (TOP_K, lambda c: [c.top_k]),
        (HIDDEN, lambda c: [c.hidden]),
        (INTERMEDIATE, lambda c: [c.intermediate]),
        (TOKENS, lambda c: list(c.tokens)),
    ]:
        seen = {v for c in a for v in get(c)}
        assert seen == set(values), (sorted(seen), sorted(values))
    for routing in ("uniform", "zipf", "one_expert"):
        assert any(c.routing == routing for c in a)
    big = [c for c in a if c.weight_bytes() > 4 << 30]
    assert len(big) <= 12, f"{len(big)} of 60 configurations carry more than 4 GiB of weights"
    assert all(c.weight_bytes() <= 24 << 30 for c in a)
    assert all(c.top_k <= c.num_experts for c in a)


def test_fp8_configs_fit_the_block_and_get_the_fp8_budgets():
    """fp8 draws (full and tiny grids) have H and I multiples of the 128 block, are labelled fp8 and are
    judged by the fp8 budgets, which pass an error the bf16 ones fail."""
    fp8 = draw_configs(24, 0, dtype="fp8")
    assert all(c.dtype == "fp8" and c.label().startswith("fp8 ") for c in fp8)
    assert {c.hidden for c in fp8} == set(HIDDEN) and {c.intermediate for c in fp8} == set(INTERMEDIATE)
    tiny = draw_configs(16, 0, tiny=True, dtype="fp8")
    assert {c.intermediate for c in tiny} == set(TINY["INTERMEDIATE_FP8"])
    assert all(c.hidden % 128 == 0 and c.intermediate % 128 == 0 for c in fp8 + tiny)
    with pytest.raises(ValueError, match="weight dtype 'fp4'"):
        draw_configs(4, 0, dtype="fp4")
    bf16 = MatrixConfig(0, 8, 2, 1024, 256, (7,), "uniform", "contiguous", 0.0, seed=0)
    fp8_cfg = MatrixConfig(0, 8, 2, 1024, 256, (7,), "uniform", "contiguous", 0.0, seed=0, dtype="fp8")
    typical_fp8_error = ErrorStats(err_sq=(5e-3) ** 2, ref_sq=1.0, max_row_rel=1e-2, rows=64)
    assert typical_fp8_error.within(*fp8_cfg.budgets()["ref"]) and typical_fp8_error.within(
        *fp8_cfg.budgets()["oracle"]
    )
    assert not typical_fp8_error.within(*bf16.budgets()["ref"])


@pytest.mark.timeout(200)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU harness check; on a GPU machine FlashMoE picks the megakernel"
)
def test_harness_runs_on_cpu_with_reference_backend(tmp_path):
    """The GPU runner's rank code, over gloo with the CPU reference backend, for both weight dtypes: all
    checks pass and the records carry the fields the report needs."""
    configs = [c for d in WEIGHT_DTYPES for c in draw_configs(4, SESSION_SEED, tiny=True, dtype=d)]
    task = gpu_task(configs) | {
        "device": "cpu",
        "tiny": True,
        "checks": ["matrix", "determinism", "stress", "put", "nodes", "padding"],
    }
    result = run_world(2, task, tmp_path, limit_s=150)
    assert result["error"] is None, result["error"]
    assert all(r["passed"] for r in result["records"]), failures(result["records"])
    for dtype in WEIGHT_DTYPES:
        assert {r["check"] for r in result["records"] if r["dtype"] == dtype} == {
            "matrix",
            "determinism",
            "stress",
            "put",
            "nodes",
            "padding",
        }
        matrix = records_of(result, "matrix", dtype)
        assert len(matrix) == 4 and all(r["config"]["dtype"] == dtype for r in matrix)
        assert all(r["backend"] == "reference" and r["nonfinite_ref"] == 0 for r in matrix)
        assert max(r["rel_err_oracle"] for r in matrix) > 0, "every configuration compared empty outputs"
    # The CPU backend computes the fp8 reference itself (world 2: the distributed one, the same bits).
    assert all(r["rel_err_ref"] == 0 for r in records_of(result, "matrix", "fp8"))


def test_merged_record_fails_when_any_rank_fails():
    line = {
        "check": "matrix",
        "dtype": "bf16",
        "index": 3,
        "passed": True,
        "rank_error": None,
        "rel_err_ref": 1e-5,
    }
    merged = merge_records([{**line, "rank": 0}, {**line, "rank": 1, "passed": False, "rank_error": "boom"}])
    assert len(merged) == 1 and not merged[0]["passed"] and merged[0]["errors"] == {"1": "boom"}
    assert merge_records([{**line, "rank": 1}, {**line, "rank": 0}])[0]["passed"]
    # The same check and index in the other dtype is another record.
    both = merge_records([{**line, "rank": 0}, {**line, "rank": 0, "dtype": "fp8", "passed": False}])
    assert [(r["dtype"], r["passed"]) for r in both] == [("bf16", True), ("fp8", False)]
    # A rank whose output failed to repeat keeps its own diagnosis.
    where = {"differing_rows": 2, "first_differing_rows": [5, 9]}
    det = merge_records(
        [{**line, "rank": 0}, {**line, "rank": 1, "passed": False, "first_difference": where}]
    )
    assert det[0]["first_difference_by_rank"] == {"1": where} and "first_difference" not in det[0]


def _status_message(rank: int, peer: int, phase: int) -> str:
    from flashmoe.megakernel import describe_status

    return describe_status(torch.tensor([1, rank, peer, phase, 0, 2, 0, 0]))


def test_timeout_verdict():
    ok = [
        {"rank": 0, "message": _status_message(0, 1, 1), "seconds": 2.4},
        {"rank": 1},  # the silent rank
    ]
    assert judge_timeout(ok, 2)["passed"]
    slow = [{**ok[0], "seconds": 20.0}, ok[1]]
    assert "bound" in judge_timeout(slow, 2)["error"]
    wrong_rank = [{**ok[0], "message": _status_message(1, 1, 1)}, ok[1]]
    assert "name its rank" in judge_timeout(wrong_rank, 2)["error"]
    barrier_only = [{**ok[0], "message": _status_message(0, -1, 3)}, ok[1]]
    assert "names no peer" in judge_timeout(barrier_only, 2)["error"]
    no_raise = [{"rank": 0, "error": "no FlashMoETimeoutError although a peer never called the layer"}, ok[1]]
    assert not judge_timeout(no_raise, 2)["passed"]
    assert "no result" in judge_timeout(ok[:1], 2)["error"]


def test_error_measures_catch_unwritten_rows_and_dropped_pairs():
    g = torch.Generator().manual_seed(SESSION_SEED)
    ref = torch.randn(64, 256, generator=g).bfloat16()
    ref[5] = 0  # a row whose slots are all -1
    out = ref.clone()
    assert error_stats(out, ref).within(0.0, 0.0)
    out[7] = float("nan")
    assert error_stats(out, ref).nonfinite == 256
    out = ref.clone()
    out[5, 3] = 1e-3
    assert error_stats(out, ref).nonzero_in_zero_rows == 1
    out = ref.clone()
    out[9] = (ref[9].float() * 0.7).bfloat16()  # one (token, expert) pair of weight 0.3 missing
    assert error_stats(out, ref).max_row_rel > 10 * SAME_ROUNDING_ROW_REL
