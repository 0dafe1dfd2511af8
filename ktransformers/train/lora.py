"""LoRA adapters through peft, on the modules a training rule file keeps as transformers' own."""
from __future__ import annotations

import torch
from torch import nn

# Attention projections of every family here (DeepSeek's low-rank q and kv included)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("fine-tuning needs peft: pip install 'ktransformers[train]' (or pip install peft)") from None
    return peft


def target_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """The names of the nn.Linear modules `targets` select: "attention" (the attention
    projections), "shared_experts", or module name suffixes such as q_proj. A ValueError says
    which target selects nothing, and what the model's linears are called."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    chosen: list[str] = []
    for target in targets:
        if target == "attention":
            hits = [n for n in linears if ".self_attn." in n and n.rsplit(".", 1)[-1] in ATTENTION_TARGETS]
        elif target == "shared_experts":
            hits = [n for n in linears if ".shared_expert." in n or ".shared_experts." in n]
        else:
            hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"LoRA target {target!r} matches no linear of this model (its linears: "
                             f"{', '.join(leaves)}; or 'attention', 'shared_experts')")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets: list[str] | None = None,
             dropout: float = 0.0, init: bool = True):
    """`model` wrapped by peft with LoRA adapters (float32) on the chosen linears, every base
    weight frozen. `init=False`: B random as well as A (peft's init_lora_weights=False), so that
    the first step's gradients reach A (tests)."""
    peft = _peft()
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    names = target_modules(model, targets or ["attention"])
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names,
                             init_lora_weights=init, bias="none")
    wrapped = peft.get_peft_model(model, config)
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return wrapped


def load_adapter(model: nn.Module, path: str, trainable: bool = False):
    """A saved adapter (peft's directory: adapter_config.json + adapter_model.safetensors) on `model`."""
    return _peft().PeftModel.from_pretrained(model, path, is_trainable=trainable)
