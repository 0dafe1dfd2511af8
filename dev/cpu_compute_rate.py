"""How fast does the T=1 MoE kernel compute when its bytes are already in the caches, by thread
count? Beside it, the stream probe at the same thread count (what DRAM gives those threads).

A Qwen3-30B-A3B-shaped Q4_K_M layer cut to 8 experts, with top_k 8: every call reads the same
24.5 MB (in Q4_K_M), which stay in a large L3 (the GPU host's 300 MiB) from call to call. Where the kernel's
rate here is close to the stream's, the decode kernel is compute-bound at that thread count, and
reading its bytes sooner (into the caches) cannot make it faster.
    python dev/cpu_compute_rate.py [threads ...]   (default: 1 2 4 8 and all cores)
KT_RATE_FORMATS (default "Q4_K_M") names the bench.moe formats to time, e.g. "Q4_K Q6_K Q8_0"."""
import os
import sys

import torch

from ktransformers.bench.moe import SHAPES, build_layers, make_calls, stream_gbps, time_layer
from ktransformers.kernels.cpu import CPURuntime


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    counts = [int(a) for a in sys.argv[1:]] or sorted({t for t in (1, 2, 4, 8, cores) if t <= cores})
    shape = dict(SHAPES["qwen3"])
    formats = os.environ.get("KT_RATE_FORMATS", "Q4_K_M").split()
    print(f"{'format':>7} {'threads':>7} {'isa':>6} {'kernel us':>9} {'GB/s':>6} {'GB/s a thread':>13} {'stream GB/s':>11} {'ratio':>5}")
    for fmt, threads in ((f, t) for f in formats for t in counts):
        runtime = CPURuntime(threads)
        gen = torch.Generator().manual_seed(0)
        layer = build_layers(runtime, shape, fmt, 1, 8, gen)[0]
        _, inside, touched = time_layer([layer], make_calls(40, 1, 8, 8, shape["hidden"], gen))
        us = inside * 1e6
        gbps = touched / us / 1e3
        stream = stream_gbps(runtime)
        print(f"{fmt:>7} {threads:>7} {runtime.isa:>6} {us:>9.1f} {gbps:>6.1f} {gbps / threads:>13.1f} {stream:>11.1f} "
              f"{gbps / stream:>5.2f}", flush=True)
        del layer, runtime


if __name__ == "__main__":
    main()
