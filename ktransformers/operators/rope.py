"""Rotary embeddings: upstream rule files replace them with their own classes; transformers'
modules already compute the right cos/sin (default, YaRN, ...), so these operators keep the HF
module and only place its buffers on the operator's device. DeepSeek-V2's module gives complex
factors instead; they become the (cos, sin) tables every attention operator and the engine take.
`rotary_tables` is how the engine calls a model's rotary module (MRoPE's too)."""
from __future__ import annotations

import torch
from torch import nn

from .base import BaseInjectedModule
from .registry import OPERATORS

UPSTREAM_NAMES = ("RotaryEmbedding", "RotaryEmbeddingV3", "RotaryEmbeddingV4", "YarnRotaryEmbedding",
                  "YarnRotaryEmbeddingV3", "DeepSeekV3YarnRotaryEmbedding", "KQwen3MoeRotaryEmbedding",
                  "KGlm4MoeRotaryEmbedding", "KRotaryEmbedding")


def complex_to_cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's rotary factors [B, S, p/2] (complex, scaled) -> (cos, sin) [B, S, p] as
    DeepSeek-V3's module gives them (each half the same): rotating de-interleaved pairs by these
    (apply_rotary_pos_emb_interleave) gives V2's complex rotation with its dims permuted the same
    way in q and k, so every score is the same."""
    cos, sin = freqs.real.float(), freqs.imag.float()
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class KRotaryEmbedding(BaseInjectedModule):
    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.inner = orig_module

    def load(self) -> None:
        self.inner.to(self.device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        out = self.inner(x.to(self.device), position_ids.to(self.device))
        cos, sin = complex_to_cos_sin(out) if torch.is_tensor(out) else out
        return cos.to(x.device), sin.to(x.device)


for _name in UPSTREAM_NAMES:
    OPERATORS.register(_name)(KRotaryEmbedding)


def rotary_tables(rotary: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> tuple:
    """(cos, sin) of the model's rotary module at `positions` [1, N]. An MRoPE module (Qwen3.5's:
    a position per section) takes them as [3, 1, N], every section at the token's position, as
    a text prompt has them (some transformers releases expand [1, N] themselves, some do not)."""
    if hasattr(rotary, "mrope_section"):
        positions = positions.expand(3, *positions.shape)
    return rotary(hidden, positions)
