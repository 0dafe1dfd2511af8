"""RMSNorm as one fused torch op (`F.rms_norm`) in place of transformers' five-op version: a
decode step runs 2-4 norms per layer on a single token, where per-op overhead is the cost.
Same function: x * rsqrt(mean(x^2) + eps) in float32, cast back, times the weight. Decode-sized
inputs run it in one Triton launch where Triton runs (kernels/triton/norm_rope), float32 ones on
the CPU in the C++ row norm."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import rms_norm
from .base import BaseInjectedModule, Placement
from .registry import OPERATORS

# Up to this many rows (decode steps, short prefill chunks; q/k norms have a row per head) one
# Triton launch; longer inputs keep torch's ops (whose launch overheads no longer matter there)
TRITON_ROWS = 4096
CPP_ROWS = 64  # float32 rows on the CPU up to this many: the C++ row norm


@dataclass(frozen=True)
class NormOptions(Placement):
    # Qwen3-Next / Qwen3.5's norms: the stored weight w scales by (1 + w), and the float32 product is
    # rounded once (transformers' Qwen3NextRMSNorm)
    zero_centred: bool = False


class KRMSNorm(BaseInjectedModule):
    Options = NormOptions

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        weight = getattr(orig_module, "weight", None)
        eps = getattr(orig_module, "variance_epsilon", getattr(orig_module, "eps", None))
        if weight is None or weight.dim() != 1 or eps is None:
            raise ValueError(f"{key}: {type(orig_module).__name__} is not an RMSNorm (needs a 1-D weight and an eps)")
        self.shape, self.eps, self.dtype = tuple(weight.shape), float(eps), weight.dtype
        self.weight = self.ext = None
        self.triton_norm = None  # set by load() where Triton runs: kernels.triton.norm_rope.rms_norm

    def load(self) -> None:
        from ..kernels.triton.common import runs_on
        self.weight = self.weights.load(f"{self.key}.weight", self.device, self.dtype, shape=self.shape)
        if self.options.zero_centred:  # the scale as transformers computes it: 1 + w in float32
            self.weight = 1.0 + self.weight.float()
        self.ext = self.triton_norm = None
        if runs_on(self.device):
            from ..kernels.triton.norm_rope import rms_norm as triton_norm
            self.triton_norm = triton_norm
        if self.device.type == "cpu" and self.dtype == torch.float32 and len(self.shape) == 1:
            self.ext = self.run_context().cpu_runtime().ext  # the C++ row norm for decode-sized inputs

    def unload(self) -> None:
        self.weight = self.ext = self.triton_norm = None

    @property
    def fusable(self) -> bool:
        """Whether kernels that fuse this norm into other work (q/k norm + RoPE, residual add +
        norm) compute it: they round as the plain norm does, which a zero-centred one does not."""
        return not self.options.zero_centred

    def path(self, hidden_states: torch.Tensor) -> str:
        """Which kernel forward runs for these rows: "cpp" (float32 decode rows on the CPU),
        "triton" or "torch"."""
        rows = hidden_states.numel() // self.shape[0]
        if (self.ext is not None and hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu"
                and rows <= CPP_ROWS):
            return "cpp"
        if self.triton_norm is not None and rows <= TRITON_ROWS and hidden_states.device == self.weight.device:
            return "triton"
        return "torch"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        path = self.path(hidden_states)
        if path == "cpp":
            return rms_norm(self.ext, hidden_states, self.weight, self.eps)
        zero_centred = self.options.zero_centred
        if path == "triton":
            if zero_centred:
                return self.triton_norm(hidden_states, self.weight, self.eps, round_normed=False)
            return self.triton_norm(hidden_states, self.weight, self.eps)
        if zero_centred:
            return (F.rms_norm(hidden_states.float(), self.shape, None, self.eps) * self.weight).to(hidden_states.dtype)
        if hidden_states.dtype == torch.float32:
            return F.rms_norm(hidden_states, self.shape, self.weight, self.eps)
        normed = F.rms_norm(hidden_states.float(), self.shape, None, self.eps)
        return self.weight * normed.to(hidden_states.dtype)


OPERATORS.register("KRMSNorm")(KRMSNorm)
OPERATORS.register("RMSNorm")(KRMSNorm)  # upstream: ktransformers.operators.layernorm.RMSNorm
