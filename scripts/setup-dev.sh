#!/usr/bin/env bash
# Set up a fresh machine for development and tests (the README's install command).
#   CPU machine: torch 2.13.0 (CPU wheel), flashmoe[test], and the CPU-side engines the tests drive.
#   GPU machine: keeps the torch that is there (2.11.0+cu130 on our Hopper machines) and installs flashmoe[test].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check"

if ! $PY -c "import torch" 2>/dev/null; then
  # The CPU CI image carries this wheel locally; a plain 'torch' would pull several GB of CUDA wheels.
  $PIP torch==2.13.0
fi
$PIP -e ".[test]"

has_gpu=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$has_gpu" = "0" ]; then
  # --- CPU engines (sections owned by the integration tests) ---
  :
fi
echo "setup-dev: done (python $($PY -c 'import sys; print(sys.version.split()[0])'), torch $($PY -c 'import torch; print(torch.__version__)'), gpu=$has_gpu)"
