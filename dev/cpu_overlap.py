"""How much of the T=1 MoE kernel's arithmetic hides under its reads from RAM, by thread count:
the kernel, then the same tasks reading the same bytes with no arithmetic (the read-only mode), in
turns, on a Qwen3-30B-A3B-shaped layer (Q4_K_M, or --format) cycled through 3 copies (as bench.moe does), with
a 1 GiB stream probe before each pair. Noisy machines move all three together; the ratios of a
pair move much less than any one figure (the dev VM reads 27-67 GB/s by the minute).
    python dev/cpu_overlap.py [THREADS ...] [--rounds N] [--prefetch BYTES:HINT ...]
--prefetch adds the kernel at other software-prefetch settings (CPURuntime's KT_CPU_PREFETCH
bytes and hint index 0-3: t0, t1, t2, nta) to the turns, each against the same read-only runs."""
import argparse
import statistics

import torch

from ktransformers.bench.moe import SHAPES, build_layers, make_calls
from ktransformers.kernels.cpu import CPURuntime


def median_gbps(runtime, layers, calls, read_only: bool) -> float:
    """Median in-kernel rate (GB/s of weights touched) over the calls, the layers in turn."""
    runtime.ext.set_moe_read_only(read_only)
    try:
        rates = []
        for i, (x, ids, w) in enumerate(calls):
            layer = layers[i % len(layers)]
            layer.kernel.forward(x, ids, w)
            rates.append(len(torch.unique(ids)) * layer.expert_bytes / layer.kernel.last_seconds() / 1e9)
        return statistics.median(rates[2:])
    finally:
        runtime.ext.set_moe_read_only(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=80)
    p.add_argument("--prefetch", nargs="*", default=[], metavar="BYTES:HINT")
    p.add_argument("--format", default="Q4_K_M", help="a bench.moe format (default Q4_K_M)")
    args = p.parse_args()
    shape = SHAPES["qwen3"]
    print(f"{'threads':>7} {'prefetch':>9} {'probe GB/s':>10} {'read-only GB/s':>14} {'kernel GB/s':>11} "
          f"{'kernel/read':>11} {'kernel/probe':>12}")
    for threads in args.threads:
        runtime = CPURuntime(threads)
        default = runtime.ext.tile_prefetch()
        gen = torch.Generator().manual_seed(0)
        layers = build_layers(runtime, shape, args.format, 3, shape["experts"], gen)
        calls = make_calls(args.calls, 1, shape["experts"], shape["top_k"], shape["hidden"], gen)
        buf = runtime.probe_buffer(1.0)
        settings = [None] + [tuple(int(v) for v in s.split(":")) for s in args.prefetch]
        rows = {s: [] for s in settings}
        for _ in range(args.rounds):
            probe = runtime.stream_gbps(repeats=1, buffer=buf)
            read = median_gbps(runtime, layers, calls, True)
            for s in settings:
                if s is not None:
                    runtime.ext.set_tile_prefetch(*s)
                rows[s].append((probe, read, median_gbps(runtime, layers, calls, False)))
                if s is not None:
                    runtime.ext.set_tile_prefetch(*default)
        for s, got in rows.items():
            probe, read, kernel = (statistics.median(g[i] for g in got) for i in range(3))
            label = "default" if s is None else f"{s[0]}:{s[1]}"
            print(f"{threads:>7} {label:>9} {probe:>10.1f} {read:>14.1f} {kernel:>11.1f} "
                  f"{statistics.median(g[2] / g[1] for g in got):>11.2f} "
                  f"{statistics.median(g[2] / g[0] for g in got):>12.2f}", flush=True)
        del layers, runtime


if __name__ == "__main__":
    main()
