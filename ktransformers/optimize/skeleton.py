"""The model before its weights: the HF config (from an HF directory or the GGUF metadata),
transformers' own model class on the meta device, and the shipped rule file for it."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..weights.gguf import GGUFFileSet
from ..weights.source import WeightError
from ..weights.gguf_config import config_from_metadata

RULES_DIR = Path(__file__).parents[1] / "optimize_rules"
# model_type -> rule file stem; "-cpu" is appended when no GPU is used.
DEFAULT_RULES = {"deepseek_v3": "DeepSeek-V3-Chat", "deepseek_v2": "DeepSeek-V2-Chat", "glm4_moe": "Glm4Moe", "gpt_oss": "GptOss", "minimax_m2": "MiniMaxM2", "qwen3_moe": "Qwen3Moe",
                 "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral", "qwen3_next": "Qwen3Next",
                 "qwen3_5_moe_text": "Qwen35Moe"}


def load_config(model_path: str | os.PathLike | None, gguf_path: str | os.PathLike | None,
                files: GGUFFileSet | None = None) -> PretrainedConfig:
    """The HF config from --model_path, else from the GGUF metadata (`files`: the GGUF already open)."""
    if model_path is not None:
        if not Path(model_path, "config.json").is_file():
            raise FileNotFoundError(f"--model_path {str(model_path)!r} has no config.json")
        return AutoConfig.from_pretrained(model_path)
    if gguf_path is None:
        raise ValueError("need --model_path (an HF config directory) or --gguf_path (a GGUF carrying its config)")
    files = files or GGUFFileSet(gguf_path)
    embed = files.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gguf_path}: no token_embd.weight, cannot tell the vocabulary size")
    try:
        config = config_from_metadata(files.metadata, embed.shape[0], has_output="output.weight" in files.tensors,
                                      tensors=set(files.tensors))
    except WeightError as e:
        raise WeightError(f"{files.path}: {e}") from None
    if len(embed.shape) != 2 or embed.shape[1] != config.hidden_size:
        raise WeightError(f"{files.path}: token_embd.weight is {list(embed.shape)}, but the metadata's embedding_length "
                          f"is {config.hidden_size}")
    return config


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """transformers' own model class with parameters on the meta device (buffers stay real)."""
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def default_rule_file(config: PretrainedConfig, gpu: bool = False) -> Path:
    stem = DEFAULT_RULES.get(config.model_type)
    if stem is None:
        raise ValueError(f"no shipped rule file for model_type {config.model_type!r}; pass --optimize_config_path "
                         f"(shipped: {', '.join(sorted(p.name for p in RULES_DIR.glob('*.yaml')))})")
    path = RULES_DIR / (f"{stem}.yaml" if gpu else f"{stem}-cpu.yaml")
    if gpu and not path.is_file():  # no GPU rule file for this architecture yet: run it on the CPU
        path = RULES_DIR / f"{stem}-cpu.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"shipped rule file {path.name} is missing")
    return path
