"""Write the shipped multi-GPU DeepSeek-V3 rule files with the planner: DeepSeek-V3's shapes
(transformers' DeepseekV3Config defaults), 2 / 4 / 8 GPUs of 24 GiB, a 32k-token latent cache.

    python scripts/make_multi_gpu_rules.py
"""
import torch
import yaml
from transformers import DeepseekV3Config

from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.optimize.memory import GIB
from ktransformers.optimize.planner import plan_gpus, write_rules

config = DeepseekV3Config()
model = build_skeleton(config, torch.bfloat16)
template = yaml.safe_load((RULES_DIR / "DeepSeek-V3-Chat.yaml").read_text())
for n in (2, 4, 8):
    placement = plan_gpus(model, config, {f"cuda:{g}": 24 * GIB for g in range(n)}, cache_lens=32768)
    path = RULES_DIR / f"DeepSeek-V3-Chat-multi-gpu-{n}.yaml"
    path.write_text(write_rules(placement, template))
    print(f"{path.name}\n{placement.format()}\n")
