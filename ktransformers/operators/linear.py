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

from .base import BaseInjectedModule, Placement, choices, device_field
from .registry import LINEAR_OPS, register_operator


@LINEAR_OPS.register("KLinearTorch")
class KLinearTorch:
    """Reference linear: a dense weight in the model's dtype, F.linear."""

    def __init__(self, key: str, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype,
                 options=None):
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
    models (computed on with float activations), else bf16 (with bf16 activations, as the
    AMX-BF16 and AVX512-BF16 kernels take them)."""
    from ..kernels.cpu import ExpertWeights
    as_f32 = dtype == torch.float32
    data = weights.load(name, dtype=torch.float32 if as_f32 else torch.bfloat16, shape=shape).contiguous()
    return ExpertWeights(data, 0 if as_f32 else 30)


def stored_weight(weights, key: str, shape: tuple[int, int]):
    """(raw bytes, ggml type) of `key`.weight as stored, in HF row order, or None when it is not
    stored as one GGML tensor of `shape` (the caller then loads it dequantized)."""
    name = f"{key}.weight"
    stored = weights.raw_stacked(name)
    if stored is None or stored[1].shape != shape:
        return None
    raw, info = stored
    perm = weights.stored_row_order(name)
    if perm is not None:  # undo llama's Q/K row interleave once, on whole rows of blocks
        raw = torch.from_numpy(np.asarray(raw).reshape(shape[0], -1))[torch.argsort(perm)].contiguous()
    return raw, int(info.ggml_type)


@LINEAR_OPS.register("KLinearCPU")
class KLinearCPU:
    """The C++ CPU linear on the stored GGML blocks (a view of the file, or its 16-row tiles where
    RAM holds them: context.cpu_tiles); bias added in torch. Types the
    kernels do not compute on are dequantized once to bf16 and computed on as such."""

    def __init__(self, key: str, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype,
                 options=None):
        if device.type != "cpu":
            raise ValueError(f"{key}: KLinearCPU runs on the CPU, not {device}")
        self.key, self.in_features, self.out_features, self.device, self.dtype = key, in_features, out_features, device, dtype
        self.kernel = None
        self.bias: torch.Tensor | None = None

    def load(self, weights, has_bias: bool, context) -> None:
        from ..kernels.cpu import ACTIVATION_BLOCK, ExpertWeights, LinearKernel
        shape = (self.out_features, self.in_features)
        stored = stored_weight(weights, self.key, shape)
        if stored is None or stored[1] not in ACTIVATION_BLOCK:
            data = dense_weights(weights, f"{self.key}.weight", shape, self.dtype)
        else:
            data = ExpertWeights(*stored)
        self.kernel = LinearKernel(context.cpu_runtime(), in_features=self.in_features, out_features=self.out_features,
                                   weight=data, name=self.key, tiles=context.cpu_tiles)
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


class _TritonLinear:
    """Shared by the GPU linears: a weight in a Triton kernel's format on a CUDA device, bias in
    torch. Subclasses say how to build the weight (`_convert`) and which kernel runs it."""

    kind = ""

    def __init__(self, key: str, in_features: int, out_features: int, device: torch.device, dtype: torch.dtype,
                 options=None):
        from ..kernels.triton.common import require
        require(device, f"{key}: {type(self).__name__}")
        self.key, self.in_features, self.out_features, self.device, self.dtype = key, in_features, out_features, device, dtype
        self.requantize = bool(getattr(options, "requantize", False))
        self.weight = None  # the kernel's weight object, or a dense bf16 tensor (F.linear)
        self.bias: torch.Tensor | None = None

    def _dense(self, weights) -> torch.Tensor:
        return weights.load(f"{self.key}.weight", dtype=torch.float32, shape=(self.out_features, self.in_features))

    def _stored(self, weights):
        return stored_weight(weights, self.key, (self.out_features, self.in_features))

    def load(self, weights, has_bias: bool, context) -> None:
        w = self._convert(weights)
        # a dense fallback keeps the model's dtype (bf16 on GPUs; float32 models stay exact)
        self.weight = w.to(self.device) if not isinstance(w, torch.Tensor) else w.to(self.device, self.dtype)
        shape = (self.out_features,)
        self.bias = weights.load(f"{self.key}.bias", self.device, torch.float32, shape) if has_bias else None

    def unload(self) -> None:
        self.weight = self.bias = None

    def _gemm(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y = x Wᵀ rounded once to out_dtype (float32 sums)."""
        raise NotImplementedError

    def _gemm_bias(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y = x Wᵀ + bias rounded once to out_dtype (float32 sums)."""
        return (self._gemm(x, torch.float32) + self.bias).to(out_dtype)

    def _dense_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """A dense fallback weight: decode-sized rows on a small weight through the one-launch
        Triton GEMV (a small projection's cost is launch latency, where cuBLAS's bf16 GEMV is
        slower), else cuBLAS (which streams a large one, e.g. an lm_head, faster). The bias is added
        in float32 before the one rounding to the layer's dtype (in the GEMV's launch)."""
        from ..kernels.triton.common import runs_on
        from ..kernels.triton.quant_linear import DENSE_GEMV_WEIGHTS, GEMV_ROWS, dense_gemv
        if x.shape[0] <= GEMV_ROWS and self.weight.numel() <= DENSE_GEMV_WEIGHTS and runs_on(x.device):
            return dense_gemv(x, self.weight, self.dtype, self.bias)
        y = F.linear(x.to(self.weight.dtype), self.weight)
        return y if self.bias is None else (y.float() + self.bias).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError(f"{self.key}: linear op used before load()")
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if isinstance(self.weight, torch.Tensor):
            y = self._dense_gemm(flat)
        elif self.bias is not None:
            y = self._gemm_bias(flat, self.dtype)
        else:
            y = self._gemm(flat, self.dtype)  # (the output dtype the kernel's to round to, once)
        return y.reshape(*shape[:-1], self.out_features).to(self.dtype)


@LINEAR_OPS.register("KLinearMarlin")
class KLinearMarlin(_TritonLinear):
    """int4 group-quantized weights (Triton GEMM): GGUF Q4_0/Q4_K converted losslessly (per-32
    scale + offset), Q8_0 kept as int8, Q6_K as int8 with its per-16 scales; any other type stays
    dense bf16 unless `requantize: true` asks for int4 (lossy)."""

    def _convert(self, weights):
        from ..kernels.triton import quant_linear as ql
        from ..weights.ggml_quants import GROUP16_TYPES, GROUP_AFFINE_TYPES
        stored = self._stored(weights)
        if stored is not None and stored[1] in {int(t) for t in GROUP_AFFINE_TYPES + GROUP16_TYPES}:
            return ql.from_ggml(stored[0], stored[1], (self.out_features, self.in_features))
        if self.requantize and self.in_features % ql.GROUP == 0:
            return ql.quantize_int4(self._dense(weights))
        return self._dense(weights)

    def _gemm(self, x, out_dtype):
        from ..kernels.triton.quant_linear import group_gemm
        return group_gemm(x, self.weight, out_dtype)

    def _gemm_bias(self, x, out_dtype):
        from ..kernels.triton.quant_linear import group_gemm
        return group_gemm(x, self.weight, out_dtype, self.bias)


@LINEAR_OPS.register("KLinearQ8")
class KLinearQ8(KLinearMarlin):
    """int8 weights with per-32 scales: GGUF Q8_0 as stored (Q6_K with its per-16 scales), other
    types re-quantized to int8."""

    def _convert(self, weights):
        from ..kernels.triton import quant_linear as ql
        from ..weights.ggml_quants import GGMLType
        stored = self._stored(weights)
        if stored is not None and stored[1] in (int(GGMLType.Q8_0), int(GGMLType.Q6_K)):
            return ql.from_ggml(stored[0], stored[1], (self.out_features, self.in_features))
        if self.in_features % ql.GROUP:
            return self._dense(weights)
        return ql.quantize_int8(self._dense(weights))


@LINEAR_OPS.register("KLinearFP8")
class KLinearFP8(_TritonLinear):
    """FP8 e4m3 weights with 128x128 block scales: DeepSeek-V3's native FP8 safetensors as
    stored; other weights quantized to that format at load."""

    def _convert(self, weights):
        from ..kernels.triton.fp8 import FP8Weight, quantize_fp8
        stored = weights.fp8_blocks(f"{self.key}.weight")
        if stored is not None and tuple(stored[0].shape) == (self.out_features, self.in_features):
            return FP8Weight(stored[0].contiguous(), stored[1].float().contiguous())
        return quantize_fp8(self._dense(weights))

    def _gemm(self, x, out_dtype):
        from ..kernels.triton.fp8 import fp8_gemm
        return fp8_gemm(x, self.weight, out_dtype)


@dataclass(frozen=True)
class LinearOptions(Placement):
    prefill_op: str = field(default="KLinearTorch", metadata=choices(LINEAR_OPS.names))
    generate_op: str = field(default="KLinearTorch", metadata=choices(LINEAR_OPS.names))
    requantize: bool = False  # KLinearMarlin: re-quantize weights of other types to int4 (lossy)
    # upstream's KLinearMarlin bit width: its int4 is the one here (other widths are refused)
    num_bits: int = field(default=4, metadata=choices(lambda: [4]))
    out_device: str | None = device_field(None)  # where the output goes (None: where the input came from)


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
        return LINEAR_OPS.get(name)(self.key, self.in_features, self.out_features, torch.device(device), self.dtype,
                                    options=self.options)

    def load(self) -> None:
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(self.weights, self.has_bias, self.run_context())

    def unload(self) -> None:
        for op in self.ops.values():
            op.unload()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self.ops[self.phase]
        return op.forward(x.to(op.device)).to(self.options.out_device or x.device)


def cpu_kernel(module):
    """(the C++ Linear, its float32 bias or None) of a KTransformersLinear whose generate op is
    KLinearCPU, else None."""
    op = getattr(module, "ops", {}).get("generate")
    if isinstance(op, KLinearCPU) and op.kernel is not None and (op.bias is None or op.bias.dtype == torch.float32):
        return op.kernel._linear, op.bias
    return None


def direct_call(module):
    """`module`'s decode-step call on one float32 row x [1, I] -> [1, O] (float32, on the CPU),
    without the module calls and checks between it and its kernel: the C++ linear of a
    KTransformersLinear whose generate op is KLinearCPU in float32 (bias added), or F.linear on a
    plain nn.Linear's float32 CPU weight; None for any other module. The same kernel with the
    same input as the module's own forward, so the same result to the bit; x must be contiguous."""
    if isinstance(module, KTransformersLinear):
        found = cpu_kernel(module)
        if found is None or module.ops["generate"].dtype != torch.float32 or module.options.out_device not in (None, "cpu"):
            return None
        (linear, bias), width = found, module.out_features

        def call(x: torch.Tensor) -> torch.Tensor:
            y = torch.empty(1, width)
            linear.forward(1, x.data_ptr(), y.data_ptr(), 0)  # (0: float32)
            return y if bias is None else y + bias
        return call
    if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    return None
