"""LoRA fine-tuning with the routed experts frozen on the CPU kernels: `python -m ktransformers.sft`.

    python -m ktransformers.sft --gguf_path MODEL.gguf --data train.jsonl --output_dir adapter/
        [--eval_data heldout.jsonl] [--lora_rank 8] [--lora_targets attention shared_experts]
        [--steps 100] [--lr 1e-4] [--batch_size 1] [--grad_accum 8] [--max_len 2048]

The data is JSONL chat records (train/data.py: OpenAI messages, ShareGPT conversations, or
prompt/completion), rendered through the model's chat template; the loss is on the assistant's
tokens only. The rule file (default MoE-sft.yaml, or MoE-sft-cpu.yaml with --device cpu) keeps the
routed experts on the CPU kernels, forward and backward, and everything else as transformers'
modules on the device, where the adapters attach. The adapter is saved in peft's format
(adapter_config.json + adapter_model.safetensors): `ktransformers.train.load_adapter` loads it on
this model, peft's PeftModel.from_pretrained on transformers' own, `--lora_path` merges it.
"""
from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ktransformers.sft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gguf_path", help="GGUF file or directory, or a safetensors directory; default: the demo model")
    p.add_argument("--model_path", help="HF model directory (config + tokenizer) where the GGUF lacks them")
    p.add_argument("--optimize_config_path", help="training rule file (YAML); default: MoE-sft.yaml / MoE-sft-cpu.yaml")
    p.add_argument("--data", required=True, help="JSONL training records (with --dpo: preference pairs)")
    p.add_argument("--eval_data", help="JSONL held-out records: their loss before and after training")
    p.add_argument("--dpo", action="store_true",
                   help="DPO on preference pairs ({'prompt', 'chosen', 'rejected'}) instead of SFT; the reference is "
                        "the model without its adapters")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument("--output_dir", required=True, help="where the adapter is saved (peft's format)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where everything but the routed experts trains")
    p.add_argument("--cpu_infer", type=int, default=None, help="threads of the CPU kernels (default: all cores)")
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--lora_alpha", type=float, default=16.0)
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_targets", nargs="+", default=["attention"],
                   help="'attention', 'shared_experts', 'experts' (the routed experts' gate_up and down; or "
                        "'experts.gate_up_proj', 'experts.down_proj'), or linear module names (q_proj, ...)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=1, help="sequences a forward pass (padded to the longest)")
    p.add_argument("--grad_accum", type=int, default=1, help="forward passes an optimizer step")
    p.add_argument("--max_len", type=int, default=2048, help="tokens kept of each record")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="recompute each layer's activations in the backward (less GPU memory, ~1/3 more compute)")
    p.add_argument("--log_every", type=int, default=10, help="print a step line every N steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("lora_rank", "steps", "batch_size", "grad_accum", "max_len", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.lr <= 0 or args.beta <= 0:
        p.error(f"--lr and --beta must be positive, got {args.lr}, {args.beta}")
    if args.dpo and (args.grad_accum != 1 or args.warmup_steps):
        p.error("--grad_accum and --warmup_steps are SFT's: a DPO step takes --batch_size pairs at a constant --lr")
    return args


def run(args: argparse.Namespace) -> None:
    from .demo import DEMO_GGUF
    from .train import add_lora, load_for_training, save_adapter
    torch.manual_seed(args.seed)
    loaded = load_for_training(args.gguf_path or DEMO_GGUF, args.model_path, args.optimize_config_path,
                               device=args.device, cpu_infer=args.cpu_infer)
    model = add_lora(loaded.model, args.lora_rank, args.lora_alpha, args.lora_targets, args.lora_dropout)
    if args.dpo:
        run_dpo(args, model, loaded.tokenizer)
    else:
        run_sft(args, model, loaded.tokenizer)
    save_adapter(model, args.output_dir)
    print(f"adapter saved to {args.output_dir}")


def describe(args, model, sequences: int, longest: int) -> None:
    """Say what trains, and check that a step of `sequences` x `longest` tokens fits (a
    MemoryBudgetError with the numbers where it does not)."""
    from .optimize.memory import size
    from .train.memory import check_training, plan_training
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA rank {args.lora_rank} on {', '.join(args.lora_targets)}: {trainable:,} trainable parameters")
    dtype = next(p.dtype for p in model.parameters() if not p.requires_grad)
    plan = plan_training(model, model.config, tokens=sequences * longest, device=args.device,
                         checkpointing=args.gradient_checkpointing, dtype=dtype)
    check_training(plan)
    print("a step adds " + ", ".join(f"{size(sum(kinds.values()))} on {device}"
                                      for device, kinds in sorted(plan.per_device_kind().items())))


def run_dpo(args: argparse.Namespace, model, tokenizer) -> None:
    from .train import peak_memory
    from .train.dpo import evaluate_dpo, load_pairs, train_dpo
    pairs = load_pairs(args.data, tokenizer, args.max_len)
    held_out = load_pairs(args.eval_data, tokenizer, args.max_len) if args.eval_data else None
    print(f"{len(pairs)} preference pairs")
    describe(args, model, 2 * args.batch_size, max(len(e.input_ids) for p in pairs for e in (p.chosen, p.rejected)))
    if held_out:
        print("held-out DPO loss, accuracy before: {:.4f}, {:.2f}".format(*evaluate_dpo(model, held_out, args.beta,
                                                                                          args.device)))

    def log(r) -> None:
        if r.step % args.log_every == 0 or r.step == args.steps:
            tqdm.write(f"step {r.step}: loss {r.loss:.4f}, accuracy {r.accuracy:.2f}, margin {r.margin:.3f}, "
                       f"{1 / r.seconds:.2f} it/s, {peak_memory(args.device)}")
    reports = train_dpo(model, pairs, steps=args.steps, lr=args.lr, beta=args.beta, batch_size=args.batch_size,
                        max_grad_norm=args.max_grad_norm, device=args.device, seed=args.seed, on_step=log)
    seconds = sum(r.seconds for r in reports)
    print(f"trained {len(reports)} steps in {seconds:.1f} s: {len(reports) / seconds:.2f} it/s; {peak_memory(args.device)}")
    if held_out:
        print("held-out DPO loss, accuracy after: {:.4f}, {:.2f}".format(*evaluate_dpo(model, held_out, args.beta,
                                                                                         args.device)))


def run_sft(args: argparse.Namespace, model, tokenizer) -> None:
    from .train import load_examples, mean_loss, peak_memory, train
    examples = load_examples(args.data, tokenizer, args.max_len)
    held_out = load_examples(args.eval_data, tokenizer, args.max_len) if args.eval_data else None
    learned = sum(e.learned for e in examples)
    print(f"{len(examples)} records, {sum(len(e.input_ids) for e in examples)} tokens, {learned} learned")
    describe(args, model, args.batch_size, max(len(e.input_ids) for e in examples))
    if held_out:
        print(f"held-out loss before: {mean_loss(model, held_out, args.device):.4f}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0

    def log(r) -> None:
        if r.step % args.log_every == 0 or r.step == args.steps:
            tqdm.write(f"step {r.step}: loss {r.loss:.4f}, {r.tokens / r.seconds:.1f} tok/s, {1 / r.seconds:.2f} it/s, "
                       f"lr {r.lr:.2e}, {peak_memory(args.device)}")
    reports = train(model, examples, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                    grad_accum=args.grad_accum, warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm,
                    pad_id=pad, device=args.device, seed=args.seed, on_step=log)
    seconds = sum(r.seconds for r in reports)
    print(f"trained {len(reports)} steps in {seconds:.1f} s: {sum(r.tokens for r in reports) / seconds:.1f} tok/s, "
          f"{len(reports) / seconds:.2f} it/s; {peak_memory(args.device)}")
    if held_out:
        print(f"held-out loss after: {mean_loss(model, held_out, args.device):.4f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, ImportError, FloatingPointError) as e:  # (MemoryBudgetError too)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
