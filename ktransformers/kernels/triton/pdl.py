"""Programmatic dependent launch (PDL, Hopper and later) of the decode step's kernels.

A decode step is a chain of small launches, each waiting for the one before: a MoE layer's GPU
part is about ten short launches, most of each one's time latency. Launched as
programmatic dependents, a kernel's programs start while the previous kernel still runs, load
what no launch of the step writes (weights), then wait in `gdc_enter` for the previous kernel to
complete with its stores visible, and let the next kernel start in turn. The launch gap and the
weights' first round trip then overlap the previous kernel.

The contract of a kernel given a GDC parameter: every program calls `gdc_enter` exactly once,
before it loads anything an earlier launch of the stream may have written and before it stores
anything (a program that never waited could let a later kernel start before an earlier one
ended: PDL orders a launch only after its immediate predecessor). Launches that are not PDL
(torch's kernels, copies, stream memory operations) keep full stream order around these.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import interpreting

_PDL = {"GDC": True, "launch_pdl": True}
_NO_PDL = {"GDC": False}


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # (NVIDIA's griddepcontrol)


def pdl(device: torch.device) -> dict:
    """Launch options of a kernel with a GDC parameter on `device`: a programmatic dependent
    launch on CUDA devices of compute capability >= 9, else GDC off (gdc_enter is then nothing)."""
    if device.type != "cuda" or interpreting():
        return _NO_PDL
    return _PDL if _has_pdl(device.index if device.index is not None else torch.cuda.current_device()) else _NO_PDL


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """Wait for the stream's previous kernel (its stores visible from here on), then let the next
    kernel's programs start."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
