"""KExpertsGPU: routed experts resident on a CUDA device (all of a layer's, or its hot ones),
computed by the Triton fused-MoE kernel."""
from __future__ import annotations

import numpy as np
import torch

from ..registry import EXPERT_OPS
from .reference import ExpertSpec, load_biases


@EXPERT_OPS.register("KExpertsGPU")
class KExpertsGPU:
    """Experts resident on a CUDA device, computed by the Triton fused-MoE kernel: projections
    stored as Q4_0/Q4_K/Q8_0 become int4/int8 codes losslessly, MXFP4 stays e2m1 codes with its
    scales, others bf16; biases and the clamped SwiGLU (gpt-oss) as the spec says. `only` (a list
    of expert ids) keeps a subset (hot experts); ids of experts not held are skipped."""

    def __init__(self, spec: ExpertSpec, device: torch.device, only: list[int] | None = None):
        from ...kernels.triton.common import require
        require(device, f"{spec.key}: KExpertsGPU")
        self.spec, self.key, self.device, self.dtype = spec, spec.key, device, spec.dtype
        self.only = None if only is None else sorted(int(e) for e in only)
        self.gate_up = self.down = None
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.local = None  # global expert id -> index here, or -1 (when holding a subset)

    def _projections(self, weights, names: tuple[str, ...], shape: tuple[int, int, int]):
        from ...kernels.triton.fused_moe import STACKED_TYPES, stack_group_weights
        keep = self.only
        stored = [weights.raw_stacked(f"{self.key}.{n}_proj") for n in names]
        affine = {int(t) for t in STACKED_TYPES}
        if all(st is not None and st[1].shape == shape and int(st[1].ggml_type) in affine for st in stored) and \
                len({int(st[1].ggml_type) for st in stored}) == 1:
            E = shape[0]
            parts = []
            for raw, info in stored:
                raw = torch.as_tensor(np.asarray(raw).reshape(E, -1))
                if keep is not None:
                    raw = raw[keep]
                parts.append((raw.contiguous(), int(info.ggml_type), (raw.shape[0], *shape[1:])))
            return stack_group_weights(parts).to(self.device)
        dense = [weights.load(f"{self.key}.{n}_proj", dtype=torch.bfloat16, shape=shape) for n in names]
        w = torch.cat(dense, 1) if len(dense) > 1 else dense[0]
        if keep is not None:
            w = w[keep]
        return w.contiguous().to(self.device)

    def load(self, weights, context) -> None:
        E, H, I = self.spec.experts, self.spec.hidden, self.spec.intermediate
        self.gate_up = self._projections(weights, ("gate", "up"), (E, I, H))
        self.down = self._projections(weights, ("down",), (E, H, I))
        if self.spec.bias:
            bias = load_biases(weights, self.spec, torch.device("cpu"), torch.float32)
            self.bias = tuple((b if self.only is None else b[self.only]).to(self.device) for b in bias)
        if self.only is not None:
            local = torch.full((E,), -1, dtype=torch.int64)
            local[self.only] = torch.arange(len(self.only))
            self.local = local.to(self.device)

    def unload(self) -> None:
        self.gate_up = self.down = self.local = self.bias = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from ...kernels.triton.fused_moe import fused_moe
        if self.gate_up is None:
            raise RuntimeError(f"{self.key}: experts op used before load()")
        if self.local is not None:
            ids = self.local[ids]
        return fused_moe(x, ids, weights, self.gate_up, self.down, bias=self.bias, act=self.spec.act).to(self.dtype)


EXPERT_OPS.register("KExpertsMarlin")(KExpertsGPU)  # upstream's name for GPU experts
