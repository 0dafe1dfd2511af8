"""Write GGUF files the way llama.cpp's converter (and quantizer) lay them out.

Used by tests (tiny random models in every format) and by synthetic benchmark models. The HF
state dict goes through the inverse of the name map: fused experts split into gate/up/down,
DeepSeek's kv_b_proj split into attn_k_b/attn_v_b (or kept whole, like older files), llama's
Q/K rows permuted; 1-D tensors, norms and routers stay F32, as the converter keeps them.
"""
from __future__ import annotations

import os
import re
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import PretrainedConfig

from .ggml_quants import FORMATS, GGMLType, quantize
from .gguf_config import arch_of, metadata_from_config
from .gguf_names import TILED_VALUE_HEADS, GGUFNameTable
from .source import qkvz_rows

TypeChooser = Callable[[str, tuple[int, ...]], GGMLType]
_KEEP_F32 = re.compile(r"(_norm\.weight|ffn_gate_inp(_shexp)?\.weight|ssm_conv1d\.weight|\.bias|ssm_a)$")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: within each head, interleave the two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_tensors(state_dict: dict[str, torch.Tensor], config: PretrainedConfig,
                      split_kv_b: bool = True) -> dict[str, torch.Tensor]:
    """GGUF name -> float tensor (HF row-major layout), as convert_hf_to_gguf.py would emit them."""
    arch = arch_of(config)
    table = GGUFNameTable(arch)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().float()  # (a meta tensor stays meta: shapes only)
        if arch in TILED_VALUE_HEADS:
            tensor = _value_heads(name, tensor, config, tiled=True)
        for hf_name, t in _split_hf(name, tensor, config, split_kv_b):
            gguf_name = table.to_gguf(hf_name)
            if gguf_name is None:
                raise KeyError(f"no GGUF name for HF tensor {hf_name!r} in the {arch} map")
            if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
                t = _permute(t, heads)
            transform = table.transform_of(hf_name)
            if transform == "plus_one":
                t = t + 1
            elif transform == "neg_exp":
                t = -t.exp()
            out[gguf_name] = t
    return out


# model_types whose HF experts are [E, in, out] with gate and up interleaved along `out`
# (transformers' is_transposed, not is_concatenated experts): the converter transposes them and
# takes every other row apart
_INTERLEAVED_EXPERTS = frozenset({"gpt_oss"})


def _split_hf(name: str, t: torch.Tensor, config, split_kv_b: bool) -> list[tuple[str, torch.Tensor]]:
    """The HF tensor `name` as the converter's pieces, (HF-side name, tensor) each."""
    interleaved = config.model_type in _INTERLEAVED_EXPERTS
    if name.endswith(".experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        if interleaved:
            t = t.transpose(1, 2)
            return [(base + "gate_proj", t[:, 0::2]), (base + "up_proj", t[:, 1::2])]
        half = t.shape[1] // 2
        return [(base + "gate_proj", t[:, :half]), (base + "up_proj", t[:, half:])]
    if name.endswith(".experts.gate_up_proj_bias"):
        base = name[: -len("gate_up_proj_bias")]
        if not interleaved:
            half = t.shape[-1] // 2
            return [(base + "gate_proj_bias", t[..., :half]), (base + "up_proj_bias", t[..., half:])]
        return [(base + "gate_proj_bias", t[..., 0::2]), (base + "up_proj_bias", t[..., 1::2])]
    if name.endswith(".experts.down_proj") and interleaved:
        return [(name, t.transpose(1, 2))]
    if name.endswith(".self_attn.kv_b_proj.weight") and split_kv_b:
        base = name[: -len("kv_b_proj.weight")]
        nope, v = config.qk_nope_head_dim, config.v_head_dim
        kv = t.reshape(config.num_attention_heads, nope + v, t.shape[-1])
        return [(base + "k_b_proj.weight", kv[:, :nope].transpose(1, 2)), (base + "v_b_proj.weight", kv[:, nope:])]
    if name.endswith(".linear_attn.in_proj_qkvz.weight"):  # -> all q, k, v (attn_qkv) and all z (attn_gate)
        base = name[: -len("qkvz.weight")]
        stored = t[torch.argsort(_qkvz_rows(config))]
        qkv = stored.shape[0] - config.linear_num_value_heads * config.linear_value_head_dim
        return [(base + "qkv.weight", stored[:qkv]), (base + "z.weight", stored[qkv:])]
    if name.endswith(".linear_attn.conv1d.weight"):
        return [(name, t.squeeze(1))]
    return [(name, t)]


def _value_heads(name: str, t: torch.Tensor, config, tiled: bool) -> torch.Tensor:
    """A DeltaNet tensor with its value heads reordered from transformers' grouped order to tiled
    (value head j*Hk + g was head g*r + j), as qwen35moe's converter writes them, or back."""
    if ".linear_attn." not in name or config.linear_num_value_heads == config.linear_num_key_heads:
        return t
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    order = torch.arange(hv).reshape(hk, hv // hk).t().reshape(-1)  # tiled position -> grouped head
    if not tiled:
        order = torch.argsort(order)

    def rows(width: int, offset: int = 0) -> torch.Tensor:
        heads = (order[:, None] * width + torch.arange(width)).reshape(-1) + offset
        return torch.cat([torch.arange(offset), heads])

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return t[rows(dv, 2 * hk * dk)]
    if name.endswith("in_proj_z.weight"):
        return t[rows(dv)]
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return t[order]
    if name.endswith("out_proj.weight"):
        return t[:, rows(dv)]
    return t


def _qkvz_rows(config) -> torch.Tensor:
    return qkvz_rows(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)


def join_hf(name: str, pieces: list[torch.Tensor], config, shape: tuple[int, ...], split_kv_b: bool = True) -> torch.Tensor:
    """The inverse of the converter's split: the HF tensor `name` of `shape` from its pieces (in
    converter_tensors' order), e.g. as read back from a file."""
    interleaved = config.model_type in _INTERLEAVED_EXPERTS
    if name.endswith((".experts.gate_up_proj", ".experts.gate_up_proj_bias")):
        bias = name.endswith("_bias")
        if not interleaved:
            return torch.cat(pieces, dim=-1 if bias else 1)
        if bias:  # [E, I] pairs -> [E, 2I], gate and up alternating
            return torch.stack(pieces, dim=-1).flatten(-2)
        return torch.stack(pieces, dim=2).flatten(1, 2).transpose(1, 2)  # [E, I, H] pairs -> [E, H, 2I]
    if name.endswith(".experts.down_proj") and interleaved:
        return pieces[0].transpose(1, 2)
    if name.endswith(".self_attn.kv_b_proj.weight") and split_kv_b:
        k_b, v_b = pieces
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(shape)
    if name.endswith(".linear_attn.in_proj_qkvz.weight"):
        return torch.cat(pieces)[_qkvz_rows(config)].reshape(shape)
    (piece,) = pieces
    if arch_of(config) in TILED_VALUE_HEADS:
        return _value_heads(name, piece.reshape(shape), config, tiled=False)
    return piece.reshape(shape)


def converter_type(default: GGMLType) -> TypeChooser:
    """The converter's rule: 1-D tensors, norms, routers and biases F32; the rest `default`
    (falling back like llama-quantize when a row is not a whole number of blocks)."""
    def choose(name: str, shape: tuple[int, ...]) -> GGMLType:
        if len(shape) <= 1 or _KEEP_F32.search(name):
            return GGMLType.F32
        return fit_type(default, shape[-1])
    return choose


def fit_type(t: GGMLType, row: int) -> GGMLType:
    for candidate in (t, GGMLType.Q8_0, GGMLType.F16):
        if row % FORMATS[candidate].block_elems == 0:
            return candidate
    return GGMLType.F16


def tokenizer_metadata(tokenizer, pre: str = "qwen2") -> dict:
    """`tokenizer.ggml.*` keys for a byte-level BPE fast tokenizer, as the converter writes them
    (`pre` names llama.cpp's pre-tokenizer; a freshly trained byte-level BPE matches qwen2's)."""
    import json
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise ValueError(f"only BPE tokenizers can be written here, not {spec['model']['type']}")
    vocab = tokenizer.get_vocab()
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens], "tokenizer.ggml.merges": merges}
    for which, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if getattr(tokenizer, key, None) is not None:
            meta[f"tokenizer.ggml.{which}_token_id"] = getattr(tokenizer, key)
    if getattr(tokenizer, "chat_template", None):
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def _add_metadata(writer: GGUFWriter, meta: dict) -> None:
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"metadata {key!r}: cannot write {type(value).__name__}")


Encoder = Callable[[torch.Tensor, GGMLType], torch.Tensor]


def write_gguf(path: str | os.PathLike, config: PretrainedConfig, state_dict: dict[str, torch.Tensor], *,
               types: GGMLType | TypeChooser = GGMLType.F32, split_kv_b: bool = True, extra_metadata: dict | None = None,
               split_max_tensors: int = 0, encode: Encoder = quantize) -> dict[str, GGMLType]:
    """Write `state_dict` as a GGUF model (split into `-0000N-of-0000M` files when split_max_tensors > 0).
    `encode(tensor, type)` makes each tensor's bytes (default: quantize it; synthetic models pass
    random valid blocks, and tensors on the meta device). Returns the type chosen for each tensor."""
    choose = converter_type(types) if isinstance(types, GGMLType) else types
    meta = metadata_from_config(config) | (extra_metadata or {})
    writer = GGUFWriter(str(path), meta["general.architecture"], split_max_tensors=split_max_tensors)
    _add_metadata(writer, meta)
    chosen = {}
    for name, tensor in converter_tensors(state_dict, config, split_kv_b).items():
        t = chosen[name] = choose(name, tuple(tensor.shape))
        data = encode(tensor.contiguous(), t).numpy().reshape(*tensor.shape[:-1], -1)
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=GGMLQuantizationType(int(t)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen
