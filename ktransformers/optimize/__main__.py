"""Print the placement plan a rule file gives a model, without loading any weight.

    python -m ktransformers.optimize --gguf_path DIR [--model_path DIR] [--optimize_config_path RULES.yaml] --dry-run
"""
from __future__ import annotations

import argparse
import sys

import torch

from .skeleton import build_skeleton, default_rule_file, load_config
from .inject import format_plan, plan
from .rules import RuleError, load_rules


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", help="GGUF file or directory (config is read from its metadata)")
    p.add_argument("--model_path", help="HF directory with config.json")
    p.add_argument("--optimize_config_path", help="rule file (default: the shipped CPU file for the model)")
    p.add_argument("--default_device", default="cpu")
    p.add_argument("--cache_lens", type=int, default=4096, help="KV cache tokens counted in the memory plan")
    p.add_argument("--dry-run", action="store_true", help="print the plan (the only mode; nothing is loaded)")
    a = p.parse_args(argv)
    try:
        config = load_config(a.model_path, a.gguf_path)
        rules_path = a.optimize_config_path or default_rule_file(config, gpu=a.default_device.startswith("cuda"))
        model = build_skeleton(config, torch.bfloat16)
        rows = plan(model, load_rules(rules_path), a.default_device, f"rule file {rules_path}")
    except (RuleError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"rules: {rules_path}\n{format_plan(rows)}")
    if a.gguf_path:
        from ..weights.gguf import GGUFSource
        from .memory import available_memory, plan_memory, size
        mem = plan_memory(model, rows, GGUFSource(a.gguf_path), config, torch.bfloat16, cache_lens=a.cache_lens)
        free = available_memory()
        print(f"\nmemory (KV cache of {a.cache_lens} tokens; free now: "
              + ", ".join(f"{d} {size(n)}" for d, n in free.items()) + ")\n" + mem.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
