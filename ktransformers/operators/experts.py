"""Routed experts: KTransformersExperts replaces HF's fused experts module and dispatches by phase.

Shapes: x [T, H]; top_k_index, top_k_weights [T, K]; gate_up [E, 2I, H]; down [E, H, I].
    y[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = top_k_index[t, k]
Ops (EXPERT_OPS) own the expert weights in their format: KExpertsTorch is the dense reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseInjectedModule, Placement, choices, device_field
from .registry import EXPERT_OPS, register_operator


def check_routing(key: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_experts: int) -> None:
    """Raise ValueError (naming the operator) unless x [T, H], ids/weights [T, K] and 0 <= ids < E."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{key}: expected x [T, H] and top_k_index/top_k_weights [T, K], got "
                         f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"{key}: top_k_index must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        raise ValueError(f"{key}: expert ids must lie in [0, {n_experts}), got min {int(ids.min())} max {int(ids.max())}")


def moe_reference(x, ids, weights, gate_up, down, round_x=None, round_h=None, round_up=None) -> torch.Tensor:
    """The MoE formula, token-grouped per expert, in x's dtype. round_x / round_h, when given,
    transform the inputs of gate/up and of down (to model a kernel's activation rounding);
    round_up, when up's input is rounded otherwise than gate's (weights of another type)."""
    identity = lambda t: t  # noqa: E731
    round_x, round_h = round_x or identity, round_h or identity
    round_up = round_up or round_x
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    token_of, k = ids.shape[1], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[k:k + n]
        k += n
        tokens = slots // token_of
        gate_w, up_w = gate_up[e].chunk(2, dim=0)
        gate, up = F.linear(round_x(x[tokens]), gate_w), F.linear(round_up(x[tokens]), up_w)
        y = F.linear(round_h(F.silu(gate) * up), down[e])
        out.index_add_(0, tokens, y * weights.reshape(-1)[slots, None].to(y.dtype))
    return out


@dataclass(frozen=True)
class ExpertSpec:
    """What an experts op is built for: E experts of H -> I -> H, K per token, in the model's dtype."""
    key: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    dtype: torch.dtype
    int8_prefill: bool = False  # KExpertsCPU: keep int8 copies for the prefill GEMM (more RAM, faster prefill)


@EXPERT_OPS.register("KExpertsTorch")
class KExpertsTorch:
    """Reference experts: dense [E, 2I, H] and [E, H, I] weights in the model's dtype on one device."""

    def __init__(self, spec: ExpertSpec, device: torch.device):
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None

    def load(self, weights, context) -> None:
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        self.gate_up = weights.load(f"{self.key}.gate_up_proj", self.device, self.dtype, (E, 2 * I, H))
        self.down = weights.load(f"{self.key}.down_proj", self.device, self.dtype, (E, H, I))

    def unload(self) -> None:
        self.gate_up = self.down = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        return moe_reference(x.to(self.dtype), ids, weights, self.gate_up, self.down)


@EXPERT_OPS.register("KExpertsCPU")
class KExpertsCPU:
    """The C++ CPU experts on the stored GGML blocks: zero-copy views of the GGUF's stacked
    expert tensors (per-expert files are stacked once); types the kernels do not compute on, and
    FP8/other safetensors, are converted once to bf16."""

    checks_routing = True  # MoEKernel checks shapes and dtypes, the C++ side every expert id

    def __init__(self, spec: ExpertSpec, device: torch.device):
        if device.type != "cpu":
            raise ValueError(f"{spec.key}: KExpertsCPU runs on the CPU, not {device}")
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.kernel = None

    def _projection(self, weights, proj: str, shape: tuple[int, ...]):
        from ..kernels.cpu import ACTIVATION_BLOCK, ExpertWeights
        from .linear import dense_weights
        name = f"{self.key}.{proj}_proj"
        stored = weights.raw_stacked(name)
        if stored is not None and int(stored[1].ggml_type) in ACTIVATION_BLOCK and stored[1].shape == shape:
            return ExpertWeights(stored[0], int(stored[1].ggml_type))
        return dense_weights(weights, name, shape, self.dtype)

    def load(self, weights, context) -> None:
        from ..kernels.cpu import MoEKernel
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        gate, up = self._projection(weights, "gate", (E, I, H)), self._projection(weights, "up", (E, I, H))
        down = self._projection(weights, "down", (E, H, I))
        int8 = None
        if self.spec.int8_prefill:  # from the bytes just mapped, one expert at a time
            from ..kernels.cpu import Int8Rows
            shapes = ((E, I, H), (E, I, H), (E, H, I))
            int8 = tuple(Int8Rows.from_blocks(p, s) for p, s in zip((gate, up, down), shapes))
        self.kernel = MoEKernel(context.cpu_runtime(), experts=E, top_k=self.spec.top_k, hidden=H, intermediate=I,
                                gate=gate, up=up, down=down, name=self.key, int8=int8)

    def unload(self) -> None:
        self.kernel = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return self.kernel.forward(x, ids, weights).to(self.dtype)


@dataclass(frozen=True)
class ExpertsOptions(Placement):
    prefill_op: str = field(default="KExpertsTorch", metadata=choices(EXPERT_OPS.names))
    generate_op: str = field(default="KExpertsTorch", metadata=choices(EXPERT_OPS.names))
    out_device: str = device_field()
    int8_prefill: bool = False  # KExpertsCPU: int8 copies of the experts for a faster prefill GEMM


@register_operator("KTransformersExperts")
class KTransformersExperts(BaseInjectedModule):
    """HF experts' forward(hidden_states, top_k_index, top_k_weights) -> [T, H] on out_device."""

    Options = ExpertsOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        E, two_i, H = orig_module.gate_up_proj.shape
        self.n_experts = E
        top_k = getattr(config, "num_experts_per_tok", None) or E
        spec = ExpertSpec(key, E, H, two_i // 2, top_k, orig_module.gate_up_proj.dtype, self.options.int8_prefill)
        o = self.options
        self.ops = {"prefill": EXPERT_OPS.get(o.prefill_op)(spec, torch.device(o.prefill_device))}
        same = (o.prefill_op, o.prefill_device) == (o.generate_op, o.generate_device)
        self.ops["generate"] = self.ops["prefill"] if same else EXPERT_OPS.get(o.generate_op)(
            spec, torch.device(o.generate_device))

    def load(self) -> None:
        for op in {id(op): op for op in self.ops.values()}.values():
            op.load(self.weights, self.run_context())

    def unload(self) -> None:
        for op in self.ops.values():
            op.unload()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        op = self.ops[self.phase]
        if not getattr(op, "checks_routing", False):  # the C++ ops check shapes and ids themselves
            check_routing(self.key, hidden_states, top_k_index, top_k_weights, self.n_experts)
        y = op.forward(hidden_states.to(op.device), top_k_index.to(op.device), top_k_weights.to(op.device))
        return y.to(self.options.out_device, hidden_states.dtype)
