"""The DeepEP runs of vllm_serve_gpu.py (issue 14), on CPU: their server flags exist in vLLM 0.26.0 and
parse with the installed vLLM; deep_ep is installed from a wheel into the site once and checked in a
child process, and runs that need it fail with the reason when it does not import; the forced-fallback
run is recognised from the adapter's real log line and fallback counter, and fails without them.

The runs themselves need 4 Hopper GPUs (benchmarks/README.md, vLLM serving)."""

from __future__ import annotations

import os
import sys
import types
import zipfile
from pathlib import Path

import bench_import  # noqa: F401
import pytest
import vllm_serve_gpu as serve

# The server flags vllm_serve_gpu.py passes (RUNS, run_one, VLLMServer), each in vLLM 0.26.0's
# vllm/engine/arg_utils.py, and 0.26.0's All2AllBackend values (vllm/config/parallel.py).
SERVER_FLAGS_026 = {
    "--model", "--host", "--port", "--served-model-name", "--moe-backend", "--data-parallel-size",
    "--tensor-parallel-size", "--enable-expert-parallel", "--all2all-backend", "--max-model-len",
    "--max-num-seqs", "--gpu-memory-utilization", "--seed", "--compilation-config", "--attention-backend",
}  # fmt: skip
ALL2ALL_026 = {
    "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
    "mori_low_latency", "nixl_ep", "allgather_reducescatter", "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
}  # fmt: skip
# 0.26.0's MoEBackend values (vllm/config/kernel.py), plus the plugin's own.
MOE_BACKENDS_026 = {
    "auto", "triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass",
    "flashinfer_cutedsl", "flashinfer_b12x", "marlin", "humming", "triton_unfused", "aiter", "flydsl", "hpc",
    "emulation", "flashmoe",
}  # fmt: skip


def _options(args: list[str]) -> dict[str, str | None]:
    """{flag: the value after it, or None for a switch}."""
    return {
        a: (b if b is not None and not b.startswith("--") else None)
        for a, b in zip(args, [*args[1:], None], strict=True)
        if a.startswith("--")
    }


def test_deepep_runs_are_declared_with_flags_vllm_026_has():
    assert set(serve.DEEPEP_RUNS) <= set(serve.RUNS) and set(serve.FORCED_FALLBACK_ENV) <= set(serve.RUNS)
    for name, (parallel, backend) in serve.RUNS.items():
        assert (backend or "auto") in MOE_BACKENDS_026, name
        opts = _options(parallel)
        assert set(opts) <= SERVER_FLAGS_026, name
        assert opts.get("--all2all-backend", "allgather_reducescatter") in ALL2ALL_026, name
    ll, _ = serve.RUNS["vllm_dp4_ep_deepep_ll"]
    assert _options(ll) == {
        "--data-parallel-size": "{n}",
        "--enable-expert-parallel": None,
        "--all2all-backend": "deepep_low_latency",
    }
    # The forced fallback: the flashmoe DP4+EP run, declining; its all2all is the adapter's choice.
    assert serve.RUNS["flashmoe_dp4_ep_fallback"] == serve.RUNS["flashmoe_dp4_ep"]
    assert serve.FORCED_FALLBACK_ENV["flashmoe_dp4_ep_fallback"] == {
        "FLASHMOE_BACKEND": "fallback",
        "FLASHMOE_STRICT": "0",
        "FLASHMOE_FALLBACK_ALL2ALL": "deepep",  # on one host the adapter would keep vLLM's default
    }


@pytest.fixture(scope="module")
def plugins_loaded():
    pytest.importorskip("vllm")
    from vllm.plugins import load_general_plugins

    load_general_plugins()


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["vllm_dp4_ep_deepep_ll", "flashmoe_dp4_ep_fallback", "vllm_dp4_ep_triton"])
def test_deepep_runs_parse_with_the_installed_vllm(plugins_loaded, name):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parallel, backend = serve.RUNS[name]
    argv = ["--model", "m", *(a.format(n=4) for a in parallel)]
    argv += ["--moe-backend", backend] if backend else []
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    assert (ns.data_parallel_size, ns.enable_expert_parallel) == (4, True)
    want = "deepep_low_latency" if name == "vllm_dp4_ep_deepep_ll" else "allgather_reducescatter"
    assert ns.all2all_backend == want and ns.moe_backend == (backend or "auto")


def test_prebuild_reports_a_build_that_cannot_run():
    """Without FlashInfer (this machine) the prebuild step says it failed and why, in the run JSON's words."""
    try:
        import flashinfer  # noqa: F401

        pytest.skip("FlashInfer is installed here: the step would build for real")
    except ImportError:
        pass
    result = serve.prebuild_flashinfer_moe(timeout=120)
    assert result["done"] is False and result["module"] == "flashinfer fused_moe_90"
    assert result["error"].startswith("failed: ") and "No module named 'flashinfer'" in result["error"]


def _wheel(path: Path, init: str, version: str = "9.9.9") -> Path:
    """A stand-in deep_ep wheel laid out like scripts/build-deepep.sh's (package, dist-info)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("deep_ep/__init__.py", init)
        zf.writestr(
            f"deep_ep-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: deep_ep\nVersion: {version}\n",
        )
    return path


def test_ensure_deep_ep_installs_the_wheel_once_and_checks_the_import(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))  # what ensure_vllm exports for the servers
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    wheel = _wheel(tmp_path / "deep_ep-9.9.9-cp312-cp312-linux_x86_64.whl", "")
    assert serve.ensure_deep_ep(wheel, site) is None
    assert f"deep_ep 9.9.9 {site / 'deep_ep' / '__init__.py'}" in capsys.readouterr().out
    (site / "deep_ep" / "__init__.py").write_text("INSTALLED = 1\n")
    assert serve.ensure_deep_ep(wheel, site) is None  # the same version is not unzipped again
    assert (site / "deep_ep" / "__init__.py").read_text() == "INSTALLED = 1\n"
    newer = _wheel(tmp_path / "deep_ep-10.0-cp312-cp312-linux_x86_64.whl", "", version="10.0")
    assert serve.ensure_deep_ep(newer, site) is None  # replaces the other version, metadata included
    assert "deep_ep 10.0 " in capsys.readouterr().out
    assert [p.name for p in site.glob("deep_ep-*.dist-info")] == ["deep_ep-10.0.dist-info"]


def test_nvshmem_lib_goes_on_the_servers_library_path(tmp_path, monkeypatch):
    """Found per sys.path entry, past a regular ``nvidia`` package without NVSHMEM (as a bundle may hold)."""
    (tmp_path / "bundle" / "nvidia").mkdir(parents=True)
    (tmp_path / "bundle" / "nvidia" / "__init__.py").write_text("")
    lib = tmp_path / "system" / "nvidia" / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvshmem_host.so.3").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "bundle"), str(tmp_path / "system"), *sys.path])
    assert serve.nvshmem_lib_dir() == str(lib)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    wheel = _wheel(tmp_path / "deep_ep-9.9.9-cp312-cp312-linux_x86_64.whl", "")
    assert serve.ensure_deep_ep(wheel, site) is None
    assert serve.ensure_deep_ep(wheel, site) is None
    assert os.environ["LD_LIBRARY_PATH"] == f"{lib}:/opt/other"  # once, in front


def test_ensure_deep_ep_says_why_it_does_not_import(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    missing = serve.ensure_deep_ep(tmp_path / "nope.whl", site)
    assert missing.startswith(f"--deepep-wheel {tmp_path / 'nope.whl'}: no such file")
    broken = _wheel(
        tmp_path / "deep_ep-1.0-cp312-cp312-linux_x86_64.whl",
        "raise ImportError('libnvshmem_host.so.3: cannot open shared object file')\n",
        version="1.0",
    )
    why = serve.ensure_deep_ep(broken, site)
    assert why.startswith(f"deep_ep does not import in the servers' environment (--deepep-wheel {broken};")
    assert why.endswith("ImportError: libnvshmem_host.so.3: cannot open shared object file")


def test_deepep_runs_fail_before_a_server_starts_without_deep_ep():
    args = types.SimpleNamespace(deep_ep_missing="deep_ep does not import (...): ImportError: x")
    for name in serve.DEEPEP_RUNS:
        with pytest.raises(RuntimeError, match=f"^{name} needs deep_ep: deep_ep does not import"):
            serve.run_one(name, args, Path("/nonexistent"))


@pytest.mark.vllm
def test_forced_fallback_run_is_recognised_from_the_adapters_line_and_counter(
    plugins_loaded, flashmoe_log, tmp_path, monkeypatch
):
    """The line and counter the run looks for are what the adapter really emits on its DeepEP tier (a
    deep_ep stand-in makes it import here); a run without them, or with a megakernel layer, fails."""
    from flashmoe.demo.tiny_model import make_tiny_qwen3_moe
    from prometheus_client import REGISTRY, generate_latest
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    for name, value in serve.FORCED_FALLBACK_ENV["flashmoe_dp4_ep_fallback"].items():  # the run's environment
        monkeypatch.setenv(name, value)
    model = make_tiny_qwen3_moe(tmp_path / "tiny", seed=0)
    EngineArgs(
        model=str(model), enforce_eager=True, max_model_len=128, moe_backend="flashmoe",
        data_parallel_size=2, enable_expert_parallel=True,
    ).create_engine_config()  # fmt: skip
    log = "\n".join(f"(APIServer pid=1) WARNING [engine_config.py:1] {line}" for line in flashmoe_log)
    scrape = [x for x in generate_latest(REGISTRY).decode().splitlines() if x.startswith("flashmoe_")]

    facts = serve.served_path("flashmoe_dp4_ep_fallback", "flashmoe", log, scrape)
    assert "error" not in facts, facts
    assert facts["fallback_log_line"].endswith(serve.FORCED_FALLBACK_LINE) and facts["fallback_total"] >= 1
    assert not facts["megakernel_layers_reported"]

    def error(log_text, lines=scrape):
        return serve.served_path("flashmoe_dp4_ep_fallback", "flashmoe", log_text, lines).get("error")

    assert error("").startswith("the server did not log")
    elsewhere = log.replace("vLLM's DeepEP path (all2all_backend=deepep_high_throughput", "vLLM's default")
    assert "; it logged " in error(elsewhere)
    assert "using vLLM's default, moe_backend=auto; FLASHMOE_FALLBACK_ALL2ALL=deepep)" in error(elsewhere)
    assert error(log, []).startswith("/metrics has no flashmoe_fallback_total")
    assert error(log + "\nflashmoe: MoE layers E=128 ... -> backend megakernel (sm_90)").startswith(
        "a MoE layer reported the megakernel"
    )
    # The other runs keep their checks: flashmoe must report the megakernel, vLLM's runs need nothing.
    assert serve.served_path("flashmoe_dp4_ep", "flashmoe", log, scrape)["error"] == (
        "no MoE layer reported the megakernel"
    )
    assert "error" not in serve.served_path("vllm_dp4_ep_deepep_ll", None, "", [])


def test_wheel_flag_fills_what_the_bundle_lacks(tmp_path, monkeypatch, capsys):
    """--wheel unzips a pure-Python wheel once; a model's needs are checked by importing them, so a
    quantized checkpoint fails before any server starts when compressed_tensors is missing."""
    site = tmp_path / "site"
    site.mkdir()
    name = "fm_needed_mod_for_test"
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    assert serve.missing_modules((name,)) and serve.missing_modules((name,))[0].startswith(name)
    wheel = tmp_path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "")
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    assert serve.unzip_wheel(wheel, site) is True
    assert serve.unzip_wheel(wheel, site) is False  # already there
    assert serve.missing_modules((name,)) == []
    assert "compressed_tensors" in serve.MODELS["qwen3-30b-a3b-fp8"].needs
    assert serve.MODELS["qwen3-30b-a3b"].needs == ()
