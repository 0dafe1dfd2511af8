"""On the GPU machine: are the CPU experts slower when a GPU stream rings them (the doorbell) than
when Python calls the same loaded kernels directly, and does it depend on where the pool's
thread 0 runs? Qwen3-Next's experts (512 of 512 x 2048, top 10) against Qwen3's (128, top 8).
    python dev/doorbell_vs_direct.py /tmp/q3n4.gguf 14        (and under `taskset -c 1-15`)"""
import os, statistics, sys, time
import torch
from ktransformers.loader import load_model
from ktransformers.operators.experts import cpu_expert_kernels
from ktransformers.bench.e2e import doorbell_counts
from ktransformers.kernels.cuda_host import submit_on_stream

path, threads = sys.argv[1], int(sys.argv[2])
m = load_model(path, default_device="cuda", tokenizer=False, cpu_infer=threads, progress=False)
model = m.model
ks = cpu_expert_kernels(model)
k0 = ks[0]
g = torch.Generator().manual_seed(0)
print(f"{os.path.basename(path)} E={k0.experts} K={k0.top_k} I={k0.intermediate}, affinity {sorted(os.sched_getaffinity(0))}, "
      f"pool cpus {model.kt_context.cpu_runtime().cpus[:threads]}")


def routes(n):
    return [torch.randperm(k0.experts, generator=g)[:k0.top_k][None] for _ in range(n)]


def direct(label, n=80):
    rs, times = routes(n), []
    for it in range(n):
        k = ks[it % len(ks)]
        x, w = torch.randn(1, k.hidden).to(torch.bfloat16), torch.rand(1, k.top_k)
        t0 = time.perf_counter(); k.forward(x, rs[it], w); times.append(time.perf_counter() - t0)
    print(f"  direct, {label}: {statistics.median(times[10:]) * 1e6:.0f} us a call")


def stream(label, n=80, same=False):
    staging = model.kt_context.host_staging()
    rs = [r.cuda() for r in routes(n)]
    xs = [torch.randn(1, k0.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    w = torch.rand(1, k0.top_k, device="cuda")
    torch.cuda.synchronize()
    bell = staging.doorbell
    before = doorbell_counts(bell)
    t0 = time.perf_counter()
    for it in range(n):
        submit_on_stream(ks[it % len(ks)], staging, xs[it], rs[0 if same else it], w, torch.bfloat16)()
        if not same:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    bell = staging.doorbell
    served, busy, _, _ = (a - b for a, b in zip(doorbell_counts(bell), before))
    print(f"  doorbell, {label}: {busy / max(served, 1) / 1e3:.0f} us a call ({served} calls), "
          f"{(time.perf_counter() - t0) / n * 1e6:.0f} us a round trip")


direct("main thread free")
stream("synced each call")
stream("synced each call, again")
stream("back to back, same route", same=True)
direct("main thread free, after")
allowed = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {allowed[0]})
direct(f"main thread on cpu{allowed[0]}")
os.sched_setaffinity(0, {allowed[-1]})
direct(f"main thread on cpu{allowed[-1]}")
stream(f"main thread on cpu{allowed[-1]}")
os.sched_setaffinity(0, set(allowed))
