"""On the GPU machine: the rates of layer-wise prefill's staging steps, one layer's worth of bytes
(385 MB, a Qwen3-30B-A3B Q4_K_M layer's experts) read from a mapped GGUF:
mapped file -> pinned (CPU pool), pinned -> GPU (copy engine), both at once in 32 MiB chunks.
    python dev/gpu_staging.py /tmp/q3-48.gguf [threads]"""
import sys
import time

import numpy as np
import torch

from ktransformers.kernels.cpu import CPURuntime

path, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14
n = 385 << 20
data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", offset=1 << 30, shape=(4 * n,)))
rt = CPURuntime(threads)
pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
gpu = torch.empty(n, dtype=torch.uint8, device="cuda")


def timed(label, fn, nbytes=n):
    fn()
    torch.cuda.synchronize()
    t = []
    for i in range(5):
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    t.sort()
    print(f"{label:44s} {t[2] * 1e3:8.2f} ms  {nbytes / t[2] / 1e9:6.1f} GB/s")


timed("file -> pinned (pool copy)", lambda i=0: rt.copy(pinned, data[(i % 4) * n:(i % 4 + 1) * n]))
timed("pinned -> GPU (one copy)", lambda i=0: gpu.copy_(pinned, non_blocking=True))
timed("pageable file -> GPU (one copy)", lambda i=0: gpu.copy_(data[(i % 4) * n:(i % 4 + 1) * n], non_blocking=True))
chunk = 32 << 20
stream = torch.cuda.Stream()


def chunked(i=0):
    src = data[(i % 4) * n:(i % 4 + 1) * n]
    with torch.cuda.stream(stream):
        for c in range(0, n, chunk):
            e = min(n, c + chunk)
            rt.copy(pinned[c:e], src[c:e])
            gpu[c:e].copy_(pinned[c:e], non_blocking=True)
    stream.synchronize()


timed("file -> pinned -> GPU, 32 MiB chunks", chunked)

# the GPU's share of a layer: GGML -> bf16 (a Qwen3 gate tensor, Q4_K [128, 768, 2048]), the
# Triton kernel against the torch reference
from ktransformers.kernels.triton import dequant as D  # noqa: E402
from ktransformers.weights import ggml_quants as gq  # noqa: E402

for name in ("Q4_K", "Q6_K"):
    t = gq.ggml_type(name)
    shape = (128, 768, 2048)
    raw = gq.random_blocks(t, 128 * 768 * 2048 // 256).reshape(-1).cuda()
    out_bytes = 128 * 768 * 2048 * 2
    timed(f"dequantize {name} -> bf16, Triton", lambda i=0: D.dequantize(raw, t, shape), raw.numel() + out_bytes)
    timed(f"dequantize {name} -> bf16, torch reference", lambda i=0: gq.dequantize(raw, t, shape, torch.bfloat16),
          raw.numel() + out_bytes)
