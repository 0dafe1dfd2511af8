"""ktransformers: Mixture-of-Experts LLMs larger than GPU memory, with routed experts on the CPU."""
__version__ = "0.1.0"

from .loader import load_model
from .optimize.inject import optimize_and_load_gguf

__all__ = ["optimize_and_load_gguf", "load_model", "__version__"]
