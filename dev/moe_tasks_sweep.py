"""How finely a decode call's MoE work is split (KT_MOE_TASKS: tasks a thread a phase) against its
speed: the Qwen3-30B-A3B Q4_K_M layer of bench.moe at T=1 and T=4, timed inside the kernel (what a
call fed from a GPU stream costs), three rounds over the settings so drifts show.
    python dev/moe_tasks_sweep.py THREADS TASKS [TASKS ...]      e.g. 16 2 4 8 16"""
import sys

import torch

import ktransformers.bench.moe as bm
from ktransformers.kernels.cpu import CPURuntime

threads, settings = int(sys.argv[1]), [int(a) for a in sys.argv[2:]] or [16]
runtime = CPURuntime(threads)
shape = bm.SHAPES["qwen3"]
gen = torch.Generator().manual_seed(0)
layers = bm.build_layers(runtime, shape, "Q4_K_M", 8, shape["experts"], gen)


def run(T: int, n: int = 60) -> tuple[float, float]:
    calls = bm.make_calls(n, T, shape["experts"], shape["top_k"], shape["hidden"], gen)
    _, inside, nbytes = bm.time_layer(layers, calls)
    return inside * 1e6, nbytes / inside / 1e9


stream = bm.stream_gbps(runtime, 2.0)
print(f"{threads} threads, stream {stream:.1f} GB/s")
for _ in range(3):
    for tasks in settings:
        runtime.ext.set_moe_tasks_per_thread(tasks)
        (us1, gb1), (us4, gb4) = run(1), run(4)
        print(f"KT_MOE_TASKS={tasks:<3d} T=1 {us1:7.1f} us {gb1:6.1f} GB/s ({gb1 / stream:.2f})   "
              f"T=4 {us4:7.1f} us {gb4:6.1f} GB/s ({gb4 / stream:.2f})", flush=True)
