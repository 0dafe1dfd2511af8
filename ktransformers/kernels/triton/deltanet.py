"""One decode token of a gated DeltaNet layer (Qwen3-Next, Qwen3.5-MoE) per sequence, in one launch:
from the input projections' rows to the gated norm's output, over the cache's state rows.

Done op by op, a GPU decode step of such a layer is about forty small launches (the projections'
split, sigmoid and softplus, the conv step and its state, the delta rule, the state's copy back,
the gated norm's six ops), and those launches are the layer's time. Here a program takes one
sequence and one key head: the conv channels of its q and k, the value heads it serves (so the
channels and states it writes are its own), and for each of those heads the conv step, the gated
delta rule (operators.deltanet) and RMSNorm(out) * SiLU(z).

Inputs as the projections give them: Qwen3-Next's fused `in_proj_qkvz` [N, Hk * (2 Dk + 2 r Dv)]
and `in_proj_ba` [N, Hk * 2 r] (per key head: q, k, its r value heads' v, then their z; b then a),
or Qwen3.5's `in_proj_qkv` [N, 2 Hk Dk + Hv Dv], `in_proj_z` [N, Hv Dv], `in_proj_b`, `in_proj_a`
[N, Hv]. Value heads are ordered grouped (value head j reads key head j // r) or tiled (j % Hk),
as the weights are stored. Roundings follow operators.deltanet's torch path: the conv output
rounded to the projections' dtype, the delta rule in float32, its output rounded to that dtype
before the norm, the norm as transformers' Qwen3NextRMSNormGated rounds it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .norm_rope import round_to
from .pdl import gdc_enter, pdl


@triton.jit
def _in_table(like, row, rows):
    """Whether state row `row` lies in [0, rows), as a vector shaped as `like` (the interpreter
    takes masks of one shape and dtype)."""
    r = like * 0 + row
    return (r >= 0) & (r < rows)


@triton.jit
def _conv_step(conv_ptr, w_ptr, rrow, wrow, rows, s_row, c, m, x, KS: tl.constexpr, BLOCK_S: tl.constexpr,
               X_TY: tl.constexpr):
    """Channels c (mask m) of one sequence: SiLU(conv over the state row `rrow` (zeros if < 0) and
    x), rounded to X_TY; the window's last KS - 1 inputs are stored at row `wrow` (rows outside
    [0, rows) are neither read nor written: the engine's never are)."""
    j = tl.arange(0, BLOCK_S)
    has, put = _in_table(c, rrow, rows), _in_table(c, wrow, rows)
    mj = m[:, None] & (j[None, :] < KS - 1)
    cell = c[:, None] * (KS - 1) + j[None, :]
    state = tl.load(conv_ptr + rrow * s_row + cell, mask=mj & has[:, None], other=0.0)
    w = tl.load(w_ptr + c[:, None] * KS + j[None, :], mask=mj, other=0.0)
    y = tl.sum(state * w, 1) + x * tl.load(w_ptr + c * KS + KS - 1, mask=m, other=0.0)
    shifted = tl.load(conv_ptr + rrow * s_row + cell + 1, mask=mj & (j[None, :] < KS - 2) & has[:, None], other=0.0)
    shifted = tl.where(j[None, :] == KS - 2, x[:, None], shifted)
    tl.debug_barrier()  # (every thread has read the row before any writes it: read and write rows may be one)
    tl.store(conv_ptr + wrow * s_row + cell, shifted, mask=mj & put[:, None])
    return round_to(y / (1.0 + tl.exp(-y)), X_TY)


@triton.jit
def _decode_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, s_qkv, s_z, s_b, s_a,
                   conv_ptr, convw_ptr, s_conv, ssm_ptr, s_ssm, read_ptr, write_ptr, rows,
                   neg_a_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, eps, scale,
                   HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KS: tl.constexpr,
                   FUSED: tl.constexpr, TILED: tl.constexpr, P_TY: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    x_ty = qkv_ptr.dtype.element_ty
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_V)
    mk, mv = dk < DK, dv < DV
    norm_w = tl.load(norm_w_ptr + dv, mask=mv, other=0.0).to(tl.float32)  # (a weight: before waiting, GDC)
    gdc_enter(GDC)
    rrow = tl.load(read_ptr + n).to(tl.int64)
    wrow = tl.load(write_ptr + n).to(tl.int64)
    W: tl.constexpr = 2 * DK + 2 * R * DV  # a key head's columns of the fused in_proj_qkvz
    row = qkv_ptr + n * s_qkv
    q_at = row + kh * W if FUSED else row + kh * DK
    k_at = q_at + DK if FUSED else row + HK * DK + kh * DK
    q = tl.load(q_at + dk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_at + dk, mask=mk, other=0.0).to(tl.float32)
    q = _conv_step(conv_ptr, convw_ptr, rrow, wrow, rows, s_conv, kh * DK + dk, mk, q, KS, BLOCK_S, x_ty)
    k = _conv_step(conv_ptr, convw_ptr, rrow, wrow, rows, s_conv, HK * DK + kh * DK + dk, mk, k, KS, BLOCK_S, x_ty)
    q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6) / scale
    k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
    ms = mk[:, None] & mv[None, :]  # a state's cells; read, and written, where the rows lie in the table
    ms_read, ms_write = ms & _in_table(dk, rrow, rows)[:, None], ms & _in_table(dk, wrow, rows)[:, None]
    out_ty = out_ptr.dtype.element_ty
    for i in tl.static_range(R):
        h = i * HK + kh if TILED else kh * R + i  # the value head: its state, conv channels and output
        if FUSED:
            head = row + (h // R) * W
            v_at, z_at = head + 2 * DK + (h % R) * DV, head + 2 * DK + R * DV + (h % R) * DV
            b_at = b_ptr + n * s_b + (h // R) * 2 * R + h % R
            a_at = b_at + R
        else:
            v_at, z_at = row + 2 * HK * DK + h * DV, z_ptr + n * s_z + h * DV
            b_at, a_at = b_ptr + n * s_b + h, a_ptr + n * s_a + h
        v = tl.load(v_at + dv, mask=mv, other=0.0).to(tl.float32)
        v = _conv_step(conv_ptr, convw_ptr, rrow, wrow, rows, s_conv, 2 * HK * DK + h * DV + dv, mv, v, KS, BLOCK_S, x_ty)
        beta = tl.sigmoid(tl.load(b_at).to(tl.float32))
        a = tl.load(a_at).to(tl.float32) + tl.load(dt_bias_ptr + h)
        g = tl.load(neg_a_ptr + h) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, as torch's
        cell = h * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(ssm_ptr + rrow * s_ssm + cell, mask=ms_read, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(ssm_ptr + wrow * s_ssm + cell, s, mask=ms_write)
        o = round_to(tl.sum(s * q[:, None], 0), x_ty)
        normed = round_to(o * tl.math.rsqrt(tl.sum(o * o, 0) / DV + eps), x_ty)
        zg = tl.load(z_at + dv, mask=mv, other=0.0).to(tl.float32)
        y = round_to(norm_w * normed, P_TY) * (zg / (1.0 + tl.exp(-zg)))
        tl.store(out_ptr + n * (R * HK * DV) + h * DV + dv, round_to(y, out_ty).to(out_ty), mask=mv)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def gated_delta_decode(projections: tuple, conv: torch.Tensor, conv_w: torch.Tensor, ssm: torch.Tensor,
                       reads: torch.Tensor, writes: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                       norm_w: torch.Tensor, eps: float, heads: tuple[int, int, int, int], tiled: bool) -> torch.Tensor:
    """One token of N sequences -> the gated norm's output [N, Hv * Dv] in the projections' dtype.

    projections: (qkvz, ba) fused, or (qkv, z, b, a), rows [N, ...] as the layer's projections
    give them. conv [rows, C, K-1] and ssm [rows, Hv, Dk, Dv] float32: the cache's state tables;
    sequence i reads row reads[i] (-1: zero states) and writes row writes[i] (int64 on the GPU;
    a CUDA graph's static buffers, so not checked on the host: a row outside the tables is read
    as zeros and not written). conv_w [C, K] float32; neg_a = -exp(A_log), dt_bias [Hv]
    float32; norm_w [Dv]."""
    Hk, Hv, Dk, Dv = heads
    fused = len(projections) == 2
    if len(projections) not in (2, 4) or Hv % Hk:
        raise ValueError(f"gated_delta_decode: projections are (qkvz, ba) or (qkv, z, b, a), and value heads "
                         f"({Hv}) a multiple of key heads ({Hk}); got {len(projections)} tensors")
    R = Hv // Hk
    x = projections[0]
    N, device, C = x.shape[0], x.device, 2 * Hk * Dk + Hv * Dv
    widths = (Hk * (2 * Dk + 2 * R * Dv), 2 * Hv) if fused else (C, Hv * Dv, Hv, Hv)
    for name, t, width in zip(("qkvz", "ba") if fused else ("qkv", "z", "b", "a"), projections, widths):
        if t.dim() != 2 or tuple(t.shape) != (N, width) or t.stride(-1) != 1 or t.dtype != x.dtype or t.device != device:
            raise ValueError(f"gated_delta_decode: {name} must be [{N}, {width}] {x.dtype} with unit stride on "
                             f"{device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    K = conv_w.shape[-1] if conv_w.dim() == 2 else 0
    rows = conv.shape[0]
    expected = {"conv": (conv, (rows, C, K - 1)), "conv_w": (conv_w, (C, K)), "ssm": (ssm, (rows, Hv, Dk, Dv)),
                "neg_a": (neg_a, (Hv,)), "dt_bias": (dt_bias, (Hv,))}
    for name, (t, shape) in expected.items():
        if K < 2 or tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != device:
            raise ValueError(f"gated_delta_decode: {name} must be a contiguous float32 {list(shape)} on {device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if tuple(norm_w.shape) != (Dv,) or not norm_w.is_contiguous() or norm_w.device != device:
        raise ValueError(f"gated_delta_decode: norm_w must be a contiguous [{Dv}] on {device}")
    for name, t in (("reads", reads), ("writes", writes)):
        if tuple(t.shape) != (N,) or t.dtype != torch.int64 or t.device != device or not t.is_contiguous():
            raise ValueError(f"gated_delta_decode: {name} must be a contiguous int64 [{N}] on {device}")
    out = torch.empty(N, Hv * Dv, device=device, dtype=x.dtype)
    if N == 0:
        return out
    qkv, z, b, a = (x, x, projections[1], projections[1]) if fused else projections
    block_k, block_v = triton.next_power_of_2(Dk), triton.next_power_of_2(Dv)
    warps = max(1, min(8, block_k * block_v // 2048))
    _decode_kernel[(N, Hk)](qkv, z, b, a, qkv.stride(0), z.stride(0), b.stride(0), a.stride(0),
                            conv, conv_w, conv.stride(0), ssm, ssm.stride(0), reads, writes, rows,
                            neg_a, dt_bias, norm_w, out, float(eps), math.sqrt(Dk),
                            HK=Hk, R=R, DK=Dk, DV=Dv, KS=K, FUSED=fused, TILED=tiled,
                            P_TY=_TL[torch.promote_types(norm_w.dtype, x.dtype)],
                            BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_S=triton.next_power_of_2(K - 1),
                            num_warps=warps, **pdl(device))
    return out
