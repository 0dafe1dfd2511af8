"""Count how often the router picks each expert, over prompts, into the file that hot experts
(`num_gpu_experts` with `expert_counts_file` on the experts rule) read.

    python -m ktransformers.calibrate --gguf_path M.gguf [--model_path DIR] --prompt_file texts.txt \\
        --out expert_counts.json

Each non-empty line of the prompt file (or each --prompt) is one prompt; its tokens go through
prefill and every MoE layer's routing is counted. The file maps each experts module name
(`model.layers.3.mlp.experts`) to a list of counts, one per expert. Without model flags the
bundled demo model is used.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def count_routing(engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Routing counts per experts module over the prefill of each token list."""
    from .operators.moe import KMoEBlock
    counts: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in engine.model.named_modules():
        if isinstance(module, KMoEBlock):
            key = f"{name}.experts"
            experts = module.experts.n_experts if hasattr(module.experts, "n_experts") else None

            def record(_, __, out, key=key, experts=experts):
                index = out[2].reshape(-1).to("cpu", torch.int64)
                n = experts or int(index.max()) + 1
                counts[key] = counts.get(key, torch.zeros(n, dtype=torch.int64)) + torch.bincount(index, minlength=n)
            hooks.append(module.gate.register_forward_hook(record))
    try:
        for ids in prompts:
            seq = engine.new_sequence()
            try:
                engine.prefill(seq, ids)
            finally:
                engine.release(seq)
    finally:
        for h in hooks:
            h.remove()
    return {k: v.tolist() for k, v in sorted(counts.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path")
    p.add_argument("--model_path")
    p.add_argument("--optimize_config_path")
    p.add_argument("--prompt_file", help="one prompt per non-empty line")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--out", required=True, help="where to write the counts (JSON)")
    p.add_argument("--cpu_infer", type=int)
    p.add_argument("--device", default="cpu", help="default device of the model (cpu or cuda)")
    args = p.parse_args(argv)
    from .engine.generate import Engine
    from .loader import load_model
    texts = list(args.prompt)
    if args.prompt_file:
        try:
            texts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            print(f"error: cannot read --prompt_file: {e}", file=sys.stderr)
            return 2
    if not texts:
        print("error: give --prompt_file or --prompt", file=sys.stderr)
        return 2
    gguf_path, model_path = args.gguf_path, args.model_path
    if gguf_path is None:
        from .demo import DEMO_GGUF, DEMO_HF_DIR
        gguf_path, model_path = DEMO_GGUF, model_path or DEMO_HF_DIR
    try:
        loaded = load_model(gguf_path, model_path, args.optimize_config_path, default_device=args.device,
                            cpu_infer=args.cpu_infer)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    longest = max(len(ids) for ids in prompts)
    engine = Engine(loaded.model, loaded.tokenizer, cache_lens=longest + 16, chunk_size=512)
    counts = count_routing(engine, prompts)
    Path(args.out).write_text(json.dumps(counts, indent=1))
    tokens = sum(len(ids) for ids in prompts)
    print(f"counted {len(counts)} MoE layers over {len(prompts)} prompts ({tokens} tokens) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
