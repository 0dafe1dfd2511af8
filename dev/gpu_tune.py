"""On the GPU machine: launch parameters of the decode-sized kernels swept at Qwen3-30B-A3B's shapes,
each timed as a CUDA graph replays it with cold weights (copies cycled past the L2 cache).
    python dev/gpu_tune.py [gemv|attn|dense ...]
Prints one line a configuration: microseconds a call (median of replays of a graph of 32 calls)."""
import statistics
import sys

import torch
import triton

from ktransformers.kernels.triton import attention as A
from ktransformers.kernels.triton import quant_linear as Q
from ktransformers.kernels.triton.common import SplitPlan, split_counters

COPIES = 16  # 16 copies of a 4096x2048 int4 weight (6 MB each with its scales) pass the 60 MB L2


def timed(calls) -> float:
    """Median us a call of `calls` (a list of closures run in order) replayed from one graph."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def trial(best: list, label: str, call, inputs: list, ref: torch.Tensor) -> None:
    """Time `call` over `inputs` (its max error against `ref` on the first) into `best`; a
    configuration that does not compile or fit is printed and skipped."""
    try:
        err = (call(inputs[0]).float() - ref.float()).abs().max().item()
        us = timed([lambda i=i: call(i) for i in inputs])
    except (triton.CompilationError, triton.OutOfResources) as e:
        print(f"  {label}: {type(e).__name__}")
        return
    best.append((us, f"{label}: {us:6.2f} us (err {err:.1e})"))


def report(best: list, n: int) -> None:
    for _, line in sorted(best)[:n]:
        print("  " + line, flush=True)


def plan(x, N, K, bn, bk, splits, out_dtype=torch.bfloat16, bm=16):
    k_blocks = triton.cdiv(K, bk)
    splits = max(1, min(splits, k_blocks))
    kps = triton.cdiv(k_blocks, splits) * bk
    splits = triton.cdiv(K, kps)
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(N, bn), splits)
    y = torch.empty(x.shape[0], N, device=x.device, dtype=out_dtype)
    if splits == 1:
        return SplitPlan(grid, kps, y)
    part = torch.empty(splits, x.shape[0], N, device=x.device, dtype=torch.float32)
    return SplitPlan(grid, kps, y, part, split_counters(x.device))


def gemv_sweep():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for name, N, K in (("q", 4096, 2048), ("k", 512, 2048), ("o", 2048, 4096)):
        ws = [Q.quantize_int4(torch.randn(N, K, device="cuda")) for _ in range(COPIES)]
        xs = x[:, :K]
        ref = Q.group_gemm(xs, ws[0])
        base = timed([lambda w=w: Q.group_gemm(xs, w) for w in ws])
        print(f"gemv {name} {N}x{K}: current group_gemm {base:.2f} us", flush=True)
        best = []
        for bn in (32, 64, 128):
            for bk in (64, 128, 256):
                for mult in (1, 2, 4, 8):
                    for stages in (2, 3):
                        for warps in (4,):
                            tiles = triton.cdiv(N, bn)
                            splits = max(1, mult * sms // tiles)
                            p = plan(xs, N, K, bn, bk, splits)

                            def call(w, p=p, bn=bn, bk=bk, stages=stages, warps=warps):
                                Q._group_gemm_kernel[p.grid](
                                    xs, w.codes, w.scale, w.offset, p.y, *p.scratch(), 1, N, K, xs.stride(0),
                                    p.y.stride(0), p.k_per_split, BITS=4, HAS_OFFSET=True, GROUP_SIZE=32,
                                    BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, ATOMIC=False, REDUCE=p.reduce,
                                    DOT_F32=False, num_warps=warps, num_stages=stages)
                                return p.y
                            trial(best, f"bn {bn:3d} bk {bk:3d} splits {p.grid[2]:2d} progs {p.grid[1] * p.grid[2]:4d} "
                                        f"st {stages} w {warps}", call, ws, ref)
        for bn in (32, 64, 128, 256):
            for bk in (64, 128, 256):
                for mult in (1, 2, 4, 8):
                    for warps in (2, 4, 8):
                        tiles = triton.cdiv(N, bn)
                        p = plan(xs, N, K, bn, bk, max(1, mult * sms // tiles), bm=1)

                        def call(w, p=p, bn=bn, bk=bk, warps=warps):
                            Q._quant_gemv_kernel[p.grid](xs, w.codes, w.scale, w.offset, w.scale, p.y, *p.scratch(),
                                                         N, K, p.k_per_split, BITS=4, HAS_OFFSET=True, HAS_BIAS=False,
                                                         BLOCK_N=bn, BLOCK_K=bk, GROUP_SIZE=32, ATOMIC=False,
                                                         REDUCE=p.reduce, GDC=False, num_warps=warps)
                            return p.y
                        trial(best, f"NODOT bn {bn:3d} bk {bk:3d} splits {p.grid[2]:2d} progs {p.grid[1] * p.grid[2]:4d} "
                                    f"w {warps}", call, ws, ref)
        report(best, 16)


def attn_sweep():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Hq, Hkv, d = 32, 4, 128
    for L in (512, 2048, 8192):
        S = L * COPIES
        k = torch.randn(S, Hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(S, Hkv, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, Hq, d, device="cuda", dtype=torch.bfloat16)
        slot_sets = [torch.arange(c * L, (c + 1) * L, device="cuda", dtype=torch.int32)[None] for c in range(COPIES)]
        lens = torch.tensor([L], device="cuda", dtype=torch.int32)
        ref = A.decode_attention(q, k, v, slot_sets[0], lens, 0.088, out_dtype=torch.bfloat16)
        base = timed([lambda s=s: A.decode_attention(q, k, v, s, lens, 0.088, out_dtype=torch.bfloat16)
                      for s in slot_sets])
        print(f"attn L={L}: current {base:.2f} us", flush=True)
        best = []
        for bt in (16, 32, 64):
            for bh in (8, 16):
                for blocks in (1, 2, 4, 8):
                    for warps in (4, 8):
                        for stages in (1, 2):
                            programs = Hkv * triton.cdiv(Hq // Hkv, bh)
                            splits = max(1, min(triton.cdiv(L, blocks * bt), triton.cdiv(4 * sms, programs)))
                            tps = triton.cdiv(triton.cdiv(L, splits), bt) * bt
                            splits = triton.cdiv(L, tps)

                            def call(s, bt=bt, bh=bh, splits=splits, tps=tps, warps=warps, stages=stages):
                                acc = torch.empty(1, Hq, splits, d, device="cuda", dtype=torch.float32)
                                lse = torch.empty(1, Hq, splits, device="cuda", dtype=torch.float32)
                                A._decode_kernel[(1, Hkv * triton.cdiv(Hq // Hkv, bh), splits)](
                                    q, q, k, k, v, s, lens, acc, lse, acc, lse, q.stride(0), q.stride(1), q.stride(0),
                                    q.stride(1),
                                    k.stride(0), k.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                    s.stride(0), Hq, Hq // Hkv, d, 1, d, 0.088, 0, tps, splits, BLOCK_H=bh, BLOCK_T=bt,
                                    BLOCK_D1=d, BLOCK_D2=16, BLOCK_DV=d, HAS_K2=False, V_IS_K1=False, DOT_F32=False,
                                    MERGE=False, BLOCK_S=A._pow2(splits, 2), GDC=False, num_warps=warps, num_stages=stages)
                                out = torch.empty(1, Hq, d, device="cuda", dtype=torch.bfloat16)
                                A._merge_splits_kernel[(Hq,)](acc, lse, out, splits, d, BLOCK_S=A._pow2(splits, 2),
                                                              CHUNK_S=8, BLOCK_DV=d, num_warps=4)
                                return out
                            trial(best, f"bt {bt:2d} bh {bh:2d} splits {splits:3d} w {warps} st {stages}", call, slot_sets,
                                  ref)
        report(best, 10)


def dense_sweep():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    for name, N, dtype in (("router", 128, torch.float32), ("v", 512, torch.bfloat16)):
        ws = [torch.randn(N, 2048, device="cuda", dtype=dtype) for _ in range(COPIES * 4)]
        ref = x.float() @ ws[0].float().T
        base = timed([lambda w=w: Q.dense_gemv(x, w, torch.bfloat16) for w in ws])
        cublas = timed([lambda w=w: x @ w.to(x.dtype).T for w in ws]) if dtype == torch.bfloat16 else float("nan")
        print(f"dense {name} {N}x2048 {dtype}: current dense_gemv {base:.2f} us, cuBLAS {cublas:.2f} us", flush=True)
        best = []
        for bn in (8, 16, 32):
            for bk in (256, 512, 1024):
                for mult in (1, 2, 4, 8):
                    for warps in (2, 4):
                        tiles = triton.cdiv(N, bn)
                        p = plan(x, N, 2048, bn, bk, max(1, mult * sms // tiles), bm=1)

                        def call(w, p=p, bn=bn, bk=bk, warps=warps):
                            Q._dense_gemv_kernel[p.grid](x, w, p.y, p.y, *p.scratch(), 1, N, 2048, x.stride(0),
                                                         w.stride(0), p.y.stride(0), p.k_per_split, HAS_BIAS=False,
                                                         BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, ATOMIC=False,
                                                         REDUCE=p.reduce, GDC=False, num_warps=warps)
                            return p.y
                        trial(best, f"bn {bn:2d} bk {bk:4d} splits {p.grid[2]:2d} progs {p.grid[1] * p.grid[2]:4d} "
                                    f"w {warps}", call, ws, ref)
        report(best, 10)


if __name__ == "__main__":
    which = sys.argv[1:] or ["gemv", "attn", "dense"]
    for part in which:
        {"gemv": gemv_sweep, "attn": attn_sweep, "dense": dense_sweep}[part]()
