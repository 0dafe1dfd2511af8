"""Routers: pick K of E experts per token. Same contract as HF's routers:
forward(hidden_states [.., H]) -> (router_logits [T, E], top_k_weights [T, K], top_k_index [T, K]).

- KMoEGate: DeepSeek's routers, by the module replaced. V3 (and GLM-4.5, MiniMax-M2): sigmoid
  scores, + e_score_correction_bias for the choice only, group top-k (best `topk_group` of
  `n_group` groups by the sum of their top-2; MiniMax-M2: one group), weights from the raw scores,
  optionally normalized, times routed_scaling_factor (for decode-sized steps where Triton runs,
  logits and routing in one launch: kernels/triton/router.router_topk). V2: softmax
  scores, top-k over all experts ("greedy") or over the best `topk_group` groups by their best
  score ("group_limited_greedy"), times routed_scaling_factor.
- KMoEGateSoftmax: Qwen2/Qwen3-MoE, Mixtral — softmax, top-k, optionally renormalized; for
  decode-sized steps where Triton runs, in one launch (kernels/triton/router.softmax_topk).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .base import BaseInjectedModule
from .registry import register_operator

# Up to this many tokens the softmax top-k epilogue runs as one Triton launch (torch's softmax,
# topk, sum and division are ~6 launches); longer steps keep torch's ops
TRITON_ROUTE_TOKENS = 64


def route_sigmoid_grouped(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
                          norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, index [T, K]) for DeepSeek-V3 routing from fp32 logits [T, E]."""
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    index = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, index


def route_softmax_grouped(logits: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, index [T, K]) for DeepSeek-V2 routing from fp32 logits [T, E]
    (n_group 1: greedy top-k)."""
    T, E = logits.shape
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if n_group > 1:
        group_best = scores.view(T, n_group, E // n_group).max(dim=-1).values  # [T, G]
        groups = group_best.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, groups, True)
        scores = scores.masked_fill(~keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E), 0.0)
    weights, index = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scale, index


def route_softmax(logits: torch.Tensor, *, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, index [T, K]) for softmax top-k routing."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, index = probs.topk(top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


class _Router(BaseInjectedModule):
    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.top_k = orig_module.top_k
        self.hidden_dim = orig_module.hidden_dim
        self.weight_dtype, self.weight_shape = orig_module.weight.dtype, tuple(orig_module.weight.shape)
        self.weight: torch.Tensor | None = None
        # a bias of the logits (gpt-oss's router; not DeepSeek-V3's correction bias, which only picks)
        self.has_logit_bias = isinstance(getattr(orig_module, "bias", None), nn.Parameter)
        self.logit_bias: torch.Tensor | None = None
        self.kernel = None
        self.gemv = None  # set by load() where Triton runs: kernels.triton.quant_linear.dense_gemv
        self.gemv_rows = 0  # and the most tokens it takes (quant_linear.GEMV_ROWS)

    def load(self) -> None:
        from ..kernels.triton.common import runs_on
        self.weight = self.weights.load(f"{self.key}.weight", self.device, self.weight_dtype, self.weight_shape)
        self.logit_bias = (self.weights.load(f"{self.key}.bias", self.device, torch.float32, self.weight_shape[:1])
                           if self.has_logit_bias else None)
        self.kernel = self.gemv = None
        if self.device.type == "cpu" and self.weight.dtype == torch.float32:
            # the same fp32 dot products on the C++ pool (all cores stream the weight; torch's
            # single-threaded decode GEMV is bound by one core's read rate)
            from ..kernels.cpu import ExpertWeights, LinearKernel
            self.kernel = LinearKernel(self.run_context().cpu_runtime(), in_features=self.weight_shape[1],
                                       out_features=self.weight_shape[0],
                                       weight=ExpertWeights(self.weight.contiguous(), 0), name=self.key)
        elif runs_on(self.device):
            # float32 once (not a cast of the weight every step); decode steps in one GEMV launch
            from ..kernels.triton.quant_linear import GEMV_ROWS, dense_gemv
            self.weight = self.weight.float().contiguous()
            self.gemv, self.gemv_rows = dense_gemv, GEMV_ROWS

    def unload(self) -> None:
        self.weight = self.logit_bias = self.kernel = self.gemv = None

    def logits(self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [T, H] -> router logits [T, E]: float32 products and sums (+ the bias), rounded to
        out_dtype."""
        if self.kernel is not None and x.shape[0] <= 4:  # decode: bandwidth; prefill: torch's GEMM
            y = self.kernel.forward(x.float().contiguous())
            return (y if self.logit_bias is None else y + self.logit_bias).to(out_dtype)
        if self.gemv is not None and x.shape[0] <= self.gemv_rows:
            return self.gemv(x, self.weight, out_dtype, self.logit_bias)
        return F.linear(x.float(), self.weight.float(), self.logit_bias).to(out_dtype)


@register_operator("KMoEGate")
class KMoEGate(_Router):
    """DeepSeek's router: V3's sigmoid one (replaces DeepseekV3TopkRouter, Glm4MoeTopkRouter,
    MiniMaxM2TopKRouter) or V2's softmax one (replaces DeepseekV2TopkRouter, which has a
    `topk_method`). A router whose forward takes the correction bias from its MoE block
    (MiniMax-M2) has it loaded from there: `<block>.e_score_correction_bias`."""

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.softmax = hasattr(orig_module, "topk_method")
        grouped = not self.softmax or orig_module.topk_method == "group_limited_greedy"
        self.n_group = (getattr(orig_module, "num_group", 1) or 1) if grouped else 1
        self.topk_group = (getattr(orig_module, "topk_group", 1) or 1) if grouped else 1
        # (V2 never normalizes; a sigmoid router without the setting, MiniMax-M2's, always does)
        self.norm = getattr(orig_module, "norm_topk_prob", not self.softmax)
        self.scale = getattr(orig_module, "routed_scaling_factor", 1.0)
        takes_bias = "e_score_correction_bias" in inspect.signature(orig_module.forward).parameters
        self.bias_name = f"{key.rsplit('.', 1)[0] if takes_bias else key}.e_score_correction_bias"
        self.bias: torch.Tensor | None = None
        self.fused = False  # set by load(): logits and sigmoid routing in one Triton launch (router_topk)

    def load(self) -> None:
        from ..kernels.triton.common import runs_on
        super().load()
        self.fused = False
        if not self.softmax:
            self.bias = self.weights.load(self.bias_name, self.device, torch.float32, (self.weight_shape[0],))
            if self.gemv is not None and runs_on(self.device):
                from ..kernels.triton import router
                self.fused = (self.weight_shape[0] <= router.MAX_EXPERTS
                              and self.top_k <= min(router.MAX_K, self.weight_shape[0]))

    def unload(self) -> None:
        super().unload()
        self.bias, self.fused = None, False

    stores_inputs = True  # forward's `pack` (KMoEBlock._route)

    def forward(self, hidden_states: torch.Tensor, e_score_correction_bias: torch.Tensor | None = None, pack=None):
        """`e_score_correction_bias`: what MiniMax-M2's block passes; the loaded one is used.
        `pack`: as KMoEGateSoftmax's (the one-launch sigmoid route stores the experts' inputs)."""
        x = hidden_states.reshape(-1, self.hidden_dim).to(self.device)
        if self.fused and x.shape[0] <= self.gemv_rows:
            from ..kernels.triton.router import router_topk  # logits and routing in one launch
            routed = router_topk(x, self.weight, self.top_k, self.norm, torch.float32, torch.float32, pack=pack,
                                 bias=self.logit_bias, correction_bias=self.bias, scale=self.scale,
                                 n_group=self.n_group, topk_group=self.topk_group)
            if routed is not None:
                return routed
        logits = self.logits(x)
        if self.softmax:
            weights, index = route_softmax_grouped(logits, top_k=self.top_k, n_group=self.n_group,
                                                   topk_group=self.topk_group, scale=self.scale)
        else:
            weights, index = route_sigmoid_grouped(logits, self.bias, top_k=self.top_k, n_group=self.n_group,
                                                   topk_group=self.topk_group, norm=self.norm, scale=self.scale)
        return logits, weights, index


@register_operator("KMoEGateSoftmax")
class KMoEGateSoftmax(_Router):
    """Softmax top-k router (replaces Qwen2Moe/Qwen3Moe/Mixtral/GptOss TopKRouter). gpt-oss's
    softmax over its top-k logits is the softmax over all of them renormalized over the top k; its
    logits have a bias."""

    def __init__(self, key: str, weights, config, orig_module: nn.Module, **kwargs):
        super().__init__(key, weights, config, orig_module, **kwargs)
        self.norm = getattr(orig_module, "norm_topk_prob", True)  # Mixtral always renormalizes
        # Qwen's and gpt-oss's routers give the weights in the logits' dtype (Qwen3.5's, with no
        # norm_topk_prob, too)
        self.cast_back = (hasattr(orig_module, "norm_topk_prob")
                          or type(orig_module).__name__.startswith(("Qwen", "GptOss")))
        self.triton_route = None  # set by load() where Triton runs: kernels.triton.router.softmax_topk

    def load(self) -> None:
        from ..kernels.triton.common import runs_on
        super().load()
        self.triton_route = None
        # not beside the C++ router GEMV: the CPU decode layer repeats torch's epilogue bit for bit
        if runs_on(self.device) and self.kernel is None:
            from ..kernels.triton import router
            if self.weight_shape[0] <= router.MAX_EXPERTS and self.top_k <= min(router.MAX_K, self.weight_shape[0]):
                self.triton_route = router.softmax_topk

    def unload(self) -> None:
        super().unload()
        self.triton_route = None

    stores_inputs = True  # forward's `pack` (KMoEBlock._route)

    def forward(self, hidden_states: torch.Tensor, pack=None):
        """`pack`: a triton.handoff.PinnedInputs where the experts' inputs go; the one-launch
        route stores them there in passing (recorded in it), other paths leave it untouched."""
        x = hidden_states.reshape(-1, self.hidden_dim).to(self.device)
        if self.triton_route is not None and self.gemv is not None and x.shape[0] <= self.gemv_rows:
            from ..kernels.triton.router import router_topk  # logits and routing in one launch
            routed = router_topk(x, self.weight, self.top_k, self.norm, x.dtype,
                                 x.dtype if self.cast_back else torch.float32, pack=pack, bias=self.logit_bias)
            if routed is not None:
                return routed
        logits = self.logits(x, x.dtype)
        if self.triton_route is not None and logits.shape[0] <= TRITON_ROUTE_TOKENS:
            out_dtype = logits.dtype if self.cast_back else torch.float32
            return logits, *self.triton_route(logits, self.top_k, self.norm, out_dtype)
        # (the CPU decode plan routes so too; training keeps torch's ops, through which the routing
        # weights' gradient reaches the logits)
        if self.kernel is not None and logits.dtype == torch.float32 and not logits.requires_grad:
            from ..kernels.cpu import softmax_topk
            weights, index = softmax_topk(self.kernel.runtime.ext, logits, self.top_k, self.norm)
        else:
            weights, index = route_softmax(logits, top_k=self.top_k, norm=self.norm)
        return logits, weights.to(logits.dtype) if self.cast_back else weights, index
