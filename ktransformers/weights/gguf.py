"""GGUF file sets: one .gguf file, its split siblings, or a directory holding one model's files.

Files are memory-mapped (gguf's GGUFReader); `raw()` hands out zero-copy views of the stored
blocks. Tensor shapes are stored ne0-first; this module reverses them once, so everything above
sees HF (row-major) shapes. Names are translated through gguf_names.GGUFNameTable.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from .ggml_quants import GGMLType, dequantize, tensor_nbytes
from .gguf_names import DERIVED_HF, IGNORABLE_GGUF, TILED_VALUE_HEADS, VALUE_TRANSFORMS, GGUFNameTable
from .source import MissingTensorError, TensorInfo, WeightError, WeightSource

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]  # HF order (reversed from the file's ne0-first dims)
    data: np.ndarray  # uint8 view into the file's memory map
    file: str


def gguf_files(path: str | os.PathLike) -> list[Path]:
    """The files of one model: a .gguf file (plus its split siblings) or a directory of them."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".gguf")
        if not files:
            raise FileNotFoundError(f"no .gguf file in directory {str(path)!r}")
        models = {(_SPLIT.match(p.name)["stem"] if _SPLIT.match(p.name) else p.stem) for p in files}
        if len(models) > 1:
            raise WeightError(f"{path} holds several models ({', '.join(sorted(models))}); pass one .gguf file")
        return _complete_split(files)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF path {str(path)!r} does not exist")
    match = _SPLIT.match(path.name)
    if not match:
        return [path]
    siblings = sorted(p for p in path.parent.iterdir() if (m := _SPLIT.match(p.name)) and m["stem"] == match["stem"])
    return _complete_split(siblings)


def _complete_split(files: list[Path]) -> list[Path]:
    match = _SPLIT.match(files[0].name)
    if not match:
        return files
    count = int(match["count"])
    expected = [files[0].parent / f"{match['stem']}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise WeightError(f"split GGUF {match['stem']} is incomplete: missing {', '.join(missing)}")
    return expected


def _field_value(field) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
        return [v for i in field.data for v in field.parts[i].tolist()]
    return field.contents()


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


class _HeaderScan:
    """A bounds-checked walk over the header, so corrupt files fail with a message naming the problem
    (the gguf reader's own errors are numpy reshape failures)."""

    def __init__(self, path: Path, data: memoryview):
        self.path, self.data, self.at = path, data, 8

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise WeightError(f"{self.path}: truncated header while reading {what} at byte {self.at}")
        value = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> str:
        n = self.take("<Q", what)
        if self.at + n > len(self.data):
            raise WeightError(f"{self.path}: truncated header: {what} of {n} bytes at byte {self.at}")
        self.at += n
        try:
            return bytes(self.data[self.at - n: self.at]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise WeightError(f"{self.path}: {what} at byte {self.at - n} is not UTF-8 ({e.reason} at its byte "
                              f"{e.start})") from None

    def skip_value(self, vtype: int, key: str) -> None:
        if vtype == _STRING:
            self.string(f"value of {key!r}")
        elif vtype == _ARRAY:
            etype, count = self.take("<IQ", f"array header of {key!r}")
            if etype in _SCALAR_SIZES:
                self.at += _SCALAR_SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype, key)
        elif vtype in _SCALAR_SIZES:
            self.at += _SCALAR_SIZES[vtype]
        else:
            raise WeightError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")

    def check(self) -> None:
        n_tensors, n_kv = self.take("<QQ", "tensor and key counts")
        alignment = 32
        for _ in range(n_kv):
            key = self.string("a metadata key")
            vtype = self.take("<I", f"type of {key!r}")
            start = self.at
            self.skip_value(vtype, key)
            if key == "general.alignment" and vtype == 4:
                alignment = struct.unpack_from("<I", self.data, start)[0] or 32
        if alignment & (alignment - 1) or alignment > 1 << 20:
            raise WeightError(f"{self.path}: general.alignment {alignment} is not a power of two up to 1 MiB")
        infos = [self.tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.at // alignment) * alignment
        # As llama.cpp's loader requires: the tensors' data in directory order, each at the end of
        # the one before rounded up to the alignment. A wrong tensor count, a misaligned,
        # overlapping or out-of-order offset all break this chain.
        expected = 0
        for name, ggml_type, n_elements, offset in infos:
            try:
                nbytes = tensor_nbytes(ggml_type, n_elements)
            except ValueError as e:
                raise WeightError(f"{self.path}: tensor {name!r}: {e}") from None
            if offset != expected:
                raise WeightError(f"{self.path}: tensor {name!r} has data offset {offset}, expected {expected} (the "
                                  f"end of the tensor before it, aligned to {alignment}): a wrong tensor count, or "
                                  "misaligned or overlapping data")
            end = data_start + offset + nbytes
            if end > len(self.data):
                raise WeightError(f"{self.path}: tensor {name!r} data ends at byte {end}, "
                                  f"past the end of the file ({len(self.data)} bytes)")
            expected = -(-(offset + nbytes) // alignment) * alignment

    def tensor_info(self) -> tuple[str, GGMLType, int, int]:
        name = self.string("a tensor name")
        n_dims = self.take("<I", f"dimension count of {name!r}")
        if n_dims > 4:
            raise WeightError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions (at most 4)")
        dims = [self.take("<Q", f"dims of {name!r}") for _ in range(n_dims)]
        raw_type, offset = self.take("<IQ", f"type and offset of {name!r}")
        try:
            ggml_type = GGMLType(raw_type)
        except ValueError:
            raise WeightError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        return name, ggml_type, int(np.prod(dims, dtype=np.uint64)), offset


def _open_reader(path: Path) -> GGUFReader:
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise WeightError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version not in (2, 3):
        raise WeightError(f"{path}: GGUF version {version} is not supported (expected 3)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            _HeaderScan(path, view).check()
        finally:
            view.release()
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # anything the scan above did not foresee; one message for all
        raise WeightError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None


class GGUFFileSet:
    """Metadata and tensors of one model's GGUF files (split files merged)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.files = gguf_files(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._stamps: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) when it was mapped
        for file in self.files:
            stat = os.stat(file)
            self._stamps[str(file)] = (stat.st_size, stat.st_mtime_ns)
            self._add(file, _open_reader(file))

    def check_unchanged(self, file: str) -> None:
        """Raise WeightError where `file` was changed on disk since it was mapped: its pages would
        then read as other data, or fault (SIGBUS) past a truncation."""
        try:
            stat = os.stat(file)
            now = (stat.st_size, stat.st_mtime_ns)
        except OSError as e:
            raise WeightError(f"{file}: changed on disk since it was opened ({e.strerror}); load the model again") from None
        if now != self._stamps[file]:
            raise WeightError(f"{file}: changed on disk since it was opened (size {self._stamps[file][0]} -> {now[0]} "
                              "bytes, or a new modification time); load the model again")

    def _add(self, file: Path, reader: GGUFReader) -> None:
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                self.metadata.setdefault(key, _field_value(field))
        for t in reader.tensors:
            if t.name in self.tensors:
                raise WeightError(f"{file}: tensor {t.name!r} also appears in {self.tensors[t.name].file}")
            data = reader.data[t.data_offset: t.data_offset + t.n_bytes]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, GGMLType(int(t.tensor_type)), shape, data, str(file))

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise WeightError(f"{self.path}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; `{arch}` in the key is replaced by the architecture name."""
        return self.metadata.get(key.replace("{arch}", self.arch), default)



def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's llama Q/K permutation (rows of each head interleaved by halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(WeightSource):
    """WeightSource over a GGUF file set: HF names in, llama.cpp names and layouts underneath."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.files = GGUFFileSet(path)
        self.path = self.files.path
        self.arch = self.files.arch
        self.names = GGUFNameTable(self.arch)
        self._by_hf: dict[str, tuple[str, str]] = {}
        self.unknown: list[str] = []
        for gguf_name in self.files.tensors:
            mapped = self.names.to_hf(gguf_name)
            if mapped:
                self._by_hf[mapped[0]] = (gguf_name, mapped[1])
            elif not IGNORABLE_GGUF.match(gguf_name):
                self.unknown.append(gguf_name)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.files.metadata

    def keys(self) -> list[str]:
        return list(self._by_hf)

    def _tensor(self, name: str) -> tuple[GGUFTensor, str]:
        try:
            gguf_name, transform = self._by_hf[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: no tensor for {name!r}{self._hint(name)}") from None
        return self.files.tensors[gguf_name], transform

    def _hint(self, name: str) -> str:
        gguf_name = self.names.to_gguf(name)
        return f" (GGUF name {gguf_name!r})" if gguf_name else f" (no GGUF name for it in the {self.arch} map)"

    def info(self, name: str) -> TensorInfo:
        t, transform = self._tensor(name)
        return TensorInfo(t.ggml_type, t.shape, transform)

    def raw(self, name: str) -> np.ndarray:
        t, _ = self._tensor(name)
        self.files.check_unchanged(t.file)
        self.consumed.add(name)
        return t.data

    def _load_stored(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t, transform = self._tensor(name)
        self.files.check_unchanged(t.file)
        valued = transform in VALUE_TRANSFORMS  # (undone in float32, then cast)
        try:  # dequantize checks the byte count and the block size against the shape
            tensor = dequantize(t.data, t.ggml_type, t.shape, torch.float32 if valued else dtype or torch.float32)
        except (ValueError, NotImplementedError) as e:
            raise WeightError(f"{t.file}: tensor {t.name!r}: {e}") from None
        if valued:
            if transform == "neg_exp" and not bool((tensor < 0).all()):
                raise WeightError(f"{t.file}: tensor {t.name!r} holds -exp(A_log), so every value must be negative; "
                                  f"it has {int((~(tensor < 0)).sum())} that are not")
            tensor = tensor - 1 if transform == "plus_one" else torch.log(-tensor)
            return tensor.to(dtype or torch.float32)
        if transform:
            tensor = _unpermute(tensor, self._heads(transform))
        return tensor

    def _heads(self, transform: str) -> int:
        key = "attention.head_count" if transform == "unpermute_q" else "attention.head_count_kv"
        return int(self.files.get("{arch}." + key) or self.files.get("{arch}.attention.head_count"))

    @property
    def value_heads_tiled(self) -> bool:
        """The DeltaNet value heads are stored tiled, not grouped by key head (operators.deltanet)."""
        return self.arch in TILED_VALUE_HEADS

    def linear_attention_heads(self) -> tuple[int, int, int, int]:
        """(key heads, value heads, key head dim, value head dim) of the gated DeltaNet layers."""
        get = lambda key: self.files.get("{arch}.ssm." + key)  # noqa: E731
        hk, hv, dk, inner = get("group_count"), get("time_step_rank"), get("state_size"), get("inner_size")
        if not all(isinstance(v, int) and v > 0 for v in (hk, hv, dk, inner)) or inner % hv or hv % hk:
            raise WeightError(f"{self.path}: the ssm.group_count / time_step_rank / state_size / inner_size metadata "
                              f"({hk}, {hv}, {dk}, {inner}) do not describe gated DeltaNet heads")
        return hk, hv, dk, inner // hv

    def stored_row_order(self, name: str) -> torch.Tensor | None:
        if not self.stored(name):
            return super().stored_row_order(name)
        t, transform = self._tensor(name)
        if transform not in ("unpermute_q", "unpermute_k"):
            return None
        rows, heads = t.shape[0], self._heads(transform)
        return torch.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)

    def unconsumed(self) -> list[str]:
        """Stored tensors nothing read, not counting parts that composed tensors make redundant."""
        return [n for n in super().unconsumed() if not DERIVED_HF.search(n) or self._derived_unused(n)]

    def _derived_unused(self, name: str) -> bool:
        kv_b = re.sub(r"[kv]_b_proj\.weight$", "kv_b_proj.weight", name)
        return kv_b not in self.consumed
