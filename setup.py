"""Build script. Package metadata lives in pyproject.toml; this adds the C++ CPU kernels.

csrc/ is compiled once per ISA level into its own extension module; ktransformers.kernels.cpu
picks the best one the CPU has at run time (KT_CPU_ISA forces a lower one). No CUDA is needed.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVXVNNI = AVX2 + ["-mavxvnni"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
AMX = AVX512 + ["-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"]
ISA_FLAGS = {"avx2": AVX2, "avxvnni": AVXVNNI, "avx512": AVX512, "amx": AMX}


def cpu_extension(isa: str) -> Pybind11Extension:
    name = f"_cpu_{isa}"
    return Pybind11Extension(
        f"ktransformers.kernels.{name}",
        [f"csrc/ext/{isa}.cpp"],  # includes every csrc/*.cpp: one object per ISA level
        include_dirs=["csrc"],
        depends=[str(p) for p in Path("csrc").glob("*.[ch]*")],
        define_macros=[("KT_MODULE", name), ("KT_ISA", isa)],
        extra_compile_args=["-O3", "-fvisibility=hidden", "-pthread", *ISA_FLAGS[isa]],
        extra_link_args=["-pthread"],
        cxx_std=17,
    )


class ParallelBuildExt(build_ext):
    """Build the ISA variants side by side (each is one independent translation unit)."""

    def build_extensions(self):
        self.check_extensions_list(self.extensions)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(self.build_extension, self.extensions))


setup(ext_modules=[cpu_extension(isa) for isa in ISA_FLAGS], cmdclass={"build_ext": ParallelBuildExt})
