"""Upstream KTransformers' import path of the loader: `from ktransformers.optimize.optimize import
optimize_and_load_gguf` works as its scripts wrote it (the same function as ktransformers')."""
from .inject import optimize_and_load_gguf

__all__ = ["optimize_and_load_gguf"]
