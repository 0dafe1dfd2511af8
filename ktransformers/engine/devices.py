"""Where a module computes, as tensors report their devices."""
from __future__ import annotations

import torch

from ..operators.base import BaseInjectedModule


def indexed_device(device) -> torch.device:
    """`cuda` as `cuda:N` (the current GPU), as tensors report their device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def module_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """Where `module` computes: an operator's device for the current phase, else its first
    parameter's or buffer's, else `default`."""
    if isinstance(module, BaseInjectedModule):
        return indexed_device(module.device)
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else default
