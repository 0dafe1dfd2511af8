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


def _pure_torch_hybrids() -> None:
    """transformers' Qwen3-Next and Qwen3.5-MoE, the references of the hybrid tests, on their own
    torch functions: some releases hand them to flash-linear-attention wherever it is installed,
    whatever the inputs' device (CPU tensors then fail in Triton)."""
    import importlib
    for module in ("transformers.models.qwen3_next.modeling_qwen3_next",
                   "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"):
        try:
            _pure_torch(importlib.import_module(module))
        except ImportError:
            pass


def _pure_torch(m) -> None:
    import inspect
    for name, value in list(vars(m).items()):
        if callable(value) and name.startswith("torch_"):
            setattr(m, name, inspect.unwrap(value))
        elif callable(value) and (getattr(value, "__module__", "") or "").startswith("fla"):
            setattr(m, name, None)  # (imported kernels: the layer then takes the torch functions)
        elif callable(value) and inspect.unwrap(value) is not value and name.startswith("causal_conv1d"):
            setattr(m, name, inspect.unwrap(value))
    if hasattr(m, "is_fast_path_available"):
        m.is_fast_path_available = False


_pure_torch_hybrids()
