"""ggml tensor types: block layouts, torch dequantizers and simple quantizers, all described once
in the FORMATS table (used to read GGUF weights and to make synthetic quantized ones)."""
from __future__ import annotations

import enum
import math
import operator
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# Shape legend
#   N     number of blocks
#   E     elements per block (QuantFormat.block_elems)
#   B     bytes per block    (QuantFormat.block_bytes)
#   S     sub-blocks per block (k-quants), each with its own small integer scale
#   QK_K  256, the elements of one k-quant super-block
# raw bytes -> blocks uint8 [N, B] -> dequant -> float32 [N, E] -> reshape to the row-major shape.
# Multi-byte fields are little-endian; "f16" is an IEEE half scale; q are the integer codes.

QK_K = 256


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


Blocks = torch.Tensor  # uint8 [N, B]


@dataclass(frozen=True)
class QuantFormat:
    type: GGMLType
    block_elems: int
    block_bytes: int
    dequant: Callable[[Blocks], torch.Tensor] | None  # uint8 [N, B] -> float32 [N, E]
    quantize: Callable[[torch.Tensor], Blocks] | None = None  # float32 [N, E] -> uint8 [N, B]
    f16_fields: tuple[int, ...] = ()  # byte offsets of the f16 scales (for random_blocks)
    e8m0_fields: tuple[int, ...] = ()  # byte offsets of the power-of-two exponents (likewise)


# MXFP4's e2m1 code book, doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives): x = 2^(e-128) * MXFP4_VALUES[q]
MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)

# Non-linear 4-bit code book of IQ4_NL / IQ4_XS: x = scale * IQ4_VALUES[q].
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=torch.float32)
_IQ4_MIDPOINTS = (IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2


# --- bit fields -------------------------------------------------------------------------------
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).view(-1, 1)


def _unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., m] -> codes [..., 8/bits * m]: every byte's bits 0.. first, then the next field up."""
    return ((q.unsqueeze(-2) >> _shifts(bits, q.device)) & ((1 << bits) - 1)).flatten(-2)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of _unpack: non-negative codes [..., 8/bits * m] -> uint8 [..., m]."""
    planes = q.to(torch.uint8).unflatten(-1, (8 // bits, -1)) << _shifts(bits, q.device)
    return planes.sum(-2, dtype=torch.uint8)  # the fields are disjoint, so sum == bitwise or


def _f16(b: Blocks, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of every block, as float32 [N, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _f16_bytes(x: torch.Tensor) -> Blocks:
    """float [N, 1] -> its f16 encoding, uint8 [N, 2]."""
    return x.reshape(-1, 1).to(torch.float16).view(torch.uint8)


def _k_scales(s: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte field -> 8 six-bit (scale, min) pairs [N, 8] each. Bytes 0-3: scale 0-3 in
    bits 0-5; bytes 4-7: min 0-3 likewise; the top 2 bits of bytes 0-7 are bits 4-5 of scale/min
    4-7, whose low 4 bits are the nibbles of bytes 8-11 (scale low, min high)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc, mn


def _k_scales_bytes(sc: torch.Tensor, mn: torch.Tensor) -> Blocks:
    """Inverse of _k_scales."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    return torch.cat([lo, mid, (sc[:, 4:] & 15) | (mn[:, 4:] << 4)], -1)


# --- dequantizers: uint8 [N, B] -> float32 [N, E] ---------------------------------------------
def _float_view(dtype):
    """(dequant, quantize) of a plain float type, whose bytes are the values."""
    return (lambda b: b.view(dtype).to(torch.float32, copy=True),  # copy: raw may be a read-only mmap
            lambda x: x.to(dtype, copy=True).view(torch.uint8))  # copy: never alias the input


def _q5_codes(b, at):
    """Q5_0/Q5_1 codes [N, 32]: qh (u32, bit j = bit 4 of code j) at `at`, then qs nibbles."""
    high = _unpack(b[:, at:at + 4].unsqueeze(-1), 1).flatten(-2)
    return _unpack(b[:, at + 4:], 4) | (high << 4)


def _dq_q4_0(b):
    return _f16(b, 0) * (_unpack(b[:, 2:], 4).float() - 8)


def _dq_q4_1(b):
    return _f16(b, 0) * _unpack(b[:, 4:], 4).float() + _f16(b, 2)


def _dq_q5_0(b):
    return _f16(b, 0) * (_q5_codes(b, 2).float() - 16)


def _dq_q5_1(b):
    return _f16(b, 0) * _q5_codes(b, 4).float() + _f16(b, 2)


def _dq_q8_0(b):
    return _f16(b, 0) * b[:, 2:].view(torch.int8).float()


def _dq_q2_k(b):
    n, sc = len(b), b[:, :16]
    scale = (_f16(b, 80) * (sc & 15).float()).unsqueeze(-1)
    low = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _unpack(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (scale * q - low).reshape(n, QK_K)


def _dq_q3_k(b):
    n, s = len(b), b[:, 96:108]
    sc = (_unpack(s[:, :8], 4) | (_unpack(s[:, 8:], 2) << 4)).float() - 32
    low = _unpack(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    high = _unpack(b[:, :32], 1).reshape(n, 16, 16).float()
    scale = (_f16(b, 108) * sc).unsqueeze(-1)
    return (scale * (low + 4 * high - 4)).reshape(n, QK_K)


def _k_affine(b, q):
    """Q4_K/Q5_K: d*sc*q - dmin*min over 8 sub-blocks; q is [N, 8, 32]."""
    sc, mn = _k_scales(b[:, 4:16])
    scale = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    low = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    return (scale * q.float() - low).flatten(1)


def _dq_q4_k(b):
    return _k_affine(b, _unpack(b[:, 16:].reshape(len(b), 4, 32), 4).reshape(len(b), 8, 32))


def _dq_q5_k(b):
    n = len(b)
    low = _unpack(b[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    high = _unpack(b[:, 16:48], 1).reshape(n, 8, 32)
    return _k_affine(b, low | (high << 4))


def _q6_k_parts(b):
    """Q6_K blocks -> (q - 32, int8 [N, QK_K] in -32..31; sub-block scales d*sc, float32 [N, 16])."""
    n = len(b)
    low = _unpack(b[:, :128].reshape(n, 2, 64), 4)
    high = _unpack(b[:, 128:192].reshape(n, 2, 32), 2)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, QK_K)
    return q, _f16(b, 208) * b[:, 192:208].view(torch.int8).float()


def _dq_q6_k(b):
    q, scale = _q6_k_parts(b)
    return (scale.unsqueeze(-1) * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


def _dq_iq4_nl(b):
    return _f16(b, 0) * IQ4_VALUES.to(b.device)[_unpack(b[:, 2:], 4).long()]


def _dq_iq4_xs(b):
    n = len(b)
    low = _unpack(b[:, 4:8].unsqueeze(-1), 4).flatten(1)  # per byte: sub-block 2k, then 2k+1
    high = _unpack(b[:, 2:4].unsqueeze(-1), 2).flatten(1)  # sub-block i at bits 2i..2i+1
    sc = low | (high << 4)
    scale = (_f16(b, 0) * (sc.float() - 32)).unsqueeze(-1)
    q = IQ4_VALUES.to(b.device)[_unpack(b[:, 8:].reshape(n, 8, 16), 4).long()]
    return (scale * q).reshape(n, QK_K)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's shared exponent byte as the float32 factor 2^(e-128) (half the OCP E8M0 scale,
    which the doubled code book makes whole; e = 0 and 1 are float32 subnormals, exact)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 128)


def _dq_mxfp4(b):
    return e8m0_half(b[:, :1]) * MXFP4_VALUES.to(b.device)[_unpack(b[:, 1:], 4).long()]


# --- quantizers: float32 [N, E] -> uint8 [N, B] -----------------------------------------------
def _h(x):
    """Round to the f16 the file will store, so codes are computed against the stored scale."""
    return x.to(torch.float16).float()


def _inv(d):
    return torch.where(d == 0, 0.0, 1.0 / d)  # all-zero blocks get scale 0 and codes for 0


def _div_round(x, d):
    return torch.round(x * _inv(d))


def _signed_scale(x, n):
    """Per-row scale s with round(x/s) in [-n, n]: the largest-|x| entry maps to exactly -n."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -n


def _fit_affine(x, top, shrink=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)):
    """Rows x [..., k] ~ scale*q - low, q in 0..top, scale, low >= 0: the [min(x, 0), max(x)]
    range shrunk towards its middle by the factor with the least squared error."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True)
    f = torch.tensor(shrink, device=x.device).view(-1, *[1] * x.dim())
    mid, half = (lo + hi) / 2, (hi - lo) / 2 * f  # candidates [C, ..., 1]
    lo_c = (mid - half).clamp(max=0)
    scale = (mid + half - lo_c) / top
    err = ((_div_round(x - lo_c, scale).clamp(0, top) * scale + lo_c - x) ** 2).sum(-1, keepdim=True)
    best = err.argmin(0, keepdim=True)
    return scale.gather(0, best)[0], -lo_c.gather(0, best)[0]


def _legacy_quantizer(bits, affine):
    """Quantizer of Q4_0/Q5_0 (x = d*(q - 2^(bits-1))) or, if affine, Q4_1/Q5_1 (x = d*q + m)."""
    top = (1 << bits) - 1

    def quantize_blocks(x):
        if affine:
            m = _h(x.amin(-1, keepdim=True))
            d = _h((x.amax(-1, keepdim=True) - m) / top)
            scales, q = [d, m], _div_round(x - m, d).clamp(0, top)
        else:
            d = _h(_signed_scale(x, 1 << (bits - 1)))
            scales, q = [d], (_div_round(x, d) + (1 << (bits - 1))).clamp(0, top)
        q = q.to(torch.uint8)
        parts = [_f16_bytes(s) for s in scales]
        if bits == 5:  # qh: bit 4 of each code, before the low nibbles
            parts.append(_pack((q >> 4).unflatten(-1, (4, 8)), 1).flatten(1))
        return torch.cat([*parts, _pack(q & 15, 4)], -1)

    return quantize_blocks


def _q_q8_0(x):
    d = _h(x.abs().amax(-1, keepdim=True) / 127)
    q = _div_round(x, d).clamp(-128, 127).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], -1)


def _affine_superblock(x, sub, top, scale_bits):
    """Q2_K/Q4_K/Q5_K: x [N, QK_K] ~ d*sc*q - dmin*mn per sub-block -> d, dmin [N, 1], sc, mn [N, S],
    codes q [N, QK_K] (uint8, 0..top)."""
    xs = x.reshape(len(x), -1, sub)
    scale, low = (t.squeeze(-1) for t in _fit_affine(xs, top))
    smax = (1 << scale_bits) - 1
    d, dmin = _h(scale.amax(-1, keepdim=True) / smax), _h(low.amax(-1, keepdim=True) / smax)
    sc, mn = _div_round(scale, d).clamp(0, smax), _div_round(low, dmin).clamp(0, smax)
    q = _div_round(xs + (dmin * mn).unsqueeze(-1), (d * sc).unsqueeze(-1)).clamp(0, top)
    return d, dmin, sc, mn, q.flatten(1).to(torch.uint8)


def _signed_superblock(x, sub, n_q, n_sc):
    """Q3_K/Q6_K/IQ4_XS: x [N, QK_K] ~ d*sc*q per sub-block, sc in [-n_sc, n_sc), q in [-n_q, n_q]
    -> d [N, 1], sc [N, S], per-element scale d*sc [N, S, 1], sub-blocks [N, S, sub]."""
    xs = x.reshape(len(x), -1, sub)
    sub_scale = _signed_scale(xs, n_q).squeeze(-1)
    d = _h(_signed_scale(sub_scale, n_sc))
    sc = _div_round(sub_scale, d).clamp(-n_sc, n_sc - 1)
    return d, sc, (d * sc).unsqueeze(-1), xs


def _q_q2_k(x):
    d, dmin, sc, mn, q = _affine_superblock(x, 16, 3, 4)
    scales = sc.to(torch.uint8) | (mn.to(torch.uint8) << 4)
    qs = _pack(q.reshape(len(x), 2, 128), 2).flatten(1)
    return torch.cat([scales, qs, _f16_bytes(d), _f16_bytes(dmin)], -1)


def _q_q3_k(x):
    d, sc, scale, xs = _signed_superblock(x, 16, 4, 32)
    q = (_div_round(xs, scale).clamp(-4, 3) + 4).flatten(1).to(torch.uint8)
    sc = (sc + 32).to(torch.uint8)
    qs = _pack((q & 3).reshape(len(x), 2, 128), 2).flatten(1)
    return torch.cat([_pack(q >> 2, 1), qs, _pack(sc & 15, 4), _pack(sc >> 4, 2), _f16_bytes(d)], -1)


def _q_q4_k(x):
    d, dmin, sc, mn, q = _affine_superblock(x, 32, 15, 6)
    qs = _pack(q.reshape(len(x), 4, 64), 4).flatten(1)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _k_scales_bytes(sc, mn), qs], -1)


def _q_q5_k(x):
    d, dmin, sc, mn, q = _affine_superblock(x, 32, 31, 6)
    qs = _pack((q & 15).reshape(len(x), 4, 64), 4).flatten(1)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _k_scales_bytes(sc, mn), _pack(q >> 4, 1), qs], -1)


def _q_q6_k(x):
    d, sc, scale, xs = _signed_superblock(x, 16, 32, 128)
    q = (_div_round(xs, scale).clamp(-32, 31) + 32).to(torch.uint8).reshape(len(x), 2, 128)
    ql, qh = _pack(q & 15, 4).flatten(1), _pack(q >> 4, 2).flatten(1)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], -1)


def _iq4_codes(v):
    """Index of the nearest IQ4_VALUES entry, as uint8."""
    return torch.bucketize(v, _IQ4_MIDPOINTS.to(v.device)).to(torch.uint8)


def _q_iq4_nl(x):
    d = _h(_signed_scale(x, 127))
    return torch.cat([_f16_bytes(d), _pack(_iq4_codes(x * _inv(d)), 4)], -1)


def _q_iq4_xs(x):
    d, sc, scale, xs = _signed_superblock(x, 32, 127, 32)
    q = _iq4_codes(xs * _inv(scale))
    sc = (sc + 32).to(torch.uint8)
    scales_h = _pack((sc >> 4).reshape(len(x), 2, 4), 2).flatten(1)
    scales_l = _pack((sc & 15).reshape(len(x), 4, 2), 4).flatten(1)
    return torch.cat([_f16_bytes(d), scales_h, scales_l, _pack(q, 4).flatten(1)], -1)


def _q_mxfp4(x):
    """ggml's rule: e = floor(log2(max |x|)) - 2 + 127 (0 for an all-zero block), then each
    element's nearest code (the first of equals, so 0 is code 0)."""
    amax = x.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) + 125, 0).clamp(0, 255).to(torch.uint8)
    err = (e8m0_half(e).unsqueeze(-1) * MXFP4_VALUES.to(x.device) - x.unsqueeze(-1)).abs()
    return torch.cat([e, _pack(err.argmin(-1).to(torch.uint8), 4)], -1)


# --- the table --------------------------------------------------------------------------------
T = GGMLType
FORMATS: dict[GGMLType, QuantFormat] = {f.type: f for f in [
    # plain scalars, one element per "block"
    QuantFormat(T.F32, 1, 4, *_float_view(torch.float32)),
    QuantFormat(T.F16, 1, 2, *_float_view(torch.float16)),
    QuantFormat(T.BF16, 1, 2, *_float_view(torch.bfloat16)),
    QuantFormat(T.F64, 1, 8, None),
    QuantFormat(T.I8, 1, 1, None),
    QuantFormat(T.I16, 1, 2, None),
    QuantFormat(T.I32, 1, 4, None),
    QuantFormat(T.I64, 1, 8, None),
    # 32-element blocks. qs[16] holds 4-bit codes: element j in the low nibble of byte j, j+16 high.
    # Q4_0: d f16 | qs[16]                        x = d*(q - 8)
    QuantFormat(T.Q4_0, 32, 2 + 16, _dq_q4_0, _legacy_quantizer(4, affine=False), (0,)),
    # Q4_1: d f16 | m f16 | qs[16]                x = d*q + m
    QuantFormat(T.Q4_1, 32, 2 + 2 + 16, _dq_q4_1, _legacy_quantizer(4, affine=True), (0, 2)),
    # Q5_0: d f16 | qh u32 (bit j = bit 4 of code j) | qs[16]   x = d*(q - 16)
    QuantFormat(T.Q5_0, 32, 2 + 4 + 16, _dq_q5_0, _legacy_quantizer(5, affine=False), (0,)),
    # Q5_1: d f16 | m f16 | qh u32 | qs[16]      x = d*q + m
    QuantFormat(T.Q5_1, 32, 2 + 2 + 4 + 16, _dq_q5_1, _legacy_quantizer(5, affine=True), (0, 2)),
    # Q8_0: d f16 | qs int8[32]                   x = d*q
    QuantFormat(T.Q8_0, 32, 2 + 32, _dq_q8_0, _q_q8_0, (0,)),
    # Q8_1: d f16 | s f16 (= d*sum q) | qs int8[32]   (ggml's activation type; 36 bytes in ggml)
    QuantFormat(T.Q8_1, 32, 2 + 2 + 32, None),
    # IQ4_NL: d f16 | qs[16] as Q4_0             x = d*IQ4_VALUES[q]
    QuantFormat(T.IQ4_NL, 32, 2 + 16, _dq_iq4_nl, _q_iq4_nl, (0,)),
    # MXFP4: e u8 (shared exponent) | qs[16] as Q4_0   x = 2^(e-128)*MXFP4_VALUES[q]  (gpt-oss's experts)
    QuantFormat(T.MXFP4, 32, 1 + 16, _dq_mxfp4, _q_mxfp4, e8m0_fields=(0,)),
    # k-quants: 256-element super-blocks of S sub-blocks. A "2-bit plane" field packs 128 elements
    # in 32 bytes: element 32*i + j at bits 2i..2i+1 of byte j (same idea for 1- and 4-bit planes).
    # Q2_K: scales[16] (sub-block scale low nibble, min high) | qs[64] two 2-bit planes | d f16 |
    #       dmin f16;  16 x 16,  x = d*sc*q - dmin*min
    QuantFormat(T.Q2_K, QK_K, 16 + 64 + 2 + 2, _dq_q2_k, _q_q2_k, (80, 82)),
    # Q3_K: hmask[32] (1-bit plane, bit 2 of q) | qs[64] (2-bit planes, bits 0-1) | scales[12]
    #       (16 six-bit: low nibbles in bytes 0-7, high 2 bits in bytes 8-11) | d f16;
    #       16 x 16,  x = d*(sc - 32)*(q - 4)
    QuantFormat(T.Q3_K, QK_K, 32 + 64 + 12 + 2, _dq_q3_k, _q_q3_k, (108,)),
    # Q4_K: d f16 | dmin f16 | scales[12] (8 six-bit scale/min pairs, see _k_scales) | qs[128]
    #       (4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c+1 high);
    #       8 x 32,  x = d*sc*q - dmin*min
    QuantFormat(T.Q4_K, QK_K, 2 + 2 + 12 + 128, _dq_q4_k, _q_q4_k, (0, 2)),
    # Q5_K: as Q4_K with qh[32] (1-bit plane: bit 4 of q) before qs[128]
    QuantFormat(T.Q5_K, QK_K, 2 + 2 + 12 + 32 + 128, _dq_q5_k, _q_q5_k, (0, 2)),
    # Q6_K: ql[128] (per half: 64 bytes, nibbles) | qh[64] (per half: a 2-bit plane, bits 4-5) |
    #       scales int8[16] | d f16;  16 x 16,  x = d*sc*(q - 32)
    QuantFormat(T.Q6_K, QK_K, 128 + 64 + 16 + 2, _dq_q6_k, _q_q6_k, (208,)),
    # Q8_K: d f32 | qs int8[256] | bsums int16[16]   (ggml's activation type)
    QuantFormat(T.Q8_K, QK_K, 4 + 256 + 32, None),
    # IQ4_XS: d f16 | scales_h u16 (2 bits per sub-block) | scales_l[4] (nibbles) | qs[128]
    #       (8 x 16 bytes laid out as Q4_0's qs);  8 x 32,  x = d*(sc - 32)*IQ4_VALUES[q]
    QuantFormat(T.IQ4_XS, QK_K, 2 + 2 + 4 + 128, _dq_iq4_xs, _q_iq4_xs, (0,)),
    # grid-based i-quants and ternary types: sizes only
    QuantFormat(T.IQ2_XXS, QK_K, 2 + 64, None),
    QuantFormat(T.IQ2_XS, QK_K, 2 + 64 + 8, None),
    QuantFormat(T.IQ2_S, QK_K, 2 + 64 + 16, None),
    QuantFormat(T.IQ3_XXS, QK_K, 2 + 64 + 32, None),
    QuantFormat(T.IQ3_S, QK_K, 2 + 64 + 32 + 8 + 4, None),
    QuantFormat(T.IQ1_S, QK_K, 2 + 32 + 16, None),
    QuantFormat(T.IQ1_M, QK_K, 32 + 16 + 8, None),
    QuantFormat(T.TQ1_0, QK_K, 48 + 4 + 2, None),
    QuantFormat(T.TQ2_0, QK_K, 64 + 2, None),
]}
del T


# --- public API -------------------------------------------------------------------------------
def ggml_type(x) -> GGMLType:
    """GGMLType from a GGMLType, an integer id or a name such as 'q4_k'."""
    try:
        return GGMLType[x.upper()] if isinstance(x, str) else GGMLType(operator.index(x))
    except (KeyError, ValueError, TypeError):
        names = ", ".join(f"{t.name}={t.value}" for t in GGMLType)
        raise ValueError(f"unknown ggml type {x!r}; valid types: {names}") from None


def _supported(kind: str) -> str:
    return ", ".join(t.name for t, f in FORMATS.items() if getattr(f, kind) is not None)


def tensor_nbytes(t: GGMLType, n_elements: int) -> int:
    """Bytes taken by `n_elements` elements of type `t`."""
    fmt = FORMATS[ggml_type(t)]
    if n_elements % fmt.block_elems:
        raise ValueError(f"{n_elements} elements is not a multiple of the {fmt.type.name} block size "
                         f"({fmt.block_elems})")
    return n_elements // fmt.block_elems * fmt.block_bytes


def _as_bytes(raw) -> torch.Tensor:
    """Flat uint8 view of `raw` (tensor, numpy array/memmap, buffer) without copying it."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().reshape(-1).view(torch.uint8)
    if isinstance(raw, (memoryview, bytes, bytearray)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # read-only (mmap) buffers are fine: we never write to them
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


_CHUNK_BLOCKS = 1 << 15


def dequantize(raw, t, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of row-major `shape` stored as `raw` bytes of ggml type `t`, in `dtype`, on the
    device the bytes are on (a torch tensor on a GPU is decoded there by the same block decoders)."""
    fmt = FORMATS[ggml_type(t)]
    if fmt.dequant is None:
        raise NotImplementedError(f"dequantizing {fmt.type.name} is not supported; "
                                  f"supported: {_supported('dequant')}")
    shape = tuple(int(s) for s in shape)
    if shape and shape[-1] % fmt.block_elems:
        raise ValueError(f"row length {shape[-1]} of shape {shape} is not a multiple of the "
                         f"{fmt.type.name} block size ({fmt.block_elems})")
    expected = tensor_nbytes(fmt.type, math.prod(shape))
    data = _as_bytes(raw)
    if data.numel() != expected:
        raise ValueError(f"{fmt.type.name} tensor of shape {shape}: expected {expected} bytes, "
                         f"got {data.numel()}")
    blocks = data.view(expected // fmt.block_bytes, fmt.block_bytes)
    out = torch.empty(blocks.shape[0], fmt.block_elems, dtype=dtype, device=blocks.device)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):  # bounded float32 temporaries
        out[start:start + _CHUNK_BLOCKS] = fmt.dequant(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(shape)


def quantize(x: torch.Tensor, t) -> torch.Tensor:
    """The ggml bytes (flat uint8) of float tensor `x`, whose last dim is a multiple of the block size."""
    fmt = FORMATS[ggml_type(t)]
    if fmt.quantize is None:
        raise NotImplementedError(f"quantizing to {fmt.type.name} is not supported; "
                                  f"supported: {_supported('quantize')}")
    if x.dim() == 0 or x.shape[-1] % fmt.block_elems:
        raise ValueError(f"last dim of shape {tuple(x.shape)} is not a multiple of the "
                         f"{fmt.type.name} block size ({fmt.block_elems})")
    blocks = x.detach().to(torch.float32).reshape(-1, fmt.block_elems).contiguous()
    return fmt.quantize(blocks).reshape(-1)


def random_blocks(t, n_blocks: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [n_blocks, B] of random valid blocks: random codes, f16 scales of magnitude 1e-3..1e-2."""
    fmt = FORMATS[ggml_type(t)]
    if fmt.dequant is None:
        raise NotImplementedError(f"random blocks of {fmt.type.name}; supported: {_supported('dequant')}")
    if fmt.block_elems == 1:  # float types: values like weights
        return fmt.quantize(0.02 * torch.randn(n_blocks, 1, generator=generator))
    b = torch.randint(0, 256, (n_blocks, fmt.block_bytes), dtype=torch.uint8, generator=generator)
    for at in fmt.f16_fields:
        magnitude = 10 ** (torch.rand(n_blocks, 1, generator=generator) - 3)
        sign = torch.randint(0, 2, (n_blocks, 1), generator=generator) * 2 - 1
        b[:, at:at + 2] = _f16_bytes(sign * magnitude)
    for at in fmt.e8m0_fields:  # 2^-11 .. 2^-7 (times codes up to 6)
        b[:, at] = torch.randint(117, 122, (n_blocks,), dtype=torch.uint8, generator=generator)
    return b


# --- group-affine views for the GPU int4/int8 kernels ---------------------------------------------
GROUP_AFFINE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q8_0)  # groups of 32
# Q6_K's 16-value sub-blocks: int8 codes (q - 32) with a scale a sub-block (the linears' int8 kernels)
GROUP16_TYPES = (GGMLType.Q6_K,)


def mxfp4_codes(raw, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 matrix [rows, cols] as (e2m1 codes uint8 [rows, cols] in 0..15, scale float32
    [rows, cols / 32] = 2^(e-128)), losslessly: value = scale * MXFP4_VALUES[code]."""
    rows, cols = (int(s) for s in shape)
    if cols % 32:
        raise ValueError(f"row length {cols} is not a multiple of the MXFP4 block size (32)")
    data = _as_bytes(raw)
    expected = tensor_nbytes(GGMLType.MXFP4, rows * cols)
    if data.numel() != expected:
        raise ValueError(f"MXFP4 tensor of shape {(rows, cols)}: expected {expected} bytes, got {data.numel()}")
    b = data.view(-1, 17)
    return _unpack(b[:, 1:], 4).reshape(rows, cols), e8m0_half(b[:, 0]).reshape(rows, -1)


def group_affine(raw, t, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A Q4_0, Q4_K, Q8_0 or Q6_K matrix [rows, cols] as codes and per-group scale/offset,
    losslessly: value = scale * code + offset for each group of consecutive values of a row, 32 of
    them (GROUP_AFFINE_TYPES) or Q6_K's 16 (GROUP16_TYPES; the group is cols / scale.shape[1]).
    Returns (codes uint8 [rows, cols] for the 4-bit types (0..15), int8 for Q8_0 and Q6_K (its
    q - 32, in -32..31), scale float32 [rows, cols / group], offset float32 [rows, cols / group] or
    None for the symmetric types). Q4_K's 6-bit sub-block scales and mins become d*sc and
    -dmin*m, Q6_K's int8 scales d*sc (all exact in float32)."""
    t = ggml_type(t)
    if t not in GROUP_AFFINE_TYPES + GROUP16_TYPES:
        raise ValueError(f"{t.name} has no group-affine form; types that do: "
                         f"{', '.join(x.name for x in GROUP_AFFINE_TYPES + GROUP16_TYPES)}")
    rows, cols = (int(s) for s in shape)
    fmt = FORMATS[t]
    if cols % fmt.block_elems:
        raise ValueError(f"row length {cols} is not a multiple of the {t.name} block size ({fmt.block_elems})")
    expected = tensor_nbytes(t, rows * cols)
    data = _as_bytes(raw)
    if data.numel() != expected:
        raise ValueError(f"{t.name} tensor of shape {(rows, cols)}: expected {expected} bytes, got {data.numel()}")
    b = data.view(-1, fmt.block_bytes)
    n = len(b)
    if t == GGMLType.Q8_0:
        return b[:, 2:].contiguous().view(torch.int8).reshape(rows, cols), _f16(b, 0).reshape(rows, -1), None
    if t == GGMLType.Q6_K:
        codes, scale = _q6_k_parts(b)
        return codes.reshape(rows, cols), scale.reshape(rows, -1), None
    if t == GGMLType.Q4_0:
        d = _f16(b, 0)
        return _unpack(b[:, 2:], 4).reshape(rows, cols), d.reshape(rows, -1), (-8 * d).reshape(rows, -1)
    sc, mn = _k_scales(b[:, 4:16])
    codes = _unpack(b[:, 16:].reshape(n, 4, 32), 4).reshape(rows, cols)
    scale = (_f16(b, 0) * sc.float()).reshape(rows, -1)
    offset = (-_f16(b, 2) * mn.float()).reshape(rows, -1)
    return codes, scale, offset
