"""The routed experts' formula in plain torch, the reference every experts op is tested against,
and KExpertsTorch, the op that computes with it.

Shapes: x [T, H]; top_k_index, top_k_weights [T, K]; gate_up [E, 2I, H]; down [E, H, I].
    y[t] = sum_k w[t,k] * down_e(act(gate_e(x_t), up_e(x_t))),  e = top_k_index[t, k]
with act the SwiGLU silu(g) * u, or gpt-oss's clamped form (Activation), and each projection
optionally with a bias [E, out].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..registry import EXPERT_OPS


def check_routing(key: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_experts: int) -> None:
    """Raise ValueError (naming the operator) unless x [T, H], ids/weights [T, K] and 0 <= ids < E."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{key}: expected x [T, H] and top_k_index/top_k_weights [T, K], got "
                         f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"{key}: top_k_index must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
        raise ValueError(f"{key}: expert ids must lie in [0, {n_experts}), got min {int(ids.min())} max {int(ids.max())}")


@dataclass(frozen=True)
class Activation:
    """h = act(g, u) between the gate/up and down projections: the SwiGLU silu(g) * u, or with a
    `limit`, gpt-oss's clamped form: g clamped above at limit, u to [-limit, limit], then
    g * sigmoid(alpha * g) * (u + 1)."""
    limit: float | None = None
    alpha: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SWIGLU = Activation()


def moe_reference(x, ids, weights, gate_up, down, round_x=None, round_h=None, round_up=None,
                  act: Activation = SWIGLU, bias=None) -> torch.Tensor:
    """The MoE formula, token-grouped per expert, in x's dtype. round_x / round_h, when given,
    transform the inputs of gate/up and of down (to model a kernel's activation rounding);
    round_up, when up's input is rounded otherwise than gate's (weights of another type).
    `bias`: (gate_up bias [E, 2I], down bias [E, H]) or None."""
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
        gate_b, up_b = (None, None) if bias is None else bias[0][e].chunk(2)
        gate, up = F.linear(round_x(x[tokens]), gate_w, gate_b), F.linear(round_up(x[tokens]), up_w, up_b)
        y = F.linear(round_h(act(gate, up)), down[e], None if bias is None else bias[1][e])
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
    # KExpertsCPU fed from a GPU: of each decode token's top-k, the GPU computes this many ("auto": by rates)
    pcie_experts: int | str = 0
    int4_group: int = 0  # KExpertsCPU: int4 prefill copies in groups of this many columns instead (0: none)
    int4_decode: bool = False  # KExpertsCPU: the int4 copies serve decode too; the stored weights are not kept
    act: Activation = SWIGLU
    bias: bool = False  # gate, up and down have biases (experts.<p>_proj_bias [E, out])
    int8_backward: bool = False  # KExpertsCPU: the training backward on int8 copies (ExpertsOptions)


@EXPERT_OPS.register("KExpertsTorch")
class KExpertsTorch:
    """Reference experts: dense [E, 2I, H] and [E, H, I] weights in the model's dtype on one device."""

    def __init__(self, spec: ExpertSpec, device: torch.device):
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def load(self, weights, context) -> None:
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        self.gate_up = weights.load(f"{self.key}.gate_up_proj", self.device, self.dtype, (E, 2 * I, H))
        self.down = weights.load(f"{self.key}.down_proj", self.device, self.dtype, (E, H, I))
        self.bias = load_biases(weights, self.spec, self.device) if self.spec.bias else None

    def unload(self) -> None:
        self.gate_up = self.down = self.bias = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        return moe_reference(x.to(self.dtype), ids, weights, self.gate_up, self.down, act=self.spec.act,
                             bias=self.bias)


    def trainable_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """forward on the op's device, differentiable (torch ops) with respect to x and the weights."""
        return self.forward(x.to(self.device), ids.to(self.device), weights.to(self.device))

    def pairs(self):
        """The frozen per-pair products adapters on the experts build on (adapters.py)."""
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        from .adapters import DensePairs
        return DensePairs(self.gate_up, self.down)


def load_biases(weights, spec: ExpertSpec, device, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up bias [E, 2I], down bias [E, H]) of the experts `spec` describes."""
    E, H, I, key, dtype = spec.experts, spec.hidden, spec.intermediate, spec.key, dtype or spec.dtype
    gate_up = torch.cat([weights.load(f"{key}.{p}_proj_bias", device, dtype, (E, I)) for p in ("gate", "up")], dim=1)
    return gate_up, weights.load(f"{key}.down_proj_bias", device, dtype, (E, H))
