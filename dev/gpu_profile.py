"""On the GPU machine, a synthetic Qwen3-30B-A3B-shaped file decoding:
- `kernels` (default): which CUDA kernels a hybrid decode step launches and how long each takes
  (torch.profiler over eager steps), after the step time with and without CUDA graphs;
- `host`: where the host's time goes in a CUDA-graph decode step (what `bench.e2e` calls issuing
  the step), phase by phase, then torch.profiler's CPU-side ops and a cProfile of the steps;
- `timeline`: CUDA-graph steps under torch.profiler, each kernel charged with what it adds to the
  stream's timeline (its end minus the latest end before it: with PDL a kernel starts before the
  one ahead ends, so its own duration double-counts), summed by name.
    python dev/gpu_profile.py /tmp/q3-4.gguf [threads] [kernels|host|timeline]"""
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ktransformers.engine.generate import Engine
from ktransformers.loader import load_model


def warm_engine(model, graphs: bool):
    """An engine holding one 512-token sequence that has decoded five tokens."""
    engine = Engine(model, None, cache_lens=1024, page_size=256, chunk_size=512, use_cuda_graph=graphs)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(3, 515)))
    for t in range(5):
        engine.decode(seq, 100 + t)
    torch.cuda.synchronize()
    return engine, seq


def kernels(model) -> None:
    layers = model.config.num_hidden_layers
    for graphs in (True, False):
        engine, seq = warm_engine(model, graphs)
        t0 = time.perf_counter()
        for t in range(20):
            engine.decode(seq, 200 + t)
        torch.cuda.synchronize()
        print(f"graphs={graphs}: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms a step, {layers} layers")
        engine.release(seq)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(3, 515)))
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            engine.decode(seq, 300 + t)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    n = sum(e.count for e in rows)
    print(f"eager: {n / steps:.0f} GPU ops a step ({n / steps / layers:.1f} a layer), {total / steps:.0f} us of GPU time a step")
    print(f"{'count/step':>10} {'us/step':>9} {'us each':>8}  name")
    for e in rows[:45]:
        print(f"{e.count / steps:>10.1f} {e.device_time_total / steps:>9.1f} {e.device_time_total / e.count:>8.2f}  {e.key[:110]}")


def host(model) -> None:
    engine, seq = warm_engine(model, True)
    spent = defaultdict(list)

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)
    timed(engine.cache, "prepare", "cache.prepare")
    timed(engine.graphs, "_fill", "graphs._fill")
    timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")
    timed(engine.graphs, "run", "graphs.run (all of the above but prepare)")
    timed(engine, "_wait_gpu", "wait for the GPU")
    timed(engine.context, "check_host_errors", "check_host_errors")
    timed(engine, "step", "Engine.step")
    engine.step_times.reset()
    steps = 30
    for t in range(steps):
        engine.decode(seq, 200 + t)
    torch.cuda.synchronize()
    print(f"{'phase':<44} {'median us':>10} {'calls/step':>10}")
    for label, xs in spent.items():
        print(f"{label:<44} {statistics.median(xs) * 1e6:>10.1f} {len(xs) / steps:>10.1f}")
    st = engine.step_times
    print(f"step_times: issue {st.issue_s / st.steps * 1e6:.1f} us, wait {st.wait_s / st.steps * 1e6:.1f} us a step")
    # (cProfile before torch.profiler: CUPTI left subscribed after the latter slows launches)
    profiler = cProfile.Profile()
    profiler.enable()
    for t in range(20):
        engine.decode(seq, 400 + t)
    torch.cuda.synchronize()
    profiler.disable()
    print("cProfile of 20 steps (tottime: in the function itself, its callees excluded):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for t in range(10):
            engine.decode(seq, 300 + t)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"{'count/step':>10} {'self cpu us/step':>16}  name (torch.profiler, CPU side)")
    for e in rows[:30]:
        print(f"{e.count / 10:>10.1f} {e.self_cpu_time_total / 10:>16.1f}  {e.key[:100]}")


def timeline(model) -> None:
    layers = model.config.num_hidden_layers
    engine, seq = warm_engine(model, True)
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(steps):
            engine.decode(seq, 300 + t)
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA"), key=lambda k: k[0])
    if not kernels:
        print("timeline: the profiler recorded no kernels inside the graphs")
        return
    added, own, count = defaultdict(float), defaultdict(float), defaultdict(int)
    latest = kernels[0][0]
    for start, end, name in kernels:
        added[name] += max(0.0, end - max(latest, start))
        own[name] += end - start
        count[name] += 1
        latest = max(latest, end)
    span = kernels[-1][1] - kernels[0][0]
    print(f"timeline: {len(kernels) / steps:.0f} kernels a step ({len(kernels) / steps / layers:.1f} a layer), "
          f"{span / steps:.0f} us from first start to last end a step (steps issued back to back)")
    print(f"{'count/step':>10} {'added us/step':>13} {'added us each':>13} {'own us each':>11}  name")
    for name in sorted(added, key=lambda n: -added[n])[:30]:
        print(f"{count[name] / steps:>10.1f} {added[name] / steps:>13.1f} {added[name] / count[name]:>13.2f} "
              f"{own[name] / count[name]:>11.2f}  {name[:100]}")


if __name__ == "__main__":
    path, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14
    mode = sys.argv[3] if len(sys.argv) > 3 else "kernels"
    modes = {"kernels": kernels, "host": host, "timeline": timeline}
    if mode not in modes:
        sys.exit(f"mode must be one of {', '.join(modes)}, got {mode!r}")
    loaded = load_model(path, cpu_infer=threads, tokenizer=False, default_device="cuda", progress=False)
    modes[mode](loaded.model)
