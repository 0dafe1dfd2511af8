"""On the GPU machine: where the host's time goes in one CUDA-graph decode step (the part of a step
that `bench.e2e` calls "issuing the step"), phase by phase, then torch.profiler's CPU-side ops.
    python scripts/host_step.py /tmp/q3-12.gguf [threads]"""
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ktransformers.engine.generate import Engine
from ktransformers.loader import load_model

path, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14
loaded = load_model(path, cpu_infer=threads, tokenizer=False, default_device="cuda", progress=False)
engine = Engine(loaded.model, None, cache_lens=1024, page_size=256, chunk_size=512, use_cuda_graph=True)
seq = engine.new_sequence()
engine.prefill(seq, list(range(3, 515)))
for t in range(5):
    engine.decode(seq, 100 + t)
torch.cuda.synchronize()

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


graphs = engine.graphs
timed(engine.cache, "prepare", "cache.prepare")
timed(graphs, "_fill", "graphs._fill")
timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")
timed(graphs, "run", "graphs.run (all of the above but prepare)")
timed(engine, "_wait_gpu", "wait for the GPU")
timed(engine.context, "check_host_errors", "check_host_errors")
timed(engine, "step", "Engine.step")
timed(engine, "decode", "Engine.decode (step + sampling)")
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

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for t in range(10):
        engine.decode(seq, 300 + t)
    torch.cuda.synchronize()
rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
rows.sort(key=lambda e: -e.self_cpu_time_total)
print(f"{'count/step':>10} {'self cpu us/step':>16}  name (torch.profiler, CPU side)")
for e in rows[:30]:
    print(f"{e.count / 10:>10.1f} {e.self_cpu_time_total / 10:>16.1f}  {e.key[:100]}")

import cProfile  # noqa: E402
import pstats  # noqa: E402
profiler = cProfile.Profile()
profiler.enable()
for t in range(20):
    engine.decode(seq, 400 + t)
torch.cuda.synchronize()
profiler.disable()
print("cProfile of 20 steps (tottime: in the function itself, its callees excluded):")
pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
