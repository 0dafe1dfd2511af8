"""What every Triton kernel module shares: whether Triton runs here, and the dot-product dtype."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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


def split_grid(x: torch.Tensor, N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int,
                per_sm: int = 2, min_blocks: int = 2):
    """(grid, k_per_split) of a GEMM over x [M, K] -> [M, N]: with few rows, K is split across
    programs until there are about `per_sm` programs an SM, each with >= `min_blocks` K blocks."""
    M = x.shape[0]
    tiles = -(-M // BLOCK_M) * -(-N // BLOCK_N)
    k_blocks = -(-K // BLOCK_K)
    splits = 1
    if M <= 64:
        splits = max(1, min(k_blocks // min_blocks, per_sm * sm_count(x.device) // max(tiles, 1)))
    k_per_split = -(-k_blocks // splits) * BLOCK_K
    splits = -(-K // k_per_split)
    return (-(-M // BLOCK_M), -(-N // BLOCK_N), splits), k_per_split


# Split-K launches with a serial reduction: each split stores its partial sums, and the last of a
# tile's programs to arrive (an int32 counter a tile, which it sets back to 0) adds them in split
# order and writes the output in its dtype. One launch where atomics into a zeroed float32 buffer
# take three (zero, GEMM, cast), and the same bits every run. The counters are one buffer a device:
# such launches on one device must not overlap on two streams (the engine runs its GEMMs on one).
MAX_SPLIT_TILES = 1024
_COUNTERS: dict[str, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The device's tile counters (all 0 between launches), or None where they cannot be made now
    (inside a CUDA graph capture before any launch outside one made them)."""
    key = str(device if device.type != "cuda" or device.index is not None
              else torch.device("cuda", torch.cuda.current_device()))
    counters = _COUNTERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


@dataclass
class SplitPlan:
    """A GEMM launch over x [M, K] -> y [M, N]. `partials` [splits, M, N] float32 and `counters`
    when K is split with the serial reduction; `atomic` when it is split with float32 atomics into
    y (zeroed, float32: the caller casts); neither when K is not split (y in out_dtype)."""
    grid: tuple[int, int, int]
    k_per_split: int
    y: torch.Tensor
    partials: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    atomic: bool = False

    @property
    def reduce(self) -> bool:
        return self.partials is not None

    def scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials, counters) as kernel arguments: y in their place where the plan has none
        (a kernel compiled without REDUCE never reads them)."""
        return (self.partials, self.counters) if self.reduce else (self.y, self.y)


def plan_split_k(x: torch.Tensor, N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int,
                 out_dtype: torch.dtype, per_sm: int = 2, min_blocks: int = 2) -> SplitPlan:
    """Plan a GEMM launch over x [M, K] -> [M, N]: with few rows K is split (split_grid), the
    splits reduced in the launch itself where the counters allow, else added with float32
    atomics into a zeroed y (a memset and a cast besides the GEMM: the fallback)."""
    grid, k_per_split = split_grid(x, N, K, BLOCK_M, BLOCK_N, BLOCK_K, per_sm, min_blocks)
    M = x.shape[0]
    counters = split_counters(x.device) if grid[2] > 1 and grid[0] * grid[1] <= MAX_SPLIT_TILES else None
    if grid[2] > 1 and counters is None:
        return SplitPlan(grid, k_per_split, torch.zeros(M, N, device=x.device, dtype=torch.float32), atomic=True)
    y = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if counters is None:
        return SplitPlan(grid, k_per_split, y)
    return SplitPlan(grid, k_per_split, y, torch.empty(grid[2], M, N, device=x.device, dtype=torch.float32), counters)

