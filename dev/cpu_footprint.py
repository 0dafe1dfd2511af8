"""Does the CPU experts' decode rate depend on how much expert memory a process holds?

One Qwen3-30B-A3B-shaped Q4_K_M layer is made once and copied into N fresh layers (as a 48-layer
model holds); T=1 calls, timed inside the kernel, cycle over the first k copies for several k, with
the weight buffers in 4 KiB pages (plain torch.empty in place of kernels.cpu.weight_empty; 4 KiB
where transparent huge pages are "madvise", not "always"), then as the product makes them (advised
for huge pages). Needs ~0.4 GiB of free RAM a copy (18 GiB for 48).
Prints the OS's huge-page settings, the NUMA nodes, how many huge pages the buffers got, and for
each k the kernel's median, its GB/s and the ratio to the stream probe of the same run. (Its read-only
tasks and the prefetch/tasks sweep used switches since taken out of the kernels; dev/README.md
keeps what they answered.)
    python dev/cpu_footprint.py [threads] [copies] [k ...]"""
import os
import statistics
import sys
import time

import torch

from ktransformers.bench.moe import SHAPES, Layer, build_layers, make_calls, stream_gbps, time_layer
from ktransformers.kernels import cpu as kcpu
from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, MoEKernel


def anon_huge_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def show(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.strerror})"


def copies_of(runtime, layer: Layer, n: int, shape: dict) -> list[Layer]:
    """n fresh copies of the layer's blocks, each its own kernel (tiles repacked as a model's are)."""
    H, I, E, K = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    out = []
    for _ in range(n):
        w = [ExpertWeights(p.data.clone(), p.ggml_type) for p in layer.weights]
        kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=w[0], up=w[1], down=w[2],
                           max_tokens=16)
        out.append(Layer(kernel, layer.expert_bytes, ()))
    return out


def time_cycled(layers: list[Layer], calls, k: int) -> float:
    """Median microseconds inside the kernel of the calls, cycling over the first k layers."""
    return time_layer(layers[:k], calls)[1] * 1e6


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else None
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    ks = [int(a) for a in sys.argv[3:]] or [2, 12, n]
    print("THP enabled:", show("/sys/kernel/mm/transparent_hugepage/enabled"))
    print("THP defrag: ", show("/sys/kernel/mm/transparent_hugepage/defrag"))
    nodes = sorted(d for d in os.listdir("/sys/devices/system/node") if d.startswith("node"))
    print("NUMA nodes:", ", ".join(f"{d} cpus {show(f'/sys/devices/system/node/{d}/cpulist')}" for d in nodes))
    runtime = CPURuntime(threads)
    shape = SHAPES["qwen3"]
    gen = torch.Generator().manual_seed(0)
    base = build_layers(runtime, shape, "Q4_K_M", 1, shape["experts"], gen, tiles=False)[0]
    per_layer = base.expert_bytes * shape["experts"]
    calls = make_calls(4 * n + 2, 1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    touched = statistics.mean(len(torch.unique(ids)) * base.expert_bytes for _, ids, _ in calls)
    advised = kcpu.weight_empty
    for huge in ("0", "1"):
        kcpu.weight_empty = advised if huge == "1" else (lambda shape, dtype=torch.uint8: torch.empty(shape, dtype=dtype))
        before = anon_huge_mib()
        t0 = time.perf_counter()
        layers = copies_of(runtime, base, n, shape)
        made = time.perf_counter() - t0
        stream = stream_gbps(runtime)
        print(f"\nhuge pages {('off', 'advised')[int(huge)]}: {n} copies, {n * per_layer / 2**30:.1f} GiB in {made:.1f} s; "
              f"anonymous huge pages {anon_huge_mib() - before:+.0f} MiB; stream {stream:.1f} GB/s")
        print(f"{'cycled':>6} {'GiB':>6} {'kernel us':>9} {'GB/s':>6} {'ratio':>5}")
        for k in ks:
            us = time_cycled(layers, calls, k)
            print(f"{k:>6} {k * per_layer / 2**30:>6.1f} {us:>9.1f} {touched / us / 1e3:>6.1f} "
                  f"{touched / us / 1e3 / stream:>5.2f}", flush=True)
        del layers


if __name__ == "__main__":
    main()
