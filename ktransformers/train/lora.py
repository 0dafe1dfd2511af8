"""LoRA adapters through peft, on the modules a training rule file keeps as transformers' own, and
on the routed experts (operators/experts/adapters.py) in peft's format for them.

The experts' adapters are named as peft names its adapters of transformers' 3-D expert parameters
(LoraConfig.target_parameters: "experts.gate_up_proj", "experts.down_proj"), and saved in the same
files, so an adapter trained here loads in transformers + peft, and back."""
from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch
from torch import nn

# Attention projections of every family here (DeepSeek's low-rank q and kv included)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# the routed experts' projections (3-D parameters [E, out, in], or [E, in, out] where transposed)
EXPERT_TARGETS = {"experts": ("gate_up_proj", "down_proj"), "experts.gate_up_proj": ("gate_up_proj",),
                  "experts.down_proj": ("down_proj",)}
_PREFIX = "base_model.model."


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("fine-tuning needs peft: pip install 'ktransformers[train]' (or pip install peft)") from None
    return peft


def _expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the routed experts: ours (KTransformersExperts) or transformers' own."""
    from ..operators.experts import KTransformersExperts
    found = []
    for name, m in model.named_modules():
        ours = isinstance(m, KTransformersExperts)
        theirs = not ours and isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3
        if ours or theirs:
            found.append((name, m))
    return found


def target_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """The names of the nn.Linear modules `targets` select: "attention" (the attention
    projections), "shared_experts", or module name suffixes such as q_proj (the routed experts'
    targets, EXPERT_TARGETS, are left to expert_projections). A ValueError says which target
    selects nothing, and what the model's linears are called."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    chosen: list[str] = []
    for target in targets:
        if target in EXPERT_TARGETS:
            continue
        if target == "attention":
            hits = [n for n in linears if ".self_attn." in n and n.rsplit(".", 1)[-1] in ATTENTION_TARGETS]
        elif target == "shared_experts":
            hits = [n for n in linears if ".shared_expert." in n or ".shared_experts." in n]
        else:
            hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"LoRA target {target!r} matches no linear of this model (its linears: "
                             f"{', '.join(leaves)}; or 'attention', 'shared_experts', 'experts')")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def expert_projections(targets: list[str]) -> tuple[str, ...]:
    """The routed experts' projections `targets` select (gate_up_proj, down_proj), in that order."""
    chosen = {p for t in targets for p in EXPERT_TARGETS.get(t, ())}
    return tuple(p for p in ("gate_up_proj", "down_proj") if p in chosen)


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets: list[str] | None = None,
             dropout: float = 0.0, init: bool = True, use_rslora: bool = False):
    """`model` with LoRA adapters (float32) on the chosen linears (wrapped by peft) and, with an
    "experts" target, on the routed experts' gate_up and down projections; every base weight
    frozen. `init=False`: B random as well as A (peft's init_lora_weights=False), so that the first
    step's gradients reach A (tests). A model with only expert adapters is returned unwrapped
    (save it with save_adapter)."""
    peft = _peft()
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    targets = targets or ["attention"]
    names = target_modules(model, targets)
    projections = expert_projections(targets)
    if projections and dropout:
        raise ValueError("LoRA on the routed experts takes no dropout (peft's expert adapters do not either)")
    experts = _expert_modules(model) if projections else []
    if projections and not experts:
        raise ValueError("LoRA target 'experts' matches no routed experts module of this model")
    ours = [m for _, m in experts if hasattr(m, "add_adapters")]
    theirs = bool(experts) and not ours
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names or None,
                             init_lora_weights=init, bias="none", use_rslora=use_rslora,
                             target_parameters=[f"experts.{p}" for p in projections] if theirs else None)
    for m in ours:
        m.add_adapters(rank, alpha, projections, use_rslora=use_rslora, init=init)
    if not names and not theirs:  # (no peft model: save_adapter writes this config)
        config.target_parameters = [f"experts.{p}" for p in projections]
        model._expert_lora_config = config
        return model
    wrapped = peft.get_peft_model(model, config)
    if ours:
        _with_expert_adapters(wrapped, projections)
        for m in ours:  # (peft froze every parameter outside its own layers)
            for adapter in m.adapters.values():
                adapter.requires_grad_(True)
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return wrapped


def save_adapter(model: nn.Module, path: str | Path, **kwargs) -> None:
    """The adapters in peft's format (adapter_config.json + adapter_model.safetensors): peft's
    save_pretrained (its kwargs), with the routed experts' adapters added to its file."""
    from safetensors.torch import load_file, save_file
    path = Path(path)
    experts = {k: v.detach().cpu().contiguous() for name, m in _expert_modules(model) if getattr(m, "adapters", None)
               for k, v in _expert_state(name, m).items()}
    weights = path / "adapter_model.safetensors"
    if hasattr(model, "peft_config"):
        type(model).save_pretrained(model, str(path), **kwargs)
        if experts:
            save_file(load_file(str(weights)) | experts, str(weights), metadata={"format": "pt"})
        return
    config = getattr(model, "_expert_lora_config", None)
    if config is None:
        raise ValueError("the model has no LoRA adapters to save (add_lora adds them)")
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file(experts, str(weights), metadata={"format": "pt"})


def _expert_state(name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """{saved key: tensor} of an experts module's adapters (views of them, on their device), named as
    peft names them in its files."""
    name = name.removeprefix(_PREFIX)  # (the module's name in the peft model or in the bare one)
    return {_PREFIX + f"{name}.{k}".replace(".default.", "."): v
            for k, v in module.state_dict().items() if "lora_" in k}


def load_adapter(model: nn.Module, path: str, trainable: bool = False):
    """A saved adapter (peft's directory: adapter_config.json + adapter_model.safetensors) on
    `model`: the linears' through peft, the routed experts' (target_parameters) on our experts."""
    peft = _peft()
    config = peft.PeftConfig.from_pretrained(path)
    projections = tuple(p for p in ("gate_up_proj", "down_proj")
                        if any(t.endswith(p) for t in (getattr(config, "target_parameters", None) or [])))
    ours = [m for _, m in _expert_modules(model) if hasattr(m, "add_adapters")] if projections else []
    if not ours:
        return peft.PeftModel.from_pretrained(model, path, is_trainable=trainable)
    for m in ours:
        m.add_adapters(config.r, config.lora_alpha, projections, use_rslora=config.use_rslora, init=False)
    from safetensors.torch import load_file
    stored = load_file(str(Path(path) / "adapter_model.safetensors"))
    for name, m in _expert_modules(model):
        for key, tensor in _expert_state(name, m).items():
            if key not in stored or stored[key].shape != tensor.shape:
                raise ValueError(f"{path}: the adapter has no {key} of shape {list(tensor.shape)} (an adapter of "
                                 "another model?)")
            with torch.no_grad():
                tensor.copy_(stored[key])
    for m in ours:
        for adapter in m.adapters.values():
            adapter.requires_grad_(trainable)
    if not config.target_modules:
        model._expert_lora_config = config
        return model
    config.target_parameters = None  # (peft would look for transformers' parameters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = peft.PeftModel.from_pretrained(model, path, config=config, is_trainable=trainable)
    for w in caught:  # (peft counts the experts' adapters, loaded above, as missing from its own)
        keys = re.findall(r"'([^']+)'", str(w.message))
        if not (str(w.message).startswith("Found missing adapter keys") and keys and
                all(".experts." in k for k in keys)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _with_expert_adapters(wrapped, projections)
    return wrapped


def _with_expert_adapters(wrapped, projections: tuple[str, ...]) -> None:
    """A peft model over our experts' adapters: its config names them as transformers + peft
    would (target_parameters), and its save_pretrained saves them too (save_adapter)."""
    wrapped.peft_config["default"].target_parameters = [f"experts.{p}" for p in projections]
    wrapped.save_pretrained = lambda path, **kwargs: save_adapter(wrapped, path, **kwargs)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The model without its adapters for the block (DPO's reference): peft's disable_adapter, and
    the routed experts' adapters off."""
    experts = [m for _, m in _expert_modules(model) if getattr(m, "adapters", None)]
    for m in experts:
        m.adapters_enabled = False
    try:
        with model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext():
            yield
    finally:
        for m in experts:
            m.adapters_enabled = True
