"""Session-wide test setup: without a CUDA device, Triton's interpreter runs the GPU kernels on
CPU tensors (it must be chosen before the kernel modules are imported); tests marked `triton`
skip, with the reason, where Triton is not installed (it is an optional dependency)."""
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _triton_missing() -> str | None:
    """Why Triton cannot be imported here, or None where it can."""
    try:
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
    except ImportError as e:
        return f"Triton cannot be imported ({e})"
    return None


TRITON_MISSING = _triton_missing()


def pytest_runtest_setup(item):
    if TRITON_MISSING and item.get_closest_marker("triton"):
        pytest.skip(f"needs Triton for its kernels: {TRITON_MISSING}; pip install 'triton>=3.9'")
