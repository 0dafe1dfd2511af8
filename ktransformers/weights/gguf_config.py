"""HF config <-> GGUF metadata, one declarative table per architecture.

Keys are what llama.cpp's converter writes under `{arch}.`; the same tables build an HF config
from a GGUF file (when no --model_path is given) and write the metadata of GGUF files we make
(tests, synthetic benchmark models).
"""
from __future__ import annotations

import math
import re
from typing import Any

from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MiniMaxM2Config,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from .source import WeightError

# (GGUF key under "{arch}.", HF config attribute). Values are copied as they are.
_COMMON = (
    ("block_count", "num_hidden_layers"),
    ("context_length", "max_position_embeddings"),
    ("embedding_length", "hidden_size"),
    ("feed_forward_length", "intermediate_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    ("expert_used_count", "num_experts_per_tok"),
)
_QWEN_MOE = _COMMON + (("expert_count", "num_experts"), ("expert_feed_forward_length", "moe_intermediate_size"))
# Qwen3-Next's and Qwen3.5-MoE's: the gated DeltaNet's heads beside Qwen2-MoE's keys
_HYBRID = _QWEN_MOE + (
    ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ("attention.key_length", "head_dim"),
    ("attention.value_length", "head_dim"),
    ("ssm.conv_kernel", "linear_conv_kernel_dim"),
    ("ssm.state_size", "linear_key_head_dim"),
    ("ssm.group_count", "linear_num_key_heads"),
    ("ssm.time_step_rank", "linear_num_value_heads"),
    ("full_attention_interval", "full_attention_interval"),
)
KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "deepseek2": tuple(k for k in _COMMON if k[0] != "attention.head_count_kv") + (
        ("leading_dense_block_count", "first_k_dense_replace"),
        ("vocab_size", "vocab_size"),
        ("attention.q_lora_rank", "q_lora_rank"),
        ("attention.kv_lora_rank", "kv_lora_rank"),
        ("attention.value_length_mla", "v_head_dim"),
        ("rope.dimension_count", "qk_rope_head_dim"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_count", "n_routed_experts"),
        ("expert_shared_count", "n_shared_experts"),
        ("expert_weights_scale", "routed_scaling_factor"),
        ("expert_weights_norm", "norm_topk_prob"),
        ("expert_group_count", "n_group"),
        ("expert_group_used_count", "topk_group"),
    ),
    "glm4moe": _COMMON + (
        ("expert_count", "n_routed_experts"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_shared_count", "n_shared_experts"),
        ("leading_dense_block_count", "first_k_dense_replace"),
        ("expert_weights_scale", "routed_scaling_factor"),
        ("expert_weights_norm", "norm_topk_prob"),
        ("expert_group_count", "n_group"),
        ("expert_group_used_count", "topk_group"),
        ("attention.key_length", "head_dim"),
        ("attention.value_length", "head_dim"),
        ("nextn_predict_layers", "num_nextn_predict_layers"),
    ),
    "qwen3moe": _QWEN_MOE + (("attention.key_length", "head_dim"), ("attention.value_length", "head_dim")),
    "qwen2moe": _QWEN_MOE + (("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),),
    "gpt-oss": _COMMON + (
        ("expert_count", "num_local_experts"),
        ("expert_feed_forward_length", "intermediate_size"),
        ("attention.key_length", "head_dim"),
        ("attention.value_length", "head_dim"),
        ("attention.sliding_window", "sliding_window"),
    ),
    "minimax-m2": _COMMON + (
        ("expert_count", "num_local_experts"),
        ("expert_feed_forward_length", "intermediate_size"),
        ("attention.key_length", "head_dim"),
        ("attention.value_length", "head_dim"),
    ),
    "llama": _COMMON + (("expert_count", "num_local_experts"), ("vocab_size", "vocab_size")),
    "qwen35moe": _HYBRID,
    "qwen3next": _HYBRID,
}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
# HF model_type -> the GGUF architecture llama.cpp's converter writes for it
GGUF_ARCH = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe", "mixtral": "llama", "gpt_oss": "gpt-oss",
             "minimax_m2": "minimax-m2", "qwen3_next": "qwen3next",
             "qwen3_5_moe_text": "qwen35moe"}


def arch_of(config: PretrainedConfig) -> str:
    arch = GGUF_ARCH.get(config.model_type)
    if arch is None:
        raise ValueError(f"model_type {config.model_type!r} has no GGUF architecture here; "
                         f"supported: {', '.join(GGUF_ARCH)}")
    return arch


def _rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def metadata_from_config(config: PretrainedConfig) -> dict[str, Any]:
    """The `{arch}.*` metadata llama.cpp's converter would write for `config`."""
    arch = arch_of(config)
    meta: dict[str, Any] = {"general.architecture": arch, f"{arch}.rope.freq_base": _rope_theta(config)}
    for key, attr in KEYS[arch]:
        value = getattr(config, attr, None)
        if value is not None and not (key == "expert_weights_norm" and not value):
            meta[f"{arch}.{key}"] = value
    if arch in _EXTRA_METADATA:
        meta.update(_EXTRA_METADATA[arch](config))
    return meta


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary_dims(config: PretrainedConfig, default_factor: float) -> int:
    """`rope.dimension_count`: the rotated part of a head (partial rotary)."""
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", default_factor)
    return int(_head_dim(config) * partial)


def _set_partial_rotary(arch: str, meta: dict[str, Any], kw: dict[str, Any], default_dims) -> None:
    """The config's head_dim and partial_rotary_factor from `{arch}.rope.dimension_count`."""
    head_dim = kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw["rope_parameters"]["partial_rotary_factor"] = meta.get(f"{arch}.rope.dimension_count", default_dims(head_dim)) / head_dim


def _glm4moe_metadata(config: PretrainedConfig) -> dict[str, Any]:
    """The converter counts the next-n (MTP) layers in block_count and rotates a part of each head."""
    nextn = getattr(config, "num_nextn_predict_layers", 0) or 0
    return {"glm4moe.block_count": config.num_hidden_layers + nextn,
            "glm4moe.nextn_predict_layers": nextn,
            "glm4moe.attention.key_length": _head_dim(config),
            "glm4moe.attention.value_length": _head_dim(config),
            "glm4moe.rope.dimension_count": _rotary_dims(config, 0.5),
            "glm4moe.expert_gating_func": GATING_SIGMOID}


def _deepseek_metadata(config: PretrainedConfig) -> dict[str, Any]:
    meta = {
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": config.kv_lora_rank + config.qk_rope_head_dim,
        "deepseek2.attention.value_length": config.kv_lora_rank,
        "deepseek2.attention.key_length_mla": config.qk_nope_head_dim + config.qk_rope_head_dim,
        "deepseek2.expert_gating_func": GATING_SIGMOID if config.model_type == "deepseek_v3" else GATING_SOFTMAX,
    }
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":
        meta.update({
            "deepseek2.rope.scaling.type": "yarn",
            "deepseek2.rope.scaling.factor": float(rope["factor"]),
            "deepseek2.rope.scaling.original_context_length": int(rope["original_max_position_embeddings"]),
            "deepseek2.rope.scaling.yarn_log_multiplier": 0.1 * float(rope.get("mscale_all_dim", 0.0)),
        })
    return meta


def _yarn_metadata(arch: str, config: PretrainedConfig) -> dict[str, Any]:
    """YaRN's keys as the converter writes them (none for other rotary types)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "yarn":
        return {}
    meta = {f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": float(rope["factor"]),
            f"{arch}.rope.scaling.original_context_length": int(rope["original_max_position_embeddings"])}
    for key, attr in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if rope.get(attr) is not None:
            meta[f"{arch}.rope.scaling.{key}"] = float(rope[attr])
    return meta


# The range each integer key may take ((least, most), under "{arch}."): what a model can have, so a
# corrupt or hostile value is an error naming the key before anything is sized by it.
_INT_RANGES = {
    "block_count": (1, 4096), "context_length": (1, 1 << 31), "embedding_length": (1, 1 << 20),
    "feed_forward_length": (0, 1 << 22), "attention.head_count": (1, 4096), "attention.head_count_kv": (1, 4096),
    "expert_used_count": (1, 1 << 16), "expert_count": (1, 1 << 16), "expert_feed_forward_length": (1, 1 << 22),
    "expert_shared_feed_forward_length": (0, 1 << 22), "leading_dense_block_count": (0, 4096),
    "vocab_size": (1, 1 << 24), "attention.q_lora_rank": (0, 1 << 16), "attention.kv_lora_rank": (1, 1 << 16),
    "attention.value_length_mla": (1, 1 << 16), "attention.key_length_mla": (1, 1 << 16),
    "attention.key_length": (1, 1 << 16), "attention.value_length": (1, 1 << 16), "rope.dimension_count": (1, 1 << 16),
    "expert_shared_count": (0, 1 << 10), "expert_group_count": (1, 1 << 16), "expert_group_used_count": (1, 1 << 16),
    "nextn_predict_layers": (0, 64), "attention.sliding_window": (1, 1 << 31), "expert_gating_func": (0, 3),
    "rope.scaling.original_context_length": (1, 1 << 31), "ssm.conv_kernel": (2, 64), "ssm.state_size": (1, 1 << 12),
    "ssm.group_count": (1, 1024), "ssm.time_step_rank": (1, 1024), "ssm.inner_size": (1, 1 << 20),
    "full_attention_interval": (1, 4096), "rope.dimension_sections": (0, 1 << 16),
}
# float keys that must be finite and positive (yarn_log_multiplier: finite and >= 0)
_POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "expert_weights_scale",
                    "rope.scaling.factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")


def check_metadata(meta: dict[str, Any], tensors: frozenset[str] | set[str] = frozenset()) -> None:
    """Raise WeightError naming the key for a metadata value of the wrong type, out of range, or
    at odds with the others or with the tensors present (block_count against the blk.N tensors),
    before any of them sizes anything."""
    arch = meta.get("general.architecture")
    for suffix, (least, most) in _INT_RANGES.items():
        key = f"{arch}.{suffix}"
        if key in meta:
            values = meta[key] if isinstance(meta[key], list) else [meta[key]]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= most:
                    raise WeightError(f"GGUF metadata {key} = {meta[key]!r}: expected an integer in [{least}, {most}]")
    for suffix in (*_POSITIVE_FLOATS, "rope.scaling.yarn_log_multiplier"):
        key = f"{arch}.{suffix}"
        if key in meta:
            v = meta[key]
            least_ok = v >= 0 if suffix.endswith("log_multiplier") else v > 0
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not least_ok:
                raise WeightError(f"GGUF metadata {key} = {v!r}: expected a finite "
                                  f"{'non-negative' if suffix.endswith('log_multiplier') else 'positive'} number")
    key = f"{arch}.expert_weights_norm"
    if key in meta and not isinstance(meta[key], bool):
        raise WeightError(f"GGUF metadata {key} = {meta[key]!r}: expected a boolean")
    get = lambda suffix: meta.get(f"{arch}.{suffix}")  # noqa: E731
    first = lambda v: v[0] if isinstance(v, list) and v else v  # noqa: E731
    experts, used = get("expert_count"), get("expert_used_count")
    if experts is not None and used is not None and used > experts:
        raise WeightError(f"GGUF metadata {arch}.expert_used_count = {used} exceeds {arch}.expert_count = {experts}")
    groups, groups_used = get("expert_group_count"), get("expert_group_used_count")
    if groups is not None and experts is not None and experts % groups:
        raise WeightError(f"GGUF metadata {arch}.expert_group_count = {groups} does not divide "
                          f"{arch}.expert_count = {experts}")
    if groups is not None and groups_used is not None and groups_used > groups:
        raise WeightError(f"GGUF metadata {arch}.expert_group_used_count = {groups_used} exceeds "
                          f"{arch}.expert_group_count = {groups}")
    heads, kv_heads = first(get("attention.head_count")), first(get("attention.head_count_kv"))
    if heads is not None and kv_heads and heads % kv_heads:
        raise WeightError(f"GGUF metadata {arch}.attention.head_count = {heads} is not a multiple of "
                          f"{arch}.attention.head_count_kv = {kv_heads}")
    blocks = get("block_count")
    layers = {int(m.group(1)) for m in map(re.compile(r"^blk\.(\d+)\.").match, tensors) if m}
    if blocks is not None and layers and max(layers) + 1 != blocks:
        raise WeightError(f"GGUF metadata {arch}.block_count = {blocks}, but the file's tensors are of "
                          f"{max(layers) + 1} blocks (blk.0 .. blk.{max(layers)})")
    for suffix in ("leading_dense_block_count", "nextn_predict_layers"):
        if blocks is not None and (get(suffix) or 0) >= blocks:
            raise WeightError(f"GGUF metadata {arch}.{suffix} = {get(suffix)} is not below {arch}.block_count = {blocks}")


def config_from_metadata(meta: dict[str, Any], vocab_size: int, has_output: bool = True,
                         tensors: frozenset[str] | set[str] = frozenset()) -> PretrainedConfig:
    """An HF config from GGUF metadata (`vocab_size` from the embedding tensor's rows; `tensors`:
    the file's tensor names, for what llama.cpp too tells from the tensors present, such as biases).
    The values are checked first (check_metadata)."""
    arch = meta.get("general.architecture")
    if arch not in KEYS:
        raise WeightError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(KEYS)}")
    check_metadata(meta, tensors)
    kwargs: dict[str, Any] = {}
    for key, attr in KEYS[arch]:
        if f"{arch}.{key}" in meta:
            value = meta[f"{arch}.{key}"]
            kwargs[attr] = value[0] if isinstance(value, list) and value else value
    kwargs.update(vocab_size=vocab_size, tie_word_embeddings=not has_output,
                  rope_parameters={"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))})
    for which in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{which}_token_id")
        if token is not None:
            kwargs["pad_token_id" if which == "padding" else f"{which}_token_id"] = int(token)
    return _BUILDERS[arch](meta, kwargs, tensors)


def _deepseek_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    rope_dim = kw["qk_rope_head_dim"]
    if "deepseek2.attention.key_length_mla" in meta:
        kw["qk_nope_head_dim"] = meta["deepseek2.attention.key_length_mla"] - rope_dim
    else:  # files from before MLA-aware conversion: key/value_length are the per-head sizes
        kw["qk_nope_head_dim"] = meta["deepseek2.attention.key_length"] - rope_dim
        kw["v_head_dim"] = meta["deepseek2.attention.value_length"]
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    kw.setdefault("norm_topk_prob", False)
    kw.setdefault("q_lora_rank", None)
    if meta.get("deepseek2.rope.scaling.type") == "yarn":
        mscale = meta.get("deepseek2.rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        kw["rope_parameters"].update(
            rope_type="yarn", factor=meta["deepseek2.rope.scaling.factor"], mscale=mscale, mscale_all_dim=mscale,
            original_max_position_embeddings=meta["deepseek2.rope.scaling.original_context_length"])
    # no gating key: a DeepSeek-V2/V2.5 file from before the converter wrote one (softmax, as llama.cpp reads it)
    if meta.get("deepseek2.expert_gating_func", GATING_SOFTMAX) == GATING_SIGMOID:
        return DeepseekV3Config(**kw)
    grouped = (kw.get("n_group") or 1) > 1
    return DeepseekV2Config(topk_method="group_limited_greedy" if grouped else "greedy", **kw)


def _qwen3_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    return Qwen3MoeConfig(norm_topk_prob=True, **kw)  # llama.cpp always normalizes qwen3moe's top-k


def _qwen2_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    return Qwen2MoeConfig(norm_topk_prob=False, qkv_bias=True, **kw)


def _llama_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    if "num_local_experts" not in kw:
        raise WeightError("GGUF architecture 'llama' without llama.expert_count is a dense model; only MoE (Mixtral) is supported")
    head_dim = meta.get("llama.rope.dimension_count")
    if head_dim and head_dim != kw["hidden_size"] // kw["num_attention_heads"]:
        kw["head_dim"] = head_dim
    return MixtralConfig(**kw)


def _glm4moe_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    nextn = int(kw.get("num_nextn_predict_layers", 0) or 0)
    kw["num_hidden_layers"] -= nextn  # block_count counts the next-n layers; the HF model does not build them
    _set_partial_rotary("glm4moe", meta, kw, lambda head_dim: head_dim // 2)
    kw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    kw["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    kw.setdefault("norm_topk_prob", False)
    return Glm4MoeConfig(**kw)


def _gpt_oss_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    """Sliding-window layers alternate with full ones from the first, as llama.cpp also assumes;
    the clamped SwiGLU's constants are the config's defaults, which the files do not carry."""
    if meta.get("gpt-oss.rope.scaling.type") == "yarn":
        kw["rope_parameters"].update(
            rope_type="yarn", factor=float(meta["gpt-oss.rope.scaling.factor"]), truncate=False,
            original_max_position_embeddings=int(meta["gpt-oss.rope.scaling.original_context_length"]),
            beta_fast=float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)))
    kw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return GptOssConfig(**kw)


def _minimax_m2_metadata(config: PretrainedConfig) -> dict[str, Any]:
    return {"minimax-m2.rope.dimension_count": _rotary_dims(config, 1.0),
            "minimax-m2.expert_gating_func": GATING_SIGMOID}


def _minimax_m2_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    _set_partial_rotary("minimax-m2", meta, kw, lambda head_dim: head_dim)
    return MiniMaxM2Config(**kw)


def _hybrid_metadata(arch: str, config: PretrainedConfig) -> dict[str, Any]:
    """The converter writes the value heads' total width, the rotated part of each head and the
    interval of the full-attention layers (Qwen3.5: also the MRoPE sections, padded to 4)."""
    types = list(config.layer_types)
    interval = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    if types != ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]:
        raise ValueError(f"{arch} files say where full attention is by one interval; layer_types {types} has none")
    meta = {f"{arch}.ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
            f"{arch}.rope.dimension_count": _rotary_dims(config, 0.25),
            f"{arch}.full_attention_interval": interval}
    if arch == "qwen35moe":
        sections = list((getattr(config, "rope_parameters", None) or {}).get("mrope_section") or [11, 11, 10])
        meta[f"{arch}.rope.dimension_sections"] = (sections + [0] * 4)[:4]
    return meta


def _hybrid_config(arch: str, meta: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """Layer i is full attention where (i + 1) % full_attention_interval == 0, linear otherwise (as
    llama.cpp reads the files); the value heads' width is inner_size over their count."""
    inner, v_heads = meta.get(f"{arch}.ssm.inner_size"), kw.get("linear_num_value_heads")
    if inner is None or not v_heads or inner % v_heads:
        raise WeightError(f"GGUF metadata {arch}.ssm.inner_size = {inner!r} is not a multiple of "
                          f"{arch}.ssm.time_step_rank = {v_heads!r}")
    if v_heads % kw.get("linear_num_key_heads", 1):
        raise WeightError(f"GGUF metadata {arch}.ssm.time_step_rank = {v_heads} is not a multiple of "
                          f"{arch}.ssm.group_count = {kw['linear_num_key_heads']}")
    kw["linear_value_head_dim"] = inner // v_heads
    interval = kw.pop("full_attention_interval", 4)
    kw["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                         for i in range(kw["num_hidden_layers"])]
    _set_partial_rotary(arch, meta, kw, lambda head_dim: head_dim // 4)
    return kw


def _qwen3next_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    """llama.cpp always normalizes the top-k weights and runs every layer's MoE."""
    from transformers import Qwen3NextConfig
    kw = _hybrid_config("qwen3next", meta, kw)
    kw.setdefault("intermediate_size", kw.get("moe_intermediate_size"))
    return Qwen3NextConfig(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **kw)


def _qwen35moe_config(meta: dict[str, Any], kw: dict[str, Any], tensors) -> PretrainedConfig:
    from transformers import Qwen3_5MoeTextConfig
    kw = _hybrid_config("qwen35moe", meta, kw)
    sections = meta.get("qwen35moe.rope.dimension_sections")
    if sections:
        kw["rope_parameters"]["mrope_section"] = [int(s) for s in sections[:3]]
    kw.pop("intermediate_size", None)
    return Qwen3_5MoeTextConfig(**kw)


_EXTRA_METADATA = {"deepseek2": _deepseek_metadata, "qwen3next": lambda config: _hybrid_metadata("qwen3next", config),
                   "qwen35moe": lambda config: _hybrid_metadata("qwen35moe", config), "glm4moe": _glm4moe_metadata,
                   "gpt-oss": lambda config: _yarn_metadata("gpt-oss", config), "minimax-m2": _minimax_m2_metadata}
_BUILDERS = {"deepseek2": _deepseek_config, "glm4moe": _glm4moe_config, "gpt-oss": _gpt_oss_config,
             "minimax-m2": _minimax_m2_config, "qwen3next": _qwen3next_config, "qwen35moe": _qwen35moe_config, "qwen3moe": _qwen3_config, "qwen2moe": _qwen2_config, "llama": _llama_config}


def routed_experts(config) -> int:
    """Routed experts per MoE layer, under whichever name the config's family uses (0 if none)."""
    return next((getattr(config, k) for k in ("n_routed_experts", "num_experts", "num_local_experts")
                 if getattr(config, k, None)), 0)
