"""GGML blocks -> bf16/f16/f32 on the GPU in one launch: what layer-wise prefill runs on each
layer's expert bytes once they are copied to the GPU (weights.ggml_quants.dequantize, the torch
reference, decodes the same blocks in a dozen elementwise launches over float32 temporaries).

Types: Q4_K, Q6_K, Q8_0, MXFP4 (what Q4_K_M / Q6_K / Q8_0 files and gpt-oss's store their experts
in); others go to the reference (`dequantize` falls back). Each program decodes BLOCKS blocks, every value computed
from its own bytes with the reference's float32 arithmetic (bit-identical after the rounding).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...weights.ggml_quants import FORMATS, GGMLType, ggml_type, tensor_nbytes
from ...weights.ggml_quants import dequantize as dequantize_reference
from .norm_rope import round_to

BLOCKS = 8  # blocks a program (8 x 256 values)


@triton.jit
def _f16_at(ptr, mask):
    """float32 of the little-endian f16 whose first byte `ptr` points at (any alignment; 0 where
    not mask: past the last block nothing is read)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_kernel(src_ptr, out_ptr, n_blocks, group, stride, TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                    BLOCK_ELEMS: tl.constexpr, BLOCKS: tl.constexpr):
    """Value i of the tensor (row-major) goes to out[(i // group) * stride + i % group]."""
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    valid = blk < n_blocks
    e = tl.arange(0, BLOCK_ELEMS)
    base = src_ptr + blk[:, None] * BLOCK_BYTES  # [BLOCKS, 1] block starts
    m = valid[:, None] & (e < BLOCK_ELEMS)[None, :]
    if TYPE == 12:  # Q4_K: d f16 | dmin f16 | 12 bytes of 6-bit (scale, min) pairs | 128 bytes of nibbles
        d = _f16_at(src_ptr + blk * BLOCK_BYTES, valid)
        dmin = _f16_at(src_ptr + blk * BLOCK_BYTES + 2, valid)
        j = e // 32  # sub-block
        jl = j % 4
        lo = tl.load(base + 4 + jl[None, :], mask=m, other=0).to(tl.int32)   # bytes 0-3 of the field
        mid = tl.load(base + 8 + jl[None, :], mask=m, other=0).to(tl.int32)  # bytes 4-7
        hi = tl.load(base + 12 + jl[None, :], mask=m, other=0).to(tl.int32)  # bytes 8-11
        first = (j < 4)[None, :]
        sc = tl.where(first, lo & 63, (hi & 15) | ((lo >> 6) << 4))
        mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
        r = e % 64
        q = tl.load(base + 16 + (e // 64 * 32 + r % 32)[None, :], mask=m, other=0).to(tl.int32)
        q = (q >> (4 * (r // 32))[None, :]) & 15
        scale = d[:, None] * sc.to(tl.float32)
        low = dmin[:, None] * mn.to(tl.float32)
        v = scale * q.to(tl.float32) - low
    elif TYPE == 14:  # Q6_K: ql[128] | qh[64] | 16 int8 scales | d f16
        d = _f16_at(src_ptr + blk * BLOCK_BYTES + 208, valid)
        half = e // 128
        r = e % 128
        ql = tl.load(base + (half * 64 + r % 64)[None, :], mask=m, other=0).to(tl.int32)
        qh = tl.load(base + 128 + (half * 32 + r % 32)[None, :], mask=m, other=0).to(tl.int32)
        q = ((ql >> (4 * (r // 64))[None, :]) & 15) | (((qh >> (2 * (r // 32))[None, :]) & 3) << 4)
        sc = tl.load(base + 192 + (e // 16)[None, :], mask=m, other=0).to(tl.int8, bitcast=True)
        scale = d[:, None] * sc.to(tl.float32)
        v = scale * (q.to(tl.float32) - 32)
    elif TYPE == 39:  # MXFP4: e u8 | 16 bytes of e2m1 nibbles (values 0-15 low, 16-31 high)
        ex = tl.load(src_ptr + blk * BLOCK_BYTES, mask=valid, other=0).to(tl.int32)
        # 2^(e-128) from its bits (e = 0, 1: float32 subnormals), exact where exp2 may not be
        scale = tl.where(ex >= 2, (ex - 1) << 23, 1 << (21 + tl.minimum(ex, 1))).to(tl.float32, bitcast=True)
        c = tl.load(base + 1 + (e % 16)[None, :], mask=m, other=0).to(tl.int32)
        c = (c >> (4 * (e // 16))[None, :]) & 15
        c7 = c & 7
        mag = tl.where(c7 < 2, c7, (2 + (c7 & 1)) << tl.maximum((c7 >> 1) - 1, 0))  # 0,1,2,3,4,6,8,12
        v = scale[:, None] * tl.where(c >= 8, -mag, mag).to(tl.float32)
    else:  # Q8_0: d f16 | 32 int8
        d = _f16_at(src_ptr + blk * BLOCK_BYTES, valid)
        q = tl.load(base + 2 + e[None, :], mask=m, other=0).to(tl.int8, bitcast=True)
        v = d[:, None] * q.to(tl.float32)
    i = blk[:, None] * BLOCK_ELEMS + e[None, :]
    out = out_ptr + (i // group) * stride + i % group
    tl.store(out, round_to(v, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=m)


KERNEL_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4)


def dequantize(raw: torch.Tensor, t, shape, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quants.dequantize(raw, t, shape, dtype) for bytes on a device Triton runs on: one
    launch for KERNEL_TYPES, the reference for other types (and for what it rejects: wrong sizes).

    `out`: write into this view instead (of `shape`, its dtype; its innermost dims may sit inside
    a larger tensor: [E, I, H] into gate_up[:, :I] of an [E, 2I, H] tensor, the rows of each
    leading index contiguous), e.g. gate and up side by side without a concatenation."""
    fmt = FORMATS[ggml_type(t)]
    shape = tuple(int(s) for s in shape)
    group = stride = max(1, math.prod(shape))
    if out is not None:
        dtype = out.dtype
        if tuple(out.shape) != shape or out.device != raw.device:
            raise ValueError(f"dequantize: out {tuple(out.shape)} on {out.device}, expected {shape} on {raw.device}")
        if len(shape) > 1 and out[0].is_contiguous() and (shape[0] == 1 or out.stride(0) >= out[0].numel()):
            group, stride = out[0].numel(), out.stride(0)  # (one leading index: the stride is never used)
        elif not out.is_contiguous():
            raise ValueError(f"dequantize: out must be contiguous below its first dim, got strides {out.stride()}")
    if fmt.type not in KERNEL_TYPES or dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
            raw.dtype != torch.uint8 or not raw.is_contiguous() or (shape and shape[-1] % fmt.block_elems) or \
            raw.numel() != tensor_nbytes(fmt.type, math.prod(shape)):
        ref = dequantize_reference(raw, t, shape, dtype)
        return ref if out is None else out.copy_(ref)
    n_blocks = raw.numel() // fmt.block_bytes
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    if n_blocks:
        _dequant_kernel[(triton.cdiv(n_blocks, BLOCKS),)](raw, out, n_blocks, group, stride, TYPE=int(fmt.type),
                                                          BLOCK_BYTES=fmt.block_bytes,
                                                          BLOCK_ELEMS=fmt.block_elems, BLOCKS=BLOCKS,
                                                          num_warps=8)
    return out
