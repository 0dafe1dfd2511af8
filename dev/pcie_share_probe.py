"""Would the GPU reading some of a token's experts over the bus speed up CPU decode? The CPU
kernel's T=1 time (inside the kernel) for a Qwen3 Q4_K_M layer with 8, 7 and 6 of the token's
experts, alone and while the GPU reads pinned host memory in place without pause (the bus's
share of the host's memory bandwidth taken). Layer copies cycled as bench.moe does.

    python dev/pcie_share_probe.py [THREADS] [COPIES]
"""
from __future__ import annotations

import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pcie_probe import gpu_reading  # noqa: E402

from ktransformers.bench.moe import SHAPES, build_layers, make_calls, stream_gbps  # noqa: E402
from ktransformers.kernels.cpu import CPURuntime, MoEKernel  # noqa: E402


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    copies = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    rt = CPURuntime(threads)
    shape = SHAPES["qwen3"]
    gen = torch.Generator().manual_seed(0)
    layers = build_layers(rt, shape, "Q4_K_M", copies, shape["experts"], gen)
    H, I, E = shape["hidden"], shape["intermediate"], shape["experts"]
    kernels = {8: [la.kernel for la in layers]}
    for k in (7, 6):
        kernels[k] = [MoEKernel(rt, experts=E, top_k=k, hidden=H, intermediate=I, gate=la.kernel._weights[0],
                                up=la.kernel._weights[1], down=la.kernel._weights[2], max_tokens=1)
                      for la in layers]
    calls = make_calls(60, 1, E, 8, H, gen)
    per_expert = layers[0].expert_bytes

    def time_k(k: int) -> float:
        inside = []
        for i, (x, ids, w) in enumerate(calls):
            kern = kernels[k][i % copies]
            kern.forward(x, ids[:, :k].contiguous(), w[:, :k].contiguous())
            if i >= 2:
                inside.append(kern.last_seconds())
        return statistics.median(inside)

    host = torch.empty(1 << 28, dtype=torch.int32, pin_memory=True)
    host.fill_(1)
    out = torch.empty(4096, dtype=torch.int32, device="cuda")
    for rnd in range(3):
        stream = stream_gbps(rt, 2.0)
        alone = {k: time_k(k) for k in (8, 7, 6)}
        with gpu_reading(host, out, launches=1) as rates:
            busy = {k: time_k(k) for k in (8, 7, 6)}
        print(f"round {rnd}: stream {stream:.1f} GB/s; GPU reading {statistics.median(rates):.1f} GB/s meanwhile")
        for k in (8, 7, 6):
            print(f"  {k} experts: alone {alone[k] * 1e6:7.1f} us ({k * per_expert / alone[k] / 1e9:5.1f} GB/s), "
                  f"GPU reading {busy[k] * 1e6:7.1f} us ({k * per_expert / busy[k] / 1e9:5.1f} GB/s)")
        for g in (1, 2):
            gpu_us = g * per_expert / 39e9 * 1e6  # the 6 MiB zero-copy read's rate measured by pcie_probe.py
            print(f"  split {8 - g}+{g}: CPU {busy[8 - g] * 1e6:.1f} us, GPU ~{gpu_us:.1f} us "
                  f"against {alone[8] * 1e6:.1f} us all on the CPU")


if __name__ == "__main__":
    main()
