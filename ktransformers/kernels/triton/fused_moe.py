"""Routed experts that live on the GPU: token-grouped, two kernels per call.

    y[t] = Σ_k w[t,k] · down_e(act(gate_e(x_t), up_e(x_t))),   e = ids[t,k]

act is the SwiGLU silu(g) ⊙ u, or gpt-oss's clamped form (with its limit and alpha); each
projection may have a bias per expert (gpt-oss).

The T*K (token, slot) pairs are sorted by expert and each expert's run padded to BLOCK_M rows
(`align`), so one program computes BLOCK_M rows of one expert: the first kernel computes gate and
up together for a column tile and writes silu(gate)*up; the second multiplies by down and the
routing weight and writes the pair's row; a sum over K finishes. Ids of -1 mark pairs whose
expert is not on this GPU (hot-expert splits): they are skipped and contribute 0.

Each projection of all experts is either dense bf16 [E, N, K] (HF layout) or group-quantized
(`StackedGroupWeight`: int4 / int8 codes with per-32 scales, as in quant_linear, one per expert;
or MXFP4's e2m1 codes with their power-of-two scales, as the published gpt-oss files store them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...weights.ggml_quants import MXFP4_VALUES, GGMLType, group_affine, mxfp4_codes
from .common import dot_f32
from .quant_linear import GROUP, load_group_weights, pack_codes, unpack_codes


# The ggml types whose stored experts become a StackedGroupWeight without loss.
STACKED_TYPES = (GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.MXFP4)


@dataclass
class StackedGroupWeight:
    """E matrices [N, K] as group-quantized codes packed as quant_linear's (int4: int32
    [E, K/8, N]; int8: [E, K/4, N]), scale (and offset) float32 [E, K/32, N]. `e2m1`: the 4-bit
    codes are MXFP4's (value = scale * MXFP4_VALUES[code], no offset) rather than integers."""
    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    n: int
    k: int
    e2m1: bool = False

    def to(self, device) -> StackedGroupWeight:
        return StackedGroupWeight(self.bits, self.codes.to(device), self.scale.to(device),
                                  None if self.offset is None else self.offset.to(device), self.n, self.k, self.e2m1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 [E, N, K]."""
        E = self.codes.shape[0]
        codes = unpack_codes(self.codes, self.bits).reshape(E, self.k, self.n)
        if self.e2m1:
            codes = MXFP4_VALUES.to(codes.device)[codes.long()]
        w = codes.float().reshape(E, self.k // GROUP, GROUP, self.n) * self.scale[:, :, None, :]
        if self.offset is not None:
            w = w + self.offset[:, :, None, :]
        return w.reshape(E, self.k, self.n).transpose(1, 2).contiguous()


def stack_group_weights(parts: list[tuple[object, int, tuple[int, int, int]]]) -> StackedGroupWeight:
    """Stored GGUF bytes of one or more [E, n_i, K] projections of the same group-affine type,
    concatenated along n (gate then up) -> one StackedGroupWeight [E, Σn_i, K]."""
    types = {GGMLType(int(t)) for _, t, _ in parts}
    if len(types) != 1:
        raise ValueError(f"stack_group_weights: projections of different types {sorted(t.name for t in types)}")
    E, K = parts[0][2][0], parts[0][2][2]
    e2m1 = types == {GGMLType.MXFP4}
    codes, scales, offsets = [], [], []
    for raw, t, (e, n, k) in parts:
        c, s, o = (*mxfp4_codes(raw, (e * n, k)), None) if e2m1 else group_affine(raw, t, (e * n, k))
        codes.append(c.reshape(e, n, k))
        scales.append(s.reshape(e, n, k // GROUP))
        offsets.append(None if o is None else o.reshape(e, n, k // GROUP))
    codes, scale = torch.cat(codes, 1), torch.cat(scales, 1)  # [E, N, K], [E, N, K/32]
    N = codes.shape[1]
    offset = None if offsets[0] is None else torch.cat(offsets, 1).transpose(1, 2).contiguous()
    scale = scale.transpose(1, 2).contiguous()
    bits = 8 if types == {GGMLType.Q8_0} else 4
    packed = torch.stack([pack_codes(codes[e], bits) for e in range(E)])
    return StackedGroupWeight(bits, packed, scale, offset, N, K, e2m1)


def quantize_stacked_int4(w: torch.Tensor) -> StackedGroupWeight:
    """Asymmetric int4 per 32 values from float [E, N, K] (lossy; only when asked)."""
    from .quant_linear import quantize_int4
    parts = [quantize_int4(w[e]) for e in range(w.shape[0])]
    return StackedGroupWeight(4, torch.stack([p.codes for p in parts]), torch.stack([p.scale for p in parts]),
                              torch.stack([p.offset for p in parts]), w.shape[1], w.shape[2])


ExpertProjection = "torch.Tensor | StackedGroupWeight"


def align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*K pairs by expert, each expert's run padded to a multiple of block_m, without a
    host sync (so a CUDA graph can hold it): sizes are the worst case for T*K pairs.
    Returns (pairs int32 [P]: flat pair index t*K+k, or T*K for padding; block_expert int32
    [P/block_m]: the block's expert, or `experts` for a block past the last one)."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    max_blocks = n // block_m + min(experts, n) + 1
    key = torch.where((flat < 0) | (flat >= experts), experts, flat)  # pairs not held here sort last, dropped
    order = torch.argsort(key, stable=True)
    counts_all = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts_all[:experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts, firsts = ends - padded, torch.cumsum(counts_all, 0) - counts_all
    sorted_key = key[order]
    rank = torch.arange(n, device=ids.device) - firsts[sorted_key]
    dump = max_blocks * block_m  # where the dropped pairs are written
    where = torch.where(sorted_key < experts, starts[sorted_key.clamp(max=experts - 1)] + rank, dump)
    pairs = torch.full((dump + 1,), n, dtype=torch.int32, device=ids.device)
    pairs.scatter_(0, where, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends[:experts].contiguous(), block_start, right=True).to(torch.int32)
    return pairs[:dump], block_expert


@triton.jit
def _e2m1_tile(codes_ptr, scale_ptr, k0, K, rn, N, stride_code, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
               GROUP_SIZE: tl.constexpr):
    """float32 W[k0 : k0+BLOCK_K, rn] of MXFP4 weights: packed e2m1 codes (as int4's) times their
    group's power of two. The code book's doubled magnitudes 0,1,2,3,4,6,8,12 are built as float32
    bits (no int-to-float conversion): code 1 is 1.0, codes 2-7 (exponent e = m/2 >= 1, mantissa
    bit m%2) are 2^e (1 + (m%2) / 2); bit 3 is the sign."""
    mask_n = rn < N
    rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(codes_ptr + rw[:, None] * stride_code + rn[None, :], mask=(rw * 8 < K)[:, None] & mask_n[None, :],
                    other=0)
    c = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 15
    m = c & 7
    e = m >> 1
    bits = tl.where(e == 0, (m & 1) * 0x3F800000, ((e + 127) << 23) | ((m & 1) << 22)) | ((c & 8) << 28)
    q = tl.reshape(bits.to(tl.float32, bitcast=True), (BLOCK_K // GROUP_SIZE, GROUP_SIZE, BLOCK_N))
    rg = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
    s = tl.load(scale_ptr + rg[:, None] * stride_code + rn[None, :], mask=(rg * GROUP_SIZE < K)[:, None] & mask_n[None, :],
                other=0.0)
    return tl.reshape(q * s[:, None, :], (BLOCK_K, BLOCK_N))


@triton.jit
def _load_expert_tile(w_ptr, scale_ptr, offset_ptr, e, k0, K, rn, N, n_total, s_we, s_se,
                      BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, E2M1: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """float W_e[k0 : k0+BLOCK_K, rn]ᵀ-tile of expert e (dense bf16 [E, n_total, K] or group-quantized
    with n_total columns); columns >= N read as 0. One return after the branches: Triton still
    compiles the code after a return inside a constexpr branch (the integer unpacking on bf16)."""
    if BITS == 16:
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + e * s_we + rn[None, :] * K + rk[:, None], mask=(rn < N)[None, :] & (rk < K)[:, None],
                    other=0.0).to(tl.float32)
    elif E2M1:
        w = _e2m1_tile(w_ptr + e * s_we, scale_ptr + e * s_se, k0, K, rn, N, n_total, BLOCK_K, BLOCK_N, GROUP_SIZE)
    else:
        w = load_group_weights(w_ptr + e * s_we, scale_ptr + e * s_se, offset_ptr + e * s_se, k0, K, rn, N, n_total,
                               BITS, HAS_OFFSET, BLOCK_K, BLOCK_N, GROUP_SIZE)
    return w


@triton.jit
def _expert_gemm_kernel(a_ptr, pairs_ptr, block_expert_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, route_ptr, out_ptr,
                        num_pairs, num_experts, top_k, N, K, s_a, s_out, s_we, s_se, limit, alpha,
                        GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                        E2M1: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """GATED: out[pair, n] = act(a W_gateᵀ + b_gate, a W_upᵀ + b_up) with W = [gate; up] of N rows
    each (bias [E, 2N]), act silu(g)*u or, CLAMPED, g*sigmoid(alpha*g)*(u+1) after g <= limit and
    |u| <= limit; else out[pair, n] = route[pair] * (a W_eᵀ + b) (bias [E, N]). a's row is the
    pair's token (A_BY_TOKEN) or the pair."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:  # a block past the last expert's run (sizes are the worst case)
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pairs < num_pairs
    a_row = (pairs // top_k) if A_BY_TOKEN else pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + a_row.to(tl.int64)[:, None] * s_a + (k0 + rk)[None, :],
                    mask=live[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        if GATED:
            wg = _load_expert_tile(w_ptr, scale_ptr, offset_ptr, e, k0, K, rn, N, 2 * N, s_we, s_se, BITS,
                                   HAS_OFFSET, E2M1, BLOCK_K, BLOCK_N, GROUP_SIZE)
            wu = _load_expert_tile(w_ptr, scale_ptr, offset_ptr, e, k0, K, rn + N, 2 * N, 2 * N,
                                   s_we, s_se, BITS, HAS_OFFSET, E2M1, BLOCK_K, BLOCK_N, GROUP_SIZE)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), wg)
                acc_up += tl.dot(a.to(tl.float32), wu)
            else:
                acc += tl.dot(a.to(tl.bfloat16), wg.to(tl.bfloat16))
                acc_up += tl.dot(a.to(tl.bfloat16), wu.to(tl.bfloat16))
        else:
            w = _load_expert_tile(w_ptr, scale_ptr, offset_ptr, e, k0, K, rn, N, N, s_we, s_se, BITS, HAS_OFFSET,
                                  E2M1, BLOCK_K, BLOCK_N, GROUP_SIZE)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), w)
            else:
                acc += tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))
    if GATED:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * 2 * N + rn, mask=rn < N, other=0.0)[None, :]
            acc_up += tl.load(bias_ptr + e * 2 * N + N + rn, mask=rn < N, other=0.0)[None, :]
        if CLAMPED:
            acc = tl.minimum(acc, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = acc / (1.0 + tl.exp(-alpha * acc)) * (acc_up + 1.0)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * N + rn, mask=rn < N, other=0.0)[None, :]
        acc = acc * tl.load(route_ptr + pairs, mask=live, other=0.0)[:, None]
    mask = live[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * s_out + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _weight_args(w) -> tuple:
    """(codes/weight, scale, offset, bits, has_offset, expert stride of w, of the scales, N, K, e2m1)."""
    if isinstance(w, StackedGroupWeight):
        offset = w.offset if w.offset is not None else w.scale
        return (w.codes, w.scale, offset, w.bits, w.offset is not None, w.codes.stride(0), w.scale.stride(0), w.n, w.k,
                w.e2m1)
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise ValueError(f"dense expert weights must be contiguous bf16 [E, N, K], got {w.dtype}")
    return w, w, w, 16, False, w.stride(0), 0, w.shape[1], w.shape[2], False


def _bias_arg(what: str, bias: torch.Tensor | None, shape: tuple[int, int], device) -> torch.Tensor | None:
    if bias is None:
        return None
    if tuple(bias.shape) != shape or bias.device != device:
        raise ValueError(f"fused_moe: the {what} bias must be [{shape[0]}, {shape[1]}] on {device}, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    return bias.to(torch.float32).contiguous()


def fused_moe_block_m(tokens: int, top_k: int, experts: int) -> int:
    """Pairs a program of fused_moe computes: 16 while experts get few tokens each, else 64."""
    return 16 if tokens * top_k <= 64 * experts else 64


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
              pairs: torch.Tensor | None = None, block_m: int | None = None,
              bias: tuple[torch.Tensor, torch.Tensor] | None = None, act=None) -> torch.Tensor:
    """x [T, H] (bf16 or float32), ids [T, K] (expert index, or -1: not here), weights [T, K];
    gate_up [E, 2I, H] and down [E, H, I], each dense bf16 or a StackedGroupWeight. -> [T, H] float32.
    `bias`: (gate_up bias [E, 2I], down bias [E, H]) or None; `act`: the experts' Activation
    (operators.experts.reference; None or no limit: the SwiGLU).

    A layer's experts in groups (layer-wise prefill of a layer too large to hold at once): each
    call gets one group's weights, the ids of the others as -1, `pairs` [T*K, H] float32 zeros
    (each call writes its pairs' weighted rows there and returns it unsummed) and `block_m` =
    fused_moe_block_m over all the experts; pairs.view(T, K, H).sum(1) after the last group is
    then, to the bit, the one call over all of them."""
    T, H = x.shape
    K = ids.shape[1]
    gu = _weight_args(gate_up)
    dn = _weight_args(down)
    E, I = (gate_up.codes.shape[0] if isinstance(gate_up, StackedGroupWeight) else gate_up.shape[0]), gu[7] // 2
    if gu[8] != H or dn[7] != H or dn[8] != I:
        raise ValueError(f"fused_moe: gate_up [E, {gu[7]}, {gu[8]}] and down [E, {dn[7]}, {dn[8]}] do not fit "
                         f"x [T, {H}]")
    if pairs is not None and (pairs.shape != (T * K, H) or pairs.dtype != torch.float32 or not pairs.is_contiguous()
                              or pairs.device != x.device):
        raise ValueError(f"fused_moe: pairs must be a contiguous float32 [{T * K}, {H}] on {x.device}, got "
                         f"{tuple(pairs.shape)} {pairs.dtype} on {pairs.device}")
    gate_up_bias = _bias_arg("gate_up", None if bias is None else bias[0], (E, 2 * I), x.device)
    down_bias = _bias_arg("down", None if bias is None else bias[1], (E, H), x.device)
    limit = getattr(act, "limit", None)
    BLOCK_M = block_m or fused_moe_block_m(T, K, E)
    if BLOCK_M not in (16, 64):
        raise ValueError(f"fused_moe: block_m must be 16 or 64 (fused_moe_block_m), got {block_m}")
    pair_ids, block_expert = align(ids, E, BLOCK_M)
    x = x.contiguous()
    act_dtype = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    inter = torch.empty(T * K, I, device=x.device, dtype=act_dtype)
    out = torch.zeros(T * K, H, device=x.device, dtype=torch.float32) if pairs is None else pairs
    route = weights.reshape(-1).to(torch.float32).contiguous()
    common = dict(BLOCK_M=BLOCK_M, GROUP_SIZE=GROUP, DOT_F32=dot_f32(), HAS_BIAS=bias is not None, num_warps=4,
                  num_stages=3 if x.device.type == "cuda" else 1)
    clamp = (float(limit), float(act.alpha)) if limit is not None else (0.0, 1.0)
    blocks = block_expert.numel()
    BN, BK = 64, (64 if H % 64 == 0 else 32)
    _expert_gemm_kernel[(blocks, triton.cdiv(I, BN))](
        x, pair_ids, block_expert, gu[0], gu[1], gu[2], route if gate_up_bias is None else gate_up_bias, route, inter,
        T * K, E, K, I, H, x.stride(0), inter.stride(0), gu[5], gu[6], *clamp, GATED=True, A_BY_TOKEN=True, BITS=gu[3],
        HAS_OFFSET=gu[4], E2M1=gu[9], CLAMPED=limit is not None, BLOCK_N=BN, BLOCK_K=BK, **common)
    BK = 64 if I % 64 == 0 else 32
    _expert_gemm_kernel[(blocks, triton.cdiv(H, BN))](
        inter, pair_ids, block_expert, dn[0], dn[1], dn[2], route if down_bias is None else down_bias, route, out,
        T * K, E, K, H, I, inter.stride(0), out.stride(0), dn[5], dn[6], *clamp, GATED=False, A_BY_TOKEN=False,
        BITS=dn[3], HAS_OFFSET=dn[4], E2M1=dn[9], CLAMPED=False, BLOCK_N=BN, BLOCK_K=BK, **common)
    return out if pairs is not None else out.view(T, K, H).sum(1)
