"""Linear layers: KTransformersLinear replaces nn.Linear and dispatches to a linear op by phase.

Shapes: x [..., I] -> y [..., O]; weight [O, I] (HF layout), bias [O] or absent.
Ops (LINEAR_OPS) own the weight in their format on one device: KLinearTorch keeps it dense.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseInjectedModule, Placement, choices
from .registry import LINEAR_OPS, register_operator


@LINEAR_OPS.register("KLinearTorch")
class KLinearTorch:
    """Reference linear: a dense weight in the model's dtype, F.linear."""

    def __init__(self, key: str, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype):
        self.key, self.in_features, self.out_features = key, in_features, out_features
        self.device, self.dtype = device, dtype
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.key}: weight shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}")
        self.weight = weight.to(self.device, self.dtype).contiguous()
        self.bias = None if bias is None else bias.to(self.device, self.dtype)

    def unload(self) -> None:
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError(f"{self.key}: linear op used before load()")
        return F.linear(x.to(self.dtype), self.weight, self.bias)


@dataclass(frozen=True)
class LinearOptions(Placement):
    prefill_op: str = field(default="KLinearTorch", metadata=choices(LINEAR_OPS.names))
    generate_op: str = field(default="KLinearTorch", metadata=choices(LINEAR_OPS.names))


@register_operator("KTransformersLinear")
class KTransformersLinear(BaseInjectedModule):
    """nn.Linear's forward(x) with a per-phase op; one op instance when both phases agree."""

    Options = LinearOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Linear, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.in_features, self.out_features = orig_module.in_features, orig_module.out_features
        self.has_bias = orig_module.bias is not None
        self.dtype = orig_module.weight.dtype
        o = self.options
        self.ops = {"prefill": self._make_op(o.prefill_op, o.prefill_device)}
        same = (o.prefill_op, o.prefill_device) == (o.generate_op, o.generate_device)
        self.ops["generate"] = self.ops["prefill"] if same else self._make_op(o.generate_op, o.generate_device)

    def _make_op(self, name: str, device: str):
        return LINEAR_OPS.get(name)(self.key, self.in_features, self.out_features, torch.device(device), self.dtype)

    def load(self) -> None:
        weight = self.weights.load(f"{self.key}.weight", shape=(self.out_features, self.in_features))
        bias = self.weights.load(f"{self.key}.bias", shape=(self.out_features,)) if self.has_bias else None
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(weight, bias)

    def unload(self) -> None:
        for op in self.ops.values():
            op.unload()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self.ops[self.phase]
        return op.forward(x.to(op.device)).to(x.device)
