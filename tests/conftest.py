"""Session-wide test setup: without a CUDA device, Triton's interpreter runs the GPU kernels on
CPU tensors (it must be chosen before the kernel modules are imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
