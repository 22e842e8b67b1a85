"""SGLang integration on CPU: the real SGLang 0.5.23, its real plugin loader and its own code paths.

SGLang lives in its own virtualenv (.venv-sglang, made by scripts/setup-dev.sh: it needs CUDA-build
torch 2.14.1 + torchvision, which cannot share the CPU torch of this environment), so each check runs
tests/sglang_checks.py there as a subprocess and these tests assert on the JSON it prints.

- config: plugin entry point -> hooks applied; every hook target resolves; CLI parsing; server-argument
  resolution (Engine(**kwargs) builds the same ServerArgs); refusals; CUDA fallback; unknown names.
- layer: two scheduler ranks over gloo, set up by SGLang's own init_parallel_runtime; a Qwen3-MoE
  sparse block built and weight-loaded by SGLang; its forward through flashmoe vs a float64 oracle.
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
def config(model_dir) -> dict:
    return _run(["config", model_dir], "the SGLang config check")


@pytest.fixture(scope="module")
def layer_ranks(model_dir) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [str(SGLANG_PY), str(CHECKS), "layer", model_dir, str(rank), "2", str(port)],
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
