"""RMSNorm, and Qwen3's per-head q/k norms fused with RoPE, each in one launch: a decode step runs
these on one token per sequence, where the four to ten small torch ops each one costs are the time.

Shapes: rows [.., D] (D = H for the layer norms, d = head_dim for q/k); q [B, S, h, d],
k [B, S, h_kv, d], cos/sin [B, S, d] (HF's rotate_half convention).

Roundings follow the torch references step by step (HF's RMSNorm: float32 norm, cast to the
input's dtype, times the weight in float32 rounded to the result dtype; RoPE: q*cos and
rotate_half(q)*sin each rounded, then their sum), so in bf16 the results equal torch's except
where a different float32 summation order of mean(x^2) moves a value across a rounding step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import gdc_enter, pdl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normed: bool = True) -> torch.Tensor:
    """KRMSNorm's torch path: rows of x [.., D] normalized, times weight [D]. `round_normed=False`:
    the zero-centred norms' order (Qwen3-Next: the float32 product rounded once, to x's dtype)."""
    if not round_normed:
        return (F.rms_norm(x.float(), weight.shape, None, eps) * weight.float()).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def qk_norm_rope_reference(q, k, cos, sin, q_weight=None, k_weight=None, eps: tuple[float, float] = (1e-6, 1e-6),
                           pair_tables: bool = False):
    """Optional per-head RMSNorm of q and k, then transformers' RoPE on [B, S, heads, d] over the
    first r = cos.shape[-1] dims of each head (the rest pass unrotated: partial rotary).
    pair_tables: cos and sin hold one factor per rotated pair (r / 2 of them: gpt-oss's)."""
    if pair_tables:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps[0]), rms_norm_reference(k, k_weight, eps[1])
    half = cos.shape[-1] // 2
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)

    def rotate(x):  # x1 cos - x2 sin, x2 cos + x1 sin over the first 2 half dims; the rest as it is
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:], rest], -1)
    return rotate(q), rotate(k)


@triton.jit
def round_to(x, TY: tl.constexpr):
    """float32 x rounded to the nearest TY value (ties to even), kept in float32, as torch rounds.
    bf16 by bits: Triton's interpreter truncates a float32 -> bf16 cast where the GPU rounds."""
    if TY == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124 (a NaN stays a NaN)
    elif TY == tl.float32:
        return x
    else:
        return x.to(TY).to(tl.float32)


@triton.jit
def normalize_row(x, w, D, eps, ROUND_TY: tl.constexpr, OUT_TY: tl.constexpr):
    """float32 row x (zero past D) -> weight * (x * rsqrt(mean(x^2) + eps) as ROUND_TY), as OUT_TY."""
    r = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
    return round_to(w * round_to(x * r, ROUND_TY), OUT_TY)


@triton.jit
def _rms_norm_kernel(x_ptr, b_ptr, w_ptr, s_ptr, y_ptr, D, s_x, s_b, eps, BLOCK_D: tl.constexpr, ADD: tl.constexpr,
                     ROUND_NORMED: tl.constexpr, GDC: tl.constexpr):
    """A row's norm; ADD: of the row's sum with b's (x + b, stored at s_ptr, rounded as torch's add
    rounds: a float32 sum rounded once), the norm reading the rounded sum."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)  # (a weight: before waiting, GDC)
    gdc_enter(GDC)
    x = tl.load(x_ptr + row * s_x + d, mask=m, other=0.0).to(tl.float32)
    x_ty = x_ptr.dtype.element_ty
    if ADD:
        x_ty = s_ptr.dtype.element_ty
        x = round_to(x + tl.load(b_ptr + row * s_b + d, mask=m, other=0.0).to(tl.float32), x_ty)
        tl.store(s_ptr + row * D + d, x.to(x_ty), mask=m)
    if ROUND_NORMED:
        y = normalize_row(x, w, D, eps, x_ty, y_ptr.dtype.element_ty)
    else:
        y = round_to(x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps) * w, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [R, D] with unit element stride (a view when the strides allow one, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_normed: bool = True) -> torch.Tensor:
    """Rows of x [.., D] (bf16/fp16/fp32, any leading dims) normalized, times weight [D], as
    rms_norm_reference: the result in torch's promoted dtype of x and weight, or with
    `round_normed=False` in x's dtype, rounded once."""
    D = x.shape[-1]
    if weight.shape != (D,) or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be a contiguous [{D}] on {x.device}, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    rows = _rows(x)
    dtype = torch.promote_types(x.dtype, weight.dtype) if round_normed else x.dtype
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, D, rows.stride(0), 0, float(eps),
                                           BLOCK_D=block, ADD=False, ROUND_NORMED=round_normed,
                                           num_warps=_warps(block), **pdl(x.device))
    return out


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float):
    """(s, rms_norm(s)) for s = a + b, rows [.., D] of the same shape on one device, in one launch:
    a decoder layer's residual add and the next norm (s of torch's promoted dtype of a and b; the
    norm as rms_norm_reference(s, weight, eps))."""
    D = a.shape[-1]
    if b.shape != a.shape or b.device != a.device:
        raise ValueError(f"add_rms_norm: a {tuple(a.shape)} on {a.device} and b {tuple(b.shape)} on {b.device} differ")
    if weight.shape != (D,) or weight.device != a.device or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be a contiguous [{D}] on {a.device}, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    ra, rb = _rows(a), _rows(b)
    s = torch.empty(a.shape, device=a.device, dtype=torch.promote_types(a.dtype, b.dtype))
    y = torch.empty(a.shape, device=a.device, dtype=torch.promote_types(s.dtype, weight.dtype))
    if ra.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(ra.shape[0],)](ra, rb, weight, s, y, D, ra.stride(0), rb.stride(0), float(eps),
                                         BLOCK_D=block, ADD=True, ROUND_NORMED=True, num_warps=_warps(block),
                                         **pdl(a.device))
    return s, y


@triton.jit
def _normed(x, w_ptr, cols, mask, r, TY: tl.constexpr):
    """Part `cols` of a row x times its rsqrt r, rounded to TY, times the norm weight, rounded."""
    return round_to(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * round_to(x * r, TY), TY)


@triton.jit
def _store_kv(kc_ptr, vc_ptr, vrow, slot_ptr, t, Hk, h, D, total_slots, cols, mask, k, OUT_TY: tl.constexpr):
    """k (a part `cols` of a rotated key row) and the same part of v's row at token t's slot of the
    caches [slots, Hk, D]; v rounded to the cache's dtype as index_copy_ casts. A slot outside the
    caches is skipped (the engine's are always in range)."""
    slot = tl.load(slot_ptr + t + cols * 0).to(tl.int64)  # (a vector: masks of one dtype)
    ok = mask & (slot >= 0) & (slot < total_slots)
    row = (slot * Hk + h) * D
    tl.store(kc_ptr + row + cols, k.to(OUT_TY), mask=ok)
    v = round_to(tl.load(vrow + cols, mask=mask, other=0.0).to(tl.float32), OUT_TY)
    tl.store(vc_ptr + row + cols, v.to(OUT_TY), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr,
                         Hq, Hk, S, half, second, D, s_qt, s_qh, s_kt, s_kh, s_ct, s_cb, s_st, s_sb, q_eps, k_eps,
                         v_ptr, s_vt, s_vh, kc_ptr, vc_ptr, slot_ptr, total_slots,
                         BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, NORM: tl.constexpr,
                         WRITE: tl.constexpr, GDC: tl.constexpr):
    """Program (token t, head j): j < Hq is q's head j, else k's head j - Hq. The row of D values
    is read as its two rotary halves [0, half) and [half, 2 half), so rotate_half is a swap of
    registers, and the unrotated rest [2 half, D) (partial rotary; BLOCK_PASS 0 where there is
    none). The second half's cos/sin factors start at `second` in the tables (half, or 0 for
    tables of one factor a pair). WRITE: k's programs also store the rotated row, and v's row of
    the same head, at the token's slot of the caches."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    is_q = j < Hq
    h = tl.where(is_q, j, j - Hq).to(tl.int64)
    b, s = t // S, t % S
    i = tl.arange(0, BLOCK_HALF)
    m = i < half
    gdc_enter(GDC)
    if is_q:
        src, w_ptr, dst, eps = q_ptr + t * s_qt + h * s_qh, qw_ptr, qo_ptr + (t * Hq + h) * D, q_eps
    else:
        src, w_ptr, dst, eps = k_ptr + t * s_kt + h * s_kh, kw_ptr, ko_ptr + (t * Hk + h) * D, k_eps
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=m, other=0.0).to(tl.float32)
    ty = q_ptr.dtype.element_ty
    out_ty = qo_ptr.dtype.element_ty
    if BLOCK_PASS > 0:
        p = 2 * half + tl.arange(0, BLOCK_PASS)
        mp = p < D
        x3 = tl.load(src + p, mask=mp, other=0.0).to(tl.float32)
    if NORM:  # every part's squares in one reduction
        sq = tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)
        if BLOCK_PASS > 0:
            sq += tl.sum(x3 * x3, 0)
        r = tl.math.rsqrt(sq / D + eps)
        x1, x2 = _normed(x1, w_ptr, i, m, r, ty), _normed(x2, w_ptr, half + i, m, r, ty)
        if BLOCK_PASS > 0:
            x3 = _normed(x3, w_ptr, p, mp, r, ty)
    c = cos_ptr + b * s_cb + s * s_ct
    sn = sin_ptr + b * s_sb + s * s_st
    c1 = tl.load(c + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c + second + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sn + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sn + second + i, mask=m, other=0.0).to(tl.float32)
    y1 = round_to(round_to(x1 * c1, out_ty) + round_to(-x2 * s1, out_ty), out_ty)
    y2 = round_to(round_to(x2 * c2, out_ty) + round_to(x1 * s2, out_ty), out_ty)
    tl.store(dst + i, y1.to(out_ty), mask=m)
    tl.store(dst + half + i, y2.to(out_ty), mask=m)
    if BLOCK_PASS > 0:  # (q's dtype promoted to the output's, as torch.cat promotes)
        tl.store(dst + p, x3.to(out_ty), mask=mp)
    if WRITE:
        if not is_q:
            vrow = v_ptr + t * s_vt + h * s_vh
            _store_kv(kc_ptr, vc_ptr, vrow, slot_ptr, t, Hk, h, D, total_slots, i, m, y1, out_ty)
            _store_kv(kc_ptr, vc_ptr, vrow, slot_ptr, t, Hk, h, D, total_slots, half + i, m, y2, out_ty)
            if BLOCK_PASS > 0:
                _store_kv(kc_ptr, vc_ptr, vrow, slot_ptr, t, Hk, h, D, total_slots, p, mp, x3, out_ty)


def _heads(x: torch.Tensor, what: str) -> torch.Tensor:
    """x [B, S, h, d] with unit element stride and one stride per token (B and S merge)."""
    if x.dim() != 4:
        raise ValueError(f"qk_norm_rope: {what} must be [B, S, heads, d], got {tuple(x.shape)}")
    if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x


def _check(q, k, cos, sin, q_weight, k_weight, pair_tables: bool) -> None:
    B, S, _, d = q.shape
    if k.shape[:2] != (B, S) or k.shape[3] != d or d % 2 or q.dtype != k.dtype:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not match")
    width = cos.shape[-1] if cos.dim() == 3 else -1
    r = 2 * width if pair_tables else width
    if not (0 < r <= d and r % 2 == 0):
        what = "r / 2] (pair tables)" if pair_tables else "r]"
        raise ValueError(f"qk_norm_rope: cos must be [{B}, {S}, {what} with an even rotary dim r <= {d}, "
                         f"got {tuple(cos.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, S, width) or t.stride(-1) != 1 or t.dtype != cos.dtype or t.device != q.device:
            raise ValueError(f"qk_norm_rope: {name} must be [{B}, {S}, {width}] with unit stride like cos on "
                             f"{q.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: q_weight and k_weight come together")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != q.dtype or w.device != q.device or not w.is_contiguous()):
            raise ValueError(f"qk_norm_rope: {name} must be a contiguous [{d}] of q's dtype {q.dtype} on {q.device}")


def _check_cache(write, k: torch.Tensor, out_dtype: torch.dtype):
    """(v, k_cache, v_cache, slots) of qk_norm_rope's `write`, checked against k [B, S, h_kv, d]."""
    v, k_cache, v_cache, slots = write
    B, S, Hk, d = k.shape
    if v.shape != k.shape or v.device != k.device or not v.dtype.is_floating_point:
        raise ValueError(f"qk_norm_rope: v must be a float [B, S, h_kv, d] like k {tuple(k.shape)} on {k.device}, "
                         f"got {tuple(v.shape)} {v.dtype} on {v.device}")
    v = _heads(v, "v")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[1:] != (Hk, d) or not c.is_contiguous() or c.dtype != out_dtype or c.device != k.device:
            raise ValueError(f"qk_norm_rope: {name} must be a contiguous [slots, {Hk}, {d}] {out_dtype} on {k.device}, "
                             f"got {tuple(c.shape)} {c.dtype} on {c.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"qk_norm_rope: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if slots.shape != (B * S,) or slots.device != k.device or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qk_norm_rope: slots must be [{B * S}] int32/int64 on {k.device}, got {tuple(slots.shape)} "
                         f"{slots.dtype} on {slots.device}")
    return v, k_cache, v_cache, slots.contiguous()


def qk_norm_rope(q, k, cos, sin, q_weight=None, k_weight=None, eps: tuple[float, float] = (1e-6, 1e-6),
                 write=None, pair_tables: bool = False):
    """qk_norm_rope_reference in one launch: q [B, S, h, d], k [B, S, h_kv, d] -> rotated contiguous
    copies, of torch's promoted dtype of q and cos; cos and sin [B, S, r] rotate the first r dims
    ([B, S, r / 2] with pair_tables: one factor a pair, read for both halves). The norm weights,
    when given, have q's dtype.
    `write` = (v, k_cache, v_cache, slots): the same launch also stores the rotated k and v
    [B, S, h_kv, d] at rows `slots` [B*S] of the caches [slots, h_kv, d] (of the output dtype), as
    the paged cache's write does with two index_copy_ launches. The slots are the engine's own
    (in range by construction); one outside the caches is skipped, not raised (a check would be a
    device-to-host sync)."""
    q, k = _heads(q, "q"), _heads(k, "k")
    _check(q, k, cos, sin, q_weight, k_weight, pair_tables)
    B, S, Hq, d = q.shape
    Hk = k.shape[2]
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    if write is not None:
        v, k_cache, v_cache, slots = _check_cache(write, k, out_dtype)
    qo = torch.empty(q.shape, device=q.device, dtype=out_dtype)
    ko = torch.empty(k.shape, device=q.device, dtype=out_dtype)
    if B * S == 0:
        return qo, ko
    norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if norm else (cos, cos)
    if write is None:
        v, k_cache, v_cache, slots = k, ko, ko, cos  # (not read: WRITE is off)
    half = cos.shape[-1] if pair_tables else cos.shape[-1] // 2
    # no fused multiply-adds: torch rounds each product before the sum
    second = 0 if pair_tables else half
    _qk_norm_rope_kernel[(B * S, Hq + Hk)](q, k, cos, sin, qw, kw, qo, ko, Hq, Hk, S, half, second, d,
                                           q.stride(1), q.stride(2), k.stride(1), k.stride(2),
                                           cos.stride(1), cos.stride(0), sin.stride(1), sin.stride(0),
                                           float(eps[0]), float(eps[1]), v, v.stride(1), v.stride(2), k_cache,
                                           v_cache, slots, k_cache.shape[0],
                                           BLOCK_HALF=triton.next_power_of_2(half),
                                           BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if d > 2 * half else 0,
                                           NORM=norm,
                                           WRITE=write is not None, num_warps=1, enable_fp_fusion=False,
                                           **pdl(q.device))
    return qo, ko
