"""The environment variables ktransformers reads, each read and validated here and nowhere else.

KT_CPU_ISA=avx2|avxvnni|avx512|amx
    Run the CPU kernels built for this ISA level instead of the best one the CPU has. Only a
    level the CPU supports is accepted (a lower one than the best: the tests use it to run every
    level this CPU has). Unset or empty: the best level.
"""
from __future__ import annotations

import os

CPU_ISAS = ("amx", "avx512", "avxvnni", "avx2")  # best first


def cpu_isa() -> str | None:
    """The ISA level KT_CPU_ISA asks for (lower-cased), or None when it is unset or empty.
    Raises ValueError naming the variable for a value that is no ISA level; whether this CPU has
    it is the caller's check (ktransformers.kernels.cpu.default_isa)."""
    value = os.environ.get("KT_CPU_ISA", "").strip().lower()
    if not value:
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"KT_CPU_ISA={value!r}: valid values are {', '.join(CPU_ISAS)}")
    return value
