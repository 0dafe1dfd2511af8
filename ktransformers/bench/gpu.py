"""The Triton GPU kernels against the GPU's memory bandwidth (and torch's bf16 kernels).

    python -m ktransformers.bench.gpu [--only linear mla moe] [--json]

For each kernel and shape: median microseconds per call (CUDA events, after warm-up), the bytes
the call must read (weights, or the KV history), the effective GB/s, TFLOP/s, the device-to-
device copy bandwidth measured in the same run, and the ratio (1.0 = at the bandwidth floor).
Rows:
  linear  int4 (GGUF Q4_K, lossless), int8 (Q8_0) and FP8 GEMM at DeepSeek-V3 / Qwen3 shapes,
          M = 1, 16, 512 tokens, beside torch's bf16 F.linear on the same shape;
  mla     absorbed MLA decode over the paged latent cache (128 heads, r 512, rope 64),
          batches of 1 and 8 sequences of 1k / 8k tokens; Qwen3's GQA decode (32 / 4 heads);
  moe     fused MoE at the Qwen3-30B-A3B shape (E 128, K 8, H 2048, I 768), bf16 and int4.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ..weights.ggml_quants import FORMATS, GGMLType, random_blocks


def timed(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median microseconds of fn() on the GPU: replays of a CUDA graph of 10 calls (what a decode
    step's graph runs, without Python's launch overhead); eager calls if fn cannot be captured."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph, calls = torch.cuda.CUDAGraph(), 10
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except RuntimeError:
        run, calls = fn, 1
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def copy_gbps(gib: float = 2.0) -> float:
    """Device memory bandwidth: a large device-to-device copy counts its read and its write."""
    n = int(gib * 2**30)
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    times = []
    for _ in range(10):  # eager: one 2 GiB copy dwarfs a launch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return 2 * n / statistics.median(times) / 1e3


def row(kernel: str, shape: str, us: float, nbytes: int, flops: float, hbm: float, note: str = "") -> dict:
    gbps = nbytes / us / 1e3
    return dict(kernel=kernel, shape=shape, median_us=round(us, 2), bytes=nbytes, gbps=round(gbps, 1),
                tflops=round(flops / us / 1e6, 2), hbm_gbps=round(hbm, 1), ratio=round(gbps / hbm, 3), note=note)


LINEAR_SHAPES = {"dsv3.q_b": (24576, 1536), "dsv3.o": (7168, 16384), "dsv3.mlp_up": (18432, 7168),
                 "qwen3.qkv": (5120, 2048), "qwen3.q": (4096, 2048), "qwen3.kv": (512, 2048),
                 "qwen3.o": (2048, 4096), "qwen3.router": (128, 2048)}


def linear_rows(hbm: float, tokens=(1, 16, 512)) -> list[dict]:
    from ..kernels.triton import fp8
    from ..kernels.triton import quant_linear as ql
    rows = []
    for name, (N, K) in LINEAR_SHAPES.items():
        gen = torch.Generator().manual_seed(N + K)
        weights = {}
        for t in (GGMLType.Q4_K, GGMLType.Q8_0):
            raw = random_blocks(t, N * K // FORMATS[t].block_elems, gen)
            weights[t.name] = ql.from_ggml(raw, t, (N, K)).to("cuda")
        dense = (0.02 * torch.randn(N, K, generator=gen)).to("cuda", torch.bfloat16)
        f8 = fp8.quantize_fp8(dense.float()).to("cuda")
        for M in tokens:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            flops = 2.0 * M * N * K
            for fmt, w in weights.items():
                label = f"linear {fmt}->{'int4' if w.bits == 4 else 'int8'}"
                us = timed(lambda w=w: ql.group_gemm(x, w))
                rows.append(row(label, f"{name} M={M}", us, w.nbytes() + x.numel() * 2, flops, hbm))
            us = timed(lambda: fp8.fp8_gemm(x, f8))
            rows.append(row("linear fp8", f"{name} M={M}", us, f8.nbytes() + x.numel() * 2, flops, hbm))
            us = timed(lambda: F.linear(x, dense))
            rows.append(row("linear bf16 (torch)", f"{name} M={M}", us, dense.numel() * 2, flops, hbm))
            if M <= ql.GEMV_ROWS:
                us = timed(lambda: ql.dense_gemv(x, dense, torch.bfloat16))
                rows.append(row("linear bf16 (triton)", f"{name} M={M}", us, dense.numel() * 2, flops, hbm, "gemv"))
                if name.endswith("router"):  # the router's float32 weight (kept so at load)
                    d32 = dense.float()
                    us = timed(lambda: ql.dense_gemv(x, d32, torch.bfloat16))
                    rows.append(row("linear fp32 (triton)", f"{name} M={M}", us, d32.numel() * 4, flops, hbm, "gemv"))
                    us = timed(lambda: F.linear(x.float(), d32).to(torch.bfloat16))
                    rows.append(row("linear fp32 (torch)", f"{name} M={M}", us, d32.numel() * 4, flops, hbm,
                                    "+ casts"))
    return rows


def mla_rows(hbm: float) -> list[dict]:
    from ..kernels.triton.attention import decode_attention
    h, r, p = 128, 512, 64
    rows = []
    for B, L in ((1, 1024), (1, 8192), (8, 1024), (8, 8192)):
        slots_total = B * L
        cache = torch.randn(slots_total, r + p, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(slots_total, device="cuda").to(torch.int32).view(B, L)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        q_lat = torch.randn(B, h, r, device="cuda")
        q_rot = torch.randn(B, h, p, device="cuda")
        us = timed(lambda: decode_attention(q_lat, cache[:, None, :r], None, slots, lens, 0.07, q2=q_rot,
                                            k2=cache[:, None, r:]))
        flops = 2.0 * B * h * L * (r + p + r)
        rows.append(row("mla decode", f"B={B} L={L}", us, cache.numel() * 2, flops, hbm))
    # Qwen3-30B-A3B's GQA (32 query heads on 4 kv heads of 128) as a graph replays it: the slot
    # table as wide as the cache (8192), the history shorter
    hq, hkv, d, width = 32, 4, 128, 8192
    k, v = (torch.randn(width, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(width, device="cuda", dtype=torch.int32)[None]
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    for L in (512, 4096):
        lens = torch.full((1,), L, dtype=torch.int32, device="cuda")
        us = timed(lambda: decode_attention(q, k, v, slots, lens, 0.088, out_dtype=torch.bfloat16))
        rows.append(row("gqa decode", f"B=1 L={L}", us, 2 * L * hkv * d * 2, 4.0 * hq * L * d, hbm))
    return rows


def moe_rows(hbm: float, tokens=(1, 32, 512)) -> list[dict]:
    from ..kernels.triton import fused_moe as fm
    E, K, H, I = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(0)
    t = GGMLType.Q4_K
    per = FORMATS[t].block_elems
    raws = [random_blocks(t, E * I * H // per, gen) for _ in range(3)]
    int4 = (fm.stack_group_weights([(raws[0], t, (E, I, H)), (raws[1], t, (E, I, H))]).to("cuda"),
            fm.stack_group_weights([(raws[2], t, (E, H, I))]).to("cuda"))
    bf16 = ((0.02 * torch.randn(E, 2 * I, H)).to("cuda", torch.bfloat16), (0.02 * torch.randn(E, H, I)).to("cuda", torch.bfloat16))
    rows = []
    for T in tokens:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to("cuda")
        w = torch.rand(T, K, device="cuda")
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        touched = int(ids.unique().numel())
        for name, (gu, dn) in (("int4", int4), ("bf16", bf16)):
            per_expert = ((gu.nbytes() + dn.nbytes()) if name == "int4" else (gu.numel() + dn.numel()) * 2) // E
            us = timed(lambda gu=gu, dn=dn: fm.fused_moe(x, ids, w, gu, dn))
            rows.append(row(f"fused moe {name}", f"qwen3 T={T}", us, touched * per_expert, 6.0 * T * K * H * I, hbm,
                            f"{touched} experts touched"))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=["linear", "mla", "moe"], choices=["linear", "mla", "moe"])
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device")
    hbm = copy_gbps()
    print(f"# {torch.cuda.get_device_name()}: device copy bandwidth {hbm:.0f} GB/s")
    if not args.json:
        print(f"{'kernel':<24} {'shape':<22} {'median_us':>10} {'MB':>9} {'GB/s':>8} {'TFLOP/s':>8} {'ratio':>6}  note")
    for part in args.only:
        for r in {"linear": linear_rows, "mla": mla_rows, "moe": moe_rows}[part](hbm):
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{r['kernel']:<24} {r['shape']:<22} {r['median_us']:>10.1f} {r['bytes'] / 1e6:>9.2f} "
                      f"{r['gbps']:>8.0f} {r['tflops']:>8.2f} {r['ratio']:>6.2f}  {r['note']}", flush=True)


if __name__ == "__main__":
    main()
