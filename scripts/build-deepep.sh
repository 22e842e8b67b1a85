#!/usr/bin/env bash
# Build DeepEP (deepseek-ai/DeepEP, pinned below) for the GPU machines' stack: Python 3.12, torch 2.11.0+cu130,
# NVSHMEM 3.4.5 from pip (nvidia-nvshmem-cu13), CUDA 13.0, sm_90 (H100/H200). It cross-builds on a machine without
# a GPU or driver, so the build stays out of every device call: the result is a plain site folder to put on
# PYTHONPATH there (and a wheel for the Docker image).
#
#   bash scripts/build-deepep.sh                 # -> .carry/deepep/site/{deep_ep/,deep_ep_cpp*.so}, .carry/deepep/*.whl
#
# Environment (all optional):
#   PYTHON        a Python 3.12 with torch 2.11.0 (cu130) and nvidia-nvshmem-cu13 3.4.5 (default: a venv made in
#                 $WORK/py312 with python3.12 and `pip install torch==2.11.0 nvidia-nvshmem-cu13==3.4.5`; PyPI's
#                 torch 2.11.0 is the cu130 build and pins nvshmem 3.4.5 and NCCL 2.28.9, exactly the GPU image's)
#   DEEPEP_GIT    where to clone DeepEP from (default https://github.com/deepseek-ai/DeepEP.git; a local clone or
#                 the bare mirror of the fetch tool works too)
#   DEEPEP_SRC    a DeepEP source tree or .tar.gz instead of cloning (e.g. the copy this script leaves in
#                 .carry/deepep/deepep-src.tar.gz, for a build on a machine without network)
#   RDMA_INCLUDE  a folder with infiniband/mlx5dv.h (default: libibverbs-dev unpacked from `apt-get download`,
#                 also left in .carry/deepep/rdma-include)
#   CUDA_HOME     default /usr/local/cuda;   OUT_DIR default <repo>/.carry/deepep;   WORK default /tmp/deepep-build
#   MAX_JOBS      parallel compile jobs (default: nproc)
#
# On a GPU machine:
#   PYTHONPATH=.carry/deepep/site LD_LIBRARY_PATH=$(python3 -c 'import nvidia.nvshmem as m; print(m.__path__[0])')/lib \
#     python3 -c 'import deep_ep'
# (benchmarks/moe_bench/deepep_ll.py loads libnvshmem_host.so.3 from the nvidia.nvshmem package itself, so
# LD_LIBRARY_PATH is only needed for a bare `import deep_ep`). Installed from the wheel next to
# nvidia-nvshmem-cu13 (the Docker image), the extension finds NVSHMEM through its RUNPATH $ORIGIN/../nvidia/nvshmem/lib.
#
# Record (2026-11-22, 2-core CPU machine, no GPU; nvcc 13.0.88, g++ 12):
# - Commit 567632dd59810d77b3cc05553df953cc0f779799 (2026-02-03; DeepEP V1 on main, just before the EPv2 release
#   b306af0). Its low-latency kernels run intranode over NVLink (NVSHMEM P2P pointers, allow_nvlink_for_low_latency_mode)
#   and include the NVSHMEM 3.x fixes (29d31c0); setup.py finds the pip NVSHMEM (nvidia.nvshmem, libnvshmem_host.so.3).
#   It does not use NCCL at all. Newer main (EPv2, b306af0 onwards) builds on the NCCL device API (ncclDevComm...),
#   which is what breaks the tokenspeed-deepep wheel against the image's NCCL 2.28.9 (`ncclCommQueryProperties`).
# - One source change (applied by this script, checked to match): DeepEP's LL dispatch asserts on the device that
#   IBGDA holds a QP per local expert even when every peer is an NVLink P2P peer and no QP is used; with NVSHMEM
#   initialised without IBGDA (flashmoe first, or no mlx5 NIC) that is 0 and the kernel would trap. The assertion
#   now accepts 0.
# - What the build needed beyond `python setup.py bdist_wheel`, all headers or link-time stand-ins, nothing run:
#   infiniband/mlx5dv.h (NVSHMEM's IBGDA header includes it): libibverbs-dev headers; CUDA 13's CCCL headers
#   (cuda/std/tuple, included by NVSHMEM 3.4.5 headers in host code): $CUDA_HOME/include/cccl on the host
#   compiler's path; cusparse.h/cublas headers (torch's CUDAContextLight.h) from the pip nvidia/cu13/include when
#   the toolkit lacks them; a libcuda.so to satisfy -lcuda: an empty stub with soname libcuda.so.1, linked with
#   --no-as-needed so libcuda.so.1 stays NEEDED and the driver's cuMem* symbols resolve when the GPU's libcuda loads.
# - Build time: 54-76 s wall (about 100 s CPU) with MAX_JOBS=2, from a clone or from the carried tarball (both
#   tried here); the wheel is 9.2 MB, the stripped site folder 14 MB
#   (deep_ep_cpp 13.7 MB; 26 MB unstripped). sm_90 SASS (TORCH_CUDA_ARCH_LIST=9.0, DeepEP's own default for Hopper).
# - Checked here: `import deep_ep` with Python 3.12.1, torch 2.11.0+cu130 (PyPI), nvidia-nvshmem-cu13 3.4.5 and a
#   stub libcuda.so.1 defining the 14 cu* symbols the extension imports (Python loads extensions RTLD_NOW: every
#   symbol resolved against torch 2.11 and NVSHMEM 3.4.5); the extension has no NCCL dependency.
#   Not checked here (no GPU): that its kernels run. Fallback if the carried build does not load there: run this
#   script on the GPU machine with PYTHON=python3 DEEPEP_SRC=.carry/deepep/deepep-src.tar.gz
#   RDMA_INCLUDE=.carry/deepep/rdma-include (no network needed; estimate: under a minute, 7 compile units of
#   about 100 CPU-s in all, the largest alone bounding it).
set -euo pipefail

DEEPEP_COMMIT=567632dd59810d77b3cc05553df953cc0f779799
TORCH_VERSION=2.11.0
NVSHMEM_VERSION=3.4.5
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${OUT_DIR:-$REPO/.carry/deepep}
WORK=${WORK:-/tmp/deepep-build}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MAX_JOBS=${MAX_JOBS:-$(nproc)}
export CUDA_HOME MAX_JOBS
mkdir -p "$WORK" "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# Paths given relative to where this was started stay valid after the cd into the source tree.
[ -n "${DEEPEP_SRC:-}" ] && DEEPEP_SRC=$(realpath "$DEEPEP_SRC")
[ -n "${RDMA_INCLUDE:-}" ] && RDMA_INCLUDE=$(realpath "$RDMA_INCLUDE")
t0=$(date +%s)

# --- Python 3.12 with torch 2.11.0 (cu130) and NVSHMEM 3.4.5 -------------------------------------------------
if [ -z "${PYTHON:-}" ]; then
  py312=
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do  # a pyenv shim may exist yet not run
    if "$c" -c 'import sysconfig, os; assert os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then
      py312=$c; break
    fi
  done
  [ -n "$py312" ] || { echo "need python3.12 with its headers (or PYTHON=...)" >&2; exit 1; }
  if [ ! -x "$WORK/py312/bin/python" ]; then
    "$py312" -m venv "$WORK/py312"
    "$WORK/py312/bin/pip" install -q "torch==$TORCH_VERSION" "nvidia-nvshmem-cu13==$NVSHMEM_VERSION" setuptools wheel ninja
  fi
  PYTHON=$WORK/py312/bin/python
fi
"$PYTHON" - <<EOF
import sys, torch
assert sys.version_info[:2] == (3, 12), f"Python {sys.version}: the GPU machines run 3.12"
assert torch.__version__.startswith("$TORCH_VERSION") and torch.version.cuda == "13.0", torch.__version__
EOF
nvshmem_dir=$("$PYTHON" -c 'import nvidia.nvshmem as m; print(m.__path__[0])')
NV_CU13_INCLUDE=$("$PYTHON" -c 'import os, nvidia; print(os.path.join(nvidia.__path__[0], "cu13", "include"))')
[ -f "$nvshmem_dir/lib/libnvshmem_device.a" ] || { echo "no NVSHMEM device library under $nvshmem_dir" >&2; exit 1; }

# --- DeepEP source at the pinned commit ---------------------------------------------------------------------
src=$WORK/DeepEP
rm -rf "$src"
if [ -n "${DEEPEP_SRC:-}" ]; then
  mkdir -p "$src"
  if [ -d "$DEEPEP_SRC" ]; then cp -a "$DEEPEP_SRC/." "$src/"; else tar -xzf "$DEEPEP_SRC" -C "$src"; fi
else
  git clone -q --no-checkout "${DEEPEP_GIT:-https://github.com/deepseek-ai/DeepEP.git}" "$src"
  git -C "$src" -c advice.detachedHead=false checkout -q "$DEEPEP_COMMIT"
  tar -czf "$OUT_DIR/deepep-src.tar.gz" -C "$src" --exclude=.git --exclude=figures .
fi

# --- One local change: the LL dispatch's QP assertion --------------------------------------------------------
# Every LL dispatch asserts (device trap) that IBGDA holds a QP per local expert, even where every peer is reached
# through NVSHMEM P2P pointers over NVLink and no QP is ever used. NVSHMEM initialised without IBGDA (by flashmoe
# before DeepEP, or on a host without mlx5 NICs) has num_rc_per_pe == 0, so the unchanged kernel traps on our
# machines. Accept 0 too; peers without a P2P pointer would still need IBGDA (internode: not our case).
ll=$src/csrc/kernels/internode_ll.cu
qp_check='EP_DEVICE_ASSERT(ibgda_get_state()->num_rc_per_pe >= num_local_experts);'
grep -qF "$qp_check" "$ll" || { echo "DeepEP source changed: QP assertion not found in $ll" >&2; exit 1; }
sed -i "s|EP_DEVICE_ASSERT(ibgda_get_state()->num_rc_per_pe >= num_local_experts);|EP_DEVICE_ASSERT(ibgda_get_state()->num_rc_per_pe == 0 or ibgda_get_state()->num_rc_per_pe >= num_local_experts);|" "$ll"
grep -qF 'num_rc_per_pe == 0 or' "$ll"

# --- Headers and link-time stand-ins ------------------------------------------------------------------------
if [ -z "${RDMA_INCLUDE:-}" ]; then
  if [ -f /usr/include/infiniband/mlx5dv.h ]; then
    RDMA_INCLUDE=/usr/include
  else
    (cd "$WORK" && rm -f libibverbs-dev_*.deb && apt-get download libibverbs-dev >/dev/null)
    rm -rf "$WORK/rdma" && dpkg -x "$WORK"/libibverbs-dev_*.deb "$WORK/rdma"
    RDMA_INCLUDE=$WORK/rdma/usr/include
    rm -rf "$OUT_DIR/rdma-include" && mkdir -p "$OUT_DIR/rdma-include"
    cp -a "$RDMA_INCLUDE/infiniband" "$OUT_DIR/rdma-include/"
  fi
fi
export CPATH="$RDMA_INCLUDE:$CUDA_HOME/include/cccl:$NV_CU13_INCLUDE${CPATH:+:$CPATH}"
stub=$WORK/cuda-stub
if ! ls "$CUDA_HOME"/lib64/stubs/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so >/dev/null 2>&1; then
  mkdir -p "$stub" && : >"$stub/empty.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/empty.c"
  export LIBRARY_PATH="$stub${LIBRARY_PATH:+:$LIBRARY_PATH}"
elif [ -f "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  export LIBRARY_PATH="$CUDA_HOME/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
# --no-as-needed keeps libcuda.so.1 NEEDED even when linked against the empty stub.
export LDFLAGS='-Wl,--no-as-needed -Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib'
# NVSHMEM_DIR stays unset: setup.py then finds nvidia.nvshmem and links its libnvshmem_host.so.3 by soname.
unset NVSHMEM_DIR
export PATH="$CUDA_HOME/bin:$PATH" TORCH_CUDA_ARCH_LIST=9.0

# --- Build -------------------------------------------------------------------------------------------------
tb=$(date +%s)
(cd "$src" && "$PYTHON" setup.py bdist_wheel >"$WORK/build.log" 2>&1) || { tail -40 "$WORK/build.log" >&2; exit 1; }
build_s=$(($(date +%s) - tb))
whl=$(ls "$src"/dist/deep_ep-*.whl)
rm -rf "$OUT_DIR/site" "$OUT_DIR"/deep_ep-*.whl && mkdir -p "$OUT_DIR/site"
cp "$whl" "$OUT_DIR/"
"$PYTHON" -m zipfile -e "$whl" "$OUT_DIR/site"
strip --strip-debug "$OUT_DIR"/site/deep_ep_cpp*.so
cat >"$OUT_DIR/BUILD_INFO" <<EOF
deepep_commit $DEEPEP_COMMIT
torch $("$PYTHON" -c 'import torch; print(torch.__version__)')
nvshmem $NVSHMEM_VERSION ($nvshmem_dir)
nvcc $("$CUDA_HOME/bin/nvcc" --version | tail -1)
arch sm_90 (TORCH_CUDA_ARCH_LIST=9.0)
patch internode_ll.cu LL dispatch QP assertion accepts num_rc_per_pe == 0 (NVLink-only, IBGDA not initialised)
build_seconds $build_s (MAX_JOBS=$MAX_JOBS, $(nproc) cores)
built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)
EOF

# --- Check: the extension's symbols resolve against this torch and NVSHMEM ------------------------------------
so=$(ls "$OUT_DIR"/site/deep_ep_cpp*.so)
readelf -d "$so" | grep -q 'NEEDED.*libcuda.so.1' || { echo "libcuda.so.1 is not NEEDED by $so" >&2; exit 1; }
if readelf -d "$so" | grep -q 'NEEDED.*nccl'; then echo "unexpected NCCL dependency in $so" >&2; exit 1; fi
check_env=()
if ! ldconfig -p | grep -q 'libcuda.so.1 '; then  # no driver here: stand in for it with the symbols it must export
  mkdir -p "$stub/sym"
  nm -D --undefined-only "$so" | awk '{print $2}' | grep -E '^cu[A-Z]' | sed 's/@.*//' | sort -u |
    awk '{print "void " $1 "(void) {}"}' >"$stub/sym/s.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/sym/libcuda.so.1" "$stub/sym/s.c"
  check_env=(LD_LIBRARY_PATH="$stub/sym")
fi
env "${check_env[@]}" PYTHONPATH="$OUT_DIR/site" "$PYTHON" -c '
import torch, deep_ep
assert deep_ep.Buffer.is_sm90_compiled()
print("import deep_ep ok:", deep_ep.__file__, "topk_idx", deep_ep.topk_idx_t,
      "LL rdma bytes (512 tok, H 7168, EP4, E 256):", deep_ep.Buffer.get_low_latency_rdma_size_hint(512, 7168, 4, 256))'
echo "built in ${build_s}s (all steps $(($(date +%s) - t0))s): $(du -sh "$OUT_DIR/site" | cut -f1) site, $(du -h "$whl" | cut -f1) wheel -> $OUT_DIR"
