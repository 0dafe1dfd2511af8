"""Can the GPU add to the CPU's memory bandwidth during decode? Measures, on a CUDA machine:

1. the copy engine's host-to-device rate from pinned memory (cudaMemcpyAsync, 1 GiB);
2. a Triton kernel's rate reading pinned host memory in place (zero-copy over the bus), for a
   whole buffer and for a decode-sized read (two Qwen3 experts, ~6 MB);
3. the CPU pool's stream probe alone, then while the GPU reads another pinned buffer in place:
   whether the two rates add up or share one limit.

    python dev/pcie_probe.py [THREADS]
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time

import torch

from ktransformers.kernels.triton.pcie_experts import read_words


def gpu_read(buf: torch.Tensor, programs: int, block: int, out: torch.Tensor) -> None:
    read_words(buf, out, programs, block)


@contextlib.contextmanager
def gpu_reading(host: torch.Tensor, out: torch.Tensor, launches: int = 4):
    """Inside the block the GPU reads pinned `host` in place without pause (its own stream and
    thread), from its first timed round on; yields the list of its rates in GB/s, one a round
    of `launches` reads."""
    stop, rates = threading.Event(), []

    def loop():
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(launches):
                    gpu_read(host, 1056, 1024, out)
                b.record()
                b.synchronize()
                rates.append(launches * host.numel() * 4 / (a.elapsed_time(b) / 1e3) / 1e9)

    th = threading.Thread(target=loop)
    th.start()
    while not rates and th.is_alive():
        time.sleep(0.01)
    try:
        yield rates
    finally:
        stop.set()
        th.join()


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of fn() on the GPU (events)."""
    times = []
    for _ in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times[1:])


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    dev = torch.device("cuda")
    gib = 1 << 30
    host = torch.empty(gib // 4, dtype=torch.int32, pin_memory=True)
    host.fill_(3)
    dst = torch.empty(gib, dtype=torch.uint8, device=dev)
    out = torch.empty(1 << 16, dtype=torch.int32, device=dev)
    t = timed(lambda: dst.copy_(host.view(torch.uint8), non_blocking=True))
    print(f"copy engine H2D, pinned 1 GiB: {gib / t / 1e9:.1f} GB/s")
    for programs in (132, 264, 528, 1056, 2112, 4224):
        for block in (1024, 4096):
            t = timed(lambda: gpu_read(host, programs, block, out))
            print(f"zero-copy read 1 GiB, {programs:>4} programs x {block:>4} words: {gib / t / 1e9:.1f} GB/s")
    small = host[: (6 << 20) // 4]
    for programs in (132, 264, 528, 1056):
        t = timed(lambda: gpu_read(small, programs, 1024, out), repeats=21)
        print(f"zero-copy read 6 MiB, {programs:>4} programs: {t * 1e6:.1f} us = {small.numel() * 4 / t / 1e9:.1f} GB/s")
    # a registered (not cudaHostAlloc'ed) buffer, as the CPU kernels' weights would be
    reg = torch.empty(256 << 20, dtype=torch.uint8)
    reg.fill_(1)
    rc = torch.cuda.cudart().cudaHostRegister(reg.data_ptr(), reg.numel(), 0)
    print("cudaHostRegister of a torch CPU tensor:", rc)
    try:
        regw = reg.view(torch.int32)
        t = timed(lambda: gpu_read(regw, 1056, 1024, out))
        print(f"zero-copy read of the registered 256 MiB: {reg.numel() / t / 1e9:.1f} GB/s")
    except Exception as e:  # noqa: BLE001
        print("registered read failed:", e)

    from ktransformers.kernels.cpu import CPURuntime, weight_buffer
    rt = CPURuntime(threads)
    cbuf = weight_buffer(rt.ext, 2 * gib).numpy()
    cbuf.fill(7)

    def cpu_probe(n=5):
        rates = []
        for _ in range(n):
            s = time.perf_counter()
            rt._rt.stream_checksum(cbuf.ctypes.data, cbuf.nbytes)
            rates.append(cbuf.nbytes / (time.perf_counter() - s) / 1e9)
        return rates

    for rnd in range(3):
        alone = cpu_probe()
        gpu_alone = gib / timed(lambda: gpu_read(host, 1056, 1024, out)) / 1e9
        with gpu_reading(host, out) as gpu_rates:  # the GPU reading in place while the CPU streams
            together = cpu_probe()
        print(f"round {rnd}: CPU stream alone {statistics.median(alone):.1f} GB/s (best {max(alone):.1f}), "
              f"GPU in place alone {gpu_alone:.1f}; together: CPU {statistics.median(together):.1f} "
              f"(best {max(together):.1f}), GPU {statistics.median(gpu_rates[1:] or gpu_rates):.1f} GB/s")


if __name__ == "__main__":
    main()
