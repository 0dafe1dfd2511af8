"""What every Triton kernel module shares: whether Triton runs here, and the dot-product dtype."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device`."""
    device = torch.device(device)
    if not triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def require(device: torch.device | str, what: str) -> None:
    """Raise a clear error when `what` (an operator) would need Triton where it cannot run."""
    device = torch.device(device)
    if not triton_available():
        raise RuntimeError(f"{what}: the GPU kernels need Triton (it ships with CUDA builds of torch)")
    if not runs_on(device):
        raise ValueError(f"{what}: the Triton kernels run on CUDA tensors, not {device} "
                         "(or on the CPU under TRITON_INTERPRET=1, for tests)")


# Feed tl.dot float32 instead of bf16 under the interpreter, whose bf16 dot is wrong (Triton 3.6-3.9).
# Fixed at import, like Triton's own choice of interpreter (made when a kernel is decorated).
DOT_F32 = interpreting()


# Above this many rows a GEMM is compute-bound: the weight is dequantized once to bf16 and cuBLAS
# multiplies (its tensor-core GEMM beats dequantizing inside every tile of a Triton GEMM).
DENSE_ROWS = 64


def dot_f32() -> bool:
    return DOT_F32


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_k(x: torch.Tensor, N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, out_dtype: torch.dtype):
    """Plan a GEMM launch over x [M, K] -> [M, N]: with few rows, K is split across programs until
    the GPU is busy (float32 atomics into a zeroed output). Returns (grid, k_per_split, atomic, y)."""
    M = x.shape[0]
    tiles = -(-M // BLOCK_M) * -(-N // BLOCK_N)
    k_blocks = -(-K // BLOCK_K)
    splits = 1
    if M <= 64:
        splits = max(1, min(k_blocks // 2, 2 * sm_count(x.device) // max(tiles, 1)))
    k_per_split = -(-k_blocks // splits) * BLOCK_K
    splits = -(-K // k_per_split)
    atomic = splits > 1
    y = (torch.zeros(M, N, device=x.device, dtype=torch.float32) if atomic
         else torch.empty(M, N, device=x.device, dtype=out_dtype))
    return (-(-M // BLOCK_M), -(-N // BLOCK_N), splits), k_per_split, atomic, y
