"""Question: does advising the CPU kernels' buffers for transparent huge pages (kernels.cpu.weight_empty)
pay end to end on a given host, e.g. the GPU host's bench.e2e? Runs any module with weight_empty
replaced by plain torch.empty (4 KiB pages where THP is "madvise"); run the same module without it,
in the same session, and compare.

    python dev/no_hugepages.py ktransformers.bench.e2e --gguf_path /tmp/glm-4.5-air-8.gguf --threads 14 ...
"""
import runpy
import sys

import torch

from ktransformers.kernels import cpu


def plain_empty(shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


cpu.weight_empty = plain_empty
module = sys.argv.pop(1)
sys.argv[0] = module
runpy.run_module(module, run_name="__main__")
