"""The JIT: builds the CUDA sources for sm_90a without a GPU or driver, caches by content, and fails clearly.

The sm_90a compile (about a minute on CI) happens once per module (``sm90a_objects``); the full build on top of
it (what the Docker image bakes in) only links, and the runtime lookup must find exactly that library.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flashmoe import build as jit
from flashmoe.build.__main__ import main as build_main
from flashmoe.errors import FlashMoEBuildError


@pytest.fixture(scope="module")
def nvcc() -> str:
    """nvcc runs the sm_90a build, CI's only compile check of csrc/. Without it these tests skip, except
    when ``CI`` is set (.ci/run sets it): a skip would let pytest pass without the check, so they fail."""
    path = jit.find_nvcc()
    if path is None:
        msg = "nvcc not found (FLASHMOE_NVCC, $CUDA_HOME/bin, /usr/local/cuda/bin or PATH)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}: CI must run the sm_90a build; install the CUDA 13 toolkit", pytrace=False)
        pytest.skip(msg)
    return path


needs_nvcc = pytest.mark.usefixtures("nvcc")


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


@pytest.fixture(scope="module")
def sm90a_objects(fresh_cache, nvcc) -> jit.BuildResult:
    """The one sm_90a compile of this module (compile-only, as CI's compile check has always been)."""
    return jit.build(arch="sm_90a", compile_only=True)


@needs_nvcc
@pytest.mark.timeout(900)
def test_compile_only_sm90a_then_cache_hit(sm90a_objects):
    first = sm90a_objects
    assert not first.cached
    assert first.library is None
    for obj in first.objects:
        assert obj.is_file() and obj.stat().st_size > 0, obj
    # The bf16 kernel is relocatable device code (an embedded device ELF for the device link); the default build's
    # fp8 kernel is a whole program, so that ptxas honours setmaxnreg (recipe.py _kernel_units).
    by_name = {o.name: o for o in first.objects}
    assert {"kernel.o", "kernel_bf16.o", "kernel_fp8.o", "dlink.o", "bindings.o"} <= set(by_name), by_name

    def sections(obj: Path) -> str:
        return subprocess.run(["readelf", "-S", "-W", str(obj)], capture_output=True, text=True).stdout

    assert "__nv_relfatbin" in sections(by_name["kernel_bf16.o"])
    fp8 = sections(by_name["kernel_fp8.o"])
    assert "__nv_relfatbin" not in fp8 and ".nv_fatbin" in fp8, fp8
    # No NVSHMEM device code in the default build (its device link has the bf16 kernel only).
    assert b"nvshmemi_device_state" not in by_name["dlink.o"].read_bytes()
    t0 = time.perf_counter()
    second = jit.build(arch="sm_90a", compile_only=True)
    assert second.cached and second.key == first.key
    assert time.perf_counter() - t0 < 30  # hashing only, no compiler


@needs_nvcc
@pytest.mark.timeout(900)
def test_put_build_compiles_its_device_puts(fresh_cache):
    """The put build (multi-node EP, FLASHMOE_FORCE_PUT) is the only one that compiles NVSHMEM's device calls and
    links its device library: CI's compile check of that path. Both kernels are relocatable there."""
    put = jit.build(arch="sm_90a", compile_only=True, variant=jit.Variant.default().with_puts())
    by_name = {o.name: o for o in put.objects}
    for name in ("kernel_bf16.o", "kernel_fp8.o"):
        out = subprocess.run(
            ["readelf", "-S", "-W", str(by_name[name])], capture_output=True, text=True
        ).stdout
        assert "__nv_relfatbin" in out, (name, out)
    # NVSHMEM's device library is in the device link (its device state's name in the embedded device ELF).
    assert b"nvshmemi_device_state" in by_name["dlink.o"].read_bytes()


@needs_nvcc
@pytest.mark.timeout(900)
def test_driverless_full_build_is_the_library_the_runtime_finds(
    sm90a_objects, fresh_cache, monkeypatch, capsys
):
    """What the Docker build runs (no GPU, no driver) produces the file the GPU path loads, under the same key."""
    kernel_o = next(o for o in sm90a_objects.objects if o.name == "kernel.o")
    compiled_at = kernel_o.stat().st_mtime_ns
    no_gpu = {k: v for k, v in os.environ.items() if k != "FLASHMOE_ARCH"}
    no_gpu.update(CUDA_VISIBLE_DEVICES="", FLASHMOE_CACHE_DIR=str(fresh_cache))
    cli = [sys.executable, "-m", "flashmoe.build", "--arch", "sm_90a"]
    out = subprocess.run(cli, env=no_gpu, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lib = Path(out.stdout.strip().rsplit("library: ", 1)[1])
    assert f"(key {sm90a_objects.key})" in out.stdout, out.stdout
    assert lib.is_file() and lib.stat().st_size > 0
    # The compile-only entry was linked in place, not compiled again.
    assert lib.parent == kernel_o.parent and kernel_o.stat().st_mtime_ns == compiled_at
    linked_at = lib.stat().st_mtime_ns
    info = json.loads((lib.parent / "build.json").read_text())
    assert info["linked"] and info["arch"] == "sm_90a" and info["key"] == sm90a_objects.key
    assert not {"device", "driver", "gpu"} & {k.lower() for k in info["fields"]}

    # The runtime lookup, given the device's arch (compute capability 9.0), resolves to this very file.
    assert jit.arch_for_capability(9, 0) == "sm_90a"
    assert jit.find_library(jit.arch_for_capability(9, 0)) == lib
    assert jit.find_library(jit.arch_for_capability(8, 0)) is None  # another GPU never gets this build
    again = jit.build(arch="sm_90a")
    assert again.cached and again.library == lib and again.key == sm90a_objects.key
    assert jit.build(arch="sm_90a", compile_only=True).cached
    assert lib.stat().st_mtime_ns == linked_at and kernel_o.stat().st_mtime_ns == compiled_at

    monkeypatch.delenv("FLASHMOE_ARCH", raising=False)
    assert build_main(["--arch", "sm_90a", "--print-key"]) == 0
    shown = capsys.readouterr()
    key_info = json.loads(shown.out)
    assert key_info["key"] == sm90a_objects.key and key_info["library"] == str(lib) and key_info["built"]
    assert key_info["fields"] == info["fields"]
    assert build_main(["--arch", "sm_100a", "--print-key"]) == 1  # not built: the Docker build would fail
    assert "builds only for sm_90a" in capsys.readouterr().err

    # Linked without a driver: only the runtime API and NVSHMEM/torch libraries are needed; the op
    # registration is in the library.
    dynamic = subprocess.run(
        ["readelf", "-d", "-W", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert {"libcudart.so.13", "libnvshmem_host.so.3", "libc10.so", "libtorch_cpu.so"} <= needed, needed
    assert needed <= {
        "libcudart.so.13",
        "libnvshmem_host.so.3",
        "libc10.so",
        "libtorch.so",
        "libtorch_cpu.so",
        "libcuda.so.1",
        "libstdc++.so.6",
        "libgcc_s.so.1",
        "libc.so.6",
        "libm.so.6",
    }, needed
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True, check=True
    )
    driver_calls = re.findall(r"\bcu[A-Z]\w*", undefined.stdout)
    assert not driver_calls or "libcuda.so.1" in needed, driver_calls
    symbols = subprocess.run(["nm", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "TORCH_LIBRARY_static_init_" in symbols and "TORCH_LIBRARY_init_" in symbols

    # The GPU path itself (jit.load: the device's arch, lookup, torch.ops.load_library) with the device
    # faked as an H100: it must load this file, never compile or link, and not even take the lock (the
    # image's cache may be read-only to the pod's user).
    code = (
        "import filelock, torch\n"
        "from flashmoe import build as jit\n"
        "from flashmoe.build import recipe\n"
        "filelock.FileLock = None\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.get_device_capability = lambda device=None: (9, 0)\n"
        "def refuse(*a, **k): raise AssertionError('the runtime built again')\n"
        "recipe.compile_objects = recipe.link_library = refuse\n"
        "ops = jit.load()\n"
        "print(ops.build_info())\n"
    )
    cuda_lib = Path(jit.find_nvcc()).resolve().parent.parent / "lib64"
    load_env = dict(no_gpu, LD_LIBRARY_PATH=f"{cuda_lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    loaded = subprocess.run(
        [sys.executable, "-c", code], env=load_env, capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert loaded.stdout.startswith("flashmoe megakernel"), loaded.stdout


def test_arch_is_spelt_one_way():
    for spelling in ("sm_90a", "sm_90", "SM_90A", "90", "9.0", "compute_90a"):
        assert jit.canonical_arch(spelling) == "sm_90a", spelling
    assert jit.canonical_arch("sm_100a") == "sm_100a" and jit.canonical_arch("10.0") == "sm_100"
    assert jit.canonical_arch("sm_120") == "sm_120"
    assert jit.arch_for_capability(9, 0) == jit.canonical_arch("sm_90a")
    with pytest.raises(FlashMoEBuildError, match="unrecognised arch"):
        jit.canonical_arch("hopper")


def test_runtime_arch_is_the_gpus_and_must_agree_with_flashmoe_arch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("FLASHMOE_ARCH", raising=False)
    assert jit.runtime_arch() == "sm_90a"
    monkeypatch.setenv("FLASHMOE_ARCH", "sm_90")
    assert jit.runtime_arch() == "sm_90a"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(FlashMoEBuildError, match="FLASHMOE_ARCH=sm_90 but the GPU"):
        jit.runtime_arch()
    monkeypatch.delenv("FLASHMOE_ARCH")
    assert jit.runtime_arch() == "sm_100"


@needs_nvcc
def test_every_source_file_is_in_the_key(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(jit.source_dir(), src)
    variant = jit.Variant.current()
    nvcc = jit.find_nvcc()
    base = jit.build_key(src, variant, "sm_90a", nvcc)
    assert jit.build_key(src, variant, "sm_90a", nvcc) == base  # deterministic
    assert jit.build_key(src, variant, "sm_90", nvcc) == base  # one spelling per arch
    files = sorted(p for p in src.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert len(files) >= 8
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n// touched\n")
        assert jit.build_key(src, variant, "sm_90a", nvcc) != base, (
            f"editing {path.name} did not change the key"
        )
        path.write_bytes(original)
    assert jit.build_key(src, variant, "sm_90a", nvcc) == base
    # Arch and variant are part of the key too.
    assert jit.build_key(src, variant, "sm_100a", nvcc) != base
    stress = jit.Variant(
        "stress5", "flashmoe_stress", ("FLASHMOE_STRESS_DELAY_NS=5", "FLASHMOE_OPS=flashmoe_stress")
    )
    assert jit.build_key(src, stress, "sm_90a", nvcc) != base
    assert jit.build_key(src, jit.Variant.trace(), "sm_90a", nvcc) not in (
        base,
        jit.build_key(src, stress, "sm_90a", nvcc),
    )
    assert jit.build_key(src, variant.with_puts(), "sm_90a", nvcc) != base


def test_variant_follows_the_environment(monkeypatch):
    monkeypatch.delenv("FLASHMOE_STRESS_DELAY_NS", raising=False)
    monkeypatch.delenv("FLASHMOE_TRACE", raising=False)
    assert jit.Variant.current() == jit.Variant.default()
    monkeypatch.setenv("FLASHMOE_TRACE", "1")
    trace = jit.Variant.current()
    assert (
        trace.name == "trace"
        and trace.ops_namespace == "flashmoe_trace"
        and "FLASHMOE_TRACE=1" in trace.defines
    )
    monkeypatch.setenv("FLASHMOE_STRESS_DELAY_NS", "100")
    with pytest.raises(ValueError, match="set one"):
        jit.Variant.current()
    monkeypatch.delenv("FLASHMOE_TRACE")
    assert jit.Variant.current().ops_namespace == "flashmoe_stress"
    # The put build of any variant: its own op namespace and cache name, one define more.
    put = jit.Variant.current(device_puts=True)
    assert put.device_puts and not jit.Variant.current().device_puts
    assert put.ops_namespace == "flashmoe_stress_put" and put.name == "stress100-put"
    assert (
        "FLASHMOE_OPS=flashmoe_stress_put" in put.defines
        and "FLASHMOE_OPS=flashmoe_stress" not in put.defines
    )
    assert put.with_puts() == put


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
        "from flashmoe import build as jit\n"
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
    out = subprocess.run(
        [sys.executable, "-m", "flashmoe.build", "--arch", "sm_90a", "--compile-only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "nvcc not found" in out.stderr


def test_sources_ship_with_the_package():
    src = jit.source_dir()
    assert (src / "kernel.cu").is_file() and (src / "bindings.cpp").is_file()
    roles = {p.stem for p in (src / "flashmoe").glob("*.cuh")}
    assert {
        "scheduler",
        "subscriber",
        "moe_layer",
        "tasks",
        "layout",
        "comm",
        "gemm",
        "hopper",
        "metrics",
    } <= roles
    assert (src / "flashmoe" / "contract.h").is_file()


def test_unknown_flashmoe_variable_is_rejected():
    from flashmoe.config import env

    with pytest.raises(KeyError):
        env("FLASHMOE_NOT_A_VARIABLE")


@pytest.mark.skipif(not Path("/proc").exists(), reason="linux only")
def test_cache_dir_is_overridable(tmp_path, monkeypatch):
    from flashmoe.config import cache_dir

    monkeypatch.setenv("FLASHMOE_CACHE_DIR", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a", "8.9"])
def test_an_arch_the_runtime_never_loads_is_refused(arch, capsys):
    with pytest.raises(FlashMoEBuildError, match="builds only for sm_90a"):
        jit.build(arch=arch, compile_only=True)
    assert build_main(["--arch", arch]) == 1
    assert "builds only for sm_90a" in capsys.readouterr().err
