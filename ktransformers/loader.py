"""From paths to a ready model: config (+ tokenizer), a meta skeleton of transformers' own class,
the rule file, and optimize_and_load_gguf."""
from __future__ import annotations

import atexit
import gc
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from .optimize.inject import PlanRow, is_gguf, optimize_and_load_gguf
from .optimize.inject import plan as plan_rows
from .optimize.rules import load_rules
from .optimize.skeleton import DEFAULT_RULES, RULES_DIR, build_skeleton, default_rule_file, load_config  # noqa: F401
from .weights.gguf import GGUFFileSet, GGUFSource
from .weights.gguf_config import arch_of
from .weights.gguf_tokenizer import byte_level_bpe, ids_past_the_vocabulary, set_pre_tokenizer


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: PretrainedConfig
    tokenizer: object | None
    plan: list[PlanRow]


def resolve_model_path(model_path: str | os.PathLike | None) -> Path | None:
    """--model_path as given where it exists; else a Hugging Face repo id ("org/name") found in the
    local Hugging Face cache (never downloaded: this project loads what is on disk)."""
    if model_path is None:
        return None
    if Path(model_path).exists():
        return Path(model_path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_path)):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
        try:
            return Path(snapshot_download(str(model_path), local_files_only=True))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(f"--model_path {str(model_path)!r} is neither a directory nor a model in the local "
                                    f"Hugging Face cache ({constants.HF_HUB_CACHE}): download it there first "
                                    f"(hf download {model_path}), or pass its directory") from None
    raise FileNotFoundError(f"--model_path {str(model_path)!r} does not exist")


def load_tokenizer(model_path: str | os.PathLike | None, gguf_path: str | os.PathLike | None,
                   files: GGUFFileSet | None = None):
    """The tokenizer from --model_path, else from tokenizer files beside the GGUF, else rebuilt
    from the GGUF metadata: by transformers, or, for a byte-level BPE vocabulary whose architecture
    the installed transformers cannot rebuild, from its tokens and merges directly. `files`: the
    GGUF already open. A ValueError says why none could be built."""
    if model_path is not None:
        return AutoTokenizer.from_pretrained(model_path)
    path = Path(gguf_path)
    if not is_gguf(path):  # a safetensors checkpoint holds its tokenizer files
        return AutoTokenizer.from_pretrained(path)
    file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
    if (file.parent / "tokenizer.json").is_file():  # tokenizer files shipped beside the GGUF win
        return PreTrainedTokenizerFast.from_pretrained(file.parent)
    metadata = (files or GGUFFileSet(file)).metadata
    try:  # the fast-tokenizer class directly: AutoTokenizer would first want an HF config for the architecture
        tokenizer = PreTrainedTokenizerFast.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as e:  # transformers rebuilds the GGUF tokenizers of the architectures it knows
        try:
            return byte_level_bpe(metadata, str(file))
        except ValueError as ours:
            raise ValueError(f"cannot build the tokenizer of {file}: transformers says {type(e).__name__}: {e}; "
                             f"{ours}. Pass --model_path with the model's tokenizer files") from e
    extra = ids_past_the_vocabulary(tokenizer, metadata)
    if extra and metadata.get("tokenizer.ggml.model") == "gpt2":
        return byte_level_bpe(metadata, str(file))  # (the GGUF's own tokens, BOS and EOS)
    if extra:
        warnings.warn(f"the tokenizer transformers built from {file} has {extra} id(s) past the GGUF's "
                      f"{len(metadata['tokenizer.ggml.tokens'])} tokens (the model has no embedding for them): "
                      "pass --model_path with the model's tokenizer files", stacklevel=2)
    return set_pre_tokenizer(tokenizer, metadata.get("tokenizer.ggml.pre"))


def load_model(gguf_path: str | os.PathLike, model_path: str | os.PathLike | None = None,
               optimize_config_path: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
               default_device: str = "cpu", progress: bool = True, cpu_infer: int | None = None,
               tokenizer: bool = True, cache_lens: int | None = None,
               memory_budget: dict[str, int] | None = None, lora_path: str | os.PathLike | None = None) -> LoadedModel:
    """Config (+ tokenizer) from model_path or the GGUF, the rules (default: the shipped file for
    the architecture), weights from gguf_path; `cpu_infer` threads for the CPU kernels;
    `tokenizer=False` skips building the tokenizer (benchmarks feed token ids); otherwise it is built
    before the weights load, and a ValueError says why where it cannot be. Before loading,
    the bytes each device will hold (with a KV cache of `cache_lens` tokens when given) are checked
    against `memory_budget` ({'cuda:0': bytes, 'cpu': bytes}; default: what is free now).
    `lora_path`: a peft LoRA adapter merged into the weights it adapts as they load."""
    if not Path(gguf_path).exists():
        raise FileNotFoundError(f"--gguf_path {str(gguf_path)!r} does not exist")
    model_path = resolve_model_path(model_path)
    weights = GGUFSource(gguf_path) if is_gguf(gguf_path) else None  # the GGUF's header, read once
    files = weights.files if weights else None
    config = load_config(model_path, gguf_path, files)
    if weights is not None:
        check_architecture(config, files)
    loaded_tokenizer = load_tokenizer(model_path, gguf_path, files) if tokenizer else None  # before the weights
    if dtype is None:  # float32 on the CPU: torch's bf16 GEMV/norms there are slow; bf16 on GPUs
        dtype = torch.bfloat16 if torch.device(default_device).type == "cuda" else torch.float32
    model = build_skeleton(config, dtype)
    rule_file = optimize_config_path or default_rule_file(config, gpu=default_device.startswith("cuda"))
    rules = load_rules(rule_file)
    rows = plan_rows(model, rules, default_device, f"rule file {rule_file}")
    check_experts_placed(rows, rule_file)
    if weights is not None and model_path is not None and uses_fp8_linears(rows):
        # FP8 rule files: the dense part from the HF checkpoint (FP8 as stored), the experts from the GGUF
        from .weights.combined import CombinedSource
        from .weights.safetensors import SafetensorsSource
        if not any(Path(model_path).glob("*.safetensors")):
            raise ValueError(f"rule file {rule_file} keeps linears in FP8: --model_path {model_path} must hold the "
                             f"model's (FP8) safetensors; the routed experts come from --gguf_path")
        weights = CombinedSource(SafetensorsSource(model_path, config.model_type), weights)
    if lora_path is not None:
        from .optimize.inject import open_weights
        from .operators.experts.module import gate_up_interleaved
        from .weights.lora import LoraSource
        interleaved = frozenset(n for n, m in model.named_modules()
                                if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) and gate_up_interleaved(m))
        weights = LoraSource(weights or open_weights(gguf_path, config.model_type), lora_path, interleaved)
    tiles = True
    if weights is not None:
        from .optimize.memory import available_memory, check_budget, plan_memory, tiles_fit
        memory = plan_memory(model, rows, weights, config, dtype, cache_lens=cache_lens)
        budget = memory_budget or available_memory()  # read once: both checks judge the same figures
        check_budget(memory, budget)
        tiles = tiles_fit(memory, budget)
        if not tiles:
            warnings.warn("the CPU kernels' weights stay in the mapped file: RAM is short for their repacked 16-row "
                          "tiles (decode and prefill on the CPU run slower)", stacklevel=2)
    plan = optimize_and_load_gguf(model, rules, weights or gguf_path, config, default_device=default_device,
                                  progress=progress, cpu_infer=cpu_infer, cpu_tiles=tiles)
    return LoadedModel(model, config, loaded_tokenizer, plan)


def freeze_heap() -> None:
    """For a process that serves one model until it exits (local_chat, the server, the benchmarks),
    once the model is loaded: collect, then move every object alive now out of the cyclic
    collector's reach. What loading leaves (modules, the GGUF's parsed fields: ~400k objects with a
    32k vocabulary) lives as long as the model, and full collector passes over it would only
    slow a prefill down, the more so on few cores. At exit they are handed back, so that interpreter shutdown frees them
    as usual (extension modules check for leaks then)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def check_architecture(config: PretrainedConfig, files: GGUFFileSet) -> None:
    """A GGUF must hold the architecture the config describes."""
    arch = files.metadata.get("general.architecture")
    if arch != arch_of(config):
        raise ValueError(f"--gguf_path {files.path!r} holds a {arch!r} model but the config is "
                         f"{config.model_type!r} (GGUF architecture {arch_of(config)!r}); pass the matching "
                         f"--model_path, or none to take the config from the GGUF")


def uses_fp8_linears(rows: list[PlanRow]) -> bool:
    return any(r.kwargs.get(f"{phase}_op") == "KLinearFP8" for r in rows for phase in ("prefill", "generate"))


def check_experts_placed(rows: list[PlanRow], rule_file) -> None:
    """Routed experts left as transformers' module would run in slow eager torch: refuse, before loading."""
    left = [r.name for r in rows if r.name.endswith("mlp.experts") and r.cls is None]
    if left:
        raise ValueError(f"rule file {rule_file} leaves {len(left)} expert module(s) unplaced (e.g. {left[0]}); add a "
                         f"rule replacing \"^model\\.layers\\..*\\.mlp\\.experts$\" with KTransformersExperts, as "
                         f"the shipped files in {RULES_DIR} do")
