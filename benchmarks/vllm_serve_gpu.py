"""vLLM 0.26.0 serving the Qwen3-30B-A3B architecture on one 4-GPU host: flashmoe against vLLM's own
MoE paths, greedy token ids and throughput, CUDA graphs on.

    python benchmarks/vllm_serve_gpu.py --bundle /tmp/wh --out $OUT \\
        --runs flashmoe_dp4_ep,vllm_dp4_ep,flashmoe_tp4_ep,vllm_tp4

Runs (``--runs``, in order; each starts ``vllm.entrypoints.openai.api_server`` on all GPUs):

    flashmoe_dp4_ep   DP4 + EP4, --moe-backend flashmoe (FLASHMOE_STRICT=1: a fallback fails the run)
    flashmoe_tp4_ep   TP4 + EP4, --moe-backend flashmoe
    vllm_dp4_ep       DP4 + EP4, vLLM's default MoE path (moe_backend auto, its default all2all backend)
    vllm_tp4_ep       TP4 + EP4, vLLM's default MoE path
    vllm_tp4          TP4 without EP (experts tensor-parallel), vLLM's default MoE path

Every run loads the same seeded random checkpoint (real shapes, N(0, 0.02) weights: see
``flashmoe.demo.tiny_model.make_qwen3_30b_a3b_shaped``), so greedy token ids are comparable across runs
and layouts. Each run: greedy ids for ``--check-prompts`` random-id prompts, then a throughput sweep
(``--input-len`` random ids in, ``--output-len`` tokens out with ignore_eos, streaming) at each
``--concurrency``. One JSON per run lands in ``--out`` as soon as it finishes
(``vllm_<run>.json``); ``--deadline-s`` skips runs that would not finish in time, so a later call
can do the rest. ``benchmarks/vllm_serve_report.py`` merges the JSONs, compares and plots.

``--bundle``: the folder of ``vllm-bundle.part-*`` files made by the gpu-wheelhouse tool (vLLM 0.26.0
for the machines' torch 2.11, no network there); unpacked once into ``--site``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugin"))
from flashmoe.demo import VLLMServer  # noqa: E402
from flashmoe.demo.tiny_model import make_qwen3_30b_a3b_shaped  # noqa: E402

RUNS = {  # name: (parallel arguments, --moe-backend or None for vLLM's own)
    "flashmoe_dp4_ep": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
    "flashmoe_tp4_ep": (["--tensor-parallel-size", "{n}", "--enable-expert-parallel"], "flashmoe"),
    "vllm_dp4_ep": (["--data-parallel-size", "{n}", "--enable-expert-parallel"], None),
    "vllm_tp4_ep": (["--tensor-parallel-size", "{n}", "--enable-expert-parallel"], None),
    "vllm_tp4": (["--tensor-parallel-size", "{n}"], None),
}
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


def greedy_ids(srv: VLLMServer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        choice = srv.complete(p, max_tokens=max_tokens, timeout=600.0)
        if "token_ids" not in choice:
            raise RuntimeError(f"no token_ids in the completion: {json.dumps(choice)[:500]}")
        out.append(choice["token_ids"])
    return out


def one_streamed(srv: VLLMServer, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": srv.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        srv.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600.0) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("choices") and first is None:
                first = time.perf_counter()
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens != max_tokens or first is None:
        raise RuntimeError(f"streamed {tokens} tokens, expected {max_tokens}")
    return {
        "ttft_s": first - t0,
        "tpot_s": (end - first) / max(1, tokens - 1),
        "e2e_s": end - t0,
        "tokens": tokens,
    }


def throughput(
    srv: VLLMServer,
    concurrency: int,
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
    vocab: int,
) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num_requests)]
    results, errors, lock = [], [], threading.Lock()
    queue = list(range(num_requests))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            try:
                res = one_streamed(srv, prompts[i], output_len)
                with lock:
                    results.append(res)
            except Exception as e:  # noqa: BLE001 - reported in the row
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:300])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    row = {
        "concurrency": concurrency,
        "requests": num_requests,
        "ok": len(results),
        "errors": errors[:3],
        "wall_s": wall,
    }
    if results:
        out_tokens = sum(r["tokens"] for r in results)
        row.update(
            output_tok_per_s=out_tokens / wall,
            total_tok_per_s=(out_tokens + input_len * len(results)) / wall,
            ttft_median_ms=statistics.median(r["ttft_s"] for r in results) * 1e3,
            tpot_median_ms=statistics.median(r["tpot_s"] for r in results) * 1e3,
            # Per-request decode rate summed over the concurrent requests: the decode throughput.
            decode_tok_per_s=concurrency / statistics.median(r["tpot_s"] for r in results),
        )
    return row


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
    )
    return [line[-400:] for line in text.splitlines() if any(k in line for k in keys)][:80]


def run_one(name: str, args, model: Path) -> dict:
    parallel, backend = RUNS[name]
    parallel = [a.format(n=args.gpus) for a in parallel]
    compilation = {"cudagraph_capture_sizes": CAPTURE_SIZES, "pass_config": {"fuse_allreduce_rms": False}}
    vargs = parallel + [
        "--skip-tokenizer-init",
        "--max-model-len",
        str(args.input_len + args.output_len + 64),
        "--max-num-seqs",
        "256",
        "--gpu-memory-utilization",
        "0.85",
        "--seed",
        "0",
        "--compilation-config",
        json.dumps(compilation),
        "--attention-backend",
        "TRITON_ATTN",
    ]
    env = dict(ENV)
    if backend:
        env["FLASHMOE_STRICT"] = "1"  # a fallback would make the comparison meaningless
    log = args.out / f"vllm_{name}.log"
    server = VLLMServer(
        model, vargs, moe_backend=backend, env=env, log_path=log, startup_timeout=args.startup_timeout
    )
    row = {"run": name, "moe_backend": backend or "auto", "vllm_args": server.cmd[3:], "env": env}
    t0 = time.monotonic()
    with server as srv:
        row["startup_s"] = round(time.monotonic() - t0, 1)
        print(f"{name}: server up in {row['startup_s']} s", flush=True)
        rng = random.Random(1234)
        prompts = [
            [rng.randrange(4, args.vocab) for _ in range(args.check_len)] for _ in range(args.check_prompts)
        ]
        row["check_prompts"] = prompts
        row["greedy_token_ids"] = greedy_ids(srv, prompts, args.check_tokens)
        row["throughput"] = []
        for c in args.concurrency:
            n = max(c, args.min_requests)
            tp = throughput(srv, c, n, args.input_len, args.output_len, seed=c, vocab=args.vocab)
            row["throughput"].append(tp)
            print(
                f"  c={c:4d}: {tp.get('output_tok_per_s', 0):8.0f} out tok/s, TPOT {tp.get('tpot_median_ms', 0):6.2f} ms, "
                f"TTFT {tp.get('ttft_median_ms', 0):7.1f} ms, {tp['ok']}/{tp['requests']} ok",
                flush=True,
            )
        # The plugin's Prometheus series as an operator scrapes them from vLLM's /metrics.
        row["metrics_scrape"] = [m for m in srv.get("/metrics").splitlines() if m.startswith("flashmoe_")][
            :60
        ]
    text = log.read_text(errors="replace")
    row["log"] = log_lines(text)
    row["megakernel_layers_reported"] = "-> backend megakernel" in text
    if backend == "flashmoe" and not row["megakernel_layers_reported"]:
        row["error"] = "no MoE layer reported the megakernel"
    row["elapsed_s"] = round(time.monotonic() - t0, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=Path("/tmp/wh"))
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"))
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen3-30b-a3b-random"))
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", default="flashmoe_dp4_ep,vllm_dp4_ep,flashmoe_tp4_ep,vllm_tp4")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--check-prompts", type=int, default=8)
    ap.add_argument("--check-len", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--startup-timeout", type=float, default=420.0)
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="skip a run if less than --run-estimate-s is left"
    )
    ap.add_argument("--run-estimate-s", type=float, default=240.0)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    ensure_vllm(args.bundle, args.site)
    import vllm

    t0 = time.monotonic()
    make_qwen3_30b_a3b_shaped(args.model_dir, args.num_layers, seed=0, device="cuda")
    print(
        f"vLLM {vllm.__version__}; model {args.model_dir} ready in {time.monotonic() - t0:.0f} s", flush=True
    )

    import torch

    meta = {
        "commit": args.commit,
        "machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "argv": sys.argv,
        "model": "Qwen3-30B-A3B architecture, random N(0, 0.02) weights (flashmoe.tiny_model), bf16",
        "num_layers": args.num_layers,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    for name in args.runs.split(","):
        left = (args.deadline_s or 1e9) - (time.monotonic() - t_start)
        if left < args.run_estimate_s:
            print(f"{name}: skipped, {left:.0f} s left (estimate {args.run_estimate_s:.0f} s)", flush=True)
            continue
        try:
            row = run_one(name, args, args.model_dir)
        except Exception as e:  # noqa: BLE001 - recorded, the next run still goes
            log = args.out / f"vllm_{name}.log"
            row = {"run": name, "error": f"{type(e).__name__}: {e}"[-3000:]}
            if log.exists():
                row["log"] = log_lines(log.read_text(errors="replace"))
        (args.out / f"vllm_{name}.json").write_text(json.dumps({**meta, **row}, indent=1))
        print(
            f"{name}: {'ERROR ' + row['error'][-600:] if row.get('error') else 'done'} ({time.monotonic() - t_start:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
