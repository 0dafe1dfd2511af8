"""Is the gated delta rule's chunked form (64-token chunks, the state read and written once a
chunk: csrc/deltanet.cpp's chunk_rule at the commit that added this file) faster on the CPU than
the token-by-token recurrence for a prefill?

Run at that commit: calls of >= 64 tokens take the chunked form, so 63-token calls time the
recurrence on the same inputs. Qwen3-Next's layer shape (16 key / 32 value heads of 128), 512
tokens, the runtime's threads (default 2).
"""
import sys
import time

import torch

from ktransformers.kernels.cpu import CPURuntime, gated_delta_rule

rt = CPURuntime(threads=int(sys.argv[1]) if len(sys.argv) > 1 else 2)
B, T, Hk, Hv, Dk, Dv = 1, 512, 16, 32, 128, 128
gen = torch.Generator().manual_seed(0)
q, k = (torch.randn(B, T, Hk, Dk, generator=gen) for _ in range(2))
v = torch.randn(B, T, Hv, Dv, generator=gen)
g, beta = -torch.rand(B, T, Hv, generator=gen), torch.rand(B, T, Hv, generator=gen)


def chunked():
    gated_delta_rule(rt, q, k, v, g, beta, torch.zeros(B, Hv, Dk, Dv))


def recurrent():
    state = torch.zeros(B, Hv, Dk, Dv)
    for a in range(0, T, 63):
        gated_delta_rule(rt, *(t[:, a:a + 63].contiguous() for t in (q, k, v, g, beta)), state)


for f in (chunked, recurrent, chunked, recurrent):
    f()
    start = time.perf_counter()
    f(), f()
    print(f"{f.__name__}: {(time.perf_counter() - start) / 2 * 1e3:.1f} ms")
