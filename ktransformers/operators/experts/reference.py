"""The routed experts' formula in plain torch, the reference every experts op is tested against,
and KExpertsTorch, the op that computes with it.

Shapes: x [T, H]; top_k_index, top_k_weights [T, K]; gate_up [E, 2I, H]; down [E, H, I].
    y[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = top_k_index[t, k]
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
    # KExpertsCPU fed from a GPU: of each decode token's top-k, the GPU computes this many ("auto": by rates)
    pcie_experts: int | str = 0
    int4_group: int = 0  # KExpertsCPU: int4 prefill copies in groups of this many columns instead (0: none)
    int4_decode: bool = False  # KExpertsCPU: the int4 copies serve decode too; the stored weights are not kept


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
