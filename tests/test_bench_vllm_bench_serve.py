"""`vllm bench serve` as vllm_serve_gpu.py runs it: the command line, and one short real run against
vllm-cpu serving the tiny model with the word-level tokenizer the GPU runs write (2 repeats, c=2)."""

from __future__ import annotations

import json
import types

import bench_import  # noqa: F401
import pytest
import vllm_serve_gpu as serve

FLAGS_026 = {  # every flag the command uses exists in vLLM 0.26.0's vllm/benchmarks/serve.py and datasets
    "--backend", "--base-url", "--model", "--served-model-name", "--dataset-name", "--random-input-len",
    "--random-output-len", "--random-range-ratio", "--ignore-eos", "--temperature", "--max-concurrency",
    "--num-prompts", "--request-rate", "--seed", "--percentile-metrics", "--metric-percentiles",
    "--disable-tqdm", "--save-result", "--result-dir", "--result-filename",
}  # fmt: skip


def _cmd(tmp_path, c=16):
    return serve.bench_serve_cmd("http://127.0.0.1:8000", tmp_path / "m", "tiny", c,
                                 serve.num_prompts(c, 64), 1024, 256, 7, tmp_path, "r.json")  # fmt: skip


def test_command_line_asks_for_steady_state_at_the_level(tmp_path):
    cmd = _cmd(tmp_path)
    assert cmd[1] == "-c" and "add_cli_args" in cmd[2]
    flags = [a for a in cmd[3:] if a.startswith("--")]
    assert set(flags) <= FLAGS_026 and len(flags) == len(set(flags))
    opt = {a: b for a, b in zip(cmd[3:], cmd[4:], strict=False) if a.startswith("--")}
    assert (
        opt["--max-concurrency"] == "16"
        and opt["--num-prompts"] == "64"
        and opt["--dataset-name"] == "random"
    )
    assert (opt["--random-input-len"], opt["--random-output-len"], opt["--random-range-ratio"]) == (
        "1024",
        "256",
        "0",
    )
    assert (
        "--ignore-eos" in cmd
        and opt["--served-model-name"] == "tiny"
        and opt["--result-filename"] == "r.json"
    )
    assert [serve.num_prompts(c, 64) for c in (1, 16, 64, 256)] == [64, 64, 256, 1024]


def test_command_line_parses_with_the_installed_vllm(tmp_path):
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse_utils.FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(_cmd(tmp_path)[3:])
    assert (args.max_concurrency, args.num_prompts, args.ignore_eos, args.request_rate) == (
        16,
        64,
        True,
        float("inf"),
    )
    assert args.metric_percentiles == "50,99" and args.save_result


@pytest.mark.parametrize("vocab", [1000, 102400, 151936])
def test_max_model_len_admits_the_longest_word_prompt(vocab):
    # vLLM rejects a text prompt longer than (max_model_len - max_tokens) x the longest token string
    # (characters) before tokenizing it; the worst prompt is every word of the longest length.
    longest = len(f"w{vocab - 1}")
    text = " ".join([f"w{vocab - 1}"] * 1024)
    assert len(text) == 1024 * (longest + 1) - 1
    mml = serve.max_model_len(1024, 256, vocab)
    assert len(text) <= (mml - 256) * longest and mml - 256 >= 1024 + 64
    # the margin the first GPU run used let 103 of 256 Qwen3-vocabulary prompts fail with 400
    assert vocab < 100000 or len(text) > (1024 + 64) * longest


def test_summary_keeps_the_spread_over_repeats():
    keys = [ours for ours, _ in serve.BENCH_FIELDS]
    reps = [dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 3.0)]
    for r in reps:
        r.update(completed=64, failed=0, tpot_median_ms=r["tpot_median_ms"] * 10)
    level = serve.summarize(16, 64, reps)
    assert level["output_tok_per_s"] == 2.0 and level["spread"]["output_tok_per_s"] == [1.0, 3.0]
    assert level["tpot_median_ms"] == 20.0 and level["decode_tok_per_s"] == pytest.approx(16 / 20e-3)
    assert level["ok"] == 128 and level["failed"] == 0 and len(level["repeats"]) == 2


@pytest.mark.vllm
@pytest.mark.slow
def test_short_real_run_against_vllm_cpu(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from flashmoe.demo import VLLMServer
    from flashmoe.demo.tiny_model import VOCAB_SIZE, make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path / "tiny", seed=0)
    serve.write_word_tokenizer(model, VOCAB_SIZE)  # the tokenizer the GPU runs serve with
    server_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]
    args = types.SimpleNamespace(repeats=2, min_prompts=4, input_len=16, output_len=4)
    with VLLMServer(model, server_args, log_path=tmp_path / "server.log", startup_timeout=420) as srv:
        level = serve.measure_level(srv, model, 2, args, tmp_path, timeout=300)
    # measure_level raised unless all 2 x 8 requests completed with exactly 16 tokens in and 4 out.
    assert level["requests"] == 8 and level["ok"] == 16 and level["failed"] == 0
    assert len(level["repeats"]) == 2 and all(r["input_tokens"] == 8 * 16 for r in level["repeats"])
    lo, hi = level["spread"]["output_tok_per_s"]
    assert 0 < lo <= level["output_tok_per_s"] <= hi
    for metric in ("ttft", "tpot"):
        assert 0 < level[f"{metric}_median_ms"] <= level[f"{metric}_p99_ms"]
    raw = json.loads((tmp_path / "bench-c2-r1.json").read_text())
    assert raw["max_concurrency"] == 2 and raw["num_prompts"] == 8


def test_a_run_named_again_is_a_second_start_with_its_own_files():
    stems = serve.start_stems(
        ["flashmoe_dp4_ep", "vllm_dp4_ep_triton", "vllm_dp4_ep_triton", "flashmoe_dp4_ep"]
    )
    assert stems == [
        ("flashmoe_dp4_ep", "vllm_flashmoe_dp4_ep"),
        ("vllm_dp4_ep_triton", "vllm_vllm_dp4_ep_triton"),
        ("vllm_dp4_ep_triton", "vllm_vllm_dp4_ep_triton.start2"),
        ("flashmoe_dp4_ep", "vllm_flashmoe_dp4_ep.start2"),
    ]
