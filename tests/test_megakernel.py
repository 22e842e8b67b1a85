"""The megakernel against the reference (issue 3), on 1, 2 and 4 GPUs, plus CPU tests of the harness.

GPU tests (marked ``gpu``; skipped without sm_90 GPUs, or with fewer GPUs than the world size) run
through the same rank code as ``tests/megakernel_matrix.py`` (``megakernel_cases.py``): one process
group per world size runs every configuration and check once per module; each test asserts on its
part of the records. Inputs and shapes are drawn from the session seed (in the report header).
Budgets: ``tolerances.py``. The timeout test uses its own processes (a timed-out process is poisoned).

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
    TOKENS,
    TOP_K,
    draw_configs,
    judge_timeout,
    merge_records,
    run_timeout_check,
    run_world,
)
from tolerances import SAME_ROUNDING_ROW_REL, error_stats

GPU_CONFIGS = 50
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


def gpu_task(configs) -> dict:
    return {
        "device": "cuda",
        "checks": [c for c in CHECKS if c != "timeout"],
        "configs": [vars(c) | {"tokens": list(c.tokens)} for c in configs],
        "seed": SESSION_SEED,
        "tiny": False,
        "graph_replays": 1000,
        "stress_delay_ns": 2000,
        "timeout_ms": TIMEOUT_MS,
    }


_WORLD_RUNS: dict[int, dict] = {}


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    """world -> run_world result, run once per module (all configurations and checks)."""

    def get(world: int) -> dict:
        require_gpus(world)
        if world not in _WORLD_RUNS:
            configs = draw_configs(GPU_CONFIGS, SESSION_SEED)
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


def records_of(result: dict, check: str) -> list[dict]:
    return [r for r in result["records"] if r["check"] == check]


WORLDS = [1, 2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_matrix_matches_reference(world, world_run):
    recs = records_of(world_run(world), "matrix")
    assert len(recs) == GPU_CONFIGS, f"only {len(recs)} of {GPU_CONFIGS} configurations ran"
    bad = failures(recs)
    assert not bad, f"world {world}: {bad}"
    worst = max(recs, key=lambda r: r["rel_err_oracle"])
    print(f"world {world}: worst rel err vs fp64 oracle {worst['rel_err_oracle']:.3e} ({worst['label']})")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_cuda_graph_replays_match_eager_and_reference(world, world_run):
    (rec,) = records_of(world_run(world), "graph")
    assert rec["replays"] >= 1000
    assert rec["passed"], failures([rec])
    assert rec["replays_not_bitwise_eager"] == 0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_repeated_calls_are_bitwise_identical(world, world_run):
    recs = records_of(world_run(world), "determinism")
    assert recs and all(r["repeats_differing"] == 0 for r in recs), failures(recs)
    assert all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_stress_build_is_bitwise_identical(world, world_run):
    recs = records_of(world_run(world), "stress")
    assert recs and all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.gpu
@pytest.mark.timeout(WORLD_LIMIT_S + 120)
def test_forced_put_path_is_bitwise_identical(world, world_run):
    recs = records_of(world_run(world), "put")
    assert recs and all(r["passed"] for r in recs), failures(recs)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_missing_rank_raises_timeout_naming_rank_peer_phase(world, tmp_path):
    require_gpus(world)
    task = gpu_task([]) | {"timeout_ms": TIMEOUT_MS}
    verdict = run_timeout_check(world, task, tmp_path, limit_s=120)
    assert verdict["passed"], verdict["error"]


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


@pytest.mark.timeout(200)
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness check; on a GPU machine FlashMoE picks the megakernel")
def test_harness_runs_on_cpu_with_reference_backend(tmp_path):
    """The GPU runner's rank code, over gloo with the CPU reference backend: all checks pass and the
    records carry the fields the report needs."""
    configs = draw_configs(5, SESSION_SEED, tiny=True)
    task = gpu_task(configs) | {
        "device": "cpu",
        "tiny": True,
        "checks": ["matrix", "determinism", "stress", "put"],
    }
    result = run_world(2, task, tmp_path, limit_s=150)
    assert result["error"] is None, result["error"]
    assert [r["check"] for r in result["records"]].count("matrix") == 5
    assert {r["check"] for r in result["records"]} == {"matrix", "determinism", "stress", "put"}
    assert all(r["passed"] for r in result["records"]), failures(result["records"])
    matrix = records_of(result, "matrix")
    assert all(r["backend"] == "reference" and r["nonfinite_ref"] == 0 for r in matrix)
    assert max(r["rel_err_oracle"] for r in matrix) > 0, "every configuration compared empty outputs"


def test_merged_record_fails_when_any_rank_fails():
    line = {"check": "matrix", "index": 3, "passed": True, "rank_error": None, "rel_err_ref": 1e-5}
    merged = merge_records([{**line, "rank": 0}, {**line, "rank": 1, "passed": False, "rank_error": "boom"}])
    assert len(merged) == 1 and not merged[0]["passed"] and merged[0]["errors"] == {"1": "boom"}
    assert merge_records([{**line, "rank": 1}, {**line, "rank": 0}])[0]["passed"]


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
