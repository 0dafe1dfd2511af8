"""Question: does a LoRA step's time outside the CPU experts (about 9-10 ms a layer on the GPU host,
nearly independent of the sequence length) come from torch's intra-op threads (16 by default)
contending with the CPU kernels' pool workers, which spin for a while after each job? bench.sft
with torch's intra-op threads set first; compare two counts in one session.

    python dev/sft_threads.py TORCH_THREADS --gguf_path /tmp/q3-12.gguf --seq 256 --threads 14
"""
import runpy
import sys

import torch

torch.set_num_threads(int(sys.argv.pop(1)))
print(f"# torch intra-op threads: {torch.get_num_threads()}", flush=True)
sys.argv[0] = "bench.sft"
runpy.run_module("ktransformers.bench.sft", run_name="__main__")
