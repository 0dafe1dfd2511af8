"""Rotary embeddings: upstream rule files replace them with their own classes; transformers'
modules already compute the right cos/sin (default, YaRN, ...), so these operators keep the HF
module and only place its buffers on the operator's device."""
from __future__ import annotations

import torch
from torch import nn

from .base import BaseInjectedModule
from .registry import OPERATORS

UPSTREAM_NAMES = ("RotaryEmbedding", "RotaryEmbeddingV3", "YarnRotaryEmbedding", "YarnRotaryEmbeddingV3",
                  "DeepSeekV3YarnRotaryEmbedding", "KRotaryEmbedding")


class KRotaryEmbedding(BaseInjectedModule):
    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.inner = orig_module

    def load(self) -> None:
        self.inner.to(self.device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = self.inner(x.to(self.device), position_ids.to(self.device))
        return cos.to(x.device), sin.to(x.device)


for _name in UPSTREAM_NAMES:
    OPERATORS.register(_name)(KRotaryEmbedding)
