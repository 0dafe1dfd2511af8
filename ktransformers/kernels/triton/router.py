"""Routers in one launch: the softmax top-k epilogue (Qwen2/Qwen3-MoE, Mixtral, gpt-oss), router
logits [T, E] -> (weights [T, K], index [T, K]), whose torch reference is
operators.gate.route_softmax; and router_topk, the logits' GEMV and that epilogue, or DeepSeek-V3's
sigmoid routing (its expert groups; one group: GLM-4.5, MiniMax-M2, Kimi-K2; reference
operators.gate.route_sigmoid_grouped), together.

Shapes: T tokens, E experts (<= 1024), K picked per token (<= 32), in descending order of the
pick as torch.topk returns them; equal choices go to the lower expert index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import MAX_SPLIT_TILES, split_counters
from .handoff import PinnedInputs, _copy_row
from .norm_rope import round_to
from .pdl import pdl
from .quant_linear import GEMV_ROWS, _dense_rows, check_bias, gemv_plan, split_reduce

MAX_EXPERTS, MAX_K = 1024, 32


@triton.jit
def _route_row(x, e, valid, w_ptr, idx_ptr, cb_ptr, scale, eps, K: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, NORM: tl.constexpr, SIGMOID: tl.constexpr, GROUP_SIZE: tl.constexpr,
               TOPK_GROUP: tl.constexpr):
    """One token's float32 logits x [BLOCK_E] (valid: e < E) -> its top-K weights and expert ids at
    w_ptr / idx_ptr [K]. Softmax: the K largest probabilities. SIGMOID (DeepSeek-V3's router): the
    K largest choices sigmoid(x) + correction bias cb [E], weighted by their sigmoid(x); with
    expert groups (GROUP_SIZE > 0 experts each), only from the TOPK_GROUP groups whose two largest
    choices sum highest. NORM: weights / (their sum + eps); then times scale."""
    x = tl.where(valid, x, float("-inf"))
    if SIGMOID:
        p = tl.sigmoid(x)
        choice = p + tl.load(cb_ptr + e, mask=valid, other=0.0).to(tl.float32)
        if GROUP_SIZE > 0:
            choice = _keep_best_groups(tl.where(valid, choice, float("-inf")), BLOCK_E, GROUP_SIZE, TOPK_GROUP)
    else:
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(valid, p, 0.0)
        p = p / tl.sum(p, 0)
        choice = p
    # Each expert's key: its choice's bits made to order as the floats do, above, BLOCK_E - 1 - e
    # below, so that one max a round picks the largest and, of equal ones, the lower index. A NaN
    # keys just above the experts past E: after every number, picked as a NaN weight, in range;
    # experts past E are never picked.
    bits = choice.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    bits = tl.where(choice != choice, -2147483647, bits)
    bits = tl.where(valid, bits, -2147483647 - 1)
    key = bits.to(tl.int64) * 4294967296 + (BLOCK_E - 1 - e).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    index = tl.zeros((BLOCK_K,), tl.int32)
    for j in tl.static_range(K):  # K rounds of one max, each pick masked out for the next
        best = tl.max(key, 0)
        pick = (BLOCK_E - 1 - (best & 4294967295)).to(tl.int32)
        weight = tl.sum(tl.where(e == pick, p, 0.0), 0)
        weights = tl.where(kk == j, weight, weights)
        index = tl.where(kk == j, pick, index)
        key = tl.where(e == pick, -9223372036854775807, key)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + eps)  # slots past K hold 0
    weights = weights * scale
    out = kk < K
    weights = round_to(weights, w_ptr.dtype.element_ty)
    tl.store(w_ptr + kk, weights.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(idx_ptr + kk, index.to(tl.int64), mask=out)
    return weights, index.to(tl.int64), kk, out


@triton.jit
def _keep_best_groups(choice, BLOCK_E: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """choice [BLOCK_E] (-inf past the experts) as groups of GROUP_SIZE experts: -inf outside the
    TOPK_GROUP groups of the highest sums of their two largest values (gate.route_sigmoid_grouped's
    choice; the groups past the experts sum to -inf)."""
    groups: tl.constexpr = BLOCK_E // GROUP_SIZE
    c = tl.reshape(choice, (groups, GROUP_SIZE))
    i = tl.arange(0, GROUP_SIZE)[None, :]
    first = tl.argmax(c, 1)
    score = tl.max(c, 1) + tl.max(tl.where(i == first[:, None], float("-inf"), c), 1)  # [groups]
    g = tl.arange(0, groups)
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):  # each round the best group left (of equal ones, the lower)
        best = tl.argmax(tl.where(keep, float("-inf"), score), 0)
        keep = keep | (g == best)
    keep = tl.reshape(tl.broadcast_to(keep[:, None], (groups, GROUP_SIZE)), (BLOCK_E,))
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, idx_ptr, E, s_l, K: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(logits_ptr + t * s_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    _route_row(x, e, valid, w_ptr + t * K, idx_ptr + t * K, logits_ptr, 1.0, 0.0, K, BLOCK_E, BLOCK_K, NORM, False,
               0, 1)


@triton.jit
def _router_kernel(x_ptr, g_ptr, b_ptr, y_ptr, part_ptr, count_ptr, w_ptr, idx_ptr, xo_ptr, io_ptr, wo_ptr, cpu_k,
                   cb_ptr, scale, eps, M, E, H, stride_xm, k_per_split, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, REDUCE: tl.constexpr,
                   K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                   PACK: tl.constexpr, PACK_BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Router logits y [M, E] = x [M, H] Gᵀ (+ b [E] where HAS_BIAS; quant_linear's dense GEMV:
    program_id 1 a tile of BLOCK_N experts, 2 a split of H added in the launch), then, by the
    program that completes the last tile (a counter past the tiles' own), every token's top-K
    routing from y (_route_row's; SIGMOID with the correction bias cb [E]). PACK: that program
    also stores what handoff.pack_moe_inputs would (x rows converted, the ids with those of
    columns >= cpu_k as -1, the weights as float32) at xo/io/wo."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = _dense_rows(x_ptr, g_ptr, rm, rn, M, E, H, stride_xm, H, tl.program_id(2) * k_per_split, k_per_split,
                      BLOCK_M, BLOCK_N, BLOCK_H, GDC)
    mask = (rm < M)[:, None] & (rn < E)[None, :]
    out = y_ptr + rm[:, None] * E + rn[None, :]
    tiles = tl.num_programs(1)
    if REDUCE:
        complete = split_reduce(acc, part_ptr, count_ptr, out, rm, rn, mask, M, E, y_ptr.dtype.element_ty, b_ptr,
                                HAS_BIAS)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < E, other=0.0)[None, :]
        tl.store(out, round_to(acc, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask)
        complete = True
    if complete:
        tl.debug_barrier()  # the tile's stores issued before the (release) arrival below
        if tl.atomic_add(count_ptr + tiles, 1, sem="acq_rel") == tiles - 1:
            e = tl.arange(0, BLOCK_E)
            valid = e < E
            for m in range(0, M):
                x = tl.load(y_ptr + m * E + e, mask=valid, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
                weights, index, kk, picked = _route_row(x, e, valid, w_ptr + m * K, idx_ptr + m * K, cb_ptr, scale,
                                                        eps, K, BLOCK_E, BLOCK_K, NORM, SIGMOID, GROUP_SIZE,
                                                        TOPK_GROUP)
                if PACK:
                    _copy_row(x_ptr + m * stride_xm, xo_ptr + m * H, H, PACK_BLOCK, False, x_ptr, False)
                    tl.store(io_ptr + m * K + kk, tl.where(kk < cpu_k, index, -1), mask=picked)
                    tl.store(wo_ptr + m * K + kk, weights, mask=picked)
            tl.atomic_xchg(count_ptr + tiles, 0)


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


def router_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm: bool, logits_dtype: torch.dtype,
                weights_dtype: torch.dtype, pack: PinnedInputs | None = None, bias: torch.Tensor | None = None,
                correction_bias: torch.Tensor | None = None, scale: float = 1.0, n_group: int = 1,
                topk_group: int = 1):
    """(logits, weights, index) of a top-k router in one launch for up to GEMV_ROWS tokens:
    logits [T, E] = x [T, H] weightᵀ (+ bias, float32 [E]; float32 sums rounded to logits_dtype,
    as dense_gemv), then on those rounded logits either softmax_topk or, given a
    `correction_bias` (float32 [E]), DeepSeek-V3's sigmoid routing (gate.route_sigmoid_grouped:
    picked by sigmoid + correction bias from the best `topk_group` of `n_group` groups, weighted by
    the sigmoid, normalized with `norm`, times `scale`); the weights rounded to weights_dtype, in
    descending order of the pick. None where it does not apply (more tokens, experts or picks than
    the kernels take, groups of a number of experts that is not a power of two, no tile counters
    now).
    `pack`: the same launch also stores x, the index and the weights where a MoE call fed from
    this stream reads them, as handoff.pack_moe_inputs would (and records what it stored)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not weight.is_contiguous():
        raise ValueError(f"router_topk: x [T, H] and a row-major weight [E, H], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"router_topk: weight on {weight.device}, x on {x.device}")
    T, E = x.shape[0], weight.shape[0]
    check_bias("router_topk", bias, E, x.device)
    check_bias("router_topk (correction)", correction_bias, E, x.device)
    if n_group > 1 and correction_bias is None:
        raise ValueError("router_topk: expert groups (n_group > 1) are the sigmoid route's: give a correction_bias")
    if not (n_group >= 1 and 1 <= topk_group <= n_group):
        raise ValueError(f"router_topk: topk_group {topk_group} of n_group {n_group}")
    if not 0 < T <= GEMV_ROWS or E > MAX_EXPERTS or not 0 < top_k <= min(E, MAX_K) or x.shape[1] == 0:
        return None
    if n_group > 1 and (E & (E - 1) or n_group & (n_group - 1) or E % n_group or top_k > topk_group * E // n_group):
        return None
    x = x.contiguous()
    block_m, block_n, block_h, plan = gemv_plan(x, E, logits_dtype)
    counters = split_counters(x.device)
    # (one block of rows: the counter past the tiles' own is the launch's, grid[1] of them)
    if plan.atomic or counters is None or plan.grid[0] != 1 or plan.grid[1] + 1 > MAX_SPLIT_TILES:
        return None
    weights = torch.empty(T, top_k, device=x.device, dtype=weights_dtype)
    index = torch.empty(T, top_k, device=x.device, dtype=torch.int64)
    if pack is not None:
        pack.check(x, top_k)
    part = plan.scratch()[0]
    block_e = max(16, triton.next_power_of_2(E))
    xo, io, wo = (pack.x, pack.ids, pack.weights) if pack is not None else (x, index, weights)  # (unread without PACK)
    _router_kernel[plan.grid](x, weight, bias if bias is not None else weight, plan.y, part, counters, weights, index,
                              xo, io, wo, top_k if pack is None else pack.cpu_k,
                              correction_bias if correction_bias is not None else weight, float(scale),
                              1e-20 if correction_bias is not None else 0.0, T, E, x.shape[1], x.stride(0),
                              plan.k_per_split, HAS_BIAS=bias is not None, SIGMOID=correction_bias is not None,
                              GROUP_SIZE=E // n_group if n_group > 1 else 0, TOPK_GROUP=topk_group,
                              BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_H=block_h,
                              REDUCE=plan.reduce, K=top_k, BLOCK_E=block_e,
                              BLOCK_K=max(2, triton.next_power_of_2(top_k)), NORM=bool(norm), PACK=pack is not None,
                              PACK_BLOCK=min(1024, triton.next_power_of_2(x.shape[1])), num_warps=4, **pdl(x.device))
    if pack is not None:
        pack.written = (x, weights, index)
    return plan.y, weights, index
