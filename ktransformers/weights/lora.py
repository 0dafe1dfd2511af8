"""A LoRA adapter (peft's format: adapter_config.json + adapter_model.safetensors) merged into
the weights as they load: each adapted linear's weight becomes W + scale * B @ A, dequantized
(the operators then quantize or keep it as they do any dense weight); every other tensor comes
from the base source untouched. This is how an adapter trained by `python -m ktransformers.sft`
runs in local_chat and the server (`--lora_path`).

Adapters of the routed experts (peft's target_parameters, "experts.gate_up_proj" and
"experts.down_proj": lora_A [r*E, in], lora_B [out, r*E], expert e's rows and columns as
operators/experts/adapters.py reads them) merge into each expert's gate, up and down stacks, which
then load dense (bf16, or float32 for a float32 model) rather than as stored."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from .source import WeightError, WeightSource

_PREFIX = "base_model.model."
_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A(\.[^.]+)?\.weight$")


def read_adapter(path: str | Path, interleaved: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """{HF weight name: float32 delta} of a peft LoRA adapter directory; a WeightError names the
    file and what it cannot use (another adapter type, DoRA, a missing B for an A). `interleaved`:
    the experts modules whose gate_up rows alternate gate and up (gpt-oss)."""
    from safetensors.torch import load_file
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise WeightError(f"{path}: not a peft adapter directory (adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise WeightError(f"{config_file}: only plain LoRA adapters merge here, not {config.get('peft_type')}"
                          f"{' with DoRA' if config.get('use_dora') else ''}")
    tensors = load_file(str(weights_file))
    expert_params = [p for p in ("gate_up_proj", "down_proj")
                     if any(t.endswith(p) for t in config.get("target_parameters") or [])]
    deltas = {}
    for key, a in tensors.items():
        m = _LORA_A.match(key)
        if not m:
            continue
        module = m["module"].removeprefix(_PREFIX)
        b = tensors.get(key.replace(".lora_A", ".lora_B"))
        if b is None:
            raise WeightError(f"{weights_file}: {key} has no lora_B beside it")
        experts = module.removesuffix(".base_layer")
        if expert_params and experts.endswith(".experts"):
            # peft nests gate_up's wrapper inside down's (base_layer) where it adapts both
            param = expert_params[0] if module.endswith(".base_layer") or len(expert_params) == 1 else "down_proj"
            deltas.update(_expert_deltas(experts, param, a, b, config, experts in interleaved, weights_file))
            continue
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        deltas[f"{module}.weight"] = lora_scale(alpha, rank, config.get("use_rslora", False)) * (b.float() @ a.float())
    if not deltas:
        raise WeightError(f"{weights_file}: no LoRA weights (lora_A/lora_B pairs)")
    return deltas


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """peft's scaling of B A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def expert_factors(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, r, in], B [E, out, r]), views of peft's adapters of a stacked experts parameter:
    lora_A [r*E, in] holds expert e's rows at e*r .. e*r + r - 1, lora_B [out, r*E] its columns at
    e, E + e, 2E + e, ..."""
    rank = a.shape[0] // experts
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)


def _expert_deltas(module: str, param: str, a: torch.Tensor, b: torch.Tensor, config: dict, interleaved: bool,
                   where) -> dict[str, torch.Tensor]:
    """{name: delta} of one adapted experts projection: gate_proj and up_proj [E, I, H] (and their
    stack gate_up_proj [E, 2I, H]) from gate_up's, or down_proj [E, H, I]."""
    rank = int(_pattern_value(config.get("rank_pattern") or {}, f"{module}.{param}", config.get("r", 0)) or 0)
    if rank < 1 or a.shape[0] % rank or b.shape[1] != a.shape[0]:
        raise WeightError(f"{where}: {module}.{param}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                          f"rank-{rank} adapters of stacked experts")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, f"{module}.{param}", config.get("lora_alpha", rank))
    A, B = expert_factors(a.float(), b.float(), a.shape[0] // rank)
    delta = lora_scale(alpha, rank, config.get("use_rslora", False)) * torch.bmm(B, A)  # [E, out, in]
    if param == "down_proj":
        return {f"{module}.down_proj": delta}
    gate, up = (delta[:, 0::2], delta[:, 1::2]) if interleaved else delta.chunk(2, dim=1)
    return {f"{module}.gate_proj": gate.contiguous(), f"{module}.up_proj": up.contiguous(),
            f"{module}.gate_up_proj": torch.cat([gate, up], dim=1)}


def _pattern_value(patterns: dict, module: str, default):
    """peft's per-module override: the value of the first pattern the module's name ends with."""
    for pattern, value in patterns.items():
        if re.search(rf"(^|\.){pattern}$", module):
            return value
    return default


class LoraSource(WeightSource):
    """`base` with an adapter's deltas merged into the weights they adapt (read_adapter)."""

    def __init__(self, base: WeightSource, adapter: str | Path, interleaved: frozenset[str] = frozenset()):
        """`interleaved`: read_adapter's."""
        super().__init__()
        self.base, self.deltas = base, read_adapter(adapter, interleaved)
        self.path = f"{base.path} + LoRA {adapter}"
        self.aliases, self.consumed = base.aliases, base.consumed  # (one bookkeeping for both)
        for name in [n for n in self.deltas if n.endswith(".gate_up_proj") and not base.has(n)]:
            del self.deltas[name]  # (a source without the stack gives gate and up apart)
        unknown = [n for n in self.deltas if not base.has(n)]
        if unknown:
            raise WeightError(f"LoRA adapter {adapter}: {len(unknown)} adapted weight(s) the model does not have, "
                              f"e.g. {unknown[0]!r} (an adapter of another model?)")

    def __getattr__(self, name: str):  # the base's other attributes (files, arch, unknown, ...)
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def keys(self):
        return self.base.keys()

    def info(self, name):
        return self.base.info(name)

    def raw(self, name):
        return self.base.raw(name)

    def _load_stored(self, name, dtype=None):
        return self.base._load_stored(name, dtype)

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def raw_stacked(self, name):
        return None if name in self.deltas else self.base.raw_stacked(name)  # (merged: dense)

    def fp8_blocks(self, name):
        return None if name in self.deltas else self.base.fp8_blocks(name)

    def stored_row_order(self, name):
        return self.base.stored_row_order(name)

    def load(self, name, device="cpu", dtype=None, shape=None):
        if name not in self.deltas:
            return self.base.load(name, device, dtype, shape)
        weight = self.base.load(name, "cpu", torch.float32, shape)
        delta = self.deltas[name]
        if delta.shape != weight.shape:
            raise WeightError(f"{self.path}: the adapter's delta for {name!r} is {tuple(delta.shape)}, the weight "
                              f"{tuple(weight.shape)}")
        return (weight + delta).to(device=device, dtype=dtype or torch.float32)

    def unconsumed(self) -> list[str]:
        return self.base.unconsumed()
