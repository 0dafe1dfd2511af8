"""Group-quantized weight x activation GEMM: the GPU linear for int4 ("Marlin") and int8 weights.

A weight W [N, K] (HF layout, y = x Wᵀ) is held as codes and per-group (scale, offset), groups
of g = 32 values along K (16 for weights from Q6_K):
    W[n, k] = scale[k // g, n] * code[k, n] + offset[k // g, n]
int4: codes 0..15, eight per int32 along K: packed [K / 8, N], code k in bits 4*(k % 8).
int8: codes -127..127, four per int32 along K: packed [K / 4, N], code k in byte k % 4 (two's
complement); offset absent (symmetric). A thread's load is a word of either, never a byte.
GGUF Q4_0 and Q4_K convert losslessly (ggml_quants.group_affine); Q8_0 becomes int8 likewise, and
Q6_K int8 in groups of 16 (its sub-blocks: 1.25 bytes a value, where bf16 would take 2).
`quantize_int4` / `quantize_int8` re-quantize float weights (lossy), only when asked.

Kernel: one program per (BLOCK_M x BLOCK_N) output tile and K split; codes are unpacked and scaled
in registers, fed to tl.dot in bf16, accumulated in float32. Few rows (decode) split K across
programs so that every SM streams weights; the last program of a tile adds the splits' partial
sums in order and writes the output (one launch, the same bits every run; common.plan_split_k).
(A single-launch GEMV without the split, its own program over all of K for a few columns, is
slower: it keeps too few loads in flight a program to stream the weights.) One row (decode) runs
a GEMV without tl.dot instead, whose 16-row tiles would be 15/16 padding: `_quant_gemv_kernel`,
or `gemv_many` for a layer's q, k and v in one launch.

`dense_gemv`: float weights W [N, K] as torch stores them against up to GEMV_ROWS rows, in one
launch (the routers' logits: cheaper than F.linear and the casts around it, whose launches
are the cost at these sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...weights.ggml_quants import GGMLType, group_affine
from .common import (DENSE_ROWS, MAX_SPLIT_TILES, SplitPlan, dot_f32, plan_split_k, sm_count, split_counters,
                     split_grid)
from .pdl import gdc_enter, pdl
from .norm_rope import round_to

GROUP = 32
# Rows of x dense_gemv takes: decode steps (a chosen limit; more rows belong to a GEMM).
GEMV_ROWS = 4
# Dense weights up to this many values take the one-launch GEMVs for decode-sized rows (a 4096x4096
# projection; a 32k-vocabulary lm_head stays on cuBLAS, which streams a weight that large faster).
DENSE_GEMV_WEIGHTS = 1 << 24
# int4 weights of at least this many values take the one-row GEMV's wider programs (_gemv_blocks)
GEMV_WIDE = 1 << 24


@dataclass
class GroupQuantWeight:
    """One weight matrix in the kernel's layout (see the module doc)."""
    bits: int
    codes: torch.Tensor  # int32 [K/8, N] (int4) or [K/4, N] (int8)
    scale: torch.Tensor  # float32 [K/group, N]
    offset: torch.Tensor | None  # float32 [K/group, N] or None
    out_features: int  # N
    in_features: int  # K
    group: int = GROUP  # values a scale (and offset) covers along K: 32, or 16 (from Q6_K)

    def to(self, device) -> GroupQuantWeight:
        return GroupQuantWeight(self.bits, self.codes.to(device), self.scale.to(device),
                                None if self.offset is None else self.offset.to(device),
                                self.out_features, self.in_features, self.group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """float32 W [N, K] (the reference)."""
        K, N = self.in_features, self.out_features
        codes = unpack_codes(self.codes, self.bits).reshape(K, N)
        w = codes.float().reshape(K // self.group, self.group, N) * self.scale[:, None, :]
        if self.offset is not None:
            w = w + self.offset[:, None, :]
        return w.reshape(K, N).T.contiguous()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (int4: 0..15, int8: -128..127) -> int32 [K/(32/bits), N]: code k of a column
    in bits `bits`*(k % per) of word k // per, per = 32 / bits codes a word."""
    N, K = codes.shape
    per = 32 // bits
    c = (codes.to(torch.int64) & ((1 << bits) - 1)).T.reshape(K // per, per, N)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)[None, :, None]
    packed = (c << shifts).sum(1)  # disjoint bit fields: sum == or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., K/per, N] from pack_codes -> int32 codes [..., K/per, per, N] (int8 signed)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)
    return codes - 256 * (codes >= 128) if bits == 8 else codes


def _check_shape(what: str, N: int, K: int) -> None:
    if K % GROUP:
        raise ValueError(f"{what}: in_features {K} is not a multiple of the group size {GROUP}")


def check_bias(what: str, bias: torch.Tensor | None, N: int, device: torch.device) -> None:
    """A launch's bias: None, or float32 [N] on the launch's device."""
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32 or bias.device != device):
        raise ValueError(f"{what}: bias must be float32 [{N}] on {device}, got {bias.dtype} "
                         f"{list(bias.shape)} on {bias.device}")


def _epilogue_bias(plan: SplitPlan, bias: torch.Tensor | None, placeholder: torch.Tensor):
    """(bias_ptr, HAS_BIAS) of a launch on `plan`: the bias added in its epilogue; under the atomic
    fallback y starts as the bias instead (the splits add into it). `placeholder` stands in for
    an absent bias (never read)."""
    if bias is None:
        return placeholder, False
    if plan.atomic:
        plan.y.copy_(bias.expand_as(plan.y))
        return placeholder, False
    return bias, True


def from_ggml(raw, ggml_type, shape: tuple[int, int]) -> GroupQuantWeight:
    """GGUF Q4_0 / Q4_K -> int4, Q8_0 -> int8, Q6_K -> int8 in groups of 16, losslessly (on the CPU)."""
    codes, scale, offset = group_affine(raw, ggml_type, shape)
    N, K = shape
    if GGMLType(int(ggml_type)) in (GGMLType.Q8_0, GGMLType.Q6_K):
        return GroupQuantWeight(8, pack_codes(codes, 8), scale.T.contiguous(), None, N, K, K // scale.shape[1])
    return GroupQuantWeight(4, pack_codes(codes, 4), scale.T.contiguous(), offset.T.contiguous(), N, K)


def quantize_int4(w: torch.Tensor) -> GroupQuantWeight:
    """Asymmetric int4 per 32 values of a row (min/max), from a float W [N, K] (lossy)."""
    N, K = w.shape
    _check_shape("quantize_int4", N, K)
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    return GroupQuantWeight(4, pack_codes(codes, 4), scale.T.contiguous(), lo.T.contiguous(), N, K)


def quantize_int8(w: torch.Tensor) -> GroupQuantWeight:
    """Symmetric int8 per 32 values of a row (absmax), from a float W [N, K] (lossy)."""
    N, K = w.shape
    _check_shape("quantize_int8", N, K)
    g = w.float().reshape(N, K // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-12)
    codes = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(N, K)
    return GroupQuantWeight(8, pack_codes(codes, 8), scale.T.contiguous(), None, N, K)


@triton.jit
def _unpack_words(codes_ptr, k0, K, rn, mask_n, stride_code, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 codes [BLOCK_K / PER, PER, len(rn)] of rows [k0, k0 + BLOCK_K) (0 past K or N) from
    their packed words (PER = 32 / BITS a word; int4 unsigned, int8 two's complement). An int8
    code, biased by 128, goes under 2^23's exponent as the float 2^23 + 128 + c, and 2^23 + 128 is
    subtracted: exact, on the logic and float units instead of the int-to-float conversion (16 a
    clock an SM on NVIDIA GPUs). int4 codes convert as they are: there the trick's extra logic
    costs more than the conversions it saves (dev/int8_gemv.py, dev/README.md)."""
    PER: tl.constexpr = 32 // BITS
    rw = k0 // PER + tl.arange(0, BLOCK_K // PER)
    words = tl.load(codes_ptr + rw[:, None] * stride_code + rn[None, :], mask=(rw * PER < K)[:, None] & mask_n[None, :],
                    other=0)
    if BITS == 4:
        return ((words[:, None, :] >> (tl.arange(0, PER) * 4)[None, :, None]) & 15).to(tl.float32)
    bits = (((words[:, None, :] >> (tl.arange(0, PER) * 8)[None, :, None]) & 255) ^ 128) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def load_group_weights(codes_ptr, scale_ptr, offset_ptr, k0, K, rn, N, stride_code,
                       BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """float32 W[k0 : k0+BLOCK_K, rn] (transposed weights) from codes and group scales;
    columns outside N and rows past K read as 0. BLOCK_K is a multiple of the group size (and K of
    the group size)."""
    mask_n = rn < N
    rg = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
    mask_g = (rg * GROUP_SIZE < K)[:, None] & mask_n[None, :]
    q = tl.reshape(_unpack_words(codes_ptr, k0, K, rn, mask_n, stride_code, BITS, BLOCK_K), (BLOCK_K, BLOCK_N))
    s = tl.load(scale_ptr + rg[:, None] * stride_code + rn[None, :], mask=mask_g, other=0.0)
    w = tl.reshape(q, (BLOCK_K // GROUP_SIZE, GROUP_SIZE, BLOCK_N)) * s[:, None, :]
    if HAS_OFFSET:
        o = tl.load(offset_ptr + rg[:, None] * stride_code + rn[None, :], mask=mask_g, other=0.0)
        w = w + o[:, None, :]
    return tl.reshape(w, (BLOCK_K, BLOCK_N))


@triton.jit
def _group_gemm_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                       stride_xm, stride_ym, k_per_split,
                       BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ATOMIC: tl.constexpr, REDUCE: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, k_per_split // BLOCK_K):
        k0 = pid_k * k_per_split + i * BLOCK_K
        # the last split may hold fewer blocks: rows past K read as 0
        a = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :],
                    mask=(rm < M)[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        w = load_group_weights(codes_ptr, scale_ptr, offset_ptr, k0, K, rn, N, N, BITS, HAS_OFFSET, BLOCK_K,
                               BLOCK_N, GROUP_SIZE)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w)
        else:
            acc += tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))
    store_tile(acc, y_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_ym, ATOMIC, REDUCE, bias_ptr, HAS_BIAS)


@triton.jit
def _quant_block(codes_ptr, scale_ptr, offset_ptr, rn, N, K, k0, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """The codes (float32 [G, GROUP_SIZE, BLOCK_N]), scales and offsets ([G, BLOCK_N]; the scales
    again without HAS_OFFSET, never read) of int4 or int8 weight columns rn over [k0, k0 +
    BLOCK_K); past K or N: 0."""
    G: tl.constexpr = BLOCK_K // GROUP_SIZE
    mask_n = rn < N
    q = tl.reshape(_unpack_words(codes_ptr, k0, K, rn, mask_n, N, BITS, BLOCK_K), (G, GROUP_SIZE, BLOCK_N))
    rg = k0 // GROUP_SIZE + tl.arange(0, G)
    mask_g = (rg * GROUP_SIZE < K)[:, None] & mask_n[None, :]
    s = tl.load(scale_ptr + rg[:, None] * N + rn[None, :], mask=mask_g, other=0.0)
    o = tl.load(offset_ptr + rg[:, None] * N + rn[None, :], mask=mask_g, other=0.0) if HAS_OFFSET else s
    return q, s, o


@triton.jit
def _quant_block_sum(x_ptr, q, s, o, K, k0, HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_SIZE: tl.constexpr):
    """[G, BLOCK_N]: per group g of the block, scale * (x_g . code_g) (+ offset * sum(x_g))."""
    G: tl.constexpr = BLOCK_K // GROUP_SIZE
    rk = k0 + tl.arange(0, BLOCK_K)
    xk = tl.reshape(tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32), (G, GROUP_SIZE))
    acc = s * tl.sum(q * xk[:, :, None], axis=1)
    if HAS_OFFSET:
        acc += o * tl.sum(xk, axis=1)[:, None]
    return acc


@triton.jit
def _quant_split_sum(x_ptr, codes_ptr, scale_ptr, offset_ptr, rn, N, K, k_start, k_per_split, BITS: tl.constexpr,
                     HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
                     GDC: tl.constexpr):
    """float32 [BLOCK_N]: one row of x times int4 or int8 weight columns rn over [k_start, k_start +
    k_per_split), without tl.dot: per group g of 32 values
        scale[g, n] * (x_g . code_g[:, n]) (+ offset[g, n] * sum(x_g))
    (the groups' terms kept apart and summed once at the end). The first block's weights are
    loaded before gdc_enter (GDC: while the kernel that writes x still runs), x after it. int8
    blocks are half as deep as int4's (BLOCK_K / 2 rows a step): the same bytes a step."""
    STEP: tl.constexpr = BLOCK_K if BITS == 4 else BLOCK_K // 2
    q, s, o = _quant_block(codes_ptr, scale_ptr, offset_ptr, rn, N, K, k_start, BITS, HAS_OFFSET, BLOCK_N, STEP,
                           GROUP_SIZE)
    gdc_enter(GDC)
    acc = _quant_block_sum(x_ptr, q, s, o, K, k_start, HAS_OFFSET, STEP, GROUP_SIZE)
    for k0 in range(k_start + STEP, k_start + k_per_split, STEP):
        q, s, o = _quant_block(codes_ptr, scale_ptr, offset_ptr, rn, N, K, k0, BITS, HAS_OFFSET, BLOCK_N, STEP,
                               GROUP_SIZE)
        acc += _quant_block_sum(x_ptr, q, s, o, K, k0, HAS_OFFSET, STEP, GROUP_SIZE)
    return tl.sum(acc, axis=0)


@triton.jit
def _quant_gemv_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, N, K,
                       k_per_split, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr, ATOMIC: tl.constexpr,
                       REDUCE: tl.constexpr, GDC: tl.constexpr):
    """One row of x against int4 or int8 weights in float32 (program_id 1: BLOCK_N columns, 2: the
    K split), plus a float32 bias where HAS_BIAS."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _quant_split_sum(x_ptr, codes_ptr, scale_ptr, offset_ptr, rn, N, K, tl.program_id(2) * k_per_split,
                           k_per_split, BITS, HAS_OFFSET, BLOCK_N, BLOCK_K, GROUP_SIZE, GDC)
    store_tile(acc[None, :], y_ptr, part_ptr, count_ptr, tl.arange(0, 1), rn, 1, N, N, ATOMIC, REDUCE, bias_ptr,
               HAS_BIAS)


@triton.jit
def _gemv_segment(x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, N, K, tile,
                  k_per_split, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr, REDUCE: tl.constexpr, GDC: tl.constexpr):
    """Tile `tile` of one weight of a gemv_many launch, its split program_id(2). The tile counter is
    the launch's program_id(1) (each weight's tiles have their own), the partial sums the weight's.
    BITS 4 (with offsets) or 8: group-quantized codes; 0: a row-major dense W [N, K]."""
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 1)
    k_start = tl.program_id(2) * k_per_split
    if BITS != 0:
        acc = _quant_split_sum(x_ptr, w_ptr, scale_ptr, offset_ptr, rn, N, K, k_start, k_per_split, BITS, BITS == 4,
                               BLOCK_N, BLOCK_K, GROUP_SIZE, GDC)[None, :]
    else:  # a row-major dense W [N, K]
        acc = _dense_rows(x_ptr, w_ptr, rm, rn, 1, N, K, K, K, k_start, k_per_split, 1, BLOCK_N, BLOCK_K, GDC)
    store_tile(acc, y_ptr, part_ptr, count_ptr, rm, rn, 1, N, N, False, REDUCE, bias_ptr, HAS_BIAS)


@triton.jit
def _gemv_many_kernel(x_ptr, count_ptr, K, k_per_split, T0, T1,
                      w0, s0, o0, b0, y0, p0, N0, w1, s1, o1, b1, y1, p1, N1, w2, s2, o2, b2, y2, p2, N2,
                      BITS_0: tl.constexpr, BITS_1: tl.constexpr, BITS_2: tl.constexpr, BIAS_0: tl.constexpr,
                      BIAS_1: tl.constexpr, BIAS_2: tl.constexpr, BN0: tl.constexpr, BN1: tl.constexpr,
                      BN2: tl.constexpr, G0: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr, BLOCK_K: tl.constexpr,
                      REDUCE: tl.constexpr, GDC: tl.constexpr):
    """Two or three GEMVs of one row in one launch: program_id(1) < T0 are weight 0's tiles, the
    next T1 weight 1's, the rest weight 2's (Gi: weight i's group size)."""
    t = tl.program_id(1)
    if t < T0:
        _gemv_segment(x_ptr, w0, s0, o0, b0, y0, p0, count_ptr, N0, K, t, k_per_split, BITS_0, BIAS_0, BN0, BLOCK_K,
                      G0, REDUCE, GDC)
    elif t < T0 + T1:
        _gemv_segment(x_ptr, w1, s1, o1, b1, y1, p1, count_ptr, N1, K, t - T0, k_per_split, BITS_1, BIAS_1, BN1,
                      BLOCK_K, G1, REDUCE, GDC)
    else:
        _gemv_segment(x_ptr, w2, s2, o2, b2, y2, p2, count_ptr, N2, K, t - T0 - T1, k_per_split, BITS_2, BIAS_2, BN2,
                      BLOCK_K, G2, REDUCE, GDC)


@triton.jit
def store_tile(acc, y_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_ym, ATOMIC: tl.constexpr,
               REDUCE: tl.constexpr, bias_ptr, HAS_BIAS: tl.constexpr):
    """A program's float32 tile of y [M, N] as its SplitPlan says: added in the launch by the last
    split (REDUCE), added atomically into a float32 y (ATOMIC: the caller's y starts as the bias),
    or rounded and stored; the float32 bias [N] added before the one rounding where HAS_BIAS."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if REDUCE:
        split_reduce(acc, part_ptr, count_ptr, out, rm, rn, mask, M, N, y_ptr.dtype.element_ty, bias_ptr, HAS_BIAS)
    elif ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out, round_to(acc, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_reduce(acc, part_ptr, count_ptr, out, rm, rn, mask, M, N, OUT_DTYPE: tl.constexpr, bias_ptr,
                 HAS_BIAS: tl.constexpr):
    """This split's partial tile to part_ptr [splits, M, N]; the tile's last program to arrive adds
    all of them in split order (then the float32 bias [N] where HAS_BIAS), writes `out` and sets
    the tile's counter back to 0. Returns whether this program was that one."""
    parts = part_ptr + rm[:, None] * N + rn[None, :]
    tl.store(parts + tl.program_id(2) * M * N, acc, mask=mask)
    tl.debug_barrier()  # every thread's stores issued before the (release) arrival below
    counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    splits = tl.num_programs(2)
    last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
    if last:
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(parts + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out, round_to(total, OUT_DTYPE).to(OUT_DTYPE), mask=mask)
        tl.atomic_xchg(counter, 0)
    return last


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                       stride_ym, k_per_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, REDUCE: tl.constexpr, GDC: tl.constexpr):
    """y[:M, rows] = x W[rows]ᵀ (+ bias) for this program's BLOCK_N weight rows over its K split,
    in float32 (program_id 1: the rows, 2: the split; split_reduce adds the splits)."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = _dense_rows(x_ptr, w_ptr, rm, rn, M, N, K, stride_xm, stride_wn, tl.program_id(2) * k_per_split,
                      k_per_split, BLOCK_M, BLOCK_N, BLOCK_K, GDC)
    store_tile(acc, y_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_ym, ATOMIC, REDUCE, bias_ptr, HAS_BIAS)


@triton.jit
def _dense_rows(x_ptr, w_ptr, rm, rn, M, N, K, stride_xm, stride_wn, k_start, k_per_split, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: rows rm of x times weight rows rn over [k_start, k_start +
    k_per_split). The first block of weights is loaded before gdc_enter, x after it (as
    _quant_split_sum)."""
    w = _dense_block(w_ptr, rn, N, K, stride_wn, k_start, BLOCK_K)
    gdc_enter(GDC)
    acc = tl.sum(_dense_block(x_ptr, rm, M, K, stride_xm, k_start, BLOCK_K)[:, None, :] * w[None, :, :], axis=2)
    for k0 in range(k_start + BLOCK_K, k_start + k_per_split, BLOCK_K):
        a = _dense_block(x_ptr, rm, M, K, stride_xm, k0, BLOCK_K)
        w = _dense_block(w_ptr, rn, N, K, stride_wn, k0, BLOCK_K)
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _dense_block(ptr, rows, R, K, stride, k0, BLOCK_K: tl.constexpr):
    """float32 [len(rows), BLOCK_K]: columns [k0, k0 + BLOCK_K) of row-major rows `rows` (of R;
    past R or K: 0), of x or of a dense weight."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None] * stride + rk[None, :], mask=(rows < R)[:, None] & (rk < K)[None, :],
                   other=0.0).to(tl.float32)


def gemv_plan(x: torch.Tensor, N: int, out_dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SplitPlan) of dense_gemv over x [M, K]. Rows a program shrink
    until every SM has two programs (more in flight hides more memory latency); K a step fills
    ~4096 products a program (32 floats a thread of 4 warps); where the rows alone leave SMs idle
    (a router's 64-256 experts), common.plan_split_k splits K too, the splits added in the launch."""
    M, K = x.shape
    block_m, block_n = triton.next_power_of_2(max(M, 1)), 32
    while block_n > 8 and triton.cdiv(N, block_n) < 2 * sm_count(x.device):
        block_n //= 2
    block_k = max(16, min(512, 4096 // (block_m * block_n), triton.next_power_of_2(K)))
    return block_m, block_n, block_k, plan_split_k(x, N, K, block_m, block_n, block_k, out_dtype, per_sm=4,
                                                   min_blocks=1)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [N, K]ᵀ (+ bias, float32 [N]) (any float dtypes, float32 sums) for
    M <= GEMV_ROWS, in one launch, the result rounded once to out_dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.stride(1) != 1:
        raise ValueError(f"dense_gemv: x [M, K] and a row-major w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if M > GEMV_ROWS:
        raise ValueError(f"dense_gemv: at most {GEMV_ROWS} rows, got {M}")
    if w.device != x.device:
        raise ValueError(f"dense_gemv: weight on {w.device}, x on {x.device}")
    check_bias("dense_gemv", bias, N, x.device)
    x = x.contiguous()
    if N == 0 or K == 0 or M == 0:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)
        return (y if bias is None else y + bias).to(out_dtype)
    block_m, block_n, block_k, plan = gemv_plan(x, N, out_dtype)
    y = plan.y
    bias_ptr, has_bias = _epilogue_bias(plan, bias, y)
    _dense_gemv_kernel[plan.grid](x, w, bias_ptr, y, *plan.scratch(), M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                  plan.k_per_split, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n,
                                  BLOCK_K=block_k, ATOMIC=plan.atomic, REDUCE=plan.reduce, num_warps=4, **pdl(x.device))
    return y.to(out_dtype) if plan.atomic else y


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, offset_ptr, out_ptr, N, K,
                    BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, GROUP_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [K, N] bf16 = Wᵀ, one (BLOCK_K x BLOCK_N) tile per program."""
    k0 = tl.program_id(0) * BLOCK_K
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = load_group_weights(codes_ptr, scale_ptr, offset_ptr, k0, K, rn, N, N, BITS, HAS_OFFSET, BLOCK_K, BLOCK_N,
                           GROUP_SIZE)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rk[:, None] * N + rn[None, :], w.to(tl.bfloat16), mask=(rk < K)[:, None] & (rn < N)[None, :])


def dequantize_t(w: GroupQuantWeight) -> torch.Tensor:
    """Wᵀ [K, N] in bf16 on the weight's device (for the many-row path: one pass, then cuBLAS)."""
    K, N = w.in_features, w.out_features
    out = torch.empty(K, N, device=w.codes.device, dtype=torch.bfloat16)
    BLOCK_K = 64 if K % 64 == 0 else 32
    offset = w.offset if w.offset is not None else w.scale
    _dequant_kernel[(K // BLOCK_K, triton.cdiv(N, 128))](w.codes, w.scale, offset, out, N, K, BITS=w.bits,
                                                         HAS_OFFSET=w.offset is not None, GROUP_SIZE=w.group,
                                                         BLOCK_N=128, BLOCK_K=BLOCK_K)
    return out


def group_gemm(x: torch.Tensor, w: GroupQuantWeight, out_dtype: torch.dtype | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias, float32 [N]) for a GroupQuantWeight on x's device, the
    float32 sum rounded once to out_dtype (the bias added in the launch, below DENSE_ROWS rows)."""
    K, N = w.in_features, w.out_features
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"group_gemm: x must be [M, {K}], got {tuple(x.shape)}")
    if w.codes.device != x.device:
        raise ValueError(f"group_gemm: weight on {w.codes.device}, x on {x.device}")
    x = x.contiguous()
    M = x.shape[0]
    out_dtype = out_dtype or x.dtype
    check_bias("group_gemm", bias, N, x.device)
    if M > DENSE_ROWS and x.device.type == "cuda":
        y = x.to(torch.bfloat16) @ dequantize_t(w)
        return (y if bias is None else y.float() + bias).to(out_dtype)
    if M == 1 and (w.bits == 8 or w.offset is not None):
        return _quant_gemv(x, w, out_dtype, bias)
    offset = w.offset if w.offset is not None else w.scale
    BLOCK_K = _block_k(K, 128)
    if M <= 16:
        BLOCK_M, BLOCK_N = 16, 64
    elif M <= 64:
        BLOCK_M, BLOCK_N = 64, 64
    else:
        BLOCK_M, BLOCK_N = 128, 64
    plan = plan_split_k(x, N, K, BLOCK_M, BLOCK_N, BLOCK_K, out_dtype)
    y = plan.y
    bias_ptr, has_bias = _epilogue_bias(plan, bias, w.scale)
    _group_gemm_kernel[plan.grid](x, w.codes, w.scale, offset, bias_ptr, y,
                                  *plan.scratch(), M, N, K, x.stride(0), y.stride(0), plan.k_per_split, BITS=w.bits,
                                  HAS_OFFSET=w.offset is not None, HAS_BIAS=has_bias,
                                  GROUP_SIZE=w.group,
                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ATOMIC=plan.atomic,
                                  REDUCE=plan.reduce, DOT_F32=dot_f32(), num_warps=4,
                                  num_stages=3 if x.device.type == "cuda" else 1)
    return y.to(out_dtype) if plan.atomic else y


def _quant_gemv(x: torch.Tensor, w: GroupQuantWeight, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """group_gemm of one row (_quant_gemv_kernel, the bias in its epilogue). K is split until there
    are ~4 programs an SM, down to one block a split: for one row this is quicker than the tl.dot
    GEMM's 16-row tiles at attention-projection shapes."""
    K, N = w.in_features, w.out_features
    BLOCK_N, BLOCK_K, warps = _gemv_blocks(w.bits, N, K)
    plan = plan_split_k(x, N, K, 1, BLOCK_N, BLOCK_K, out_dtype, per_sm=4, min_blocks=1)
    bias_ptr, has_bias = _epilogue_bias(plan, bias, w.scale)
    offset = w.offset if w.offset is not None else w.scale  # (unread without HAS_OFFSET)
    _quant_gemv_kernel[plan.grid](x, w.codes, w.scale, offset, bias_ptr, plan.y,
                                  *plan.scratch(), N, K, plan.k_per_split, BITS=w.bits,
                                  HAS_OFFSET=w.offset is not None, HAS_BIAS=has_bias,
                                  BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_SIZE=w.group, ATOMIC=plan.atomic,
                                  REDUCE=plan.reduce, num_warps=warps, **pdl(x.device))
    return plan.y.to(out_dtype) if plan.atomic else plan.y


def _gemv_blocks(bits: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a one-row GEMV, as graph-timed on an H100
    (dev/int8_gemv.py): int8 in 128 columns (a warp's words span 512 contiguous bytes) and K blocks
    of 256 (read as two steps of 128; the last block masked past K) on 4 warps; int4 in K blocks of
    up to 256 that divide K, in 64 columns on 2 warps, or from GEMV_WIDE weights (GLM's q and o,
    an lm_head) in 128 columns on 4 warps (their programs then keep more loads in flight)."""
    if bits == 8:
        return 128, 256, 4
    return (128, _block_k(K, 256), 4) if N * K >= GEMV_WIDE else (64, _block_k(K, 256), 2)


def _block_k(K: int, largest: int) -> int:
    """The widest K block, `largest` down to 32 (a group), that divides K (else 32)."""
    block = largest
    while block > GROUP and K % block:
        block //= 2
    return block


class _Operand(NamedTuple):
    """One weight of a gemv_many launch as its kernel arguments (a dense weight stands in for its
    own absent scale and offset)."""
    bits: int  # 4 or 8: GroupQuantWeight codes; 0: dense
    block_n: int
    weight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    n: int
    group: int


def _many_operand(w, x: torch.Tensor) -> _Operand | None:
    """One gemv_many weight, or None where the launch does not take it (int4 codes without an
    offset, another K or device, a non-row-major dense weight or one cuBLAS streams faster, offsets
    past int32)."""
    K = x.shape[1]
    if isinstance(w, GroupQuantWeight):
        if ((w.bits == 4 and w.offset is None) or w.in_features != K or w.codes.device != x.device
                or w.codes.numel() >= 2**31):
            return None
        return _Operand(w.bits, _gemv_blocks(w.bits, w.out_features, K)[0], w.codes, w.scale,
                        w.offset if w.offset is not None else w.scale, w.out_features, w.group)
    if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == K and w.is_contiguous()
            and w.device == x.device and w.dtype.is_floating_point and w.numel() <= DENSE_GEMV_WEIGHTS):
        return _Operand(0, 32, w, w, w, w.shape[0], GROUP)
    return None


def gemv_many(x: torch.Tensor, weights: list, out_dtype: torch.dtype,
              biases: list | None = None) -> list[torch.Tensor] | None:
    """[x Wᵢᵀ (+ bᵢ) for each weight] in one launch, for one row x [1, K] and two or three weights
    (int8 GroupQuantWeights, int4 ones with offsets, or dense row-major [N, K] tensors of up to
    DENSE_GEMV_WEIGHTS values: a layer's q, k and v projections) and their float32 biases [N] or
    None, float32 sums each rounded once to out_dtype (the values of the one-weight GEMVs up to
    float32 summation order: the blocks and splits are the launch's own); None where the launch
    does not apply (the caller runs the projections one by one). Launched alone, k and v cost
    nearly what q does (latency, not bytes): together they add little to q's time."""
    if x.dim() != 2 or x.shape[0] != 1 or not 2 <= len(weights) <= 3:
        return None
    biases = list(biases) if biases is not None else [None] * len(weights)
    ops = [_many_operand(w, x) for w in weights]
    if None in ops or len(biases) != len(ops) or any(
            b is not None and (b.shape != (op.n,) or b.dtype != torch.float32 or b.device != x.device)
            for b, op in zip(biases, ops)):
        return None
    x = x.contiguous()
    K = x.shape[1]
    tiles = [triton.cdiv(op.n, op.block_n) for op in ops]
    if sum(tiles) > MAX_SPLIT_TILES or K == 0 or 0 in tiles:
        return None
    # the K block and warps of the widest weight's own GEMV, and int8's where the launch has int8
    int8 = any(op.bits == 8 for op in ops)
    _, BLOCK_K, warps = _gemv_blocks(8 if int8 else 4, max(op.n for op in ops), K)
    # the K split of the widest weight alone (as _quant_gemv would choose it), shared by all
    widest = max(range(len(ops)), key=lambda i: tiles[i])
    grid, k_per_split = split_grid(x, ops[widest].n, K, 1, ops[widest].block_n, BLOCK_K, per_sm=4, min_blocks=1)
    splits = grid[2]
    counters = split_counters(x.device) if splits > 1 else x  # (x: never read without a split)
    if counters is None:
        return None
    ys = [torch.empty(1, op.n, device=x.device, dtype=out_dtype) for op in ops]
    parts = [torch.empty(splits, 1, op.n, device=x.device, dtype=torch.float32) if splits > 1 else y
             for op, y in zip(ops, ys)]
    segs = list(zip(ops, biases, ys, parts))
    if len(segs) == 2:
        segs.append(segs[1])  # a placeholder third weight: the grid holds two weights' tiles, never reaching it
    args = []
    for op, bias, y, part in segs:
        args += [op.weight, op.scale, op.offset, bias if bias is not None else op.scale, y, part, op.n]
    (o0, b0, _, _), (o1, b1, _, _), (o2, b2, _, _) = segs
    _gemv_many_kernel[(1, sum(tiles), splits)](x, counters, K, k_per_split, tiles[0], tiles[1], *args,
                                               BITS_0=o0.bits, BITS_1=o1.bits, BITS_2=o2.bits,
                                               BIAS_0=b0 is not None, BIAS_1=b1 is not None, BIAS_2=b2 is not None,
                                               BN0=o0.block_n, BN1=o1.block_n, BN2=o2.block_n,
                                               G0=o0.group, G1=o1.group, G2=o2.group,
                                               BLOCK_K=BLOCK_K, REDUCE=splits > 1, num_warps=warps,
                                               **pdl(x.device))
    return ys


def group_gemm_reference(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    return (x.float() @ w.dequantize().T).to(x.dtype)
