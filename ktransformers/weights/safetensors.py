"""Hugging Face safetensors checkpoints: single or sharded (index json), per-expert tensors, and
DeepSeek-V3's FP8 e4m3 weights with 128x128-block `weight_scale_inv` scales.

Checkpoints store HF names as `save_pretrained` writes them (per-expert tensors; Mixtral's
`block_sparse_moe.*.w1/w2/w3`); the table below renames them to the module names of
transformers' classes, and WeightSource stacks experts into the fused parameters.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from .ggml_quants import GGMLType
from .source import MissingTensorError, TensorInfo, WeightError, WeightSource

FP8_BLOCK = 128

# Checkpoint names -> module names of transformers' classes, per model_type (applied in order).
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    ),
}

_DTYPE_TO_GGML = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}


def safetensors_files(path: str | os.PathLike) -> dict[str, Path]:
    """{stored tensor name: file} for a checkpoint directory or one .safetensors file."""
    path = Path(path)
    if path.is_file():
        return {k: path for k in _keys_of(path)}
    if not path.is_dir():
        raise FileNotFoundError(f"safetensors path {str(path)!r} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise WeightError(f"{index}: not a safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise WeightError(f"{index} names shard files that are absent: {', '.join(missing)}")
        return {k: path / f for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in directory {str(path)!r}")
    return {k: f for f in files for k in _keys_of(f)}


def _keys_of(file: Path) -> list[str]:
    try:
        with safe_open(file, "pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise WeightError(f"{file}: not a readable safetensors file ({e})") from None


def dequant_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float32 weight from e4m3 `weight` [O, I] and per-block `scale_inv` [ceil(O/b), ceil(I/b)]."""
    rows, cols = weight.shape
    expect = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expect:
        raise WeightError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
                          f"in {block}x{block} blocks (expected {expect})")
    scale = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * scale


class SafetensorsSource(WeightSource):
    """WeightSource over an HF checkpoint directory."""

    def __init__(self, path: str | os.PathLike, model_type: str = ""):
        super().__init__()
        self.path = str(path)
        stored = safetensors_files(path)
        renames = [(re.compile(a), b) for a, b in CHECKPOINT_RENAMES.get(model_type, ())]
        self._files: dict[str, tuple[str, Path]] = {}
        for name, file in stored.items():
            if name.endswith("_scale_inv"):
                continue
            hf = name
            for pattern, repl in renames:
                hf = pattern.sub(repl, hf)
            self._files[hf] = (name, file)
        self._scales = {n[: -len("_scale_inv")]: f for n, f in stored.items() if n.endswith("_scale_inv")}
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._files)

    def _entry(self, name: str) -> tuple[str, Path]:
        try:
            return self._files[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: no tensor for {name!r}") from None

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file]

    def _get(self, stored_name: str, file: Path) -> torch.Tensor:
        return self._handle(file).get_tensor(stored_name)

    def info(self, name: str) -> TensorInfo:
        stored_name, file = self._entry(name)
        sl = self._handle(file).get_slice(stored_name)
        dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), "uint8"))
        return TensorInfo(_DTYPE_TO_GGML.get(dtype, GGMLType.I8), tuple(sl.get_shape()))

    def raw(self, name: str) -> np.ndarray:
        stored_name, file = self._entry(name)
        self.consumed.add(name)
        return self._get(stored_name, file).contiguous().view(torch.uint8).numpy().reshape(-1)

    def fp8_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if name not in self._files:
            return None
        stored_name, file = self._files[name]
        scale_file = self._scales.get(stored_name)
        if scale_file is None or self._handle(file).get_slice(stored_name).get_dtype() != "F8_E4M3":
            return None
        self.consumed.add(name)
        return self._get(stored_name, file), self._get(stored_name + "_scale_inv", scale_file).float()

    def _load_stored(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        stored_name, file = self._entry(name)
        tensor = self._get(stored_name, file)
        if tensor.dtype == torch.float8_e4m3fn:
            scale_file = self._scales.get(stored_name)
            if scale_file is None:
                raise WeightError(f"{file}: FP8 tensor {stored_name!r} has no {stored_name}_scale_inv")
            try:
                tensor = dequant_fp8_blocks(tensor, self._get(stored_name + "_scale_inv", scale_file))
            except WeightError as e:
                raise WeightError(f"{file}: {stored_name}: {e}") from None
        return tensor if dtype is None else tensor.to(dtype)
