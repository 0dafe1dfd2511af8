"""Attention kernels over the paged caches: decode (one query per sequence, many heads, split
over the history) and causal prefill (flash-style, a block of queries per program).

Both take the key in up to two parts and a separate value, which covers both families:
    score(q, j) = q1 · k1[j] + q2 · k2[j]          out = Σ_j softmax(score)_j v[j]
GQA: k1 = K, no k2, v = V, `group` query heads per kv head.
MLA decode (absorbed): q1 = q_nope W_uk (latent), k1 = the cached latent c, q2 = q_rot, k2 = the
    cached rotated key, v = c again (V_IS_K1: the tile already loaded), one kv head for all heads.
MLA prefill (expanded): k1 = k_nope [L, h, n], k2 = k_rot shared by every head (head stride 0).
Rows of the caches are addressed by slot: `slots` [B, max_len] int32 lists each sequence's
history in order (cache.paged.pad_slots of PagedCache's read slots), so pages are read in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import MAX_SPLIT_TILES, dot_f32, sm_count, split_counters
from .norm_rope import round_to
from .pdl import gdc_enter, pdl


# Most splits of one sequence's history in decode_attention (the merge reads every split).
MAX_SPLITS = 64


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _online_softmax(scores, v, m, l, acc, DOT_F32: tl.constexpr):
    """Fold one block of keys (scores [rows, keys], values v [keys, DV]) into each row's running
    max m, sum l and weighted values acc; a row that has seen only masked keys stays at zero."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p, v, DOT_F32)


@triton.jit
def _decode_kernel(q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, slots_ptr, lens_ptr, sinks_ptr, acc_ptr, lse_ptr, out_ptr,
                   count_ptr, s_q1b, s_q1h, s_q2b, s_q2h, s_k1s, s_k1h, s_k2s, s_k2h, s_vs, s_vh, s_slb,
                   Hq, group, D1, D2, DV, scale, window, tokens_per_split, num_splits,
                   BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                   BLOCK_DV: tl.constexpr, HAS_K2: tl.constexpr, V_IS_K1: tl.constexpr, HAS_SINKS: tl.constexpr,
                   DOT_F32: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr):
    """One program: sequence program_id(0), a block of BLOCK_H query heads of one kv head
    (program_id(1)), one split of the history (program_id(2)); stores the split's partial output.
    A head's sink (HAS_SINKS) is folded into split 0 as a key of that logit with a zero value."""
    b = tl.program_id(0)
    gdc_enter(GDC)  # (q and the step's k/v rows are the previous launch's)
    kvh, heads, hmask = _head_block(group, BLOCK_H)
    split = tl.program_id(2)
    start, end = _split_bounds(tl.load(lens_ptr + b), split, window, tokens_per_split)
    q1 = _load_heads(q1_ptr + b * s_q1b, heads, hmask, s_q1h, D1, BLOCK_D1)
    q2 = q1  # (unused without a second key part)
    if HAS_K2:
        q2 = _load_heads(q2_ptr + b * s_q2b, heads, hmask, s_q2h, D2, BLOCK_D2)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    if HAS_SINKS:
        if split == 0:
            m, l = _sink_start(sinks_ptr, heads, hmask, m, l)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        tmask = rt < end
        slot = tl.load(slots_ptr + b * s_slb + rt, mask=tmask, other=0).to(tl.int64)
        k1 = _load_rows(k1_ptr, slot, kvh * s_k1h, tmask, s_k1s, D1, BLOCK_D1)
        scores = _dot(q1, tl.trans(k1), DOT_F32)
        if HAS_K2:
            k2 = _load_rows(k2_ptr, slot, kvh * s_k2h, tmask, s_k2s, D2, BLOCK_D2)
            scores += _dot(q2, tl.trans(k2), DOT_F32)
        scores = tl.where(tmask[None, :], scores * scale, float("-inf"))
        if V_IS_K1:
            v = k1
        else:
            v = _load_rows(v_ptr, slot, kvh * s_vh, tmask, s_vs, DV, BLOCK_DV)
        m, l, acc = _online_softmax(scores, v, m, l, acc, DOT_F32)
    base = (b * Hq + heads) * num_splits + split  # acc [B, Hq, splits, DV], lse [B, Hq, splits]
    _store_split(acc_ptr, lse_ptr, base, hmask, m, l, acc, DV, BLOCK_DV)
    if MERGE:  # the last split of these heads to arrive merges them all (its counter back to 0)
        counter = count_ptr + b * tl.num_programs(1) + tl.program_id(1)
        _merge_if_last(counter, acc_ptr, lse_ptr, out_ptr, b * Hq + heads, hmask, num_splits, DV, BLOCK_S, BLOCK_DV)


@triton.jit
def _sink_start(sinks_ptr, heads, mask, m, l):
    """The running (max, sum) of rows that start with their head's sink logit: a key whose value
    is zero, so it only takes its share of the softmax (rows outside `mask` keep m, l)."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, sink, m), tl.where(mask, 1.0, l)


@triton.jit
def _head_block(group, BLOCK_H: tl.constexpr):
    """(kv head, [BLOCK_H] query heads, their mask) of this program's block of heads."""
    blocks_per_kv = tl.cdiv(group, BLOCK_H)
    kvh = tl.program_id(1) // blocks_per_kv
    hl = (tl.program_id(1) % blocks_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)  # heads within the group
    return kvh, kvh * group + hl, hl < group


@triton.jit
def _split_bounds(length, split, window, tokens_per_split):
    """[start, end) of the history positions this split reads (the last `window` ones, if set)."""
    lo = 0
    if window > 0:
        lo = tl.maximum(length - window, 0)
    start = lo + split * tokens_per_split
    return start, tl.minimum(start + tokens_per_split, length)


@triton.jit
def _load_heads(row_ptr, heads, hmask, s_h, D, BLOCK_D: tl.constexpr):
    """[BLOCK_H, BLOCK_D] of one sequence's query (row_ptr at its first head), zero outside."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(row_ptr + heads[:, None] * s_h + d[None, :], mask=hmask[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _load_rows(ptr, slot, head_offset, tmask, s_s, D, BLOCK_D: tl.constexpr):
    """[BLOCK_T, BLOCK_D] cache rows at `slot` of one kv head, zero outside."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(ptr + slot[:, None] * s_s + head_offset + d[None, :], mask=tmask[:, None] & (d < D)[None, :],
                   other=0.0)


@triton.jit
def _store_split(acc_ptr, lse_ptr, base, hmask, m, l, acc, DV, BLOCK_DV: tl.constexpr):
    """A split's partial result: its normalised output and its log-sum-exp (-inf when empty). With
    one split, acc is the output, of the caller's dtype, rounded to nearest as torch rounds."""
    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(l > 0, m + tl.log(safe_l), float("-inf"))
    dv = tl.arange(0, BLOCK_DV)
    tl.store(acc_ptr + base[:, None] * DV + dv[None, :],
             round_to(out, acc_ptr.dtype.element_ty).to(acc_ptr.dtype.element_ty),
             mask=hmask[:, None] & (dv < DV)[None, :])
    tl.store(lse_ptr + base, lse, mask=hmask)


@triton.jit
def _merge_if_last(counter, acc_ptr, lse_ptr, out_ptr, rows, hmask, num_splits, DV, BLOCK_S: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """Count this split's arrival; the last of `num_splits` merges the rows and resets the counter."""
    tl.debug_barrier()  # every thread's stores issued before the (release) arrival below
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
        _merge_rows(acc_ptr, lse_ptr, out_ptr, rows, hmask, num_splits, DV, BLOCK_S, 8, BLOCK_DV)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_rows(acc_ptr, lse_ptr, out_ptr, rows, rmask, splits, DV, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """out[r] = Σ_s exp(lse_s - logsumexp(lse)) acc[r, s] for rows r (sequence x head, [R]): the
    splits' normalised partial outputs weighed by their share of the softmax (empty splits, -inf,
    weigh 0; a split is never empty for every row: lens >= 1). The partial outputs are read
    CHUNK_S splits at a time (a whole [splits, DV] tile a row would not fit in registers)."""
    rows = rows.to(tl.int64)
    rs = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + rows[:, None] * splits + rs[None, :], mask=rmask[:, None] & (rs < splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # (rows outside rmask: nothing to weigh)
    total = tl.sum(tl.exp(lse - top[:, None]), 1)
    total = tl.where(total > 0, total, 1.0)
    dv = tl.arange(0, BLOCK_DV)
    out = tl.zeros((rows.shape[0], BLOCK_DV), tl.float32)
    for s0 in range(0, splits, CHUNK_S):
        cs = s0 + tl.arange(0, CHUNK_S)
        cm = rmask[:, None] & (cs < splits)[None, :]
        w = tl.exp(tl.load(lse_ptr + rows[:, None] * splits + cs[None, :], mask=cm, other=float("-inf"),
                           cache_modifier=".cg") - top[:, None]) / total[:, None]
        idx = (rows[:, None] * splits + cs[None, :]) * DV
        acc = tl.load(acc_ptr + idx[:, :, None] + dv[None, None, :], mask=cm[:, :, None] & (dv < DV)[None, None, :],
                      other=0.0, cache_modifier=".cg")
        out += tl.sum(acc * w[:, :, None], 1)
    tl.store(out_ptr + rows[:, None] * DV + dv[None, :], round_to(out, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (dv < DV)[None, :])


def decode_attention(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float, q2: torch.Tensor | None = None, k2: torch.Tensor | None = None,
                     window: int = 0, max_len: int | None = None,
                     out_dtype: torch.dtype = torch.float32, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its cached history.

    q1 [B, Hq, D1], q2 [B, Hq, D2]; k1 [S, Hkv, D1], k2 [S, Hkv, D2], v [S, Hkv, DV] (cache rows by
    slot; any row stride), or v=None when the value is k1 itself (MLA); slots [B, max_len] int32,
    lens [B] int32 (>= 1); sinks [Hq] float32: each head's sink logit (gpt-oss), which joins the
    softmax without a value. Returns [B, Hq, DV] of out_dtype (float32 math, rounded once)."""
    B, Hq, D1 = q1.shape
    Hkv = k1.shape[1]
    if Hq % Hkv:
        raise ValueError(f"decode_attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    group = Hq // Hkv
    has_k2 = q2 is not None
    if has_k2 != (k2 is not None):
        raise ValueError("decode_attention: q2 and k2 come together")
    DV = k1.shape[2] if v is None else v.shape[2]
    D2 = q2.shape[2] if has_k2 else 1
    _check_sinks("decode_attention", sinks, Hq, q1.device)
    max_len = int(max_len if max_len is not None else slots.shape[1])
    span = min(max_len, window) if window else max_len
    BLOCK_T, BLOCK_H, splits, tokens_per_split = _decode_split(span, max(D1, DV), group, B * Hkv, q1.device)
    # one split: the kernel's stores round straight to out_dtype (nothing to merge)
    acc = torch.empty(B, Hq, splits, DV, device=q1.device, dtype=torch.float32 if splits > 1 else out_dtype)
    lse = torch.empty(B, Hq, splits, device=q1.device, dtype=torch.float32)
    q2_, k2_ = (q2, k2) if has_k2 else (q1, k1)
    v_ = k1 if v is None else v
    grid = (B, Hkv * triton.cdiv(group, BLOCK_H), splits)
    # narrow rows (GQA) merge in the launch, by the last split of each head block to arrive
    counters = split_counters(q1.device) if splits > 1 and DV <= 128 and B * grid[1] <= MAX_SPLIT_TILES else None
    out = torch.empty(B, Hq, DV, device=q1.device, dtype=out_dtype) if splits > 1 else acc
    _decode_kernel[grid](q1, q2_, k1, k2_, v_, slots, lens, lse if sinks is None else sinks, acc, lse, out,
                         counters if counters is not None else lse,
                         q1.stride(0), q1.stride(1), q2_.stride(0), q2_.stride(1), k1.stride(0), k1.stride(1),
                         k2_.stride(0), k2_.stride(1), v_.stride(0), v_.stride(1), slots.stride(0),
                         Hq, group, D1, D2, DV, float(scale), int(window or 0), tokens_per_split, splits,
                         BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T, BLOCK_D1=_pow2(D1), BLOCK_D2=_pow2(D2), BLOCK_DV=_pow2(DV),
                         HAS_K2=has_k2, V_IS_K1=v is None, HAS_SINKS=sinks is not None, DOT_F32=dot_f32(),
                         MERGE=counters is not None,
                         BLOCK_S=_pow2(splits, 2), num_warps=8 if max(D1, DV) >= 256 else 4,
                         num_stages=2 if q1.device.type == "cuda" else 1, **pdl(q1.device))
    if splits == 1:
        return acc[:, :, 0]
    if counters is not None:
        return out
    _merge_splits_kernel[(B * Hq,)](acc, lse, out, splits, DV, BLOCK_S=_pow2(splits, 2), CHUNK_S=8,
                                    BLOCK_DV=_pow2(DV), num_warps=4)
    return out


def _decode_split(span: int, width: int, group: int, kv_rows: int, device) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, splits, tokens a split) of decode_attention over `span` positions.
    Decode is latency-bound: each block of the history is a dependent round trip (slots, then keys
    and values), so the history is split until a program has about one block, up to MAX_SPLITS
    (the merge reads every split) and a few programs an SM: at GQA shapes such as Qwen3's 32/4
    heads of 128, 64-token blocks and 8 heads a program (fewer round trips a program, more
    programs to fill the SMs) rather than 32-token blocks, 16 heads a program and at least 4
    blocks a split. Wide rows (MLA's 512-value latent) keep 32-token blocks, for registers."""
    BLOCK_T = 64 if width <= 128 else 32
    BLOCK_H = 8 if group <= 8 else 16
    programs = kv_rows * triton.cdiv(group, BLOCK_H)
    splits = max(1, min(triton.cdiv(span, BLOCK_T), MAX_SPLITS, triton.cdiv(4 * sm_count(device), programs)))
    tokens_per_split = triton.cdiv(triton.cdiv(span, splits), BLOCK_T) * BLOCK_T
    return BLOCK_T, BLOCK_H, triton.cdiv(span, tokens_per_split), tokens_per_split


def _check_sinks(what: str, sinks: torch.Tensor | None, heads: int, device) -> None:
    if sinks is not None and (sinks.shape != (heads,) or sinks.dtype != torch.float32 or sinks.device != device
                              or not sinks.is_contiguous()):
        raise ValueError(f"{what}: sinks must be a contiguous float32 [{heads}] on {device}, got "
                         f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")


@triton.jit
def _merge_splits_kernel(acc_ptr, lse_ptr, out_ptr, splits, DV, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                         BLOCK_DV: tl.constexpr):
    """_merge_rows for one (sequence, head) row a program: wide rows (MLA's latent), and any rows
    where the decode launch could not merge (no tile counters, e.g. inside a first capture)."""
    row = tl.program_id(0) + tl.arange(0, 1)
    _merge_rows(acc_ptr, lse_ptr, out_ptr, row, row >= 0, splits, DV, BLOCK_S, CHUNK_S, BLOCK_DV)


@triton.jit
def _prefill_kernel(q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, slots_ptr, sinks_ptr, out_ptr,
                    s_q1t, s_q1h, s_q2t, s_q2h, s_k1s, s_k1h, s_k2s, s_k2h, s_vs, s_vh, s_ot, s_oh,
                    Tq, start, group, D1, D2, DV, scale, window,
                    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                    BLOCK_DV: tl.constexpr, HAS_K2: tl.constexpr, PAGED: tl.constexpr, HAS_SINKS: tl.constexpr,
                    DOT_F32: tl.constexpr):
    h = tl.program_id(1)
    kvh = h // group
    rq = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = rq < Tq
    qpos = start + rq
    d1 = tl.arange(0, BLOCK_D1)
    dv = tl.arange(0, BLOCK_DV)
    q1 = tl.load(q1_ptr + rq[:, None] * s_q1t + h * s_q1h + d1[None, :], mask=qmask[:, None] & (d1 < D1)[None, :],
                 other=0.0)
    if HAS_K2:
        d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q2_ptr + rq[:, None] * s_q2t + h * s_q2h + d2[None, :],
                     mask=qmask[:, None] & (d2 < D2)[None, :], other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_SINKS:
        m, l = _sink_start(sinks_ptr, h + tl.zeros((BLOCK_M,), tl.int32), qmask, m, l)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    last = tl.minimum(start + tl.program_id(0) * BLOCK_M + BLOCK_M, start + Tq)  # keys < last are visible to some row
    lo = 0
    if window > 0:
        lo = tl.maximum(start + tl.program_id(0) * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_T) * BLOCK_T
    for t0 in range(lo, last, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        tmask = rt < last
        if PAGED:
            row = tl.load(slots_ptr + rt, mask=tmask, other=0).to(tl.int64)
        else:
            row = rt.to(tl.int64)
        k1 = tl.load(k1_ptr + row[:, None] * s_k1s + kvh * s_k1h + d1[None, :],
                     mask=tmask[:, None] & (d1 < D1)[None, :], other=0.0)
        scores = _dot(q1, tl.trans(k1), DOT_F32)
        if HAS_K2:
            k2 = tl.load(k2_ptr + row[:, None] * s_k2s + kvh * s_k2h + d2[None, :],
                         mask=tmask[:, None] & (d2 < D2)[None, :], other=0.0)
            scores += _dot(q2, tl.trans(k2), DOT_F32)
        visible = tmask[None, :] & (rt[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (rt[None, :] > qpos[:, None] - window)
        scores = tl.where(visible, scores * scale, float("-inf"))
        v = tl.load(v_ptr + row[:, None] * s_vs + kvh * s_vh + dv[None, :],
                    mask=tmask[:, None] & (dv < DV)[None, :], other=0.0)
        m, l, acc = _online_softmax(scores, v, m, l, acc, DOT_F32)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rq[:, None] * s_ot + h * s_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask[:, None] & (dv < DV)[None, :])


def prefill_attention(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                      q2: torch.Tensor | None = None, k2: torch.Tensor | None = None, window: int = 0,
                      slots: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of Tq queries at positions start..start+Tq-1 over keys 0..start+Tq-1.

    q1 [Tq, Hq, D1], q2 [Tq, Hq, D2]; k1 [L, Hk, D1], k2 [L, Hk or 1, D2] (a head stride of 0
    shares one head), v [L, Hk, DV]; with `slots` [L] int32 the rows are cache slots; sinks [Hq]
    float32 as in decode_attention. Returns [Tq, Hq, DV] in out_dtype."""
    Tq, Hq, D1 = q1.shape
    Hkv = v.shape[1]
    if Hq % Hkv:
        raise ValueError(f"prefill_attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    has_k2 = q2 is not None
    if has_k2 != (k2 is not None):
        raise ValueError("prefill_attention: q2 and k2 come together")
    DV, D2 = v.shape[2], (q2.shape[2] if has_k2 else 1)
    _check_sinks("prefill_attention", sinks, Hq, q1.device)
    out = torch.empty(Tq, Hq, DV, device=q1.device, dtype=out_dtype)
    q2_, k2_ = (q2, k2) if has_k2 else (q1, k1)
    k2_head_stride = 0 if has_k2 and k2.shape[1] == 1 else k2_.stride(1)
    k1_head_stride = 0 if k1.shape[1] == 1 else k1.stride(1)
    slots_ = slots if slots is not None else q1  # unused when not PAGED
    big = max(D1 + D2, DV) > 256
    BLOCK_M, BLOCK_T = (32, 32) if big else (64, 32)
    grid = (triton.cdiv(Tq, BLOCK_M), Hq)
    _prefill_kernel[grid](q1, q2_, k1, k2_, v, slots_, out if sinks is None else sinks, out,
                          q1.stride(0), q1.stride(1), q2_.stride(0), q2_.stride(1), k1.stride(0), k1_head_stride,
                          k2_.stride(0), k2_head_stride, v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                          Tq, int(start), Hq // Hkv, D1, D2, DV, float(scale), int(window or 0),
                          BLOCK_M=BLOCK_M, BLOCK_T=BLOCK_T, BLOCK_D1=_pow2(D1), BLOCK_D2=_pow2(D2),
                          BLOCK_DV=_pow2(DV), HAS_K2=has_k2, PAGED=slots is not None, HAS_SINKS=sinks is not None,
                          DOT_F32=dot_f32(),
                          num_warps=8 if big else 4, num_stages=2 if q1.device.type == "cuda" else 1)
    return out


def attention_reference(q1, k1, v, start: int, scale: float, q2=None, k2=None, window: int = 0,
                        sinks=None) -> torch.Tensor:
    """float32 reference: q [Tq, Hq, D], keys/values [L, Hk, D] (k2 may have 1 head), causal
    from position `start`, optional sliding window, optional per-head sink logits [Hq] (a column
    of the softmax whose value is zero)."""
    Tq, Hq, _ = q1.shape
    L = k1.shape[0]
    g = Hq // v.shape[1]
    k1e = k1.float().repeat_interleave(Hq // k1.shape[1], 1)
    scores = torch.einsum("qhd,lhd->hql", q1.float(), k1e)
    if q2 is not None:
        k2e = k2.float().expand(L, Hq, k2.shape[2]) if k2.shape[1] == 1 else k2.float().repeat_interleave(
            Hq // k2.shape[1], 1)
        scores = scores + torch.einsum("qhd,lhd->hql", q2.float(), k2e)
    qpos = torch.arange(start, start + Tq, device=q1.device)[:, None]
    kpos = torch.arange(L, device=q1.device)[None, :]
    visible = kpos <= qpos
    if window:
        visible &= kpos > qpos - window
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(Hq, 1, 1).expand(Hq, Tq, 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :L]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hql,lhd->qhd", probs, v.float().repeat_interleave(g, 1))
