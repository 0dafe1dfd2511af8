"""GGUF file sets: metadata, zero-copy raw blocks, split files, and bad input -> clear errors."""
import struct

import numpy as np
import pytest
import torch

from ktransformers.weights.ggml_quants import GGMLType, dequantize
from ktransformers.weights.gguf import GGUFFileSet, GGUFSource, gguf_files
from ktransformers.weights.gguf_config import arch_of
from ktransformers.weights.gguf_names import ARCH_NAMES, GGUFNameTable
from ktransformers.weights.gguf_write import _split_hf, write_gguf
from ktransformers.weights.source import MissingTensorError, WeightError
from tiny import FAMILIES, tiny_model


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    model = tiny_model("qwen3_moe", layers=2)
    path = tmp_path_factory.mktemp("g") / "q.gguf"
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q4_K)
    return path, model


def test_metadata_and_shapes(qwen_file):
    path, model = qwen_file
    files = GGUFFileSet(path)
    assert files.arch == "qwen3moe"
    assert files.get("{arch}.expert_count") == 8 and files.get("{arch}.block_count") == 2
    t = files.tensors["blk.0.ffn_gate_exps.weight"]
    assert t.ggml_type == GGMLType.Q4_K and t.shape == (8, 256, 256)  # HF order, reversed from ne


def test_raw_is_a_zero_copy_view_of_the_mmap(qwen_file):
    path, _ = qwen_file
    source = GGUFSource(path)
    raw = source.raw("model.layers.1.mlp.experts.down_proj")
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)
    assert not raw.flags.owndata and raw.nbytes == 8 * 256 * 256 // 256 * 144
    info = source.info("model.layers.1.mlp.experts.down_proj")
    assert torch.equal(dequantize(raw, info.ggml_type, info.shape), source.load("model.layers.1.mlp.experts.down_proj"))


def test_source_composes_fused_experts(qwen_file):
    path, model = qwen_file
    source = GGUFSource(path)
    gate_up = source.load("model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.shape == model.model.layers[0].mlp.experts.gate_up_proj.shape
    assert torch.equal(gate_up[:, :256], source.load("model.layers.0.mlp.experts.gate_proj"))


@pytest.mark.parametrize("family", FAMILIES)
def test_name_maps_cover_every_parameter(family):
    """Every HF tensor of each family has a GGUF name, and maps back to itself."""
    model = tiny_model(family, layers=2)
    table = GGUFNameTable(arch_of(model.config))
    for name, tensor in model.state_dict().items():
        for part, _ in _split_hf(name, tensor, model.config, split_kv_b=False):
            gguf_name = table.to_gguf(part)
            assert gguf_name is not None, part
            assert table.to_hf(gguf_name)[0] == part


@pytest.mark.parametrize("family", FAMILIES)
def test_name_maps_agree_with_gguf_py(family):
    """Where gguf-py's own HF -> GGUF tensor map (what llama.cpp's converter applies) names an HF
    tensor of the family, our table gives that name; the tensors the converter renames in code
    (the correction bias, fused experts) are left to the converter checks."""
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES
    from gguf.tensor_mapping import get_tensor_name_map
    model = tiny_model(family, layers=2)
    arch_name = arch_of(model.config)
    theirs = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), 2)
    ours, compared = GGUFNameTable(arch_name), 0
    for name in model.state_dict():
        expected = theirs.get_name(name, try_suffixes=(".weight", ".bias"))
        if expected is None or name.endswith("kv_b_proj.weight"):  # (kv_b: split by the converter)
            continue
        got = ours.to_gguf(name)
        assert got is not None and got.removesuffix(".weight") == expected.removesuffix(".weight"), (name, got, expected)
        compared += 1
    assert compared >= len(model.state_dict()) * 3 // 4


def test_name_map_entries_are_unique():
    for arch, maps in ARCH_NAMES.items():
        assert len({m.gguf for m in maps}) == len(maps), arch
        assert len({m.hf for m in maps}) == len(maps), arch


def test_missing_tensor_names_both_names(qwen_file):
    source = GGUFSource(qwen_file[0])
    with pytest.raises(MissingTensorError, match=r"model\.layers\.7\.self_attn\.q_proj\.weight.*blk\.7\.attn_q\.weight"):
        source.load("model.layers.7.self_attn.q_proj.weight")


def _copy(src, dst, mutate):
    data = bytearray(src.read_bytes())
    mutate(data)
    dst.write_bytes(bytes(data))
    return dst


def test_wrong_magic(qwen_file, tmp_path):
    bad = _copy(qwen_file[0], tmp_path / "bad.gguf", lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    with pytest.raises(WeightError, match="not a GGUF file"):
        GGUFSource(bad)


def test_unsupported_version(qwen_file, tmp_path):
    bad = _copy(qwen_file[0], tmp_path / "bad.gguf", lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 9)))
    with pytest.raises(WeightError, match="version 9"):
        GGUFSource(bad)


def test_truncated_data_names_the_tensor(qwen_file, tmp_path):
    data = qwen_file[0].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 5000])
    with pytest.raises(WeightError, match=r"tensor '.*' data ends at byte \d+, past the end of the file"):
        GGUFSource(bad)


@pytest.mark.parametrize("keep", [10, 200, 3000])
def test_truncated_header(qwen_file, tmp_path, keep):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(qwen_file[0].read_bytes()[:keep])
    with pytest.raises(WeightError, match="cut.gguf"):
        GGUFSource(bad)


def _tensor_info_offset(data: bytes, name: bytes) -> int:
    """Byte offset just after a tensor-info entry's name (where n_dims starts)."""
    at = data.index(struct.pack("<Q", len(name)) + name)
    return at + 8 + len(name)


def test_unknown_ggml_type(qwen_file, tmp_path):
    def mutate(d):
        at = _tensor_info_offset(bytes(d), b"blk.0.attn_q.weight")
        n_dims = struct.unpack_from("<I", d, at)[0]
        struct.pack_into("<I", d, at + 4 + 8 * n_dims, 99)
    bad = _copy(qwen_file[0], tmp_path / "type.gguf", mutate)
    with pytest.raises(WeightError, match="99"):
        GGUFSource(bad)


def test_offset_past_the_end(qwen_file, tmp_path):
    def mutate(d):
        at = _tensor_info_offset(bytes(d), b"blk.0.attn_q.weight")
        n_dims = struct.unpack_from("<I", d, at)[0]
        struct.pack_into("<Q", d, at + 4 + 8 * n_dims + 4, 1 << 40)
    bad = _copy(qwen_file[0], tmp_path / "off.gguf", mutate)
    with pytest.raises(WeightError, match=r"blk\.0\.attn_q\.weight.*past the end"):
        GGUFSource(bad)


def test_paths(tmp_path, qwen_file):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_files(tmp_path / "none.gguf")
    with pytest.raises(FileNotFoundError, match="no .gguf file"):
        gguf_files(tmp_path)
    (tmp_path / "a.gguf").write_bytes(qwen_file[0].read_bytes())
    (tmp_path / "b.gguf").write_bytes(qwen_file[0].read_bytes())
    with pytest.raises(WeightError, match="several models"):
        gguf_files(tmp_path)


def test_incomplete_split_set(tmp_path):
    model = tiny_model("mixtral", layers=1)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), split_max_tensors=4)
    files = sorted(tmp_path.iterdir())
    files[1].unlink()
    with pytest.raises(WeightError, match=f"missing {files[1].name}"):
        gguf_files(files[0])


def test_not_moe_llama_is_refused(tmp_path):
    from ktransformers.weights.gguf_config import config_from_metadata
    with pytest.raises(WeightError, match="dense model"):
        config_from_metadata({"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
                              "llama.attention.head_count": 4}, 100)
    with pytest.raises(WeightError, match="not supported"):
        config_from_metadata({"general.architecture": "gpt2"}, 100)
