"""The JIT: compiles the CUDA sources for sm_90a without a GPU, caches by content, and fails clearly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flashmoe import jit
from flashmoe.errors import FlashMoEBuildError

needs_nvcc = pytest.mark.skipif(jit.find_nvcc() is None, reason="nvcc not on this machine")


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    old = os.environ.get("FLASHMOE_CACHE_DIR")
    path = tmp_path_factory.mktemp("flashmoe-cache")
    os.environ["FLASHMOE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FLASHMOE_CACHE_DIR", None)
    else:
        os.environ["FLASHMOE_CACHE_DIR"] = old


@needs_nvcc
@pytest.mark.timeout(900)
def test_compile_only_sm90a_then_cache_hit(fresh_cache):
    first = jit.build(arch="sm_90a", compile_only=True)
    assert not first.cached
    assert first.library is None
    for obj in first.objects:
        assert obj.is_file() and obj.stat().st_size > 0, obj
    # Relocatable device code: the object carries an embedded device ELF for the device link.
    kernel_o = next(o for o in first.objects if o.name == "kernel.o")
    sections = subprocess.run(["readelf", "-S", "-W", str(kernel_o)], capture_output=True, text=True).stdout
    assert "__nv_relfatbin" in sections, sections
    t0 = time.perf_counter()
    second = jit.build(arch="sm_90a", compile_only=True)
    assert second.cached and second.key == first.key
    assert time.perf_counter() - t0 < 30  # hashing only, no compiler


@needs_nvcc
def test_every_source_file_is_in_the_key(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(jit.source_dir(), src)
    variant = jit.Variant.current()
    nvcc = jit.find_nvcc()
    base = jit.build_key(src, variant, "sm_90a", nvcc, True)
    assert jit.build_key(src, variant, "sm_90a", nvcc, True) == base  # deterministic
    files = sorted(p for p in src.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert len(files) >= 8
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n// touched\n")
        assert jit.build_key(src, variant, "sm_90a", nvcc, True) != base, f"editing {path.name} did not change the key"
        path.write_bytes(original)
    assert jit.build_key(src, variant, "sm_90a", nvcc, True) == base
    # Arch and variant are part of the key too.
    assert jit.build_key(src, variant, "sm_100a", nvcc, True) != base
    stress = jit.Variant("stress5", "flashmoe_stress", ("FLASHMOE_STRESS_DELAY_NS=5", "FLASHMOE_OPS=flashmoe_stress"))
    assert jit.build_key(src, stress, "sm_90a", nvcc, True) != base


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHMOE_NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(FlashMoEBuildError, match="nvcc not found"):
        jit.build(arch="sm_90a", compile_only=True)


def test_missing_nvshmem_is_a_clear_error():
    # A fresh interpreter in which the nvidia.nvshmem package cannot be imported.
    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'nvidia.nvshmem' or name.startswith('nvidia.nvshmem.'):\n"
        "            raise ImportError('hidden for the test')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from flashmoe import jit\n"
        "from flashmoe.errors import FlashMoEBuildError\n"
        "try:\n"
        "    jit.nvshmem_dir()\n"
        "except FlashMoEBuildError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR NVSHMEM not found" in out.stdout, out.stdout + out.stderr
    assert "nvidia-nvshmem-cu13" in out.stdout


def test_cli_compile_only_reports_failure_without_nvcc(tmp_path):
    env = dict(os.environ, FLASHMOE_NVCC=str(tmp_path / "missing"), FLASHMOE_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "flashmoe.jit", "--arch", "sm_90a", "--compile-only"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "nvcc not found" in out.stderr


def test_sources_ship_with_the_package():
    src = jit.source_dir()
    assert (src / "kernel.cu").is_file() and (src / "bindings.cpp").is_file()
    roles = {p.stem for p in (src / "flashmoe").glob("*.cuh")}
    assert {"scheduler", "subscriber", "processor", "tasks", "layout", "comm", "gemm"} <= roles


def test_unknown_flashmoe_variable_is_rejected():
    from flashmoe.config import env

    with pytest.raises(KeyError):
        env("FLASHMOE_NOT_A_VARIABLE")


@pytest.mark.skipif(not Path("/proc").exists(), reason="linux only")
def test_cache_dir_is_overridable(tmp_path, monkeypatch):
    from flashmoe.config import cache_dir

    monkeypatch.setenv("FLASHMOE_CACHE_DIR", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
