"""WeightSource: tensors by Hugging Face name, whatever the file format underneath.

Sources store tensors under their own names and layouts; each translates HF names in and gives
back `load(name) -> Tensor` (dequantized, in HF layout) or `raw(name)` (the stored bytes). HF
tensors that files keep in pieces are composed here, once for every format:
  experts.gate_up_proj    [E, 2I, H] = cat(experts.gate_proj [E, I, H], experts.up_proj [E, I, H])
                                       (and gate_proj / up_proj as halves of a stored gate_up_proj)
  experts.<p>_proj        [E, ...]   = stack of experts.<e>.<p>_proj.weight over e (per-expert files)
  self_attn.kv_b_proj     [N*(D+V), R] from k_b_proj [N, R, D] and v_b_proj [N, V, R] (newer GGUF)
  linear_attn.in_proj_qkvz  rows of in_proj_qkv (all q, all k, all v) and in_proj_z (all z),
                          regrouped per key head as transformers' Qwen3-Next keeps them (GGUF)
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from .ggml_quants import GGMLType


class WeightError(ValueError):
    """A weight file or tensor that cannot be used as asked; the message names file and tensor."""


class MissingTensorError(WeightError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class TensorInfo:
    ggml_type: GGMLType
    shape: tuple[int, ...]  # HF (row-major) order of the stored tensor
    transform: str = ""  # applied by load(), not by raw(): e.g. "unpermute_q"


_EXPERT_PART = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate|up|down)_proj$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class WeightSource(ABC):
    """Tensors by HF name. Subclasses implement the stored-tensor primitives."""

    path: str

    def __init__(self) -> None:
        self.consumed: set[str] = set()
        self.aliases: dict[str, str] = {}  # e.g. tied lm_head.weight -> model.embed_tokens.weight
        self._expert_counts: dict[str, int] | None = None

    # --- primitives --------------------------------------------------------------------------
    @abstractmethod
    def keys(self) -> list[str]:
        """HF names of the tensors stored (before composition)."""

    @abstractmethod
    def info(self, name: str) -> TensorInfo: ...

    @abstractmethod
    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor, zero-copy where the file allows (a uint8 view)."""

    @abstractmethod
    def _load_stored(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One stored tensor, dequantized to `dtype` (default float32, or its own float dtype), in HF layout."""

    # --- composition -------------------------------------------------------------------------
    def stored(self, name: str) -> bool:
        return name in self._key_set()

    def _key_set(self) -> set[str]:
        if not hasattr(self, "_keys_cache"):
            self._keys_cache = set(self.keys())
        return self._keys_cache

    def has(self, name: str) -> bool:
        try:
            self._plan(name)
            return True
        except MissingTensorError:
            return False

    def _plan(self, name: str) -> list[str]:
        """The stored tensors `name` is made of; raises MissingTensorError naming what is absent."""
        if self.stored(name):
            return [name]
        if name in self.aliases:
            return self._plan(self.aliases[name])
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            return self._plan(base + "gate_proj") + self._plan(base + "up_proj")
        m = _EXPERT_PART.match(name)
        if m and m["proj"] in ("gate", "up") and self.stored(f"{m['prefix']}.gate_up_proj"):
            return [f"{m['prefix']}.gate_up_proj"]  # half of a fused tensor
        if m and self.expert_count(m["prefix"]):
            return [f"{m['prefix']}.{e}.{m['proj']}_proj.weight" for e in range(self.expert_count(m["prefix"]))]
        if name.endswith(".self_attn.kv_b_proj.weight"):
            base = name[: -len("kv_b_proj.weight")]
            parts = [base + "k_b_proj.weight", base + "v_b_proj.weight"]
            if all(self.stored(p) for p in parts):
                return parts
        if name.endswith(_QKVZ):
            base = name[: -len("qkvz.weight")]
            parts = [base + "qkv.weight", base + "z.weight"]
            if all(self.stored(p) for p in parts):
                return parts
        raise MissingTensorError(f"{self.path}: no tensor for {name!r}{self._hint(name)}")

    def _hint(self, name: str) -> str:
        return ""

    def expert_count(self, prefix: str) -> int:
        """Number of per-expert tensors stored under `prefix` (e.g. 'model.layers.3.mlp.experts')."""
        if self._expert_counts is None:
            counts: dict[str, int] = {}
            for key in self._key_set():
                m = _PER_EXPERT.match(key)
                if m:
                    counts[m["prefix"]] = max(counts.get(m["prefix"], 0), int(m["e"]) + 1)
            self._expert_counts = counts
        return self._expert_counts.get(prefix, 0)

    def load(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The HF tensor `name`, dequantized and composed, on `device` in `dtype` (default: as stored).
        With `shape`, a tensor of another shape is an error (size-1 dimensions may differ)."""
        tensor = self._compose(name, dtype)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            if tensor.numel() != _numel(shape) or [d for d in tensor.shape if d != 1] != [d for d in shape if d != 1]:
                raise WeightError(f"{self.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(shape)}")
            tensor = tensor.reshape(shape)
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def _compose(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """Parts are converted to `dtype` as they are read, so no float32 copy of a whole fused tensor exists."""
        parts = self._plan(name)
        self.consumed.update(parts)
        if name in self.aliases and not self.stored(name):
            return self._compose(self.aliases[name], dtype)
        if parts == [name]:
            return self._load_stored(name, dtype)
        if len(parts) == 1 and parts[0].endswith(".gate_up_proj"):  # gate or up half of a fused tensor
            fused = self._load_stored(parts[0], dtype)
            half = fused.shape[1] // 2
            return (fused[:, :half] if name.endswith(".gate_proj") else fused[:, half:]).contiguous()
        if name.endswith(".experts.gate_up_proj"):
            return self._gate_up(name[: -len("gate_up_proj")], dtype)
        if name.endswith(".self_attn.kv_b_proj.weight"):
            return _kv_b_from_parts(self._load_stored(parts[0], dtype), self._load_stored(parts[1], dtype))
        if name.endswith(_QKVZ):
            stored = torch.cat([self._load_stored(p, dtype) for p in parts])
            return stored[self._qkvz_rows(stored.shape[0])]
        return torch.stack([self._load_stored(p, dtype) for p in parts])

    def _gate_up(self, base: str, dtype: torch.dtype | None) -> torch.Tensor:
        """[E, 2I, H] filled half by half: one part is alive at a time besides the result."""
        gate = self._compose(base + "gate_proj", dtype)
        out = torch.empty(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:], dtype=gate.dtype)
        half = gate.shape[1]
        out[:, :half] = gate
        del gate
        out[:, half:] = self._compose(base + "up_proj", dtype)
        return out

    def stored_row_order(self, name: str) -> torch.Tensor | None:
        """For a tensor stored with its rows reordered: stored row i is HF row order[i]; else None
        (raw_stacked's rows are in stored order)."""
        if name.endswith(_QKVZ) and self._plan(name) != [name]:
            rows = sum(self.info(p).shape[0] for p in self._plan(name))
            return torch.argsort(self._qkvz_rows(rows))
        return None

    def linear_attention_heads(self) -> tuple[int, int, int, int]:
        """(key heads, value heads, key head dim, value head dim) of gated DeltaNet layers, for
        sources that store their projections split (GGUF)."""
        raise WeightError(f"{self.path}: cannot tell the gated DeltaNet heads of this file")

    def _qkvz_rows(self, rows: int) -> torch.Tensor:
        """HF row j of in_proj_qkvz is row idx[j] of cat(in_proj_qkv, in_proj_z)."""
        hk, hv, dk, dv = self.linear_attention_heads()
        if rows != 2 * hk * dk + 2 * hv * dv:
            raise WeightError(f"{self.path}: in_proj_qkv and in_proj_z have {rows} rows together; heads "
                              f"({hk} key x {dk}, {hv} value x {dv}) make {2 * hk * dk + 2 * hv * dv}")
        return qkvz_rows(hk, hv, dk, dv)

    def fp8_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(float8_e4m3fn weight, float32 block scale_inv) when `name` is stored that way (DeepSeek-V3's
        FP8 safetensors), else None."""
        return None

    def raw_stacked(self, name: str) -> tuple[np.ndarray, TensorInfo] | None:
        """The stored bytes of `name` as one array with its info: zero-copy when stored whole,
        the parts' bytes concatenated once when it is a stack of per-expert tensors of one type,
        None when it is composed in another way (the caller then loads it dequantized)."""
        parts = self._plan(name)
        if parts == [name] and name not in self.aliases:
            return self.raw(name), self.info(name)
        infos = [self.info(p) for p in parts]
        if name.endswith(_QKVZ) and len({i.ggml_type for i in infos}) == 1 and not any(i.transform for i in infos):
            data = np.concatenate([np.asarray(self.raw(p)).reshape(-1) for p in parts])  # (whole rows of blocks)
            return data, TensorInfo(infos[0].ggml_type, (sum(i.shape[0] for i in infos), *infos[0].shape[1:]))
        is_stack = _EXPERT_PART.match(name) is not None and len(parts) > 1
        if not is_stack or len({(i.ggml_type, i.shape, i.transform) for i in infos}) != 1:
            return None
        data = np.concatenate([np.asarray(self.raw(p)).reshape(-1) for p in parts])
        return data, TensorInfo(infos[0].ggml_type, (len(parts), *infos[0].shape), infos[0].transform)

    def unconsumed(self) -> list[str]:
        return sorted(self._key_set() - self.consumed)


_QKVZ = ".linear_attn.in_proj_qkvz.weight"


def qkvz_rows(hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """The row order of transformers' in_proj_qkvz (per key head g: q_g, k_g, then v and z of its
    hv / hk value heads) as indices into [all q; all k; all v; all z] (llama.cpp's attn_qkv, then
    attn_gate)."""
    r = hv // hk
    q = torch.arange(hk * dk).reshape(hk, dk)
    k = q + hk * dk
    v = torch.arange(hv * dv).reshape(hk, r * dv) + 2 * hk * dk
    z = v + hv * dv
    return torch.cat([q, k, v, z], dim=1).reshape(-1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _kv_b_from_parts(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [N*(D+V), R] from k_b [N, R, D] (stored transposed) and v_b [N, V, R]."""
    n_head, rank = k_b.shape[0], k_b.shape[1]
    if v_b.shape[0] != n_head or v_b.shape[2] != rank:
        raise WeightError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not fit together")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank)
