"""A LoRA adapter (peft's format: adapter_config.json + adapter_model.safetensors) merged into
the weights as they load: each adapted linear's weight becomes W + scale * B @ A, dequantized
(the operators then quantize or keep it as they do any dense weight); every other tensor comes
from the base source untouched. This is how an adapter trained by `python -m ktransformers.sft`
runs in local_chat and the server (`--lora_path`)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from .source import WeightError, WeightSource

_PREFIX = "base_model.model."
_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A(\.[^.]+)?\.weight$")


def read_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """{HF weight name: float32 delta} of a peft LoRA adapter directory; a WeightError names the
    file and what it cannot use (another adapter type, DoRA, a missing B for an A)."""
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
    deltas = {}
    for key, a in tensors.items():
        m = _LORA_A.match(key)
        if not m:
            continue
        module = m["module"].removeprefix(_PREFIX)
        b = tensors.get(key.replace(".lora_A", ".lora_B"))
        if b is None:
            raise WeightError(f"{weights_file}: {key} has no lora_B beside it")
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        deltas[f"{module}.weight"] = scale * (b.float() @ a.float())
    if not deltas:
        raise WeightError(f"{weights_file}: no LoRA weights (lora_A/lora_B pairs)")
    return deltas


def _pattern_value(patterns: dict, module: str, default):
    """peft's per-module override: the value of the first pattern the module's name ends with."""
    for pattern, value in patterns.items():
        if re.search(rf"(^|\.){pattern}$", module):
            return value
    return default


class LoraSource(WeightSource):
    """`base` with an adapter's deltas merged into the weights they adapt (read_adapter)."""

    def __init__(self, base: WeightSource, adapter: str | Path):
        super().__init__()
        self.base, self.deltas = base, read_adapter(adapter)
        self.path = f"{base.path} + LoRA {adapter}"
        self.aliases, self.consumed = base.aliases, base.consumed  # (one bookkeeping for both)
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
