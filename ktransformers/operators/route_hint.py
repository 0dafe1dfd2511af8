"""Route hints: at decode, the CPU cores read the next layer's likely experts into their caches
while the GPU runs that layer's attention (the C++ side is RouteHint in csrc/moe.h).

A decoder layer's MoE input is x = n * h / rms(h): its residual h, normalized, times the layer's
norm weights n. The next layer's router reads n' * h' / rms(h') with h' = h + (this layer's
experts' output) + (the next attention's output). Leaving out those two additions, the next
router with its columns scaled by n' / n, applied to x, ranks the experts the next layer will
likely pick, up to a positive scale. On a synthetic Qwen3-30B-A3B-shaped model this guesses 0.6 to
0.8 of the next layer's experts past the first few layers (a real model's residual stream changes
less from layer to layer). The guess only decides which bytes are read early: results never
depend on it. KT_ROUTE_HINT=0 turns it off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RouteHint:
    """What the doorbell needs after a layer's one-token call: the next layer's experts, and its
    router folded with both layers' norm weights (bf16 [E, H] on the CPU)."""
    next: object  # the next layer's MoEKernel
    router: torch.Tensor


def folded_router(router: torch.Tensor, norm: torch.Tensor, next_norm: torch.Tensor) -> torch.Tensor:
    """router [E, H] with column j scaled by next_norm[j] / norm[j] (0 where norm[j] is 0: the MoE
    input carries nothing there), as contiguous bf16 on the CPU."""
    if router.dim() != 2 or norm.shape != (router.shape[1],) or next_norm.shape != norm.shape:
        raise ValueError(f"route hint: a router [E, H] and two norm weights [H] are needed, got "
                         f"{tuple(router.shape)}, {tuple(norm.shape)}, {tuple(next_norm.shape)}")
    n = norm.detach().float().cpu()
    scale = torch.where(n != 0, next_norm.detach().float().cpu() / torch.where(n != 0, n, 1), 0)
    return (router.detach().float().cpu() * scale).to(torch.bfloat16).contiguous()


def _cpu_kernel(layer: nn.Module):
    """The MoEKernel that computes this decoder layer's experts at decode, or None."""
    from ..kernels.cpu import MoEKernel
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    op = getattr(experts, "ops", {}).get("generate") if experts is not None else None
    kernel = getattr(op, "kernel", None)
    return kernel if isinstance(kernel, MoEKernel) else None


def _weight(module) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.device.type != "meta" else None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order (model.model.layers), or [] when it has none."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def link_route_hints(model: nn.Module) -> int:
    """Give each decoder layer whose experts run on the CPU kernels, followed by another such
    layer, the route hint for it (kernel.route_hint); returns how many layers got one. Layers
    without a loaded router or norm weights are left alone. KT_ROUTE_HINT=0: none (and any
    earlier hints dropped)."""
    on = os.environ.get("KT_ROUTE_HINT", "1").strip() != "0"
    linked = 0
    layers = decoder_layers(model)
    for layer, nxt in zip(layers, layers[1:]):
        kernel, next_kernel = _cpu_kernel(layer), _cpu_kernel(nxt)
        if kernel is None:
            continue
        kernel.route_hint = None
        if not on or next_kernel is None or next_kernel.hidden != kernel.hidden:
            continue
        router = _weight(getattr(getattr(nxt, "mlp", None), "gate", None))
        norm, next_norm = _weight(getattr(layer, "post_attention_layernorm", None)), \
            _weight(getattr(nxt, "post_attention_layernorm", None))
        if router is None or norm is None or next_norm is None or router.shape != (next_kernel.experts, kernel.hidden):
            continue
        kernel.route_hint = RouteHint(next_kernel, folded_router(router, norm, next_norm))
        linked += 1
    return linked
