"""Does it matter where the calling thread runs? bench.moe's Qwen3 Q4_K_M layer at T=1, timed
inside the kernel, with the Python thread (the pool's thread 0 of a synchronous call) free to
move or pinned to the first allowed core, as the doorbell pins itself, in alternating rounds.
(In 2026-12-01's calls on the GPU host the doorbell's calls took 156-195 us a layer where
bench.moe's took 222-267 us inside the kernel, for the same bytes.)
    python dev/caller_pin_ab.py [threads] [rounds]
The 2-core dev machine, 2026-12-01: 560 / 558 us, no difference."""
import os
import sys

import torch

from ktransformers.bench.moe import SHAPES, build_layers, make_calls, stream_gbps, time_layer
from ktransformers.kernels.cpu import CPURuntime

threads = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count()
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
runtime = CPURuntime(threads)
gen = torch.Generator().manual_seed(0)
shape = SHAPES["qwen3"]
layers = build_layers(runtime, shape, "Q4_K_M", 3, shape["experts"], gen)
calls = make_calls(300, 1, shape["experts"], shape["top_k"], shape["hidden"], gen)
allowed = sorted(os.sched_getaffinity(0))


def median_kernel_us() -> float:
    return time_layer(layers, calls)[1] * 1e6


for r in range(rounds):
    os.sched_setaffinity(0, set(allowed))
    free = median_kernel_us()
    os.sched_setaffinity(0, {allowed[0]})
    pinned = median_kernel_us()
    os.sched_setaffinity(0, set(allowed))
    print(f"round {r}: caller free {free:.1f} us, pinned {pinned:.1f} us, stream {stream_gbps(runtime, 1.0, 3):.1f} GB/s",
          flush=True)
