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
    theirs = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name),
                                 model.config.num_hidden_layers)
    ours, compared = GGUFNameTable(arch_name), 0
    for name in model.state_dict():
        expected = theirs.get_name(name, try_suffixes=(".weight", ".bias"))
        if expected is None or name.endswith(("kv_b_proj.weight", "in_proj_qkvz.weight", "experts.gate_up_proj")):
            # (split by the converter)
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


def _offset_at(d, name: bytes) -> int:
    """Byte position of a tensor-info entry's data offset."""
    at = _tensor_info_offset(bytes(d), name)
    return at + 4 + 8 * struct.unpack_from("<I", d, at)[0] + 4


def _tensor_names(path) -> list[bytes]:
    return [name.encode() for name in GGUFFileSet(path).tensors]


@pytest.mark.parametrize("change", ["far", "misaligned", "overlapping", "one more tensor"])
def test_data_offsets_form_one_chain(qwen_file, tmp_path, change):
    """Each tensor's data starts where the one before it ends, rounded to the alignment (what
    llama.cpp's loader requires): an offset past the end, off the alignment or over another
    tensor's data, or a tensor count one too high (the first data bytes read as a directory
    entry), is an error naming the file and the tensor, never a model with shifted weights."""
    names = _tensor_names(qwen_file[0])

    def mutate(d):
        if change == "one more tensor":
            struct.pack_into("<Q", d, 8, struct.unpack_from("<Q", d, 8)[0] + 1)
            return
        at = _offset_at(d, names[3])
        new = {"far": 1 << 40, "misaligned": struct.unpack_from("<Q", d, at)[0] + 4,
               "overlapping": struct.unpack_from("<Q", d, _offset_at(d, names[2]))[0]}[change]
        struct.pack_into("<Q", d, at, new)
    bad = _copy(qwen_file[0], tmp_path / "off.gguf", mutate)
    match = r"off\.gguf: .*" + ("" if change == "one more tensor" else f"tensor '{names[3].decode()}' has data offset")
    with pytest.raises(WeightError, match=match):
        GGUFSource(bad)


def test_metadata_string_that_is_not_utf8(qwen_file, tmp_path):
    model = qwen_file[1]
    path = tmp_path / "named.gguf"
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0, extra_metadata={"general.name": "abcdefgh"})

    def mutate(d):
        at = bytes(d).index(b"abcdefgh") + 2
        d[at:at + 2] = b"\xff\xfe"
    bad = _copy(path, tmp_path / "utf8.gguf", mutate)
    with pytest.raises(WeightError, match=r"utf8\.gguf: value of 'general\.name' at byte \d+ is not UTF-8"):
        GGUFSource(bad)


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.attention.layer_norm_rms_epsilon", float("nan"), "expected a finite positive number"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", -1e-6, "expected a finite positive number"),
    ("qwen3moe.rope.freq_base", float("inf"), "expected a finite positive number"),
    ("qwen3moe.block_count", 2**32 - 1, r"expected an integer in \[1, 4096\]"),
    ("qwen3moe.block_count", 3, "the file's tensors are of 2 blocks"),
    ("qwen3moe.embedding_length", 2**31, r"expected an integer in \[1, 1048576\]"),
    ("qwen3moe.embedding_length", 128, "token_embd.weight is"),
    ("qwen3moe.block_count", "two", "expected an integer"),
    ("qwen3moe.expert_used_count", 99, "exceeds qwen3moe.expert_count"),
])
def test_metadata_values_are_checked(qwen_file, tmp_path, key, value, message):
    """Metadata of the wrong type, out of range, or at odds with the tensors is an error naming
    the file and the key before anything is sized by it (a block_count of 2^32 - 1 once reached a
    torch allocation; a NaN epsilon gave NaN logits)."""
    from ktransformers.optimize.skeleton import load_config
    model = qwen_file[1]
    path = tmp_path / "meta.gguf"
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0, extra_metadata={key: value})
    with pytest.raises(WeightError, match=f"meta\\.gguf: .*{message}"):
        load_config(None, path)


def test_expert_groups_must_divide_the_experts(tmp_path):
    from ktransformers.optimize.skeleton import load_config
    model = tiny_model("deepseek_v3", layers=2)
    path = tmp_path / "groups.gguf"
    experts = model.config.n_routed_experts
    write_gguf(path, model.config, model.state_dict(), types=GGMLType.Q8_0,
               extra_metadata={"deepseek2.expert_group_count": experts - 1})
    with pytest.raises(WeightError, match=f"expert_group_count = {experts - 1} does not divide"):
        load_config(None, path)


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


def test_a_file_changed_on_disk_is_an_error(qwen_file, tmp_path):
    """A GGUF rewritten or truncated after it was mapped is an error at the next load, not a
    SIGBUS or weights read from other data."""
    import os
    path = tmp_path / "live.gguf"
    path.write_bytes(qwen_file[0].read_bytes())
    source = GGUFSource(path)
    name = source.keys()[0]
    source.load(name)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(WeightError, match=r"live\.gguf: changed on disk"):
        source.load(name)
    with open(path, "r+b") as f:  # truncated: touching the lost pages would fault
        f.truncate(4096)
    with pytest.raises(WeightError, match=r"live\.gguf: changed on disk since it was opened \(size \d+ -> 4096"):
        source.raw(name)
