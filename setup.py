"""Build of kvstore's native extensions; project metadata lives in pyproject.toml.

* ``kvstore._C`` (pybind11, C++17): CPU gather/scatter of paged-KV blocks. Always built. Its fused-checksum
  entries dlopen ``libxxhash.so.0`` at first use (no xxhash headers or link needed; without the library they
  report themselves unavailable and callers hash in Python).
* ``kvstore._C_cuda`` (pybind11 + CUDA): the GPU kernels and the CUDA runtime helpers of the GPU data path
  (IPC handles, pinned host ranges, copies and events on a caller's stream), linked with the static CUDA
  runtime so that no runtime library path is needed. Built when ``nvcc`` is found; ``KVSTORE_CUDA=0`` skips
  it, ``=1`` makes its absence or failure an error. ``KVSTORE_CUDA_ARCHS="80;90"`` picks the SASS targets (PTX
  for the newest is always embedded as well, so newer GPUs JIT it).

Neither extension includes torch headers or links torch: the kernels take raw addresses and strides, so the
build needs no torch and survives torch ABI changes. Extensions compile in parallel (one job per core), and
nvcc runs alongside the host compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.modified import newer_group
except ImportError:  # setuptools < 69
    from setuptools._distutils.dep_util import newer_group

ROOT = Path(__file__).resolve().parent
CSRC = Path("csrc")
DEFAULT_CUDA_ARCHS = ("80", "90")
HOST_FLAGS = ["-O3"]


def _cuda_mode() -> str:
    """'off', 'auto' or 'required', from KVSTORE_CUDA."""
    value = os.environ.get("KVSTORE_CUDA", "").strip().lower()
    modes = {"": "auto", "auto": "auto", "0": "off", "off": "off", "false": "off", "1": "required",
             "on": "required", "true": "required"}
    if value not in modes:
        raise SystemExit(f"KVSTORE_CUDA must be 0, 1 or unset, got {value!r}")
    return modes[value]


def _find_cuda() -> tuple[Path, Path] | None:
    """(nvcc, directory holding libcudart_static.a), or None when no usable toolkit is found."""
    nvcc_on_path = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc_on_path:
        roots.append(str(Path(nvcc_on_path).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        root_path = Path(root)
        nvcc = root_path / "bin" / "nvcc"
        if not nvcc.exists():
            continue
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (root_path / lib / "libcudart_static.a").exists():
                return nvcc, root_path / lib
    return None


def _gencode_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("KVSTORE_CUDA_ARCHS", ";".join(DEFAULT_CUDA_ARCHS)).split(";")]
    archs = [a for a in archs if a]
    if not archs or not all(a.isdigit() for a in archs):
        raise SystemExit(f"KVSTORE_CUDA_ARCHS must be like '80;90', got {os.environ.get('KVSTORE_CUDA_ARCHS')!r}")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=int)
    return flags + [f"-gencode=arch=compute_{newest},code=compute_{newest}"]


class CudaExtension(Pybind11Extension):
    """A pybind11 extension whose ``cuda_sources`` are compiled by nvcc and linked in as objects."""

    def __init__(self, name: str, sources: list[str], cuda_sources: list[str], nvcc: Path, **kwargs):
        super().__init__(name, sources, **kwargs)
        self.cuda_sources = cuda_sources
        self.nvcc = nvcc


class BuildExt(build_ext):
    """build_ext that builds extensions in parallel and runs nvcc concurrently with the host compiler."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext) -> None:
        if not isinstance(ext, CudaExtension):
            super().build_extension(ext)
            return
        try:
            self._build_cuda_extension(ext)
        except Exception as exc:  # noqa: BLE001 -- auto mode degrades to a CPU-only build, loudly
            if _cuda_mode() == "required":
                raise
            print(f"warning: kvstore._C_cuda not built ({exc}); CUDA tensors will be rejected", file=sys.stderr)

    def _build_cuda_extension(self, ext: CudaExtension) -> None:
        ext_path = self.get_ext_fullpath(ext.name)
        inputs = [*ext.sources, *ext.cuda_sources, *ext.depends]
        if not self.force and os.path.exists(ext_path) and not newer_group(inputs, ext_path):
            print(f"skipping {ext.name!r} extension (up-to-date)")
            return
        objects: list[str] = []
        errors: list[BaseException] = []
        thread = threading.Thread(target=self._run_nvcc, args=(ext, objects, errors))
        thread.start()  # nvcc compiles the kernels while the host compiler builds the bindings
        try:
            sources = [str(s) for s in ext.sources]
            host_objects = self.compiler.compile(
                sources, output_dir=self.build_temp, macros=ext.define_macros, include_dirs=ext.include_dirs,
                debug=self.debug, extra_postargs=ext.extra_compile_args, depends=ext.depends)
        finally:
            thread.join()
        if errors:
            raise errors[0]
        os.makedirs(os.path.dirname(ext_path) or ".", exist_ok=True)
        self.compiler.link_shared_object(
            host_objects + objects, ext_path, libraries=ext.libraries, library_dirs=ext.library_dirs,
            extra_postargs=ext.extra_link_args, debug=self.debug, build_temp=self.build_temp, target_lang="c++")

    def _run_nvcc(self, ext: CudaExtension, objects: list[str], errors: list[BaseException]) -> None:
        try:
            for source in ext.cuda_sources:
                obj = Path(self.build_temp) / (Path(source).stem + ".cu.o")
                obj.parent.mkdir(parents=True, exist_ok=True)
                cmd = [str(ext.nvcc), "-c", source, "-o", str(obj), "-O3", "-std=c++17", f"-I{CSRC}",
                       "-Xcompiler", "-fPIC,-fvisibility=hidden", *_gencode_flags()]
                print(" ".join(cmd))
                subprocess.run(cmd, check=True)
                objects.append(str(obj))
        except BaseException as exc:  # handed to the building thread
            errors.append(exc)


def _extensions() -> list[Pybind11Extension]:
    exts = [Pybind11Extension("kvstore._C", [str(CSRC / "pack_cpu.cpp")], include_dirs=[str(CSRC)],
                              depends=[str(CSRC / "page_plan.h")], cxx_std=17, extra_compile_args=HOST_FLAGS,
                              libraries=["dl"])]  # dlopen of libxxhash.so.0 (fused checksums), not linked
    mode = _cuda_mode()
    if mode == "off":
        return exts
    cuda = _find_cuda()
    if cuda is None:
        if mode == "required":
            raise SystemExit("KVSTORE_CUDA=1 but no CUDA toolkit (nvcc and libcudart_static.a) was found; "
                             "set CUDA_HOME")
        print("note: nvcc not found, building kvstore without CUDA kernels", file=sys.stderr)
        return exts
    nvcc, cuda_lib = cuda
    exts.append(CudaExtension(
        "kvstore._C_cuda", [str(CSRC / "cuda" / "bindings_cuda.cpp")],
        cuda_sources=[str(CSRC / "cuda" / "pack_kernels.cu"), str(CSRC / "cuda" / "runtime_cuda.cu")], nvcc=nvcc,
        include_dirs=[str(CSRC)], depends=[str(CSRC / "page_plan.h"), str(CSRC / "cuda" / "pack_cuda.h"),
                                           str(CSRC / "cuda" / "cuda_util.h"), str(CSRC / "cuda" / "runtime_cuda.h")],
        cxx_std=17, extra_compile_args=HOST_FLAGS, library_dirs=[str(cuda_lib)],
        libraries=["cudart_static", "rt", "pthread", "dl"],
        # Keep the static runtime's symbols private: torch loads its own libcudart globally, and our calls must
        # not bind to it (our fat binary is registered with our runtime).
        extra_link_args=["-Wl,--exclude-libs,ALL"]))
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
