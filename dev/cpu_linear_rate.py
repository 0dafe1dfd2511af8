"""How fast one CPU linear kernel reads its weights, from RAM or from cache: `copies` random
matrices of N x 2048 values of a GGML type, each multiplied by one token in turn (T=1, as a
decode step does); bytes of weights / time. One copy of a matrix that fits the L3 cache
measures the arithmetic; many copies measure RAM.
    python dev/cpu_linear_rate.py THREADS [TYPE [N [COPIES]]]     (default Q4_K 16384 8)"""
import statistics
import sys
import time

import torch

from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, LinearKernel
from ktransformers.weights import ggml_quants as gq

threads = int(sys.argv[1])
fmt = sys.argv[2] if len(sys.argv) > 2 else "Q4_K"
N, K = (int(sys.argv[3]) if len(sys.argv) > 3 else 16384), 2048
copies = int(sys.argv[4]) if len(sys.argv) > 4 else 8
rt = CPURuntime(threads)
t = gq.ggml_type(fmt)
kernels = []
for _ in range(copies):
    raw = gq.random_blocks(t, N * K // gq.FORMATS[t].block_elems).reshape(-1)
    kernels.append(LinearKernel(rt, in_features=K, out_features=N, weight=ExpertWeights(raw, int(t))))
x = torch.randn(1, K)
for k in kernels:
    k.forward(x)
times = []
for _ in range(10):
    t0 = time.perf_counter()
    for k in kernels:
        k.forward(x)
    times.append((time.perf_counter() - t0) / copies)
med = statistics.median(times)
print(f"{fmt} {N}x{K} x{copies}, {threads} threads, tiled={kernels[0]._weight.tiled}: "
      f"{med * 1e6:.1f} us a matrix, {raw.numel() / med / 1e9:.1f} GB/s")
