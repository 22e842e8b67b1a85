"""The build recipe: the compile, device-link and link command lines, and the compile-time variants.

This file is part of the cache key (:func:`flashmoe.build.cache.build_key` hashes it), so any change to a
flag or a link input here makes a new cache entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import config
from ..errors import FlashMoEBuildError
from .toolchain import nvshmem_dir


@dataclass(frozen=True)
class Variant:
    """One build of the kernel library: its name (cache files), op namespace and compile-time defines.

    ``device_puts``: the put build, which also reaches peers through NVSHMEM's device library (other nodes,
    ``FLASHMOE_FORCE_PUT``). That library needs relocatable device code, under which ptxas ignores ``setmaxnreg``
    (benchmarks/experiments/setmaxnreg_rdc.cu) and the fp8 kernel runs slower, so the default build leaves it out
    (peers by NVLink stores only) and compiles the fp8 kernel as a whole program (:func:`_kernel_units`). Each
    build has its own op namespace, ``_put`` appended.
    """

    name: str  # "default", "stress<ns>" or "trace", "-put" appended for the put build
    ops_namespace: str  # torch.ops.<ns>
    defines: tuple[str, ...]

    @property
    def device_puts(self) -> bool:
        return "FLASHMOE_DEVICE_PUTS=1" in self.defines

    @staticmethod
    def default() -> Variant:
        return Variant("default", "flashmoe", ("FLASHMOE_OPS=flashmoe",))

    @staticmethod
    def stress(delay_ns: int) -> Variant:
        """Sleeps a random 0..delay_ns before each signal and wait (race hunting); its own op namespace."""
        return Variant(
            f"stress{delay_ns}",
            "flashmoe_stress",
            (f"FLASHMOE_STRESS_DELAY_NS={delay_ns}", "FLASHMOE_OPS=flashmoe_stress"),
        )

    @staticmethod
    def trace() -> Variant:
        """Records a tile-level timeline of each launch (csrc/flashmoe/trace.cuh); its own op namespace."""
        return Variant("trace", "flashmoe_trace", ("FLASHMOE_TRACE=1", "FLASHMOE_OPS=flashmoe_trace"))

    def with_puts(self) -> Variant:
        """The same build with NVSHMEM's device puts."""
        if self.device_puts:
            return self
        namespace = f"{self.ops_namespace}_put"
        defines = tuple(d for d in self.defines if not d.startswith("FLASHMOE_OPS="))
        return Variant(
            f"{self.name}-put", namespace, (*defines, "FLASHMOE_DEVICE_PUTS=1", f"FLASHMOE_OPS={namespace}")
        )

    @staticmethod
    def current(device_puts: bool = False) -> Variant:
        """The variant FLASHMOE_STRESS_DELAY_NS or FLASHMOE_TRACE asks for (not both); its put build if
        ``device_puts`` (a layer with a peer on another node, or FLASHMOE_FORCE_PUT)."""
        delay = config.stress_delay_ns()
        if delay > 0 and config.trace():
            raise ValueError("FLASHMOE_STRESS_DELAY_NS and FLASHMOE_TRACE select different builds; set one")
        if delay > 0:
            variant = Variant.stress(delay)
        else:
            variant = Variant.trace() if config.trace() else Variant.default()
        return variant.with_puts() if device_puts else variant


def _gencode(arch: str) -> str:
    num = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def _run(cmd: list[str], verbose: bool) -> subprocess.Popen:
    if verbose:
        print("[flashmoe.build]", " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    errors = []
    for what, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"--- {what} failed (exit {proc.returncode}):\n{out[-8000:]}")
    if errors:
        raise FlashMoEBuildError("flashmoe kernel build failed:\n" + "\n".join(errors))


# The translation units: the host API, then one per kernel (csrc/flashmoe/kernels.h), with the device-code mode
# of each. The bf16 kernel is relocatable device code in every build: as a whole program, where its mainloops
# are inlined (gemm.cuh FLASHMOE_MAINLOOP), it ran 1.1-2.6x slower. The fp8 kernel is a whole program except in
# the put build (NVSHMEM's device library needs relocatable code): 1.00-1.06x faster so, and setmaxnreg works
# only there (benchmarks/kernel-notes.md, twenty-first session).
def _kernel_units(puts: bool) -> list[tuple[str, bool]]:
    """(source, relocatable device code) per nvcc translation unit."""
    return [("kernel.cu", False), ("kernel_bf16.cu", True), ("kernel_fp8.cu", puts)]


def compile_objects(src: Path, out: Path, arch: str, variant: Variant, nvcc: str) -> list[Path]:
    import torch
    from torch.utils import cpp_extension

    verbose = config.jit_verbose()
    nv = nvshmem_dir()
    includes = [f"-I{src}", f"-I{nv / 'include'}"]
    defines = [f"-D{d}" for d in variant.defines]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    dlink_o, bind_o = out / "dlink.o", out / "bindings.o"
    puts = variant.device_puts
    cuda_home = Path(nvcc).resolve().parent.parent
    torch_includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{cuda_home / 'include'}"]
    units = _kernel_units(puts)
    objects = [out / Path(name).with_suffix(".o").name for name, _ in units]
    procs = []
    for (name, relocatable), obj in zip(units, objects, strict=True):
        nvcc_cmd = [
            nvcc,
            "-c",
            str(src / name),
            "-o",
            str(obj),
            *(["-rdc=true"] if relocatable else []),
            _gencode(arch),
            "-std=c++17",
            "-O3",
            "-Xcompiler",
            "-fPIC",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            "-Xptxas=-v" if verbose else "-Xptxas=-O3",
            abi,
            *defines,
            *includes,
        ]
        procs.append((f"nvcc {name}", _run(nvcc_cmd, verbose)))
    cxx = os.environ.get("CXX", "g++")
    bind_cmd = [
        cxx,
        "-c",
        str(src / "bindings.cpp"),
        "-o",
        str(bind_o),
        "-std=c++20",
        "-O2",
        "-fPIC",
        abi,
        *defines,
        *includes,
        *torch_includes,
    ]
    _wait_all([*procs, ("c++ bindings.cpp", _run(bind_cmd, verbose))])
    # Device link of the relocatable units, with NVSHMEM's device library in the put build.
    dlink_cmd = [
        nvcc,
        "-dlink",
        *[str(obj) for (_, relocatable), obj in zip(units, objects, strict=True) if relocatable],
        *([str(nv / "lib" / "libnvshmem_device.a")] if puts else []),
        "-o",
        str(dlink_o),
        _gencode(arch),
        "-Xcompiler",
        "-fPIC",
    ]
    _wait_all([("nvcc -dlink", _run(dlink_cmd, verbose))])
    return [*objects, dlink_o, bind_o]


def link_library(out: Path, objects: list[Path], variant: Variant, nvcc: str, tmp_suffix: str = "") -> Path:
    """Host link of the library; needs no GPU and no driver.

    No ``-lcuda``: the objects call only the runtime API (libcudart, which finds the driver at run time) and
    NVSHMEM, so ``--no-undefined`` holds without the driver or the toolkit's ``lib64/stubs/libcuda.so``. A
    driver-API call added later fails this link loudly on a machine without a driver, rather than producing a
    library that cannot load.
    """
    import torch

    verbose = config.jit_verbose()
    nv = nvshmem_dir()
    cuda_home = Path(nvcc).resolve().parent.parent
    torch_lib = Path(torch.__file__).parent / "lib"
    lib = out / f"flashmoe_{variant.name}.so"
    target = lib.with_name(lib.name + tmp_suffix)
    cxx = os.environ.get("CXX", "g++")
    link_cmd = [
        cxx,
        "-shared",
        "-Wl,--no-undefined",
        "-o",
        str(target),
        *map(str, objects),
        # Put build: the device archive again, for its host half (the registration stubs of its device modules
        # and the NVSHMEM init entry point that installs this library's device state).
        *([str(nv / "lib" / "libnvshmem_device.a")] if variant.device_puts else []),
        f"-L{nv / 'lib'}",
        "-l:libnvshmem_host.so.3",
        f"-Wl,-rpath,{nv / 'lib'}",
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
        f"-L{cuda_home / 'lib64'}",
        "-lcudart",
    ]
    _wait_all([("link", _run(link_cmd, verbose))])
    if target != lib:
        os.replace(target, lib)
    return lib
