"""The softmax top-k router's epilogue in one launch (Qwen2/Qwen3-MoE, Mixtral): router logits
[T, E] -> (weights [T, K], index [T, K]); its torch reference is operators.gate.route_softmax.

Shapes: T tokens, E experts (<= 1024), K picked per token (<= 32), in descending weight order as
torch.topk returns them; equal probabilities go to the lower expert index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_rope import round_to

MAX_EXPERTS, MAX_K = 1024, 32


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, idx_ptr, E, s_l, K: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(logits_ptr + t * s_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, 0)
    p = tl.where(valid, p, -1.0)  # below every probability: never picked
    p = tl.where(p != p, -0.5, p)  # NaN (from a NaN logit): after every number, as a NaN weight, in range
    kk = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    index = tl.zeros((BLOCK_K,), tl.int32)
    for j in tl.static_range(K):  # K rounds of argmax, each pick masked out for the next
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        weights = tl.where(kk == j, tl.where(best == -0.5, float("nan"), best), weights)
        index = tl.where(kk == j, pick, index)
        p = tl.where(e == pick, -2.0, p)
    if NORM:
        weights = weights / tl.sum(weights, 0)  # slots past K hold 0
    out = kk < K
    tl.store(w_ptr + t * K + kk, round_to(weights, w_ptr.dtype.element_ty).to(w_ptr.dtype.element_ty), mask=out)
    tl.store(idx_ptr + t * K + kk, index.to(tl.int64), mask=out)


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """route_softmax(logits, top_k=top_k, norm=norm) with the weights rounded to out_dtype:
    softmax over E in float32, the top_k probabilities (renormalized to sum 1 with `norm`).
    logits [T, E] of any float dtype -> (weights out_dtype [T, K], index int64 [T, K])."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"softmax_topk: logits must be [T, E] with unit stride, got {tuple(logits.shape)}")
    T, E = logits.shape
    if not (0 < top_k <= min(E, MAX_K)) or E > MAX_EXPERTS:
        raise ValueError(f"softmax_topk: top_k {top_k} of {E} experts (supported: E <= {MAX_EXPERTS}, "
                         f"K <= {MAX_K}, K <= E)")
    weights = torch.empty(T, top_k, device=logits.device, dtype=out_dtype)
    index = torch.empty(T, top_k, device=logits.device, dtype=torch.int64)
    if T:
        block_e = max(16, triton.next_power_of_2(E))
        _softmax_topk_kernel[(T,)](logits, weights, index, E, logits.stride(0), K=top_k, BLOCK_E=block_e,
                                   BLOCK_K=max(2, triton.next_power_of_2(top_k)), NORM=bool(norm),
                                   num_warps=4 if block_e >= 512 else 1)
    return weights, index
