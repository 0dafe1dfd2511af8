"""bench: benchmarks, each run as `python -m ktransformers.bench.<name>`; the timed ones compare
their figures with the bound they cannot beat (memory bandwidth measured in the same run) and,
where installed, with a peer on the same bytes. `synth` writes realistic-size GGUF models of random valid blocks
(no download); `load` the peak memory of loading one; `moe` one MoE layer on the CPU kernels
(beside kt-kernel, through `peers`); `decode` a whole model's prefill and decode, beside
llama.cpp; `e2e` hybrid GPU + CPU prefill and decode against the decode roofline and llama.cpp's
CUDA build; `gpu` the Triton kernels against the GPU's memory bandwidth; `handoff` what handing
a layer's experts from a GPU stream to the CPU and back costs; `serve` the OpenAI server under
concurrent clients. How to run each, what its columns mean and current figures:
docs/benchmarks.md (whole models) and docs/kernel_benchmarks.md (moe, gpu, handoff)."""
from __future__ import annotations

from pathlib import Path

import torch


def sync() -> None:
    """Wait for every GPU (layers may be spread over several): before and after a timed region."""
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def machine(threads: int) -> str:
    """"CPU model, N threads; GPU" for a table's header line."""
    info = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if info.exists() else "unknown CPU"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {threads} threads; {gpu}"

