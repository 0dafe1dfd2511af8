"""What grammar-constrained decoding (structured output, forced tool calls) costs a decode step.

    python -m ktransformers.bench.grammar                      # the bundled demo model
    python -m ktransformers.bench.grammar --gguf_path /tmp/q3-48.gguf --threads 14 --batch 1 8

For each batch size B: B sequences after a 64-token prompt, decoded greedily `--steps` steps the
way the server decodes constrained requests (each step's logits read back, each row masked by
its request's grammar where the logits are, then its pick taken by the grammar), step for step
beside a like batch decoded freely. Columns: `free step ms` (an unconstrained step: its forward
and picks), `step ms` (a constrained step's forward and picks), `mask ms` (the grammars' work in
that step, all rows: the next-token bitmasks, their application to the logits, the picks taken
by the grammars), their ratio, and what a constrained step costs over a free one in all. The
grammar is a tool call's arguments (a JSON schema with strings, an integer, an enum and an
array); a row whose JSON is complete starts over as a new request of that schema would.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from . import machine, sync

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "units", "fields"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"},
                         "units": {"enum": ["metric", "imperial"]},
                         "fields": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}


def measure(engine, grammars, vocab: int, batch: int, steps: int) -> dict:
    """Two like batches decoded step for step, one free and one constrained (so that their
    contexts grow alike and the machine's drift falls on both)."""
    from ..engine.grammar import mask_rows
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (64,), generator=gen).tolist() for _ in range(batch)]
    free_seqs, seqs = ([engine.new_sequence() for _ in range(batch)] for _ in range(2))
    free_tokens = [int(engine.prefill(s, p)[0].argmax()) for s, p in zip(free_seqs, prompts)]
    tokens = [int(engine.prefill(s, p)[0].argmax()) for s, p in zip(seqs, prompts)]
    constraints = [grammars.json_schema(SCHEMA) for _ in range(batch)]
    free_s, step_s, mask_s = [], [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        free_tokens = engine.step(free_seqs, [[t] for t in free_tokens]).argmax(dim=-1).tolist()
        t1 = time.perf_counter()
        logits = engine.step(seqs, [[t] for t in tokens])
        sync()
        t2 = time.perf_counter()
        mask_rows(logits, constraints, list(range(batch)))  # (as the scheduler does: before the read-back)
        t3 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()  # (the pick, as the free batch's: the step's)
        t4 = time.perf_counter()
        for i, c in enumerate(constraints):
            if not c.accept(tokens[i]) or c.done:
                constraints[i] = grammars.json_schema(SCHEMA)
        t5 = time.perf_counter()
        free_s.append(t1 - t0)
        step_s.append(t2 - t1 + t4 - t3)
        mask_s.append(t3 - t2 + t5 - t4)
    for s in free_seqs + seqs:
        engine.release(s)
    free, step, mask = (statistics.median(x[1:]) for x in (free_s, step_s, mask_s))
    return {"batch": batch, "free_ms": free * 1e3, "step_ms": step * 1e3, "mask_ms": mask * 1e3, "ratio": mask / step,
            "cost": (step + mask) / free - 1}


def main(argv: list[str] | None = None) -> None:
    from ..demo import DEMO_GGUF
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", default=str(DEMO_GGUF), help="default: the bundled demo model")
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args(argv)
    if not Path(args.gguf_path).exists():
        p.error(f"--gguf_path {args.gguf_path} does not exist")
    from ..engine.generate import Engine, eos_token_ids
    from ..engine.grammar import available, grammars_for
    from ..loader import load_model
    why = available()
    if why:
        raise SystemExit(why)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(args.gguf_path, args.model_path, args.optimize_config_path, default_device=device,
                        cpu_infer=args.threads, progress=False)
    per_sequence = -(-(64 + args.steps + 1) // 64) * 64  # (whole pages: each sequence holds its own)
    engine = Engine(loaded.model, loaded.tokenizer, cache_lens=2 * max(args.batch) * per_sequence, page_size=64,
                    use_cuda_graph=device == "cuda", max_batch=max(args.batch))
    engine._set_phase("generate")
    vocab = loaded.config.vocab_size
    grammars = grammars_for(loaded.tokenizer, vocab, eos_token_ids(loaded.model, loaded.tokenizer))
    rows = [measure(engine, grammars, vocab, b, args.steps) for b in args.batch]
    print(f"# {Path(args.gguf_path).name}, vocabulary {vocab}; {machine(args.threads)}; medians of {args.steps} steps")
    print("| batch | free step ms | step ms | mask ms | mask / step | constrained vs free |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['free_ms']:.2f} | {r['step_ms']:.2f} | {r['mask_ms']:.3f} | {r['ratio']:.1%} | "
              f"{r['cost']:+.1%} |")


if __name__ == "__main__":
    main()
