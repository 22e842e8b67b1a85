#!/usr/bin/env bash
# vLLM 0.26.0 serving the Qwen3-30B-A3B architecture through --moe-backend flashmoe on a 4xH200 host,
# with CUDA graphs on, in TP4+EP4 and DP4+EP4; checks that every MoE layer got the megakernel and that
# greedy outputs agree across the two layouts and with vLLM's own MoE path (moe_backend=auto).
#
#   bash benchmarks/vllm_serve_gpu.sh [OUT_DIR]        # on the GPU host, from the repo root
#
# Env: WHEELHOUSE (default ../shared/tools/gpu-wheelhouse), NUM_LAYERS (default 48; 8 loads faster),
# MODEL_DIR (default $OUT_DIR/qwen3-30b-a3b-random), GPUS (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/flashmoe-vllm-gpu}}
mkdir -p "$OUT"
WHEELHOUSE=${WHEELHOUSE:-../shared/tools/gpu-wheelhouse}
NUM_LAYERS=${NUM_LAYERS:-48}
GPUS=${GPUS:-4}
MODEL_DIR=${MODEL_DIR:-$OUT/qwen3-30b-a3b-random}
PY=${PYTHON:-python3}

# vLLM 0.26.0 pins the machines' torch 2.11; install it without touching torch (notes: vllm-integration §12).
if ! $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.26.0')" 2>/dev/null; then
  $PY -m pip install -q --no-index --find-links "$WHEELHOUSE" --no-deps vllm==0.26.0
  $PY -m pip install -q --find-links "$WHEELHOUSE" pydantic msgspec pyzmq fastapi uvicorn openai \
    transformers tokenizers safetensors sentencepiece blake3 cachetools cbor2 gguf py-cpuinfo \
    prometheus-fastapi-instrumentator partial-json-parser pybase64 setproctitle ijson einops
fi
$PY -m pip install -q -e ".[test]"

[ -f "$MODEL_DIR/config.json" ] || $PY -m flashmoe.tiny_model "$MODEL_DIR" --qwen3-30b-a3b --num-layers "$NUM_LAYERS"

# No FlashInfer sampler / FA2 on these machines; NVLink multicast stays off (notes §12).
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLREDUCE_USE_SYMM_MEM=0 HF_HUB_OFFLINE=1
export FLASHMOE_STRICT=1   # a fallback would make this run meaningless: fail instead

$PY - "$MODEL_DIR" "$OUT" "$GPUS" <<'EOF'
import json, sys, time
from flashmoe.demo import VLLMServer
from flashmoe.tiny_model import prompt_words

model, out, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
common = ["--attention-backend", "TRITON_ATTN", "--max-model-len", "4096", "--gpu-memory-utilization", "0.85"]
runs = {
    f"tp{gpus}_ep{gpus}": (["--tensor-parallel-size", str(gpus), "--enable-expert-parallel"], "flashmoe"),
    f"dp{gpus}_ep{gpus}": (["--data-parallel-size", str(gpus), "--enable-expert-parallel"], "flashmoe"),
    f"tp{gpus}_ep{gpus}_vllm_default": (["--tensor-parallel-size", str(gpus), "--enable-expert-parallel"], None),
}
prompts = [prompt_words(32, seed=i) for i in range(8)]
results = {}
for name, (args, backend) in runs.items():
    env = {} if backend else {"FLASHMOE_STRICT": "0"}
    t0 = time.monotonic()
    with VLLMServer(model, common + args, moe_backend=backend, env=env, log_path=f"{out}/{name}.log", startup_timeout=1800) as srv:
        up = time.monotonic() - t0
        ids = [srv.complete(p, max_tokens=16, timeout=300)["token_ids"] for p in prompts]
    log = open(f"{out}/{name}.log", errors="replace").read()
    lines = [l for l in log.splitlines() if "flashmoe:" in l or "KV cache" in l or "CUDA graph" in l]
    if backend and "-> backend megakernel" not in log:
        sys.exit(f"{name}: no MoE layer reported the megakernel; see {out}/{name}.log")
    results[name] = {"startup_s": round(up, 1), "token_ids": ids, "log": lines}
    print(f"{name}: up in {up:.0f} s\n  " + "\n  ".join(lines[:12]), flush=True)
names = list(results)
first = results[names[0]]["token_ids"]
for n in names[1:]:
    same = sum(a[:8] == b[:8] for a, b in zip(first, results[n]["token_ids"]))
    print(f"{names[0]} vs {n}: {same}/{len(prompts)} prompts agree on the first 8 tokens (bf16)")
json.dump(results, open(f"{out}/results.json", "w"), indent=1)
EOF
echo "vllm_serve_gpu: results in $OUT/results.json"
