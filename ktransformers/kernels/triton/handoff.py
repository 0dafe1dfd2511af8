"""The inputs and output of CPU experts fed from a GPU stream, moved by kernels, not copies.

A decode step's MoE block hands the CPU x [T, H], top_k_index [T, K] and top_k_weights [T, K]
(kernels/cuda_host.submit_on_stream). Copied one by one that is a cast of the weights to float32
and three device-to-host copies, four graph nodes a layer; `pack_moe_inputs` is one kernel that
stores the three, converted, straight into the pinned host buffer (pinned memory is addressable
from the GPU under unified addressing: the stores cross the bus, no copy engine is involved).
`copy_rows` brings the output y back the same way, one kernel instead of a host-to-device copy;
`copy_rows_add_norm` also adds y to the residual and normalizes the sum for the next layer (the
decoder layer's last add and the next input norm: one launch where the read-back and that
add + norm were two).
The copy-engine transfers are the slow part of a hand-off this small (each is a fixed cost for a
few bytes), so packing shortens the GPU side of a decode layer. The torch references are the `copy_` calls
they replace.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .norm_rope import normalize_row, round_to
from .pdl import gdc_enter, pdl


@dataclass
class PinnedInputs:
    """Where a MoE call fed from a GPU stream reads its inputs (pack_moe_inputs' outputs: x
    [T, H], ids int64 [T, K], weights float32 [T, K], pinned), for a launch before it that stores
    them in passing (router.router_topk's `pack`), with ids of columns >= cpu_k stored as -1.
    That launch records in `written` the (x, weights, index) it stored from; the call then skips
    its own pack where its inputs are those very tensors (`holds`)."""
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    cpu_k: int
    written: tuple | None = None

    def check(self, x: torch.Tensor, top_k: int) -> None:
        """Raise unless the views fit a pack of x [T, H] with top_k picks."""
        T, H = x.shape
        if (tuple(self.x.shape) != (T, H) or tuple(self.ids.shape) != (T, top_k)
                or tuple(self.weights.shape) != (T, top_k)):
            raise ValueError(f"PinnedInputs: views {tuple(self.x.shape)}, {tuple(self.ids.shape)}, "
                             f"{tuple(self.weights.shape)} do not fit x {tuple(x.shape)} with top_k {top_k}")
        if (self.ids.dtype != torch.int64 or self.weights.dtype != torch.float32
                or self.x.dtype not in (torch.float32, torch.bfloat16)
                or not all(t.is_contiguous() for t in (self.x, self.ids, self.weights))):
            raise ValueError("PinnedInputs: contiguous (float32|bfloat16, int64, float32) views expected, got "
                             f"{self.x.dtype}, {self.ids.dtype}, {self.weights.dtype}")
        if not 0 <= self.cpu_k <= top_k:
            raise ValueError(f"PinnedInputs: cpu_k must lie in [0, {top_k}], got {self.cpu_k}")

    def holds(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, views: tuple, cpu_k: int) -> bool:
        """Whether the stored values are x, ids and weights, in these views, with this cpu_k."""
        if self.written is None or self.cpu_k != cpu_k:
            return False
        wx, ww, wi = self.written
        return (ww is weights and wi is ids and wx.data_ptr() == x.data_ptr() and wx.shape == x.shape
                and wx.dtype == x.dtype and wx.stride() == x.stride()
                and all(a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                        for a, b in zip((self.x, self.ids, self.weights), views)))


@triton.jit
def _copy_row(src, dst, H, BLOCK_H: tl.constexpr, VOLATILE: tl.constexpr, add, ADD: tl.constexpr):
    """H values src (+ add's float32 values, ADD) -> dst, converted to dst's dtype (rounded to
    nearest even, once)."""
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        m = h0 + h < H
        v = tl.load(src + h0 + h, mask=m, volatile=VOLATILE).to(tl.float32)
        if ADD:
            v += tl.load(add + h0 + h, mask=m)
        tl.store(dst + h0 + h, round_to(v, dst.dtype.element_ty).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, w_ptr, xo_ptr, io_ptr, wo_ptr, H, K, cpu_k, s_x, s_i, s_w,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    gdc_enter(GDC)
    _copy_row(x_ptr + t * s_x, xo_ptr + t * H, H, BLOCK_H, False, x_ptr, False)  # (x_ptr: no add, never read)
    k = tl.arange(0, BLOCK_K)
    mk = k < K
    ids = tl.load(ids_ptr + t * s_i + k, mask=mk).to(tl.int64)
    tl.store(io_ptr + t * K + k, tl.where(k < cpu_k, ids, -1), mask=mk)  # -1: the CPU skips the pair
    tl.store(wo_ptr + t * K + k, tl.load(w_ptr + t * s_w + k, mask=mk).to(tl.float32), mask=mk)


def pack_moe_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, x_out: torch.Tensor,
                    ids_out: torch.Tensor, w_out: torch.Tensor, cpu_k: int | None = None) -> None:
    """x [T, H] (bf16/fp16/fp32) -> x_out (float32 or bf16), ids [T, K] (any integer) -> ids_out
    int64, weights [T, K] (any float) -> w_out float32; the outputs contiguous, in device memory or
    pinned host memory. Rows of the inputs may be strided (last dimension contiguous). `cpu_k`:
    ids of the columns from there on are stored as -1 (pairs the CPU kernel skips: computed on
    the GPU)."""
    T, H = x.shape
    K = ids.shape[1]
    if (tuple(ids.shape) != (T, K) or tuple(weights.shape) != (T, K) or tuple(x_out.shape) != (T, H)
            or tuple(ids_out.shape) != (T, K) or tuple(w_out.shape) != (T, K)):
        raise ValueError(f"pack_moe_inputs: x [T, H] with ids/weights [T, K] and outputs of the same shapes, got "
                         f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)} -> {tuple(x_out.shape)}, "
                         f"{tuple(ids_out.shape)}, {tuple(w_out.shape)}")
    if ids_out.dtype != torch.int64 or w_out.dtype != torch.float32 or x_out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_moe_inputs: outputs must be (float32|bfloat16, int64, float32), got "
                         f"{x_out.dtype}, {ids_out.dtype}, {w_out.dtype}")
    if ids.dtype.is_floating_point or not weights.dtype.is_floating_point:
        raise ValueError(f"pack_moe_inputs: ids must be integers and weights floats, got {ids.dtype}, {weights.dtype}")
    if any(t.stride(-1) != 1 for t in (x, ids, weights)) or not all(t.is_contiguous() for t in (x_out, ids_out, w_out)):
        raise ValueError("pack_moe_inputs: inputs need a contiguous last dimension and outputs must be contiguous")
    if T == 0:
        return
    cpu_k = K if cpu_k is None else cpu_k
    if not 0 <= cpu_k <= K:
        raise ValueError(f"pack_moe_inputs: cpu_k must lie in [0, {K}], got {cpu_k}")
    _pack_kernel[(T,)](x, ids, weights, x_out, ids_out, w_out, H, K, cpu_k, x.stride(0), ids.stride(0), weights.stride(0),
                       BLOCK_H=min(1024, triton.next_power_of_2(H)), BLOCK_K=triton.next_power_of_2(K), num_warps=4,
                       **pdl(x.device))


@triton.jit
def _copy_rows_kernel(src_ptr, add_ptr, dst_ptr, H, s_src, s_dst, BLOCK_H: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    # volatile: the CPU rewrites these pinned words between launches; never a cached copy
    _copy_row(src_ptr + t * s_src, dst_ptr + t * s_dst, H, BLOCK_H, True, add_ptr + t * H, ADD)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, add: torch.Tensor | None = None) -> None:
    """dst [T, H] = src [T, H] (+ add, float32 [T, H] contiguous) converted to dst's dtype
    (float32/bf16/fp16, rounded once), in one launch: the CPU experts' output read from pinned
    host memory by a kernel (one round trip over the bus a row) where a copy-engine transfer and
    a cast would be two graph nodes; `add` the GPU's share of the experts."""
    if src.dim() != 2 or dst.shape != src.shape or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError(f"copy_rows: src and dst of one [T, H] shape with contiguous rows, got {tuple(src.shape)} "
                         f"{src.stride()} -> {tuple(dst.shape)} {dst.stride()}")
    if not (src.dtype.is_floating_point and dst.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"copy_rows: float rows into float32/bfloat16/float16, got {src.dtype} -> {dst.dtype}")
    if add is not None and (add.shape != src.shape or add.dtype != torch.float32 or not add.is_contiguous()):
        raise ValueError(f"copy_rows: add must be a contiguous float32 {tuple(src.shape)}, got "
                         f"{tuple(add.shape)} {add.dtype}")
    T, H = src.shape
    if T == 0 or H == 0:
        return
    _copy_rows_kernel[(T,)](src, dst if add is None else add, dst, H, src.stride(0), dst.stride(0),
                            BLOCK_H=min(8192, triton.next_power_of_2(H)), ADD=add is not None, num_warps=8)


@triton.jit
def _copy_add_norm_kernel(src_ptr, add_ptr, r_ptr, w_ptr, y_ptr, s_ptr, n_ptr, H, s_src, s_r, eps,
                          BLOCK_H: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    m = h < H
    w = tl.load(w_ptr + h, mask=m, other=0.0).to(tl.float32)
    # volatile: pinned words the CPU rewrites between launches (see _copy_rows_kernel)
    v = tl.load(src_ptr + t * s_src + h, mask=m, other=0.0, volatile=True).to(tl.float32)
    if ADD:
        v += tl.load(add_ptr + t * H + h, mask=m, other=0.0)
    y_ty = y_ptr.dtype.element_ty
    y = round_to(v, y_ty)
    tl.store(y_ptr + t * H + h, y.to(y_ty), mask=m)
    s_ty = s_ptr.dtype.element_ty
    s = round_to(tl.load(r_ptr + t * s_r + h, mask=m, other=0.0).to(tl.float32) + y, s_ty)
    tl.store(s_ptr + t * H + h, s.to(s_ty), mask=m)
    n = normalize_row(s, w, H, eps, s_ty, n_ptr.dtype.element_ty)
    tl.store(n_ptr + t * H + h, n.to(n_ptr.dtype.element_ty), mask=m)


def copy_rows_add_norm(src: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype, add: torch.Tensor | None = None):
    """(y, s, norm) in one launch, as copy_rows then norm_rope.add_rms_norm bit for bit:
    y [T, H] = src (+ add) in out_dtype (float32/bf16/fp16, rounded once), s = residual + y in
    torch's promoted dtype of the two, norm = rms_norm_reference(s, weight, eps). src may be
    pinned host memory the CPU rewrote since the last launch (read, never cached); residual
    [T, H] on the GPU with contiguous rows, weight [H] contiguous."""
    if src.dim() != 2 or src.stride(-1) != 1 or residual.shape != src.shape or residual.stride(-1) != 1:
        raise ValueError(f"copy_rows_add_norm: src and residual of one [T, H] shape with contiguous rows, got "
                         f"{tuple(src.shape)} {src.stride()} and {tuple(residual.shape)} {residual.stride()}")
    T, H = src.shape
    if weight.shape != (H,) or not weight.is_contiguous() or weight.device != residual.device:
        raise ValueError(f"copy_rows_add_norm: weight must be a contiguous [{H}] on {residual.device}, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    if not src.dtype.is_floating_point or out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"copy_rows_add_norm: float rows into float32/bfloat16/float16, got {src.dtype} -> {out_dtype}")
    if add is not None and (add.shape != src.shape or add.dtype != torch.float32 or not add.is_contiguous()):
        raise ValueError(f"copy_rows_add_norm: add must be a contiguous float32 {tuple(src.shape)}, got "
                         f"{tuple(add.shape)} {add.dtype}")
    dev = residual.device
    y = torch.empty(T, H, device=dev, dtype=out_dtype)
    s = torch.empty(T, H, device=dev, dtype=torch.promote_types(residual.dtype, out_dtype))
    n = torch.empty(T, H, device=dev, dtype=torch.promote_types(s.dtype, weight.dtype))
    if T and H:
        block = triton.next_power_of_2(H)
        _copy_add_norm_kernel[(T,)](src, y if add is None else add, residual, weight, y, s, n, H, src.stride(0),
                                    residual.stride(0), float(eps), BLOCK_H=block, ADD=add is not None,
                                    num_warps=max(1, min(16, block // 512)))
    return y, s, n


def pack_moe_inputs_reference(x, ids, weights, x_out, ids_out, w_out) -> None:
    x_out.copy_(x.to(x_out.dtype))
    ids_out.copy_(ids.to(torch.int64))
    w_out.copy_(weights.to(torch.float32))


@functools.lru_cache(maxsize=None)
def packs_into_pinned(device_index: int) -> str | None:
    """None when a kernel on this GPU writes pinned host memory as pack_moe_inputs does; else why
    not (the hand-off then copies: cast + three device-to-host copies)."""
    try:
        with torch.cuda.device(device_index):
            dev = torch.device("cuda", device_index)
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(2, 300, generator=g).to(dev, torch.bfloat16)
            ids = torch.randint(0, 100, (2, 5), generator=g, dtype=torch.int32).to(dev)
            w = torch.rand(2, 5, generator=g).to(dev, torch.bfloat16)
            outs = (torch.empty(2, 300, dtype=torch.bfloat16, pin_memory=True),
                    torch.empty(2, 5, dtype=torch.int64, pin_memory=True),
                    torch.empty(2, 5, dtype=torch.float32, pin_memory=True))
            pack_moe_inputs(x, ids, w, *outs)
            back = torch.empty(2, 300, dtype=torch.float32, device=dev)
            copy_rows(outs[0], back)  # and read back from the pinned buffer by a kernel
            torch.cuda.synchronize(dev)
            want = (x.cpu(), ids.cpu().long(), w.cpu().float())
            if not all(torch.equal(o, r) for o, r in zip(outs, want)):
                return "the pinned buffer does not hold what the kernel wrote"
            if not torch.equal(back.cpu(), x.cpu().float()):
                return "a kernel reading the pinned buffer does not see what it holds"
            outs[0].mul_(-2)  # rewritten by the CPU: the next read must see the new values
            copy_rows(outs[0], back)
            torch.cuda.synchronize(dev)
            if not torch.equal(back.cpu(), outs[0].float()):
                return "a kernel reading the pinned buffer again sees stale values"
    except Exception as e:  # noqa: BLE001 - any failure means: copy instead
        return str(e)
    return None
