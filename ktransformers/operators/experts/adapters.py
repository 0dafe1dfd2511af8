"""LoRA adapters on the routed experts, beside frozen experts that compute elsewhere (the C++ CPU
kernels, or the torch reference).

An adapted projection (gate_up or down) of all E experts holds the two matrices peft gives a 3-D
expert parameter it targets (LoraConfig.target_parameters): lora_A [r*E, in] and lora_B
[out, r*E]. Expert e's factors are A_e = lora_A's rows e*r .. e*r + r - 1 and B_e = lora_B's
columns e, E + e, 2E + e, ..., and its projection becomes
    gate_up(x) = G_e x + s B_e A_e x,    down(h) = D_e h + s B_e A_e h    (s = alpha / r)
with gate_up's 2I outputs split into gate and up as the family's experts split them (halves, or
gpt-oss's alternate rows).

The frozen products come per (token, expert) pair from the experts op (MoEKernel.pair_*: the
activation needs g and u whole, adapters included); the activation, the low-rank terms and the
routing weights' sum run in torch, whose autograd joins them, on the adapters' device: the GPU
where the model trains on one (the pairs' products cross the bus, a few MB a layer), so that the
CPU threads do the experts' products alone. Kept for the backward there: each pair's input row,
g, u, h and output, (2 H + 4 I) floats a (token, expert) pair of each layer.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...weights.lora import expert_factors


class ExpertAdapter(nn.Module):
    """One projection's LoRA adapters for all the experts of a layer, in peft's layout."""

    def __init__(self, experts: int, in_features: int, out_features: int, rank: int, scaling: float,
                 adapter_name: str = "default", init: bool = True):
        super().__init__()
        self.experts, self.rank, self.scaling = experts, rank, scaling
        self.in_features, self.out_features = in_features, out_features
        self.lora_A = nn.ModuleDict({adapter_name: nn.Linear(in_features, rank * experts, bias=False)})
        self.lora_B = nn.ModuleDict({adapter_name: nn.Linear(rank * experts, out_features, bias=False)})
        if init:  # (peft's default: A as nn.Linear's, B zero, so that the adapter starts as a no-op)
            nn.init.kaiming_uniform_(self.a_weight, a=math.sqrt(5))
            nn.init.zeros_(self.b_weight)

    @property
    def a_weight(self) -> torch.Tensor:
        return next(iter(self.lora_A.values())).weight

    @property
    def b_weight(self) -> torch.Tensor:
        return next(iter(self.lora_B.values())).weight

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, r, in], B [E, out, r]), views of the trained matrices."""
        return expert_factors(self.a_weight, self.b_weight, self.experts)

    def extra_repr(self) -> str:
        return f"experts={self.experts}, in={self.in_features}, out={self.out_features}, rank={self.rank}"


class _FrozenGateUp(torch.autograd.Function):
    """(g, u) [T*K, I]: each (token, slot) pair's G_e x and U_e x on a MoEKernel's frozen experts
    (computed in RAM, returned on x's device); the backward gives dx [T, H] = the sum over a
    token's pairs of G_e^T dg + U_e^T du."""

    @staticmethod
    def forward(ctx, x, ids, kernel):
        ctx.kernel, ctx.ids, ctx.device = kernel, ids, x.device
        return tuple(t.to(x.device) for t in kernel.pair_gate_up(x, ids))

    @staticmethod
    def backward(ctx, dg, du):
        return ctx.kernel.pair_gate_up_t(dg, du, ctx.ids).to(ctx.device), None, None


class _FrozenDown(torch.autograd.Function):
    """o [T*K, H]: each pair's D_e h on a MoEKernel's frozen experts (on h's device); the
    backward D_e^T do."""

    @staticmethod
    def forward(ctx, h, ids, kernel):
        ctx.kernel, ctx.ids, ctx.device = kernel, ids, h.device
        return kernel.pair_down(h, ids).to(h.device)

    @staticmethod
    def backward(ctx, do):
        return ctx.kernel.pair_down_t(do, ctx.ids).to(ctx.device), None, None


class KernelPairs:
    """The frozen per-pair products on a MoEKernel (KExpertsCPU's), differentiable in their input."""

    def __init__(self, kernel):
        self.kernel = kernel

    def gate_up(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _FrozenGateUp.apply(x, ids, self.kernel)

    def down(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _FrozenDown.apply(h, ids, self.kernel)


class DensePairs:
    """The same products on dense weights, gate_up [E, 2I, H] and down [E, H, I] (KExpertsTorch's),
    by torch ops (their autograd is the backward)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up_w, self.down_w = gate_up, down

    def gate_up(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        K, device = ids.shape[1], x.device
        x, ids = x.to(self.gate_up_w.device), ids.to(self.gate_up_w.device)
        w = self.gate_up_w.unbind(0)
        gu = _per_expert(x.repeat_interleave(K, dim=0), ids.reshape(-1), lambda e, rows: rows @ w[e].T.to(rows.dtype))
        return tuple(t.to(device) for t in gu.chunk(2, dim=1))

    def down(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        device = h.device
        h, ids = h.to(self.down_w.device), ids.to(self.down_w.device)
        w = self.down_w.unbind(0)
        return _per_expert(h, ids.reshape(-1), lambda e, rows: rows @ w[e].T.to(rows.dtype)).to(device)


def _per_expert(rows: torch.Tensor, experts: torch.Tensor, fn) -> torch.Tensor:
    """fn(e, rows of expert e) for each expert that `experts` [P] names, back in the rows' order."""
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts).tolist()
    used = [e for e, n in enumerate(counts) if n]
    # (split, not slices: a slice's backward writes a zero gradient the size of all the rows)
    groups = rows.index_select(0, order).split([counts[e] for e in used])
    out = torch.cat([fn(e, group) for e, group in zip(used, groups)])
    return out.index_select(0, torch.argsort(order))


# pairs a low-rank term takes at a time on a GPU: its gathered factors, pairs x r x (in + out)
# values, stay within about 32 Mi values
_GATHER_VALUES = 32 << 20


def low_rank(rows: torch.Tensor, experts: torch.Tensor, adapter: ExpertAdapter) -> torch.Tensor:
    """s B_e A_e row for each row [P, in] and its expert [P]: [P, out]. On a GPU each pair's factors
    are gathered and multiplied in two batched products, a run of pairs at a time; on the CPU,
    whose memory reads the gathered factors slower than it runs a loop, expert by expert."""
    a, b = adapter.factors()
    if not rows.is_cuda:
        # (unbind, not a[e]: each select's backward writes a zero gradient the size of all the experts')
        a, b = a.unbind(0), b.unbind(0)
        return adapter.scaling * _per_expert(rows, experts, lambda e, r: (r @ a[e].T) @ b[e].T)
    step = max(1, _GATHER_VALUES // (adapter.rank * (adapter.in_features + adapter.out_features)))
    parts = []
    for r, e in zip(rows.split(step), experts.split(step)):
        z = torch.bmm(a.index_select(0, e), r.unsqueeze(-1))  # [n, r, 1]
        parts.append(torch.bmm(b.index_select(0, e), z).squeeze(-1))
    return adapter.scaling * (torch.cat(parts) if len(parts) > 1 else parts[0])


def adapted_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, frozen, gate_up: ExpertAdapter | None,
                    down: ExpertAdapter | None, act, bias=None, interleaved: bool = False) -> torch.Tensor:
    """y [T, H] float32 of the experts with their adapters (module docstring), on the adapters'
    device: x [T, H], ids, weights [T, K] (every id valid); `frozen` a KernelPairs or DensePairs;
    `bias` (gate_up [E, 2I], down [E, H]) or None; `interleaved`: gate_up's adapter outputs
    alternate gate and up (gpt-oss) rather than being its halves."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    if bias is not None:  # (the op's: in RAM for the CPU kernels, in the model's dtype for the torch op; small)
        bias = tuple(b.to(x.device, x.dtype) for b in bias)
    g, u = frozen.gate_up(x, ids)
    if gate_up is not None:
        d = low_rank(x.repeat_interleave(K, dim=0), flat, gate_up)
        dg, du = (d[:, 0::2], d[:, 1::2]) if interleaved else d.chunk(2, dim=1)
        g, u = g + dg, u + du
    if bias is not None:
        bg, bu = bias[0].index_select(0, flat).chunk(2, dim=1)
        g, u = g + bg, u + bu
    h = act(g, u)
    o = frozen.down(h, ids)
    if down is not None:
        o = o + low_rank(h, flat, down)
    if bias is not None:
        o = o + bias[1].index_select(0, flat)
    return (o.reshape(T, K, -1) * weights.unsqueeze(-1).to(o.dtype)).sum(1)
