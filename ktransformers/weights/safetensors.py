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

from .ggml_quants import GGMLType, dequantize
from .source import MissingTensorError, TensorInfo, WeightError, WeightSource

FP8_BLOCK = 128

# Checkpoint names -> module names of transformers' classes, per model_type (applied in order).
_BLOCK_SPARSE_MOE = (  # Mixtral's and MiniMax-M2's checkpoints: the MoE block and its per-expert w1/w2/w3
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    (r"\.block_sparse_moe\.", ".mlp."),
)
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {"mixtral": _BLOCK_SPARSE_MOE, "minimax_m2": _BLOCK_SPARSE_MOE}

_DTYPE_TO_GGML = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}

# model_types whose checkpoints keep transformers' interleaved experts: gate_up_proj [E, H, 2I]
# (gate, up alternating along 2I), down_proj [E, I, H], biases likewise; or OpenAI's MXFP4
# `<p>_blocks` [E, out, in/32, 16] (two values a byte, the earlier in the low nibble) with
# `<p>_scales` [E, out, in/32] (E8M0). They are given as the [E, out, in] stacks a GGUF holds;
# MXFP4 ones as ggml MXFP4 blocks, which the CPU kernels compute on.
INTERLEAVED_EXPERTS = frozenset({"gpt_oss"})
_GGML_OF = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj(_blocks)?$")


def mxfp4_from_openai(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ggml MXFP4 blocks uint8 [..., n, 17] from OpenAI's blocks [..., n, 16] and scales [..., n]:
    the same code book and exponent; ggml keeps values j and j + 16 of a block in byte j."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # [..., n, 32] in value order
    return torch.cat([scales.to(torch.uint8).unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)], dim=-1)


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
        # composed name -> (info, the stored names it reads, a function giving it: raw bytes for
        # MXFP4, else the tensor)
        self._virtual: dict[str, tuple[TensorInfo, tuple[str, ...], object]] = {}
        self._stored = dict(self._files)  # every stored tensor, composed ones' parts too
        if model_type in INTERLEAVED_EXPERTS:
            for name in list(self._files):
                m = _FUSED.match(name)
                if m:
                    self._split_experts(m["prefix"])

    def _split_experts(self, prefix: str) -> None:
        """Virtual entries `<prefix>.{gate,up,down}_proj` (+ `_bias`) for one layer's interleaved experts."""
        def add(name: str, parts: tuple[str, ...], info: TensorInfo, fn) -> None:
            self._virtual[name] = (info, parts, fn)
            for part in parts:
                self._files.pop(part, None)
            self._files[name] = self._stored.get(name, ("", Path()))  # (listed by keys())

        def stored(name: str) -> torch.Tensor:
            return self._get(*self._stored[name])

        for half, proj in enumerate(("gate", "up")):
            rows = slice(half, None, 2)
            if f"{prefix}.gate_up_proj_blocks" in self._stored:
                parts = (f"{prefix}.gate_up_proj_blocks", f"{prefix}.gate_up_proj_scales")
                E, two_i, n, _ = self._shape(parts[0])
                add(f"{prefix}.{proj}_proj", parts, TensorInfo(GGMLType.MXFP4, (E, two_i // 2, n * 32)),
                    lambda p=parts, r=rows: mxfp4_from_openai(stored(p[0])[:, r], stored(p[1])[:, r]))
            else:
                part = f"{prefix}.gate_up_proj"
                E, H, two_i = self._shape(part)
                add(f"{prefix}.{proj}_proj", (part,), TensorInfo(self.info_of(part), (E, two_i // 2, H)),
                    lambda p=part, r=rows: stored(p).transpose(1, 2)[:, r])
            if f"{prefix}.gate_up_proj_bias" in self._stored:
                part = f"{prefix}.gate_up_proj_bias"
                E, two_i = self._shape(part)
                add(f"{prefix}.{proj}_proj_bias", (part,), TensorInfo(self.info_of(part), (E, two_i // 2)),
                    lambda p=part, r=rows: stored(p)[:, r])
        if f"{prefix}.down_proj_blocks" in self._stored:
            parts = (f"{prefix}.down_proj_blocks", f"{prefix}.down_proj_scales")
            E, H, n, _ = self._shape(parts[0])
            add(f"{prefix}.down_proj", parts, TensorInfo(GGMLType.MXFP4, (E, H, n * 32)),
                lambda p=parts: mxfp4_from_openai(stored(p[0]), stored(p[1])))
        elif f"{prefix}.down_proj" in self._stored:
            part = f"{prefix}.down_proj"
            E, I, H = self._shape(part)
            add(part, (part,), TensorInfo(self.info_of(part), (E, H, I)), lambda p=part: stored(p).transpose(1, 2))

    def _shape(self, name: str) -> tuple[int, ...]:
        stored_name, file = self._stored[name]
        return tuple(self._handle(file).get_slice(stored_name).get_shape())

    def info_of(self, name: str) -> GGMLType:
        stored_name, file = self._stored[name]
        return _GGML_OF.get(self._handle(file).get_slice(stored_name).get_dtype(), GGMLType.I8)

    def _from_virtual(self, name: str) -> torch.Tensor:
        info, parts, fn = self._virtual[name]
        self.consumed.update(parts)
        return fn().contiguous()

    def unconsumed(self) -> list[str]:
        consumed = self.consumed | {n for n, (_, parts, _) in self._virtual.items() if set(parts) <= self.consumed}
        return sorted(self._key_set() - consumed)

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
        if name in self._virtual:
            return self._virtual[name][0]
        stored_name, file = self._entry(name)
        sl = self._handle(file).get_slice(stored_name)
        dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), "uint8"))
        return TensorInfo(_DTYPE_TO_GGML.get(dtype, GGMLType.I8), tuple(sl.get_shape()))

    def raw(self, name: str) -> np.ndarray:
        if name in self._virtual:
            return self._from_virtual(name).view(torch.uint8).numpy().reshape(-1)
        stored_name, file = self._entry(name)
        self.consumed.add(name)
        return self._get(stored_name, file).contiguous().view(torch.uint8).numpy().reshape(-1)

    def fp8_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if name not in self._files or name in self._virtual:
            return None
        stored_name, file = self._files[name]
        scale_file = self._scales.get(stored_name)
        if scale_file is None or self._handle(file).get_slice(stored_name).get_dtype() != "F8_E4M3":
            return None
        self.consumed.add(name)
        return self._get(stored_name, file), self._get(stored_name + "_scale_inv", scale_file).float()

    def _load_stored(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self._virtual:
            info, tensor = self._virtual[name][0], self._from_virtual(name)
            if info.ggml_type == GGMLType.MXFP4:
                tensor = dequantize(tensor, GGMLType.MXFP4, info.shape)
            return tensor if dtype is None else tensor.to(dtype)
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
