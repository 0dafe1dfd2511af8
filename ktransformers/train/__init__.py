"""Fine-tuning with the routed experts frozen on the CPU kernels (forward and backward) and
everything else as transformers' own modules, where peft's LoRA adapters attach: the model
(load_for_training), the data (data.py), the adapters (lora.py) and the loop (train)."""
from __future__ import annotations

import itertools
import math
import os
import resource
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..loader import RULES_DIR, LoadedModel, load_model
from .data import IGNORE, Example, load_examples
from .lora import adapters_disabled, add_lora, load_adapter, save_adapter, target_modules

SFT_RULES = RULES_DIR / "MoE-sft.yaml"
SFT_RULES_CPU = RULES_DIR / "MoE-sft-cpu.yaml"


def load_for_training(gguf_path: str | os.PathLike, model_path: str | os.PathLike | None = None,
                      optimize_config_path: str | os.PathLike | None = None, device: str = "cuda",
                      dtype: torch.dtype | None = None, cpu_infer: int | None = None,
                      progress: bool = True, tokenizer: bool = True) -> LoadedModel:
    """The model for a training step: the training rule file (default: MoE-sft.yaml, or
    MoE-sft-cpu.yaml for device cpu) places it, the routed experts on the CPU kernels; in
    training mode, every base weight frozen (adapters add the trainable ones). `tokenizer=False`:
    none is built (callers that feed token ids)."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    rules = optimize_config_path or (SFT_RULES_CPU if torch.device(device).type == "cpu" else SFT_RULES)
    loaded = load_model(gguf_path, model_path, rules, dtype=dtype, default_device=device, progress=progress,
                        cpu_infer=cpu_infer, tokenizer=tokenizer)
    loaded.model.train()
    loaded.model.requires_grad_(False)
    loaded.model.config.use_cache = False
    return loaded


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float
    tokens: int  # tokens the step's forward passes computed (pads excluded)
    seconds: float
    lr: float


def batches(examples: list[Example], batch_size: int, pad_id: int, device, seed: int = 0):
    """Endless shuffled batches: (input_ids, attention_mask, labels) padded on the right."""
    order = list(range(len(examples)))
    gen = torch.Generator().manual_seed(seed)
    for _ in itertools.count():
        order = [order[i] for i in torch.randperm(len(order), generator=gen).tolist()]
        for at in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1, batch_size):
            group = [examples[i] for i in order[at:at + batch_size]]
            width = max(len(e.input_ids) for e in group)
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            labels = torch.full((len(group), width), IGNORE, dtype=torch.long)
            for row, e in enumerate(group):
                n = len(e.input_ids)
                ids[row, :n], mask[row, :n], labels[row, :n] = (torch.tensor(e.input_ids), 1, torch.tensor(e.labels))
            yield ids.to(device), mask.to(device), labels.to(device)


def mean_loss(model, examples: list[Example], device) -> float:
    """The mean cross-entropy per learned token over `examples`, without gradients."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.input_ids], device=device)
            labels = torch.tensor([e.labels], device=device)
            n = int((labels[:, 1:] != IGNORE).sum())
            if n:
                total += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * n
                count += n
    if not count:
        raise ValueError("no learned token in the evaluation examples")
    return total / count


def train(model, examples: list[Example], *, steps: int, lr: float = 1e-4, batch_size: int = 1,
          grad_accum: int = 1, warmup_steps: int = 0, max_grad_norm: float = 1.0, pad_id: int = 0,
          device: str = "cuda", seed: int = 0, progress: bool = True, on_step=None) -> list[StepReport]:
    """AdamW on the model's trainable parameters (the adapters) for `steps` optimizer steps of
    grad_accum batches each; a linear warm-up, then a constant rate. `on_step(report)` after
    each step. Returns the reports."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: the model has no trainable parameters (add LoRA adapters)")
    if steps < 1 or grad_accum < 1 or batch_size < 1:
        raise ValueError(f"steps, grad_accum and batch_size must be at least 1, got {steps}, {grad_accum}, {batch_size}")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
    data = batches(examples, batch_size, pad_id, device, seed)
    reports = []
    bar = tqdm(total=steps, desc="training", unit="step", disable=not progress)
    for step in range(1, steps + 1):
        start, loss_sum, tokens = time.perf_counter(), 0.0, 0
        for _ in range(grad_accum):
            ids, mask, labels = next(data)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: the loss is {float(loss)}")
            (loss / grad_accum).backward()
            loss_sum += float(loss.detach())
            tokens += int(mask.sum())
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        rate = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        report = StepReport(step, loss_sum / grad_accum, tokens, time.perf_counter() - start, rate)
        reports.append(report)
        bar.update(1)
        bar.set_postfix(loss=f"{report.loss:.4f}", tok_s=f"{report.tokens / report.seconds:.0f}")
        if on_step is not None:
            on_step(report)
    bar.close()
    return reports


def peak_memory(device) -> str:
    """Peak GPU memory (where training runs on one) and the process's peak RSS, for the logs."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    text = f"peak RSS {rss:.2f} GiB"
    if torch.device(device).type == "cuda":
        text = f"peak GPU {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB, " + text
    return text


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


__all__ = ["Example", "StepReport", "adapters_disabled", "add_lora", "batches", "load_adapter", "load_examples",
           "load_for_training", "mean_loss", "peak_memory", "perplexity", "save_adapter", "target_modules", "train",
           "SFT_RULES", "SFT_RULES_CPU"]
