"""Plan placement on the meta model, replace modules with operators, load their weights.

    rows = plan(model, rules)            # data: (module name, rule index, operator, kwargs)
    inject(model, rows, weights, config) # swap modules for operator instances (still meta)
    load_weights(model, rows, weights)   # every tensor from the WeightSource, onto its device
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..operators.base import BaseInjectedModule, RunContext
from ..weights.gguf import GGUFSource
from ..weights.safetensors import SafetensorsSource
from ..weights.source import WeightError, WeightSource
from .rules import DEFAULT, Rule, RuleError, check_rules_fit, first_match, load_rules, parse_rules

_ROTARY = re.compile(r"\.rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class PlanRow:
    name: str
    rule: int | None  # index of the rule that matched; None: placed by inheritance / default_device
    operator: str  # operator name as the rule file gives it, or "default" (keep the HF module)
    kwargs: dict = field(default_factory=dict)
    cls: type | None = field(default=None, repr=False, compare=False)  # the operator class; None for default

    @property
    def device(self) -> str:
        return self.kwargs.get("generate_device") or self.kwargs.get("prefill_device") or "cpu"


def plan(model: nn.Module, rules: list[Rule], default_device: str = "cpu", source: str = "the rule file") -> list[PlanRow]:
    """Walk named_modules top-down; the first matching rule decides each module. A file for another
    architecture (`source` names it) is a RuleError first."""
    check_rules_fit(model, rules, source)
    rows: list[PlanRow] = []

    def visit(name: str, module: nn.Module, inherited: dict) -> None:
        rule = first_match(rules, name, module)
        if rule is None:
            rows.append(PlanRow(name, None, DEFAULT, inherited))
        else:
            rows.append(PlanRow(name, rule.index, rule.operator_name, rule.kwargs, rule.operator))
            if not rule.recursive:
                return
            if rule.operator is None and rule.kwargs:
                inherited = {k: v for k, v in rule.kwargs.items() if k.endswith("_device")}
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, inherited)

    base = {"generate_device": default_device, "prefill_device": default_device}
    for child_name, child in model.named_children():
        visit(child_name, child, base)
    _check_transfer_maps(rows, source)
    return rows


def _check_transfer_maps(rows: list[PlanRow], source: str) -> None:
    """Upstream's transfer_map ({layer: device}, on its model-level operator) must agree with where
    the layers' own rules put their attention: here those rules decide, and the engine moves the
    hidden states at each change of device."""
    devices = {r.name: r.device for r in rows}
    for row in rows:
        for layer, device in (row.kwargs.get("transfer_map") or {}).items():
            placed = devices.get(f"model.layers.{layer}.self_attn")
            if placed is None or torch.device(placed) != torch.device(str(device)):
                raise RuleError(f"{source}: rule {row.rule}: transfer_map puts layer {layer} on {device}, but its "
                                f"rules put its attention on {placed or 'no device (no such layer)'}: place layers by "
                                f"their own rules (generate_device / prefill_device; docs/multi_gpu.md)")


def format_plan(rows: list[PlanRow]) -> str:
    """The plan as a table: one line per matched module, then a count of the rest."""
    matched = [r for r in rows if r.rule is not None]
    width = max((len(r.name) for r in matched), default=10)
    lines = [f"{'module':<{width}}  rule  operator  kwargs"]
    lines += [f"{r.name:<{width}}  {r.rule:>4}  {r.operator}  {r.kwargs}" for r in matched]
    lines.append(f"({len(rows) - len(matched)} more modules keep their HF class, placed on their parent's device)")
    return "\n".join(lines)


def check_devices(rows: list[PlanRow]) -> None:
    """Every device a row names must exist here; say which rule asked for one that does not."""
    for row in rows:
        for key, value in row.kwargs.items():
            if not key.endswith("_device"):
                continue
            device = torch.device(value)
            if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
                where = f"rule {row.rule}" if row.rule is not None else "default_device"
                raise ValueError(f"{where} puts {row.name!r} on {value} ({key}), but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s); use a -cpu rule file or another device")


def inject(model: nn.Module, rows: list[PlanRow], weights: WeightSource, config,
           context: RunContext | None = None) -> RunContext:
    """Replace every module whose row names an operator (top-down, so parents go first).
    Every operator gets the same RunContext (the model's CPU runtime); it is returned."""
    context = context or RunContext()
    for row in rows:
        if row.cls is None:
            continue
        parent_name, _, attr = row.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        orig = getattr(parent, attr)
        operator = row.cls(row.name, weights, config, orig, **row.kwargs)
        operator.context = context
        setattr(parent, attr, operator)
    return context


def load_weights(model: nn.Module, rows: list[PlanRow], weights: WeightSource, progress: bool = False) -> None:
    """Load operators (each pulls its own tensors) and the parameters of the modules kept as they are."""
    device_of = {r.name: r.device for r in rows}
    modules = list(model.named_modules())
    for name, module in tqdm(modules, desc="loading", unit="module", disable=not progress):
        if isinstance(module, BaseInjectedModule):
            module.load()
        elif name in device_of:
            _load_own_tensors(name, module, weights, torch.device(device_of[name]))
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftovers:
        raise WeightError(f"{weights.path}: after loading, these tensors have no data: {', '.join(leftovers[:20])}"
                          + (f" and {len(leftovers) - 20} more" if len(leftovers) > 20 else ""))


def _load_own_tensors(name: str, module: nn.Module, weights: WeightSource, device: torch.device) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        tensor = weights.load(f"{name}.{pname}", device, param.dtype, shape=tuple(param.shape))
        module._parameters[pname] = nn.Parameter(tensor, requires_grad=False)
    for bname, buf in list(module.named_buffers(recurse=False)):
        full = f"{name}.{bname}"
        persistent = bname not in module._non_persistent_buffers_set
        if persistent and (weights.has(full) or buf.is_meta):
            buf = weights.load(full, device, buf.dtype, shape=tuple(buf.shape))
        module._buffers[bname] = buf.to(device)


def is_gguf(path: str | os.PathLike) -> bool:
    """A .gguf file or a directory holding some."""
    path = Path(path)
    return path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))


def open_weights(path: str | os.PathLike | WeightSource, model_type: str = "") -> WeightSource:
    """A GGUF file / directory, or a directory of safetensors (an open WeightSource passes as is)."""
    if isinstance(path, WeightSource):
        return path
    if is_gguf(path):
        return GGUFSource(path)
    path = Path(path)
    if path.suffix == ".safetensors" or (path.is_dir() and any(path.glob("*.safetensors"))):
        return SafetensorsSource(path, model_type)
    if not path.exists():
        raise FileNotFoundError(f"weights path {str(path)!r} does not exist")
    raise WeightError(f"{path}: neither a .gguf file nor a directory of .gguf or .safetensors files")


def check_extras(weights: WeightSource, config) -> None:
    """Tensors in the file that the model did not read mean the file and config disagree."""
    unknown = getattr(weights, "unknown", [])
    extra = [n for n in weights.unconsumed() if not _ignorable(n, config, weights)]
    problems = []
    if unknown:
        problems.append(f"tensors the {getattr(weights, 'arch', '')} name map does not know: {', '.join(unknown[:20])}")
    if extra:
        problems.append(f"tensors the model did not use: {', '.join(extra[:20])}" + (" ..." if len(extra) > 20 else ""))
    if problems:
        raise WeightError(f"{weights.path}: " + "; ".join(problems))


def _ignorable(name: str, config, weights: WeightSource) -> bool:
    """Multi-token-prediction (next-n) layers after the last layer: HF checkpoints keep them (DeepSeek,
    GLM), and so do GLM-4.5's GGUFs; the HF model does not build them, so they are left unread."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    n, mtp = config.num_hidden_layers, getattr(config, "num_nextn_predict_layers", 0) or 0
    is_mtp = match is not None and n <= int(match[1]) < n + mtp
    return is_mtp or bool(_ROTARY.search(name))


def recompute_meta_buffers(model: nn.Module, config) -> None:
    """The rotary embeddings' tables of a skeleton built under `torch.device("meta")` (as upstream's
    scripts build it), which no checkpoint holds: computed again from the config by their own
    class. (Other buffers come from the weights; load_weights names any left without data.)"""
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        meta = [b for b, t in module.named_buffers(recurse=False) if t is not None and t.is_meta]
        meta += [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta and k not in meta]
        if not meta:
            continue
        with torch.device("cpu"):
            fresh = type(module)(config=getattr(module, "config", config))
        for key in meta:
            if key in module._buffers:
                module._buffers[key] = getattr(fresh, key)
            else:
                setattr(module, key, getattr(fresh, key))


def optimize_and_load_gguf(model: nn.Module, rule_file: str | os.PathLike | list[Rule],
                           gguf_path: str | os.PathLike | WeightSource,
                           config, default_device: str = "cpu", progress: bool = False,
                           cpu_infer: int | None = None, cpu_tiles: bool = True) -> list[PlanRow]:
    """Rewrite `model` (built on the meta device) by the rules and load its weights in place.

    `gguf_path`: a .gguf file (split siblings found beside it), a directory of one model's GGUF
    files, a directory of safetensors, or a WeightSource already opened on one of them. `cpu_infer`: threads of the CPU kernels (default: all
    cores this process may use). `cpu_tiles`: repack the CPU kernels' Q4_K/Q5_K/Q6_K/IQ4_XS/Q8_0 weights
    into 16-row tiles (a RAM copy; False: compute on the mapped file). Returns the plan rows (what
    replaced what)."""
    rules = rule_file if isinstance(rule_file, list) else load_rules(rule_file)
    recompute_meta_buffers(model, config)
    weights = open_weights(gguf_path, config.model_type)
    if getattr(config, "tie_word_embeddings", False) or not weights.has("lm_head.weight"):
        weights.aliases["lm_head.weight"] = "model.embed_tokens.weight"
    rows = plan(model, rules, default_device, "the given rules" if isinstance(rule_file, list) else f"rule file {rule_file}")
    check_devices(rows)
    model.kt_context = inject(model, rows, weights, config, RunContext(cpu_infer, cpu_tiles))
    load_weights(model, rows, weights, progress)
    check_extras(weights, config)
    thresholds = [r.kwargs["per_layer_prefill_intput_threshold"] for r in rows
                  if "per_layer_prefill_intput_threshold" in r.kwargs]  # upstream's model-level operator's
    if thresholds:
        from ..operators.experts import set_prefill_gpu_threshold
        set_prefill_gpu_threshold(model, thresholds[-1])
    model.eval()
    return rows


__all__ = ["PlanRow", "plan", "format_plan", "inject", "load_weights", "open_weights", "optimize_and_load_gguf",
           "parse_rules", "load_rules"]
