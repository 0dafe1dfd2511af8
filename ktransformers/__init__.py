"""ktransformers: Mixture-of-Experts LLMs larger than GPU memory, with routed experts on the CPU."""
__version__ = "0.1.0"

import os

# torch's OpenMP workers otherwise spin after each of its parallel regions, on the cores our own
# pool is about to use (a 512-token prefill on 2 cores: ~7% of its time). libgomp reads the
# setting once, when torch loads it: so only when ktransformers is imported first, an explicit
# setting wins, and it is taken back out of the environment so that child processes (llama.cpp
# beside us in the benchmarks, which spins by design) start as they would have.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch  # noqa: F401
    del os.environ["OMP_WAIT_POLICY"]

from .loader import load_model  # noqa: E402
from .optimize.inject import optimize_and_load_gguf  # noqa: E402

__all__ = ["optimize_and_load_gguf", "load_model", "__version__"]
