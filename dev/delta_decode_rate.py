"""The C++ gated DeltaNet decode step (conv step, delta rule, gated norm) of one Qwen3-Next layer
(16 key / 32 value heads of 128), one sequence, on this CPU's threads: its time and the state's
bytes over it. `cached`: the same rows each call, in place (the state stays in the caches);
`RAM`: 48 rows of state (100 MB) cycled, each call reading one row and writing the next, as
the hybrid cache's ring does between decode steps that stream the weights through the caches.
    python dev/delta_decode_rate.py"""
import time, torch, statistics
from ktransformers.kernels.cpu import CPURuntime, gated_delta_decode
rt = CPURuntime(threads=2)
Hk, Hv, Dk, Dv, K, n = 16, 32, 128, 128, 4, 1
C, R = 2*Hk*Dk + Hv*Dv, 48
mixed, z = torch.randn(n, C), torch.randn(n, Hv, Dv)
conv_w = torch.randn(C, K); conv = torch.randn(R, C, K-1); ssm = torch.randn(R, Hv, Dk, Dv)*0.1
g, beta = -torch.rand(n, Hv), torch.rand(n, Hv)
nw = torch.ones(Dv)
state = Hv * Dk * Dv * 4
for label in ("cached", "RAM"):
    ts = []
    for i in range(400):
        rows = (0, 0) if label == "cached" else (i % R, (i + 1) % R)
        r, w = torch.tensor([rows[0]]), torch.tensor([rows[1]])
        t0 = time.perf_counter()
        gated_delta_decode(rt, mixed, conv_w, conv, r, w, g, beta, ssm, r, w, z, nw, 1e-6, (Hk, Hv, Dk, Dv), False)
        ts.append(time.perf_counter() - t0)
    m = statistics.median(ts[40:])
    print(f"{label}: {m*1e6:.0f} us, state {state/1e6:.1f} MB read and written -> {2*state/m/1e9:.1f} GB/s")
