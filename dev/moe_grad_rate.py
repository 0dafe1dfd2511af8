"""Where does a training step's CPU-experts time go, and how close is each part to the memory
stream? One Qwen3-30B-A3B-shaped layer (random Q4_K_M blocks, 128 experts, top-8), T tokens of
uniform routing: the forward on the stored tiles and on int8 copies (int8_prefill), the backward
on the stored blocks and on the int8 copies (int8_backward), recomputing g and u or taking the
forward's (forward_keeping), each timed (median of 5) with the
bytes of expert weights it must read and the GB/s that makes, beside the stream probe.

    python dev/moe_grad_rate.py [threads] [T ...]
"""
import statistics
import sys
import time

import torch

from ktransformers.bench.moe import SHAPES, build_layers, stream_gbps
from ktransformers.kernels.cpu import CPURuntime

threads = int(sys.argv[1]) if len(sys.argv) > 1 else None
token_counts = [int(t) for t in sys.argv[2:]] or [64, 256, 512]
rt = CPURuntime(threads)
shape = SHAPES["qwen3"]
E, H, I, K = shape["experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
gen = torch.Generator().manual_seed(0)
plain, = build_layers(rt, shape, "Q4_K_M", 1, E, gen)
int8, = build_layers(rt, shape, "Q4_K_M", 1, E, gen, int8=True)
blocks, = build_layers(rt, shape, "Q4_K_M", 1, E, gen, tiles=False)
int8.kernel.int8_backward = True
print(f"# {rt.isa}, {rt.threads} threads, stream {stream_gbps(rt):.1f} GB/s")
print("| T | pairs | experts | op | ms | weight MB | GB/s |")
print("|---|---|---|---|---|---|---|")


def timed(fn, n=5):
    fn()
    out = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - s)
    return statistics.median(out)


for T in token_counts:
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    dy = torch.randn(T, H)
    active = len(torch.unique(ids))
    m = active * H * I  # one matrix of the touched experts, int8 bytes
    q4 = plain.expert_bytes * active
    kept = int8.kernel.forward_keeping(x, ids, w)[1]
    rows = [("forward, tiles", lambda: plain.kernel.forward(x, ids, w), q4),
            ("forward, int8 copies", lambda: int8.kernel.forward(x, ids, w), 3 * m),
            ("forward keeping g, u, int8 copies", lambda: int8.kernel.forward_keeping(x, ids, w), 3 * m),
            ("backward, int8 copies", lambda: int8.kernel.backward(x, ids, w, dy), 5 * m),
            ("backward, int8 copies, kept g, u", lambda: int8.kernel.backward(x, ids, w, dy, kept), 3 * m),
            ("backward, stored blocks", lambda: blocks.kernel.backward(x, ids, w, dy), 2 * q4)]
    for name, fn, nbytes in rows:
        s = timed(fn)
        print(f"| {T} | {T * K} | {active} | {name} | {s * 1e3:.2f} | {nbytes / 1e6:.0f} | {nbytes / s / 1e9:.1f} |")
