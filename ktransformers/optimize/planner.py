"""Placement over several GPUs from memory budgets: layer ranges per GPU (a pipeline), hot experts
per GPU with what is left, routed experts otherwise on the CPU — written as a rule file.

    python -m ktransformers.optimize.planner --gguf_path M.gguf --gpu_memory 0:24GiB,1:24GiB \\
        --cache_lens 32768 --out DeepSeek-V3-2gpu.yaml [--dry-run]

The rule file is the architecture's single-GPU file with each rule copied per GPU and restricted
to that GPU's layers (`cuda` -> `cuda:g`); modules outside the layers go to the first GPU
(embeddings, rotary tables) or the last (final norm, lm_head). Layer bytes come from the model's
shapes: linears as int4 + per-32 scale/offset (what KLinearMarlin keeps of Q4_0/Q4_K tensors;
with --gguf_path, each tensor's stored type decides), norms and other small tensors in bf16,
the KV cache of `cache_lens` tokens, and a reserve per GPU for activations and CUDA graphs.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..weights.ggml_quants import GGMLType
from ..weights.gguf_config import routed_experts
from .memory import GIB, _group_bytes, _stored, available_memory, cache_values_per_token, parse_memory, size

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Placement:
    gpus: list[str]
    layers: dict[str, list[int]]  # gpu -> its layer indices (a contiguous run)
    hot_experts: dict[str, int]  # gpu -> num_gpu_experts per layer it holds
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> what -> bytes
    budgets: dict[str, int] = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"{'device':<8} {'layers':<12} {'hot experts':>11} {'planned':>11} {'budget':>11}  of which"]
        for gpu in self.gpus:
            layers = self.layers[gpu]
            run = f"{layers[0]}-{layers[-1]}" if layers else "-"
            kinds = self.bytes.get(gpu, {})
            parts = ", ".join(f"{k} {size(v)}" for k, v in kinds.items())
            lines.append(f"{gpu:<8} {run:<12} {self.hot_experts[gpu]:>11} {size(sum(kinds.values())):>11} "
                         f"{size(self.budgets[gpu]):>11}  {parts}")
        if "cpu" in self.bytes:
            kinds = self.bytes["cpu"]
            parts = ", ".join(f"{k} {size(v)}" for k, v in kinds.items())
            budget = size(self.budgets["cpu"]) if "cpu" in self.budgets else "-"
            lines.append(f"{'cpu':<8} {'experts':<12} {'':>11} {size(sum(kinds.values())):>11} {budget:>11}  {parts}")
        return "\n".join(lines)

    def ram_warning(self) -> str | None:
        """A line when the routed experts (read from the mapped file) exceed the RAM budget."""
        need = sum(self.bytes.get("cpu", {}).values())
        if "cpu" in self.budgets and need > self.budgets["cpu"]:
            return (f"warning: the routed experts ({size(need)}) exceed the RAM budget ({size(self.budgets['cpu'])}): "
                    f"they are pages of the mapped GGUF, so this runs, but decode re-reads them from disk")
        return None


def layer_bytes(model, config, weights=None, cache_lens: int = 4096, page_size: int = 256):
    """Per layer: (dense GPU bytes, bytes of one routed expert, KV cache bytes); and the bytes of
    the modules outside the layers: {name prefix: bytes}."""
    n = config.num_hidden_layers
    dense, expert, outside = [0.0] * n, [0.0] * n, {}
    experts_per_layer = routed_experts(config) or 1
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        ggml_type, _ = _stored(weights, name)
        if p.dim() >= 2:
            nbytes = _group_bytes(ggml_type if weights is not None else GGMLType.Q4_K, p.numel(), 2)
        else:
            nbytes = p.numel() * 2
        if m is None:  # embeddings, final norm, lm_head (counted in bf16: dense where not int4-convertible)
            key = ".".join(name.split(".")[:2]) if name.startswith("model.") else name.split(".")[0]
            outside[key] = outside.get(key, 0) + p.numel() * 2
            continue
        i = int(m[1])
        if ".mlp.experts." in name:  # stored type of gate (for gate_up) / down decides int4 or bf16 on the GPU
            stored_as = name.replace("gate_up_proj", "gate_proj")
            t = _stored(weights, stored_as)[0] if weights is not None else GGMLType.Q4_K
            expert[i] += _group_bytes(t if t is not None else GGMLType.Q4_K, p.numel(), 2) / experts_per_layer
        else:
            dense[i] += nbytes
        if name.endswith("self_attn.kv_b_proj.weight"):
            dense[i] += p.numel() * 4  # W_uk / W_uv in float32 for absorption
    capacity = -(-cache_lens // page_size) * page_size
    kv = [cache_values_per_token(config) * capacity * 2] * n  # bf16
    return dense, expert, kv, outside


def expert_ram_bytes(model, weights) -> int:
    """Stored bytes of every routed expert tensor (what the CPU kernels read from the mapped
    GGUF); 0 without the file."""
    from ..weights.ggml_quants import tensor_nbytes
    if weights is None:
        return 0
    total = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            t = _stored(weights, name.replace("gate_up_proj", "gate_proj"))[0]
            if t is not None:
                total += tensor_nbytes(t, p.numel())
    return total


def plan_gpus(model, config, budgets: dict[str, int], weights=None, cache_lens: int = 4096,
              reserve: int = 2 * GIB) -> Placement:
    """Contiguous layer runs over the GPUs in order, in proportion to their free bytes (else each
    GPU filled before the next), then hot experts with each GPU's remaining bytes. Raises
    ValueError when the layers do not fit."""
    gpus = sorted((d for d in budgets if d.startswith("cuda")), key=lambda d: int(d.split(":")[1]))
    if not gpus:
        raise ValueError("no GPU budget given (e.g. --gpu_memory 0:24GiB,1:24GiB)")
    dense, expert, kv, outside = layer_bytes(model, config, weights, cache_lens)
    first = sum(v for k, v in outside.items() if "embed" in k)
    last = sum(v for k, v in outside.items() if "embed" not in k)
    free = {g: budgets[g] - reserve for g in gpus}
    free[gpus[0]] -= first
    free[gpus[-1]] -= last
    cost = [dense[i] + kv[i] for i in range(config.num_hidden_layers)]
    layers = _balanced(cost, gpus, free) or _greedy(cost, gpus, free)
    if layers is None:
        total = sum(cost) + first + last + reserve * len(gpus)
        raise ValueError(f"the layers do not fit the GPUs: {size(total)} needed (dense layers, KV cache of "
                         f"{cache_lens} tokens, embeddings, lm_head, {size(reserve)} reserve each), "
                         f"{size(sum(budgets[x] for x in gpus))} given; lower --cache_lens or add GPUs")
    for gpu in gpus:
        free[gpu] -= sum(cost[i] for i in layers[gpu])
    experts_per_layer = routed_experts(config)
    hot, used = {}, {}
    for gpu in gpus:
        own = layers[gpu]
        moe = [i for i in own if expert[i] > 0]
        per_expert = sum(expert[i] for i in moe)
        hot[gpu] = min(experts_per_layer, int(max(free[gpu], 0) // per_expert)) if per_expert else 0
        used[gpu] = {"dense layers": int(sum(dense[i] for i in own)), "KV cache": int(sum(kv[i] for i in own)),
                     "hot experts": int(hot[gpu] * per_expert), "reserve": reserve}
    used[gpus[0]]["embeddings"] = int(first)
    used[gpus[-1]]["norm + lm_head"] = int(last)
    per_device = {g: {k: v for k, v in used[g].items() if v} for g in gpus}
    # the CPU kernels compute on the GGUF's pages as stored (every expert stays there, hot ones too)
    ram = expert_ram_bytes(model, weights)
    if ram:
        per_device["cpu"] = {"routed experts (mapped file)": int(ram)}
    return Placement(gpus, layers, hot, per_device, {d: budgets[d] for d in gpus + ["cpu"] if d in budgets})


def _balanced(cost: list[float], gpus: list[str], free: dict[str, float]) -> dict[str, list[int]] | None:
    """Contiguous runs whose costs are in proportion to the GPUs' free bytes (so every GPU keeps
    room for hot experts of its own layers); None if a run would not fit its GPU."""
    total_free, total = sum(max(free[g], 0) for g in gpus), sum(cost)
    if total_free <= 0:
        return None
    layers, i, acc, share = {g: [] for g in gpus}, 0, 0.0, 0.0
    for k, gpu in enumerate(gpus):
        share += max(free[gpu], 0) / total_free
        while i < len(cost) and (k == len(gpus) - 1 or acc + cost[i] / 2 <= share * total):
            layers[gpu].append(i)
            acc += cost[i]
            i += 1
    ok = all(sum(cost[j] for j in layers[g]) <= free[g] for g in gpus)
    return layers if ok else None


def _greedy(cost: list[float], gpus: list[str], free: dict[str, float]) -> dict[str, list[int]] | None:
    """Each GPU filled before the next; None if the layers do not fit."""
    layers, room, g = {x: [] for x in gpus}, dict(free), 0
    for i, c in enumerate(cost):
        while g < len(gpus) and c > room[gpus[g]]:
            g += 1
        if g == len(gpus):
            return None
        layers[gpus[g]].append(i)
        room[gpus[g]] -= c
    return layers


def _restrict(name: str | None, layers: list[int]) -> str:
    """A name regex limited to the given layers (re.search semantics kept)."""
    run = "|".join(str(i) for i in layers)
    return f"^(?=model\\.layers\\.(?:{run})\\.).*?(?:{name})" if name else f"^model\\.layers\\.(?:{run})\\."


def _on(kwargs: dict, gpu: str) -> dict:
    return {k: (gpu if isinstance(v, str) and v.startswith("cuda") else v) for k, v in kwargs.items()}


def write_rules(placement: Placement, template: list[dict]) -> str:
    """The single-GPU rule file `template` (parsed YAML) spread over the placement's GPUs."""
    out = []
    gpus = placement.gpus
    for rule in template:
        match, replace = dict(rule.get("match", {})), dict(rule.get("replace", {}))
        kwargs = replace.get("kwargs", {}) or {}
        name = match.get("name")
        inside_only = bool(name) and name.startswith("^model\\.layers\\.")
        if not inside_only:  # modules outside the layers: embeddings/rotary on the first GPU, the rest on the last
            front = any(k in (name or "") for k in ("embed", "rotary")) or "Rotary" in str(match.get("class"))
            target = gpus[0] if front else gpus[-1]
            out.append({**rule, "match": {**match, "name": f"^(?!model\\.layers\\.)(?:{name or '.*'})"},
                        "replace": {**replace, "kwargs": _on(kwargs, target)} if kwargs else replace})
        for gpu in gpus:
            own = placement.layers[gpu]
            if not own:
                continue
            copy = dict(rule)
            restricted = name[len("^model\\.layers\\."):] if inside_only else name
            if inside_only:
                # (a layer's own modules, or the layer itself: KDecoderLayer's rule names model.layers.N)
                runs = "|".join(map(str, own))
                copy["match"] = {**match, "name": f"^model\\.layers\\.(?=(?:{runs})(?:\\.|$)){restricted}"}
            else:
                copy["match"] = {**match, "name": _restrict(name, own)}
            new_kwargs = _on(kwargs, gpu)
            if replace.get("class", "").endswith("KTransformersExperts"):
                new_kwargs = {**new_kwargs, "out_device": gpu}
                if placement.hot_experts[gpu]:
                    new_kwargs.update(num_gpu_experts=placement.hot_experts[gpu], gpu_experts_device=gpu)
            copy["replace"] = {**replace, "kwargs": new_kwargs} if kwargs else replace
            out.append(copy)
    head = ["# Generated by python -m ktransformers.optimize.planner; one GPU's share of the layers each:"]
    head += [f"#   {line}" for line in placement.format().splitlines()]
    return "\n".join(head) + "\n" + yaml.safe_dump(out, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf_path", help="GGUF (config from its metadata; stored types sharpen the byte counts)")
    p.add_argument("--model_path", help="HF directory with config.json")
    p.add_argument("--gpu_memory", default="free", help="'0:24GiB,1:24GiB' or 'free' (what the GPUs have now)")
    p.add_argument("--cache_lens", type=int, default=8192)
    p.add_argument("--reserve", type=float, default=2.0, help="GiB kept free on each GPU (activations, graphs)")
    p.add_argument("--base_rules", help="the single-GPU rule file to spread (default: the shipped one)")
    p.add_argument("--out", help="where to write the rule file")
    p.add_argument("--dry-run", action="store_true", help="print the byte budget per device, write nothing")
    a = p.parse_args(argv)
    from .skeleton import RULES_DIR, build_skeleton, default_rule_file, load_config
    try:
        config = load_config(a.model_path, a.gguf_path)
        budgets = available_memory() if a.gpu_memory == "free" else parse_memory(a.gpu_memory)
        weights = None
        if a.gguf_path:
            from ..weights.gguf import GGUFSource
            weights = GGUFSource(a.gguf_path)
        model = build_skeleton(config, torch.bfloat16)
        placement = plan_gpus(model, config, budgets, weights, a.cache_lens, int(a.reserve * GIB))
        base = Path(a.base_rules) if a.base_rules else default_rule_file(config, gpu=True)
        if not str(base).endswith(".yaml") or not Path(base).is_file():
            base = RULES_DIR / str(base)
        text = write_rules(placement, yaml.safe_load(Path(base).read_text()))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(placement.format())
    warning = placement.ram_warning()
    if warning:
        print(warning, file=sys.stderr)
    if a.out and not a.dry_run:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
