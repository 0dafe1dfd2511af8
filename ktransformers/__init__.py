"""ktransformers: Mixture-of-Experts LLMs larger than GPU memory, with routed experts on the CPU."""
__version__ = "0.1.0"

import os

# torch's OpenMP workers spin after each of its parallel regions (libgomp: 300000 spins by
# default) on the cores our own pool is about to use. A short spin keeps torch's back-to-back
# regions quick to start and gives the cores back soon after, so a prefill on few cores gets
# faster and the server keeps its throughput (never spinning, OMP_WAIT_POLICY=PASSIVE, would
# make every region start cold and slow the server down). libgomp reads this once, when torch loads it:
# so it applies only when ktransformers is imported first, a setting of the user's wins, and it
# is taken back out of the environment so that child processes (llama.cpp in the benchmarks)
# start as they would have.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
    import torch  # noqa: F401
    del os.environ["GOMP_SPINCOUNT"]

from .loader import load_model  # noqa: E402
from .optimize.inject import optimize_and_load_gguf  # noqa: E402

__all__ = ["optimize_and_load_gguf", "load_model", "__version__"]
