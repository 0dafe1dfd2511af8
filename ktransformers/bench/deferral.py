"""Expert deferral (the experts rule's n_deferred_experts): what it does to the output, and to
decode speed.

    python -m ktransformers.bench.deferral                     # the bundled demo model, CPU rules
    python -m ktransformers.bench.deferral --gguf_path /tmp/q3-48.gguf --deferred 0 1 2 --threads 14

For each count k of deferred experts (each decode token's k lowest-weight experts of a MoE layer
join the next MoE layer's output): the text is fed one decode step a token after a short
prefill (teacher forcing), which gives its perplexity and, at every step, the KL divergence of
the next-token distribution from k = 0's (mean and max); then a timed greedy decode gives tok/s
(median of --repeats). The model is loaded once; k changes through set_expert_deferral. On a
GPU host the rule file defaults to the shipped GPU one, where the deferred experts run on the
CPU while the GPU computes the next layer's attention; on the CPU alone there is nothing to
overlap them with, so only the output changes.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch

from . import machine, sync

# Prose of the kind the demo model learned from (the Python documentation's), written for this benchmark.
TEXT = (
    "A list is a mutable sequence of items. You can create a list by placing values between square brackets, "
    "separated by commas, and you can change it later: the append method adds an item to the end, the insert "
    "method puts an item at a given position, and the remove method deletes the first item whose value is equal "
    "to its argument. Lists can hold values of different types, although in practice the items of a list usually "
    "have the same type. When you need an immutable sequence, use a tuple instead. The function returns a new "
    "list, and the original list is not modified. If the index is out of range, an IndexError exception is raised. "
    "The for statement iterates over the items of any sequence, in the order that they appear in the sequence. "
    "A dictionary maps keys to values; the keys must be hashable, which is why lists cannot be used as keys. "
    "This module provides functions for working with files and directories, and the class below describes the "
    "interface that every file object supports."
)
PREFILL = 8  # the text's first tokens, fed as one prefill; every later token is a decode step


def teacher_forced(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids) - PREFILL, V] log-probabilities of each next token, the first from the prefill's
    logits and the rest from decode steps fed the text's own tokens."""
    seq = engine.new_sequence()
    rows = [engine.prefill(seq, ids[:PREFILL])[0].float()]
    rows += [engine.decode(seq, t)[0].float() for t in ids[PREFILL:-1]]
    engine.release(seq)
    return torch.stack(rows).log_softmax(-1).cpu()


def timed_decode(engine, vocab: int, steps: int, repeats: int) -> float:
    """Median tok/s of `repeats` greedy decodes of `steps` tokens after a 64-token random prompt
    (a first, untimed decode warms up and captures the CUDA graphs)."""
    gen = torch.Generator().manual_seed(0)
    rates = []
    for i in range(repeats + 1):
        seq = engine.new_sequence()
        first = int(engine.prefill(seq, torch.randint(3, vocab, (64,), generator=gen).tolist())[0].argmax())
        sync()
        t0 = time.perf_counter()
        made = sum(1 for _ in engine.greedy_tokens(seq, first, steps))
        sync()
        if i:
            rates.append(made / (time.perf_counter() - t0))
        engine.release(seq)
    return statistics.median(rates)


def measure(args) -> tuple[list[dict], object]:
    from ..engine.generate import Engine
    from ..loader import load_model
    from ..operators.experts import set_expert_deferral
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(args.gguf_path, args.model_path, args.optimize_config_path, default_device=device,
                        cpu_infer=args.threads, progress=not args.quiet)
    text = Path(args.text).read_text() if args.text else TEXT
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
    if len(ids) <= PREFILL + 1:
        raise SystemExit(f"the text has {len(ids)} tokens; at least {PREFILL + 2} are needed")
    engine = Engine(loaded.model, loaded.tokenizer, cache_lens=max(len(ids), 64 + args.decode) + 64, page_size=64,
                    use_cuda_graph=device == "cuda", max_batch=1)
    target = torch.tensor(ids[PREFILL:])
    rows, base = [], None
    for k in args.deferred:
        set_expert_deferral(loaded.model, k)
        logp = teacher_forced(engine, ids)
        nll = -logp.gather(1, target[:, None]).mean().item()
        base = logp if base is None else base
        kl = (base.exp() * (base - logp)).sum(-1)  # KL(k=first || k) at each step
        # (a random model's perplexity on text can be beyond a float: inf)
        rows.append({"deferred": k, "ppl": math.exp(nll) if nll < 700 else math.inf, "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                     "tok_s": timed_decode(engine, loaded.config.vocab_size, args.decode, args.repeats),
                     "tokens": len(target)})
    return rows, loaded


def print_table(rows: list[dict], args, loaded) -> None:
    print(f"# {Path(args.gguf_path).name}: {loaded.config.num_hidden_layers} layers, top-k "
          f"{loaded.config.num_experts_per_tok}; {machine(args.threads)}")
    print(f"# {rows[0]['tokens']} text tokens scored by decode steps; decode tok/s: median of {args.repeats} runs "
          f"of {args.decode} greedy steps")
    first = rows[0]["tok_s"]
    print("| deferred experts | perplexity | KL from k=" + f"{rows[0]['deferred']} mean | KL max | decode tok/s | vs k="
          f"{rows[0]['deferred']} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['deferred']} | {r['ppl']:.3f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / first:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    from ..demo import DEMO_GGUF
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", default=str(DEMO_GGUF), help="default: the bundled demo model")
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path", help="default: the shipped rule file (the GPU one on a GPU host)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--deferred", type=int, nargs="+", default=[0, 1, 2],
                   help="counts of deferred experts to compare; the first is the reference of the KL")
    p.add_argument("--text", help="a text file to score (default: a built-in paragraph of documentation prose)")
    p.add_argument("--max_tokens", type=int, default=512, help="score at most this many of the text's tokens")
    p.add_argument("--decode", type=int, default=64, help="greedy steps of each timed decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quiet", action="store_true", help="no progress bar while loading")
    args = p.parse_args(argv)
    if not Path(args.gguf_path).exists():
        p.error(f"--gguf_path {args.gguf_path} does not exist")
    rows, loaded = measure(args)
    print_table(rows, args, loaded)


if __name__ == "__main__":
    main()
