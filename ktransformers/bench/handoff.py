"""GPU -> CPU experts -> GPU inside a CUDA graph: what the hand-off costs per layer.

    python -m ktransformers.bench.handoff [--layers 48] [--threads 14] [--shapes tiny qwen3]

A decode step of a hybrid model is a chain of layers, each a GPU part whose output the CPU experts
need and whose next layer needs their result. This captures such a chain — per layer a small GPU
op, the CPU experts of one token (kernels/cuda_host.submit_on_stream), and an add of their output
— in one CUDA graph, and times its replays for each hand-off (`--modes`: `doorbell`, `host`)
against the same chain without the CPU call (`gpu only`) and the CPU kernel called alone from
Python. overhead = per layer - gpu only - CPU alone: what the start and the wait cost. The
`tiny` shape (E 8, H 2048, I 256) leaves almost nothing but the hand-off; `qwen3` is
Qwen3-30B-A3B's layer in Q4_K_M (8 copies cycled, so experts come from RAM).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from ..kernels.cpu import CPURuntime
from ..kernels.cuda_host import HostStaging, submit_on_stream
from .moe import SHAPES, build_layers, make_calls, time_layer

BENCH_SHAPES = {"tiny": dict(hidden=2048, intermediate=256, experts=8, top_k=2), "qwen3": SHAPES["qwen3"]}


def chain(layers, staging, base, ids, weights, n: int):
    """The captured step: n layers of (GPU op -> CPU experts -> add), or no CPU call without staging."""
    x = base
    for i in range(n):
        h = x * 1e-3 + base  # GPU work the CPU call depends on (bounded values)
        if staging is None:
            x = h + h
        else:
            wait = submit_on_stream(layers[i % len(layers)].kernel, staging, h, ids[i], weights[i], torch.bfloat16)
            x = h + wait()
    return x


def time_graph(fn, replays: int) -> float:
    """Median seconds of a replay of the CUDA graph of fn() (run twice eagerly first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for i in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_shape(args, runtime, name: str) -> list[dict]:
    shape = BENCH_SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    copies = 1 if name == "tiny" else args.copies
    layers = build_layers(runtime, shape, "Q4_K_M", copies, shape["experts"], gen)
    calls = make_calls(20, 1, shape["experts"], shape["top_k"], shape["hidden"], gen)
    alone, _ = time_layer(layers, calls)  # the CPU kernel called from Python, tensors on the CPU
    dev = torch.device("cuda")
    n = args.layers
    base = torch.randn(1, shape["hidden"], generator=gen).to(dev, torch.bfloat16)
    route = [make_calls(1, 1, shape["experts"], shape["top_k"], shape["hidden"], gen)[0] for _ in range(n)]
    ids = [r[1].to(dev) for r in route]
    weights = [r[2].to(dev) for r in route]
    gpu_only = time_graph(lambda: chain(layers, None, base, ids, weights, n), args.replays) / n
    rows = []
    for mode in args.modes:
        staging = HostStaging(runtime, handoff=mode)
        used = staging.handoff(dev)  # (host where the doorbell's stream memory operations do not work)
        per_layer = time_graph(lambda s=staging: chain(layers, s, base, ids, weights, n), args.replays) / n
        staging.check_errors()
        rows.append(dict(shape=name, mode=used, layers=n, threads=runtime.threads, us_per_layer=per_layer * 1e6,
                         gpu_only_us=gpu_only * 1e6, cpu_alone_us=alone * 1e6,
                         overhead_us=(per_layer - gpu_only - alone) * 1e6))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--shapes", nargs="+", default=["tiny", "qwen3"], choices=sorted(BENCH_SHAPES))
    p.add_argument("--modes", nargs="+", default=["doorbell", "host"], choices=["doorbell", "host"])
    p.add_argument("--copies", type=int, default=8, help="copies of the qwen3 layer cycled (cold caches)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.handoff needs a CUDA device")
    runtime = CPURuntime(args.threads)
    rows = [r for name in args.shapes for r in run_shape(args, runtime, name)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{torch.cuda.get_device_name()}, {runtime.threads} CPU threads ({runtime.isa}), "
          f"{args.layers} layers a graph, median of {args.replays} replays")
    print(f"{'shape':<7}{'hand-off':<10}{'us/layer':>10}{'gpu only':>10}{'CPU alone':>11}{'overhead':>10}")
    for r in rows:
        print(f"{r['shape']:<7}{r['mode']:<10}{r['us_per_layer']:>10.1f}{r['gpu_only_us']:>10.1f}"
              f"{r['cpu_alone_us']:>11.1f}{r['overhead_us']:>10.1f}")


if __name__ == "__main__":
    main()
