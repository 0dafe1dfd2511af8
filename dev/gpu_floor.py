"""On the GPU machine: the floor under a decode-sized kernel, each timed as a CUDA graph replays 32
calls (cold data: copies cycled past the L2), median of 30 replays:
- an empty kernel (what a launch in a graph costs);
- a plain read of B bytes by P programs, each summing its share and storing one float (what the
  bytes cost with no arithmetic and no reduction across programs);
- the same read plus a reduction across the programs by a counter (what a split K's "last
  program adds the partial sums" costs beyond the read);
against the int4 GEMVs of quant_linear at Qwen3-30B-A3B's q and o shapes (6 MB with scales).
    python dev/gpu_floor.py"""
import torch
import triton
import triton.language as tl

from ktransformers.kernels.triton import quant_linear as Q
from gpu_tune import timed  # (dev/: a graph of the calls, median us a call)

COPIES = 32


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _share_sum(x_ptr, per_program, BLOCK: tl.constexpr):
    """The sum of this program's `per_program` words of x."""
    base = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK))
    return tl.sum(acc, 0).to(tl.float32)


@triton.jit
def _read(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0), _share_sum(x_ptr, per_program, BLOCK))


@triton.jit
def _read_reduce(x_ptr, out_ptr, count_ptr, per_program, BLOCK: tl.constexpr):
    tl.store(out_ptr + 1 + tl.program_id(0), _share_sum(x_ptr, per_program, BLOCK))
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        r = tl.arange(0, 1024)
        parts = tl.load(out_ptr + 1 + r, mask=r < tl.num_programs(0), other=0.0, cache_modifier=".cg")
        tl.store(out_ptr, tl.sum(parts, 0))
        tl.atomic_xchg(count_ptr, 0)


def main() -> None:
    x = torch.zeros(1, device="cuda")
    print(f"empty kernel: {timed([lambda: _empty[(1,)](x)] * COPIES):.2f} us a launch")
    print(f"empty kernel, 528 programs: {timed([lambda: _empty[(528,)](x)] * COPIES):.2f} us a launch")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for mb in (1, 6):
        words = mb * 2**20 // 4
        bufs = [torch.randint(0, 100, (words,), dtype=torch.int32, device="cuda") for _ in range(COPIES)]
        for programs in (132, 264, 528, 1056):
            per = words // programs // 256 * 256
            for warps in (2, 4):
                out = torch.empty(1 + programs, device="cuda")
                r = timed([lambda b=b: _read[(programs,)](b, out, per, BLOCK=256, num_warps=warps) for b in bufs])
                rr = timed([lambda b=b: _read_reduce[(programs,)](b, out, counter, per, BLOCK=256, num_warps=warps)
                            for b in bufs])
                gb = programs * per * 4 / 1e9
                print(f"read {mb} MB, {programs:4d} programs, {warps} warps: {r:6.2f} us ({gb / r * 1e6:5.0f} GB/s), "
                      f"with a counter reduction {rr:6.2f} us")
    xs = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for name, N, K in (("q", 4096, 2048), ("o", 2048, 4096)):
        ws = [Q.quantize_int4(torch.randn(N, K, device="cuda")) for _ in range(COPIES)]
        xk = xs[:, :K]
        us = timed([lambda w=w: Q.group_gemm(xk, w) for w in ws])
        print(f"int4 GEMV {name} {N}x{K} ({ws[0].nbytes() / 1e6:.1f} MB): {us:.2f} us")


if __name__ == "__main__":
    main()
