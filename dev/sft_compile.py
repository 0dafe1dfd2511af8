"""Question: does compiling each decoder layer's dense modules (torch.compile, in place, on every
part of a layer but the routed experts) cut the host-bound time of a LoRA step outside the CPU
experts (dev/sft_profile.py: the dense part issues ~2,200 kernel launches for 12 layers)?

One process: eager steps, the loss and adapter gradients of one batch, then the same compiled;
prints the step medians, the gradients' largest relative difference, and dynamo's graph count
(one compile shared by all layers, or one a layer).

    python dev/sft_compile.py FILE.gguf [threads] [seq] [device]
"""
import re
import statistics
import sys
import time

import torch

from ktransformers.operators.experts import KTransformersExperts
from ktransformers.train import add_lora, load_for_training


def compile_dense(model) -> int:
    """nn.Module.compile (in place: parameter names stay peft's) on every part of each decoder layer
    but the routed experts (the MoE block's own glue stays eager). Returns the modules compiled."""
    def all_but_experts(module) -> int:
        count = 0
        for child in module.children():
            if isinstance(child, KTransformersExperts):
                continue
            if any(isinstance(m, KTransformersExperts) for m in child.modules()):
                count += all_but_experts(child)
            else:
                child.compile()
                count += 1
        return count
    return sum(all_but_experts(m) for n, m in model.named_modules() if re.search(r"(^|\.)layers\.\d+$", n))


path = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
seq = int(sys.argv[3]) if len(sys.argv) > 3 else 256
device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
loaded = load_for_training(path, device=device, cpu_infer=threads, tokenizer=False)
model = add_lora(loaded.model, rank=8, targets=["attention"])
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=0.0)  # (the step's work, the adapters unchanged: gradients compare)
ids = torch.randint(0, loaded.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def grads():
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss), [p.grad.detach().clone() for p in params]


def steps(n=5):
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
    return times


eager_loss, eager_grads = grads()
steps(1)
eager = steps()
print(f"eager: loss {eager_loss:.6f}, step median {statistics.median(eager) * 1e3:.1f} ms "
      f"({', '.join(f'{t * 1e3:.1f}' for t in eager)})", flush=True)

print(f"compiled {compile_dense(model)} modules")
opt.zero_grad(set_to_none=True)
t = time.perf_counter()
steps(1)
print(f"first compiled step (compiles): {time.perf_counter() - t:.1f} s", flush=True)
loss, compiled_grads = grads()
diff = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(compiled_grads, eager_grads))
print(f"compiled: loss {loss:.6f} (eager {eager_loss:.6f}); adapter gradients' largest relative difference {diff:.2e}")
compiled = steps()
print(f"compiled: step median {statistics.median(compiled) * 1e3:.1f} ms "
      f"({', '.join(f'{t * 1e3:.1f}' for t in compiled)}); speed-up {statistics.median(eager) / statistics.median(compiled):.3f}x")
from torch._dynamo.utils import counters  # noqa: E402
print(f"dynamo: {dict(counters['stats'])}, graph breaks {sum(counters['graph_break'].values())}")
