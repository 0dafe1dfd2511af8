"""ktransformers.weights.ggml_quants against gguf-py's numpy reference (de)quantizers."""
import warnings

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ktransformers.weights.ggml_quants import (
    FORMATS, GGMLType, dequantize, ggml_type, quantize, random_blocks, tensor_nbytes,
)

DEQUANT_TYPES = [t for t, f in FORMATS.items() if f.dequant is not None]

# Relative RMS error of quantize -> gguf dequantize on N(0, 1) data.
QUANT_BOUNDS = {
    "F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01,
    "Q4_0": 0.11, "Q4_1": 0.1, "Q5_0": 0.055, "Q5_1": 0.05,
    "Q2_K": 0.33, "Q3_K": 0.18, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.025,
    "IQ4_NL": 0.1, "IQ4_XS": 0.1, "MXFP4": 0.15,
}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def reference(blocks: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """gguf-py's dequantization of uint8 [N, B] blocks, as float32 [N, E]."""
    out = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(int(t)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(len(blocks), -1)


def test_type_ids_match_gguf():
    for t in GGMLType:
        assert GGMLQuantizationType[t.name].value == t.value


def test_table_covers_every_type_with_gguf_block_sizes():
    assert set(FORMATS) == set(GGMLType)
    for t, fmt in FORMATS.items():
        assert fmt.type == t
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(t))]
        if t == GGMLType.Q8_1:
            # gguf-py says 4 + 4 + 32; ggml's block_q8_1 is {f16 d, f16 s, int8 qs[32]} = 36 bytes.
            assert (elems, nbytes, fmt.block_bytes) == (32, 40, 36)
            continue
        assert (fmt.block_elems, fmt.block_bytes) == (elems, nbytes), t.name


def test_supported_dequant_types():
    expected = "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4"
    assert {t.name for t in DEQUANT_TYPES} == set(expected.split())


@pytest.mark.parametrize("n_blocks", [1, 7, 64])
@pytest.mark.parametrize("t", DEQUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact_vs_gguf(t, n_blocks):
    fmt = FORMATS[t]
    blocks = random_blocks(t, n_blocks, gen(n_blocks))
    assert blocks.dtype == torch.uint8 and blocks.shape == (n_blocks, fmt.block_bytes)
    ours = dequantize(blocks.reshape(-1), t, (n_blocks * fmt.block_elems,))
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    assert torch.equal(ours.reshape(n_blocks, -1), reference(blocks, t))


def test_mxfp4_every_exponent_and_code_bit_exact_vs_gguf():
    """All 256 exponent bytes (subnormal, huge) with every code pair, against gguf-py."""
    blocks = torch.randint(0, 256, (256 * 4, 17), dtype=torch.uint8, generator=gen(3))
    blocks[:, 0] = torch.arange(256, dtype=torch.uint8).repeat_interleave(4)
    ours = dequantize(blocks.reshape(-1), "MXFP4", (blocks.shape[0] * 32,)).reshape(len(blocks), -1)
    with np.errstate(over="ignore"):  # (gguf-py computes 2^127 * 12 as inf, as ggml does)
        expected = reference(blocks, GGMLType.MXFP4)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_mxfp4_quantize_equals_gguf_bytes(scale):
    x = torch.randn(16, 256, generator=gen(4)) * scale
    x[0, :32] = 0  # an all-zero block
    ours = quantize(x, "MXFP4").numpy()
    theirs = gguf_quants.quantize(x.numpy(), GGMLQuantizationType.MXFP4).reshape(-1)
    assert np.array_equal(ours, theirs)


def test_random_blocks_have_small_scales():
    blocks = random_blocks(GGMLType.Q4_K, 256, gen())
    d = blocks[:, :2].contiguous().view(torch.float16).float().abs()
    assert (d >= 1e-3 * 0.999).all() and (d <= 1e-2 * 1.001).all()
    weights = dequantize(random_blocks(GGMLType.BF16, 1000, gen()), "bf16", (10, 100))
    assert 0.01 < weights.std() < 0.04


def test_dequantize_shapes_dtypes_and_inputs(tmp_path):
    t = GGMLType.Q6_K
    blocks = random_blocks(t, 6, gen())
    expected = reference(blocks, t).reshape(3, 512)
    path = tmp_path / "w.bin"
    blocks.numpy().tofile(path)
    readonly = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable" warning may escape
        from_mmap = dequantize(readonly, t, (3, 512))
        from_view = dequantize(memoryview(blocks.numpy().tobytes()), "Q6_K", [3, 512])
    assert torch.equal(from_mmap, expected) and torch.equal(from_view, expected)
    assert torch.equal(dequantize(blocks, int(t), (3, 512)), expected)  # 2-D tensor is fine too
    half = dequantize(blocks.numpy(), t, (3, 2, 256), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.shape == (3, 2, 256)


def test_dequantize_float_from_readonly_mmap_is_a_copy(tmp_path):
    values = torch.randn(4, 8, generator=gen())
    path = tmp_path / "f.bin"
    values.numpy().tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r")  # a float32 view, as GGUFReader gives
    out = dequantize(mm, "F32", (4, 8))
    assert torch.equal(out, values)
    out += 1  # writable, and not aliasing the read-only map
    assert np.array_equal(np.asarray(mm).reshape(4, 8), values.numpy())


@pytest.mark.parametrize("name", list(QUANT_BOUNDS))
def test_quantize_round_trip_through_gguf(name):
    t = ggml_type(name)
    x = torch.randn(8, 1024, generator=gen(1))
    raw = quantize(x, t)
    assert raw.dtype == torch.uint8 and raw.shape == (tensor_nbytes(t, x.numel()),)
    blocks = raw.reshape(-1, FORMATS[t].block_bytes)
    back = reference(blocks, t).reshape(x.shape)
    err = ((back - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
    assert err <= QUANT_BOUNDS[name], f"{name}: relative RMS error {err:.4f}"
    assert torch.equal(dequantize(raw, t, x.shape), back)


@pytest.mark.parametrize("name", list(QUANT_BOUNDS))
def test_quantize_zeros_and_scaled_rows(name):
    t = ggml_type(name)
    x = torch.zeros(2, 256)
    x[1] = torch.randn(256, generator=gen(2)) * 1e-3  # tiny weights: f16 scales must not flush
    back = dequantize(quantize(x, t), t, x.shape)
    assert torch.equal(back[0], torch.zeros(256))
    assert ((back[1] - x[1]).pow(2).mean().sqrt() / x[1].pow(2).mean().sqrt()).item() <= QUANT_BOUNDS[name] * 1.5


def test_ggml_type_accepts_names_ids_and_enums():
    assert ggml_type("q4_k") is GGMLType.Q4_K
    assert ggml_type(12) is GGMLType.Q4_K
    assert ggml_type(np.int32(30)) is GGMLType.BF16
    assert ggml_type(GGMLQuantizationType.Q6_K) is GGMLType.Q6_K
    for bad in ["Q9_9", 99, 2.0, None]:
        with pytest.raises(ValueError, match="valid types: F32=0, F16=1"):
            ggml_type(bad)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"Q4_K block size \(256\)"):
        tensor_nbytes(GGMLType.Q4_K, 300)
    assert tensor_nbytes("Q4_K", 512) == 288
    good = random_blocks(GGMLType.Q8_0, 2, gen()).reshape(-1)
    with pytest.raises(ValueError, match="expected 68 bytes, got 67"):
        dequantize(good[:-1], "Q8_0", (64,))
    with pytest.raises(ValueError, match="row length 48"):
        dequantize(good[:51], "Q8_0", (1, 48))
    with pytest.raises(ValueError, match="unknown ggml type"):
        dequantize(good, "Q8_9", (64,))
    with pytest.raises(NotImplementedError, match="IQ2_XXS.*supported: F32"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS", (256,))
    with pytest.raises(NotImplementedError, match="Q8_K"):
        quantize(torch.zeros(256), "Q8_K")
    with pytest.raises(ValueError, match="Q6_K block size"):
        quantize(torch.zeros(4, 100), "Q6_K")
    with pytest.raises(NotImplementedError):
        random_blocks("TQ2_0", 1)


def test_group_affine_is_lossless():
    """group_affine (the int4/int8 GEMM's view of a GGUF type: codes * scale + offset per group
    of 32, or of Q6_K's 16) gives back gguf-py's dequantized values exactly."""
    from ktransformers.weights.ggml_quants import GROUP16_TYPES, GROUP_AFFINE_TYPES, group_affine
    for t in GROUP_AFFINE_TYPES + GROUP16_TYPES:
        raw = random_blocks(t, 48, gen(int(t)))
        shape = (6, 48 * FORMATS[t].block_elems // 6)
        codes, scale, offset = group_affine(raw, t, shape)
        group = 16 if t in GROUP16_TYPES else 32
        assert scale.shape == (shape[0], shape[1] // group), t.name
        w = codes.float().reshape(shape[0], -1, group) * scale[..., None]
        if offset is not None:
            w = w + offset[..., None]
        assert torch.equal(w.reshape(shape), reference(raw, t).reshape(shape)), t.name
    codes = group_affine(random_blocks("Q6_K", 4, gen(3)), "Q6_K", (2, 512))[0]
    assert codes.dtype == torch.int8 and -32 <= int(codes.min()) < int(codes.max()) <= 31
    with pytest.raises(ValueError, match="Q5_K has no group-affine form"):
        group_affine(random_blocks("Q5_K", 1), "Q5_K", (1, 256))
    with pytest.raises(ValueError, match="expected 144 bytes"):
        group_affine(random_blocks("Q4_K", 2), "Q4_K", (1, 256))
