"""The C++ CPU kernels against torch references: every format x every ISA level this CPU has x
token counts {1, 3, 17, 128} x shapes with odd expert counts.

Quantized formats take int8 activations (per 32 or per 256 values, as llama.cpp does). Two
references: one that rounds activations the same way (checks the kernel's arithmetic, tight),
and KExpertsTorch's float formula on the dequantized weights (checks the overall error)."""
import os
import zlib

import numpy as np
import pytest
import torch

from ktransformers.kernels.cpu import (
    ACTIVATION_BLOCK,
    BF16_ACTIVATIONS,
    BF16_KERNELS,
    CPURuntime,
    ExpertWeights,
    Int8Rows,
    LinearKernel,
    MoEKernel,
    default_isa,
    round_activations,
    supported_isas,
)
from ktransformers.operators.experts import moe_reference
from ktransformers.weights.ggml_quants import GGMLType, dequantize, quantize

FORMATS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0,
           GGMLType.IQ4_XS, GGMLType.MXFP4,
           GGMLType.BF16, GGMLType.F16]
SHAPES = [(7, 3, 256, 512), (5, 2, 512, 256)]  # E, K, H, I


@pytest.fixture(scope="module", params=supported_isas())
def runtime(request):
    return CPURuntime(threads=2, isa=request.param)


def expert_weights(t: GGMLType, E: int, rows: int, cols: int, gen):
    w = torch.randn(E, rows, cols, generator=gen) * 0.05
    raw = quantize(w, t)
    return ExpertWeights(raw, int(t)), dequantize(raw, t, (E, rows, cols))


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routing(T, E, K, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=gen)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}K{}H{}I{}".format(*s))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda t: t.name)
def test_moe_matches_reference(runtime, fmt, shape):
    E, K, H, I = shape
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}{shape}".encode()))  # same inputs every run
    (g, gd), (u, ud), (d, dd) = (expert_weights(fmt, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=64)
    block = ACTIVATION_BLOCK[int(fmt)]
    gate_up = torch.cat([gd, ud], dim=1)
    for T in (1, 3, 17, 128):  # 128 > max_tokens: the kernel works in chunks
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        y = kernel.forward(x, ids, w)
        same_rounding = moe_reference(x, ids, w, gate_up, dd, lambda t: round_activations(t, block),
                                      lambda t: round_activations(t, block))
        # h is rounded from g, u computed in another order, so a rare one-step flip differs, and the
        # k-quants' min terms cancel in float32 (worst seen over 12 seeds: 2.7e-3, Q5_K); the
        # activation rounding itself is 1-2.5e-2, so a real arithmetic error would not hide here
        assert rel_err(y, same_rounding) < 5e-3, (fmt.name, T, runtime.isa)
        float_ref = moe_reference(x, ids, w, gate_up, dd)
        # int8 activations: 1-2.5e-2 from the rounding; bf16 ones: ~3e-3
        limit = {None: 1e-5, BF16_ACTIVATIONS: 1e-2}.get(block, 3e-2)
        assert rel_err(y, float_ref) < limit, (fmt.name, T, runtime.isa)


@pytest.mark.parametrize("fmt", [GGMLType.MXFP4, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_moe_biases_and_clamped_swiglu(runtime, fmt):
    """gpt-oss's experts: a bias on each projection and the clamped SwiGLU (limit 7, alpha 1.702),
    with inputs large enough that the clamps bite; the int8 prefill copies too."""
    from ktransformers.operators.experts.reference import Activation
    E, K, H, I = 6, 2, 256, 256
    gen = torch.Generator().manual_seed(zlib.crc32(fmt.name.encode()))
    (g, gd), (u, ud), (d, dd) = (expert_weights(fmt, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    biases = (torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen), torch.randn(E, H, generator=gen))
    act = Activation(7.0, 1.702)
    block = ACTIVATION_BLOCK[int(fmt)]
    gate_up = torch.cat([gd, ud], dim=1)
    copies = tuple(Int8Rows.from_blocks(w, shape) for w, shape in zip((g, u, d), ((E, I, H), (E, I, H), (E, H, I))))
    kernels = [MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=64,
                         biases=biases, swiglu_limit=act.limit, swiglu_alpha=act.alpha),
               MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                         max_tokens=64, biases=biases, swiglu_limit=act.limit, swiglu_alpha=act.alpha,
                         int8=copies, int8_min_tokens=2)]
    for T in (1, 3, 17, 128):
        x = torch.randn(T, H, generator=gen) * 8  # pre-activations past +-7
        ids, w = routing(T, E, K, gen)
        ref = moe_reference(x, ids, w, gate_up, dd, act=act, bias=(torch.cat(biases[:2], dim=1), biases[2]))
        plain = moe_reference(x, ids, w, gate_up, dd, bias=(torch.cat(biases[:2], dim=1), biases[2]))
        assert rel_err(plain, ref) > 0.1  # the clamps and alpha change the result
        for kernel in kernels:
            assert rel_err(kernel.forward(x, ids, w), ref) < 3e-2, (fmt.name, T, runtime.isa, kernel.int8_min_tokens)
    kernels[0].forward(x, ids, w)
    with pytest.raises(ValueError, match="the down bias must be"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                  biases=(biases[0], biases[1], torch.randn(E, H + 32)))


def test_mixed_formats_and_bf16_activations(runtime):
    """Q4_K_M files mix types: gate/up Q4_K, down Q6_K; activations may be bf16."""
    E, K, H, I = 9, 4, 512, 256
    gen = torch.Generator().manual_seed(7)
    (g, gd), (u, ud) = expert_weights(GGMLType.Q4_K, E, I, H, gen), expert_weights(GGMLType.Q5_K, E, I, H, gen)
    d, dd = expert_weights(GGMLType.Q6_K, E, H, I, gen)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
    x = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    ids, w = routing(5, E, K, gen)
    y = kernel.forward(x, ids, w)
    assert y.dtype == torch.bfloat16
    ref = moe_reference(x.float(), ids, w, torch.cat([gd, ud], dim=1), dd,
                        lambda t: round_activations(t, 256), lambda t: round_activations(t, 256))
    assert rel_err(y, ref) < 1e-2  # bf16 output rounding


def test_submit_then_sync_overlaps_python(runtime):
    E, K, H, I = 4, 2, 256, 256
    gen = torch.Generator().manual_seed(3)
    (g, gd), (u, ud), (d, dd) = (expert_weights(GGMLType.Q8_0, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
    xs = [torch.randn(3, H, generator=gen) for _ in range(3)]
    routes = [routing(3, E, K, gen) for _ in range(3)]
    outs = [kernel.submit(x, *r) for x, r in zip(xs, routes)]  # queued, run in order
    runtime.sync()
    for x, (ids, w), y in zip(xs, routes, outs):
        assert torch.equal(y, kernel.forward(x, ids, w))


@pytest.mark.parametrize("fmt", [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_0,
                                 GGMLType.MXFP4, GGMLType.BF16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 7, 40])
def test_linear_matches_reference(runtime, fmt, T):
    gen = torch.Generator().manual_seed(T)
    w = torch.randn(96, 512, generator=gen) * 0.05
    raw = quantize(w, fmt)
    wd = dequantize(raw, fmt, (96, 512))
    lin = LinearKernel(runtime, in_features=512, out_features=96, weight=ExpertWeights(raw, int(fmt)), max_tokens=16)
    x = torch.randn(T, 512, generator=gen)
    block = ACTIVATION_BLOCK[int(fmt)]
    assert rel_err(lin.forward(x), round_activations(x, block) @ wd.T) < 1e-4


@pytest.mark.parametrize("fmt", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS,
                                 GGMLType.MXFP4, GGMLType.BF16, GGMLType.F16],
                         ids=lambda t: t.name)
def test_linear_rows_together_equal_rows_alone(runtime, fmt):
    """Several tokens go through the formats' four-row dot products; each token's output is
    bit-identical to computing that token alone (same integer sums, same float steps)."""
    gen = torch.Generator().manual_seed(11)
    raw = quantize(torch.randn(80, 512, generator=gen) * 0.05, fmt)
    lin = LinearKernel(runtime, in_features=512, out_features=80, weight=ExpertWeights(raw, int(fmt)), max_tokens=16)
    x = torch.randn(9, 512, generator=gen)
    together = lin.forward(x)
    alone = torch.cat([lin.forward(x[i:i + 1]) for i in range(9)])
    if fmt == GGMLType.BF16 and runtime.bf16_kernel == "amx":
        # AMX-BF16 tiles take calls of >= 4 tokens, and add the same exact products in another order
        assert rel_err(together, alone) < 1e-6
    else:
        assert torch.equal(together, alone)


@pytest.mark.parametrize("fmt", [GGMLType.BF16, GGMLType.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("K", [8, 200, 216, 520])
@pytest.mark.parametrize("T", [1, 3, 6])
def test_16bit_linear_any_width(runtime, fmt, K, T):
    """16-bit rows of any width and count: the vector steps and the tail meet the float64 product
    of the same weights (and, for BF16, of the activations rounded to bf16 as the kernel takes
    them), for every block of up to 4 rows x 4 tokens (37 rows: blocks of 4 and 1; 3 and 6
    tokens: blocks of 3, 4 and 2)."""
    gen = torch.Generator().manual_seed(K + T)
    w = (torch.randn(37, K, generator=gen) * 0.05).to(torch.bfloat16 if fmt == GGMLType.BF16 else torch.float16)
    lin = LinearKernel(runtime, in_features=K, out_features=37,
                       weight=ExpertWeights(w.view(torch.uint8).reshape(-1), int(fmt)), max_tokens=8)
    x = torch.randn(T, K, generator=gen)
    ref = round_activations(x, ACTIVATION_BLOCK[int(fmt)]).double() @ w.double().T
    assert rel_err(lin.forward(x), ref) < 1e-6


def _nibble_tiles(values: torch.Tensor) -> torch.Tensor:
    """[G, nb, 16 rows, 256] values -> the tiles' 32 x 64 nibble bytes: byte 4r + i of step 4j + q
    holds values 32j + 4q + i (low nibble) and 32j + 16 + 4q + i (high) of row r."""
    v = (values & 15).reshape(*values.shape[:3], 8, 2, 4, 4)
    return (v[..., 0, :, :] | v[..., 1, :, :] << 4).permute(0, 1, 3, 4, 2, 5).reshape(*values.shape[:2], 2048)


def q4_k_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row Q4_K tile layout (csrc/blocks.h tile_q4_k16), rearranged with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 256, 144).transpose(1, 2)
    G, nb = blocks.shape[:2]
    d, dmin = blocks[..., 0:2].reshape(G, nb, 32), blocks[..., 2:4].reshape(G, nb, 32)
    sc = blocks[..., 4:16].reshape(G, nb, 16, 3, 4).transpose(2, 3).reshape(G, nb, 192)
    qs = blocks[..., 16:].reshape(G, nb, 16, 4, 32)
    values = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(G, nb, 16, 256)
    return torch.cat([d, dmin, sc, _nibble_tiles(values)], dim=-1).reshape(-1)


def q6_k_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row Q6_K tile layout (csrc/blocks.h tile_q6_k16), rearranged with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 256, 210).transpose(1, 2)
    G, nb = blocks.shape[:2]
    ql = blocks[..., :128].reshape(G, nb, 16, 2, 2, 32)  # [half, k % 2, l]
    qh = blocks[..., 128:192].reshape(G, nb, 16, 2, 32)
    low = torch.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=-2)
    high = torch.stack([(qh >> (2 * k)) & 3 for k in range(4)], dim=-2)
    values = (low | high << 4).reshape(G, nb, 16, 256)  # value 128 half + 32 k + l, 0..63
    d = blocks[..., 208:210].reshape(G, nb, 32)
    ql_tiles = _nibble_tiles(values).reshape(G, nb, 4, 2, 4 * 64)  # [part, j's half s, 4 q x 64]
    hb = (values >> 4).reshape(G, nb, 16, 8, 2, 2, 2, 4)  # [r, j, +16, h, +4, i]
    qh_tiles = hb[..., 0, :, 0, :] | hb[..., 1, :, 0, :] << 2 | hb[..., 0, :, 1, :] << 4 | hb[..., 1, :, 1, :] << 6
    qh_tiles = qh_tiles.permute(0, 1, 3, 4, 2, 5).reshape(G, nb, 4, 2, 2 * 64)  # [j, h, r, i]
    sc = blocks[..., 192:208].reshape(G, nb, 16, 8, 2).transpose(2, 3).reshape(G, nb, 4, 64)  # [j, r, 2]
    halves = torch.cat([qh_tiles, ql_tiles], dim=-1).reshape(G, nb, 4, 2 * 384)  # each s: qh[0..1], ql[0..3]
    parts = torch.cat([sc, halves], dim=-1).reshape(G, nb, 4 * 832)
    return torch.cat([parts, d], dim=-1).reshape(-1)


def q5_k_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row Q5_K tile layout (csrc/blocks.h tile_q5_k16), rearranged with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 256, 176).transpose(1, 2)
    G, nb = blocks.shape[:2]
    d, dmin = blocks[..., 0:2].reshape(G, nb, 32), blocks[..., 2:4].reshape(G, nb, 32)
    sc = blocks[..., 4:16].reshape(G, nb, 16, 3, 4).transpose(2, 3).reshape(G, nb, 192)
    qh = blocks[..., 16:48]
    qs = blocks[..., 48:].reshape(G, nb, 16, 4, 32)
    values = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(G, nb, 16, 256)
    fifth = torch.stack([(qh >> j) & 1 for j in range(8)], dim=-2).reshape(G, nb, 16, 8, 2, 4, 4)  # [r, j, +16, q, i]
    qh_tiles = sum(fifth[..., 0, q, :] << q | fifth[..., 1, q, :] << (4 + q) for q in range(4))  # [r, j, i]
    qh_tiles = qh_tiles.permute(0, 1, 3, 2, 4).reshape(G, nb, 8, 64)
    parts = torch.cat([qh_tiles, _nibble_tiles(values).reshape(G, nb, 8, 256)], dim=-1).reshape(G, nb, 2560)
    return torch.cat([d, dmin, sc, parts], dim=-1).reshape(-1)


def iq4_xs_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row IQ4_XS tile layout (csrc/blocks.h tile_iq4_xs16), rearranged with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 256, 136).transpose(1, 2)
    G, nb = blocks.shape[:2]
    d, sh, sl = (blocks[..., a:b].reshape(G, nb, 16 * (b - a)) for a, b in ((0, 2), (2, 4), (4, 8)))
    qs = blocks[..., 8:].reshape(G, nb, 16, 32, 4).transpose(2, 3).reshape(G, nb, 2048)
    return torch.cat([d, sh, sl, qs], dim=-1).reshape(-1)


def q8_0_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row Q8_0 tile layout (csrc/blocks.h tile_q8_0x16, two blocks a tile), with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 64, 2, 34).permute(0, 2, 3, 1, 4)
    G, nt = blocks.shape[:2]  # [G, tile, h, r, 34]
    qs = blocks[..., 2:].reshape(G, nt, 2, 16, 8, 4).permute(0, 1, 2, 4, 3, 5).reshape(G, nt, 1024)
    d = blocks[..., :2].reshape(G, nt, 64)
    return torch.cat([d, qs], dim=-1).reshape(-1)


def mxfp4_tiles_reference(raw, rows: int, cols: int) -> torch.Tensor:
    """The 16-row MXFP4 tile layout (csrc/blocks.h tile_mxfp4x16, one block a tile), with torch alone."""
    blocks = torch.as_tensor(raw).view(torch.uint8).reshape(rows // 16, 16, cols // 32, 17).transpose(1, 2)
    G, nb = blocks.shape[:2]  # [G, tile, r, 17]
    qs = blocks[..., 1:].reshape(G, nb, 16, 4, 4).transpose(2, 3).reshape(G, nb, 256)
    return torch.cat([blocks[..., 0], qs], dim=-1).reshape(-1)


TILE_REFERENCES = {GGMLType.Q4_K: q4_k_tiles_reference, GGMLType.Q5_K: q5_k_tiles_reference,
                   GGMLType.Q6_K: q6_k_tiles_reference, GGMLType.IQ4_XS: iq4_xs_tiles_reference,
                   GGMLType.Q8_0: q8_0_tiles_reference, GGMLType.MXFP4: mxfp4_tiles_reference}


@pytest.mark.parametrize("fmt", list(TILE_REFERENCES), ids=lambda t: t.name)
def test_tiles_layout_and_kernel(runtime, fmt):
    """The repack gives the layout the torch reference builds; the tiled kernel (four tokens at a
    time, then 3, 2, 1) gives what the row kernel gives on the same rounded activations."""
    from ktransformers.kernels.cpu import tile_weights
    assert runtime.ext.has_tiles(int(fmt)), (runtime.isa, fmt.name)  # every level tiles every one of these formats
    gen = torch.Generator().manual_seed(5)
    E, K, H, I = 7, 3, 512, 256
    (g, gd), (u, ud), (d, dd) = (expert_weights(fmt, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    for w, rows, cols in ((g, E * I, H), (d, E * H, I)):
        tiled = tile_weights(runtime, w, rows, cols)
        assert tiled.tiled and torch.equal(tiled.data, TILE_REFERENCES[fmt](w.data, rows, cols))
    with_tiles = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=64)
    rows = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=64, tiles=False)
    assert all(w.tiled for w in with_tiles._weights) and not any(w.tiled for w in rows._weights)
    # Q8_0 sums per 32 values in float, in another order than its row kernel, and the AVX2 tiles
    # scale each row's exact integer sum once where its row kernel scales eight lanes: h (rounded
    # to int8 for down) can flip a step, ~1e-4 of a layer; AVX512's K-quant float steps match the rows'
    moe_tol = 1e-3 if fmt in (GGMLType.Q8_0, GGMLType.MXFP4) or runtime.isa in ("avx2", "avxvnni") else 1e-6
    for T in (1, 2, 3, 5, 17, 128):
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        assert rel_err(with_tiles.forward(x, ids, w), rows.forward(x, ids, w)) < moe_tol, T
    row_bytes = H // 256 * {GGMLType.Q4_K: 144, GGMLType.Q5_K: 176, GGMLType.Q6_K: 210, GGMLType.IQ4_XS: 136,
                             GGMLType.Q8_0: 272, GGMLType.MXFP4: 136}[fmt]
    lin = LinearKernel(runtime, in_features=H, out_features=96, weight=ExpertWeights(g.data[: 96 * row_bytes], int(fmt)))
    x = torch.randn(9, H, generator=gen)
    assert lin._weight.tiled
    assert rel_err(lin.forward(x), round_activations(x, ACTIVATION_BLOCK[int(fmt)]) @ gd.reshape(-1, H)[:96].T) < 1e-4
    assert torch.equal(lin.forward(x), torch.cat([lin.forward(x[i:i + 1]) for i in range(9)]))  # each token alone
    lin_rows = LinearKernel(runtime, in_features=H, out_features=96, weight=ExpertWeights(g.data[: 96 * row_bytes], int(fmt)),
                            tiles=False)
    for m in (2, 3, 9):  # the tiled kernels for 2 and 3 tokens at once; 9 = 4 + 4 + 1
        assert rel_err(lin.forward(x[:m]), lin_rows.forward(x[:m])) < 1e-6, m  # no rounding between: the arithmetic alone
    with pytest.raises(ValueError, match="rows % 16 == 0"):
        runtime._rt.repack_tiles(int(fmt), g.data.data_ptr(), 8 * row_bytes, 0, 8 * row_bytes, 8, H)
    with pytest.raises(ValueError, match="bytes; got source"):
        runtime._rt.repack_tiles(int(fmt), g.data.data_ptr(), 100, 0, 100, 16, H)
    with pytest.raises(ValueError, match="no tiled layout"):
        runtime._rt.repack_tiles(int(GGMLType.Q4_0), 0, 0, 0, 0, 16, H)
    with pytest.raises(ValueError, match="needs the GGUF's rows"):
        Int8Rows.from_blocks(tiled, (E, H, I))


def test_mxfp4_tiles_every_scale_exponent(runtime):
    """Rows whose blocks carry e8m0 exponents 0 (subnormal scales) to 135: the tiled kernel's scales
    against the dequantized weights, row by row (tokens scaled so that every row's sum is a normal
    float; the scales are powers of two, so only the sums round)."""
    gen = torch.Generator().manual_seed(11)
    rows, H = 144, 256
    raw = quantize(torch.randn(rows, H, generator=gen), GGMLType.MXFP4).view(torch.uint8).reshape(rows, H // 32, 17).clone()
    raw[:, :, 0] = (torch.arange(rows) % 136).to(torch.uint8)[:, None]
    weights = dequantize(raw.reshape(-1), GGMLType.MXFP4, (rows, H)).double()
    assert (weights[0] != 0).any() and weights[0].abs().max() < 1e-37  # row 0: subnormal, not flushed
    lin = LinearKernel(runtime, in_features=H, out_features=rows, weight=ExpertWeights(raw.reshape(-1), int(GGMLType.MXFP4)))
    assert lin._weight.tiled
    x = torch.randn(5, H, generator=gen) * 1e28
    y = lin.forward(x).double()
    ref = round_activations(x, ACTIVATION_BLOCK[int(GGMLType.MXFP4)]).double() @ weights.T
    err = (y - ref).abs().amax(0) / ref.abs().amax(0)
    assert torch.isfinite(y).all() and (err < 1e-5).all(), (runtime.isa, err.argmax().item(), err.max().item())


def test_experts_whose_rows_are_not_whole_tile_groups(runtime):
    """I = 24: 16-row groups would straddle experts, so gate/up stay rows (E * I is a multiple of
    16, a tiling of the whole stack would be wrong); the layer still computes what it should."""
    E, K, H, I = 8, 2, 256, 24
    gen = torch.Generator().manual_seed(9)
    (g, gd), (u, ud) = (expert_weights(GGMLType.Q4_K, E, I, H, gen) for _ in range(2))
    d, dd = expert_weights(GGMLType.BF16, E, H, I, gen)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
    assert not kernel._weights[0].tiled and not kernel._weights[1].tiled
    x = torch.randn(5, H, generator=gen)
    ids, w = routing(5, E, K, gen)
    ref = moe_reference(x, ids, w, torch.cat([gd, ud], dim=1), dd, lambda t: round_activations(t, 256))
    assert rel_err(kernel.forward(x, ids, w), ref) < 5e-3


def test_bad_input_raises_before_touching_memory(runtime):
    E, K, H, I = 4, 2, 256, 256
    gen = torch.Generator().manual_seed(1)
    (g, _), (u, _), (d, _) = (expert_weights(GGMLType.Q8_0, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
    x, w = torch.randn(2, H), torch.rand(2, K)
    with pytest.raises(ValueError, match=r"expert id 4 at position 1 is outside \[0, 4\)"):
        kernel.forward(x, torch.tensor([[0, 4], [1, 2]]), w)
    with pytest.raises(ValueError, match=r"expert id -2 at position 3"):
        kernel.submit(x, torch.tensor([[0, 1], [2, -2]]), w)  # checked before the job is queued
    # -1 skips a pair (its expert runs elsewhere, e.g. on the GPU): as if its weight were 0
    skipped = kernel.forward(x, torch.tensor([[0, 1], [2, -1]]), w)
    assert torch.equal(skipped, kernel.forward(x, torch.tensor([[0, 1], [2, 3]]), w * torch.tensor([[1.0, 1], [1, 0]])))
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        kernel.forward(x, torch.tensor([[0, 1]]), w[:1])
    with pytest.raises(ValueError, match=r"x must be a CPU tensor \[T, 256\]"):
        kernel.forward(torch.randn(2, 128), torch.tensor([[0, 1], [1, 2]]), w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.forward(x.half(), torch.tensor([[0, 1], [1, 2]]), w)
    with pytest.raises(ValueError, match="integer"):
        kernel.forward(x, torch.ones(2, 2), w)
    with pytest.raises(ValueError, match="gate holds .* bytes, expected"):  # C++ checks sizes too
        MoEKernel(runtime, experts=E + 1, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d)
    with pytest.raises(ValueError, match="not computed on here; supported"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=ExpertWeights(g.data, 16), up=u, down=d)
    with pytest.raises(ValueError, match="not a whole number of Q8_0 blocks"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H + 16, intermediate=I, gate=g, up=u, down=d)


def test_moe_one_region_matches_phases():
    """Decode-sized calls run gate/up, activation and down as one parallel region, whose down tasks
    wait for their expert's last gate/up chunk; prefill-sized ones as three regions with barriers.
    Both meet the reference, give the same bits at any thread count (also more threads than cores:
    waiting threads descheduled) and with skipped pairs, and a token computed alone (one region)
    gives the bits it gets inside a prefill-sized call (phases)."""
    gen = torch.Generator().manual_seed(21)
    E, K, H, I = 9, 3, 512, 256
    (g, gd), (u, ud) = expert_weights(GGMLType.Q4_K, E, I, H, gen), expert_weights(GGMLType.Q4_K, E, I, H, gen)
    d, dd = expert_weights(GGMLType.Q6_K, E, H, I, gen)
    cases = []
    for T in (1, 2, 5, 33, 3):
        ids, w = routing(T, E, K, gen)
        if T == 5:
            ids[1, 0] = -1  # computed elsewhere (GPU experts)
        if T == 3:
            ids[:] = -1  # every pair elsewhere: no expert active
        cases.append((torch.randn(T, H, generator=gen), ids, w))
    outs, regions = {}, {}
    for threads in (1, 2, 7):
        kernel = MoEKernel(CPURuntime(threads), experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                           max_tokens=16)
        outs[threads] = [kernel.forward(x, ids, w) for x, ids, w in cases]
        x, ids, w = cases[3]
        alone = torch.cat([kernel.forward(x[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(16)])
        assert torch.equal(alone, outs[threads][3][:16]), threads
        regions[threads] = kernel._moe.one_region_calls
    # the one region ran for the decode-sized calls (T 1, 2, 5, the last 1-token chunk of T=33 and
    # the empty T=3; T=33's two 16-token chunks have ~5 tokens an expert: phases), then for each of
    # the 16 tokens alone
    assert all(n == 5 + 16 for n in regions.values()), regions
    base = outs[1]
    for threads, ys in outs.items():
        assert all(torch.equal(y, b) for y, b in zip(ys, base)), threads
    for (x, ids, w), y in zip(cases, base):
        if bool((ids < 0).all()):  # every pair skipped
            assert torch.equal(y, torch.zeros_like(y))
            continue
        skipped = ids < 0  # (the reference takes them as expert 0 at weight 0)
        ref = moe_reference(x, ids.clamp(min=0), torch.where(skipped, 0.0, w), torch.cat([gd, ud], dim=1), dd,
                            lambda t: round_activations(t, 256), lambda t: round_activations(t, 256))
        assert rel_err(y, ref) < 5e-3, x.shape[0]


@pytest.mark.parametrize("max_tokens", [16, 64])
def test_moe_counts_the_experts_it_reads(max_tokens):
    """experts_read sums, over calls and their max_tokens chunks, the distinct experts each chunk
    routes to (skipped pairs read nothing), and expert_bytes is one expert's stored gate, up and
    down rows: together the bytes the serving benchmark's floor charges to the CPU."""
    from gguf import GGML_QUANT_SIZES
    gen = torch.Generator().manual_seed(22)
    E, K, H, I = 12, 4, 256, 256
    g, u = (expert_weights(GGMLType.Q4_K, E, I, H, gen)[0] for _ in range(2))
    d = expert_weights(GGMLType.Q6_K, E, H, I, gen)[0]
    kernel = MoEKernel(CPURuntime(2), experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                       max_tokens=max_tokens)
    def nbytes(t, values):
        block, size = GGML_QUANT_SIZES[t]
        return values // block * size
    assert kernel.expert_bytes == 2 * nbytes(GGMLType.Q4_K, I * H) + nbytes(GGMLType.Q6_K, H * I)
    expected = 0
    for T in (1, 3, 7, 40, 2, 100):
        ids, w = routing(T, E, K, gen)
        ids[torch.rand(T, K, generator=gen) < 0.2] = -1  # computed elsewhere
        kernel.forward(torch.randn(T, H, generator=gen), ids, w)
        for start in range(0, T, max_tokens):
            chunk = ids[start:start + max_tokens]
            expected += torch.unique(chunk[chunk >= 0]).numel()
        assert kernel.experts_read == expected, T


@pytest.mark.parametrize("isa", supported_isas())
def test_bf16_kernels_agree(isa):
    """BF16 weights: the AMX-BF16 tiles (blocks of 16 rows x 16 tokens, from 4 tokens), the
    AVX512-BF16 dot products and the widening kernel each meet the float64 formula on the same
    bf16-rounded activations, wherever this CPU runs them (CPURuntime's bf16_kernel: the best allowed):
    token counts below and above the AMX threshold, 16-token blocks part full, more tokens than
    one packed B buffer (64), rows that end inside a 16-row block, a width that is no multiple of
    32 (the AMX path refuses it: the dot products take all)."""
    gen = torch.Generator().manual_seed(29)
    E, K = 5, 3
    seen = set()
    for H, I in ((512, 320), (544, 200)):
        (g, gd), (u, ud), (d, dd) = (expert_weights(GGMLType.BF16, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
        gate_up = torch.cat([gd, ud], dim=1)
        for kernels in ("widen", "dot", "amx"):
            rt = CPURuntime(2, isa=isa, bf16_kernel=kernels)
            ran = rt.bf16_kernel
            assert BF16_KERNELS.index(ran) <= BF16_KERNELS.index(kernels), (kernels, ran)
            seen.add(ran)
            kernel = MoEKernel(rt, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=128)
            for T in (1, 3, 4, 21, 70):  # 70 tokens: one expert gets > 64 of them, two B buffers
                x = torch.randn(T, H, generator=gen)
                ids, w = routing(T, E, K, gen)
                y = kernel.forward(x, ids, w)
                bf16 = lambda t: round_activations(t, BF16_ACTIVATIONS)
                want = moe_reference(x.double(), ids, w.double(), gate_up.double(), dd.double(), bf16, bf16)
                # the products are exact; float32 sums, and h rounded to bf16 (a rare flip of one step)
                assert rel_err(y, want) < 2e-4, (isa, kernels, ran, H, I, T)
            lin = LinearKernel(rt, in_features=H, out_features=I, weight=ExpertWeights(g.data[: I * H * 2], int(GGMLType.BF16)),
                               max_tokens=80)
            for T in (1, 9, 80):  # 9 and 80 tokens: chunks of >= 64 rows, AMX tiles where they run
                x = torch.randn(T, H, generator=gen)
                want = round_activations(x, BF16_ACTIVATIONS).double() @ gd[0].double().T
                assert rel_err(lin.forward(x), want) < 1e-6, (isa, kernels, H, I, T)
    assert "widen" in seen
    with pytest.raises(ValueError, match="bf16_kernel='tiles'"):
        CPURuntime(1, isa=isa, bf16_kernel="tiles")
    if isa == "amx":
        assert "amx" in seen, "the amx build ran no AMX-BF16 tiles"


def test_isa_override(monkeypatch):
    have = supported_isas()
    assert have and have[-1] == "avx2"
    monkeypatch.delenv("KT_CPU_ISA", raising=False)
    assert default_isa() == have[0]
    monkeypatch.setenv("KT_CPU_ISA", " ")
    assert default_isa() == have[0]
    for isa in have:
        monkeypatch.setenv("KT_CPU_ISA", isa)
        assert default_isa() == isa and CPURuntime(1).isa == isa
    monkeypatch.setenv("KT_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="valid values are amx, avx512, avxvnni, avx2"):
        default_isa()
    if "amx" not in have:
        monkeypatch.setenv("KT_CPU_ISA", "amx")
        with pytest.raises(ValueError, match="supports only"):
            default_isa()


def disassemble(path: str, *flags: str) -> str:
    """objdump -d of a built module (binutils: where the extension was compiled, it is there)."""
    import shutil
    import subprocess
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) not installed: a prebuilt extension's instructions cannot be read")
    return subprocess.run(["objdump", "-d", *flags, path], capture_output=True, text=True, check=True).stdout


def test_avx2_builds_have_no_avx512_instructions():
    """One build must run on any AVX2 CPU: its module may not contain a single zmm register nor
    vpdpbusd; the avxvnni build neither zmm registers nor an EVEX-encoded instruction (its
    vpdpbusd is AVX-VNNI's, VEX-encoded: `{vex}` in objdump's listing)."""
    import re

    from ktransformers.kernels import _cpu_avx2, _cpu_avxvnni
    listing = disassemble(_cpu_avx2.__file__)
    assert "zmm" not in listing and "vpdpbusd" not in listing
    listing = disassemble(_cpu_avxvnni.__file__)
    assert "zmm" not in listing and re.search(r"%k[0-7]\b", listing) is None  # (no opmask registers either)
    dpbusd = [line for line in listing.splitlines() if "vpdpbusd" in line]
    assert dpbusd and all("{vex}" in line for line in dpbusd), dpbusd[:3]


def test_tiled_kernels_prefetch():
    """Every tiled kernel of every build on disk issues its software prefetches: GCC once deleted
    _mm_prefetch from all of them without a word, and a one-token call then waits on memory. A
    function of the tile kernels (tile_*_rows, or tiles_* with the T=1 kernel inlined) that
    computes (dpbusd or maddubs) must hold a prefetch instruction."""
    import glob
    import re

    from ktransformers import kernels
    modules = glob.glob(os.path.join(os.path.dirname(kernels.__file__), "_cpu_*.so"))
    assert modules, "no built CPU extension found"
    for path in modules:
        checked = 0
        for body in re.split(r"\n(?=[0-9a-f]+ <)", disassemble(path, "-C", "--no-show-raw-insn")):
            name = body.split(">:", 1)[0]
            if not re.search(r"::tiles?_[a-z0-9_]+(rows)?[<(]", name) or not re.search(r"vpdpbusd|vpmaddubsw", body):
                continue
            checked += 1
            assert re.search(r"prefetch(t0|t1|t2|nta)", body), f"{os.path.basename(path)}: {name} has no prefetch"
        assert checked >= 4, f"{os.path.basename(path)}: only {checked} tiled kernels found"


def test_every_level_has_the_int8_gemm(runtime):
    """The int8 GEMM (prefill copies, the training backward) is built at every ISA level; on VNNI
    (or AMX) everywhere but AVX2, whose vpmaddubsw GEMM serves the backward only."""
    assert runtime.ext.int8_gemm
    assert runtime.ext.int8_gemm_vnni == (runtime.isa != "avx2")


@pytest.mark.parametrize("fmt, H, I", [(GGMLType.Q4_K, 512, 256), (GGMLType.Q8_0, 576, 320)],
                         ids=["Q4_K", "Q8_0-odd-row-chunks"])
def test_int8_prefill_path(runtime, fmt, H, I):
    """Experts with enough tokens use the int8 copies (per-row weight and activation scales);
    the others, the GGML blocks. With min tokens 1 every expert takes the int8 path. (320 rows
    split over tasks leave chunks of 4k+3 rows: the GEMM's 2- and 1-row tails run. On AMX the
    48- to 96-row chunks take two and one 16-row blocks a step, and experts of 45 and 60 tokens
    two 32-token groups, the last of one or two 16-token tiles.)"""
    from ktransformers.kernels.cpu import Int8Rows, round_activations_rows
    E, K = 6, 2
    gen = torch.Generator().manual_seed(11)
    (g, gd), (u, ud), (d, dd) = (expert_weights(fmt, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    int8 = tuple(Int8Rows.from_dense(w) for w in (gd, ud, dd))
    from_bytes = Int8Rows.from_blocks(g, (E, I, H))  # what KExpertsCPU builds from the mapped blocks
    assert torch.equal(from_bytes.w, int8[0].w) and torch.equal(from_bytes.scale, int8[0].scale)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                       int8=int8, int8_min_tokens=1, max_tokens=64)
    assert kernel.int8_min_tokens == 1
    if runtime.isa == "amx":  # the AMX tiles take the whole 16-row blocks, AVX-512 the edges
        assert runtime.ext.amx_available() and kernel._int8[0].amx is not None
    for T in (1, 5, 70, 45, 60):
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        if T in (45, 60):  # every token to experts 0 and 1: 45 or 60 tokens an expert, in groups of up to
            ids = torch.stack([torch.randperm(2, generator=gen) for _ in range(T)])  # 32 (AMX: 32 + 13, 32 + 28)
        y = kernel.forward(x, ids, w)
        gate_up8 = torch.cat([int8[0].dequantized(), int8[1].dequantized()], dim=1)
        same = moe_reference(x, ids, w, gate_up8, int8[2].dequantized(), round_activations_rows, round_activations_rows)
        assert rel_err(y, same) < 1e-3, T
        assert rel_err(y, moe_reference(x, ids, w, torch.cat([gd, ud], dim=1), dd)) < 5e-2, T
    mixed = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                      int8=int8, int8_min_tokens=8)
    x = torch.randn(40, H, generator=gen)
    ids, w = routing(40, E, K, gen)
    assert rel_err(mixed.forward(x, ids, w), moe_reference(x, ids, w, torch.cat([gd, ud], dim=1), dd)) < 5e-2


def test_int8_copies_as_amx_tiles_alone(runtime):
    """pack_amx keeps an int8 copy as its AMX tiles alone, in place of the rows (half the RAM):
    they unpack to the same rows and scales, and count once in the bytes a call reads. On an AMX
    machine a kernel computes on them as on the rows; elsewhere it refuses them by name."""
    from ktransformers.kernels.cpu import Int8Rows, _copy_bytes, round_activations_rows
    E, H, I, K = 4, 192, 128, 2
    gen = torch.Generator().manual_seed(17)
    dense = (torch.randn(E, I, H, generator=gen), torch.randn(E, I, H, generator=gen), torch.randn(E, H, I, generator=gen))
    rows = tuple(Int8Rows.from_dense(w) for w in dense)
    tiles = tuple(r.pack_amx() for r in rows)
    for r, t in zip(rows, tiles):
        assert t.w is None and t.amx is not None and t.shape == r.shape
        assert torch.equal(t.rows(), r.w) and torch.equal(t.dequantized(), r.dequantized())
        assert _copy_bytes(t) == _copy_bytes(r) and t.pack_amx() is t
    odd = Int8Rows.from_dense(torch.randn(2, 24, 64, generator=gen))  # (no whole 16-row blocks: kept as rows)
    assert odd.pack_amx() is odd
    with pytest.raises(ValueError, match="rows w or their AMX tiles"):
        Int8Rows(None, rows[0].scale, rows[0].row_sum)
    make = lambda: MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=None, up=None, down=None,
                             int8=tiles, int8_min_tokens=1, max_tokens=64)
    if not runtime.ext.amx_available():
        with pytest.raises(ValueError, match="AMX tiles"):
            make()
        return
    kernel = make()
    for T in (3, 40):
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        gate_up8 = torch.cat([rows[0].dequantized(), rows[1].dequantized()], dim=1)
        want = moe_reference(x, ids, w, gate_up8, rows[2].dequantized(), round_activations_rows, round_activations_rows)
        assert rel_err(kernel.forward(x, ids, w), want) < 1e-3, T


def test_int4_rows_layout_round_trip():
    """Int4Rows packs weights that lie on its grid exactly (dequantized() reads the packed tiles
    back, so this checks the layout the kernels read), and quantizes Gaussian weights to ~10%."""
    from ktransformers.kernels.cpu import Int4Rows
    gen = torch.Generator().manual_seed(5)
    E, rows, cols, group = 3, 48, 384, 128
    codes = torch.randint(-8, 8, (E, rows, cols // group, group), generator=gen).float()
    codes[..., 0] = -8  # each group's largest magnitude at -8: its step is exactly what was used
    steps = torch.rand(E, rows, cols // group, 1, generator=gen) + 0.5
    exact = (codes * steps).reshape(E, rows, cols)
    packed = Int4Rows.from_dense(exact, group)
    assert torch.equal(packed.dequantized(), exact)
    want_corr = 128 * (steps[..., 0] * codes.sum(dim=3)).sum(dim=2)
    assert torch.allclose(packed.corr, want_corr, rtol=1e-5)
    w = torch.randn(E, rows, cols, generator=gen)
    for g in (64, 128, 384):
        assert 0.05 < rel_err(Int4Rows.from_dense(w, g).dequantized(), w) < 0.11, g
    with pytest.raises(ValueError, match="multiple of 64 dividing 384"):
        Int4Rows.from_dense(w, 96)
    with pytest.raises(ValueError, match="rows % 16"):
        Int4Rows.from_dense(w[:, :40], 128)


@pytest.mark.parametrize("H, I, group", [(256, 384, 128), (576, 320, 64), (512, 256, 256)],
                         ids=["g128", "g64-odd-row-chunks", "g256"])
def test_int4_prefill_path(runtime, H, I, group):
    """Experts with enough tokens use the int4 copies (groups of `group` columns, per-row activation
    scales): against the MoE formula on the copies' own dequantized weights with activations
    rounded as the kernel rounds them (tight), and on the original weights (int4's own error).
    Token counts cover the 8/4/2/1-token VNNI steps and, on AMX, one and two 16-token tiles;
    320 rows split over tasks leave chunks that start and end inside 16-row blocks."""
    if not runtime.ext.int4_gemm:
        pytest.skip(f"{runtime.isa} build has no int4 GEMM (needs AVX512-VNNI)")
    from ktransformers.kernels.cpu import Int4Rows, round_activations_rows
    E, K = 6, 2
    gen = torch.Generator().manual_seed(group + I)
    (g, gd), (u, ud), (d, dd) = (expert_weights(GGMLType.Q8_0, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    int4 = tuple(Int4Rows.from_dense(w, group) for w in (gd, ud, dd))
    from_bytes = Int4Rows.from_blocks(g, (E, I, H), group)  # what KExpertsCPU builds from the mapped blocks
    assert torch.equal(from_bytes.q, int4[0].q) and torch.equal(from_bytes.scale, int4[0].scale)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                       int4=int4, int8_min_tokens=1, max_tokens=64)
    assert kernel.int8_min_tokens == 1
    gate_up4 = torch.cat([int4[0].dequantized(), int4[1].dequantized()], dim=1)
    for T in (1, 7, 64, 45, 60):
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        if T in (45, 60):  # every token to experts 0 and 1: 45 or 60 tokens an expert (AMX: 32 + 13, 32 + 28)
            ids = torch.stack([torch.randperm(2, generator=gen) for _ in range(T)])
        y = kernel.forward(x, ids, w)
        same = moe_reference(x, ids, w, gate_up4, int4[2].dequantized(), round_activations_rows, round_activations_rows)
        assert rel_err(y, same) < 1e-3, T
        assert rel_err(y, moe_reference(x, ids, w, torch.cat([gd, ud], dim=1), dd)) < 0.25, T
    with pytest.raises(ValueError, match="alternatives"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, int4=int4,
                  int8=tuple(Int8Rows.from_dense(w) for w in (gd, ud, dd)))
    alone = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=None, up=None, down=None,
                      int4=int4, max_tokens=64)  # int4_decode: the copies are the only weights, every call
    assert alone.copies_only and alone.int8_min_tokens == 1
    for T in (1, 2, 9):  # decode-sized calls (one parallel region) and a prefill-sized one
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, K, gen)
        same = moe_reference(x, ids, w, gate_up4, int4[2].dequantized(), round_activations_rows, round_activations_rows)
        assert rel_err(alone.forward(x, ids, w), same) < 1e-3, T
    with pytest.raises(ValueError, match="all of gate, up and down"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=None, down=None, int4=int4)
    with pytest.raises(ValueError, match="no weights"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=None, up=None, down=None)
    with pytest.raises(ValueError, match="int4 scale"):
        MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                  int4=(int4[0], int4[1], Int4Rows(int4[2].q, int4[2].scale[:, :1], int4[2].corr, group)))


@pytest.mark.parametrize("shape", [(1, 64), (3, 2048), (2, 5, 100)])
def test_rms_norm_rows(runtime, shape):
    from ktransformers.kernels.cpu import rms_norm
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    want = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
    got = rms_norm(runtime.ext, x, w, 1e-6)
    assert got.shape == want.shape and ((got - want).norm() / want.norm()).item() < 1e-6
    with pytest.raises(ValueError, match="float32"):
        rms_norm(runtime.ext, x.bfloat16(), w, 1e-6)


@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (3, 60, 4), (17, 128, 8), (2, 256, 8), (4, 7, 7), (1, 32, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_routing(runtime, T, E, k, renorm):
    """The C++ router epilogue against torch's softmax, topk and renormalization (gate.route_softmax):
    the same experts in the same order, weights within float rounding; a tie goes to the lower
    index; a NaN logit and k outside 1..E are errors naming them."""
    from ktransformers.kernels.cpu import softmax_topk
    from ktransformers.operators.gate import route_softmax
    logits = torch.randn(T, E) * 3
    weights, ids = softmax_topk(runtime.ext, logits, k, renorm)
    want_w, want_ids = route_softmax(logits, top_k=k, norm=renorm)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w, rtol=1e-5, atol=1e-7)
    if renorm:
        assert torch.allclose(weights.sum(-1), torch.ones(T), atol=1e-6)
    tied = logits.clone()
    tied[0, E - 1] = tied[0, 0] = tied[0].max() + 1  # (the largest, twice)
    assert softmax_topk(runtime.ext, tied, k, renorm)[1][0, 0].item() == 0
    tied[T - 1, E // 2] = float("nan")
    with pytest.raises(ValueError, match=f"row {T - 1} has a NaN logit \\(column {E // 2}\\)"):
        softmax_topk(runtime.ext, tied, k, renorm)
    with pytest.raises(ValueError, match="k must be in"):
        softmax_topk(runtime.ext, logits, E + 1, renorm)


@pytest.mark.parametrize("heads, kv_heads, d, L", [(4, 4, 64, 1), (8, 2, 128, 37), (32, 4, 128, 300), (6, 3, 24, 9),
                                                  (28, 4, 128, 129), (16, 16, 64, 64), (12, 2, 192, 200),
                                                  (16, 2, 128, 77), (64, 4, 64, 13), (8, 1, 96, 64),
                                                  (24, 2, 128, 150), (8, 2, 64, 70), (96, 8, 128, 33),
                                                  (8, 2, 80, 45)])
def test_gqa_decode_attention_from_the_paged_cache(runtime, heads, kv_heads, d, L):
    """Every head-grouping path: head tiles (g a multiple of 4, d of 32 at AVX-512 and of 16 at
    AVX2 (d = 96 and 80 tiled at AVX2 alone): 8-head score tiles for 32/4, 16/2, 64/4, 8/1, an 8-
    and a 4-head tile for GLM-4.5-Air's g = 12 in 24/2 and 96/8, 4-head tiles for 8/2), 8-head dot
    products, single heads; chunk counts 1 to 5, partial chunks and tiles."""
    from ktransformers.kernels.cpu import attend_gqa_decode
    total = L + 50
    k, v = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    slots = torch.randperm(total)[:L]  # a history scattered over the pages
    q = torch.randn(heads, d)
    scale = d ** -0.5
    g = heads // kv_heads
    keys, values = k[slots].repeat_interleave(g, dim=1), v[slots].repeat_interleave(g, dim=1)  # [L, heads, d]
    p = torch.softmax(torch.einsum("hd,lhd->hl", q, keys) * scale, dim=-1)
    want = torch.einsum("hl,lhd->hd", p, values)
    got = attend_gqa_decode(runtime, q, k, v, slots, scale)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="outside"):
        attend_gqa_decode(runtime, q, k, v, torch.tensor([0, total]), scale)
    # gpt-oss's sinks: one more logit per head in the softmax, with no value
    sinks = torch.randn(heads) * 2
    logits = torch.cat([torch.einsum("hd,lhd->hl", q, keys) * scale, sinks[:, None]], dim=-1)
    want = torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1)[:, :-1], values)
    got = attend_gqa_decode(runtime, q, k, v, slots, scale, sinks)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="sinks must be"):
        attend_gqa_decode(runtime, q, k, v, slots, scale, sinks[:-1])


@pytest.mark.parametrize("heads, kv_heads, d, L", [(4, 4, 64, 1), (8, 2, 128, 19), (6, 3, 24, 40)])
def test_rope_write_attend_gqa(runtime, heads, kv_heads, d, L):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from ktransformers.kernels.cpu import attend_gqa_decode, rope_write_attend_gqa
    total = L + 20
    k_cache, v_cache = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    slots = torch.randperm(total)[:L]
    q, k, v = torch.randn(heads, d), torch.randn(kv_heads, d), torch.randn(kv_heads, d)
    angle = torch.rand(d // 2) * 10
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
    q_rot, k_rot = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=1)  # HF's RoPE
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[slots[-1]], want_v[slots[-1]] = k_rot[0], v
    want = attend_gqa_decode(runtime, q_rot[0], want_k, want_v, slots, d ** -0.5)
    got = rope_write_attend_gqa(runtime, q, k, v, cos, sin, k_cache, v_cache, int(slots[-1]), slots, d ** -0.5)
    assert torch.allclose(k_cache, want_k, atol=1e-6) and torch.equal(v_cache, want_v)  # the step's entries stored
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="outside"):
        rope_write_attend_gqa(runtime, q, k, v, cos, sin, k_cache, v_cache, total, slots, d ** -0.5)
    # partial rotary (GLM-4.5, MiniMax-M2): the first r values of each head rotated, the rest as they are
    from ktransformers.operators.attention import rotate_qk
    r = d // 2 if d // 2 % 2 == 0 else d - 2
    angle = torch.rand(r // 2) * 10
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
    q_rot, k_rot = rotate_qk(q[None, None], k[None, None], cos[None, None], sin[None, None])  # the torch reference
    want_k[slots[-1]] = k_rot[0, 0]
    want = attend_gqa_decode(runtime, q_rot[0, 0], want_k, want_v, slots, d ** -0.5)
    got = rope_write_attend_gqa(runtime, q, k, v, cos, sin, k_cache, v_cache, int(slots[-1]), slots, d ** -0.5)
    assert torch.allclose(k_cache, want_k, atol=1e-6) and ((got - want).norm() / want.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="r even"):
        rope_write_attend_gqa(runtime, q, k, v, cos[:-1], sin[:-1], k_cache, v_cache, int(slots[-1]), slots, 1.0)


def test_runtime_copy_moves_every_byte():
    """CPURuntime.copy (the pool's memcpy, mapped file -> pinned staging) at sizes around its
    2 MiB task size; a size mismatch raises before anything is copied."""
    runtime = CPURuntime(2)
    g = torch.Generator().manual_seed(3)
    for n in (1, 4095, 2 << 20, (5 << 20) + 17):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        dst = torch.zeros(n, dtype=torch.uint8)
        runtime.copy(dst, src.numpy())
        assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="copy: 5 source bytes into a 4-byte destination"):
        runtime.copy(torch.zeros(4, dtype=torch.uint8), np.zeros(5, dtype=np.uint8))


def test_sizes_that_overflow_are_refused(runtime):
    """Dimensions whose byte counts wrap 64 bits are refused before any memory is read (an
    unchecked 4·H·I·E once wrapped to 0 and matched empty weights, and the forward read unmapped
    memory); so are a NaN eps, an empty row and zero kv heads."""
    empty = ExpertWeights(np.zeros(0, dtype=np.uint8), int(GGMLType.F32))
    with pytest.raises(ValueError, match="overflows 64 bits"):
        MoEKernel(runtime, experts=2**20, top_k=2, hidden=2**21, intermediate=2**21, gate=empty, up=empty, down=empty,
                  max_tokens=1, tiles=False)
    with pytest.raises(ValueError, match="expected 4611686018427387904"):  # (2^62: int dimensions stay below 2^64)
        LinearKernel(runtime, in_features=2**30, out_features=2**30,
                     weight=ExpertWeights(np.zeros(0, dtype=np.uint8), int(GGMLType.F32)), max_tokens=1)
    from ktransformers.kernels.cpu import rms_norm
    x, w = torch.randn(2, 8), torch.ones(8)
    for eps in (float("nan"), float("inf"), -1e-6):
        with pytest.raises(ValueError, match="eps must be finite"):
            rms_norm(runtime.ext, x, w, eps)
    with pytest.raises(ValueError, match="n > 0"):
        rms_norm(runtime.ext, torch.randn(2, 0), torch.ones(0), 1e-6)
    from ktransformers.kernels.cpu import attend_gqa_decode
    cache = torch.randn(4, 0, 8)
    with pytest.raises(ValueError, match="positive multiple of kv_heads"):
        attend_gqa_decode(runtime, torch.randn(2, 8), cache, cache, torch.tensor([0, 1]), 0.1)


@pytest.mark.parametrize("fmt", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.IQ4_XS,
                                 GGMLType.BF16], ids=lambda t: t.name)
def test_nan_activations_propagate(runtime, fmt):
    """A NaN in a token's activations makes that token's output NaN, as in the reference (the int8
    rounding of activations once dropped it: its block's scale came from a max that skips NaNs);
    the other tokens' outputs stay finite, and an infinity gives no finite garbage either."""
    gen = torch.Generator().manual_seed(31)
    E, K, H, I = 4, 2, 512, 256
    (g, _), (u, _), (d, _) = (expert_weights(fmt, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    kernels = [MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=8)]
    if fmt != GGMLType.BF16:
        copies = tuple(Int8Rows.from_blocks(w, s) for w, s in zip((g, u, d), ((E, I, H), (E, I, H), (E, H, I))))
        kernels.append(MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=g, up=u, down=d,
                                 max_tokens=8, int8=copies, int8_min_tokens=1))
    lin = LinearKernel(runtime, in_features=H, out_features=I, weight=ExpertWeights(g.data[: g.data.numel() // E], int(fmt)),
                       max_tokens=8)
    x = torch.randn(6, H, generator=gen)
    x[1, 77], x[4, 300] = float("nan"), float("inf")
    ids, w = routing(6, E, K, gen)
    for kernel in kernels:
        y = kernel.forward(x, ids, w)
        assert y[1].isnan().all() and not y[4].isfinite().any() and y[[0, 2, 3, 5]].isfinite().all()
    y = lin.forward(x)
    assert y[1].isnan().all() and not y[4].isfinite().any() and y[[0, 2, 3, 5]].isfinite().all()


def test_weight_buffers_on_huge_page_bounds(runtime):
    """Buffers of 2 MiB and more start on a 2 MiB boundary (the huge-page advice covers them
    whole), take writes of their dtype, and tiles repacked into one equal the torch reference's
    and compute as the rows do; smaller buffers are plain tensors."""
    from ktransformers.kernels.cpu import HUGE_PAGE, tile_weights, weight_empty
    small = weight_empty((3, 5), torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    big = weight_empty((4, HUGE_PAGE // 8), torch.int16)
    assert big.shape == (4, HUGE_PAGE // 8) and big.data_ptr() % HUGE_PAGE == 0 and big.is_contiguous()
    values = torch.randint(-30000, 30000, big.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(3))
    big.copy_(values)
    assert torch.equal(big, values)
    t = GGMLType.Q4_K
    assert runtime.ext.has_tiles(int(t)), runtime.isa  # (every level tiles Q4_K: test_tiles_layout_and_kernel)
    gen = torch.Generator().manual_seed(41)
    E, H, I = 8, 1024, 1024  # 4.7 MB of Q4_K a projection: a huge-page buffer
    (g, _), (u, _), (d, _) = (expert_weights(t, E, r, c, gen) for r, c in ((I, H), (I, H), (H, I)))
    tiled = tile_weights(runtime, g, E * I, H)
    assert tiled.data.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(tiled.data, TILE_REFERENCES[t](g.data, E * I, H))
    with_tiles = MoEKernel(runtime, experts=E, top_k=2, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=8)
    rows = MoEKernel(runtime, experts=E, top_k=2, hidden=H, intermediate=I, gate=g, up=u, down=d, max_tokens=8, tiles=False)
    tol = 1e-3 if runtime.isa in ("avx2", "avxvnni") else 1e-6
    for T in (1, 3):
        x = torch.randn(T, H, generator=gen)
        ids, w = routing(T, E, 2, gen)
        assert rel_err(with_tiles.forward(x, ids, w), rows.forward(x, ids, w)) < tol, T


def test_tiles_are_told_apart_by_a_tag(runtime):
    """Tiles and rows of a type have the same size: only a buffer tile_weights made is taken as
    tiles (bytes claimed tiled are refused), and only for the shape it was tiled for."""
    from ktransformers.kernels.cpu import tile_weights
    t = GGMLType.Q4_K
    if not runtime.ext.has_tiles(int(t)):
        pytest.skip(f"the {runtime.isa} build has no {t.name} tiles")
    gen = torch.Generator().manual_seed(37)
    w, _ = expert_weights(t, 2, 64, 512, gen)
    with pytest.raises(ValueError, match="not tiles tile_weights made"):
        ExpertWeights(w.data, int(t), tiled=True)
    tiled = tile_weights(runtime, w, 128, 512)
    assert tiled.tiled and ExpertWeights(tiled.data, int(t), tiled=True).tiled  # (its own buffer: accepted)
    with pytest.raises(ValueError, match="not tiles tile_weights made"):
        ExpertWeights(tiled.data, int(GGMLType.Q5_K), tiled=True)
    with pytest.raises(ValueError, match="made for 128 x 512 values, not 256 x 256"):
        LinearKernel(runtime, in_features=256, out_features=256, weight=tiled)
    with pytest.raises(ValueError, match="made for 128 x 512 values"):
        MoEKernel(runtime, experts=4, top_k=2, hidden=512, intermediate=32, gate=tiled, up=tiled, down=tiled)
    LinearKernel(runtime, in_features=512, out_features=128, weight=tiled)  # the shape it was tiled for


def _fake_sysfs(root, cores):
    """cores: (siblings, capacity or None, max kHz or None) per physical core."""
    for siblings, capacity, khz in cores:
        for cpu in siblings:
            d = root / f"cpu{cpu}"
            (d / "topology").mkdir(parents=True)
            (d / "topology" / "thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
            if capacity is not None:
                (d / "cpu_capacity").write_text(f"{capacity}\n")
            if khz is not None:
                (d / "cpufreq").mkdir()
                (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{khz}\n")


def test_pin_order_puts_a_thread_on_each_fast_core_first(tmp_path):
    """A hybrid CPU (two P-cores with two threads each, four E-cores): the pool's threads go to the
    P-cores' first threads, then the E-cores, then the P-cores' second threads; capacity, where
    Linux gives it, outranks the clock; with no sysfs, the allowed CPUs as they are."""
    from ktransformers.kernels.cpu import pin_order
    hybrid = tmp_path / "hybrid"
    _fake_sysfs(hybrid, [((0, 1), None, 5_000_000), ((2, 3), None, 5_000_000)]
                + [((c,), None, 3_800_000) for c in (4, 5, 6, 7)])
    assert pin_order(list(range(8)), hybrid) == [0, 2, 4, 5, 6, 7, 1, 3]
    assert pin_order([1, 3, 5, 6], hybrid) == [1, 3, 5, 6]  # (an affinity mask: only what is allowed)
    by_capacity = tmp_path / "capacity"
    _fake_sysfs(by_capacity, [((0, 4), 600, 5_000_000), ((1, 5), 1024, 4_000_000), ((2,), 600, 6_000_000)])
    assert pin_order([0, 1, 2, 4, 5], by_capacity) == [1, 2, 0, 5, 4]
    assert pin_order([3, 1, 2], tmp_path / "absent") == [1, 2, 3]
    runtime = CPURuntime(2)
    assert runtime.cpus and set(runtime.cpus) <= os.sched_getaffinity(0) and not CPURuntime(2, pin=False).cpus


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grammar_masks_on_cpu_logits(runtime, dtype):
    """mask_logits (a grammar's packed bitmask applied to a step's CPU logits) against torch: the
    rows named get -inf exactly where their bit is 0 (bit t % 32 of word t // 32), other values
    and rows untouched, over a vocabulary not a multiple of 32; bad rows and narrow masks refused."""
    gen = torch.Generator().manual_seed(3)
    B, V = 5, 1000
    words = torch.randint(-2**31, 2**31 - 1, (3, -(-V // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    words[1, :4] = -1  # (whole words allowed)
    rows = [4, 0, 2]
    logits = torch.randn(B, V, generator=gen).to(dtype)
    before = logits.clone()
    ext = runtime.ext
    index = torch.tensor(rows)
    ext.mask_logits(logits.data_ptr(), dtype == torch.bfloat16, B, V, V, index.data_ptr(), len(rows), words.data_ptr(),
                    words.shape[1])
    bits = ((words.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1).reshape(3, -1)[:, :V].bool()
    want = before.clone()
    for j, i in enumerate(rows):
        want[i] = before[i].masked_fill(~bits[j], float("-inf"))
    assert torch.equal(logits, want) and (~bits).any() and bits.any()
    with pytest.raises(ValueError, match="row 5 is outside"):
        bad = torch.tensor([1, 5])
        ext.mask_logits(logits.data_ptr(), dtype == torch.bfloat16, B, V, V, bad.data_ptr(), 2, words.data_ptr(),
                        words.shape[1])
    with pytest.raises(ValueError, match="covers fewer"):
        ext.mask_logits(logits.data_ptr(), dtype == torch.bfloat16, B, V, V, index.data_ptr(), 3, words.data_ptr(), 31)
