"""Question: is a Q6_K lm_head (Q4_K_M files; GLM-4.5-Air's 151,552 x 4,096) faster on the GPU as
int8 codes in Q6_K's groups of 16 (1.25 bytes a value, what KLinearMarlin keeps) than as the bf16
weight it used to be (2 bytes a value, cuBLAS)? One row, as decode runs it; the Q8_0 form (int8 in
groups of 32) beside it for reference.

    python dev/q6k_lm_head.py   # CUDA; us a launch inside a CUDA graph (as decode runs), median of 30

The weight (0.78-1.24 GB) is far past the L2 cache, so one copy is read cold every launch.
"""
import torch

from ktransformers.bench.gpu import copy_gbps
from ktransformers.kernels.triton import quant_linear as ql
from ktransformers.weights import ggml_quants as gq

from gpu_tune import timed  # (dev/, beside this script)

N, K = 151552, 4096


def launch_us(fn, launches: int = 8) -> float:
    return timed([fn] * launches)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=g).to(torch.bfloat16).cuda()
    bw = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device copy {bw:.0f} GB/s; lm_head {N} x {K}, one row")
    for t in ("Q6_K", "Q8_0"):
        raw = gq.random_blocks(t, N * K // gq.FORMATS[gq.ggml_type(t)].block_elems, g)
        w = ql.from_ggml(raw, gq.ggml_type(t), (N, K)).to("cuda")
        us = launch_us(lambda: ql.group_gemm(x, w, torch.bfloat16))
        rate = w.nbytes() / us / 1e3
        print(f"{t} as int8, groups of {w.group}: {us:.1f} us, {w.nbytes() / 1e9:.3f} GB, {rate:.0f} GB/s "
              f"({rate / bw:.2f} of the copy rate)")
        if t == "Q6_K":
            dense = ql.dequantize_t(w).T.contiguous()
            exact, ref = ql.group_gemm(x, w, torch.float32), x.float() @ dense.float().T
            print(f"  against the bf16 weight's product: relative error {((exact - ref).norm() / ref.norm()).item():.2e}")
            us = launch_us(lambda: torch.nn.functional.linear(x, dense))
            print(f"the same weight in bf16 (cuBLAS): {us:.1f} us, {dense.numel() * 2 / 1e9:.3f} GB, "
                  f"{dense.numel() * 2 / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
