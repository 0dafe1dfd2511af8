"""Does the CPU experts' decode rate depend on how much expert memory a process holds?

One Qwen3-30B-A3B-shaped Q4_K_M layer is made once and copied into N fresh layers (as a 48-layer
model holds); T=1 calls, timed inside the kernel, cycle over the first k copies for several k, with
the weight buffers in 4 KiB pages (where transparent huge pages are "madvise", not "always") and
then advised for huge pages (KT_HUGEPAGES=1). Needs ~0.4 GiB of free RAM a copy (18 GiB for 48).
Prints the OS's huge-page settings, the NUMA nodes, how many huge pages the buffers got, and for
each k the kernel's median, its GB/s and the ratio to the stream probe of the same run, then the
same tasks over all N copies reading their bytes and computing nothing (what the task structure
alone reads at), and (4 KiB pages) each call run again right after those reads or after itself
(its bytes then in the caches: the kernel's rate when memory is not what it waits for). With
SWEEP=1, then a sweep over all N copies of the tiled kernels' prefetch distance and hint, the
decode tasks a thread and the tasks' prologue prefetch (two rounds, interleaved).
    python dev/cpu_footprint.py [threads] [copies] [k ...]"""
import os
import statistics
import sys
import time

import torch

from ktransformers.bench.moe import SHAPES, Layer, build_layers, make_calls, stream_gbps, time_layer
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


def time_second(runtime, layers: list[Layer], calls, reads_first: bool) -> float:
    """Each call run twice in a row, cycling over all layers: the median microseconds of the
    second run, inside the kernel. With reads_first the first run only reads (set_moe_read_only):
    the call's bytes are then in the caches, brought by the same tasks a call runs; else the first
    run is the call itself. Against the cold call, what its bytes being cached would gain."""
    inside = []
    for i, (x, ids, w) in enumerate(calls):
        layer = layers[i % len(layers)]
        runtime.ext.set_moe_read_only(reads_first)
        try:
            layer.kernel.forward(x, ids, w)
        finally:
            runtime.ext.set_moe_read_only(False)
        layer.kernel.forward(x, ids, w)
        if i >= 2:
            inside.append(layer.kernel.last_seconds() * 1e6)
    return statistics.median(inside)


def sweep(runtime, layers, calls, touched: float, stream: float) -> None:
    ext = runtime.ext
    saved = ext.tile_prefetch()
    pf = ((4096, 0), (8192, 0), (4096, 2), (8192, 2))
    configs = [(b, h, t, p) for t in (4, 8) for b, h in pf for p in (True, False)] + [(0, 0, 4, False)]
    results = {c: [] for c in configs}
    for _ in range(2):
        for c in configs:
            ext.set_tile_prefetch(c[0], c[1])
            ext.set_moe_tasks_per_thread(c[2])
            ext.set_task_prologue(c[3])
            results[c].append(time_cycled(layers, calls, len(layers)))
    ext.set_tile_prefetch(*saved)
    ext.set_moe_tasks_per_thread(int(os.environ.get("KT_MOE_TASKS", "0")))  # (as CPURuntime set them)
    ext.set_task_prologue(True)
    print(f"{'prefetch':>8} {'hint':>4} {'tasks':>5} {'prologue':>8} {'kernel us (2 rounds)':>21} {'ratio':>5}")
    for (b, h, t, p), us in sorted(results.items(), key=lambda kv: min(kv[1])):
        print(f"{b:>8} {('t0', 't1', 't2', 'nta')[h]:>4} {t:>5} {'on' if p else 'off':>8} {us[0]:>10.1f} {us[1]:>10.1f} "
              f"{touched / min(us) / 1e3 / stream:>5.2f}", flush=True)


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
    for huge in ("0", "1"):
        os.environ["KT_HUGEPAGES"] = huge
        before = anon_huge_mib()
        t0 = time.perf_counter()
        layers = copies_of(runtime, base, n, shape)
        made = time.perf_counter() - t0
        stream = stream_gbps(runtime)
        print(f"\nKT_HUGEPAGES={huge}: {n} copies, {n * per_layer / 2**30:.1f} GiB in {made:.1f} s; "
              f"anonymous huge pages {anon_huge_mib() - before:+.0f} MiB; stream {stream:.1f} GB/s")
        print(f"{'cycled':>6} {'GiB':>6} {'kernel us':>9} {'GB/s':>6} {'ratio':>5}")
        for k in ks:
            us = time_cycled(layers, calls, k)
            print(f"{k:>6} {k * per_layer / 2**30:>6.1f} {us:>9.1f} {touched / us / 1e3:>6.1f} "
                  f"{touched / us / 1e3 / stream:>5.2f}", flush=True)
        runtime.ext.set_moe_read_only(True)  # the same tasks reading the same bytes, computing nothing
        try:
            us = time_cycled(layers, calls, n)
        finally:
            runtime.ext.set_moe_read_only(False)
        print(f"{'reads':>6} {n * per_layer / 2**30:>6.1f} {us:>9.1f} {touched / us / 1e3:>6.1f} "
              f"{touched / us / 1e3 / stream:>5.2f}  (the tasks' reads alone: set_moe_read_only)", flush=True)
        if huge == "0":
            for reads_first, what in ((True, "after the same tasks read its bytes"), (False, "after the same call")):
                us = time_second(runtime, layers, calls, reads_first)
                print(f"{'again':>6} {'':>6} {us:>9.1f} {touched / us / 1e3:>6.1f} {touched / us / 1e3 / stream:>5.2f}"
                      f"  (each call {what})", flush=True)
        if os.environ.get("SWEEP") == "1":
            sweep(runtime, layers, calls, touched, stream)
        del layers


if __name__ == "__main__":
    main()
