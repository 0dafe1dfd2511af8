"""DPO (direct preference optimization) on preference pairs, with the same model, adapters and
CPU experts as SFT: the policy is the model with its LoRA adapters, the reference the same model
with them switched off (lora.adapters_disabled), so no second copy of the weights is held.

    loss = -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

with log pi(y) the sum of the response tokens' log-probabilities (the assistant's tokens, as the
SFT labels mark them). Records (JSONL): {"prompt": "..." or [messages], "chosen": "...",
"rejected": "..."}; chosen/rejected may also be assistant messages ({"role", "content"}).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .data import IGNORE, Example, jsonl_records, render
from .lora import adapters_disabled


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example


@dataclass(frozen=True)
class DPOReport:
    step: int
    loss: float
    accuracy: float  # share of the step's pairs whose chosen answer the policy prefers more than the reference
    margin: float    # mean of beta * (the chosen's log-ratio - the rejected's)
    seconds: float


def _answer(value, where: str, key: str) -> str:
    if isinstance(value, dict) and value.get("role") == "assistant" and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list) and len(value) == 1:
        return _answer(value[0], where, key)
    if isinstance(value, str):
        return value
    raise ValueError(f"{where}: '{key}' must be a string or an assistant message")


def load_pairs(path: str | os.PathLike, tokenizer, max_len: int) -> list[Pair]:
    """The preference pairs of a JSONL file, each answer rendered after its prompt through the chat
    template; a ValueError names the file and line of a record it cannot use."""
    pairs = []
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= record.keys():
            raise ValueError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'")
        prompt = record["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'prompt' must be a string or a list of messages")
        chosen, rejected = (render(tokenizer, messages + [{"role": "assistant", "content": _answer(record[k], where, k)}],
                                   where, max_len) for k in ("chosen", "rejected"))
        if not chosen.learned or not rejected.learned:
            raise ValueError(f"{where}: no answer token within the first {max_len} tokens (raise --max_len)")
        pairs.append(Pair(chosen, rejected))
    if not pairs:
        raise ValueError(f"{path}: no records")
    return pairs


def sequence_logps(model, examples: list[Example], device) -> torch.Tensor:
    """[len(examples)]: each example's summed log-probability of its learned tokens (one padded
    batch; differentiable where the model is)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n], mask[row, :n], labels[row, :n] = torch.tensor(e.input_ids), 1, torch.tensor(e.labels)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != IGNORE
    picked = torch.gather(F.log_softmax(logits, dim=-1), 2, target.clamp(min=0)[..., None])[..., 0]
    return (picked * keep).sum(dim=1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float):
    """(mean loss, accuracy, mean margin) of a batch of pairs' summed log-probabilities."""
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    stats = margin.detach()
    return -F.logsigmoid(margin).mean(), float((stats > 0).float().mean()), float(stats.mean())


def reference_logps(model, pairs: list[Pair], device) -> list[tuple[float, float]]:
    """(chosen, rejected) log-probabilities under the reference: the model with its adapters off."""
    out = []
    with torch.no_grad(), adapters_disabled(model):
        for p in pairs:
            chosen, rejected = sequence_logps(model, [p.chosen, p.rejected], device).tolist()
            out.append((chosen, rejected))
    return out


def train_dpo(model, pairs: list[Pair], *, steps: int, lr: float = 5e-6, beta: float = 0.1, batch_size: int = 1,
              max_grad_norm: float = 1.0, device: str = "cuda", seed: int = 0, progress: bool = True,
              on_step=None) -> list[DPOReport]:
    """AdamW on the adapters for `steps` steps of `batch_size` pairs each (shuffled, cycled)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: the model has no trainable parameters (add LoRA adapters)")
    if steps < 1 or batch_size < 1 or beta <= 0:
        raise ValueError(f"steps and batch_size must be at least 1 and beta positive, got {steps}, {batch_size}, {beta}")
    reference = reference_logps(model, pairs, device)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    reports, at = [], 0
    for step in tqdm(range(1, steps + 1), desc="DPO", unit="step", disable=not progress):
        start = time.perf_counter()
        chosen = [order[(at + i) % len(order)] for i in range(batch_size)]
        at += batch_size
        logps = sequence_logps(model, [e for i in chosen for e in (pairs[i].chosen, pairs[i].rejected)], device)
        ref = torch.tensor([r for i in chosen for r in reference[i]], device=logps.device)
        loss, accuracy, margin = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: the DPO loss is {float(loss)}")
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report = DPOReport(step, float(loss.detach()), accuracy, margin, time.perf_counter() - start)
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports


def evaluate_dpo(model, pairs: list[Pair], beta: float, device) -> tuple[float, float]:
    """(mean DPO loss, accuracy) over `pairs`, without gradients."""
    reference = reference_logps(model, pairs, device)
    with torch.no_grad():
        policy = [sequence_logps(model, [p.chosen, p.rejected], device).tolist() for p in pairs]
    pc, pr = (torch.tensor([p[i] for p in policy]) for i in (0, 1))
    rc, rr = (torch.tensor([r[i] for r in reference]) for i in (0, 1))
    loss, accuracy, _ = dpo_loss(pc, pr, rc, rr, beta)
    return float(loss), accuracy
