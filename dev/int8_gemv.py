"""Question: which one-row GEMV on int8 (Q8_0) codes streams gpt-oss's attention projections
fastest on the GPU: the 16-row tl.dot GEMM, or the float32 GEMV without tl.dot on the codes packed
four to an int32 word along K (as int4 packs eight), and at which blocks and warps? Are int4's
GEMV blocks right for GLM's large projections? And what does gemv_many (q, k and v in one launch)
save over three launches?

    python dev/int8_gemv.py   # CUDA; us a launch inside a CUDA graph (as decode runs), median of 30

Each shape rotates through enough copies of its weight to miss L2, as a decode step's weights do.
"""
from __future__ import annotations

import torch

from ktransformers.kernels.triton import quant_linear as ql
from ktransformers.kernels.triton.common import plan_split_k, split_counters

from gpu_tune import timed  # (dev/, beside this script)


def graph_us(fn, copies: int, launches: int = 48) -> float:
    """us a call of fn(i) in a CUDA graph of `launches` calls (i rotating over the copies)."""
    return timed([lambda i=i: fn(i % copies) for i in range(launches)])


def dot_gemm(x, w):
    """The 16-row tl.dot GEMM at one row (what group_gemm ran for int8 before the GEMV took it)."""
    K, N = w.in_features, w.out_features
    plan = plan_split_k(x, N, K, 16, 64, 128, torch.bfloat16)
    ql._group_gemm_kernel[plan.grid](x, w.codes, w.scale, w.scale, w.scale, plan.y, *plan.scratch(), 1, N, K,
                                     x.stride(0), plan.y.stride(0), plan.k_per_split, BITS=w.bits, HAS_OFFSET=False,
                                     HAS_BIAS=False, GROUP_SIZE=32, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                                     ATOMIC=plan.atomic, REDUCE=plan.reduce, DOT_F32=False, num_warps=4, num_stages=3)
    return plan.y


def gemv(x, w, bn, bk, warps, per_sm=4):
    K, N = w.in_features, w.out_features
    plan = plan_split_k(x, N, K, 1, bn, bk, torch.bfloat16, per_sm=per_sm, min_blocks=1)
    offset = w.offset if w.offset is not None else w.scale
    ql._quant_gemv_kernel[plan.grid](x, w.codes, w.scale, offset, w.scale, plan.y, *plan.scratch(), N, K,
                                     plan.k_per_split, BITS=w.bits, HAS_OFFSET=w.offset is not None, HAS_BIAS=False,
                                     BLOCK_N=bn,
                                     BLOCK_K=bk, GROUP_SIZE=32, ATOMIC=plan.atomic, REDUCE=plan.reduce, GDC=False,
                                     num_warps=warps)
    return plan.y


def copies_of(w, n):
    return [ql.quantize_int8(w + 0.001 * torch.randn_like(w)) for _ in range(n)]


def main() -> None:
    torch.manual_seed(0)
    split_counters(torch.device("cuda"))
    shapes = {"gpt-oss q": (4096, 2880), "gpt-oss k/v": (512, 2880), "gpt-oss o": (2880, 4096),
              "glm q": (12288, 4096), "glm o": (4096, 12288), "lm_head 32k": (32000, 2880)}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda") * 0.05
        ws = copies_of(w, max(2, int(96e6 // ql.quantize_int8(w).nbytes()) + 1))
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].dequantize().T
        rows = [("tl.dot GEMM, 16-row tiles", lambda i: dot_gemm(x, ws[i])),
                ("product group_gemm (one-row GEMV)", lambda i: ql.group_gemm(x, ws[i], torch.bfloat16))]
        for bn, bk, warps in [(128, 256, 2), (128, 128, 4), (64, 256, 4), (256, 256, 8), (128, 512, 4)]:
            rows.append((f"int8 GEMV bn {bn} bk {bk} (steps {bk // 2}) w {warps}",
                         lambda i, a=(bn, bk, warps): gemv(x, ws[i], *a)))
        q4 = [ql.quantize_int4(c.dequantize()) for c in ws]
        rows.append(("int4 product group_gemm", lambda i: ql.group_gemm(x, q4[i], torch.bfloat16)))
        for bn, bk, warps in [(128, 256, 4), (128, 128, 4), (64, 256, 4), (256, 256, 8)]:
            rows.append((f"int4 GEMV bn {bn} bk {bk} w {warps}", lambda i, a=(bn, bk, warps): gemv(x, q4[i], *a)))
        mb = ws[0].nbytes() / 1e6
        print(f"## {name}: N {N} K {K}, int8 {mb:.1f} MB a copy (int4 {q4[0].nbytes() / 1e6:.1f}), "
              f"{len(ws)} copies")
        for label, fn in rows:
            try:
                err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(fn, len(ws))
            except Exception as e:  # a config Triton cannot build: say so and go on
                print(f"{label:<44} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            print(f"{label:<44} {us:7.2f} us  {mb / us * 1e3:6.0f} GB/s  rel err {err:.1e}")
    # gpt-oss-120b's q, k and v with biases: one gemv_many launch against three GEMVs
    H = 2880
    qkv = [copies_of(torch.randn(n, H, device="cuda") * 0.05, 6) for n in (4096, 512, 512)]
    biases = [torch.randn(n, device="cuda") for n in (4096, 512, 512)]
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    many = graph_us(lambda i: ql.gemv_many(x, [c[i] for c in qkv], torch.bfloat16, biases), 6)
    apart = graph_us(lambda i: [ql.group_gemm(x, c[i], torch.bfloat16, b) for c, b in zip(qkv, biases)], 6)
    print(f"## gpt-oss q/k/v with biases: gemv_many {many:.2f} us, three GEMVs {apart:.2f} us")
    # GLM-4.5-Air's (int4)
    H = 4096
    qkv = [[ql.quantize_int4(torch.randn(n, H, device="cuda") * 0.05) for _ in range(3)] for n in (12288, 1024, 1024)]
    biases = [torch.randn(n, device="cuda") for n in (12288, 1024, 1024)]
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    many = graph_us(lambda i: ql.gemv_many(x, [c[i] for c in qkv], torch.bfloat16, biases), 3)
    apart = graph_us(lambda i: [ql.group_gemm(x, c[i], torch.bfloat16, b) for c, b in zip(qkv, biases)], 3)
    print(f"## GLM q/k/v int4 with biases: gemv_many {many:.2f} us, three GEMVs {apart:.2f} us")


if __name__ == "__main__":
    main()
