"""The routed experts' backward (csrc/moe_grad.cpp, for training with frozen experts) against
torch autograd through the plain-torch MoE formula on the weights the `gguf` package decodes:
dx and the routing weights' dw, at every ISA level this CPU runs, for every format the experts
are stored in, at several token counts (across the kernel's max_tokens chunks), with empty
slots (-1), biases and gpt-oss's clamped SwiGLU. The C++ block decoders it reads the weights
through are checked against the gguf package bit for bit."""
import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, MoEKernel, dequantize_cpu, supported_isas
from ktransformers.operators.experts.reference import Activation, moe_reference
from ktransformers.weights.ggml_quants import GGMLType, quantize, random_blocks

# ggml type ids: F32, F16, BF16, Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4
TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "IQ4_XS": 23, "MXFP4": 39}
BLOCK = {0: 1, 1: 1, 30: 1, 2: 32, 8: 32, 39: 32}  # else 256


@pytest.fixture(scope="module", params=supported_isas())
def runtime(request):
    return CPURuntime(threads=2, isa=request.param)


def blocks_of(t: int, values: int, gen: torch.Generator) -> torch.Tensor:
    n = values // BLOCK.get(t, 256)
    return random_blocks(t, n, gen).reshape(-1).contiguous()


def gguf_values(raw: torch.Tensor, t: int, shape) -> torch.Tensor:
    out = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType(t))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


@pytest.mark.parametrize("name", list(TYPES))
def test_decoders_equal_the_gguf_package(runtime, name):
    t = TYPES[name]
    raw = blocks_of(t, 4 * 512, torch.Generator().manual_seed(t))
    got = dequantize_cpu(runtime, raw, t, raw.numel() and 4 * 512)
    assert torch.equal(got, gguf_values(raw, t, (-1,)))
    with pytest.raises(ValueError, match="bytes hold fewer"):
        dequantize_cpu(runtime, raw[:-1], t, 4 * 512)


def experts(types, E, H, I, seed, trained_like=False):
    """(kernel weights, dense gate_up [E, 2I, H], down [E, H, I]) of random blocks per projection,
    or, `trained_like`, of random normal weights quantized (block scales as even as a trained
    model's, not the random blocks' tenfold spread)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I))
    if trained_like:
        raws = [quantize(0.02 * torch.randn(E * rows, cols, generator=gen), GGMLType(t)).reshape(-1).contiguous()
                for t, (rows, cols) in zip(types, shapes)]
    else:
        raws = [blocks_of(t, E * rows * cols, gen) for t, (rows, cols) in zip(types, shapes)]
    gate, up = (gguf_values(r, t, (E, I, H)) for r, t in zip(raws[:2], types[:2]))
    down = gguf_values(raws[2], types[2], (E, H, I))
    return [ExpertWeights(r, t) for r, t in zip(raws, types)], torch.cat([gate, up], dim=1), down


def routing(T, K, E, gen, empty=False):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if empty:  # some slots computed elsewhere (hot experts on a GPU): -1
        ids[torch.rand(T, K, generator=gen) < 0.25] = -1
    w = torch.rand(T, K, generator=gen)
    return ids, w


def torch_grads(x, ids, w, gate_up, down, dy, act, bias):
    """dx, dw by autograd through moe_reference (a -1 slot contributes nothing)."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    keep = ids >= 0
    safe_ids = ids.clamp(min=0)
    y = moe_reference(x, safe_ids, w * keep, gate_up, down, act=act, bias=bias)
    y.backward(dy)
    return x.grad, w.grad * keep


CASES = [  # (gate, up, down types), E, K, H, I, T, max_tokens
    (("Q4_K", "Q4_K", "Q6_K"), 8, 2, 256, 512, 5, 512),
    (("Q8_0", "Q8_0", "Q8_0"), 6, 3, 288, 160, 37, 16),
    (("Q5_K", "Q5_K", "Q4_K"), 4, 2, 512, 256, 1, 512),
    (("IQ4_XS", "IQ4_XS", "Q2_K"), 5, 2, 256, 256, 19, 8),
    (("Q3_K", "Q4_0", "Q8_0"), 4, 2, 256, 256, 9, 512),
    (("BF16", "BF16", "F16"), 4, 2, 96, 64, 11, 4),
    (("F32", "F32", "F32"), 3, 1, 64, 32, 3, 512),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c[0]) + f"-T{c[5]}")
def test_backward_matches_autograd(runtime, case):
    types, E, K, H, I, T, max_tokens = case
    types = tuple(TYPES[n] for n in types)
    gen = torch.Generator().manual_seed(E * 100 + T)
    weights, gate_up, down = experts(types, E, H, I, seed=T)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], max_tokens=max_tokens, name="grad-test")
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen, empty=T > 8)
    dx, dw = kernel.backward(x, ids, w, dy)
    want_dx, want_dw = torch_grads(x, ids, w, gate_up, down, dy, Activation(), None)
    scale_x, scale_w = want_dx.abs().max(), want_dw.abs().max()
    assert scale_x > 0 and scale_w > 0
    assert (dx - want_dx).abs().max() <= 1e-4 * scale_x, runtime.isa
    assert (dw - want_dw).abs().max() <= 1e-4 * scale_w


@pytest.mark.parametrize("T", [1, 13])
def test_backward_with_biases_and_the_clamped_swiglu(runtime, T):
    """gpt-oss's experts: MXFP4, biases on all three projections, the clamped SwiGLU (limit 7);
    inputs large enough that some g and u fall beyond the limit."""
    E, K, H, I = 4, 2, 128, 64
    gen = torch.Generator().manual_seed(T)
    weights, gate_up, down = experts((39, 39, 39), E, H, I, seed=3)
    bias = (torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen))
    act = Activation(7.0, 1.702)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], name="grad-test", biases=(*bias[0].chunk(2, dim=1), bias[1]),
                       swiglu_limit=7.0, swiglu_alpha=1.702)
    x, dy = 40 * torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen)
    g = torch.einsum("th,eih->tei", x, gate_up[:, :I]) + bias[0][:, :I]
    assert (g > 7).any() and (g.abs() < 7).any()  # (both sides of the clamp are exercised)
    dx, dw = kernel.backward(x, ids, w, dy)
    want_dx, want_dw = torch_grads(x, ids, w, gate_up, down, dy, act, bias)
    assert (dx - want_dx).abs().max() <= 1e-4 * want_dx.abs().max()
    assert (dw - want_dw).abs().max() <= 1e-4 * want_dw.abs().max()


def test_backward_reads_tiled_kernels_stored_rows(runtime):
    """A kernel that tiled its weights for the forward still backs up on the stored rows."""
    E, K, H, I, T = 4, 2, 256, 256, 6
    weights, gate_up, down = experts((12, 12, 14), E, H, I, seed=9)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], tiles=True, name="grad-test")
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen)
    dx, _ = kernel.backward(x, ids, w, dy)
    want_dx, _ = torch_grads(x, ids, w, gate_up, down, dy, Activation(), None)
    assert (dx - want_dx).abs().max() <= 1e-4 * want_dx.abs().max()


def test_backward_bad_inputs_are_value_errors(runtime):
    E, K, H, I = 4, 2, 64, 32
    weights, _, _ = experts((0, 0, 0), E, H, I, seed=1)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], name="grad-test")
    x, ids, w = torch.randn(3, H), torch.tensor([[0, 1], [2, 4], [3, -1]]), torch.rand(3, K)
    with pytest.raises(ValueError, match=r"expert id 4 at \[1, 1\]"):
        kernel.backward(x, ids, w, torch.randn(3, H))
    with pytest.raises(ValueError, match="dy must be"):
        kernel.backward(x, ids.clamp(max=3), w, torch.randn(2, H))
    short = ExpertWeights(weights[2].data[:-4], 0)
    bad = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                    down=weights[2], name="grad-test")
    bad._stored = (weights[0], weights[1], short)
    with pytest.raises(ValueError, match="down holds"):
        bad.backward(x, ids.clamp(max=3), w, torch.randn(3, H))


@pytest.mark.parametrize("types, bias, int8", [((0, 0, 0), False, False), ((12, 12, 14), False, False),
                                               ((39, 39, 39), True, False), ((12, 12, 14), False, True)],
                         ids=["F32", "Q4_K", "MXFP4-biases", "Q4_K-int8"])
def test_backward_takes_the_forwards_gate_and_up(runtime, types, bias, int8):
    """forward_keeping hands each pair's g and u (biases added, before the activation) to the
    backward, which then does not recompute them: they equal torch's (zeros for -1 slots, across
    max_tokens chunks), the forward's output is forward's, and the gradients equal autograd's (F32
    weights: to 1e-4; quantized ones: within the forward's int8/Q8 activation rounding). The
    backward reads them: other values change its result."""
    E, K, H, I, T = 4, 2, 256, 256, 21
    gen = torch.Generator().manual_seed(7 + types[0])
    weights, gate_up, down = experts(types, E, H, I, seed=5, trained_like=types[0] == 12)
    biases = (torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)) if bias else None
    act = Activation(7.0, 1.702) if bias else Activation()
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], max_tokens=8, name="grad-test", swiglu_limit=act.limit,
                       biases=(*biases[0].chunk(2, dim=1), biases[1]) if bias else None,
                       swiglu_alpha=act.alpha if bias else 1.702)
    kernel.int8_backward = int8
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen, empty=True)
    y, kept = kernel.forward_keeping(x, ids, w)
    assert torch.equal(y, kernel.forward(x, ids, w))
    want = torch.einsum("th,tkih->tki", x, gate_up[ids.clamp(min=0)])
    if bias:
        want = want + biases[0][ids.clamp(min=0)]
    want = torch.where((ids >= 0)[..., None], want, 0.0).reshape(T * K, 2 * I)
    exact = types[0] == 0
    assert ((kept - want).norm() / want.norm()).item() < (1e-5 if exact else 2e-2)
    assert torch.equal(kept[(ids < 0).reshape(-1)], torch.zeros_like(kept[(ids < 0).reshape(-1)]))
    dx, dw = kernel.backward(x, ids, w, dy, kept)
    want_dx, want_dw = torch_grads(x, ids, w, gate_up, down, dy, act, biases)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    limit = 4e-2 if int8 else 1e-4 if exact else 2e-2
    assert rel(dx, want_dx) < limit and rel(dw, want_dw) < limit
    other, _ = kernel.backward(x, ids, w, dy, kept * 1.5)
    assert rel(other, dx) > 1e-2
    with pytest.raises(ValueError, match="gate_up must be float32"):
        kernel.backward(x, ids, w, dy, kept[1:])


INT8_CASES = [((12, 12, 14), 8, 2, 256, 512, 37), ((8, 8, 8), 6, 3, 128, 64, 5), ((39, 39, 39), 4, 2, 128, 64, 70)]


@pytest.mark.parametrize("prefill_copies", [False, True], ids=["blocks", "int8-prefill"])
@pytest.mark.parametrize("case", INT8_CASES, ids=lambda c: f"types{c[0][0]}-T{c[5]}")
def test_int8_backward_matches_autograd(runtime, case, prefill_copies):
    """int8_backward: the products on int8 copies (the transposed ones made from the stored blocks),
    activations rounded to int8 per row: within int8's rounding of autograd's result. g and u
    recomputed (no forward's handed over) from the stored blocks, or, where the forward has int8
    copies of gate and up, on those."""
    from ktransformers.kernels.cpu import Int8Rows
    types, E, K, H, I, T = case
    weights, gate_up, down = experts(types, E, H, I, seed=T, trained_like=True)
    int8 = None
    if prefill_copies:
        int8 = tuple(Int8Rows.from_blocks(w, s) for w, s in zip(weights, ((E, I, H), (E, I, H), (E, H, I))))
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], max_tokens=32, name="grad-test", int8=int8)
    kernel.int8_backward = True
    gen = torch.Generator().manual_seed(T)
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen, empty=T > 8)
    dx, dw = kernel.backward(x, ids, w, dy)
    assert kernel._grad.int8
    assert [rows is not None for rows, _ in kernel._grad_int8] == [prefill_copies] * 2 + [True] * 3
    want_dx, want_dw = torch_grads(x, ids, w, gate_up, down, dy, Activation(), None)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # (each product rounds both sides to int8 per row, ~0.7% an element, and dx is two products
    # deep: 2-2.5% measured, where a wrong transpose or scale gives ~100%)
    assert rel(dx, want_dx) < 4e-2 and rel(dw, want_dw) < 4e-2


def test_int8_backward_falls_back_where_its_gemm_cannot_run(runtime):
    """Sizes the int8 GEMM does not take (intermediate 32): a warning, and the exact backward."""
    E, K, H, I, T = 4, 2, 64, 32, 5
    weights, gate_up, down = experts((8, 8, 8), E, H, I, seed=2)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], name="grad-test")
    kernel.int8_backward = True
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    ids, w = routing(T, K, E, gen)
    with pytest.warns(UserWarning, match="int8 backward is off"):
        dx, _ = kernel.backward(x, ids, w, dy)
    assert not kernel._grad.int8
    want_dx, _ = torch_grads(x, ids, w, gate_up, down, dy, Activation(), None)
    assert (dx - want_dx).abs().max() <= 1e-4 * want_dx.abs().max()


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "MXFP4", "BF16"])
def test_int8_copies_equal_torch(runtime, name, transpose):
    """The backward's int8 copies (C++: decode, transpose, per-row int8) against torch on the
    gguf package's values: the same scales, and the same codes but for ties rounded apart."""
    from ktransformers.kernels.cpu import _int8_copy
    t, E, rows, cols = TYPES[name], 3, 64, 256
    raw = blocks_of(t, E * rows * cols, torch.Generator().manual_seed(t + transpose))
    got = _int8_copy(runtime, ExpertWeights(raw, t), (E, rows, cols), transpose)
    dense = gguf_values(raw, t, (E, rows, cols))
    dense = dense.transpose(1, 2) if transpose else dense
    scale = dense.abs().amax(dim=2) / 127
    codes = torch.round(dense / scale[..., None])
    assert torch.allclose(got.scale, scale, rtol=1e-6)
    diff = (got.w.float() - codes).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert torch.equal(got.row_sum, got.w.sum(dim=2, dtype=torch.int32))


def pair_products(kernel, ids, gate_up, down, gen):
    """(got, want): the kernel's five pair products and pair_reference's, on random inputs."""
    T, K, H, I = ids.shape[0], ids.shape[1], down.shape[1], down.shape[2]
    x = torch.randn(T, H, generator=gen)
    h, dg, du = (torch.randn(T * K, I, generator=gen) for _ in range(3))
    dout = torch.randn(T * K, H, generator=gen)
    got = (*kernel.pair_gate_up(x, ids), kernel.pair_down(h, ids), kernel.pair_down_t(dout, ids),
           kernel.pair_gate_up_t(dg, du, ids))
    return got, pair_reference(x, ids, gate_up, down, h, dout, dg, du)


def pair_reference(x, ids, gate_up, down, h, dout, dg, du):
    """The per-pair products in plain torch (zero rows for slots of id -1): G x, U x, D h, D^T dout
    per (token, slot), and per token the sum of G^T dg + U^T du."""
    T, K = ids.shape
    I = down.shape[2]
    e = ids.reshape(-1).clamp(min=0)
    keep = (ids.reshape(-1) >= 0).float()[:, None]
    xs = x.repeat_interleave(K, dim=0)
    g = torch.einsum("ph,pih->pi", xs, gate_up[e, :I]) * keep
    u = torch.einsum("ph,pih->pi", xs, gate_up[e, I:]) * keep
    o = torch.einsum("pi,phi->ph", h, down[e]) * keep
    dh = torch.einsum("ph,phi->pi", dout, down[e]) * keep
    dxp = (torch.einsum("pi,pih->ph", dg, gate_up[e, :I]) + torch.einsum("pi,pih->ph", du, gate_up[e, I:])) * keep
    return g, u, o, dh, dxp.reshape(T, K, -1).sum(1)


# CASES' K-quant, Q8_0 and 16-bit mixes, and gpt-oss's MXFP4
PAIR_CASES = [CASES[0], CASES[1], (("MXFP4", "MXFP4", "MXFP4"), 4, 2, 128, 64, 1, 512), CASES[5]]


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "-".join(c[0]) + f"-T{c[5]}")
def test_pair_products_match_torch(runtime, case):
    """MoEKernel.pair_* (what adapters on the experts build their forward and backward from): each
    product per (token, slot) pair, across max_tokens chunks and with empty slots, equals torch's
    on the gguf package's values."""
    types, E, K, H, I, T, max_tokens = case
    types = tuple(TYPES[n] for n in types)
    gen = torch.Generator().manual_seed(E * 10 + T)
    weights, gate_up, down = experts(types, E, H, I, seed=T + 1)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], max_tokens=max_tokens, name="pair-test")
    ids, _ = routing(T, K, E, gen, empty=T > 8)
    got, want = pair_products(kernel, ids, gate_up, down, gen)
    for name, a, b in zip(("g", "u", "o", "dh", "dx"), got, want):
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (name, runtime.isa)
    empty = (ids.reshape(-1) < 0).nonzero().flatten()
    assert all(t[empty].abs().max() == 0 for t in got[:4]) if len(empty) else True


@pytest.mark.parametrize("adapters", [False, True])
def test_int8_pair_products_match_torch(runtime, adapters):
    """int8_backward: the pair products on the int8 copies (D h on the forward's copy of down where
    adapters asked for it, else on the stored blocks), within int8's rounding."""
    E, K, H, I, T = 6, 3, 128, 64, 21
    weights, gate_up, down = experts((8, 8, 8), E, H, I, seed=5, trained_like=True)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], max_tokens=8, name="pair-test")
    kernel.int8_backward, kernel.adapters = True, adapters
    gen = torch.Generator().manual_seed(4)
    ids, _ = routing(T, K, E, gen, empty=True)
    got, want = pair_products(kernel, ids, gate_up, down, gen)
    assert kernel._grad.int8 and len(kernel._grad_int8) == (6 if adapters else 5)
    for name, a, b in zip(("g", "u", "o", "dh", "dx"), got, want):
        rel = ((a - b).norm() / b.norm()).item()
        # (int8 per row on both sides: ~1%; a wrong row, transpose or scale: ~100%)
        assert rel < 3e-2, (name, rel, runtime.isa)


def test_pair_products_bad_inputs_are_value_errors(runtime):
    E, K, H, I = 4, 2, 64, 32
    weights, _, _ = experts((0, 0, 0), E, H, I, seed=1)
    kernel = MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=weights[0], up=weights[1],
                       down=weights[2], name="pair-test")
    ids = torch.tensor([[0, 1], [2, 4]])
    with pytest.raises(ValueError, match=r"expert id 4 at \[1, 1\]"):
        kernel.pair_gate_up(torch.randn(2, H), ids)
    with pytest.raises(ValueError, match=r"expected an input of shape \[4, 32\]"):
        kernel.pair_down(torch.randn(4, H), ids.clamp(max=3))
    with pytest.raises(ValueError, match="top_k_index must be"):
        kernel.pair_down_t(torch.randn(4, H), torch.zeros(2, 3, dtype=torch.long))
