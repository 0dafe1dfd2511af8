"""FP8 e4m3 weights with 128x128 block scales (DeepSeek-V3's native format) x bf16 activations.

W [N, K] float8_e4m3fn and scale_inv [ceil(N/128), ceil(K/128)] float32:
    W_real[n, k] = W[n, k] * scale_inv[n // 128, k // 128]
One program per output tile and K split, like quant_linear; each 128-wide K block is scaled
once per tile (its 128x128 scale block is one number per BLOCK_N <= 128 columns).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import DENSE_ROWS, dot_f32, plan_split_k
from .quant_linear import store_tile

FP8_BLOCK = 128


@dataclass
class FP8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale_inv: torch.Tensor  # float32 [ceil(N/128), ceil(K/128)]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def to(self, device) -> FP8Weight:
        return FP8Weight(self.weight.to(device), self.scale_inv.to(device))

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_inv.numel() * 4

    def dequantize(self) -> torch.Tensor:
        N, K = self.weight.shape
        s = self.scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
        return self.weight.float() * s


def quantize_fp8(w: torch.Tensor) -> FP8Weight:
    """Block-scaled e4m3 from a float W [N, K]: each 128x128 block's absmax maps to 448 (lossy)."""
    N, K = w.shape
    nb, kb = triton.cdiv(N, FP8_BLOCK), triton.cdiv(K, FP8_BLOCK)
    padded = torch.zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return FP8Weight(q.reshape(nb * FP8_BLOCK, kb * FP8_BLOCK)[:N, :K].contiguous(), scale.contiguous())


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_sn, BLOCK: tl.constexpr):
    """out [K, N] bf16 = W_realᵀ, one 128x128 scale block per program."""
    rk = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rk < K)[:, None] & (rn < N)[None, :]
    w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + tl.program_id(1) * stride_sn + tl.program_id(0))
    tl.store(out_ptr + rk[:, None] * N + rn[None, :], (w * s).to(tl.bfloat16), mask=mask)


def dequantize_t(w: FP8Weight) -> torch.Tensor:
    N, K = w.weight.shape
    out = torch.empty(K, N, device=w.weight.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(K, FP8_BLOCK), triton.cdiv(N, FP8_BLOCK))
    _dequant_kernel[grid](w.weight, w.scale_inv, out, N, K, w.scale_inv.stride(0), BLOCK=FP8_BLOCK)
    return out


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_ym, stride_sn,
                     k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr, ATOMIC: tl.constexpr, REDUCE: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, k_per_split // BLOCK_K):
        k0 = pid_k * k_per_split + i * BLOCK_K
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn < N)[None, :] & (kk < K)[:, None], other=0.0)
        s = tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=k0 < K, other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32)) * s
        else:
            acc += tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16)) * s
    store_tile(acc, y_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_ym, ATOMIC, REDUCE, y_ptr, False)


def fp8_gemm(x: torch.Tensor, w: FP8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W_realᵀ."""
    N, K = w.weight.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"fp8_gemm: x must be [M, {K}], got {tuple(x.shape)}")
    if w.scale_inv.shape != (triton.cdiv(N, FP8_BLOCK), triton.cdiv(K, FP8_BLOCK)):
        raise ValueError(f"fp8_gemm: scale_inv {tuple(w.scale_inv.shape)} does not fit weight {(N, K)}")
    x = x.contiguous()
    M = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if M > DENSE_ROWS and x.device.type == "cuda":  # compute-bound: dequantize once, then cuBLAS
        return (x.to(torch.bfloat16) @ dequantize_t(w)).to(out_dtype)
    BLOCK_K = FP8_BLOCK
    BLOCK_M, BLOCK_N = (16, 64) if M <= 16 else ((64, 64) if M <= 64 else (128, 128))
    # few rows split K, the splits added in the launch (common.plan_split_k; atomics where the
    # tile counters cannot be made): one launch where a memset, the GEMM and a cast were three
    plan = plan_split_k(x, N, K, BLOCK_M, BLOCK_N, BLOCK_K, out_dtype)
    y = plan.y
    _fp8_gemm_kernel[plan.grid](x, w.weight, w.scale_inv, y, *plan.scratch(), M, N, K, x.stride(0), y.stride(0),
                                w.scale_inv.stride(0), plan.k_per_split, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                BLOCK_K=BLOCK_K, SCALE_BLOCK=FP8_BLOCK, ATOMIC=plan.atomic, REDUCE=plan.reduce,
                                DOT_F32=dot_f32(), num_warps=4, num_stages=3 if x.device.type == "cuda" else 1)
    return y.to(out_dtype) if plan.atomic else y
