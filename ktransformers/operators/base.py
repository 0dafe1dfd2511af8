"""BaseInjectedModule: the lifecycle every operator follows (construct on meta -> load -> forward).

An operator replaces one Hugging Face module. It is constructed from the meta-device original,
pulls its own tensors from a WeightSource in `load()`, and its `forward` keeps the signature and
return type of the module it replaced, so the surrounding HF code keeps working.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .context import RunContext

PHASES = ("prefill", "generate")


def check_device(value: str) -> None:
    """Raise ValueError unless `value` names a torch device ("cpu", "cuda", "cuda:1")."""
    try:
        torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{value!r} is not a device (expected e.g. 'cpu', 'cuda', 'cuda:0')") from e


def choices(get: Callable[[], list[str]]) -> dict:
    """Dataclass field metadata: the value must be one of get() (resolved lazily, registries fill late)."""
    return {"choices": get}


def device_field(default: str = "cpu"):
    return dataclasses.field(default=default, metadata={"device": True})


@dataclass(frozen=True)
class Placement:
    """Where an operator lives in each phase. Every operator's options extend this."""

    prefill_device: str = device_field()
    generate_device: str = device_field()


@dataclass(frozen=True)
class ModelPlacement(Placement):
    """Upstream's model-level operators (`KDeepseekV2Model`, `KQwen2MoeModel`, ... on `^model$`):
    the model stays transformers' own; their setting, the prompt length from which prefill
    streams each layer's experts to the GPU (0: never), is every experts operator's
    prefill_gpu_threshold."""

    per_layer_prefill_intput_threshold: int = dataclasses.field(default=0, metadata={"min": 0})
    # {layer index: device}: where the hidden states move to another GPU; here each layer's own
    # rules place it (the engine moves the hidden states), so the map is checked against them
    transfer_map: dict | None = None


# upstream's names of the model-level operators (ktransformers.operators.models.<name>), and of its
# dense-MLP operators (ktransformers.operators.mlp.<name>: the MLP's linears have rules of their own here)
UPSTREAM_MODEL_OPERATORS = ("KDeepseekV2Model", "KDeepseekV3Model", "KQwen2MoeModel", "KQwen3MoeModel",
                            "KMixtralModel", "KLlamaModel", "KGlm4MoeModel")
UPSTREAM_MLP_OPERATORS = ("kDeepseekV3MLP", "KDeepseekV3MLP", "KQwen2MoeMLP", "KQwen3MoeMLP", "KGlm4MoeMLP")


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint)


def option_errors(options_cls: type, kwargs: dict) -> list[tuple[str, str]]:
    """(key, message) for every kwarg that `options_cls` would not accept; empty when all is well."""
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    hints = typing.get_type_hints(options_cls)
    errors = []
    for key, value in kwargs.items():
        if key not in fields:
            errors.append((key, f"unknown kwarg; valid: {', '.join(sorted(fields))}"))
            continue
        hint, meta = hints[key], fields[key].metadata
        if not _type_ok(value, hint):
            errors.append((key, f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__} {value!r}"))
        elif meta.get("device") and value is not None:
            try:
                check_device(value)
            except ValueError as e:
                errors.append((key, str(e)))
        elif "choices" in meta and value not in meta["choices"]():
            errors.append((key, f"{value!r} is not one of: {', '.join(map(str, meta['choices']()))}"))
        elif "min" in meta and value < meta["min"]:
            errors.append((key, f"must be at least {meta['min']}, got {value!r}"))
    return errors


def make_options(options_cls: type, kwargs: dict, owner: str):
    errors = option_errors(options_cls, kwargs)
    if errors:
        raise ValueError(f"{owner}: " + "; ".join(f"{k}: {m}" for k, m in errors))
    return options_cls(**kwargs)


class BaseInjectedModule(nn.Module):
    """Base of every operator. Subclasses set `Options` (a frozen dataclass extending Placement)."""

    Options: ClassVar[type] = Placement
    context: RunContext | None = None  # set by inject(); operators that need CPU kernels read it

    def __init__(self, key: str, weights, config, orig_module: nn.Module | None, **kwargs):
        super().__init__()
        self.key = key
        self.weights = weights
        self.config = config
        self.options = make_options(self.Options, kwargs, f"{type(self).__name__} at {key!r}")
        self.phase = "prefill"

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.options, f"{self.phase}_device"))

    def run_context(self) -> RunContext:
        if self.context is None:
            self.context = RunContext()
        return self.context

    def load(self) -> None:
        """Pull this operator's own tensors from self.weights onto its devices."""

    def unload(self) -> None:
        """Drop loaded tensors (back to an unloaded state)."""

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase = phase

    def extra_repr(self) -> str:
        return f"key={self.key!r}, {self.options}"


def adopt_children(new: nn.Module, orig: nn.Module) -> None:
    """Let a container operator keep the original's submodules under the same names."""
    for name, child in orig.named_children():
        new.add_module(name, child)


def set_phase(model: nn.Module, phase: str) -> None:
    """Switch every operator in `model` to the prefill or generate phase."""
    for module in model.modules():
        if isinstance(module, BaseInjectedModule):
            module.set_phase(phase)
