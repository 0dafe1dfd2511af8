"""Linear layers: KTransformersLinear replaces nn.Linear and dispatches to a linear op by phase.

Shapes: x [..., I] -> y [..., O]; weight [O, I] (HF layout), bias [O] or absent.
Ops (LINEAR_OPS) own the weight in their format on one device: KLinearTorch keeps it dense.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
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

    def load(self, weights, has_bias: bool, context) -> None:
        shape = (self.out_features, self.in_features)
        self.weight = weights.load(f"{self.key}.weight", self.device, self.dtype, shape).contiguous()
        self.bias = weights.load(f"{self.key}.bias", self.device, self.dtype, shape[:1]) if has_bias else None

    def unload(self) -> None:
        self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError(f"{self.key}: linear op used before load()")
        return F.linear(x.to(self.dtype), self.weight, self.bias)


def dense_weights(weights, name: str, shape: tuple[int, ...], dtype: torch.dtype):
    """A tensor the CPU kernels cannot take as stored, dequantized once: float32 for float32
    models, else bf16 (both computed on with float activations)."""
    from ..kernels.cpu import ExpertWeights
    as_f32 = dtype == torch.float32
    data = weights.load(name, dtype=torch.float32 if as_f32 else torch.bfloat16, shape=shape).contiguous()
    return ExpertWeights(data, 0 if as_f32 else 30)


@LINEAR_OPS.register("KLinearCPU")
class KLinearCPU:
    """The C++ CPU linear on the stored GGML blocks (zero-copy); bias added in torch. Types the
    kernels do not compute on are dequantized once to bf16 and computed on as such."""

    def __init__(self, key: str, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype):
        if device.type != "cpu":
            raise ValueError(f"{key}: KLinearCPU runs on the CPU, not {device}")
        self.key, self.in_features, self.out_features, self.device, self.dtype = key, in_features, out_features, device, dtype
        self.kernel = None
        self.bias: torch.Tensor | None = None

    def load(self, weights, has_bias: bool, context) -> None:
        from ..kernels.cpu import ACTIVATION_BLOCK, ExpertWeights, LinearKernel
        name, shape = f"{self.key}.weight", (self.out_features, self.in_features)
        stored = weights.raw_stacked(name)
        if stored is None or int(stored[1].ggml_type) not in ACTIVATION_BLOCK or stored[1].shape != shape:
            data = dense_weights(weights, name, shape, self.dtype)
        else:
            raw, info = stored
            perm = weights.stored_row_order(name)
            if perm is not None:  # undo llama's Q/K row interleave once, on whole rows of blocks
                raw = torch.from_numpy(np.asarray(raw).reshape(self.out_features, -1))[torch.argsort(perm)].contiguous()
            data = ExpertWeights(raw, int(info.ggml_type))
        self.kernel = LinearKernel(context.cpu_runtime(), in_features=self.in_features, out_features=self.out_features,
                                   weight=data, name=self.key)
        self.bias = weights.load(f"{self.key}.bias", dtype=torch.float32, shape=shape[:1]) if has_bias else None

    def unload(self) -> None:
        self.kernel = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: linear op used before load()")
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        y = self.kernel.forward(flat)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(self.dtype)


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
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(self.weights, self.has_bias, self.run_context())

    def unload(self) -> None:
        for op in self.ops.values():
            op.unload()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self.ops[self.phase]
        return op.forward(x.to(op.device)).to(x.device)
