"""LoRA fine-tuning speed with the routed experts frozen on the CPU kernels (python -m
ktransformers.sft's step): optimizer steps a second, tokens a second, peak GPU and CPU memory;
with --baseline, the same step in plain transformers + peft with accelerate offloading the
experts to the CPU (their weights copied to the GPU for each forward), in the same run.

    python -m ktransformers.bench.sft                                   # the demo model, on the CPU
    python -m ktransformers.bench.sft --gguf_path /tmp/q3-48.gguf --seq 128 256 512 --threads 14 --baseline

Each step is one forward and backward over `--batch` sequences of `--seq` random tokens (every one
learned; several lengths are timed one after the other on the same loaded models) and an AdamW
step on rank-`--rank` adapters of `--targets` (sft's --lora_targets: the attention projections by
default; `experts` adds the routed experts'); the first
`--warmup` steps are not timed, and the table gives the median of the rest, with the share of the
step the CPU experts took (forward and backward, timed around the kernels' calls).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from . import machine

# The baseline's placement: every module as transformers has it, on the CPU (accelerate then
# dispatches it).
PLAIN_RULES = """
- match: {name: "^(model|lm_head)"}
  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cpu}}
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ktransformers.bench.sft", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", help="default: the bundled demo model")
    p.add_argument("--optimize_config_path", help="training rule file (default: MoE-sft.yaml / MoE-sft-cpu.yaml)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU kernel threads (default: all cores)")
    p.add_argument("--seq", type=int, nargs="+", default=[256], help="sequence lengths (each timed on the same models)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", nargs="+", default=["attention"], help="LoRA targets, as sft's --lora_targets")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--baseline", action="store_true",
                   help="also time transformers + peft with accelerate's CPU offload of the experts")
    args = p.parse_args(argv)
    if min(*args.seq, args.batch, args.rank, args.steps) < 1 or args.warmup < 0:
        p.error("--seq, --batch, --rank and --steps must be at least 1, --warmup at least 0")
    return args


def time_lengths(model, args, vocab: int, experts_seconds=None) -> list[tuple[int, float, float, str]]:
    """(seq, median step seconds, median share of it in the CPU experts (0 without
    experts_seconds), peak memory so far) for each of --seq."""
    from ..train import peak_memory
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return [(seq, *time_steps(model, optimizer, args, seq, vocab, experts_seconds), peak_memory(args.device))
            for seq in args.seq]


def time_steps(model, optimizer, args, seq: int, vocab: int, experts_seconds=None) -> tuple[float, float]:
    """(median step seconds, median share of it in the CPU experts: 0 without experts_seconds)."""
    gen = torch.Generator().manual_seed(0)
    times, shares = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, seq), generator=gen).to(args.device)
        if experts_seconds is not None:
            experts_seconds[0] = 0.0
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if step >= args.warmup:
            times.append(seconds)
            shares.append(experts_seconds[0] / seconds if experts_seconds is not None else 0.0)
    return statistics.median(times), statistics.median(shares)


def ours(args):
    """(time_lengths' rows, config, threads) on the training rule file."""
    from ..demo import DEMO_GGUF
    from ..kernels.cpu import MoEKernel
    from ..train import add_lora, load_for_training
    loaded = load_for_training(args.gguf_path or DEMO_GGUF, optimize_config_path=args.optimize_config_path,
                               device=args.device, cpu_infer=args.threads, tokenizer=False)
    model = add_lora(loaded.model, rank=args.rank, targets=args.targets)
    spent = [0.0]
    # the kernels' calls: the fused forward and backward, and the per-pair products expert adapters use
    calls = ("forward", "forward_keeping", "backward", "pair_gate_up", "pair_down", "pair_down_t", "pair_gate_up_t")
    originals = {name: getattr(MoEKernel, name) for name in calls}

    def timed(fn):
        def wrapper(self, *a):
            start = time.perf_counter()
            out = fn(self, *a)
            spent[0] += time.perf_counter() - start
            return out
        return wrapper
    for name, fn in originals.items():
        setattr(MoEKernel, name, timed(fn))
    try:
        rows = time_lengths(model, args, loaded.config.vocab_size, spent)
    finally:
        for name, fn in originals.items():
            setattr(MoEKernel, name, fn)
    return rows, loaded.config, loaded.model.kt_context.cpu_runtime().threads


def baseline(args, config):
    """time_lengths' rows of transformers + peft, the experts offloaded by accelerate."""
    from accelerate import dispatch_model

    from ..demo import DEMO_GGUF
    from ..optimize.inject import optimize_and_load_gguf
    from ..optimize.rules import parse_rules
    from ..optimize.skeleton import build_skeleton
    from ..train import add_lora
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    model = build_skeleton(config, dtype)
    optimize_and_load_gguf(model, parse_rules(PLAIN_RULES, "baseline rules"), args.gguf_path or DEMO_GGUF, config,
                           progress=True)
    if torch.device(args.device).type == "cuda":
        experts = {name: "cpu" for name, _ in model.named_modules() if name.endswith(".mlp.experts")}
        device_map = {"": torch.device(args.device).index or 0} | experts
        model = dispatch_model(model, device_map=device_map)
    model.train().requires_grad_(False)
    model = add_lora(model, rank=args.rank, targets=args.targets)
    return time_lengths(model, args, config.vocab_size)


def main(argv=None) -> None:
    args = parse_args(argv)
    mine, config, threads = ours(args)
    base = []
    if args.baseline:
        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = baseline(args, config)
    print(f"# {machine(threads)}; device {args.device}")
    print(f"# {args.gguf_path or 'demo model'}: {config.num_hidden_layers} layers, LoRA rank {args.rank} on {', '.join(args.targets)}, "
          f"batch {args.batch}")
    print("| tokens | engine | step | it/s | tok/s | CPU experts' share | memory (peak so far) |")
    print("|---|---|---|---|---|---|---|")
    rows = [("ktransformers (CPU experts' backward)", seq, step, f"{share:.2f}", mem) for seq, step, share, mem in mine]
    rows += [("transformers + peft, accelerate offloading the experts", seq, step, "", mem) for seq, step, _, mem in base]
    for name, seq, seconds, experts_share, mem in rows:
        tokens = args.batch * seq
        print(f"| {args.batch} x {seq} | {name} | {seconds * 1e3:.1f} ms | {1 / seconds:.2f} | {tokens / seconds:.0f} | "
              f"{experts_share} | {mem} |")
    for (seq, step, _, _), (_, base_step, _, _) in zip(mine, base):
        print(f"ours / baseline at {args.batch} x {seq} tokens: {base_step / step:.2f}x")


if __name__ == "__main__":
    main()
