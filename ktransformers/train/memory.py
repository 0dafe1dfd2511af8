"""What a training step adds to the loaded model's memory, per device, checked against what is
free before the first step: a step that cannot fit is refused with the numbers, not run out of
memory halfway."""
from __future__ import annotations

from collections import Counter

import torch

from ..operators.experts import KTransformersExperts
from ..optimize.memory import MemoryBudgetError, MemoryPlan, available_memory, size

# Activations a transformer layer keeps for its backward, in values of the training dtype per
# hidden unit per token (attention's inputs, q/k/v, scores' softmax output with a fused kernel,
# the MLP's inputs and gates, the norms'): the usual 34 bytes of 16-bit values.
LAYER_VALUES = 17
ADAM_BYTES = 16  # a float32 trainable parameter: itself, its gradient, Adam's two moments


def plan_training(model, config, *, tokens: int, device: str, checkpointing: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """The bytes a step of `tokens` tokens (batch x longest sequence) adds: on the training device,
    the adapters with their gradients and optimizer state, the layers' activations (or, with
    gradient checkpointing, each layer's input and one layer's activations) and the logits with
    their gradient, and with adapters on the routed experts, the pairs' products they keep
    (gradient checkpointing: one layer's); on the CPU, each MoE layer's saved input and its
    experts' g and u (checkpointing: one layer's), the backward's int8 copies where they are still
    to be made, and the kernels' scratch. (CPU-only training puts it all in RAM.)"""
    plan = MemoryPlan()
    value = torch.finfo(dtype).bits // 8
    trainable = Counter()
    for p in model.parameters():
        if p.requires_grad:
            trainable["cpu" if p.device.type == "cpu" else device] += p.numel()
    for where, n in sorted(trainable.items()):
        plan.add(where, "adapters, gradients and optimizer state", n * ADAM_BYTES)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    if checkpointing:
        plan.add(device, "activations (checkpointed)", tokens * hidden * value * (layers + LAYER_VALUES))
    else:
        plan.add(device, "activations", tokens * hidden * value * LAYER_VALUES * layers)
    plan.add(device, "logits and their gradient", tokens * config.vocab_size * (value + 8))
    scratch, adapted, kept = 0, [], []
    for module in model.modules():
        if not isinstance(module, KTransformersExperts):
            continue
        kernel = getattr(module.ops["prefill"], "kernel", None)
        if kernel is None:
            continue
        E, H, I, K = kernel.experts, kernel.hidden, kernel.intermediate, kernel.top_k
        plan.add("cpu", "MoE layers' saved inputs", tokens * (H * 4 + K * 16))
        if module.adapters:  # (torch keeps each pair's input rows, g, u, h and output: adapters.py)
            adapted.append(tokens * K * (2 * H + 4 * I) * 4)
            kept_on = device if module.adapter_device().type == "cuda" else "cpu"
        else:  # (the forward's g and u [T*K, 2I] float32, which the backward takes)
            kept.append(tokens * K * 2 * I * 4)
        if kernel.int8_backward and kernel._grad is None:
            own = getattr(kernel, "_int8", None) is not None  # (the forward's gate, up and down copies)
            copies = 3 + (3 if kernel.adapters and not own else 0)  # (D^T, G^T, U^T; gate, up, down for adapters)
            plan.add("cpu", "the backward's int8 copies", E * H * I * copies)
        pairs = kernel.max_tokens * K
        # (float32 g, u, D^T dy [P, I] and dx parts [P, H]; int8 rows of dg, du [P, I] and the pairs' dout [P, H])
        scratch = max(scratch, pairs * (3 * I + 2 * H) * 4 + pairs * (2 * I + H))
    plan.add("cpu", "the experts' backward scratch", scratch)
    if adapted:
        plan.add(kept_on, "the expert adapters' saved pairs", max(adapted) if checkpointing else sum(adapted))
    if kept:
        plan.add("cpu", "the MoE layers' g and u", max(kept) if checkpointing else sum(kept))
    return plan


def check_training(plan: MemoryPlan, budget: dict[str, int] | None = None) -> None:
    """Raise MemoryBudgetError naming each device whose planned bytes exceed what is free there
    now (the model already loaded; default: available_memory())."""
    budget = dict(budget or available_memory())
    problems = []
    for device, kinds in plan.per_device_kind().items():
        need = sum(kinds.values())
        if device in budget and need > budget[device]:
            parts = ", ".join(f"{what} {size(n)}" for what, n in kinds.items())
            hint = ("lower --batch_size or --max_len, or add --gradient_checkpointing" if device != "cpu" else
                    "lower --batch_size or --max_len, or set int8_backward: false in the rule file")
            problems.append(f"{device} needs {size(need)} more ({parts}) but has {size(budget[device])} free: {hint}")
    if problems:
        raise MemoryBudgetError("the training step does not fit: " + "; ".join(problems))
