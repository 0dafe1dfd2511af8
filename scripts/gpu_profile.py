"""On the GPU machine: which CUDA kernels a hybrid decode step launches, and how long each takes
(torch.profiler over eager decode steps of a synthetic Qwen3-30B-A3B-shaped file).
    python scripts/gpu_profile.py /tmp/q3-4.gguf [threads]"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ktransformers.engine.generate import Engine
from ktransformers.loader import load_model

path, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14
loaded = load_model(path, cpu_infer=threads, tokenizer=False, default_device="cuda", progress=False)
layers = loaded.model.config.num_hidden_layers
for graphs in (True, False):
    engine = Engine(loaded.model, None, cache_lens=1024, page_size=256, chunk_size=512, use_cuda_graph=graphs)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(3, 515)))
    for t in range(5):
        engine.decode(seq, 100 + t)
    torch.cuda.synchronize()
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
