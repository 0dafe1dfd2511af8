"""Where does a LoRA training step (bench.sft's) spend its time outside the CPU experts? torch's
profiler over one step after two warm-up steps: the top ops by host time, and by GPU time.

    python dev/sft_profile.py FILE.gguf [threads] [seq]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ktransformers.train import add_lora, load_for_training

path = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
seq = int(sys.argv[3]) if len(sys.argv) > 3 else 256
loaded = load_for_training(path, device="cuda", cpu_infer=threads, tokenizer=False)
model = add_lora(loaded.model, rank=8, targets=["attention"])
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
ids = torch.randint(0, loaded.config.vocab_size, (1, seq)).cuda()


def step():
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


step(), step()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
avg = prof.key_averages()
print(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
print(avg.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
