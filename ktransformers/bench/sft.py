"""LoRA fine-tuning speed with the routed experts frozen on the CPU kernels (python -m
ktransformers.sft's step): optimizer steps a second, tokens a second, peak GPU and CPU memory.

    python -m ktransformers.bench.sft                                   # the demo model, on the CPU
    python -m ktransformers.bench.sft --gguf_path /tmp/q3-48.gguf --seq 512 --batch 1 --threads 14

Each step is one forward and backward over `--batch` sequences of `--seq` random tokens (every one
learned) and an AdamW step on rank-`--rank` adapters of the attention projections; the first
`--warmup` steps are not timed, and the table gives the median of the rest, with the share of the
step the CPU experts took (forward and backward, from the kernels' own clocks where they run
synchronously).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import machine


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ktransformers.bench.sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", help="default: the bundled demo model")
    p.add_argument("--optimize_config_path", help="training rule file (default: MoE-sft.yaml / MoE-sft-cpu.yaml)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU kernel threads (default: all cores)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gradient_checkpointing", action="store_true")
    args = p.parse_args(argv)
    if min(args.seq, args.batch, args.rank, args.steps) < 1 or args.warmup < 0:
        p.error("--seq, --batch, --rank and --steps must be at least 1, --warmup at least 0")
    return args


def main(argv=None) -> None:
    from ..demo import DEMO_GGUF
    from ..kernels.cpu import MoEKernel
    from ..train import add_lora, load_for_training, peak_memory
    args = parse_args(argv)
    loaded = load_for_training(args.gguf_path or DEMO_GGUF, optimize_config_path=args.optimize_config_path,
                               device=args.device, cpu_infer=args.threads, tokenizer=False)
    model = add_lora(loaded.model, rank=args.rank)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    expert_seconds = [0.0]
    forward, backward = MoEKernel.forward, MoEKernel.backward

    def timed(fn):
        def wrapper(self, *a):
            start = time.perf_counter()
            out = fn(self, *a)
            expert_seconds[0] += time.perf_counter() - start
            return out
        return wrapper
    MoEKernel.forward, MoEKernel.backward = timed(forward), timed(backward)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    times, shares = [], []
    try:
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device)
            expert_seconds[0] = 0.0
            start = time.perf_counter()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if torch.device(args.device).type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if step >= args.warmup:
                times.append(seconds)
                shares.append(expert_seconds[0] / seconds)
    finally:
        MoEKernel.forward, MoEKernel.backward = forward, backward
    step = statistics.median(times)
    tokens = args.batch * args.seq
    print(f"# {machine(loaded.model.kt_context.cpu_runtime().threads)}; device {args.device}")
    print(f"# {args.gguf_path or 'demo model'}: {loaded.config.num_hidden_layers} layers, LoRA rank {args.rank} on "
          f"attention ({sum(p.numel() for p in params):,} parameters), batch {args.batch} x {args.seq} tokens")
    print("| step | it/s | tok/s | CPU experts' share | memory |")
    print("|---|---|---|---|---|")
    print(f"| {step * 1e3:.1f} ms | {1 / step:.2f} | {tokens / step:.0f} | {statistics.median(shares):.2f} | "
          f"{peak_memory(args.device)} |")


if __name__ == "__main__":
    main()
