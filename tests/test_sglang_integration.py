"""SGLang integration on CPU: the real SGLang 0.5.23, its real plugin loader and its own code paths.

SGLang lives in its own virtualenv (.venv-sglang, made by scripts/setup-dev.sh: it needs CUDA-build
torch 2.14.1 + torchvision, which cannot share the CPU torch of this environment), so each check runs
tests/sglang_checks.py there as a subprocess and these tests assert on the JSON it prints.

- config: plugin entry point -> hooks applied; every hook target resolves; CLI parsing; server-argument
  resolution (Engine(**kwargs) builds the same ServerArgs); refusals; CUDA fallback; unknown names.
- layer: two scheduler ranks over gloo, set up by SGLang's own init_parallel_runtime; a Qwen3-MoE
  sparse block built and weight-loaded by SGLang; its forward through flashmoe vs a float64 oracle.
- fp8 (issue 15): a block-fp8 checkpoint config resolves to flashmoe, other fp8 variants fall back
  with a reason; the block built with SGLang's own Fp8Config/Fp8MoEMethod and loader, SGLang's
  post-load step leaving the weights as loaded, and the output equal to moe_reference_fp8 bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from multiproc import free_port

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[1]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
CHECKS = REPO / "tests" / "sglang_checks.py"
TIMEOUT_S = 420

# A tiny Qwen3-MoE: 8 experts, top-2, H=128, I=64 (config only: SGLang reads it, no weights are fetched).
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

# The same model with block-fp8 experts (the intermediate size one 128-wide block).
TINY_QWEN3_MOE_FP8 = {
    **TINY_QWEN3_MOE,
    "moe_intermediate_size": 128,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}

if not SGLANG_PY.exists():
    pytest.skip(
        f"{SGLANG_PY} is missing: run scripts/setup-dev.sh (CPU section) to create it",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-qwen3-moe")
    (d / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    return str(d)


def _sglang_env() -> dict:
    env = dict(os.environ)
    env.pop("FLASHMOE_STRICT", None)
    env.pop("FLASHMOE_BACKEND", None)
    env["PYTHONUNBUFFERED"] = "1"
    # This venv's torch is a CUDA build; point SGLang's pynccl at no library, exactly what it sees with a
    # CPU torch (it then uses the gloo groups only).
    env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    # SGLang binds one NUMA node per CPU rank unless told which cores each rank gets.
    ncpu = os.cpu_count() or 1
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % ncpu) for r in range(2))
    return env


def _result(stdout: str, stderr: str, what: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(
        f"{what} printed no RESULT line\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}"
    )


def _run(args: list[str], what: str) -> dict:
    try:
        p = subprocess.run(
            [str(SGLANG_PY), str(CHECKS), *args],
            cwd=REPO,
            env=_sglang_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what} did not finish in {TIMEOUT_S} s\n{(e.stderr or '')[-4000:]}") from None
    return _result(p.stdout, p.stderr, what)


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-qwen3-moe-fp8")
    (d / "config.json").write_text(json.dumps(TINY_QWEN3_MOE_FP8))
    return str(d)


@pytest.fixture(scope="module")
def config(model_dir, fp8_model_dir) -> dict:
    return _run(["config", model_dir, fp8_model_dir], "the SGLang config check")


def _run_ranks(mode: str, model_dir: str, *extra: str) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [str(SGLANG_PY), str(CHECKS), mode, model_dir, str(rank), "2", str(port), *extra],
            cwd=REPO,
            env=_sglang_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"SGLang layer rank {rank} did not finish in {TIMEOUT_S} s") from None
            outputs.append(_result(out, err, f"SGLang layer rank {rank}"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return outputs


@pytest.fixture(scope="module")
def layer_ranks(model_dir) -> list[dict]:
    return _run_ranks("layer", model_dir)


@pytest.fixture(scope="module")
def fp8_layer_ranks(fp8_model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    out_dir = tmp_path_factory.mktemp("sglang-fp8-layer")
    return _run_ranks("layer_fp8", fp8_model_dir, str(out_dir)), out_dir


# --------------------------------------------------------------------------- plugin loading and hooks


def test_every_hook_target_resolves(config):
    assert config["unresolved_targets"] == []


def test_real_loader_applies_every_runtime_hook(config):
    from flashmoe.integration.sglang.hooks import RUNTIME_HOOKS

    assert config["applied"] == list(RUNTIME_HOOKS)
    assert all(config["wrapped"].values()), config["wrapped"]
    assert config["registry_sources"] == ["flashmoe"]  # registered from our entry point, not by hand


def test_plugin_load_leaves_prometheus_client_unimported(config):
    # SGLang fixes prometheus multiprocess mode at that import; the launcher must not import it early.
    assert not config["prometheus_before"]
    assert not config["prometheus_after_plugins"]


def test_runner_name_registered(config):
    assert config["runner_resolves"] == "RegisteredMoeRunnerBackend"


def test_unknown_backend_keeps_sglangs_own_errors(config):
    assert "invalid choice: 'no_such_backend'" in config["cli_unknown_error"]
    assert "'flashmoe'" in config["cli_unknown_error"]  # our name is among SGLang's choices
    assert config["unknown_runner_error"] == (
        "ValueError: MoE runner backend 'no_such_backend' is neither built in nor registered"
    )


# --------------------------------------------------------------------------- server-argument resolution


def test_cli_accepts_flashmoe(config):
    assert config["cli_flashmoe_parses"]


def test_resolves_to_customized_all_to_all_with_ep_equal_tp(config):
    assert config["cpu"] == {
        "moe_a2a_backend": "customized",
        "moe_runner_backend": "flashmoe",
        "ep_size": 2,
        "disable_shared_experts_fusion": True,
    }
    assert config["cpu_tp1"]["moe_a2a_backend"] == "customized"
    assert config["cpu_tp1"]["ep_size"] == 1


def test_cuda_without_megakernel_falls_back_to_sglang(config):
    # No GPU and no deep_ep here: SGLang's default MoE path takes the layers.
    assert config["cuda_fallback"]["moe_a2a_backend"] == "none"
    assert config["cuda_fallback"]["moe_runner_backend"] == "auto"


def test_strict_turns_fallback_into_error(config):
    assert config["strict_cuda_error"].startswith("FlashMoEUnsupported:")
    assert "CUDA is not available" in config["strict_cuda_error"]


def test_forced_fallback_takes_the_decline_path(config):
    # FLASHMOE_BACKEND=fallback where flashmoe would serve (CPU): SGLang's default path (no deep_ep here).
    assert config["forced_fallback"]["moe_runner_backend"] == "auto"
    assert config["forced_fallback"]["moe_a2a_backend"] == "none"
    message = config["forced_fallback_message"]
    assert message == (
        "flashmoe: flashmoe declines the MoE layers (FLASHMOE_BACKEND=fallback); "
        "falling back to SGLang's default MoE path (deep_ep is not installed)"
    )
    assert config["forced_fallback_for_schedulers"] == message  # what the schedulers count in the metric
    assert config["forced_fallback_strict_error"] == (
        "FlashMoEUnsupported: FLASHMOE_STRICT=1 and flashmoe declines the MoE layers: FLASHMOE_BACKEND=fallback"
    )


def test_fallback_takes_deepep_across_nodes_or_when_asked(config):
    # deep_ep importable (a stand-in): one node keeps SGLang's default all-to-all, with the reason in the line;
    # --nnodes 2 takes deepep; FLASHMOE_FALLBACK_ALL2ALL=deepep takes it on one node.
    assert config["fallback_a2a_one_node"] == "none"
    assert config["fallback_a2a_one_node_message"].endswith(
        "falling back to SGLang's default MoE path (the EP group is on one node, where the engine's default "
        "all-to-all is faster than its DeepEP one (FLASHMOE_FALLBACK_ALL2ALL=deepep takes DeepEP anyway))"
    )
    assert config["fallback_a2a_two_nodes"] == "deepep"
    assert config["fallback_a2a_one_node_asked"] == "deepep"


def test_incompatible_options_are_refused(config):
    assert "--enable-two-batch-overlap" in config["tbo_error"]
    assert "--attn-dp-size 2" in config["no_dp_attention_error"]
    assert "remove --moe-a2a-backend deepep" in config["a2a_conflict_error"]


def test_other_backends_untouched(config):
    assert config["unrelated_untouched"]["moe_a2a_backend"] == "none"
    assert config["unrelated_untouched"]["moe_runner_backend"] == "auto"


# --------------------------------------------------------------------------- the MoE layer forward


def test_layer_uses_pass_through_dispatcher_and_reference_backend(layer_ranks):
    for rank, r in enumerate(layer_ranks):
        assert (r["moe_ep_size"], r["moe_ep_rank"]) == (2, rank)
        assert r["dispatcher"] == "PassThroughDispatcher"
        assert r["w13_shape"] == [4, 2 * 64, 128]  # 8 experts over 2 ranks, gate+up rows, H
        assert r["backend"] == "reference"


def test_output_is_complete_without_all_reduce(layer_ranks):
    for r in layer_ranks:
        assert r["output_complete"] is True
        assert r["reduce_is_identity"] is True


def test_layer_forward_matches_oracle(layer_ranks):
    for rank, r in enumerate(layer_ranks):
        for call in r["calls"]:
            assert call["shape"] == [call["tokens"], 128]
            assert call["dtype"] == "torch.bfloat16"
            # bf16 output rounding is 2^-8 relative; SGLang's loader or a swapped gate/up would be O(1).
            assert call["max_abs_err"] <= 2e-2 * max(call["scale"], 1e-3), (rank, call)
    assert [c["tokens"] for c in layer_ranks[1]["calls"]] == [3, 0]  # an idle rank still takes part


# --------------------------------------------------------------------------- block-fp8 experts (issue 15)


def test_block_fp8_checkpoint_resolves_to_flashmoe(config):
    assert config["fp8_cpu"] == config["cpu"]  # the same declaration as for the bf16 model


@pytest.mark.parametrize(
    "name, words",
    [
        ("per_tensor", "per-tensor fp8 weights (no weight_block_size"),
        ("ue8m0", "UE8M0 scales (scale_fmt=ue8m0)"),
    ],
)
def test_other_fp8_variants_fall_back_with_reason(config, name, words):
    assert config[f"fp8_{name}"]["moe_runner_backend"] == "auto"
    assert config[f"fp8_{name}"]["moe_a2a_backend"] == "none"  # no deep_ep here: SGLang's default path
    message = config[f"fp8_{name}_message"]
    assert (
        message.startswith("flashmoe: flashmoe cannot serve this model's experts (") and words in message
    ), message
    assert "falling back to SGLang's default MoE path" in message
    error = config[f"fp8_{name}_strict_error"]
    assert error.startswith("FlashMoEUnsupported: FLASHMOE_STRICT=1") and words in error, error


def test_fp8_layer_is_built_and_loaded_by_sglang(fp8_layer_ranks):
    ranks, _ = fp8_layer_ranks
    for rank, r in enumerate(ranks):
        assert r["moe_ep_rank"] == rank
        assert (r["quantization"], r["quant_config"], r["method"]) == ("fp8", "Fp8Config", "Fp8MoEMethod")
        assert r["params_created"] == {  # SGLang's layout: 4 local experts, one scale per 128x128 block
            "w13_weight": ["torch.float8_e4m3fn", [4, 256, 128]],
            "w2_weight": ["torch.float8_e4m3fn", [4, 128, 128]],
            "w13_weight_scale_inv": ["torch.float32", [4, 2, 1]],
            "w2_weight_scale_inv": ["torch.float32", [4, 1, 1]],
        }
        assert r["local_weights_match_checkpoint"]  # gate rows then up rows, this rank's experts
        assert r["postprocess_kept_weights"]  # SGLang's post-load step changed nothing
        assert (r["backend"], r["fp8_weights"]) == ("reference", True)
        assert r["calls"] == 1 and r["scales_in_place"] and r["block_equals_op_output"]


def test_fp8_layer_output_equals_reference_bit_for_bit(fp8_layer_ranks):
    import torch
    from flashmoe import moe_reference_fp8

    _, out_dir = fp8_layer_ranks
    for rank in range(2):
        saved = torch.load(out_dir / f"rank{rank}.pt")
        call = saved["call"]
        assert call["x"].dtype == torch.bfloat16 and call["ids"].dtype == torch.int32
        expected = moe_reference_fp8(
            call["x"], call["ids"], call["w"], saved["w13"], saved["s13"], saved["w2"], saved["s2"]
        )
        assert float(expected.float().norm()) > 0
        assert torch.equal(call["y"], expected), f"rank {rank}"
